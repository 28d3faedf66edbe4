import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memopd_trl.losses import (
    broadcast_to_tokens,
    chunked_generalized_jsd,
    distillation_diagnostics,
    gae_advantages,
    generalized_jsd_loss,
    group_normalized_advantages,
    kl_penalty,
    ppo_clip_loss,
    sampled_kl_advantages,
    until_first_divergence,
    value_loss,
)


os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
from trl.experimental.gkd.gkd_trainer import GKDTrainer  # noqa: E402


trl_generalized_jsd_loss = GKDTrainer.generalized_jsd_loss

BETAS = [0.0, 0.3, 0.5, 1.0]
REDUCTIONS = ["batchmean", "sum", "mean", "none"]


def random_logits(*shape, seed=0, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    return 3.0 * torch.randn(*shape, generator=generator, dtype=dtype)


def random_labels(batch_size, seq_len, seed=0):
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 50, (batch_size, seq_len), generator=generator)
    labels[torch.rand(batch_size, seq_len, generator=generator) < 0.4] = -100
    labels[0, 0] = 7  # at least one kept token
    return labels


# ----------------------------------------------------------------------------------------------------------------------
# generalized_jsd_loss
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("with_labels", [False, True])
def test_generalized_jsd_loss_equals_trl_values_and_gradients(beta, temperature, reduction, with_labels):
    student = random_logits(3, 5, 11, seed=1).requires_grad_()
    teacher = random_logits(3, 5, 11, seed=2)
    labels = random_labels(3, 5, seed=3) if with_labels else None

    ours = generalized_jsd_loss(
        student, teacher, labels=labels, beta=beta, temperature=temperature, reduction=reduction
    )
    theirs = trl_generalized_jsd_loss(
        student, teacher, labels=labels, beta=beta, temperature=temperature, reduction=reduction
    )

    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)
    assert ours.sum().item() > 0
    (our_grad,) = torch.autograd.grad(ours.sum(), student)
    (their_grad,) = torch.autograd.grad(theirs.sum(), student)
    torch.testing.assert_close(our_grad, their_grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("beta", BETAS)
def test_generalized_jsd_loss_num_items_in_batch_equals_trl(beta):
    student, teacher = random_logits(2, 4, 9, seed=4), random_logits(2, 4, 9, seed=5)
    labels = random_labels(2, 4, seed=6)
    ours = generalized_jsd_loss(student, teacher, labels=labels, beta=beta, num_items_in_batch=torch.tensor(13))
    theirs = trl_generalized_jsd_loss(student, teacher, labels=labels, beta=beta, num_items_in_batch=torch.tensor(13))
    torch.testing.assert_close(ours, theirs)


def test_generalized_jsd_loss_endpoints_are_forward_and_reverse_kl():
    student, teacher = random_logits(6, 7, seed=7), random_logits(6, 7, seed=8)
    p_student, p_teacher = student.softmax(-1), teacher.softmax(-1)
    forward_kl = (p_teacher * (p_teacher.log() - p_student.log())).sum(-1)  # KL(teacher || student), (6,)
    reverse_kl = (p_student * (p_student.log() - p_teacher.log())).sum(-1)  # KL(student || teacher), (6,)

    per_token_forward = generalized_jsd_loss(student, teacher, beta=0.0, reduction="none").sum(-1)
    per_token_reverse = generalized_jsd_loss(student, teacher, beta=1.0, reduction="none").sum(-1)

    torch.testing.assert_close(per_token_forward, forward_kl)
    torch.testing.assert_close(per_token_reverse, reverse_kl)
    assert not torch.allclose(forward_kl, reverse_kl)


def test_generalized_jsd_loss_mixture_matches_definition_and_is_symmetric_at_half():
    student, teacher = random_logits(4, 6, seed=9), random_logits(4, 6, seed=10)
    p_student, p_teacher = student.softmax(-1), teacher.softmax(-1)
    beta = 0.3
    mixture = (1 - beta) * p_student + beta * p_teacher

    def kl(p, q):
        return (p * (p.log() - q.log())).sum(-1)

    expected = beta * kl(p_teacher, mixture) + (1 - beta) * kl(p_student, mixture)
    per_token = generalized_jsd_loss(student, teacher, beta=beta, reduction="none").sum(-1)
    torch.testing.assert_close(per_token, expected)

    half = generalized_jsd_loss(student, teacher, beta=0.5, reduction="sum")
    half_swapped = generalized_jsd_loss(teacher, student, beta=0.5, reduction="sum")
    torch.testing.assert_close(half, half_swapped)
    assert half.item() <= math.log(2) * 4  # the JSD is bounded by log 2 per token


def test_generalized_jsd_loss_is_zero_for_identical_distributions():
    logits = random_logits(2, 3, 10, seed=11)
    for beta in BETAS:
        assert generalized_jsd_loss(logits, logits + 5.0, beta=beta).abs().item() < 1e-12  # shift-invariant softmax


def test_generalized_jsd_loss_reductions_relate_as_documented():
    student, teacher = random_logits(2, 5, 8, seed=12), random_logits(2, 5, 8, seed=13)
    labels = random_labels(2, 5, seed=14)
    kept = int((labels != -100).sum())
    terms = generalized_jsd_loss(student, teacher, labels=labels, reduction="none")
    assert terms.shape == (kept, 8)
    total = generalized_jsd_loss(student, teacher, labels=labels, reduction="sum")
    torch.testing.assert_close(generalized_jsd_loss(student, teacher, labels=labels), total / kept)
    torch.testing.assert_close(
        generalized_jsd_loss(student, teacher, labels=labels, reduction="mean"), total / (kept * 8)
    )
    # Without labels, "batchmean" divides by the first dimension, as TRL does.
    torch.testing.assert_close(
        generalized_jsd_loss(student, teacher), generalized_jsd_loss(student, teacher, reduction="sum") / 2
    )


@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean"])
def test_generalized_jsd_loss_all_masked_gives_zero_not_nan(reduction):
    student = random_logits(2, 3, 5, seed=15).requires_grad_()
    labels = torch.full((2, 3), -100)
    loss = generalized_jsd_loss(student, random_logits(2, 3, 5, seed=16), labels=labels, reduction=reduction)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(student.grad, torch.zeros_like(student))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"beta": -0.1}, "beta"),
        ({"beta": 1.5}, "beta"),
        ({"temperature": 0.0}, "temperature"),
        ({"reduction": "avg"}, "reduction"),
        ({"labels": torch.zeros(2, 4, dtype=torch.long)}, "labels"),
    ],
)
def test_generalized_jsd_loss_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        generalized_jsd_loss(random_logits(2, 3, 5), random_logits(2, 3, 5), **kwargs)


