"""Trainer-side faults and the GAE option: a bad update never reaches the weights, a value head trains and resumes."""

import copy
import warnings

import pytest
import torch
from safetensors.torch import load_file
from test_trainer import LengthRewardEnv, changed, losses_logged, make_config, params_of

from memopd_trl import HotpotQAEnv, MemOPDTrainer, PackedInvocationCollator
from memopd_trl.envs.retrieval import corpus_from_records
from memopd_trl.losses import gae_advantages
from memopd_trl.trainer import VALUE_HEAD_FILE


def test_non_finite_teacher_scores_skip_the_update_and_keep_weights_finite(
    tmp_path, world, env_factory, make_tiny_model, tiny_tokenizer
):
    student, teacher = make_tiny_model(seed=0), make_tiny_model(seed=1)
    with torch.no_grad():
        teacher.get_output_embeddings().weight[3, 0] = float("nan")  # NaN teacher log-probs everywhere
    before = params_of(student)
    trainer = MemOPDTrainer(
        model=student,
        teacher_model=teacher,
        args=make_config(tmp_path, max_steps=2, learning_rate=1e-2),
        train_dataset=world.records,
        env_factory=env_factory,
        processing_class=tiny_tokenizer,
    )
    with pytest.warns(UserWarning, match="Non-finite loss"), pytest.raises(RuntimeError, match="Every optimizer update"):
        trainer.train()
    assert trainer.num_skipped_updates == 2
    assert losses_logged(trainer, "skipped_updates") == [1.0, 2.0]
    assert not changed(before, student), "a skipped update must not move the weights (not even by Adam momentum)"
    assert all(torch.isfinite(p).all() for p in student.parameters())
    assert trainer.state.global_step == 2, "training goes on after a skipped update"


def test_a_bad_update_between_good_ones_is_skipped_but_the_good_ones_apply(
    tmp_path, world, env_factory, make_tiny_model, tiny_tokenizer
):
    student, teacher = make_tiny_model(seed=0), make_tiny_model(seed=1)
    trainer = MemOPDTrainer(
        model=student,
        teacher_model=teacher,
        args=make_config(tmp_path, max_steps=3, learning_rate=1e-2),
        train_dataset=world.records,
        env_factory=env_factory,
        processing_class=tiny_tokenizer,
    )
    score = trainer._score
    snapshots = {}

    def poison_second_batch(rollout):
        batch = score(rollout)
        snapshots[trainer.state.global_step] = params_of(student)
        if trainer.state.global_step == 1:
            batch.teacher.hidden = torch.full_like(batch.teacher.hidden, float("inf"))
        return batch

    trainer._score = poison_second_batch
    with pytest.warns(UserWarning, match="Non-finite loss"):
        trainer.train()
    assert trainer.num_skipped_updates == 1
    first, poisoned, last = snapshots[0], snapshots[1], snapshots[2]
    assert any(not torch.equal(first[n], poisoned[n]) for n in first), "the first (good) update did not apply"
    assert all(torch.equal(poisoned[n], last[n]) for n in poisoned), "the poisoned update moved the weights"
    assert changed(last, student), "the third (good) update did not apply"
    assert all(torch.isfinite(p).all() for p in student.parameters())


def test_gae_trains_a_value_head_and_saves_it_as_safetensors(tmp_path, world, make_tiny_model, tiny_tokenizer):
    student = make_tiny_model(seed=0)
    before = params_of(student)
    trainer = MemOPDTrainer(
        model=student,
        args=make_config(
            tmp_path, distill_coef=0.0, advantage_estimator="gae", num_generations=2, max_steps=2, temperature=1.5
        ),
        train_dataset=world.records,
        env_factory=LengthRewardEnv.factory(),
        processing_class=tiny_tokenizer,
    )
    head_before = {k: v.clone() for k, v in trainer.value_head.state_dict().items()}
    trainer.train()
    assert losses_logged(trainer, "loss/value"), "the value loss was not logged"
    assert any(not torch.equal(head_before[k], v) for k, v in trainer.value_head.state_dict().items())
    assert changed(before, student)
    trainer.save_model(str(tmp_path / "saved"))
    saved = load_file(str(tmp_path / "saved" / VALUE_HEAD_FILE))
    for key, value in trainer.value_head.state_dict().items():
        torch.testing.assert_close(saved[key], value)


