"""
The invariants of docs/design.md on real weights: SmolLM2-135M-Instruct (`tests/real_weights.py`), real HotpotQA
records and the model's own chat template, on CPU in fp32.

A 135M model does not know the action grammar: it writes malformed actions, so every episode plays two turns
(`max_malformed=2`), and at turn 1 its context holds its turn-0 action cut to `max_memory_chars` characters: a
rewrite, so the flattened persistent history is not the state the student sampled in. About a minute on 2 CPU cores
(with the checkpoint cached; converting it takes about 30 s more); `python -m pytest -m "not real_weights"` leaves
these tests out.
"""

import math
import warnings
from dataclasses import replace

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from memopd_trl import HotpotQAEnv, MemOPDConfig, MemOPDTrainer, PackedInvocationCollator, RolloutEngine
from memopd_trl.attention import VARLEN_SDPA, register_varlen_attention
from memopd_trl.envs.retrieval import corpus_from_records
from memopd_trl.packing import gather_actions
from memopd_trl.scoring import (
    action_log_distributions,
    action_logprobs,
    action_token_ids,
    full_logits_action_logprobs,
)


pytestmark = pytest.mark.real_weights

# Short episodes on real questions: the top passage of a search cut to 256 characters, two turns, a malformed action
# carried into the next context cut to 32 characters; contexts are about 130 tokens at turn 0 and 210 at turn 1.
ENV = dict(top_k=1, max_observation_chars=256, max_turns=2, max_malformed=2, max_memory_chars=32)
GENERATION = dict(max_new_tokens=16, max_prompt_length=256)
# With this seed the first sampled action ends in two newlines sampled one at a time, "Ċ", "Ċ", which encode as one
# token, "ĊĊ" (test (a)); a machine that samples other actions falls back to a constructed case.
ROLLOUT_SEED = 12
ROW_TOKENS = 512  # the 4 invocations of the rollout (about 750 tokens) fill two packed rows
ATOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """
    One torch thread for this module: decoding a 135M model is a long series of tiny operations, which a second thread
    only slows down when the cores are shared (this file took 7 minutes with two threads on two busy cores, 40 s with
    one). The previous setting is restored after.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def load_model(path, attn_implementation: str = "sdpa"):
    """A fresh fp32 copy of the checkpoint in eval mode."""
    return AutoModelForCausalLM.from_pretrained(
        path, attn_implementation=attn_implementation, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def tokenizer(smollm2_checkpoint):
    return AutoTokenizer.from_pretrained(smollm2_checkpoint)


@pytest.fixture(scope="module")
def student(smollm2_checkpoint):
    """The checkpoint under sdpa attention. Read-only: tests that train load their own copy."""
    return load_model(smollm2_checkpoint)


@pytest.fixture(scope="module")
def env_factory(hotpot_sample_records):
    return HotpotQAEnv.factory(corpus=corpus_from_records(hotpot_sample_records), **ENV)


@pytest.fixture(scope="module")
def rollout(student, tokenizer, env_factory, hotpot_sample_records) -> list:
    """The invocations of one sampled rollout of the real student: 1 question x 2 episodes x 2 turns (4 calls)."""
    engine = RolloutEngine(student, tokenizer, env_factory, temperature=1.0, **GENERATION)
    torch.manual_seed(ROLLOUT_SEED)
    episodes, _ = engine.rollout(hotpot_sample_records[:1], num_generations=2)
    assert [ep.num_turns for ep in episodes] == [2, 2], [ep.info for ep in episodes]
    return [inv for ep in episodes for inv in ep.invocations]


@pytest.fixture(scope="module")
def scored_alone(student, rollout) -> tuple[torch.Tensor, torch.Tensor]:
    """Each invocation of the rollout scored alone by a plain forward: action log-probs `(N,)`, distributions `(N, V)`."""
    with torch.no_grad():
        return full_logits_action_logprobs(student, rollout, return_distributions=True)


def packed(tokenizer, invocations, share_prefix: bool = False) -> dict:
    collator = PackedInvocationCollator(
        max_tokens_per_row=ROW_TOKENS, pad_token_id=tokenizer.pad_token_id, share_prefix=share_prefix
    )
    return collator(invocations)


def round_trip(tokenizer, ids: list[int]) -> list[int]:
    """The ids of `ids` decoded to text and encoded again (what a pipeline that re-tokenizes actions would score)."""
    return tokenizer(tokenizer.decode(ids), add_special_tokens=False)["input_ids"]


def split_a_token(tokenizer, ids: list[int]) -> list[int] | None:
    """`ids` with one token replaced by two vocabulary tokens that spell the same bytes and that BPE merges back."""
    vocab = tokenizer.get_vocab()
    for i, token in enumerate(tokenizer.convert_ids_to_tokens(ids)):
        for k in range(1, len(token)):
            if token[:k] in vocab and token[k:] in vocab:
                split = ids[:i] + [vocab[token[:k]], vocab[token[k:]]] + ids[i + 1 :]
                if round_trip(tokenizer, split) != split:
                    return split
    return None


def test_the_checkpoint_is_smollm2_with_its_chat_template(smollm2_checkpoint, tokenizer, student):
    # Shows what the fixture provides: a plain float32 Llama checkpoint (no GGUF quantization left in its config) whose
    # tokenizer carries SmolLM2's ChatML template and pads with the end-of-turn token, which also ends generation.
    assert student.config.model_type == "llama" and student.config.num_hidden_layers == 30
    assert "quantization_config" not in student.config.to_dict()
    assert {p.dtype for p in student.parameters()} == {torch.float32}
    assert (smollm2_checkpoint / "model.safetensors").is_file()
    messages = [{"role": "system", "content": "S <memory>m</memory>"}, {"role": "user", "content": "Q"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    rendered = "<|im_start|>system\nS <memory>m</memory><|im_end|>\n<|im_start|>user\nQ<|im_end|>\n"
    assert text == rendered + "<|im_start|>assistant\n"
    default = tokenizer.apply_chat_template([{"role": "user", "content": "Q"}], tokenize=False)
    assert default.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")  # SmolLM2's own
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>"
    assert student.generation_config.eos_token_id == tokenizer.eos_token_id


def test_recorded_ids_are_scored_not_the_re_encoded_action_text(student, tokenizer, rollout):
    # Shows invariant 1 (provenance) under a real BPE tokenizer: decoding a sampled action and encoding its text again
    # can give other ids than the model sampled, so only the recorded ids may be scored; the packed batch's action
    # tokens are exactly the recorded `output_ids`, and their packed log-probs are the generation-time ones (fp32,
    # 1e-4). The same check fails on the re-encoded ids: other tokens, other log-probs.
    changed = [(inv, round_trip(tokenizer, inv.output_ids)) for inv in rollout]
    changed = [(inv, ids) for inv, ids in changed if ids != inv.output_ids]
    if not changed:  # this machine sampled other actions: split a token of a real one, as a model may sample it
        constructed = replace(rollout[0], output_ids=split_a_token(tokenizer, rollout[0].output_ids), logprobs=None)
        with torch.no_grad():
            logprobs = full_logits_action_logprobs(student, [constructed]).tolist()
        changed = [(replace(constructed, logprobs=logprobs), round_trip(tokenizer, constructed.output_ids))]
        warnings.warn("no sampled action re-encodes to other ids here: the case is constructed", stacklevel=1)

    batch = packed(tokenizer, rollout)
    assert action_token_ids(batch).tolist() == [token for inv in rollout for token in inv.output_ids]
    with torch.no_grad():
        scores = action_logprobs(student, batch)
    generation = torch.tensor([lp for inv in rollout for lp in inv.logprobs])
    torch.testing.assert_close(scores, generation, atol=ATOL, rtol=0)

    recorded, re_encoded_ids = changed[0]
    re_encoded = packed(tokenizer, [replace(recorded, output_ids=re_encoded_ids, logprobs=None)])
    assert action_token_ids(re_encoded).tolist() != recorded.output_ids
    with torch.no_grad():
        re_scores = action_logprobs(student, re_encoded)
    sampled = torch.tensor(recorded.logprobs)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(re_scores, sampled, atol=ATOL, rtol=0)
    assert abs(re_scores.sum() - sampled.sum()) > 10 * ATOL  # the same text, another path through the model


@pytest.mark.parametrize("share_prefix", [False, True], ids=["plain", "shared-prefix"])
@pytest.mark.parametrize("attn_implementation", ["sdpa", VARLEN_SDPA])
def test_packed_scores_equal_each_invocation_scored_alone(
    attn_implementation, share_prefix, smollm2_checkpoint, tokenizer, rollout, scored_alone
):
    # Shows invariants 2-4 on real weights: the rollout's invocations packed whole into two rows (plain), or as a tree
    # sharing the question's system prompt and task (shared-prefix), give each action token the full-vocabulary
    # distribution it has when its invocation is scored alone (fp32, 1e-4), under transformers' sdpa and the project's
    # varlen attention.
    register_varlen_attention()
    model = load_model(smollm2_checkpoint, attn_implementation)
    batch = packed(tokenizer, rollout, share_prefix)
    assert batch["num_tokens_saved"] > 0 if share_prefix else batch["input_ids"].shape[0] == 2
    with torch.no_grad():
        distributions = action_log_distributions(model, batch)  # (N, vocab_size)
    torch.testing.assert_close(distributions, scored_alone[1], atol=ATOL, rtol=0)


def test_packed_rows_attending_across_invocations_score_otherwise(student, tokenizer, rollout, scored_alone):
    # Shows that the test above can fail: the same packed rows forwarded with an all-ones attention mask (transformers
    # then lets every token attend to the earlier invocations of its row) score far from each invocation alone.
    batch = packed(tokenizer, rollout)
    ids, targets = batch["input_ids"], batch["action_target_index"]
    with torch.no_grad():
        hidden = student.model(
            input_ids=ids, position_ids=batch["position_ids"], attention_mask=torch.ones_like(ids), use_cache=False
        ).last_hidden_state  # (rows, width, hidden_size)
        log_probs = student.lm_head(gather_actions(hidden[:, :-1], targets[:, 1:])).log_softmax(-1)  # (N, vocab_size)
    leaked = log_probs.gather(-1, action_token_ids(batch)[:, None]).squeeze(-1)
    assert (leaked - scored_alone[0]).abs().max() > 0.1


def lora_perturbed(path):
    """The checkpoint with a random rank-8 LoRA update of its query and value projections merged in (seeded)."""
    torch.manual_seed(0)
    config = LoraConfig(r=8, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return get_peft_model(load_model(path), config).merge_and_unload().eval()


@pytest.fixture(scope="module")
def one_update(smollm2_checkpoint, tokenizer, env_factory, hotpot_sample_records, tmp_path_factory) -> dict:
    """
    One MemOPD update (aligned teacher scoring, alignment audit on) of the real student on 1 question x 2 episodes,
    against a distinct teacher: the same checkpoint LoRA-perturbed (a mean KL to the student of about 0.2 nats per
    token). Gives the log, the names of the student's parameters and of those the update changed, and the rollout.
    """
    args = MemOPDConfig(
        output_dir=str(tmp_path_factory.mktemp("memopd")),
        use_cpu=True,
        report_to="none",
        max_steps=1,
        per_device_train_batch_size=1,
        num_generations=2,
        learning_rate=1e-5,
        max_tokens_per_row=512,
        teacher_scoring="aligned",
        misalignment_audit_steps=1,
        save_strategy="no",
        logging_steps=1,
        seed=0,
        disable_tqdm=True,
        **GENERATION,
    )
    trainer = MemOPDTrainer(
        model=str(smollm2_checkpoint),
        teacher_model=lora_perturbed(smollm2_checkpoint),
        args=args,
        train_dataset=hotpot_sample_records[:1],
        env_factory=env_factory,
        processing_class=tokenizer,
    )
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    rollouts, play = [], trainer._rollout
    trainer._rollout = lambda records: rollouts.append(play(records)) or rollouts[-1]
    trainer.train()
    changed = [name for name, p in trainer.model.named_parameters() if not torch.equal(before[name], p.detach())]
    return {"log": trainer.state.log_history, "parameters": list(before), "changed": changed, "rollout": rollouts[0]}


def test_one_memopd_update_has_finite_losses_and_changes_the_student(one_update):
    # Shows the whole step on real weights (rollout, packing, teacher scoring, student forward and backward, optimizer):
    # finite losses, a distillation loss above zero (the teacher is distinct), and a student whose weights moved.
    step = next(entry for entry in one_update["log"] if "loss" in entry)
    for name in ("loss", "loss/distill", "loss/ppo", "entropy"):
        assert math.isfinite(step[name]), (name, step[name])
    assert step["loss/distill"] > 1e-3
    assert step["skipped_updates"] == 0
    assert len(one_update["changed"]) == len(one_update["parameters"])


def test_the_alignment_audit_is_zero_at_turn_0_and_not_after_a_rewrite(one_update):
    # Shows invariant 2's other half on real weights: the teacher's distributions over the student's actions are the
    # same under aligned and persistent scoring at turn 0 (KL 0 up to 1e-5), and differ at turn 1, whose context holds
    # the turn-0 action cut to `max_memory_chars` while the flattened history holds it whole.
    audit = next(entry for entry in one_update["log"] if "misalignment/kl" in entry)
    assert abs(audit["misalignment/kl_turn_0"]) < 1e-5
    assert audit["misalignment/kl_turn_1"] > 1e-3
    episodes = one_update["rollout"].episodes
    assert [ep.num_turns for ep in episodes] == [2, 2]
    rewritten = [
        second.input_ids != first.input_ids + first.output_ids + first.observation_ids
        for first, second in (ep.invocations for ep in episodes)
    ]
    assert any(rewritten)