def test_generalized_jsd_loss_rejects_mismatched_logits():
    with pytest.raises(ValueError, match="teacher_logits"):
        generalized_jsd_loss(random_logits(2, 3, 5), random_logits(2, 3, 6))


# ----------------------------------------------------------------------------------------------------------------------
# chunked_generalized_jsd
# ----------------------------------------------------------------------------------------------------------------------


def lm_head_inputs(num_tokens=7, student_hidden=6, teacher_hidden=5, vocab_size=23, seed=0, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return scale * torch.randn(*shape, generator=generator, dtype=dtype)

    return {
        "student_hidden": randn(num_tokens, student_hidden).requires_grad_(),
        "student_weight": randn(vocab_size, student_hidden).requires_grad_(),
        "student_bias": randn(vocab_size).requires_grad_(),
        "teacher_hidden": randn(num_tokens, teacher_hidden),
        "teacher_weight": randn(vocab_size, teacher_hidden),
        "teacher_bias": randn(vocab_size),
    }


def materialized_per_token(inputs, beta, temperature):
    student_logits = inputs["student_hidden"] @ inputs["student_weight"].T + inputs["student_bias"]  # (N, V)
    teacher_logits = inputs["teacher_hidden"] @ inputs["teacher_weight"].T + inputs["teacher_bias"]  # (N, V)
    # TRL's materialized GKD loss is the reference of the chunked one.
    terms = trl_generalized_jsd_loss(student_logits, teacher_logits, beta=beta, temperature=temperature, reduction="none")
    return terms.sum(-1)  # (N,)


STUDENT_KEYS = ("student_hidden", "student_weight", "student_bias")


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [3, 1024])
def test_chunked_generalized_jsd_equals_materialized_loss_and_gradients(beta, temperature, chunk_size):
    inputs = lm_head_inputs(seed=1)
    upstream = torch.randn(7, generator=torch.Generator().manual_seed(2), dtype=torch.float64)  # (N,)

    chunked = chunked_generalized_jsd(**inputs, beta=beta, temperature=temperature, chunk_size=chunk_size)
    reference = materialized_per_token(inputs, beta, temperature)

    assert chunked.shape == (7,)
    torch.testing.assert_close(chunked, reference, rtol=1e-10, atol=1e-12)
    chunked_grads = torch.autograd.grad((chunked * upstream).sum(), [inputs[k] for k in STUDENT_KEYS])
    reference_grads = torch.autograd.grad((reference * upstream).sum(), [inputs[k] for k in STUDENT_KEYS])
    for key, ours, expected in zip(STUDENT_KEYS, chunked_grads, reference_grads, strict=True):
        torch.testing.assert_close(ours, expected, rtol=1e-9, atol=1e-12, msg=f"gradient of {key}")


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_chunked_generalized_jsd_fp32_matches_materialized_loss(beta):
    inputs = lm_head_inputs(num_tokens=33, student_hidden=32, teacher_hidden=48, vocab_size=257, dtype=torch.float32)
    chunked = chunked_generalized_jsd(**inputs, beta=beta, chunk_size=8)
    torch.testing.assert_close(chunked, materialized_per_token(inputs, beta, 1.0), rtol=1e-4, atol=1e-5)
    chunked.sum().backward()
    chunked_grad = inputs["student_hidden"].grad.clone()
    inputs["student_hidden"].grad = None
    materialized_per_token(inputs, beta, 1.0).sum().backward()
    # Peaky distributions (logits of scale ~6): gradients reach ~10, so fp32 rounding alone is ~1e-5 in absolute terms.
    torch.testing.assert_close(chunked_grad, inputs["student_hidden"].grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_chunked_generalized_jsd_equals_trl_chunked_divergence(beta):
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    inputs = lm_head_inputs(num_tokens=9, vocab_size=40, dtype=torch.float32, seed=3)
    ours = chunked_generalized_jsd(**inputs, beta=beta, chunk_size=4)
    theirs, _ = ChunkedDivergenceFunction.apply(
        inputs["student_hidden"],
        inputs["student_weight"],
        inputs["student_bias"],
        inputs["teacher_hidden"],
        inputs["teacher_weight"],
        inputs["teacher_bias"],
        beta,
    )
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_chunked_generalized_jsd_does_not_depend_on_chunk_size():
    inputs = lm_head_inputs(num_tokens=10, seed=4)
    results = [chunked_generalized_jsd(**inputs, chunk_size=size) for size in (1, 3, 10, 64)]
    for result in results[1:]:
        torch.testing.assert_close(result, results[0], rtol=1e-12, atol=1e-14)


def test_chunked_generalized_jsd_gives_no_gradient_to_the_teacher():
    inputs = lm_head_inputs(seed=5)
    for key in ("teacher_hidden", "teacher_weight", "teacher_bias"):
        inputs[key].requires_grad_()
    chunked_generalized_jsd(**inputs).sum().backward()
    for key in ("teacher_hidden", "teacher_weight", "teacher_bias"):
        assert inputs[key].grad is None, key
    assert inputs["student_hidden"].grad.abs().sum() > 0


def test_chunked_generalized_jsd_skips_gradients_of_frozen_student_weights():
    inputs = lm_head_inputs(seed=6)
    inputs["student_weight"] = inputs["student_weight"].detach()  # e.g. a frozen LM head under LoRA
    inputs["student_bias"] = None
    inputs["teacher_bias"] = None
    chunked = chunked_generalized_jsd(**inputs, beta=0.3, chunk_size=2)
    chunked.sum().backward()
    hidden_grad = inputs["student_hidden"].grad.clone()
    inputs["student_hidden"].grad = None
    materialized = trl_generalized_jsd_loss(
        inputs["student_hidden"] @ inputs["student_weight"].T,
        inputs["teacher_hidden"] @ inputs["teacher_weight"].T,
        beta=0.3,
        reduction="none",
    ).sum(-1)
    materialized.sum().backward()
    torch.testing.assert_close(hidden_grad, inputs["student_hidden"].grad)


def test_chunked_generalized_jsd_with_no_tokens_returns_empty_tensor():
    inputs = lm_head_inputs(num_tokens=0)
    chunked = chunked_generalized_jsd(**inputs)
    assert chunked.shape == (0,)
    chunked.sum().backward()
    assert inputs["student_hidden"].grad.shape == (0, 6)
    assert torch.equal(inputs["student_weight"].grad, torch.zeros_like(inputs["student_weight"]))


def test_chunked_generalized_jsd_runs_under_cpu_autocast():
    inputs = lm_head_inputs(num_tokens=12, student_hidden=32, teacher_hidden=32, vocab_size=64, dtype=torch.float32)
    reference = materialized_per_token(inputs, 0.5, 1.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        chunked = chunked_generalized_jsd(**inputs, chunk_size=5)
    assert chunked.dtype == torch.float32
    chunked.sum().backward()
    assert inputs["student_hidden"].grad.dtype == torch.float32
    torch.testing.assert_close(chunked, reference, rtol=0.1, atol=0.05)  # bf16 LM-head matmul


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"teacher_weight": torch.zeros(24, 5, dtype=torch.float64)}, "vocabulary"),
        ({"student_weight": torch.zeros(23, 4, dtype=torch.float64)}, "hidden size"),
        ({"teacher_hidden": torch.zeros(6, 5, dtype=torch.float64)}, "tokens"),
        ({"student_bias": torch.zeros(22, dtype=torch.float64)}, "student_bias"),
        ({"student_hidden": torch.zeros(7, dtype=torch.float64)}, "2-D"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"beta": 2.0}, "beta"),
        ({"temperature": -1.0}, "temperature"),
    ],
)
def test_chunked_generalized_jsd_rejects_bad_arguments(change, message):
    inputs = {**lm_head_inputs(), **change}
    with pytest.raises(ValueError, match=message):
        chunked_generalized_jsd(**inputs)