def test_a_batch_where_no_episode_reaches_the_model_skips_the_update(
    tmp_path, world, env_factory, make_tiny_model, tiny_tokenizer
):
    student = make_tiny_model(seed=0)
    before = params_of(student)
    overlong = [dict(r, question=r["question"] + " and more" * 400) for r in world.records]
    trainer = MemOPDTrainer(
        model=student,
        teacher_model=make_tiny_model(seed=1),
        args=make_config(tmp_path, max_steps=1, max_prompt_length=64),
        train_dataset=overlong,
        env_factory=env_factory,
        processing_class=tiny_tokenizer,
    )
    with (
        pytest.warns(UserWarning, match="No episode of this batch reached a model call"),
        pytest.raises(RuntimeError, match="Every optimizer update"),
    ):
        trainer.train()
    assert trainer.num_skipped_updates == 1 and trainer.state.global_step == 1
    assert not changed(before, student)


def test_a_skip_asked_by_another_process_skips_the_update_here_too(
    tmp_path, world, env_factory, make_tiny_model, tiny_tokenizer
):
    # This process's batches are fine; the vote says another process asked for a skip: the update must not apply
    # here either, or the processes' weights would part ways.
    student = make_tiny_model(seed=0)
    before = params_of(student)
    trainer = MemOPDTrainer(
        model=student,
        teacher_model=make_tiny_model(seed=1),
        args=make_config(tmp_path, max_steps=2),
        train_dataset=world.records,
        env_factory=env_factory,
        processing_class=tiny_tokenizer,
    )
    reduce = trainer.accelerator.reduce
    votes = []

    def another_process_asks(tensor, reduction="sum"):
        votes.append(float(tensor))
        return reduce(tensor, reduction) + 1.0

    trainer.accelerator.reduce = another_process_asks
    with pytest.raises(RuntimeError, match="Every optimizer update"):
        trainer.train()
    assert votes == [0.0, 0.0], "this process did not ask, and voted at every optimizer step"
    assert trainer.num_skipped_updates == 2 and losses_logged(trainer, "skipped_updates") == [1.0, 2.0]
    assert not changed(before, student), "an update skipped by the vote moved the weights"
    assert all(torch.isfinite(torch.tensor(losses_logged(trainer, "loss/distill"))))


def test_batched_gae_equals_gae_run_on_each_episode_alone(tmp_path, world, env_factory, make_tiny_model, tiny_tokenizer):
    trainer = MemOPDTrainer(
        model=make_tiny_model(seed=0),
        args=make_config(tmp_path, distill_coef=0.0, advantage_estimator="gae", num_generations=2, gamma=0.9, lam=0.8),
        train_dataset=world.records,
        env_factory=env_factory,
        processing_class=tiny_tokenizer,
    )
    with torch.no_grad():  # a value head that says something (it starts at zero)
        torch.nn.init.normal_(trainer.value_head.weight, generator=torch.Generator().manual_seed(0))
    rollout = trainer._rollout(world.records[:3])
    for i, episode in enumerate(rollout.episodes):
        episode.reward = 0.25 * i
        if i % 2:  # episodes of different lengths: the batched GAE pads them
            episode.invocations = episode.invocations[:1]
    lengths = [sum(len(inv.output_ids) for inv in ep.invocations) for ep in rollout.episodes]
    assert len(set(lengths)) > 1
    batch = trainer._score(rollout)

    advantages, returns = [], []  # one episode at a time, as a 1-D sequence of its action tokens
    for episode, values in zip(rollout.episodes, batch.old_values.split(lengths), strict=True):
        rewards = torch.zeros_like(values)
        rewards[-1:] = episode.reward
        adv, ret = gae_advantages(rewards, values, gamma=0.9, lam=0.8)
        advantages.append(adv)
        returns.append(ret)
    assert torch.equal(batch.advantages, torch.cat(advantages))
    assert torch.equal(batch.returns, torch.cat(returns))


