"""MemOPDTrainer end to end on tiny real models: rollout, packing, teacher scoring, losses, optimizer step."""

import copy
import math
import os
import re
import sys
import types
from collections import defaultdict

import pytest
import torch
import trl.generation.vllm_generation
from transformers import AutoModelForCausalLM, TrainerCallback

import memopd_trl.trainer as trainer_module
import memopd_trl.validation as validation_module
from memopd_trl import MemOPDConfig, MemOPDTrainer
from memopd_trl.envs.base import MemoryAgentEnv, StepResult
from memopd_trl.envs.hotpot import HotpotQAEnv
from memopd_trl.scoring import VARLEN_SDPA


class LengthRewardEnv(MemoryAgentEnv):
    """One-turn env whose reward depends on the sampled text, so sampled episodes get different rewards."""

    def task_text(self, record):
        return record["question"]

    def search(self, query):
        return ""

    def score(self, answer):
        return {"f1": 0.0, "em": 0.0}

    def step(self, action_text):
        self.turns.append(None)
        self.done = True
        self.reward = (len(action_text) % 5) / 4
        return StepResult("", self.reward, True, {})


def make_config(tmp_path, **overrides) -> MemOPDConfig:
    settings = dict(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        report_to="none",
        max_steps=1,
        per_device_train_batch_size=2,
        num_generations=2,
        max_new_tokens=10,
        max_prompt_length=512,
        learning_rate=1e-2,
        save_strategy="no",
        logging_steps=1,
        seed=0,
        disable_tqdm=True,
    )
    settings.update(overrides)
    return MemOPDConfig(**settings)


def params_of(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def changed(before: dict, model) -> list[str]:
    return [name for name, p in model.named_parameters() if not torch.equal(before[name], p.detach())]


def losses_logged(trainer, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry]


@pytest.mark.parametrize(
    "settings",
    [
        {"teacher_scoring": "aligned"},
        {"teacher_scoring": "persistent"},
        {"ppo_coef": 0.0},
        {"kl_coef": 0.1},
    ],
    ids=["aligned", "persistent", "distill-only", "with-kl"],
)
def test_one_step_updates_student_not_teacher(tmp_path, world, env_factory, make_tiny_model, tiny_tokenizer, settings):
    student, teacher = make_tiny_model(seed=0), make_tiny_model(seed=1, hidden_size=48)
    student_before, teacher_before = params_of(student), params_of(teacher)
    trainer = MemOPDTrainer(
        model=student,
        teacher_model=teacher,
        args=make_config(tmp_path, **settings),
        train_dataset=world.records,
        env_factory=env_factory,
        processing_class=tiny_tokenizer,
    )
    trainer.train()
    assert changed(student_before, student), "the student did not change"
    assert not changed(teacher_before, teacher), "the teacher changed"
    distill = losses_logged(trainer, "loss/distill")
    assert distill and all(torch.isfinite(torch.tensor(distill))) and distill[0] > 0
    assert all(torch.isfinite(torch.tensor(losses_logged(trainer, "loss"))))
    if settings.get("ppo_coef", 1.0) > 0:
        assert losses_logged(trainer, "loss/ppo")
    assert losses_logged(trainer, "time/teacher")
    assert bool(losses_logged(trainer, "time/reference")) == ("kl_coef" in settings), "the reference has its own time"
    # The two episodes of a question share their first context: encoded once in the rollout.
    assert 0 < losses_logged(trainer, "rollout/shared_prefill_fraction")[0] < 1


def test_ppo_only_needs_no_teacher_and_learns_from_varied_rewards(tmp_path, world, make_tiny_model, tiny_tokenizer):
    student = make_tiny_model(seed=0)
    before = params_of(student)
    trainer = MemOPDTrainer(
        model=student,
        args=make_config(tmp_path, distill_coef=0.0, num_generations=4, temperature=1.5),
        train_dataset=world.records,
        env_factory=LengthRewardEnv.factory(),
        processing_class=tiny_tokenizer,
    )
    trainer.train()
    assert trainer.teacher_model is None
    assert losses_logged(trainer, "reward_std")[0] > 0, "the test needs rewards that differ within a group"
    assert changed(before, student)


def test_ppo_only_with_all_equal_rewards_gives_zero_gradient(tmp_path, world, env_factory, make_tiny_model, tiny_tokenizer):
    # A random model only writes malformed actions: every reward is 0, every group degenerate, every advantage 0.
    student = make_tiny_model(seed=0)
    before = params_of(student)
    trainer = MemOPDTrainer(
        model=student,
        args=make_config(tmp_path, distill_coef=0.0),
        train_dataset=world.records,
        env_factory=env_factory,
        processing_class=tiny_tokenizer,
    )
    trainer.train()
    assert losses_logged(trainer, "reward") == [0.0]
    assert losses_logged(trainer, "loss/ppo") == [0.0]
    assert not changed(before, student), "zero advantages must leave the weights unchanged"


def test_distillation_on_a_fixed_batch_lowers_gjsd(tmp_path, world, env_factory, make_tiny_model, tiny_tokenizer):
    # num_iterations reuses one rollout batch: pure distillation on it must bring the student to the teacher.
    teacher = make_tiny_model(seed=1)
    with torch.no_grad():
        teacher.get_output_embeddings().weight.mul_(5.0)  # a confident teacher, far from the near-uniform student
    trainer = MemOPDTrainer(
        model=make_tiny_model(seed=0),
        teacher_model=teacher,
        args=make_config(tmp_path, ppo_coef=0.0, beta=0.0, max_steps=8, num_iterations=8, learning_rate=1e-2),
        train_dataset=world.records,
        env_factory=env_factory,
        processing_class=tiny_tokenizer,
    )
    trainer.train()
    distill = losses_logged(trainer, "loss/distill")
    assert len(distill) == 8
    assert distill[-1] < 0.5 * distill[0], distill


def test_lora_student_trains_adapters_only(tmp_path, world, env_factory, make_tiny_model, tiny_tokenizer):
    from peft import LoraConfig

    student, teacher = make_tiny_model(seed=0), make_tiny_model(seed=1)
    base_before, teacher_before = params_of(student), params_of(teacher)
    trainer = MemOPDTrainer(
        model=student,
        teacher_model=teacher,
        args=make_config(tmp_path),
        train_dataset=world.records,
        env_factory=env_factory,
        processing_class=tiny_tokenizer,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
    )
    lora_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
    trainer.train()
    lora_after = dict(trainer.model.named_parameters())
    assert any(not torch.equal(lora_before[n], lora_after[n].detach()) for n in lora_before), "adapters did not train"
    base_names = {n for n in base_before if "lora" not in n}
    frozen = {n.replace("base_model.model.", "").replace(".base_layer", ""): p for n, p in lora_after.items()}
    assert all(torch.equal(base_before[n], frozen[n].detach()) for n in base_names), "base weights changed"
    assert not changed(teacher_before, teacher)


def test_vocabulary_mismatch_is_a_clear_error(tmp_path, world, env_factory, make_tiny_model, tiny_tokenizer):
    with pytest.raises(ValueError, match="share the tokenizer's vocabulary"):
        MemOPDTrainer(
            model=make_tiny_model(),
            teacher_model=make_tiny_model(vocab_size=64),
            args=make_config(tmp_path),
            train_dataset=world.records,
            env_factory=env_factory,
            processing_class=tiny_tokenizer,
        )


def test_teacher_tokenizer_mismatch_is_a_clear_error(tmp_path, world, env_factory, make_tiny_model, tiny_tokenizer):
    other = copy.deepcopy(tiny_tokenizer)
    other.add_tokens(["<extra_token>"])
    with pytest.raises(ValueError, match="tokenizer differs"):
        MemOPDTrainer(
            model=make_tiny_model(),
            teacher_model=make_tiny_model(),
            args=make_config(tmp_path),
            train_dataset=world.records,
            env_factory=env_factory,
            processing_class=tiny_tokenizer,
            teacher_processing_class=other,
        )


def test_missing_env_teacher_or_dataset_are_clear_errors(tmp_path, world, env_factory, make_tiny_model, tiny_tokenizer):
    common = dict(args=make_config(tmp_path), processing_class=tiny_tokenizer)
    with pytest.raises(ValueError, match="env_factory"):
        MemOPDTrainer(model=make_tiny_model(), teacher_model=make_tiny_model(), train_dataset=world.records, **common)
    with pytest.raises(ValueError, match="needs a teacher"):
        MemOPDTrainer(model=make_tiny_model(), train_dataset=world.records, env_factory=env_factory, **common)
    with pytest.raises(ValueError, match="train_dataset"):
        MemOPDTrainer(model=make_tiny_model(), teacher_model=make_tiny_model(), env_factory=env_factory, **common)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("beta", 1.5, "`beta` must be in"),
        ("teacher_scoring", "flat", "`teacher_scoring` must be one of"),
        ("num_generations", 1, "num_generations"),
        ("max_tokens_per_row", 0, "`max_tokens_per_row` must be None or >= 1"),
        ("epsilon", -0.1, "`epsilon` must be >= 0"),
        ("top_p", 0.0, "`top_p` must be in"),
    ],
)
def test_bad_config_values_name_the_field(tmp_path, field, value, message):
    with pytest.raises(ValueError, match=message):
        make_config(tmp_path, **{field: value})