def materialized_diagnostics(student_logits, teacher_logits) -> dict[str, torch.Tensor]:
    """The diagnostics written out plainly on `(N, V)` logits at T=1."""
    p_s, p_t = student_logits.softmax(-1), teacher_logits.softmax(-1)
    log_p_s, log_p_t = student_logits.log_softmax(-1), teacher_logits.log_softmax(-1)
    return {
        "teacher_confidence": p_t.max(-1).values,
        "agreement": (p_t.argmax(-1) == p_s.argmax(-1)).to(p_s.dtype),
        "forward_kl": torch.nn.functional.kl_div(log_p_s, log_p_t, log_target=True, reduction="none").sum(-1),
        "reverse_kl": torch.nn.functional.kl_div(log_p_t, log_p_s, log_target=True, reduction="none").sum(-1),
        "student_entropy": torch.distributions.Categorical(logits=student_logits).entropy(),
    }


@pytest.mark.parametrize("chunk_size", [1, 3, 1024])
def test_distillation_diagnostics_equal_the_materialized_quantities(chunk_size):
    inputs = {k: v.detach() for k, v in lm_head_inputs(9, 6, 6, vocab_size=31, seed=7).items()}
    # A teacher near the student on the first tokens, so that the argmaxes agree there and differ elsewhere.
    inputs["teacher_weight"] = inputs["student_weight"] + 0.1 * inputs["teacher_weight"]
    inputs["teacher_hidden"][:5] = inputs["student_hidden"][:5] + 0.1 * inputs["teacher_hidden"][:5]
    ours = distillation_diagnostics(**inputs, chunk_size=chunk_size)
    student_logits = inputs["student_hidden"] @ inputs["student_weight"].T + inputs["student_bias"]  # (N, V)
    teacher_logits = inputs["teacher_hidden"] @ inputs["teacher_weight"].T + inputs["teacher_bias"]  # (N, V)
    reference = materialized_diagnostics(student_logits, teacher_logits)
    assert list(ours) == list(reference)
    for name, values in reference.items():
        torch.testing.assert_close(ours[name], values, rtol=1e-10, atol=1e-12, msg=name)
    assert 0 < ours["agreement"].sum() < 9, "the inputs should hold tokens where the argmaxes agree and where not"
    # The KLs are the endpoints of the divergence the loss uses.
    torch.testing.assert_close(ours["forward_kl"], chunked_generalized_jsd(**inputs, beta=0.0))
    torch.testing.assert_close(ours["reverse_kl"], chunked_generalized_jsd(**inputs, beta=1.0))


