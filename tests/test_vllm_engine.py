"""
`use_vllm=True` through TRL's real `VLLMGeneration` (colocated), on vLLM's CPU build and real weights
(SmolLM2-135M-Instruct): rollouts are sampled by the engine and recorded token-exact, and after an optimizer step the
engine holds the updated student.

vLLM's CPU build pins its own torch and transformers, so these tests run in an environment of their own (`.ci/run`
builds it; docs/quickstart.md shows the install). Elsewhere they are skipped.
"""

import copy
import os


os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in the training process (colocated)
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on the CPU

import pytest  # noqa: E402
import torch  # noqa: E402


vllm = pytest.importorskip(
    "vllm", reason="vLLM's CPU build is not installed here: it needs an environment of its own (docs/quickstart.md)"
)

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from memopd_trl import HotpotQAEnv, MemOPDConfig, MemOPDTrainer  # noqa: E402
from memopd_trl.envs.retrieval import corpus_from_records  # noqa: E402
from memopd_trl.scoring import action_token_ids  # noqa: E402


pytestmark = [pytest.mark.real_weights, pytest.mark.vllm]


def continuation_logprobs(model, prompt_ids: list[int], continuation_ids: list[int]) -> torch.Tensor:
    """`(len(continuation_ids),)`: a transformers model's log-prob of each continuation token after the prompt."""
    ids = torch.tensor([prompt_ids + continuation_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(continuation_ids)[:, None])[:, 0]


def engine_continuation_logprobs(llm, prompt_ids: list[int], continuation_ids: list[int]) -> torch.Tensor:
    """The same from the vLLM engine: its prompt log-probs at the continuation's positions."""
    params = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    (output,) = llm.generate([{"prompt_token_ids": prompt_ids + continuation_ids}], params, use_tqdm=False)
    positions = output.prompt_logprobs[len(prompt_ids) :]
    return torch.tensor([entry[token].logprob for entry, token in zip(positions, continuation_ids, strict=True)])


def test_use_vllm_samples_with_the_engine_and_the_engine_follows_the_updates(
    tmp_path, smollm2_checkpoint, hotpot_sample_records
):
    records = hotpot_sample_records[:2]
    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint)
    student = AutoModelForCausalLM.from_pretrained(smollm2_checkpoint, dtype=torch.float32)
    start = copy.deepcopy(student)
    # A distinct teacher (the checkpoint with seeded noise on its weights), so the distillation term moves the student.
    teacher = copy.deepcopy(student)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in teacher.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.02 * param.std())
    config = MemOPDConfig(
        output_dir=str(tmp_path), use_cpu=True, use_vllm=True, max_steps=1, per_device_train_batch_size=1,
        num_generations=2, max_new_tokens=12, max_prompt_length=512, vllm_max_model_length=640,
        learning_rate=1e-3, report_to="none", save_strategy="no", disable_tqdm=True, seed=0,
    )  # fmt: skip
    env_factory = HotpotQAEnv.factory(corpus=corpus_from_records(records), top_k=1, max_turns=2, max_malformed=2)
    trainer = MemOPDTrainer(
        model=student, teacher_model=teacher, args=config, train_dataset=records[:1], eval_dataset=records[1:],
        env_factory=env_factory, processing_class=tokenizer,
    )  # fmt: skip
    assert trainer.correct_sampling, "with vLLM the PPO loss is corrected for the engine's gap by default"
    llm = trainer.vllm_generation.llm
    env = env_factory()
    env.reset(records[0])
    prompt_ids = trainer.rollout_engine.prompt_ids(env.messages())  # the first context of the first question
    continuation_ids = tokenizer("<search>the answer</search>", add_special_tokens=False)["input_ids"]
    engine_before = engine_continuation_logprobs(llm, prompt_ids, continuation_ids)  # the checkpoint from disk

    scored = []
    score = trainer._score
    trainer._score = lambda rollout: scored.append((rollout, score(rollout))) or scored[-1][1]
    trainer.train()
    ((rollout, batch),) = scored
    # Sampled by the engine (its generate calls), recorded token-exact: the trainer scores the recorded ids, and the
    # engine's log-probs of them are the student's within the engine's dtype (its default on CPU is bfloat16).
    recorded = [token for inv in rollout.invocations for token in inv.output_ids]
    assert rollout.invocations and action_token_ids(batch.packed).tolist() == recorded
    gap = (batch.old_logprobs - batch.sampling_logprobs).abs()
    assert gap.max() < 0.5 and gap.mean() < 0.1, (gap.mean(), gap.max())

    after = continuation_logprobs(student, prompt_ids, continuation_ids)  # the updated student
    before = continuation_logprobs(start, prompt_ids, continuation_ids)
    # The engine's dtype gap: its own gap to the weights it holds at the start (it runs in bfloat16 on the CPU).
    start_gap = (engine_before - before).abs().mean().item()
    update = (after - before).abs().mean().item()
    assert update > 10 * start_gap, "the update must move the continuation for the test to mean much"
    assert (engine_before - after).abs().mean() > 10 * start_gap, "a skipped push would leave the engine here"
    trainer.evaluate()  # plays with the engine, after pushing the updated weights into it
    engine_after = engine_continuation_logprobs(llm, prompt_ids, continuation_ids)
    # The engine follows the update: it ends within a tenth of the update of the student (a skipped push ends a whole
    # update away). Its bfloat16 gap grows with the update: 0.041 nats at the start, 0.087 after an update of 2.46
    # (vLLM CPU 0.31.0, transformers 5.17.0, one seed), the same with and without repacking the tied LM head's kernel.
    assert (engine_after - after).abs().mean() < 0.1 * update, (engine_after, after, update)