def test_value_head_gradients_are_cleared_after_every_optimizer_step(tmp_path, world, make_tiny_model, tiny_tokenizer):
    # transformers clears gradients with `model.zero_grad()`; the value head lives beside the model, not in it.
    from transformers import TrainerCallback

    trainer = MemOPDTrainer(
        model=make_tiny_model(seed=0),
        args=make_config(
            tmp_path, distill_coef=0.0, advantage_estimator="gae", num_generations=2, max_steps=3, temperature=1.5
        ),
        train_dataset=world.records,
        env_factory=LengthRewardEnv.factory(),
        processing_class=tiny_tokenizer,
    )
    left_over = []

    class AfterEachStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            student_grads = [p.grad for p in trainer.model.parameters()]
            assert all(g is None or not g.any() for g in student_grads), "the check needs the model's grads cleared"
            left_over.append([p.grad for p in trainer.value_head.parameters()])

    trainer.add_callback(AfterEachStep())
    trainer.train()
    assert losses_logged(trainer, "loss/value")
    assert len(left_over) == 3
    assert all(g is None or not g.any() for grads in left_over for g in grads), "value-head gradients carried over"


# ----- mistakes a user makes: clear errors at construction, no silent no-op ------------------------------------------
def test_fewer_records_than_one_batch_is_an_error_naming_the_sizes(tmp_path, world, env_factory, make_tiny_model, tiny_tokenizer):
    # The sampler yields whole batches only: 4 records and batches of 5 used to train zero steps without a word.
    with pytest.raises(ValueError, match=r"has 4 records.*5 = per_device_train_batch_size \(5\) x processes \(1\) x gradient_accumulation_steps \(1\)"):
        MemOPDTrainer(
            model=make_tiny_model(seed=0),
            teacher_model=make_tiny_model(seed=1),
            args=make_config(tmp_path, per_device_train_batch_size=5),
            train_dataset=world.records[:4],
            env_factory=env_factory,
            processing_class=tiny_tokenizer,
        )
    with pytest.raises(ValueError, match=r"has 4 records.*6 = per_device_train_batch_size \(2\) .* gradient_accumulation_steps \(3\)"):
        MemOPDTrainer(
            model=make_tiny_model(seed=0),
            args=make_config(tmp_path, distill_coef=0.0, gradient_accumulation_steps=3),
            train_dataset=world.records[:4],
            env_factory=env_factory,
            processing_class=tiny_tokenizer,
        )


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda r: {k: v for k, v in r.items() if k != "answer"}, "has no 'answer' field"),
        (lambda r: dict(r, answer=1912), "field 'answer' must be a string, got int"),
    ],
    ids=["missing-answer", "int-answer"],
)
def test_invalid_records_are_rejected_up_front_naming_the_record_and_the_field(
    tmp_path, hotpot_sample_records, make_tiny_model, tiny_tokenizer, change, match
):
    # Such records used to fail every episode, skip every update, and end the run as a success.
    records = hotpot_sample_records[:6]
    env_factory = HotpotQAEnv.factory(corpus=corpus_from_records(records), top_k=1, max_turns=2, system_prompt="Act.")
    bad = [change(r) if i >= 2 else r for i, r in enumerate(records)]
    record_id = records[2]["_id"]
    kwargs = dict(
        model=make_tiny_model(seed=0),
        args=make_config(tmp_path, distill_coef=0.0),
        env_factory=env_factory,
        processing_class=tiny_tokenizer,
    )
    with pytest.raises(ValueError, match=rf"4 of the 6 records of `train_dataset`.*`train_dataset`\[2\]: Record '{record_id}'.*{match}"):
        MemOPDTrainer(train_dataset=bad, **kwargs)
    with pytest.raises(ValueError, match=rf"`eval_dataset`\[2\]: Record '{record_id}'.*{match}"):
        MemOPDTrainer(train_dataset=records, eval_dataset=bad, **kwargs)
    trainer = MemOPDTrainer(train_dataset=records, **kwargs)
    with pytest.raises(ValueError, match=rf"`eval_dataset`\[2\]: Record '{record_id}'.*{match}"):
        trainer.evaluate(bad)