def test_distillation_diagnostics_check_their_inputs_and_take_no_gradient():
    inputs = lm_head_inputs()
    assert all(not v.requires_grad for v in distillation_diagnostics(**inputs).values())
    with pytest.raises(ValueError, match="distillation_diagnostics: the student LM head has 23"):
        distillation_diagnostics(**{**inputs, "teacher_weight": torch.zeros(24, 5, dtype=torch.float64)})
    with pytest.raises(ValueError, match="chunk_size"):
        distillation_diagnostics(**inputs, chunk_size=0)


def test_sampled_kl_advantages_are_teacher_minus_sampling_logprobs():
    teacher, old = torch.tensor([-0.5, -2.0, -1.0]), torch.tensor([-1.0, -1.0, -1.0])
    assert sampled_kl_advantages(teacher, old).tolist() == [0.5, -1.0, 0.0]
    with pytest.raises(ValueError, match="`old_logprobs` has 2 entries"):
        sampled_kl_advantages(teacher, old[:2])


# ----------------------------------------------------------------------------------------------------------------------
# ppo_clip_loss
# ----------------------------------------------------------------------------------------------------------------------


def test_ppo_clip_loss_hand_worked_example():
    ratios = torch.tensor([1.0, 1.5, 0.5, 0.9], dtype=torch.float64)
    logprobs = ratios.log().requires_grad_()
    advantages = torch.tensor([1.0, 1.0, -1.0, -2.0], dtype=torch.float64)

    loss, stats = ppo_clip_loss(logprobs, torch.zeros(4, dtype=torch.float64), advantages, epsilon=0.2)

    # Per token: -1 (inside), -1.2 (clipped high), 0.8 (clipped low), 1.8 (inside).
    assert loss.item() == pytest.approx((-1.0 - 1.2 + 0.8 + 1.8) / 4)
    loss.backward()
    # d/dlogprob of -A * ratio / 4 = -A * ratio / 4 where not clipped, 0 where clipped.
    torch.testing.assert_close(logprobs.grad, torch.tensor([-0.25, 0.0, 0.0, 0.45], dtype=torch.float64))
    assert stats["clip_fraction_low"].item() == 0.25
    assert stats["clip_fraction_high"].item() == 0.25
    assert stats["clip_fraction"].item() == 0.5
    assert stats["ratio_mean"].item() == pytest.approx(0.975)
    expected_kl = sum(r - 1 - math.log(r) for r in (1.0, 1.5, 0.5, 0.9)) / 4
    assert stats["approx_kl"].item() == pytest.approx(expected_kl)
    assert all(not value.requires_grad for value in stats.values())


def test_ppo_clip_loss_is_pessimistic_outside_the_clip_range():
    # A ratio above the range with a negative advantage (or below it with a positive one) keeps its gradient.
    logprobs = torch.tensor([1.5, 0.5]).log().requires_grad_()
    loss, stats = ppo_clip_loss(logprobs, torch.zeros(2), torch.tensor([-1.0, 1.0]))
    assert loss.item() == pytest.approx((1.5 - 0.5) / 2)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([0.75, -0.25]))
    assert stats["clip_fraction"].item() == 0.0


def test_ppo_clip_loss_asymmetric_clipping():
    logprobs = torch.tensor([1.25, 1.3, 0.75]).log().requires_grad_()
    advantages = torch.tensor([1.0, 1.0, -1.0])
    loss, stats = ppo_clip_loss(logprobs, torch.zeros(3), advantages, epsilon=0.2, epsilon_high=0.28)
    # 1.25 is inside [0.8, 1.28]; 1.3 is clipped to 1.28; 0.75 is clipped to 0.8 (low side keeps epsilon).
    assert loss.item() == pytest.approx((-1.25 - 1.28 + 0.8) / 3)
    assert stats["clip_fraction_high"].item() == pytest.approx(1 / 3)
    assert stats["clip_fraction_low"].item() == pytest.approx(1 / 3)
    symmetric_loss, symmetric_stats = ppo_clip_loss(logprobs, torch.zeros(3), advantages, epsilon=0.2)
    assert symmetric_loss.item() == pytest.approx((-1.2 - 1.2 + 0.8) / 3)
    assert symmetric_stats["clip_fraction_high"].item() == pytest.approx(2 / 3)


def reference_ppo_loss(logprobs, old_logprobs, advantages, epsilon, epsilon_high, sequence_ids, aggregation):
    per_token = []
    for logprob, old_logprob, advantage in zip(
        logprobs.tolist(), old_logprobs.tolist(), advantages.tolist(), strict=True
    ):
        ratio = math.exp(logprob - old_logprob)
        clipped = min(max(ratio, 1 - epsilon), 1 + epsilon_high)
        per_token.append(max(-advantage * ratio, -advantage * clipped))
    if aggregation == "token_mean":
        return sum(per_token) / len(per_token)
    by_sequence = {}
    for value, sequence_id in zip(per_token, sequence_ids.tolist(), strict=True):
        by_sequence.setdefault(sequence_id, []).append(value)
    return sum(sum(values) / len(values) for values in by_sequence.values()) / len(by_sequence)


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
@pytest.mark.parametrize(("epsilon", "epsilon_high"), [(0.2, None), (0.1, 0.3)])
def test_ppo_clip_loss_matches_straightforward_reference(aggregation, epsilon, epsilon_high):
    generator = torch.Generator().manual_seed(0)
    old_logprobs = -torch.rand(50, generator=generator, dtype=torch.float64) * 3
    logprobs = old_logprobs + 0.4 * torch.randn(50, generator=generator, dtype=torch.float64)
    advantages = torch.randn(50, generator=generator, dtype=torch.float64)
    sequence_ids = torch.randint(0, 7, (50,), generator=generator) * 3 + 100  # neither contiguous nor sorted

    loss, _ = ppo_clip_loss(logprobs, old_logprobs, advantages, epsilon, epsilon_high, sequence_ids, aggregation)

    expected = reference_ppo_loss(
        logprobs,
        old_logprobs,
        advantages,
        epsilon,
        epsilon if epsilon_high is None else epsilon_high,
        sequence_ids,
        aggregation,
    )
    assert loss.item() == pytest.approx(expected, rel=1e-12)