def test_default_config_works_on_cpu(tmp_path):
    config = MemOPDConfig(output_dir=str(tmp_path))
    assert config.bf16 is (torch.cuda.is_available())
    assert config.teacher_scoring == "aligned" and config.distill_coef > 0 and config.ppo_coef > 0


@pytest.mark.parametrize("share_prefix", [False, True])
def test_every_packed_forward_disables_cache_and_mask(
    tmp_path, world, env_factory, make_tiny_model, tiny_tokenizer, monkeypatch, share_prefix
):
    # With use_cache=True or an attention mask, transformers silently lets packed invocations attend to each other.
    # With shared prefixes under sdpa the only mask is the tree's own: 4-D, and blocking more than the causal mask.
    import memopd_trl.scoring as scoring_module

    student, teacher = make_tiny_model(seed=0), make_tiny_model(seed=1)
    seen, scoring = [], []
    score = trainer_module.action_hidden_states

    def scored(model, batch):  # every teacher/student scoring forward of the trainer goes through here
        scoring.append(True)
        try:
            return score(model, batch)
        finally:
            scoring.pop()

    def spy(module, args, kwargs):
        if scoring:
            seen.append((kwargs.get("use_cache"), kwargs.get("attention_mask"), kwargs.get("position_ids")))

    monkeypatch.setattr(trainer_module, "action_hidden_states", scored)  # the student's forwards in its loss
    monkeypatch.setattr(scoring_module, "action_hidden_states", scored)  # every other scoring forward, row by row
    hooks = [m.get_decoder().register_forward_pre_hook(spy, with_kwargs=True) for m in (student, teacher)]
    trainer = MemOPDTrainer(
        model=student,
        teacher_model=teacher,
        args=make_config(tmp_path, max_tokens_per_row=4096, share_prefix=share_prefix),
        train_dataset=world.records,
        env_factory=env_factory,
        processing_class=tiny_tokenizer,
    )
    trainer.train()
    for hook in hooks:
        hook.remove()
    assert len(seen) >= 2, "expected packed forwards of the teacher and the student"
    assert all(use_cache is False for use_cache, _, _ in seen), seen
    if not share_prefix:
        assert all(mask is None for _, mask, _ in seen), seen
    else:
        for _, mask, _ in seen:
            assert mask.dim() == 4 and mask.dtype == torch.bool
            causal = torch.ones(mask.shape[-2:], dtype=torch.bool).tril()
            assert not bool(mask[:, 0][:, causal].all()), "the tree mask must block what a causal mask would not"
        assert trainer.share_prefix and any(m["packing/shared_fraction"] > 0.2 for m in trainer.state.log_history if "packing/shared_fraction" in m)
    assert any(bool((pos.diff(dim=-1) != 1).any()) for _, _, pos in seen), "no row held several invocations"


@pytest.mark.parametrize(
    ("attn_implementation", "max_tokens_per_row", "expected"),
    [(VARLEN_SDPA, "default", 4096), ("sdpa", "default", 4096), (VARLEN_SDPA, None, None), ("sdpa", 64, 64)],
    ids=["padding-free-default", "dense-default", "one-row", "set"],
)
def test_row_budget_is_4096_tokens_unless_set(
    tmp_path, world, env_factory, make_tiny_model, tiny_tokenizer, attn_implementation, max_tokens_per_row, expected
):
    # Rows bound the tokens of one forward (each row is forwarded on its own); None lays out a batch in one row.
    models = [make_tiny_model(seed=seed) for seed in (0, 1)]
    for m in models:
        m.set_attn_implementation(attn_implementation)
    settings = {} if max_tokens_per_row == "default" else {"max_tokens_per_row": max_tokens_per_row}
    trainer = MemOPDTrainer(
        model=models[0],
        teacher_model=models[1],
        args=make_config(tmp_path, **settings),
        train_dataset=world.records,
        env_factory=env_factory,
        processing_class=tiny_tokenizer,
    )
    assert trainer.collator.max_tokens_per_row == trainer.teacher.collators["aligned"].max_tokens_per_row == expected
    trainer.train()
    rows = losses_logged(trainer, "packing/rows")
    assert rows, "packing/rows is logged at every step"
    if expected is None:
        assert set(rows) == {1.0}
    if expected == 64:
        assert min(rows) > 1.0, "a 64-token budget splits this batch into several rows"


@pytest.mark.parametrize(
    "settings",
    [
        dict(distill_divergence_threshold=0.3, teacher_generations=2, kl_coef=0.1, loss_aggregation="token_mean"),
        dict(advantage_estimator="gae", loss_aggregation="sequence_mean", gradient_accumulation_steps=2),
    ],
    ids=["distill-mask-teacher-play-kl", "gae-sequence-mean-accumulation"],
)
def test_rows_forwarded_one_at_a_time_give_the_update_of_one_row(
    tmp_path, world, make_tiny_model, tiny_tokenizer, settings
):
    # The student forwards and back-propagates each packed row on its own (bounded activations). Each row's loss is
    # its share of every batch-level mean, so the rows' gradients add up to those of the whole batch in one row: the
    # same update (plain SGD: a scale error would show, Adam would hide it) and the same logged losses.
    def run(max_tokens_per_row, name, broken=False):
        student, teacher = make_tiny_model(seed=0), make_tiny_model(seed=1)
        for m in (student, teacher):
            m.set_attn_implementation(VARLEN_SDPA)
        trainer = MemOPDTrainer(
            model=student, teacher_model=teacher, train_dataset=world.records, env_factory=LengthRewardEnv.factory(),
            args=make_config(tmp_path / name, max_tokens_per_row=max_tokens_per_row, max_steps=2, optim="sgd",
                             learning_rate=0.5, num_generations=4, **settings),
            processing_class=tiny_tokenizer,
        )  # fmt: skip
        if broken:  # each row as if it were the whole batch: its own means, not its shares of the batch's
            pieces = trainer._loss_pieces

            def own_means(batch):
                out = pieces(batch)
                for piece in out:
                    if piece.row is not None:
                        n = int((piece.row["action_index"] < batch.num_actions).sum())
                        piece.counts = {**piece.counts, "actions": max(n, 1)}
                return out

            trainer._loss_pieces = own_means
        trainer.train()
        logged = {k: losses_logged(trainer, k) for k in ("loss", "loss/ppo", "loss/distill", "entropy", "packing/rows")}
        return logged, params_of(student)

    (one, one_weights), (rows, row_weights) = run(None, "one"), run(200, "rows")
    assert set(one["packing/rows"]) == {1.0} and min(rows["packing/rows"]) >= 3, "200-token rows: several forwards"
    assert changed(one_weights, make_tiny_model(seed=0)), "the update must move the weights for the check to mean much"
    for key in ("loss", "loss/ppo", "loss/distill", "entropy"):
        assert rows[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), key
    for name, value in one_weights.items():
        torch.testing.assert_close(row_weights[name], value, atol=1e-6, rtol=1e-5)
    _, broken_weights = run(200, "broken", broken=True)
    assert any(
        not torch.allclose(broken_weights[name], value, atol=1e-6, rtol=1e-5) for name, value in one_weights.items()
    ), "rows that each take their own mean must give another update: the check above would catch it"


def test_activation_checkpointing_gives_the_same_update(tmp_path, world, env_factory, make_tiny_model, tiny_tokenizer):
    # Large batches are scored in one forward: checkpointing is how a user bounds its activations (docs/scaling.md).
    # It must not change the update: same loss and same weights after a step as without it.
    results = []
    for checkpointing in (False, True):
        student, teacher = make_tiny_model(seed=0), make_tiny_model(seed=1)
        for m in (student, teacher):
            m.set_attn_implementation(VARLEN_SDPA)
        trainer = MemOPDTrainer(
            model=student,
            teacher_model=teacher,
            args=make_config(tmp_path / str(checkpointing), activation_checkpointing=checkpointing),
            train_dataset=world.records,
            env_factory=env_factory,
            processing_class=tiny_tokenizer,
        )
        trainer.train()
        assert student.is_activation_checkpointing == checkpointing
        results.append((losses_logged(trainer, "loss/distill"), params_of(student)))
    (plain_loss, plain_weights), (checkpointed_loss, checkpointed_weights) = results
    assert changed(plain_weights, make_tiny_model(seed=0)), "the step must move the weights for the check to mean much"
    assert plain_loss and plain_loss == pytest.approx(checkpointed_loss, rel=1e-5)
    for name, value in plain_weights.items():
        torch.testing.assert_close(checkpointed_weights[name], value, atol=1e-6, rtol=1e-5)