def test_a_run_where_every_update_was_skipped_ends_with_an_error(
    tmp_path, world, env_factory, make_tiny_model, tiny_tokenizer
):
    # Every question is too long for `max_prompt_length`: no episode reaches the model, both updates are skipped.
    student = make_tiny_model(seed=0)
    before = params_of(student)
    overlong = [dict(r, question=r["question"] + " and more" * 400) for r in world.records]
    trainer = MemOPDTrainer(
        model=student,
        args=make_config(tmp_path, distill_coef=0.0, max_steps=2, max_prompt_length=64),
        train_dataset=overlong,
        env_factory=env_factory,
        processing_class=tiny_tokenizer,
    )
    with (
        pytest.warns(UserWarning, match="No episode of this batch reached a model call"),
        pytest.raises(RuntimeError, match=r"Every optimizer update of this run was skipped \(2 of 2\).*No episode of this batch"),
    ):
        trainer.train()
    assert trainer.state.global_step == 2 and not changed(before, student)


def test_evaluate_with_no_scored_episode_raises_instead_of_reporting_zero(
    tmp_path, world, env_factory, make_tiny_model, tiny_tokenizer
):
    overlong = [dict(r, question=r["question"] + " and more" * 400) for r in world.records[:3]]
    trainer = MemOPDTrainer(
        model=make_tiny_model(seed=0),
        args=make_config(tmp_path, distill_coef=0.0, max_prompt_length=256),
        train_dataset=world.records,
        eval_dataset=overlong,
        env_factory=env_factory,
        processing_class=tiny_tokenizer,
    )
    with pytest.raises(RuntimeError, match=r"scored no episode: all 3 episodes failed.*max_prompt_length"):
        trainer.evaluate()
    assert trainer.model.training, "the model is left in training mode"
    # One scored episode is enough for a score; the failed ones count 0 and are reported.
    metrics = trainer.evaluate([*overlong[:2], world.records[0]])
    assert metrics["eval_num_episodes"] == 3 and metrics["eval_num_failed_episodes"] == 2
    assert 0.0 <= metrics["eval_f1"] <= 1 / 3


def test_training_low_precision_weights_is_warned_about(tmp_path, world, env_factory, make_tiny_model, tiny_tokenizer):
    kwargs = dict(args=make_config(tmp_path, distill_coef=0.0), train_dataset=world.records, env_factory=env_factory,
                  processing_class=tiny_tokenizer)  # fmt: skip
    with pytest.warns(UserWarning, match=r"trainable weights are stored in bfloat16.*rounds to nothing.*float32"):
        MemOPDTrainer(model=make_tiny_model(seed=0).to(torch.bfloat16), **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        MemOPDTrainer(model=make_tiny_model(seed=0), **kwargs)
    assert not [w for w in caught if "trainable weights are stored" in str(w.message)]


def test_a_tokenizer_with_neither_pad_nor_eos_token_is_a_clear_error(
    tmp_path, world, env_factory, make_tiny_model, tiny_tokenizer
):
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.pad_token = None
    tokenizer.eos_token = None
    assert tokenizer.pad_token_id is None and tokenizer.eos_token_id is None
    with pytest.raises(ValueError, match="neither a pad token nor an EOS token"):
        MemOPDTrainer(
            model=make_tiny_model(seed=0),
            args=make_config(tmp_path, distill_coef=0.0),
            train_dataset=world.records,
            env_factory=env_factory,
            processing_class=tokenizer,
        )
    with pytest.raises(ValueError, match="`pad_token_id` is None: the tokenizer has no pad token"):
        PackedInvocationCollator(pad_token_id=tokenizer.pad_token_id)