def test_ppo_clip_loss_sequence_mean_weighs_every_sequence_equally():
    logprobs = torch.zeros(4)
    advantages = torch.tensor([4.0, 1.0, 1.0, 1.0])
    sequence_ids = torch.tensor([0, 1, 1, 1])
    token_loss, _ = ppo_clip_loss(logprobs, logprobs, advantages)
    sequence_loss, _ = ppo_clip_loss(
        logprobs, logprobs, advantages, sequence_ids=sequence_ids, aggregation="sequence_mean"
    )
    assert token_loss.item() == pytest.approx(-7.0 / 4)
    assert sequence_loss.item() == pytest.approx(-(4.0 + 1.0) / 2)


def test_ppo_clip_loss_zero_advantages_give_zero_gradient():
    logprobs = torch.randn(6, generator=torch.Generator().manual_seed(1)).requires_grad_()
    loss, _ = ppo_clip_loss(logprobs, torch.zeros(6), torch.zeros(6))
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(logprobs.grad, torch.zeros(6))


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_ppo_clip_loss_with_no_tokens_is_zero_without_nan(aggregation):
    logprobs = torch.zeros(0, requires_grad=True)
    loss, stats = ppo_clip_loss(
        logprobs,
        torch.zeros(0),
        torch.zeros(0),
        sequence_ids=torch.zeros(0, dtype=torch.long),
        aggregation=aggregation,
    )
    loss.backward()
    assert loss.item() == 0.0
    assert all(value.item() == 0.0 for value in stats.values())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"epsilon": 0.0}, "epsilon"),
        ({"epsilon": 1.0}, "epsilon"),
        ({"epsilon_high": -0.1}, "epsilon_high"),
        ({"aggregation": "sum"}, "aggregation"),
        ({"aggregation": "sequence_mean"}, "sequence_ids"),
        ({"sequence_ids": torch.zeros(3)}, "integer"),
        ({"sequence_ids": torch.zeros(2, dtype=torch.long)}, "sequence_ids"),
        ({"advantages": torch.zeros(4)}, "advantages"),
    ],
)
def test_ppo_clip_loss_rejects_bad_arguments(kwargs, message):
    arguments = {"logprobs": torch.zeros(3), "old_logprobs": torch.zeros(3), "advantages": torch.zeros(3), **kwargs}
    with pytest.raises(ValueError, match=message):
        ppo_clip_loss(**arguments)


# ----------------------------------------------------------------------------------------------------------------------
# kl_penalty, value_loss
# ----------------------------------------------------------------------------------------------------------------------


def test_kl_penalty_k1_and_k3_are_unbiased_estimates_of_the_kl():
    policy = torch.tensor([0.5, 0.2, 0.2, 0.1], dtype=torch.float64)
    reference = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)
    true_kl = (policy * (policy / reference).log()).sum()
    for kind in ("k1", "k3"):
        # Expectation under the policy, computed exactly by weighting every outcome by its probability.
        expectation = (policy * kl_penalty(policy.log(), reference.log(), kind=kind)).sum()
        torch.testing.assert_close(expectation, true_kl)
    k3 = kl_penalty(policy.log(), reference.log(), kind="k3")
    assert (k3 >= 0).all()


def test_kl_penalty_values_and_gradient_flow():
    logprobs = torch.tensor([-1.0, -2.0], requires_grad=True)
    ref_logprobs = torch.tensor([-1.5, -1.0], requires_grad=True)
    log_ratio = torch.tensor([0.5, -1.0])
    torch.testing.assert_close(kl_penalty(logprobs, ref_logprobs, "k1"), log_ratio)
    torch.testing.assert_close(kl_penalty(logprobs, ref_logprobs, "k2"), 0.5 * log_ratio**2)
    k3 = kl_penalty(logprobs, ref_logprobs, "k3")
    torch.testing.assert_close(k3, torch.exp(-log_ratio) - 1 + log_ratio)
    k3.sum().backward()
    assert ref_logprobs.grad is None
    torch.testing.assert_close(logprobs.grad, 1 - torch.exp(-log_ratio))
    with pytest.raises(ValueError, match="kind"):
        kl_penalty(logprobs, ref_logprobs, kind="k4")


def test_value_loss_plain_and_clipped():
    values = torch.tensor([1.0, 3.0], requires_grad=True)
    returns = torch.tensor([0.0, 0.0])
    assert value_loss(values, returns).item() == pytest.approx(0.5 * (1 + 9) / 2)
    # Clipped around old values 2.0 with range 0.5: clipped predictions are 1.5 and 2.5; the larger error wins.
    old_values = torch.tensor([2.0, 2.0])
    loss = value_loss(values, returns, old_values=old_values, clip=0.5)
    assert loss.item() == pytest.approx(0.5 * (1.5**2 + 3.0**2) / 2)
    loss.backward()
    torch.testing.assert_close(values.grad, torch.tensor([0.0, 1.5]))  # first token's clipped term has no gradient
    assert value_loss(torch.zeros(0), torch.zeros(0)).item() == 0.0
    with pytest.raises(ValueError, match="old_values"):
        value_loss(values, returns, clip=0.5)
    with pytest.raises(ValueError, match="clip"):
        value_loss(values, returns, old_values=old_values, clip=0.0)


# ----------------------------------------------------------------------------------------------------------------------
# Advantage estimators
# ----------------------------------------------------------------------------------------------------------------------