def test_save_reload_gives_same_outputs_and_writes_model_card(
    tmp_path, world, env_factory, make_tiny_model, tiny_tokenizer
):
    student = make_tiny_model(seed=0)
    trainer = MemOPDTrainer(
        model=student,
        teacher_model=make_tiny_model(seed=1),
        args=make_config(tmp_path),
        train_dataset=world.records,
        env_factory=env_factory,
        processing_class=tiny_tokenizer,
    )
    trainer.train()
    save_dir = tmp_path / "saved"
    trainer.save_model(str(save_dir))
    assert (save_dir / "model.safetensors").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(save_dir)
    ids = torch.tensor([tiny_tokenizer("Where was the director born?")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, student.eval()(ids).logits)
    card = (save_dir / "README.md").read_text()
    assert "memopd" in card and "trl" in card
    assert "2608.07068" in card
    assert "MemOPD" in card
    assert not (tmp_path / "out" / "README.md").exists(), "the card goes beside the weights, not into output_dir"


def _python_blocks(markdown: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", markdown, flags=re.DOTALL)


def test_the_model_card_names_the_models_and_settings_and_its_snippet_plays_an_episode(
    tmp_path, world, make_tiny_model, tiny_tokenizer
):
    # Student and teacher loaded from local paths, as a user with downloaded checkpoints would.
    student_dir, teacher_dir = tmp_path / "student-start", tmp_path / "teacher-ckpt"
    make_tiny_model(seed=0).save_pretrained(student_dir)
    make_tiny_model(seed=1).save_pretrained(teacher_dir)
    tiny_tokenizer.save_pretrained(teacher_dir)
    args = make_config(tmp_path, beta=0.25, distill_coef=0.5, ppo_coef=0.75, teacher_scoring="persistent")
    trainer = MemOPDTrainer(
        model=str(student_dir),
        teacher_model=str(teacher_dir),
        args=args,
        train_dataset=world.records,
        env_factory=HotpotQAEnv.factory(corpus=world.corpus, top_k=1, action_format="mem1",
                                        memory_policy="full_history", max_turns=2, system_prompt="Act."),
        processing_class=tiny_tokenizer,
    )  # fmt: skip
    trainer.train()
    save_dir = tmp_path / "saved"
    trainer.save_model(str(save_dir))
    card = (save_dir / "README.md").read_text()
    assert "None" not in card and "huggingface.co/None" not in card
    assert f"the local checkpoint `{student_dir}`" in card and f"the local checkpoint `{teacher_dir}`" in card
    for name, value in [("distill_coef", 0.5), ("beta", 0.25), ("teacher_scoring", "persistent"), ("ppo_coef", 0.75)]:
        assert f"| `{name}` | `{value}` |" in card, name
    assert '`"mem1"`: `<think>`' in card and "| memory policy | `full_history` |" in card
    assert "pipeline(" not in card, "the generic chat example is gone"
    (snippet,) = _python_blocks(card)
    assert 'action_format="mem1"' in snippet and 'memory_policy="full_history"' in snippet
    assert f'from_pretrained("{save_dir}")' in snippet
    namespace: dict = {}
    exec(compile(snippet, "model-card-snippet", "exec"), namespace)  # the card's own usage example runs as written
    episode = namespace["episode"]
    assert episode.num_turns >= 1 and episode.invocations and episode.record_id == "q1"
    # A Hub id is named as one, with a link and in the card's metadata.
    trainer._student_name = "Qwen/Qwen2.5-3B-Instruct"
    trainer.create_model_card(output_dir=str(tmp_path / "hub-card"))
    card = (tmp_path / "hub-card" / "README.md").read_text()
    assert "base_model: Qwen/Qwen2.5-3B-Instruct" in card and "(https://huggingface.co/Qwen/Qwen2.5-3B-Instruct)" in card


@pytest.mark.parametrize("failure", ["offline-mode", "connect-error"])
def test_push_to_hub_without_a_network_says_what_failed_and_how_to_push_later(
    tmp_path, world, env_factory, make_tiny_model, tiny_tokenizer, monkeypatch, failure
):
    import huggingface_hub
    from huggingface_hub.utils import _http

    if failure == "offline-mode":
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    else:  # the Hub client's HTTP transport fails to connect, as without a network (nothing leaves the machine)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        httpx = _http.httpx2

        def refuse(request):
            raise httpx.ConnectError("[Errno -3] Temporary failure in name resolution", request=request)

        huggingface_hub.set_client_factory(lambda: httpx.Client(transport=httpx.MockTransport(refuse)))
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_ETAG_TIMEOUT", 1)
    try:
        trainer = MemOPDTrainer(
            model=make_tiny_model(seed=0),
            args=make_config(tmp_path, distill_coef=0.0, hub_model_id="someone/memopd-agent"),
            train_dataset=world.records,
            env_factory=env_factory,
            processing_class=tiny_tokenizer,
        )
        with pytest.raises(ConnectionError, match=r"push_to_hub could not reach the Hugging Face Hub") as caught:
            trainer.push_to_hub(token="hf_not_a_real_token")
    finally:
        if failure == "connect-error":
            huggingface_hub.set_client_factory(_http.default_client_factory)
    message = str(caught.value)
    out = tmp_path / "out"
    assert str(out) in message and "trainer.push_to_hub()" in message
    assert f"hf upload someone/memopd-agent {out}" in message
    assert (out / "model.safetensors").exists() and (out / "README.md").exists(), "the work is saved to push later"


def test_evaluate_plays_greedy_episodes_and_reports_f1_em(tmp_path, world, env_factory, make_tiny_model, tiny_tokenizer):
    trainer = MemOPDTrainer(
        model=make_tiny_model(seed=0),
        teacher_model=make_tiny_model(seed=1),
        args=make_config(tmp_path),
        train_dataset=world.records,
        eval_dataset=world.records[:3],
        env_factory=env_factory,
        processing_class=tiny_tokenizer,
    )
    metrics = trainer.evaluate()
    assert metrics["eval_num_episodes"] == 3
    assert {"eval_f1", "eval_em", "eval_turns", "eval_malformed_actions"} <= set(metrics)
    assert 0.0 <= metrics["eval_f1"] <= 1.0
    assert metrics["eval_turns"] >= 1


class StopAfter(TrainerCallback):
    """Stops training after `step` steps, as a crash or preemption would (the checkpoint of that step is saved)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def test_resume_from_checkpoint_reaches_the_same_weights(
    tmp_path, world, env_factory, make_tiny_model, tiny_tokenizer
):
    def run(output, resume=None, callbacks=None):
        student = make_tiny_model(seed=0)
        trainer = MemOPDTrainer(
            model=student,
            teacher_model=make_tiny_model(seed=1),
            args=make_config(tmp_path, output_dir=str(tmp_path / output), max_steps=3, save_strategy="steps", save_steps=1),
            train_dataset=world.records,
            env_factory=env_factory,
            processing_class=tiny_tokenizer,
            callbacks=callbacks,
        )
        trainer.train(resume_from_checkpoint=resume)
        return student, trainer

    straight, _ = run("straight")
    _, stopped = run("interrupted", callbacks=[StopAfter(2)])
    assert stopped.state.global_step == 2
    checkpoint = tmp_path / "interrupted" / "checkpoint-2"
    assert checkpoint.is_dir() and os.listdir(checkpoint)
    resumed, trainer = run("interrupted", resume=str(checkpoint))
    assert trainer.state.global_step == 3
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=f"{name} differs after resuming")


def test_gradient_accumulation_rolls_out_every_micro_batch(tmp_path, world, env_factory, make_tiny_model, tiny_tokenizer):
    trainer = MemOPDTrainer(
        model=make_tiny_model(seed=0),
        teacher_model=make_tiny_model(seed=1),
        args=make_config(tmp_path, max_steps=2, gradient_accumulation_steps=2, num_iterations=2),
        train_dataset=world.records,
        env_factory=env_factory,
        processing_class=tiny_tokenizer,
    )
    played = []
    rollout = trainer._rollout

    def record(records):
        played.append(tuple(r["_id"] for r in records))
        return rollout(records)

    trainer._rollout = record
    trainer.train()
    # Step 1 rolls out its two micro-batches; step 2 reuses both (num_iterations=2).
    assert len(played) == 2 and played[0] != played[1], played


class ScoredLengthEnv(LengthRewardEnv):
    """Reports its own final scores in a `metrics` dict, under names the trainer knows nothing about."""

    @property
    def metrics(self):
        return {"length_score": self.reward, "answered": 1.0}


def test_logged_episode_metrics_are_the_environments_own(tmp_path, world, make_tiny_model, tiny_tokenizer):
    trainer = MemOPDTrainer(
        model=make_tiny_model(seed=0),
        args=make_config(tmp_path, distill_coef=0.0),
        train_dataset=world.records,
        eval_dataset=world.records[:2],
        env_factory=ScoredLengthEnv.factory(),
        processing_class=tiny_tokenizer,
    )
    trainer.train()
    assert losses_logged(trainer, "answered") == [1.0]
    assert losses_logged(trainer, "length_score") == losses_logged(trainer, "reward")
    assert not losses_logged(trainer, "f1"), "the trainer must not invent QA metrics the environment does not report"
    metrics = trainer.evaluate()
    assert metrics["eval_answered"] == 1.0 and metrics["eval_length_score"] == metrics["eval_reward"]
    assert "eval_f1" not in metrics


# ----- use_vllm: TRL's VLLMGeneration (engine and weight sync) and a vLLM engine, both faked ------------------------
class FakeVLLMEngine:
    """
    Stands in for a colocated `vllm.LLM`: its own copy of the model, whose weights change only when pushed. Each
    prompt is answered with one of `actions` (in turn, so rewards differ within a group) and the log-prob of every
    action token under the engine's weights, as vLLM's `processed_logprobs` (tempered; untempered when greedy).
    """

    def __init__(self, model, student, actions: list[list[int]]):
        self.model = model.eval()
        self.student = student
        self.actions = actions
        self.llm_engine = types.SimpleNamespace(model_config=types.SimpleNamespace(logprobs_mode="processed_logprobs"))
        self.events: list[str] = []
        self.requests: list[tuple[list[dict], list[dict]]] = []
        self.in_sync: list[bool] = []  # per generate call: did the engine hold the student's current weights?

    @torch.no_grad()
    def generate(self, prompts, sampling_params, use_tqdm):
        self.events.append("generate")
        self.requests.append((prompts, sampling_params))
        student = self.student.state_dict()
        self.in_sync.append(all(torch.equal(p, student[name]) for name, p in self.model.state_dict().items()))
        outputs = []
        for index, (prompt, params) in enumerate(zip(prompts, sampling_params, strict=True)):
            context, action = prompt["prompt_token_ids"], self.actions[index % len(self.actions)]
            logits = self.model(torch.tensor([context + action])).logits[0, len(context) - 1 : -1].float()
            logprobs = torch.log_softmax(logits / (params["temperature"] or 1.0), dim=-1)
            sampled = logprobs.gather(-1, torch.tensor(action)[:, None]).squeeze(-1).tolist()
            completion = types.SimpleNamespace(token_ids=action, logprobs=[{t: lp} for t, lp in zip(action, sampled, strict=True)])
            outputs.append(types.SimpleNamespace(outputs=[completion]))
        return outputs

    def wake_up(self, tags: list[str]) -> None:
        self.events.append(f"wake_up {tags}")

    @torch.no_grad()
    def sleep(self, level: int) -> None:
        self.events.append(f"sleep {level}")
        if level == 2:  # level 2 discards the weights
            for p in self.model.parameters():
                p.fill_(float("nan"))


class FakeVLLMGeneration:
    """Stands in for TRL's `VLLMGeneration`: keeps its arguments; `sync_weights` copies the student into the engine."""

    def __init__(self, model, accelerator, processing_class, engine_model, actions, **kwargs):
        self.model = model
        self.kwargs = kwargs
        self.llm = FakeVLLMEngine(engine_model, model, actions)

    def sync_weights(self) -> None:
        self.llm.events.append("sync")
        self.llm.model.load_state_dict(self.model.state_dict())


@pytest.fixture
def fake_vllm(monkeypatch, make_tiny_model, tiny_tokenizer) -> list[FakeVLLMGeneration]:
    """Makes `use_vllm=True` run on CPU with the fakes above; returns the list of `VLLMGeneration`s the trainer built."""
    actions = [
        tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
        for text in ("<answer>a</answer>", "<answer>abc</answer>")
    ]
    built: list[FakeVLLMGeneration] = []

    def build(**kwargs) -> FakeVLLMGeneration:
        # vLLM loads the checkpoint from disk, which need not be the in-memory student: start from other weights.
        built.append(FakeVLLMGeneration(engine_model=make_tiny_model(seed=7), actions=actions, **kwargs))
        return built[-1]

    monkeypatch.setattr(trainer_module, "check_vllm_support", lambda args: None)
    monkeypatch.setattr(trl.generation.vllm_generation, "VLLMGeneration", build)
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(SamplingParams=lambda **kwargs: kwargs))
    return built


def test_use_vllm_without_vllm_installed_names_the_extra(tmp_path, world, env_factory, make_tiny_model, monkeypatch):
    monkeypatch.setattr(validation_module, "is_vllm_available", lambda: False)
    with pytest.raises(ImportError, match=r"pip install memopd-trl\[vllm\]"):
        MemOPDTrainer(
            model=make_tiny_model(), args=make_config(tmp_path, use_vllm=True, distill_coef=0.0),
            train_dataset=world.records, env_factory=env_factory,
        )


def test_use_vllm_without_a_gpu_is_a_clear_error(tmp_path, world, env_factory, make_tiny_model, monkeypatch):
    monkeypatch.setattr(validation_module, "is_vllm_available", lambda: True)
    with pytest.raises(ValueError, match="needs an NVIDIA GPU"):
        MemOPDTrainer(
            model=make_tiny_model(), args=make_config(tmp_path, use_vllm=True, distill_coef=0.0),
            train_dataset=world.records, env_factory=env_factory,
        )


def test_use_vllm_trains_with_rollouts_from_the_synced_engine(
    tmp_path, world, make_tiny_model, tiny_tokenizer, fake_vllm
):
    student = make_tiny_model(seed=0)
    trainer = MemOPDTrainer(
        model=student,
        teacher_model=make_tiny_model(seed=1),
        args=make_config(tmp_path, use_vllm=True, max_steps=3),
        train_dataset=world.records,
        eval_dataset=world.records[:2],
        env_factory=LengthRewardEnv.factory(),
        processing_class=tiny_tokenizer,
    )
    (generation,) = fake_vllm
    assert generation.model is student
    assert trainer.correct_sampling, "with vLLM, PPO is corrected for the engine's gap by default"
    assert generation.kwargs == {
        "mode": "colocate", "gpu_memory_utilization": 0.3, "max_model_length": 512 + 10, "enable_sleep_mode": False,
        "trust_remote_code": False, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_completion_length": 10,
    }
    before = params_of(student)
    trainer.train()
    engine = generation.llm

    # One rollout per step, each through the engine, each after a sync: once at the start, once per optimizer step.
    assert engine.events == ["sync", "generate"] * 3
    assert [len(prompts) for prompts, _ in engine.requests] == [4, 4, 4]  # 2 questions x 2 generations
    assert all(params["temperature"] == 1.0 and params["logprobs"] == 0 for _, ps in engine.requests for params in ps)
    assert engine.in_sync == [True, True, True]
    # The recorded log-probs are the current student's, so every step's PPO ratios start at exactly 1.
    assert max(abs(kl) for kl in losses_logged(trainer, "approx_kl_old")) < 1e-6
    assert losses_logged(trainer, "clip_fraction") == [0.0, 0.0, 0.0]
    assert len(losses_logged(trainer, "loss/distill")) == 3 and len(losses_logged(trainer, "loss/ppo")) == 3
    assert len(losses_logged(trainer, "reward")) == 3 and losses_logged(trainer, "reward_std")[0] > 0
    assert max(losses_logged(trainer, "sampling/sampling_logp_difference/max")) < 1e-4  # an fp32 engine: no gap
    assert changed(before, student)

    # Evaluation after the last step pushes the final weights once; a second one has nothing new to push.
    trainer.evaluate()
    trainer.evaluate()
    assert engine.events[6:] == ["sync", "generate", "generate"]
    assert engine.in_sync[3:] == [True, True]
    assert all(params["temperature"] == 0.0 for _, ps in engine.requests[3:] for params in ps)


def test_use_vllm_sleep_mode_wakes_and_resyncs_around_every_rollout(
    tmp_path, world, make_tiny_model, tiny_tokenizer, fake_vllm
):
    trainer = MemOPDTrainer(
        model=make_tiny_model(seed=0),
        args=make_config(tmp_path, use_vllm=True, vllm_enable_sleep_mode=True, distill_coef=0.0),
        train_dataset=world.records,
        eval_dataset=world.records[:2],
        env_factory=LengthRewardEnv.factory(),
        processing_class=tiny_tokenizer,
    )
    trainer.train()
    trainer.evaluate()
    trainer.evaluate()
    engine = fake_vllm[0].llm
    # Sleep level 2 discards the weights, so they are pushed again before every rollout, evaluation included.
    assert engine.events == ["sync", "wake_up ['kv_cache']", "generate", "sleep 2"] * 3
    assert engine.in_sync == [True, True, True]


def test_use_vllm_config_builds_without_vllm_and_checks_its_fields(tmp_path):
    config = make_config(tmp_path, use_vllm=True)  # a config can be built anywhere and shipped to a GPU machine
    assert config.vllm_gpu_memory_utilization == 0.3 and config.vllm_max_model_length is None
    assert not config.vllm_enable_sleep_mode
    with pytest.raises(ValueError, match="`vllm_gpu_memory_utilization` must be in"):
        make_config(tmp_path, vllm_gpu_memory_utilization=0.0)
    with pytest.raises(ValueError, match="`vllm_max_model_length` must be None or >= .* = 522"):
        make_config(tmp_path, vllm_max_model_length=256)


# ----- diagnostics, the alignment audit and the sampled-token KL advantage -------------------------------------------
def near_copy(model, seed: int, scale: float = 0.05):
    """A teacher close to `model`: every weight moved by `scale` times Gaussian noise (so argmaxes agree sometimes)."""
    teacher = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(scale * p.std().nan_to_num(0.0) * torch.randn(p.shape, generator=generator))
    return teacher


class ParityRewardEnv(LengthRewardEnv):
    """Reward 1 for an action of even length, else 0: sampled episodes fall on both sides of `reward > 0`."""

    def step(self, action_text):
        result = super().step(action_text)
        self.reward = float(len(action_text) % 2 == 0)
        return StepResult(result.observation, self.reward, True, {})


def test_distillation_diagnostics_equal_a_materialized_computation_split_by_reward(
    tmp_path, world, make_tiny_model, tiny_tokenizer
):
    from test_losses import materialized_diagnostics

    from memopd_trl.scoring import full_logits_action_logprobs

    student = make_tiny_model(seed=0)
    start = copy.deepcopy(student)
    teacher = near_copy(student, seed=1, scale=0.5)
    trainer = MemOPDTrainer(
        model=student,
        teacher_model=teacher,
        args=make_config(tmp_path, num_generations=4, temperature=1.5, logit_chunk_size=7, misalignment_audit_steps=0),
        train_dataset=world.records,
        env_factory=ParityRewardEnv.factory(),
        processing_class=tiny_tokenizer,
    )
    rollouts = []
    rollout = trainer._rollout
    trainer._rollout = lambda records: rollouts.append(rollout(records)) or rollouts[-1]
    trainer.train()

    (played,) = rollouts
    invocations = [inv for ep in played.episodes for inv in ep.invocations]
    with torch.no_grad():  # plain forwards with full logits, at T=1, of the student before its update and the teacher
        _, student_logits = full_logits_action_logprobs(start, invocations, return_distributions=True)
        _, teacher_logits = full_logits_action_logprobs(teacher, invocations, return_distributions=True)
    reference = materialized_diagnostics(student_logits, teacher_logits)
    rewarded = torch.tensor(
        [ep.reward > 0 for ep in played.episodes for inv in ep.invocations for _ in inv.output_ids]
    )  # (N,)
    assert 0 < rewarded.sum() < len(rewarded), "the test needs rewarded and unrewarded episodes"
    assert 0 < reference["agreement"].mean() < 1, "the test needs tokens where the argmaxes agree and where not"
    for name, values in reference.items():
        for suffix, tokens in (("", slice(None)), ("_rewarded", rewarded), ("_unrewarded", ~rewarded)):
            (logged,) = losses_logged(trainer, f"distill/{name}{suffix}")
            assert logged == pytest.approx(values[tokens].mean().item(), rel=1e-4, abs=1e-6), f"{name}{suffix}"
    (entropy,) = losses_logged(trainer, "distill/student_entropy")
    assert entropy != pytest.approx(losses_logged(trainer, "entropy")[0]), "T=1, not the sampling temperature"


def test_distillation_diagnostics_can_be_switched_off_and_leave_the_update_unchanged(
    tmp_path, world, env_factory, make_tiny_model, tiny_tokenizer
):
    students = []
    for diagnostics in (True, False):
        student = make_tiny_model(seed=0)
        trainer = MemOPDTrainer(
            model=student,
            teacher_model=make_tiny_model(seed=1),
            args=make_config(tmp_path, max_steps=2, distill_diagnostics=diagnostics),
            train_dataset=world.records,
            env_factory=env_factory,
            processing_class=tiny_tokenizer,
        )
        trainer.train()
        assert bool(losses_logged(trainer, "distill/forward_kl")) == diagnostics
        students.append(student)
    for (name, a), b in zip(students[0].named_parameters(), students[1].parameters(), strict=True):
        assert torch.equal(a, b), f"{name}: the diagnostics changed the update"


def persistent_reference_kl(teacher, episode) -> dict[int, torch.Tensor]:
    """KL(aligned || persistent) per action token of each turn, from plain forwards with full logits (no packing)."""
    from memopd_trl.scoring import full_logits_action_logprobs

    history = list(episode.invocations[0].input_ids)
    starts = []
    for inv in episode.invocations:
        starts.append(len(history) - 1)
        history += inv.output_ids + (inv.observation_ids or [])
    with torch.no_grad():
        logits = teacher(input_ids=torch.tensor([history])).logits[0].float()  # (len, V)
        kl = {}
        for inv, start in zip(episode.invocations, starts, strict=True):
            _, aligned = full_logits_action_logprobs(teacher, [inv], return_distributions=True)
            persistent = logits[start : start + len(inv.output_ids)].log_softmax(-1)
            kl[inv.turn] = (aligned.exp() * (aligned - persistent)).sum(-1)
    return kl


def test_alignment_audit_logs_the_teachers_kl_between_contexts_by_turn(
    tmp_path, world, env_factory, make_tiny_model, tiny_tokenizer
):
    teacher = make_tiny_model(seed=1)
    with torch.no_grad():
        teacher.get_output_embeddings().weight.mul_(5.0)  # a teacher whose distributions depend on its context
    trainer = MemOPDTrainer(
        model=make_tiny_model(seed=0),
        teacher_model=teacher,
        args=make_config(tmp_path, max_steps=3, misalignment_audit_steps=2),
        train_dataset=world.records,
        env_factory=env_factory,
        processing_class=tiny_tokenizer,
    )
    rollouts = []
    rollout = trainer._rollout
    trainer._rollout = lambda records: rollouts.append(rollout(records)) or rollouts[-1]
    trainer.train()

    steps = [e for e in trainer.state.log_history if "loss" in e]
    assert ["misalignment/kl" in e for e in steps] == [True, False, True], "audited at steps 0 and 2 of 3"
    for entry, played in zip(steps[::2], rollouts[::2], strict=True):
        reference = defaultdict(list)
        for episode in played.episodes:
            for turn, kl in persistent_reference_kl(teacher, episode).items():
                reference[turn].append(kl)
        reference = {turn: torch.cat(kls) for turn, kls in reference.items()}
        assert sorted(reference) == [0, 1]
        # Turn 0: the same context before any rewrite. Turn 1: its context holds the rewritten turn 0.
        # (A random 1-layer teacher reads its context little: ~3e-5 nats at turn 1, float noise ~3e-8 at turn 0.)
        assert abs(entry["misalignment/kl_turn_0"]) < 1e-6
        assert entry["misalignment/kl_turn_1"] > max(1e-5, 100 * abs(entry["misalignment/kl_turn_0"]))
        for turn, kl in reference.items():
            assert entry[f"misalignment/kl_turn_{turn}"] == pytest.approx(kl.mean().item(), rel=1e-3, abs=1e-7)
        overall = torch.cat(list(reference.values())).mean().item()
        assert entry["misalignment/kl"] == pytest.approx(overall, rel=1e-3, abs=1e-7)
        assert entry["time/audit"] > 0


@pytest.mark.parametrize(
    "settings", [{"misalignment_audit_steps": 0}, {"teacher_scoring": "persistent"}], ids=["off", "persistent"]
)
def test_alignment_audit_is_off_when_disabled_or_without_aligned_scoring(
    tmp_path, world, env_factory, make_tiny_model, tiny_tokenizer, settings
):
    trainer = MemOPDTrainer(
        model=make_tiny_model(seed=0),
        teacher_model=make_tiny_model(seed=1),
        args=make_config(tmp_path, **settings),
        train_dataset=world.records,
        env_factory=env_factory,
        processing_class=tiny_tokenizer,
    )
    trainer.train()
    assert trainer.audit is None and set(trainer.teacher.collators) == {trainer.args.teacher_scoring}
    assert not [key for e in trainer.state.log_history for key in e if key.startswith("misalignment/")]


def test_sampled_kl_advantage_adds_teacher_minus_rollout_logprobs_at_the_sampling_temperature(
    tmp_path, world, make_tiny_model, tiny_tokenizer
):
    from memopd_trl.scoring import full_logits_action_logprobs

    student, teacher = make_tiny_model(seed=0), make_tiny_model(seed=1, hidden_size=48)
    with torch.no_grad():
        teacher.get_output_embeddings().weight.mul_(3.0)
    trainer = MemOPDTrainer(
        model=student,
        teacher_model=teacher,
        args=make_config(tmp_path, sampled_kl_coef=0.5, temperature=1.5, num_generations=4),
        train_dataset=world.records,
        env_factory=LengthRewardEnv.factory(),
        processing_class=tiny_tokenizer,
    )
    rollout = trainer._rollout(world.records[:2])
    batch = trainer._score(rollout)
    reward_only, _, _ = trainer._compute_advantages(rollout, batch.rows)
    with torch.no_grad():  # by hand: the teacher's full logits at each sampled token, at the sampling temperature
        teacher_logprobs = full_logits_action_logprobs(teacher, rollout.invocations, temperature=1.5)
    old_logprobs = torch.tensor([lp for inv in rollout.invocations for lp in inv.logprobs])
    expected = reward_only + 0.5 * (teacher_logprobs - old_logprobs)
    torch.testing.assert_close(batch.advantages, expected, rtol=1e-5, atol=1e-5)
    assert (batch.advantages - reward_only).abs().max() > 0.1, "the teacher term should move the advantages"
    (logged,) = trainer._metrics["train"]["distill/sampled_reverse_kl"]
    assert logged == pytest.approx((old_logprobs - teacher_logprobs).mean().item(), rel=1e-4)


def test_sampled_kl_advantage_trains_with_ppo_alone_and_needs_a_teacher_and_ppo(
    tmp_path, world, make_tiny_model, tiny_tokenizer
):
    student = make_tiny_model(seed=0)
    before = params_of(student)
    trainer = MemOPDTrainer(
        model=student,
        teacher_model=make_tiny_model(seed=1),
        args=make_config(tmp_path, distill_coef=0.0, sampled_kl_coef=1.0),
        train_dataset=world.records,
        env_factory=LengthRewardEnv.factory(),
        processing_class=tiny_tokenizer,
    )
    trainer.train()
    assert changed(before, student)
    assert losses_logged(trainer, "loss/ppo") and not losses_logged(trainer, "loss/distill")
    assert losses_logged(trainer, "distill/sampled_reverse_kl") and losses_logged(trainer, "distill/forward_kl")
    with pytest.raises(ValueError, match="`sampled_kl_coef` > 0 needs a teacher"):
        MemOPDTrainer(
            model=make_tiny_model(seed=0),
            args=make_config(tmp_path, distill_coef=0.0, sampled_kl_coef=1.0),
            train_dataset=world.records,
            env_factory=LengthRewardEnv.factory(),
            processing_class=tiny_tokenizer,
        )
    with pytest.raises(ValueError, match="`sampled_kl_coef` .* but `ppo_coef` is 0"):
        make_config(tmp_path, ppo_coef=0.0, sampled_kl_coef=1.0)
    with pytest.raises(ValueError, match="`sampled_kl_coef` must be >= 0"):
        make_config(tmp_path, sampled_kl_coef=-1.0)


def test_distill_divergence_threshold_distills_each_action_only_up_to_its_first_unlikely_token(
    tmp_path, world, make_tiny_model, tiny_tokenizer
):
    from memopd_trl.losses import until_first_divergence
    from memopd_trl.scoring import full_logits_action_logprobs

    student, teacher = make_tiny_model(seed=0), make_tiny_model(seed=1, hidden_size=48)
    with torch.no_grad():
        teacher.get_output_embeddings().weight.mul_(3.0)  # a confident teacher: some sampled tokens fall below 0.2
    trainer = MemOPDTrainer(
        model=student, teacher_model=teacher,
        args=make_config(tmp_path, distill_divergence_threshold=0.2, num_generations=4),
        train_dataset=world.records, env_factory=LengthRewardEnv.factory(), processing_class=tiny_tokenizer,
    )  # fmt: skip
    rollout = trainer._rollout(world.records[:2])
    batch = trainer._score(rollout)
    with torch.no_grad():
        teacher_logprobs = full_logits_action_logprobs(teacher, rollout.invocations, temperature=1.0)
    expected = until_first_divergence(teacher_logprobs, batch.sequence_ids, 0.2)
    assert torch.equal(batch.distill_mask, expected)
    assert 0 < expected.sum() < expected.numel(), "the check needs kept and dropped tokens"
    trainer._metrics["train"].clear()
    trainer._batch_loss(student, batch)
    (masked,) = trainer._metrics["train"]["loss/distill"]
    batch.distill_mask = None
    trainer._batch_loss(student, batch)
    _, every_token = trainer._metrics["train"]["loss/distill"]
    assert masked != pytest.approx(every_token), "the mask must change the distillation loss"
    with pytest.raises(ValueError, match="`distill_divergence_threshold` .* but `distill_coef` is 0"):
        make_config(tmp_path, distill_coef=0.0, distill_divergence_threshold=0.1)
    with pytest.raises(ValueError, match="`distill_divergence_threshold` must be in"):
        make_config(tmp_path, distill_divergence_threshold=1.0)


def test_distill_divergence_scope_episode_stops_distilling_the_rest_of_the_episode(
    tmp_path, world, env_factory, make_tiny_model, tiny_tokenizer
):
    from memopd_trl.scoring import full_logits_action_logprobs

    student, teacher = make_tiny_model(seed=0), make_tiny_model(seed=1, hidden_size=48)
    with torch.no_grad():
        teacher.get_output_embeddings().weight.mul_(3.0)
    config = make_config(
        tmp_path, distill_divergence_threshold=0.2, distill_divergence_scope="episode", num_generations=4
    )  # the env factory plays two turns
    trainer = MemOPDTrainer(
        model=student, teacher_model=teacher, args=config, train_dataset=world.records,
        env_factory=env_factory, processing_class=tiny_tokenizer,
    )  # fmt: skip
    rollout = trainer._rollout(world.records[:2])
    batch = trainer._score(rollout)
    with torch.no_grad():
        teacher_logprobs = full_logits_action_logprobs(teacher, rollout.invocations, temperature=1.0).tolist()
    expected, action_scope, i = [], [], 0
    for episode in rollout.episodes:  # token by token: keep until the episode's first unlikely token, that one included
        diverged = False
        for invocation in episode.invocations:
            action_diverged = False
            for _ in invocation.output_ids:
                expected.append(not diverged)
                action_scope.append(not action_diverged)
                diverged |= teacher_logprobs[i] < math.log(0.2)
                action_diverged |= teacher_logprobs[i] < math.log(0.2)
                i += 1
    assert batch.distill_mask.tolist() == expected
    assert sum(expected) < sum(action_scope), "the check needs a later action the episode scope drops"
    with pytest.raises(ValueError, match="`distill_divergence_scope` must be"):
        make_config(tmp_path, distill_divergence_threshold=0.1, distill_divergence_scope="turn")


def test_teacher_generations_distill_the_student_on_episodes_the_teacher_played(
    tmp_path, world, env_factory, make_tiny_model, tiny_tokenizer
):
    from memopd_trl.losses import generalized_jsd_loss
    from memopd_trl.scoring import full_logits_action_logprobs

    student = make_tiny_model(seed=0)
    teacher = near_copy(student, seed=1, scale=0.5)
    config = make_config(
        tmp_path, num_generations=2, teacher_generations=2, beta=0.5, temperature=1.3, misalignment_audit_steps=0
    )
    trainer = MemOPDTrainer(
        model=student, teacher_model=teacher, args=config, train_dataset=world.records, env_factory=env_factory,
        processing_class=tiny_tokenizer,
    )  # fmt: skip
    rollouts = []
    rollout = trainer._rollout
    trainer._rollout = lambda records: rollouts.append(rollout(records)) or rollouts[-1]
    batch = trainer._prepare_inputs(world.records[:2])
    own = rollouts[0].invocations
    played = batch.teacher_play.invocations
    assert len({(inv.group_id, inv.episode_id) for inv in played}) == 4 and len(played) > 4, "2 x 2 multi-turn episodes"
    with torch.no_grad():  # the teacher sampled them: its own log-probs at the sampling temperature are the recorded ones
        recorded = torch.tensor([lp for inv in played for lp in inv.logprobs])
        torch.testing.assert_close(full_logits_action_logprobs(teacher, played, temperature=1.3), recorded, atol=1e-4, rtol=0)
        _, student_logits = full_logits_action_logprobs(student, own + played, return_distributions=True)
        _, teacher_logits = full_logits_action_logprobs(teacher, own + played, return_distributions=True)
    per_token = generalized_jsd_loss(student_logits[None], teacher_logits[None], beta=0.5, reduction="none").sum(-1)[0]

    trainer._metrics["train"].clear()
    trainer._batch_loss(student, batch)
    metrics = trainer._metrics["train"]
    # one token mean over the student's actions and the teacher's, each in its own exact state
    assert metrics["loss/distill"][0] == pytest.approx(per_token.mean().item(), rel=1e-4)
    num_own = sum(len(inv.output_ids) for inv in own)
    assert metrics["loss/distill_teacher_play"][0] == pytest.approx(per_token[num_own:].mean().item(), rel=1e-4)
    batch.teacher_play = None
    trainer._batch_loss(student, batch)
    assert metrics["loss/ppo"][1] == metrics["loss/ppo"][0], "the teacher's episodes never enter PPO"
    assert metrics["loss/distill"][1] != pytest.approx(metrics["loss/distill"][0])
    with pytest.raises(ValueError, match="`teacher_generations` .* but `distill_coef` is 0"):
        make_config(tmp_path, distill_coef=0.0, teacher_generations=1)
    with pytest.raises(ValueError, match="`teacher_generations` must be >= 0"):
        make_config(tmp_path, teacher_generations=-1)


@pytest.mark.parametrize("teacher_scoring", ["aligned", "persistent"])
def test_shared_prefix_packing_trains_the_same_weights_as_whole_invocations(
    tmp_path, world, env_factory, make_tiny_model, tiny_tokenizer, teacher_scoring
):
    # Same rollouts (same seed), same losses: the tree layout changes how the batch is laid out, not what is learned.
    weights, shared, losses = [], [], []
    for share_prefix in (False, True):
        trainer = MemOPDTrainer(
            model=make_tiny_model(seed=0, attn_implementation="memopd_sdpa_varlen"),
            teacher_model=make_tiny_model(seed=1),
            args=make_config(tmp_path / str(share_prefix), max_steps=2, share_prefix=share_prefix,
                             teacher_scoring=teacher_scoring),
            train_dataset=world.records,
            env_factory=env_factory,
            processing_class=tiny_tokenizer,
        )  # fmt: skip
        trainer.train()
        weights.append(params_of(trainer.model))
        shared.append(max(m.get("packing/shared_fraction", 0.0) for m in trainer.state.log_history))
        losses.append([m["loss"] for m in trainer.state.log_history if "loss" in m])
    assert shared[0] == 0.0 and shared[1] > 0.2
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    # Two AdamW steps of 1e-2 move a weight by up to 2e-2; Adam divides by the gradient's own size, so the last bits
    # of a near-zero gradient (summed in another order over a shared prefix) can move a weight by ~1e-5.
    for name, value in weights[0].items():
        torch.testing.assert_close(weights[1][name], value, atol=1e-4, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


def test_shared_prefix_packing_is_off_when_a_scoring_model_cannot_attend_over_a_tree(
    tmp_path, world, env_factory, make_tiny_model, tiny_tokenizer
):
    trainer = MemOPDTrainer(
        model=make_tiny_model(seed=0),
        teacher_model=make_tiny_model(seed=1, attn_implementation="flex_attention"),
        args=make_config(tmp_path),
        train_dataset=world.records,
        env_factory=env_factory,
        processing_class=tiny_tokenizer,
    )
    assert trainer.args.share_prefix and not trainer.share_prefix and not trainer.collator.share_prefix


def _first_update_log_ratios(trainer, student, batch) -> torch.Tensor:
    """The PPO log-ratios `log p - log p_old` of every action token at the first update of `batch` (no backward)."""
    seen = []
    ppo = trainer_module.ppo_clip_loss

    def spy(logprobs, old_logprobs, *args, **kwargs):
        seen.append((logprobs - old_logprobs).detach())
        return ppo(logprobs, old_logprobs, *args, **kwargs)

    trainer_module.ppo_clip_loss = spy
    try:
        trainer._batch_loss(student, batch)
    finally:
        trainer_module.ppo_clip_loss = ppo
    return torch.cat(seen)


@pytest.mark.parametrize("correct", [True, False], ids=["corrected", "uncorrected"])
def test_importance_sampling_correction_starts_ppo_at_ratio_one_and_weights_the_engine_gap(
    tmp_path, world, make_tiny_model, tiny_tokenizer, correct
):
    # An engine whose log-probs are off the student's (vLLM's kernels and dtype; here recorded log-probs shifted by
    # known amounts): with the correction, PPO's old log-probs are the student's own, so the first update's ratio is
    # exactly 1, and each token's loss is weighted by the engine/student probability ratio, capped as TRL's GRPO caps
    # it. Without it, the first ratio absorbs the gap.
    from memopd_trl.scoring import full_logits_action_logprobs

    student = make_tiny_model(seed=0)
    config = make_config(
        tmp_path, distill_coef=0.0, num_generations=4, importance_sampling_correction=correct,
        importance_sampling_mode="token_truncate", importance_sampling_clip_max=2.0,
    )  # fmt: skip
    trainer = MemOPDTrainer(
        model=student, args=config, train_dataset=world.records, env_factory=LengthRewardEnv.factory(),
        processing_class=tiny_tokenizer,
    )  # fmt: skip
    rollout = trainer._rollout(world.records[:2])
    shifts = torch.tensor([-1.0, 0.3, 0.0])  # ratios e (capped to 2), e^-0.3, 1
    offset = 0
    for inv in rollout.invocations:
        inv.logprobs = [lp + shifts[(offset + k) % 3].item() for k, lp in enumerate(inv.logprobs)]
        offset += len(inv.logprobs)
    engine = torch.tensor([lp for inv in rollout.invocations for lp in inv.logprobs])
    batch = trainer._score(rollout)
    ratios = _first_update_log_ratios(trainer, student, batch)
    if not correct:
        assert batch.sampling_weights is None and torch.equal(batch.old_logprobs, engine)
        assert ratios.abs().max() > 0.25, "uncorrected, the engine's gap shows in PPO's first ratio"
        return
    with torch.no_grad():
        own = full_logits_action_logprobs(student, rollout.invocations, temperature=1.0)  # each invocation alone
    torch.testing.assert_close(batch.old_logprobs, own, atol=1e-5, rtol=0)
    assert torch.equal(batch.sampling_logprobs, engine)
    torch.testing.assert_close(batch.sampling_weights, (batch.old_logprobs - engine).exp().clamp(max=2.0))
    assert batch.sampling_weights.max() == 2.0 and batch.sampling_weights.min() < 0.8, "capped and uncapped weights"
    assert torch.equal(ratios, torch.zeros_like(ratios)), "the first update's PPO ratio is exactly 1"
    trainer._metrics["train"].clear()
    trainer._score(rollout)
    logged = trainer._metrics["train"]
    assert logged["sampling/importance_sampling_ratio/max"] == [2.0]
    assert logged["sampling/sampling_logp_difference/max"][0] == pytest.approx(1.0, abs=1e-4)


def test_importance_sampling_correction_is_on_by_default_with_vllm_only(tmp_path):
    assert make_config(tmp_path).importance_sampling_correction is None  # resolved by the trainer: `use_vllm`
    with pytest.raises(ValueError, match="`importance_sampling_mode` must be one of"):
        make_config(tmp_path, importance_sampling_mode="token")
    with pytest.raises(ValueError, match="`importance_sampling_clip_max` must be None or > 0"):
        make_config(tmp_path, importance_sampling_clip_max=0.0)


def test_distill_warmup_steps_distill_the_teachers_episodes_without_their_branch_points_until_then(
    tmp_path, world, env_factory, make_tiny_model, tiny_tokenizer
):
    import math

    from memopd_trl.scoring import full_logits_action_logprobs

    student = make_tiny_model(seed=0)
    teacher = near_copy(student, seed=1, scale=0.5)
    config = make_config(
        tmp_path, num_generations=2, teacher_generations=2, distill_warmup_steps=1, distill_divergence_threshold=0.1,
        temperature=1.3, misalignment_audit_steps=0,
    )  # fmt: skip
    trainer = MemOPDTrainer(
        model=student, teacher_model=teacher, args=config, train_dataset=world.records, env_factory=env_factory,
        processing_class=tiny_tokenizer,
    )  # fmt: skip
    metrics = trainer._metrics["train"]
    for step in (0, 1):  # in the warm-up, then after it
        trainer.state.global_step = step
        batch = trainer._prepare_inputs(world.records[:2])
        play = batch.teacher_play
        metrics.clear()
        trainer._batch_loss(student, batch)
        distill, played = metrics["loss/distill"][0], metrics["loss/distill_teacher_play"][0]
        if step == 1:
            assert play.distill_mask is None
            assert distill != pytest.approx(played, rel=1e-3), "after the warm-up the student's episodes count again"
            continue
        # The student's own episodes are left out: the distillation is the teacher's episodes' alone...
        assert distill == pytest.approx(played, rel=1e-5)
        # ... each without its first token the student gives < 0.1 (its branch point), every other token kept.
        with torch.no_grad():
            logprobs = full_logits_action_logprobs(student, play.invocations, temperature=1.3)
        expected, position = [], 0
        for key in dict.fromkeys((inv.group_id, inv.episode_id) for inv in play.invocations):
            count = sum(len(inv.output_ids) for inv in play.invocations if (inv.group_id, inv.episode_id) == key)
            below = [i for i in range(count) if logprobs[position + i] < math.log(0.1)]
            expected += [not below or i != below[0] for i in range(count)]
            position += count
        assert play.distill_mask.tolist() == expected and not all(expected), "the check needs a branch point"
    with pytest.raises(ValueError, match="`distill_warmup_steps` .* but `teacher_generations` is 0"):
        make_config(tmp_path, distill_warmup_steps=1, teacher_generations=0, distill_divergence_threshold=0.1)
    with pytest.raises(ValueError, match="`distill_divergence_threshold`, which is 0"):
        make_config(tmp_path, distill_warmup_steps=1, teacher_generations=1)
    with pytest.raises(ValueError, match="`distill_warmup_steps` must be >= 0"):
        make_config(tmp_path, distill_warmup_steps=-1)


def test_distill_divergence_scope_none_keeps_the_warm_ups_branch_points_and_then_distills_every_token(
    tmp_path, world, env_factory, make_tiny_model, tiny_tokenizer
):
    student = make_tiny_model(seed=0)
    teacher = near_copy(student, seed=1, scale=0.5)
    for scope in ("episode", "none"):
        config = make_config(
            tmp_path, num_generations=2, teacher_generations=1, distill_warmup_steps=1, distill_divergence_threshold=0.1,
            distill_divergence_scope=scope, temperature=1.3, misalignment_audit_steps=0,
        )  # fmt: skip
        trainer = MemOPDTrainer(
            model=student, teacher_model=teacher, args=config, train_dataset=world.records, env_factory=env_factory,
            processing_class=tiny_tokenizer,
        )  # fmt: skip
        batch = trainer._prepare_inputs(world.records[:2])  # step 0: the warm-up
        assert not batch.distill_mask.any(), "the warm-up leaves the student's episodes out"
        assert not batch.teacher_play.distill_mask.all(), "and each teacher episode's branch point (the check needs one)"
        trainer.state.global_step = 1  # released
        batch = trainer._prepare_inputs(world.records[:2])
        assert batch.teacher_play.distill_mask is None
        if scope == "none":
            assert batch.distill_mask is None, "every token of the student's episodes"
        else:
            assert not batch.distill_mask.all(), "the episode's first divergence stops it (the check needs one)"
    with pytest.raises(ValueError, match='`distill_divergence_scope="none"` .* but `distill_warmup_steps` is 0'):
        make_config(tmp_path, distill_divergence_threshold=0.1, distill_divergence_scope="none")


def test_distill_warmup_kl_coef_holds_the_student_to_its_start_during_the_warm_up_only(
    tmp_path, world, env_factory, make_tiny_model, tiny_tokenizer
):
    student = make_tiny_model(seed=0)
    teacher = near_copy(student, seed=1, scale=0.5)
    config = make_config(
        tmp_path, num_generations=2, teacher_generations=1, distill_warmup_steps=1, distill_divergence_threshold=0.1,
        distill_warmup_kl_coef=0.5, temperature=1.3, misalignment_audit_steps=0,
    )  # fmt: skip
    trainer = MemOPDTrainer(
        model=student, teacher_model=teacher, args=config, train_dataset=world.records, env_factory=env_factory,
        processing_class=tiny_tokenizer,
    )  # fmt: skip
    assert trainer.ref_model is not None, "the warm-up's KL needs the frozen start"
    metrics, losses = trainer._metrics["train"], []
    for step in (0, 1):  # in the warm-up, then after it (kl_coef is 0)
        trainer.state.global_step = step
        batch = trainer._prepare_inputs(world.records[:2])
        with torch.no_grad():  # the student moved away from its start, so the KL is not 0
            for param in student.parameters():
                param.add_(0.05 * torch.randn_like(param))
        metrics.clear()
        losses.append(trainer._batch_loss(student, batch).item())
        if step == 0:
            assert batch.ref_logprobs is not None and metrics["kl_ref"][0] > 0
            batch.ref_logprobs = None
            without = trainer._batch_loss(student, batch).item()
            assert losses[0] == pytest.approx(without + 0.5 * metrics["kl_ref"][0], rel=1e-4)
        else:
            assert batch.ref_logprobs is None and "kl_ref" not in metrics
    with pytest.raises(ValueError, match="`distill_warmup_kl_coef` .* but `distill_warmup_steps` is 0"):
        make_config(tmp_path, distill_warmup_kl_coef=1.0)


def test_distill_warmup_anchor_coef_is_the_starts_full_vocabulary_kl_on_the_students_own_episodes(
    tmp_path, world, env_factory, make_tiny_model, tiny_tokenizer
):
    student = make_tiny_model(seed=0)
    teacher = near_copy(student, seed=1, scale=0.5)
    config = make_config(
        tmp_path, num_generations=2, teacher_generations=1, distill_warmup_steps=1, distill_divergence_threshold=0.1,
        distill_warmup_anchor_coef=2.0, temperature=1.3, misalignment_audit_steps=0,
    )  # fmt: skip
    trainer = MemOPDTrainer(
        model=student, teacher_model=teacher, args=config, train_dataset=world.records, env_factory=env_factory,
        processing_class=tiny_tokenizer,
    )  # fmt: skip
    assert trainer.ref_model is not None, "the anchor needs the frozen start"
    start = trainer.accelerator.unwrap_model(trainer.ref_model)
    metrics, rollouts, rollout = trainer._metrics["train"], [], trainer._rollout
    trainer._rollout = lambda records: rollouts.append(rollout(records)) or rollouts[-1]
    for step in (0, 1):  # in the warm-up, then after it
        trainer.state.global_step = step
        batch = trainer._prepare_inputs(world.records[:2])
        with torch.no_grad():  # the student moved away from its start
            for param in student.parameters():
                param.add_(0.5 * torch.randn_like(param))  # far enough that KL(p || q) and KL(q || p) differ
        metrics.clear()
        loss = trainer._batch_loss(student, batch).item()
        if step == 1:
            assert batch.anchor is None and "loss/anchor" not in metrics
            continue
        # KL(start || student) over the vocabulary at each of the student's own action tokens, from plain forwards.
        expected = []
        with torch.no_grad():
            for inv in rollouts[-1].invocations:
                ids = torch.tensor([inv.input_ids + inv.output_ids])
                cut = slice(len(inv.input_ids) - 1, -1)
                p = start(input_ids=ids).logits[0, cut, : trainer.vocab_size].float().log_softmax(-1)
                q = student(input_ids=ids).logits[0, cut, : trainer.vocab_size].float().log_softmax(-1)
                expected.append((p.exp() * (p - q)).sum(-1))
        anchor = metrics["loss/anchor"][0]
        assert anchor > 0 and anchor == pytest.approx(torch.cat(expected).mean().item(), rel=1e-3)
        batch.anchor = None
        without = trainer._batch_loss(student, batch).item()
        assert loss == pytest.approx(without + 2.0 * anchor, rel=1e-4)
    with pytest.raises(ValueError, match="`distill_warmup_anchor_coef` .* but `distill_warmup_steps` is 0"):
        make_config(tmp_path, distill_warmup_anchor_coef=1.0)
    with pytest.raises(ValueError, match="`distill_warmup_anchor_coef` must be >= 0"):
        make_config(tmp_path, distill_warmup_steps=1, teacher_generations=1, distill_divergence_threshold=0.1,
                    distill_warmup_anchor_coef=-1.0)  # fmt: skip


def test_distill_warmup_release_loss_ends_the_warm_up_once_the_teacher_play_loss_is_low_and_a_resume_keeps_it(
    tmp_path, world, env_factory, make_tiny_model, tiny_tokenizer
):
    warm = dict(num_generations=2, teacher_generations=1, distill_warmup_steps=100, distill_divergence_threshold=0.1,
                distill_warmup_anchor_coef=1.0, misalignment_audit_steps=0, max_steps=5, temperature=1.3,
                save_strategy="steps", save_steps=1)  # fmt: skip

    def run(output, release_loss, resume=None, callbacks=None):
        trainer = MemOPDTrainer(
            model=make_tiny_model(seed=0), teacher_model=make_tiny_model(seed=1),
            args=make_config(tmp_path, output_dir=str(tmp_path / output), distill_warmup_release_loss=release_loss,
                             **warm),
            train_dataset=world.records, env_factory=env_factory, processing_class=tiny_tokenizer, callbacks=callbacks,
        )  # fmt: skip
        trainer.train(resume_from_checkpoint=resume)
        logs = [h for h in trainer.state.log_history if "distill/warmup" in h]
        return trainer, [h["distill/warmup"] for h in logs], [h.get("loss/anchor") for h in logs]

    # Every step is a new rollout (num_iterations=1): three measured rollouts, then a loss below any bound releases.
    trainer, warmup, anchor = run("released", release_loss=1e3)
    assert warmup == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert all(a is not None for a in anchor[:3]) and anchor[3:] == [None, None], "the anchor ends with the warm-up"
    # It waited on the loss of the last three rollouts in their worst turn: the turns' token-weighted means.
    logged = [h for h in trainer.state.log_history if "distill/warmup" in h][:3]
    window = trainer._release_losses
    assert len(window) == 3 and all(len(by_turn) >= 2 for by_turn in window), "a loss for each turn of the teacher's"
    for entry, by_turn in zip(logged, window, strict=True):
        assert {f"distill/teacher_play_turn_{t}": total / n for t, (total, n) in by_turn.items()} == pytest.approx(
            {k: v for k, v in entry.items() if k.startswith("distill/teacher_play_turn_")}, rel=1e-4)
        tokens = sum(n for _, n in by_turn.values())
        mean = sum(total for total, _ in by_turn.values()) / tokens
        assert entry["loss/distill_teacher_play"] == pytest.approx(mean, rel=1e-4), "the turns add up to the loss"
    turns = {t for by_turn in window for t in by_turn}
    worst = max(sum(w[t][0] for w in window if t in w) / sum(w[t][1] for w in window if t in w) for t in turns)
    assert trainer._release_loss() == pytest.approx(worst) and worst > min(
        sum(w[t][0] for w in window if t in w) / sum(w[t][1] for w in window if t in w) for t in turns)
    _, warmup, _ = run("held", release_loss=1e-9)  # a bound the loss does not reach: the warm-up goes on
    assert warmup == [1.0] * 5
    # A resume after the release does not go back into the warm-up.
    run("interrupted", release_loss=1e3, callbacks=[StopAfter(4)])
    _, warmup, _ = run("interrupted", release_loss=1e3, resume=str(tmp_path / "interrupted" / "checkpoint-4"))
    assert warmup == [1.0, 1.0, 1.0, 0.0, 0.0]  # steps 1-4 from the checkpoint's history, step 5 resumed
    assert make_config(tmp_path, distill_warmup_release_loss=0.2).distill_warmup_release_loss == 0.2  # no warm-up to end
    with pytest.raises(ValueError, match="`distill_warmup_release_loss` must be >= 0"):
        make_config(tmp_path, **{**warm, "distill_warmup_release_loss": -1.0})