def test_group_normalized_advantages_hand_worked():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25, 0.25, 0.7])
    group_ids = torch.tensor([3, 3, 9, 5, 5, 3])
    advantages = group_normalized_advantages(rewards, group_ids, eps=0.0)
    group_three = torch.tensor([1.0, 0.0, 0.7])
    expected_three = (group_three - group_three.mean()) / group_three.std(unbiased=False)
    torch.testing.assert_close(advantages[[0, 1, 5]], expected_three)
    assert advantages[2].item() == 0.0  # group of one
    assert advantages[3].item() == 0.0 and advantages[4].item() == 0.0  # all equal


def test_group_normalized_advantages_degenerate_groups_are_exactly_zero():
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.3])  # 0.1 is not exact in binary: a naive mean would leave residue
    advantages = group_normalized_advantages(rewards, torch.tensor([0, 0, 0, 1]))
    assert torch.equal(advantages, torch.zeros(4))
    assert not torch.isnan(group_normalized_advantages(torch.tensor([2.0]), torch.tensor([0]))).any()


def test_group_normalized_advantages_without_scaling_only_centers():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    advantages = group_normalized_advantages(rewards, torch.zeros(4, dtype=torch.long), scale=False)
    torch.testing.assert_close(advantages, torch.tensor([0.75, -0.25, -0.25, -0.25]))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    rewards=st.lists(st.floats(-10, 10, allow_nan=False, width=32), min_size=1, max_size=24),
    data=st.data(),
)
def test_group_normalized_advantages_are_finite_and_centered_per_group(rewards, data):
    group_ids = data.draw(st.lists(st.integers(0, 4), min_size=len(rewards), max_size=len(rewards)))
    rewards_tensor = torch.tensor(rewards, dtype=torch.float64)
    group_tensor = torch.tensor(group_ids)
    advantages = group_normalized_advantages(rewards_tensor, group_tensor)
    assert torch.isfinite(advantages).all()
    for group in set(group_ids):
        members = group_tensor == group
        assert abs(advantages[members].sum().item()) < 1e-6 * members.sum().item()
        assert (advantages[members].abs() <= math.sqrt(members.sum().item())).all()  # unit mean square per group


def test_group_normalized_advantages_rejects_bad_input():
    with pytest.raises(ValueError, match="finite"):
        group_normalized_advantages(torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="integer"):
        group_normalized_advantages(torch.tensor([1.0]), torch.tensor([0.0]))
    with pytest.raises(ValueError, match="group_ids"):
        group_normalized_advantages(torch.tensor([1.0, 2.0]), torch.tensor([0]))
    assert group_normalized_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long)).shape == (0,)


def loop_gae(rewards, values, gamma, lam):
    advantages = [0.0] * len(rewards)
    running = 0.0
    for t in reversed(range(len(rewards))):
        next_value = values[t + 1] if t + 1 < len(rewards) else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        advantages[t] = running
    return advantages, [a + v for a, v in zip(advantages, values, strict=True)]


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.9, 0.95), (0.99, 0.0), (1.0, 0.5)])
def test_gae_advantages_matches_hand_written_loop(gamma, lam):
    generator = torch.Generator().manual_seed(0)
    rewards = torch.randn(9, generator=generator, dtype=torch.float64)
    values = torch.randn(9, generator=generator, dtype=torch.float64)
    advantages, returns = gae_advantages(rewards, values, gamma=gamma, lam=lam)
    expected_advantages, expected_returns = loop_gae(rewards.tolist(), values.tolist(), gamma, lam)
    torch.testing.assert_close(advantages, torch.tensor(expected_advantages, dtype=torch.float64))
    torch.testing.assert_close(returns, torch.tensor(expected_returns, dtype=torch.float64))


def test_gae_advantages_undiscounted_returns_equal_the_final_reward():
    rewards = torch.tensor([0.0, 0.0, 0.0, 0.8])
    values = torch.tensor([0.1, 0.4, 0.3, 0.9], requires_grad=True)
    advantages, returns = gae_advantages(rewards, values)
    torch.testing.assert_close(returns, torch.full((4,), 0.8))
    torch.testing.assert_close(advantages, 0.8 - values.detach())
    assert not advantages.requires_grad
    # lam = 0: one-step TD errors.
    td, _ = gae_advantages(rewards, values, gamma=1.0, lam=0.0)
    torch.testing.assert_close(td, torch.tensor([0.3, -0.1, 0.6, -0.1]))


def test_gae_advantages_batched_with_mask_matches_each_episode_alone():
    generator = torch.Generator().manual_seed(1)
    lengths = [5, 2, 4]
    episodes = [(torch.randn(n, generator=generator), torch.randn(n, generator=generator)) for n in lengths]
    rewards = torch.zeros(3, 6)
    values = torch.full((3, 6), 123.0)  # garbage in padding must not leak
    mask = torch.zeros(3, 6, dtype=torch.bool)
    for row, (episode_rewards, episode_values) in enumerate(episodes):
        rewards[row, : lengths[row]] = episode_rewards
        values[row, : lengths[row]] = episode_values
        mask[row, : lengths[row]] = True
    rewards[~mask] = 55.0

    advantages, returns = gae_advantages(rewards, values, gamma=0.9, lam=0.8, mask=mask)

    for row, (episode_rewards, episode_values) in enumerate(episodes):
        alone_advantages, alone_returns = gae_advantages(episode_rewards, episode_values, gamma=0.9, lam=0.8)
        torch.testing.assert_close(advantages[row, : lengths[row]], alone_advantages)
        torch.testing.assert_close(returns[row, : lengths[row]], alone_returns)
    assert torch.equal(advantages[~mask], torch.zeros(int((~mask).sum())))
    assert torch.equal(returns[~mask], torch.zeros(int((~mask).sum())))


def test_gae_advantages_mask_holes_are_stepped_over():
    rewards = torch.tensor([0.0, 9.0, 0.0, 1.0])
    values = torch.tensor([0.2, 9.0, 0.5, 0.7])
    mask = torch.tensor([True, False, True, True])
    advantages, _ = gae_advantages(rewards, values, gamma=0.9, lam=0.7, mask=mask)
    compact, _ = gae_advantages(rewards[mask], values[mask], gamma=0.9, lam=0.7)
    torch.testing.assert_close(advantages[mask], compact)
    assert advantages[1].item() == 0.0


def test_gae_advantages_rejects_bad_arguments():
    with pytest.raises(ValueError, match="values"):
        gae_advantages(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match="gamma"):
        gae_advantages(torch.zeros(3), torch.zeros(3), gamma=1.5)
    with pytest.raises(ValueError, match="lam"):
        gae_advantages(torch.zeros(3), torch.zeros(3), lam=-0.1)
    with pytest.raises(ValueError, match="mask"):
        gae_advantages(torch.zeros(3), torch.zeros(3), mask=torch.ones(2, dtype=torch.bool))


def test_broadcast_to_tokens_repeats_each_episode_value():
    per_token = broadcast_to_tokens(torch.tensor([0.5, -1.0, 2.0]), torch.tensor([2, 0, 3]))
    torch.testing.assert_close(per_token, torch.tensor([0.5, 0.5, 2.0, 2.0, 2.0]))
    assert broadcast_to_tokens(torch.tensor([1.0]), [4]).shape == (4,)
    with pytest.raises(ValueError, match=">= 0"):
        broadcast_to_tokens(torch.tensor([1.0, 2.0]), [1, -1])
    with pytest.raises(ValueError, match="tokens_per_episode"):
        broadcast_to_tokens(torch.tensor([1.0, 2.0]), [1])


def test_until_first_divergence_keeps_each_action_up_to_its_first_unlikely_token():
    generator = torch.Generator().manual_seed(0)
    lengths = [5, 1, 7, 3, 6]
    sequence_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    logprobs = -torch.rand(sum(lengths), generator=generator) * 5  # probabilities from e^-5 to 1
    mask = until_first_divergence(logprobs, sequence_ids, threshold=0.1)
    expected, start = [], 0
    for length in lengths:  # by hand, one action at a time
        diverged = False
        for lp in logprobs[start : start + length].tolist():
            expected.append(not diverged)
            diverged = diverged or lp < math.log(0.1)
        start += length
    assert mask.tolist() == expected
    assert 0 < mask.sum() < len(expected), "the check needs kept and dropped tokens"
    # A mask that ignored the action boundaries (one cumulative count over the batch) would differ.
    assert mask.tolist() != (torch.cumsum((logprobs < math.log(0.1)).long(), 0) - (logprobs < math.log(0.1)).long() == 0).tolist()
    with pytest.raises(ValueError, match="non-decreasing"):
        until_first_divergence(logprobs, sequence_ids.flip(0), threshold=0.1)
    with pytest.raises(ValueError, match="threshold"):
        until_first_divergence(logprobs, sequence_ids, threshold=0.0)


def test_importance_sampling_weights_follow_trls_modes_by_hand():
    from memopd_trl.losses import importance_sampling_weights

    # Log-ratios trainer - engine per token: 0, 2, -0.5 | 0.25, nan (an unscored token counts as no gap).
    trainer = torch.tensor([-1.0, -1.0, -1.0, -0.5, -0.2])
    engine = torch.tensor([-1.0, -3.0, -0.5, -0.75, float("nan")])
    sequences = torch.tensor([3, 3, 3, 7, 7])
    e = math.e
    cases = {
        ("token_truncate", None, 3.0): [1.0, 3.0, e**-0.5, e**0.25, 1.0],
        ("token_mask", 0.7, 3.0): [1.0, 0.0, 0.0, e**0.25, 1.0],
        ("sequence_truncate", None, 3.0): [3.0, 3.0, 3.0, e**0.25, e**0.25],  # e^1.5 capped
        ("sequence_mask", None, 3.0): [0.0, 0.0, 0.0, e**0.25, e**0.25],
        ("sequence_mask", None, None): [e**1.5] * 3 + [e**0.25] * 2,
    }
    for (mode, low, high), expected in cases.items():
        weights = importance_sampling_weights(trainer, engine, sequences, mode=mode, clip_min=low, clip_max=high)
        torch.testing.assert_close(weights, torch.tensor(expected), msg=mode)
    with pytest.raises(ValueError, match="`mode` must be one of"):
        importance_sampling_weights(trainer, engine, sequences, mode="sequence")


def test_ppo_sampling_weights_scale_each_tokens_loss():
    logprobs = torch.tensor([-1.0, -0.5, -2.0], requires_grad=True)
    old, advantages = torch.tensor([-1.0, -0.7, -1.5]), torch.tensor([1.0, -2.0, 0.5])
    weights = torch.tensor([2.0, 0.0, 0.5])
    weighted, _ = ppo_clip_loss(logprobs, old, advantages, sampling_weights=weights)
    per_token = [ppo_clip_loss(logprobs[i : i + 1], old[i : i + 1], advantages[i : i + 1])[0] for i in range(3)]
    assert weighted.item() == pytest.approx(sum(w * loss.item() for w, loss in zip(weights, per_token, strict=True)) / 3)


# ----------------------------------------------------------------------------------------------------------------------
# Distillation on a teacher's top-k
# ----------------------------------------------------------------------------------------------------------------------


def _heads(vocab=97, hidden=16, tokens=29, seed=0):
    g = torch.Generator().manual_seed(seed)
    student_hidden, teacher_hidden = torch.randn(tokens, hidden, generator=g), torch.randn(tokens, hidden, generator=g)
    student_weight = (torch.randn(vocab, hidden, generator=g) * 0.5).requires_grad_()
    return student_hidden, student_weight, teacher_hidden, torch.randn(vocab, hidden, generator=g) * 0.5


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("add_tail", [True, False])
def test_topk_losses_equal_the_full_vocabulary_loss_when_k_covers_it(beta, add_tail):
    from memopd_trl.losses import logprobs_at, topk_generalized_jsd, topk_logprobs

    student_hidden, student_weight, teacher_hidden, teacher_weight = _heads()
    vocab = teacher_weight.shape[0]
    teacher, ids = topk_logprobs(teacher_hidden, teacher_weight, None, k=vocab, chunk_size=8)
    student, rest = logprobs_at(student_hidden, student_weight, None, ids, chunk_size=8)
    topk = topk_generalized_jsd(student, teacher, beta, add_tail, student_tail=rest)
    full = chunked_generalized_jsd(student_hidden, student_weight, teacher_hidden, teacher_weight, beta=beta, chunk_size=8)
    torch.testing.assert_close(topk, full, atol=1e-5, rtol=0)
    (grad_topk,) = torch.autograd.grad(topk.sum(), student_weight)
    (grad_full,) = torch.autograd.grad(full.sum(), student_weight)
    torch.testing.assert_close(grad_topk, grad_full, atol=1e-4, rtol=1e-4)
    # With fewer tokens than the vocabulary the support is smaller and the value differs (the test can fail).
    teacher_k, ids_k = topk_logprobs(teacher_hidden, teacher_weight, None, k=5)
    student_k, rest_k = logprobs_at(student_hidden, student_weight, None, ids_k)
    assert (topk_generalized_jsd(student_k, teacher_k, beta, add_tail, rest_k) - full).abs().max() > 1e-3


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_topk_generalized_jsd_follows_trl_server_distillation(beta):
    """TRL's server distillation's divergence with its tail bucket (private functions, pinned where importable)."""
    trl_module = pytest.importorskip("trl.experimental.server_distillation.server_distillation_trainer")
    from memopd_trl.losses import logprobs_at, topk_generalized_jsd, topk_logprobs

    student_hidden, student_weight, teacher_hidden, teacher_weight = _heads()
    teacher, ids = topk_logprobs(teacher_hidden, teacher_weight, None, k=6)
    teacher[3, 2:] = float("-inf")  # a position with fewer log-probs (padding, as TRL pads)
    valid = torch.isfinite(teacher)
    student, rest = logprobs_at(student_hidden, student_weight.detach(), None, ids, valid)
    student_sparse, mask = trl_module._add_tail_bucket(student.masked_fill(~valid, float("-inf")), valid)
    teacher_sparse, _ = trl_module._add_tail_bucket(teacher, valid)
    expected = trl_module._jsd_divergence(student_sparse, teacher_sparse, beta, support_mask=mask).sum(-1)
    torch.testing.assert_close(topk_generalized_jsd(student, teacher, beta), expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(topk_generalized_jsd(student, teacher, beta, student_tail=rest), expected, atol=1e-5, rtol=1e-4)


def test_topk_padding_gives_finite_gradients():
    from memopd_trl.losses import logprobs_at, topk_generalized_jsd, topk_logprobs

    student_hidden, student_weight, teacher_hidden, teacher_weight = _heads()
    teacher, ids = topk_logprobs(teacher_hidden, teacher_weight, None, k=4)
    teacher[:, 1:] = float("-inf")  # top-1 only
    for add_tail in (True, False):
        student, rest = logprobs_at(student_hidden, student_weight, None, ids, torch.isfinite(teacher))
        loss = topk_generalized_jsd(student, teacher, 0.5, add_tail, rest).sum()
        (grad,) = torch.autograd.grad(loss, student_weight)
        assert torch.isfinite(loss) and torch.isfinite(grad).all()


def test_group_normalized_advantages_scale_like_trl_scale_rewards():
    rewards = torch.tensor([1.0, 0.0, 0.51, 0.50, 0.3, 0.3])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    group = group_normalized_advantages(rewards, groups, eps=0.0, scale="group")
    batch = group_normalized_advantages(rewards, groups, eps=0.0, scale="batch")
    none = group_normalized_advantages(rewards, groups, eps=0.0, scale="none")
    centered = torch.tensor([0.5, -0.5, 0.005, -0.005, 0.0, 0.0])
    torch.testing.assert_close(none, centered)
    torch.testing.assert_close(batch, centered / rewards.std(unbiased=False))
    # Per-group scaling turns the 0.01 reward gap of group 1 into the same full-size advantages as group 0's 1.0 gap.
    torch.testing.assert_close(group[:4], torch.tensor([1.0, -1.0, 1.0, -1.0]))
    assert batch[2].abs() < 0.05 * batch[0].abs()
    torch.testing.assert_close(group_normalized_advantages(rewards, groups, eps=0.0, scale=True), group)
    torch.testing.assert_close(group_normalized_advantages(rewards, groups, eps=0.0, scale=False), none)
    with pytest.raises(ValueError, match="`scale` must be"):
        group_normalized_advantages(rewards, groups, scale="std")


def test_without_first_divergence_drops_each_sequences_first_unlikely_token_only():
    from memopd_trl.losses import without_first_divergence

    generator = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(200, generator=generator) * 4  # about half below log(0.1)
    sequence_ids = torch.sort(torch.randint(0, 12, (200,), generator=generator)).values
    mask = without_first_divergence(logprobs, sequence_ids, threshold=0.1)
    expected = []
    for sequence in sequence_ids.unique_consecutive():
        values = logprobs[sequence_ids == sequence]
        below = [i for i, value in enumerate(values.tolist()) if value < math.log(0.1)]
        expected += [not below or i != below[0] for i in range(len(values))]
    assert mask.tolist() == expected and (~mask).sum() == len(sequence_ids.unique())
    with pytest.raises(ValueError, match="threshold"):
        without_first_divergence(logprobs, sequence_ids, threshold=0.0)
