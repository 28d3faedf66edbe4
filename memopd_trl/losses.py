"""Losses and advantage estimators of MemOPD: pure functions of tensors.

Nothing here knows about models, trainers or environments. Every per-token input lives on *action tokens only*, in
the canonical flat order of the packing collator (invocation order, then token order inside `output_ids`), so `N`
below is the total number of sampled tokens in a batch.

- [`generalized_jsd_loss`]: the generalized Jensen-Shannon divergence between teacher and student next-token
  distributions, on materialized logits (same call and same values as TRL's `GKDTrainer.generalized_jsd_loss`).
- [`chunked_generalized_jsd`]: the same divergence per action token, computed from hidden states and LM-head weights
  in token chunks, so the `(N, vocab_size)` logits of either model never exist at once. This is what the trainer uses.
- [`distillation_diagnostics`]: teacher confidence, argmax agreement, forward and reverse KL, student entropy per
  action token, from the same chunked tiles (for logging).
- [`topk_generalized_jsd`], [`logprobs_at`], [`topk_logprobs`]: the same divergence on a teacher's top-k log-probs
  plus a tail bucket (a teacher on its own server gives no more), as TRL's server distillation defines it.
- [`ppo_clip_loss`], [`kl_penalty`], [`value_loss`]: the reinforcement-learning terms; [`sampled_kl_advantages`], the
  per-token teacher reward `log q(a) - log p(a)` at the sampled token.
- [`group_normalized_advantages`], [`gae_advantages`], [`final_reward_gae`], [`broadcast_to_tokens`]: advantage
  estimators and helpers.

[`chunked_generalized_jsd`] is this project's own rather than TRL's `ChunkedDivergenceFunction`: at 32k entries it
needed less memory and time on CPU than TRL's with its default or patched tiles, and its token chunk is an argument
rather than a module constant (measurements and command: docs/benchmarks.md, "Distillation loss memory").
"""

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F


_REDUCTIONS = ("batchmean", "sum", "mean", "none")
_PPO_AGGREGATIONS = ("token_mean", "sequence_mean")
_KL_KINDS = ("k1", "k2", "k3")


# ----------------------------------------------------------------------------------------------------------------------
# Argument checks shared by the functions below
# ----------------------------------------------------------------------------------------------------------------------


def _check_beta_temperature(beta: float, temperature: float, where: str) -> None:
    # The loss functions are public and called directly; the trainer's values were checked by `MemOPDConfig`.
    if not 0.0 <= float(beta) <= 1.0:
        raise ValueError(
            f"{where}: `beta` must be in [0, 1] (0 = forward KL(teacher || student), 1 = reverse KL(student || "
            f"teacher)), got {beta}."
        )
    if not float(temperature) > 0.0:
        raise ValueError(f"{where}: `temperature` must be > 0, got {temperature}.")


def _check_same_1d(where: str, **tensors: torch.Tensor | None) -> int:
    """Checks that every given tensor is 1-D and that they share one length; returns that length."""
    length = None
    first_name = None
    for name, tensor in tensors.items():
        if tensor is None:
            continue
        if tensor.dim() != 1:
            raise ValueError(f"{where}: `{name}` must be 1-D (one value per token), got shape {tuple(tensor.shape)}.")
        if length is None:
            length, first_name = tensor.shape[0], name
        elif tensor.shape[0] != length:
            raise ValueError(
                f"{where}: `{name}` has {tensor.shape[0]} entries but `{first_name}` has {length}; give one value per "
                "token for each."
            )
    return 0 if length is None else length


# ----------------------------------------------------------------------------------------------------------------------
# Distillation: generalized Jensen-Shannon divergence
# ----------------------------------------------------------------------------------------------------------------------


def _pointwise_generalized_jsd(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, beta: float):
    """
    Per-vocabulary-entry terms of the generalized JSD between two log-distributions (same shape, last dim = vocab).

    Summed over the last dimension they give `beta * KL(p_t || m) + (1 - beta) * KL(p_s || m)` with the mixture
    `m = (1 - beta) * p_s + beta * p_t`; `beta = 0` is KL(p_t || p_s) and `beta = 1` is KL(p_s || p_t).
    """
    if beta == 0.0:
        return teacher_log_probs.exp() * (teacher_log_probs - student_log_probs)
    if beta == 1.0:
        return student_log_probs.exp() * (student_log_probs - teacher_log_probs)
    log_mixture = torch.logaddexp(student_log_probs + math.log1p(-beta), teacher_log_probs + math.log(beta))
    teacher_term = teacher_log_probs.exp() * (teacher_log_probs - log_mixture)
    student_term = student_log_probs.exp() * (student_log_probs - log_mixture)
    return beta * teacher_term + (1.0 - beta) * student_term


def generalized_jsd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor | None = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    reduction: str = "batchmean",
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """
    Generalized Jensen-Shannon divergence between the teacher's and the student's next-token distributions (Eq. 1 of
    "On-Policy Distillation of Language Models", arXiv:2306.13649), on materialized logits.

    With `p_s = softmax(student_logits / temperature)`, `p_t = softmax(teacher_logits / temperature)` and the mixture
    `m = (1 - beta) * p_s + beta * p_t`, the divergence per token is `beta * KL(p_t || m) + (1 - beta) * KL(p_s || m)`.
    `beta = 0` is the forward KL(p_t || p_s) and `beta = 1` the reverse KL(p_s || p_t). Takes the same arguments and
    returns the same values as TRL's `GKDTrainer.generalized_jsd_loss`.

    Gradients flow into both logits tensors; pass `teacher_logits` detached (or computed under `torch.no_grad()`).
    For action-position losses on real vocabularies prefer [`chunked_generalized_jsd`], which never materializes
    `(N, vocab_size)` logits.

    Args:
        student_logits (`torch.Tensor` of shape `(batch_size, seq_len, vocab_size)` or `(num_tokens, vocab_size)`):
            Student logits.
        teacher_logits (`torch.Tensor`, same shape as `student_logits`):
            Teacher logits.
        labels (`torch.Tensor` of shape `student_logits.shape[:-1]`, *optional*, defaults to `None`):
            Positions holding `-100` are left out of the loss.
        beta (`float`, *optional*, defaults to `0.5`):
            Interpolation coefficient in `[0, 1]`.
        temperature (`float`, *optional*, defaults to `1.0`):
            Softmax temperature, `> 0`, applied to both logits.
        reduction (`str`, *optional*, defaults to `"batchmean"`):
            - `"batchmean"`: sum over everything, divided by the number of unmasked tokens when `labels` is given
              (at least 1), else by `student_logits.shape[0]`.
            - `"sum"`: sum over everything.
            - `"mean"`: mean over every kept (token, vocabulary entry) pair, as `torch.nn.functional.kl_div` does;
              0 when nothing is kept (TRL returns NaN there).
            - `"none"`: no reduction (see Returns).
        num_items_in_batch (`int` or `torch.Tensor`, *optional*, defaults to `None`):
            When given, overrides `reduction`: the sum is divided by this global token count (gradient accumulation).

    Returns:
        `torch.Tensor`: a scalar, or for `reduction="none"` the per-entry divergence terms, of the logits' shape
        without `labels`, or `(num_kept_tokens, vocab_size)` with `labels`. Summing them over the last dimension gives
        the per-token divergence.

    Example:

    ```python
    >>> import torch
    >>> from memopd_trl import generalized_jsd_loss
    >>> student, teacher = torch.tensor([[2.0, 0.0, -1.0]]), torch.tensor([[0.0, 1.0, 0.0]])
    >>> round(generalized_jsd_loss(student, teacher, beta=0.0).item(), 4)  # KL(teacher || student)
    0.9826
    >>> round(generalized_jsd_loss(student, teacher).item(), 4)
    0.2167
    ```
    """
    where = "generalized_jsd_loss"
    _check_beta_temperature(beta, temperature, where)
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{where}: `reduction` must be one of {_REDUCTIONS}, got {reduction!r}.")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"{where}: `student_logits` has shape {tuple(student_logits.shape)} but `teacher_logits` has shape "
            f"{tuple(teacher_logits.shape)}; both models must score the same positions over the same vocabulary."
        )
    if student_logits.dim() < 2:
        raise ValueError(
            f"{where}: logits must have a vocabulary dimension last, got shape {tuple(student_logits.shape)}."
        )
    if labels is not None and labels.shape != student_logits.shape[:-1]:
        raise ValueError(
            f"{where}: `labels` has shape {tuple(labels.shape)}, expected {tuple(student_logits.shape[:-1])} (the "
            "logits' shape without the vocabulary dimension)."
        )

    student_log_probs = F.log_softmax(student_logits / temperature, dim=-1)
    teacher_log_probs = F.log_softmax(teacher_logits / temperature, dim=-1)
    divergence = _pointwise_generalized_jsd(student_log_probs, teacher_log_probs, float(beta))

    if labels is not None:
        kept = labels != -100
        divergence = divergence[kept]  # (num_kept_tokens, vocab_size)

    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(divergence.device)
        return divergence.sum() / num_items_in_batch
    if reduction == "batchmean":
        denominator = kept.sum().clamp_min(1) if labels is not None else max(divergence.shape[0], 1)
        return divergence.sum() / denominator
    if reduction == "sum":
        return divergence.sum()
    if reduction == "mean":
        return divergence.mean() if divergence.numel() > 0 else divergence.sum()
    return divergence


def _cast_head(
    weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The LM-head weight and bias in the dtype of the matmul (no copy when already in it)."""
    return weight.to(dtype), None if bias is None else bias.to(dtype)


def _log_probs_tile(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float
) -> torch.Tensor:
    """LM head on a chunk of hidden states in the weight's dtype, then a log-softmax in (at least) fp32: `(chunk, V)`."""
    logits = F.linear(hidden.to(weight.dtype), weight, bias)
    logits = logits.to(torch.promote_types(weight.dtype, torch.float32))  # (chunk, vocab_size)
    if temperature != 1.0:
        logits.div_(temperature)
    return logits.sub_(logits.logsumexp(dim=-1, keepdim=True))


def _tile_divergence(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, beta: float) -> torch.Tensor:
    """
    Per-token generalized JSD of one tile, `(chunk,)`, from `(chunk, vocab_size)` fp32 log-distributions.

    Same maths as [`_pointwise_generalized_jsd`] summed over the vocabulary, written with in-place operations so a tile
    needs at most four `(chunk, vocab_size)` buffers. Overwrites both inputs.
    """
    if beta == 0.0:
        teacher_probs = teacher_log_probs.exp()
        return teacher_probs.mul_(teacher_log_probs.sub_(student_log_probs)).sum(-1)
    if beta == 1.0:
        student_probs = student_log_probs.exp()
        return student_probs.mul_(student_log_probs.sub_(teacher_log_probs)).sum(-1)
    log_mixture = student_log_probs + math.log1p(-beta)
    torch.logaddexp(log_mixture, teacher_log_probs + math.log(beta), out=log_mixture)  # (chunk, V)
    teacher_probs = teacher_log_probs.exp()
    teacher_term = teacher_probs.mul_(teacher_log_probs.sub_(log_mixture)).sum(-1)  # KL(p_t || m), (chunk,)
    del teacher_probs
    student_probs = student_log_probs.exp()
    student_term = student_probs.mul_(student_log_probs.sub_(log_mixture)).sum(-1)  # KL(p_s || m), (chunk,)
    return beta * teacher_term + (1.0 - beta) * student_term


def _tile_grad_logits(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, beta: float) -> torch.Tensor:
    """
    Gradient of the per-token divergence with respect to the student's scaled logits `z_s / temperature`, for one
    tile: `(chunk, vocab_size)` fp32. Overwrites both inputs.

    With `p_s`, `p_t` the two distributions and `m = (1 - beta) p_s + beta p_t`:
    `beta = 0` (KL(p_t || p_s)) gives `p_s - p_t`; `beta = 1` (KL(p_s || p_t)) gives `p_s * (log p_s - log p_t - KL)`;
    otherwise `(1 - beta) * p_s * (log p_s - log m - KL(p_s || m))`, since the terms through `m` cancel.
    """
    if beta == 0.0:
        return student_log_probs.exp_().sub_(teacher_log_probs.exp_())
    if beta == 1.0:
        student_probs = student_log_probs.exp()
        log_ratio = student_log_probs.sub_(teacher_log_probs)  # log p_s - log p_t
        scale = 1.0
    else:
        log_mixture = teacher_log_probs.add_(math.log(beta))
        torch.logaddexp(log_mixture, student_log_probs + math.log1p(-beta), out=log_mixture)  # log m, (chunk, V)
        student_probs = student_log_probs.exp()
        log_ratio = student_log_probs.sub_(log_mixture)  # log p_s - log m
        del log_mixture
        scale = 1.0 - beta
    kl = (student_probs * log_ratio).sum(-1, keepdim=True)  # (chunk, 1)
    return student_probs.mul_(log_ratio.sub_(kl)).mul_(scale)


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    # Under autocast the LM-head matmul runs in the autocast dtype, as it would inside the model; otherwise in the
    # weight's dtype. The softmax maths always runs in fp32.
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


def _log_prob_tiles(student_hidden, student_head, teacher_hidden, teacher_head, temperature: float, chunk_size: int):
    """
    For each chunk of `chunk_size` tokens: its rows (a `slice`) and the student's and the teacher's fp32
    log-distributions `(chunk, vocab_size)` there. The tiles are made one chunk at a time and kept by no one here,
    so a caller that drops them before the next chunk holds one pair at a time.
    """
    num_tokens = student_hidden.shape[0]
    for start in range(0, num_tokens, chunk_size):
        rows = slice(start, min(start + chunk_size, num_tokens))
        yield (
            rows,
            _log_probs_tile(student_hidden[rows], *student_head, temperature),
            _log_probs_tile(teacher_hidden[rows], *teacher_head, temperature),
        )


def _head_tiles(
    student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, temperature, chunk_size
) -> tuple[torch.dtype, Iterator[tuple[slice, torch.Tensor, torch.Tensor]]]:
    """
    The dtype of the tiles and, chunk by chunk, the student's and the teacher's log-distributions in it (fp32, or
    fp64 for fp64 inputs), from hidden states and LM heads: each head's matmul in its own compute dtype (the autocast
    dtype under autocast, else the weight's), the softmax maths in the tile dtype, autocast off. What the forward of
    the chunked divergence and [`distillation_diagnostics`] iterate over; one tile pair exists at a time.
    """
    student_dtype = _compute_dtype(student_hidden, student_weight)
    teacher_dtype = _compute_dtype(teacher_hidden, teacher_weight)
    tile_dtype = torch.promote_types(torch.promote_types(student_dtype, teacher_dtype), torch.float32)

    def tiles():
        with torch.autocast(student_hidden.device.type, enabled=False):
            student_head = _cast_head(student_weight, student_bias, student_dtype)  # (V, H_s), (V,)
            teacher_head = _cast_head(teacher_weight, teacher_bias, teacher_dtype)  # (V, H_t), (V,)
            pairs = _log_prob_tiles(student_hidden, student_head, teacher_hidden, teacher_head, temperature, chunk_size)
            for rows, student_log_probs, teacher_log_probs in pairs:
                yield rows, student_log_probs.to(tile_dtype), teacher_log_probs.to(tile_dtype)

    return tile_dtype, tiles()


def _check_chunked_heads(
    where: str,
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    student_bias: torch.Tensor | None,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    teacher_bias: torch.Tensor | None,
    chunk_size: int,
) -> None:
    """The checks of the chunked teacher-student functions: shapes of both sides, one shared vocabulary, the chunk."""
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{where}: `chunk_size` must be an integer >= 1, got {chunk_size!r}.")
    if student_hidden.shape[0] != teacher_hidden.shape[0]:
        raise ValueError(
            f"{where}: `student_hidden` has {student_hidden.shape[0]} tokens but `teacher_hidden` has "
            f"{teacher_hidden.shape[0]}; both must hold the same action positions in the same order."
        )
    for role, hidden, weight in (("student", student_hidden, student_weight), ("teacher", teacher_hidden, teacher_weight)):
        for name, tensor in ((f"{role}_hidden", hidden), (f"{role}_weight", weight)):
            if tensor.dim() != 2:
                raise ValueError(f"{where}: `{name}` must be 2-D, got shape {tuple(tensor.shape)}.")
        if hidden.shape[1] != weight.shape[1]:
            raise ValueError(
                f"{where}: `{role}_hidden` has hidden size {hidden.shape[1]} but `{role}_weight` expects "
                f"{weight.shape[1]} (shape {tuple(weight.shape)})."
            )
    if student_weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(
            f"{where}: the student LM head has {student_weight.shape[0]} vocabulary entries but the teacher's has "
            f"{teacher_weight.shape[0]}; full-vocabulary distillation needs one shared tokenizer vocabulary."
        )
    for name, bias in (("student_bias", student_bias), ("teacher_bias", teacher_bias)):
        if bias is not None and bias.shape != (student_weight.shape[0],):
            raise ValueError(
                f"{where}: `{name}` must have shape ({student_weight.shape[0]},), got {tuple(bias.shape)}."
            )


class _ChunkedGeneralizedJSD(torch.autograd.Function):
    """
    Per-token generalized JSD from hidden states and LM-head weights, one token chunk at a time.

    Forward: for each chunk, both log-distributions `(chunk, vocab_size)` are formed in fp32, reduced to one number per
    token and dropped; only the inputs are saved. Backward: each chunk's tiles are recomputed and the gradient with
    respect to the student's logits is written in closed form ([`_tile_grad_logits`]), then sent through the LM head.
    The teacher side is a constant and never receives a gradient.
    """

    @staticmethod
    def forward(
        ctx,
        student_hidden: torch.Tensor,  # (N, H_s)
        student_weight: torch.Tensor,  # (V, H_s)
        student_bias: torch.Tensor | None,  # (V,)
        teacher_hidden: torch.Tensor,  # (N, H_t)
        teacher_weight: torch.Tensor,  # (V, H_t)
        teacher_bias: torch.Tensor | None,  # (V,)
        beta: float,
        temperature: float,
        chunk_size: int,
    ) -> torch.Tensor:
        tile_dtype, tiles = _head_tiles(
            student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, temperature,
            chunk_size,
        )  # fmt: skip
        divergence = torch.empty(student_hidden.shape[0], device=student_hidden.device, dtype=tile_dtype)  # (N,)
        for rows, student_log_probs, teacher_log_probs in tiles:
            divergence[rows] = _tile_divergence(student_log_probs, teacher_log_probs, beta)
            del student_log_probs, teacher_log_probs
        ctx.save_for_backward(
            student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias
        )
        student_dtype = _compute_dtype(student_hidden, student_weight)
        ctx.settings = (beta, temperature, chunk_size, student_dtype, _compute_dtype(teacher_hidden, teacher_weight))
        return divergence

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_divergence: torch.Tensor):
        student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias = ctx.saved_tensors
        beta, temperature, chunk_size, student_dtype, teacher_dtype = ctx.settings
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        # Accumulate in (at least) fp32 whatever the inputs' dtype.
        acc_dtype = torch.promote_types(student_dtype, torch.float32)
        grad_divergence = grad_divergence.to(acc_dtype)  # (N,)
        device = student_hidden.device
        grad_hidden = torch.zeros(student_hidden.shape, device=device, dtype=acc_dtype) if needs_hidden else None
        grad_weight = torch.zeros(student_weight.shape, device=device, dtype=acc_dtype) if needs_weight else None
        grad_bias = torch.zeros(student_bias.shape, device=device, dtype=acc_dtype) if needs_bias else None

        with torch.autocast(student_hidden.device.type, enabled=False):
            student_head = _cast_head(student_weight, student_bias, student_dtype)  # (V, H_s), (V,)
            teacher_head = _cast_head(teacher_weight, teacher_bias, teacher_dtype)  # (V, H_t), (V,)
            tiles = _log_prob_tiles(student_hidden, student_head, teacher_hidden, teacher_head, temperature, chunk_size)
            for rows, student_log_probs, teacher_log_probs in tiles:
                teacher_log_probs = teacher_log_probs.to(student_log_probs.dtype)
                grad_logits = _tile_grad_logits(student_log_probs, teacher_log_probs, beta)  # (chunk, V)
                del student_log_probs, teacher_log_probs
                # Chain rule: through the temperature scaling and the upstream gradient of each token.
                grad_logits.mul_(grad_divergence[rows, None] / temperature)
                if grad_hidden is not None:
                    grad_hidden[rows] = grad_logits.to(student_dtype) @ student_head[0]  # (chunk, H_s)
                if grad_weight is not None:
                    # In place, in the accumulation dtype: no (V, H_s) temporary per chunk.
                    grad_weight.addmm_(grad_logits.t(), student_hidden[rows].to(acc_dtype))
                if grad_bias is not None:
                    grad_bias += grad_logits.sum(0)
                del grad_logits

        return (
            None if grad_hidden is None else grad_hidden.to(student_hidden.dtype),
            None if grad_weight is None else grad_weight.to(student_weight.dtype),
            None if grad_bias is None else grad_bias.to(student_bias.dtype),
            *(None,) * 6,
        )


def chunked_generalized_jsd(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    beta: float = 0.5,
    temperature: float = 1.0,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """
    Per-token generalized JSD between teacher and student over the full vocabulary, from hidden states at the action
    positions and the two LM heads, computed in token chunks.

    Equals `generalized_jsd_loss(student_hidden @ student_weight.T + student_bias, teacher_hidden @ teacher_weight.T +
    teacher_bias, beta=beta, temperature=temperature, reduction="none").sum(-1)`, but never holds more than a few
    `(chunk_size, vocab_size)` fp32 tiles: the logits of a chunk are recomputed in the backward pass instead of being
    stored. The gradient flows into the student side only (`student_hidden`, `student_weight`, `student_bias`, each
    when it requires grad); the teacher tensors are constants. The LM-head matmul runs in the weight's dtype (or the
    autocast dtype) like the model's own head; the softmax maths runs in fp32. Under DeepSpeed ZeRO-3 the LM-head
    weights must be gathered by the caller ([`~memopd_trl.scoring.gathered_lm_head`]).

    Args:
        student_hidden (`torch.Tensor` of shape `(num_tokens, student_hidden_size)`):
            Student final hidden states at the positions that predict each action token.
        student_weight (`torch.Tensor` of shape `(vocab_size, student_hidden_size)`):
            Student LM-head weight.
        teacher_hidden (`torch.Tensor` of shape `(num_tokens, teacher_hidden_size)`):
            Teacher final hidden states at the same positions, in the same order.
        teacher_weight (`torch.Tensor` of shape `(vocab_size, teacher_hidden_size)`):
            Teacher LM-head weight, over the same vocabulary as the student's.
        beta (`float`, *optional*, defaults to `0.5`):
            In `[0, 1]`: `0` is KL(teacher || student), `1` is KL(student || teacher), in between the generalized JSD
            with mixture `(1 - beta) * p_student + beta * p_teacher`.
        temperature (`float`, *optional*, defaults to `1.0`):
            Softmax temperature, `> 0`, applied to both models' logits.
        student_bias (`torch.Tensor` of shape `(vocab_size,)`, *optional*, defaults to `None`):
            Student LM-head bias.
        teacher_bias (`torch.Tensor` of shape `(vocab_size,)`, *optional*, defaults to `None`):
            Teacher LM-head bias.
        chunk_size (`int`, *optional*, defaults to `1024`):
            Tokens per chunk, `>= 1`. Peak memory is about four fp32 `(chunk_size, vocab_size)` tiles plus the student
            LM-head gradient, whatever `num_tokens`; lower it for large vocabularies (measured in docs/benchmarks.md).

    Returns:
        `torch.Tensor` of shape `(num_tokens,)`, fp32 (fp64 for fp64 inputs): the divergence of each action token (an
        empty tensor when `num_tokens` is 0).

    Example:

    ```python
    >>> import torch
    >>> from memopd_trl.losses import chunked_generalized_jsd
    >>> hidden, weight = torch.randn(5, 8), torch.randn(32, 8)
    >>> chunked_generalized_jsd(hidden, weight, hidden, weight, chunk_size=2).abs().max().item() < 1e-6
    True
    ```
    """
    where = "chunked_generalized_jsd"
    _check_beta_temperature(beta, temperature, where)
    _check_chunked_heads(
        where, student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, chunk_size
    )
    return _ChunkedGeneralizedJSD.apply(
        student_hidden,
        student_weight,
        student_bias,
        teacher_hidden.detach(),
        teacher_weight.detach(),
        None if teacher_bias is None else teacher_bias.detach(),
        float(beta),
        float(temperature),
        chunk_size,
    )


DIAGNOSTICS = ("teacher_confidence", "agreement", "forward_kl", "reverse_kl", "student_entropy")


def _tile_diagnostics(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor) -> list[torch.Tensor]:
    """The per-token values of [`DIAGNOSTICS`], in that order, from one tile of log-distributions `(chunk, V)`."""
    student_probs = student_log_probs.exp()  # (chunk, V)
    teacher_max, teacher_argmax = teacher_log_probs.max(-1)  # (chunk,), (chunk,)
    log_ratio = teacher_log_probs - student_log_probs  # log p_t - log p_s, (chunk, V)
    return [
        teacher_max.exp(),
        (teacher_argmax == student_log_probs.argmax(-1)).to(log_ratio.dtype),
        (teacher_log_probs.exp() * log_ratio).sum(-1),  # KL(p_t || p_s)
        -(student_probs * log_ratio).sum(-1),  # KL(p_s || p_t)
        -(student_probs * student_log_probs).sum(-1),
    ]


@torch.no_grad()
def distillation_diagnostics(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> dict[str, torch.Tensor]:
    """
    How the teacher's and the student's next-token distributions compare at each action token, over the full
    vocabulary, in one chunked pass (no gradient; the same tiles as [`chunked_generalized_jsd`]).

    With `p_s`, `p_t` the student's and the teacher's distributions at `temperature`, per token:

    - `"teacher_confidence"`: `max p_t`, the teacher's probability of its own most likely token;
    - `"agreement"`: 1.0 where `argmax p_t == argmax p_s`, else 0.0;
    - `"forward_kl"`: KL(p_t || p_s), what `beta=0` distillation minimizes;
    - `"reverse_kl"`: KL(p_s || p_t), what `beta=1` distillation minimizes;
    - `"student_entropy"`: the entropy of `p_s`.

    Takes the arguments of [`chunked_generalized_jsd`] (without `beta`) and checks them the same way.

    Returns:
        `dict[str, torch.Tensor]`: the names of `DIAGNOSTICS`, each a detached tensor of shape `(num_tokens,)`, fp32
        (fp64 for fp64 inputs).

    Example:

    ```python
    >>> import torch
    >>> from memopd_trl.losses import distillation_diagnostics
    >>> hidden, weight = torch.randn(5, 8), torch.randn(32, 8)
    >>> values = distillation_diagnostics(hidden, weight, hidden, weight, chunk_size=2)
    >>> values["agreement"].tolist(), values["forward_kl"].abs().max().item() < 1e-6
    ([1.0, 1.0, 1.0, 1.0, 1.0], True)
    ```
    """
    where = "distillation_diagnostics"
    _check_beta_temperature(0.0, temperature, where)
    _check_chunked_heads(
        where, student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, chunk_size
    )
    tile_dtype, tiles = _head_tiles(
        student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, temperature,
        chunk_size,
    )  # fmt: skip
    values = torch.empty(len(DIAGNOSTICS), student_hidden.shape[0], device=student_hidden.device, dtype=tile_dtype)
    for rows, student_log_probs, teacher_log_probs in tiles:
        for i, value in enumerate(_tile_diagnostics(student_log_probs, teacher_log_probs)):
            values[i, rows] = value
        del student_log_probs, teacher_log_probs
    return dict(zip(DIAGNOSTICS, values, strict=True))


def until_first_divergence(
    teacher_logprobs: torch.Tensor, sequence_ids: torch.Tensor, threshold: float
) -> torch.Tensor:
    """
    Which action tokens keep a meaningful teacher target: in each action, the tokens up to and including the first
    sampled token whose teacher probability is below `threshold`.

    After the student samples a token the teacher would not have written, the rest of the action continues a prefix
    the teacher never produced, and a teacher that has not learned to continue arbitrary prefixes (a small one
    trained on its own traces) gives noise there (measured per token in docs/results.md).

    Args:
        teacher_logprobs (`torch.Tensor` of shape `(num_tokens,)`): the teacher's log-prob of each sampled token.
        sequence_ids (`torch.Tensor` of shape `(num_tokens,)`): the invocation of each token, non-decreasing
            (the canonical action order: each invocation's tokens together, in order).
        threshold (`float`): probability in (0, 1).

    Returns:
        `torch.Tensor` of shape `(num_tokens,)`, bool: `True` for the tokens to distill on.

    Example:

    ```python
    >>> import math, torch
    >>> from memopd_trl.losses import until_first_divergence
    >>> logprobs = torch.tensor([-0.1, -5.0, -0.1, -0.1, -0.1, -5.0]).float()
    >>> until_first_divergence(logprobs, torch.tensor([0, 0, 0, 1, 1, 1]), threshold=0.1).tolist()
    [True, True, False, True, True, True]
    ```
    """
    _check_same_1d("until_first_divergence", teacher_logprobs=teacher_logprobs, sequence_ids=sequence_ids)
    return _unlikely_before("until_first_divergence", teacher_logprobs, sequence_ids, threshold)[1]


def _unlikely_before(
    where: str, logprobs: torch.Tensor, sequence_ids: torch.Tensor, threshold: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(num_tokens,)` bools: whether each token's log-prob is below `log(threshold)`, and whether no earlier token of
    its own sequence is."""
    if not 0.0 < threshold < 1.0:
        raise ValueError(f"{where}: `threshold` must be in (0, 1), got {threshold}.")
    if sequence_ids.numel() and bool((sequence_ids[1:] < sequence_ids[:-1]).any()):
        raise ValueError(f"{where}: `sequence_ids` must be non-decreasing (the canonical action order).")
    below = (logprobs.detach() < math.log(threshold)).long()
    before = below.cumsum(0) - below  # unlikely tokens before each token, over the whole batch
    _, lengths = torch.unique_consecutive(sequence_ids, return_counts=True)
    starts = lengths.cumsum(0) - lengths  # each sequence's first token
    return below.bool(), before == torch.repeat_interleave(before[starts], lengths)


def without_first_divergence(logprobs: torch.Tensor, sequence_ids: torch.Tensor, threshold: float) -> torch.Tensor:
    """
    Every token but the first of each sequence whose log-prob is below `log(threshold)`: with the student's log-probs
    of a teacher's episode, every token but the teacher's branch point, where the student would have gone elsewhere
    (`MemOPDConfig.distill_warmup_steps`).

    Args:
        logprobs (`torch.Tensor` of shape `(num_tokens,)`): a model's log-prob of each token.
        sequence_ids (`torch.Tensor` of shape `(num_tokens,)`): the sequence of each token, non-decreasing.
        threshold (`float`): probability in (0, 1).

    Returns:
        `torch.Tensor` of shape `(num_tokens,)`, bool: `False` at each sequence's first unlikely token only.

    Example:

    ```python
    >>> import torch
    >>> from memopd_trl.losses import without_first_divergence
    >>> logprobs = torch.tensor([-0.1, -5.0, -5.0, -0.1, -0.1, -0.1])
    >>> without_first_divergence(logprobs, torch.tensor([0, 0, 0, 1, 1, 1]), threshold=0.1).tolist()
    [True, False, True, True, True, True]
    ```
    """
    _check_same_1d("without_first_divergence", logprobs=logprobs, sequence_ids=sequence_ids)
    below, none_before = _unlikely_before("without_first_divergence", logprobs, sequence_ids, threshold)
    return ~(below & none_before)


def sampled_kl_advantages(teacher_logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """
    Per-token reward of on-policy distillation with sampled tokens: `log q(a) - log p(a)` at each sampled action `a`,
    with `q` the teacher and `p` the policy that sampled it.

    It is minus a one-sample estimate of the reverse KL(p || q) at that token: its mean under `p`'s sampling is
    `-KL(p || q)`, 0 exactly when the two distributions agree. Added (times a coefficient) to each token's PPO
    advantage, it pushes the policy up where the teacher likes the sampled token more than the policy did and down
    where less. Both log-probs must be taken at the same temperature (the sampling one) for that mean to hold.

    Args:
        teacher_logprobs (`torch.Tensor` of shape `(num_tokens,)`):
            The teacher's log-probability of each sampled token.
        old_logprobs (`torch.Tensor` of shape `(num_tokens,)`):
            The sampling log-probability of the same tokens (recorded at rollout time).

    Returns:
        `torch.Tensor` of shape `(num_tokens,)`, detached: `teacher_logprobs - old_logprobs`.

    Example:

    ```python
    >>> import torch
    >>> from memopd_trl.losses import sampled_kl_advantages
    >>> sampled_kl_advantages(torch.tensor([-1.0, -3.0]), torch.tensor([-2.0, -1.0])).tolist()
    [1.0, -2.0]
    ```
    """
    _check_same_1d("sampled_kl_advantages", teacher_logprobs=teacher_logprobs, old_logprobs=old_logprobs)
    return (teacher_logprobs.detach() - old_logprobs.detach()).float()


# ----------------------------------------------------------------------------------------------------------------------
# Distillation on a teacher's top-k (a teacher served on its own machine)
# ----------------------------------------------------------------------------------------------------------------------


def topk_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    k: int = 1,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """
    A model's `k` most likely tokens at each position and their log-probs (no grad), from its final hidden states
    and LM head, chunk by chunk: what a teacher server returns, computed from a local teacher (the local teacher
    restricted to its top-k).

    Args:
        hidden (`torch.Tensor` of shape `(num_tokens, hidden_size)`): the final hidden states.
        weight (`torch.Tensor` of shape `(vocab_size, hidden_size)`): the LM head.
        bias (`torch.Tensor` of shape `(vocab_size,)`, *optional*): its bias.
        k (`int`): how many tokens per position (at most `vocab_size`).
        temperature (`float`): the softmax temperature.
        chunk_size (`int`): positions per chunk.

    Returns:
        `tuple[torch.Tensor, torch.Tensor]`: fp32 log-probs `(num_tokens, k)`, in descending order, and their token
        ids `(num_tokens, k)`.
    """
    _check_beta_temperature(0.0, temperature, "topk_logprobs")
    if not 1 <= k <= weight.shape[0]:
        raise ValueError(f"topk_logprobs: `k` must be in [1, vocab_size={weight.shape[0]}], got {k}.")
    values, ids = [], []
    with torch.no_grad():
        for start in range(0, hidden.shape[0], chunk_size):
            log_probs = _log_probs_tile(hidden[start : start + chunk_size], weight, bias, temperature)
            top = log_probs.topk(k, dim=-1)
            values.append(top.values.float())
            ids.append(top.indices)
    if not values:
        return hidden.new_zeros(0, k, dtype=torch.float32), torch.zeros(0, k, dtype=torch.long, device=hidden.device)
    return torch.cat(values), torch.cat(ids)


def _logprobs_at_tile(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, token_ids: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(hidden.to(weight.dtype), weight, bias)
    logits = logits.to(torch.promote_types(weight.dtype, torch.float32)) / temperature
    log_probs = logits.log_softmax(dim=-1)  # (chunk, V); out of place: `_log_probs_tile` is for no-grad tiles
    picked = log_probs.gather(-1, token_ids)  # (chunk, k)
    rest = log_probs.scatter(-1, token_ids, float("-inf")).logsumexp(-1)  # (chunk,): the mass off `token_ids`
    return picked, rest


def logprobs_at(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    token_ids: torch.Tensor,
    valid: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """
    A model's log-probs of given tokens at each position (the student's at the teacher's top-k) and the log of its
    mass on every other token, with gradients, chunk by chunk: each chunk's `(chunk, vocab_size)` log-softmax is
    recomputed in the backward pass (`torch.utils.checkpoint`), so one chunk's exists at a time.

    The rest of the mass is summed over the other tokens rather than taken as `1 - sum(p)`, which in fp32 loses a
    small tail to rounding (an error of 1e-7 is 1% of a tail of 1e-5).

    Args:
        hidden (`torch.Tensor` of shape `(num_tokens, hidden_size)`): the final hidden states.
        weight (`torch.Tensor` of shape `(vocab_size, hidden_size)`), bias (`torch.Tensor`, *optional*): the LM head.
        token_ids (`torch.Tensor` of shape `(num_tokens, k)`): the tokens to read at each position.
        valid (`torch.Tensor` of shape `(num_tokens, k)`, bool, *optional*): the entries of `token_ids` that name a
            token (padding is `False`, and counts in the rest of the mass); all by default.
        temperature (`float`): the softmax temperature.
        chunk_size (`int`): positions per chunk.

    Returns:
        `tuple[torch.Tensor, torch.Tensor]`: fp32 log-probs `(num_tokens, k)`, and the log of the mass on every token
        not in `token_ids` `(num_tokens,)`.
    """
    _check_beta_temperature(0.0, temperature, "logprobs_at")
    if token_ids.dim() != 2 or token_ids.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"logprobs_at: `token_ids` must be (num_tokens={hidden.shape[0]}, k), got {tuple(token_ids.shape)}."
        )
    if valid is not None:  # padding points at the first (valid) entry: a repeated id changes no sum
        token_ids = torch.where(valid, token_ids, token_ids[:, :1])
    dtype = _compute_dtype(hidden, weight)
    picked, rest = [], []
    with torch.autocast(hidden.device.type, enabled=False):
        weight, bias = _cast_head(weight, bias, dtype)
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            tile = torch.utils.checkpoint.checkpoint(
                _logprobs_at_tile, hidden[rows], weight, bias, token_ids[rows], temperature, use_reentrant=False
            )
            picked.append(tile[0])
            rest.append(tile[1])
    if not picked:
        empty = hidden.new_zeros(token_ids.shape, dtype=torch.float32)
        return empty, empty[:, 0]
    return torch.cat(picked).float(), torch.cat(rest).float()


# The smallest tail TRL's server distillation keeps: its top-k mass is capped at `exp(-1e-7)`.
_MIN_TAIL_LOGPROB = math.log(-math.expm1(-1e-7))


def add_tail_bucket(log_probs: torch.Tensor, valid: torch.Tensor, tail: torch.Tensor | None = None) -> torch.Tensor:
    """
    Appends to each position's top-k log-probs a last entry holding the rest of the mass, `log(1 - sum(p_topk))`:
    a proper distribution over `k + 1` outcomes (TRL's server distillation's tail bucket, with its floor: the
    top-k's mass is capped at `exp(-1e-7)` so that the tail stays finite).

    Args:
        log_probs (`torch.Tensor` of shape `(num_tokens, k)`): log-probs of `k` distinct tokens.
        valid (`torch.Tensor` of shape `(num_tokens, k)`, bool): the entries that hold one (padding is `False`).
        tail (`torch.Tensor` of shape `(num_tokens,)`, *optional*): the log of the rest of the mass, where it is
            known directly ([`logprobs_at`]); the same value up to rounding, with a well-conditioned gradient.

    Returns:
        `torch.Tensor` of shape `(num_tokens, k + 1)`; invalid entries are `-inf`.
    """
    log_probs = log_probs.masked_fill(~valid, float("-inf"))
    if tail is None:
        covered = log_probs.logsumexp(dim=-1).clamp(max=-1e-7)
        tail = torch.log(-torch.expm1(covered))
    else:
        tail = tail.clamp(min=_MIN_TAIL_LOGPROB)
    return torch.cat([log_probs, tail.unsqueeze(-1)], dim=-1)


def topk_generalized_jsd(
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    beta: float = 0.5,
    add_tail: bool = True,
    student_tail: torch.Tensor | None = None,
) -> torch.Tensor:
    """
    The generalized JSD per token on the teacher's top-k support: what a teacher that gives only its `k` most likely
    tokens supports (a teacher server). Follows the definitions of TRL's server distillation, for every `beta`.

    With `add_tail` (the default), each side is its `k` log-probs plus a tail bucket for the rest of its mass
    ([`add_tail_bucket`]), so both are proper distributions over the same `k + 1` outcomes and the divergence of
    [`generalized_jsd_loss`] is well defined on them: `beta = 0` is the forward KL(teacher || student) on the top-k
    plus the tail, `beta = 1` the reverse KL on the same support. Without it each side is renormalized over the
    top-k. When `k` covers the whole vocabulary the tail holds no mass and the value equals the full-vocabulary
    divergence.

    Args:
        student_logprobs (`torch.Tensor` of shape `(num_tokens, k)`):
            The student's log-probs (over its whole vocabulary) of the teacher's top-k tokens ([`logprobs_at`]).
        teacher_logprobs (`torch.Tensor` of shape `(num_tokens, k)`):
            The teacher's top-k log-probs; `-inf` marks padding where a position has fewer than `k`.
        beta (`float`, *optional*, defaults to `0.5`): as in [`generalized_jsd_loss`].
        add_tail (`bool`, *optional*, defaults to `True`): TRL's `loss_add_tail`.
        student_tail (`torch.Tensor` of shape `(num_tokens,)`, *optional*): the log of the student's mass off the
            top-k, from [`logprobs_at`]; taken as `1 - sum` of `student_logprobs` when not given.

    Returns:
        `torch.Tensor` of shape `(num_tokens,)`, fp32.

    Example:

    ```python
    >>> import torch
    >>> from memopd_trl.losses import topk_generalized_jsd
    >>> teacher = torch.tensor([[0.7, 0.2]]).log()  # the teacher's top-2; 0.1 elsewhere
    >>> student = torch.tensor([[0.5, 0.3]]).log()  # the student's mass on those two tokens; 0.2 elsewhere
    >>> round(topk_generalized_jsd(student, teacher, beta=0.0).item(), 4)  # KL([.7, .2, .1] || [.5, .3, .2])
    0.0851
    ```
    """
    _check_beta_temperature(beta, 1.0, "topk_generalized_jsd")
    if student_logprobs.shape != teacher_logprobs.shape or student_logprobs.dim() != 2:
        raise ValueError(
            "topk_generalized_jsd: `student_logprobs` and `teacher_logprobs` must both be (num_tokens, k), got "
            f"{tuple(student_logprobs.shape)} and {tuple(teacher_logprobs.shape)}."
        )
    student_logprobs, teacher_logprobs = student_logprobs.float(), teacher_logprobs.float()
    valid = torch.isfinite(teacher_logprobs)  # (n, k)
    if add_tail:
        student = add_tail_bucket(student_logprobs, valid, student_tail)
        teacher = add_tail_bucket(teacher_logprobs, valid)
        valid = torch.cat([valid, torch.ones_like(valid[:, :1])], dim=-1)  # (n, k + 1)
    else:
        student = student_logprobs.masked_fill(~valid, float("-inf"))
        teacher = teacher_logprobs.masked_fill(~valid, float("-inf"))
        student = student - student.logsumexp(dim=-1, keepdim=True)
        teacher = teacher - teacher.logsumexp(dim=-1, keepdim=True)
    # Padding holds 0 (a finite stand-in) before the pointwise terms, so that no NaN reaches the backward pass.
    terms = _pointwise_generalized_jsd(
        torch.where(valid, student, 0.0), torch.where(valid, teacher, 0.0), float(beta)
    )  # (n, k [+ 1])
    return torch.where(valid, terms, 0.0).sum(-1)


# ----------------------------------------------------------------------------------------------------------------------
# Reinforcement learning: PPO-clip, KL to a reference, value loss
# ----------------------------------------------------------------------------------------------------------------------


def _mean_or_zero(values: torch.Tensor) -> torch.Tensor:
    """Mean of a 1-D tensor as fp32, 0 (not NaN) when it is empty."""
    values = values.float()
    return values.mean() if values.numel() > 0 else values.sum()


def _sequence_mean(per_token: torch.Tensor, sequence_ids: torch.Tensor) -> torch.Tensor:
    """Mean within each sequence id, then mean over the sequences present: a scalar."""
    _, inverse, counts = torch.unique(sequence_ids, return_inverse=True, return_counts=True)
    sums = per_token.new_zeros(counts.shape[0]).index_add(0, inverse, per_token)  # (num_sequences,)
    return (sums / counts.to(per_token.dtype)).mean()


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    sequence_ids: torch.Tensor | None = None,
    aggregation: str = "token_mean",
    sampling_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """
    PPO clipped surrogate loss on action tokens, with token-level importance ratios.

    Per token, with `ratio = exp(logprobs - old_logprobs)`, the loss is the pessimistic
    `max(-advantages * ratio, -advantages * clip(ratio, 1 - epsilon, 1 + epsilon_high))`. An asymmetric upper bound
    (`epsilon_high > epsilon`, "clip-higher") leaves more room to raise the probability of rare good tokens.

    Args:
        logprobs (`torch.Tensor` of shape `(num_tokens,)`):
            Log-probabilities of the sampled tokens under the policy being trained (carries the gradient).
        old_logprobs (`torch.Tensor` of shape `(num_tokens,)`):
            Log-probabilities of the same tokens under the policy that sampled them (treated as constants).
        advantages (`torch.Tensor` of shape `(num_tokens,)`):
            Advantage of each token (treated as constants).
        epsilon (`float`, *optional*, defaults to `0.2`):
            Lower clipping range, in `(0, 1)`: ratios are clipped from below at `1 - epsilon`.
        epsilon_high (`float`, *optional*, defaults to `None`):
            Upper clipping range, `> 0`: ratios are clipped from above at `1 + epsilon_high`. Defaults to `epsilon`.
        sequence_ids (`torch.Tensor` of shape `(num_tokens,)`, integer, *optional*, defaults to `None`):
            Which sequence (e.g. invocation or episode) each token belongs to; needed for `"sequence_mean"`. The ids
            need not be contiguous or sorted.
        aggregation (`str`, *optional*, defaults to `"token_mean"`):
            `"token_mean"` averages over all tokens; `"sequence_mean"` averages within each sequence, then over
            sequences (every sequence weighs the same, whatever its length).
        sampling_weights (`torch.Tensor` of shape `(num_tokens,)`, *optional*, defaults to `None`):
            Importance weights of the sampling engine against the trained policy at the rollout
            ([`importance_sampling_weights`]): each token's loss is multiplied by its weight (treated as constants),
            as TRL's GRPO does with its vLLM importance sampling correction. `None`: every weight is 1.

    Returns:
        `tuple[torch.Tensor, dict[str, torch.Tensor]]`: the scalar loss (0 when `num_tokens` is 0), and detached fp32
        scalar statistics, all token means:
        - `"clip_fraction_low"`: tokens with `ratio < 1 - epsilon` and a negative advantage (the clipped term is
          chosen, the gradient is zero);
        - `"clip_fraction_high"`: tokens with `ratio > 1 + epsilon_high` and a positive advantage;
        - `"clip_fraction"`: the sum of the two;
        - `"ratio_mean"`: mean importance ratio;
        - `"approx_kl"`: the k3 estimate of KL(old || new), mean of `(ratio - 1) - log(ratio)`.

    Example:

    ```python
    >>> import torch
    >>> from memopd_trl import ppo_clip_loss
    >>> loss, stats = ppo_clip_loss(torch.tensor([0.0, 0.5]), torch.zeros(2), torch.tensor([1.0, 1.0]))
    >>> round(loss.item(), 4), stats["clip_fraction"].item()
    (-1.1, 0.5)
    ```
    """
    where = "ppo_clip_loss"
    _check_same_1d(
        where,
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        advantages=advantages,
        sequence_ids=sequence_ids,
        sampling_weights=sampling_weights,
    )
    if not 0.0 < epsilon < 1.0:
        raise ValueError(f"{where}: `epsilon` must be in (0, 1), got {epsilon}.")
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    if not epsilon_high > 0.0:
        raise ValueError(f"{where}: `epsilon_high` must be > 0 (or None to use `epsilon`), got {epsilon_high}.")
    if aggregation not in _PPO_AGGREGATIONS:
        raise ValueError(f"{where}: `aggregation` must be one of {_PPO_AGGREGATIONS}, got {aggregation!r}.")
    if aggregation == "sequence_mean" and sequence_ids is None:
        raise ValueError(f"{where}: `aggregation='sequence_mean'` needs `sequence_ids` (one id per token).")
    if sequence_ids is not None and (sequence_ids.is_floating_point() or sequence_ids.is_complex()):
        raise ValueError(f"{where}: `sequence_ids` must be an integer tensor, got dtype {sequence_ids.dtype}.")

    old_logprobs = old_logprobs.detach()
    advantages = advantages.detach()
    log_ratio = logprobs - old_logprobs  # (N,)
    ratio = log_ratio.exp()  # (N,)
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * ratio.clamp(1.0 - epsilon, 1.0 + epsilon_high)
    per_token_loss = torch.maximum(unclipped_loss, clipped_loss)  # (N,)
    if sampling_weights is not None:
        per_token_loss = per_token_loss * sampling_weights.detach()

    if per_token_loss.numel() == 0:
        loss = per_token_loss.sum()  # 0, still attached to the graph
    elif aggregation == "token_mean":
        loss = per_token_loss.mean()
    else:
        loss = _sequence_mean(per_token_loss, sequence_ids)

    with torch.no_grad():
        clipped_low = (ratio < 1.0 - epsilon) & (advantages < 0)
        clipped_high = (ratio > 1.0 + epsilon_high) & (advantages > 0)
        stats = {
            "clip_fraction_low": _mean_or_zero(clipped_low),
            "clip_fraction_high": _mean_or_zero(clipped_high),
            "clip_fraction": _mean_or_zero(clipped_low | clipped_high),
            "ratio_mean": _mean_or_zero(ratio),
            "approx_kl": _mean_or_zero((ratio - 1.0) - log_ratio),
        }
    return loss, stats


IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def importance_sampling_weights(
    trainer_logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    sequence_ids: torch.Tensor,
    mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> torch.Tensor:
    """
    Importance weights that correct the PPO loss for the gap between the engine that sampled the tokens and the trained
    policy (kernels, dtype, top-p renormalization): the ratio `p_trainer / p_engine` at each sampled token, per token
    or per sequence, truncated or masked outside `[clip_min, clip_max]`. The definitions and defaults of TRL's GRPO
    (`vllm_importance_sampling_mode`, `vllm_importance_sampling_clip_max` / `_min`).

    Args:
        trainer_logprobs (`torch.Tensor` of shape `(num_tokens,)`):
            The trained policy's log-prob of each sampled token at the rollout (the PPO loss's old log-probs).
        sampling_logprobs (`torch.Tensor` of shape `(num_tokens,)`):
            The sampling engine's log-prob of the same tokens. A NaN (a token the engine did not score) counts as no
            gap: its ratio is 1.
        sequence_ids (`torch.Tensor` of shape `(num_tokens,)`, integer):
            The sequence of each token (an invocation: one sampled action); `sequence_*` modes give all its tokens
            one ratio, the exponential of the sum of their log-ratios.
        mode (`str`, *optional*, defaults to `"sequence_mask"`):
            `"token_truncate"` (each token's ratio clipped to `[clip_min, clip_max]`), `"token_mask"` (ratios outside
            set to 0), `"sequence_truncate"`, `"sequence_mask"` (the same, per sequence).
        clip_min (`float`, *optional*, defaults to `None`), clip_max (`float`, *optional*, defaults to `3.0`):
            The bounds; `None` leaves that side open.

    Returns:
        `torch.Tensor` of shape `(num_tokens,)`, fp32, detached: the weight of each token.

    Example:

    ```python
    >>> import torch
    >>> from memopd_trl.losses import importance_sampling_weights
    >>> trainer, engine = torch.tensor([-1.0, -1.0, -0.5]), torch.tensor([-1.0, -3.0, -0.5])
    >>> importance_sampling_weights(trainer, engine, torch.tensor([0, 1, 1]), mode="token_truncate").tolist()
    [1.0, 3.0, 1.0]
    ```
    """
    where = "importance_sampling_weights"
    _check_same_1d(
        where, trainer_logprobs=trainer_logprobs, sampling_logprobs=sampling_logprobs, sequence_ids=sequence_ids
    )
    if mode not in IMPORTANCE_SAMPLING_MODES:
        raise ValueError(f"{where}: `mode` must be one of {IMPORTANCE_SAMPLING_MODES}, got {mode!r}.")
    log_ratio = torch.nan_to_num(trainer_logprobs.detach().float() - sampling_logprobs.detach().float(), nan=0.0)
    if mode.startswith("sequence"):
        _, inverse = torch.unique(sequence_ids, return_inverse=True)
        num_sequences = int(inverse.max()) + 1 if len(inverse) else 0
        log_ratio = log_ratio.new_zeros(num_sequences).index_add(0, inverse, log_ratio)[inverse]
    ratio = log_ratio.exp()  # (N,)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    if mode.endswith("truncate"):
        return ratio.clamp(min=low, max=high)
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)

def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """
    Per-token estimate of KL(policy || reference) from tokens sampled by the policy.

    With `log_ratio = logprobs - ref_logprobs`:
    - `"k1"`: `log_ratio` (unbiased, high variance, can be negative);
    - `"k2"`: `0.5 * log_ratio**2` (biased, low variance, non-negative);
    - `"k3"`: `exp(-log_ratio) - 1 + log_ratio` (unbiased, low variance, non-negative).

    Args:
        logprobs (`torch.Tensor` of shape `(num_tokens,)`):
            Log-probabilities of the sampled tokens under the policy (carries the gradient).
        ref_logprobs (`torch.Tensor` of shape `(num_tokens,)`):
            Log-probabilities of the same tokens under the reference model (treated as constants).
        kind (`str`, *optional*, defaults to `"k3"`):
            One of `"k1"`, `"k2"`, `"k3"`.

    Returns:
        `torch.Tensor` of shape `(num_tokens,)`: the per-token estimate; average it with the same aggregation as the
        policy loss.
    """
    where = "kl_penalty"
    _check_same_1d(where, logprobs=logprobs, ref_logprobs=ref_logprobs)
    if kind not in _KL_KINDS:
        raise ValueError(f"{where}: `kind` must be one of {_KL_KINDS}, got {kind!r}.")
    log_ratio = logprobs - ref_logprobs.detach()  # (N,)
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    return torch.expm1(-log_ratio) + log_ratio


def value_loss(
    values: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor | None = None,
    clip: float | None = None,
) -> torch.Tensor:
    """
    Squared-error value loss, optionally clipped around the values of the rollout policy (as in PPO).

    Per token the loss is `0.5 * (values - returns)**2`; with `clip`, it is the larger of that and
    `0.5 * (old_values + clamp(values - old_values, -clip, clip) - returns)**2`.

    Args:
        values (`torch.Tensor` of shape `(num_tokens,)`):
            Current value predictions (carries the gradient).
        returns (`torch.Tensor` of shape `(num_tokens,)`):
            Return targets (treated as constants), e.g. from [`gae_advantages`].
        old_values (`torch.Tensor` of shape `(num_tokens,)`, *optional*, defaults to `None`):
            Value predictions made at rollout time; needed when `clip` is set.
        clip (`float`, *optional*, defaults to `None`):
            Clipping range, `> 0`, or `None` for no clipping.

    Returns:
        `torch.Tensor`: the scalar mean loss over tokens (0 when there are none).
    """
    where = "value_loss"
    _check_same_1d(where, values=values, returns=returns, old_values=old_values)
    returns = returns.detach()
    per_token = 0.5 * (values - returns).square()  # (N,)
    if clip is not None:
        if not clip > 0:
            raise ValueError(f"{where}: `clip` must be > 0 or None, got {clip}.")
        if old_values is None:
            raise ValueError(f"{where}: `clip={clip}` needs `old_values` (the values predicted at rollout time).")
        old_values = old_values.detach()
        clipped_values = old_values + (values - old_values).clamp(-clip, clip)
        per_token = torch.maximum(per_token, 0.5 * (clipped_values - returns).square())
    return per_token.mean() if per_token.numel() > 0 else per_token.sum()


# ----------------------------------------------------------------------------------------------------------------------
# Advantage estimators
# ----------------------------------------------------------------------------------------------------------------------


def group_normalized_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-4, scale: bool | str = True
) -> torch.Tensor:
    """
    Group-relative advantages (as in GRPO): each episode's reward minus the mean reward of its group (the episodes
    answering the same question), divided by a standard deviation plus `eps` as `scale` says (TRL's `scale_rewards`).

    The standard deviation is the population one (`unbiased=False`): it is defined for every group size and gives the
    normalized advantages of a group unit mean square (up to `eps`). A degenerate group (size 1, or all rewards equal)
    carries no learning signal and gets advantages of exactly 0, never NaN.

    Args:
        rewards (`torch.Tensor` of shape `(num_episodes,)`):
            Final reward of each episode; must be finite.
        group_ids (`torch.Tensor` of shape `(num_episodes,)`, integer):
            Group of each episode. Ids need not be contiguous or sorted.
        eps (`float`, *optional*, defaults to `1e-4`):
            Added to the standard deviation, `>= 0`.
        scale (`bool` or `str`, *optional*, defaults to `True`):
            `"group"` (or `True`): divide by the group's standard deviation. `"batch"`: by the standard deviation of
            all of `rewards` (no group's near-zero spread is blown up to full-size advantages). `"none"` (or
            `False`): mean-centering only, as in Dr. GRPO.

    Returns:
        `torch.Tensor` of shape `(num_episodes,)`, floating point, detached: the advantages.

    Example:

    ```python
    >>> import torch
    >>> from memopd_trl.losses import group_normalized_advantages
    >>> group_normalized_advantages(torch.tensor([1.0, 0.0, 0.5]), torch.tensor([0, 0, 1]), eps=0.0).tolist()
    [1.0, -1.0, 0.0]
    ```
    """
    where = "group_normalized_advantages"
    _check_same_1d(where, rewards=rewards, group_ids=group_ids)
    if group_ids.is_floating_point() or group_ids.is_complex():
        raise ValueError(f"{where}: `group_ids` must be an integer tensor, got dtype {group_ids.dtype}.")
    if eps < 0:
        raise ValueError(f"{where}: `eps` must be >= 0, got {eps}.")
    scale = {True: "group", False: "none"}.get(scale, scale) if isinstance(scale, bool) else scale
    if scale not in ("group", "batch", "none"):
        raise ValueError(f'{where}: `scale` must be "group", "batch", "none" or a bool, got {scale!r}.')
    rewards = rewards.detach()
    if not rewards.is_floating_point():
        rewards = rewards.float()
    if not torch.isfinite(rewards).all():
        bad = torch.nonzero(~torch.isfinite(rewards)).flatten().tolist()
        raise ValueError(f"{where}: `rewards` must be finite; episodes {bad} have NaN or infinite rewards.")
    if rewards.numel() == 0:
        return rewards.clone()

    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    num_groups = counts.shape[0]
    counts = counts.to(rewards.dtype)  # (G,)
    means = rewards.new_zeros(num_groups).index_add(0, inverse, rewards) / counts  # (G,)
    advantages = rewards - means[inverse]  # (E,)
    if scale == "group":
        variances = rewards.new_zeros(num_groups).index_add(0, inverse, advantages.square()) / counts  # (G,)
        advantages = advantages / (variances.sqrt()[inverse] + eps)
    elif scale == "batch":
        advantages = advantages / (rewards.std(unbiased=False) + eps)
    group_max = rewards.new_full((num_groups,), -math.inf).scatter_reduce(0, inverse, rewards, reduce="amax")
    group_min = rewards.new_full((num_groups,), math.inf).scatter_reduce(0, inverse, rewards, reduce="amin")
    degenerate = (group_max == group_min)[inverse]  # (E,)
    return advantages.masked_fill(degenerate, 0.0)


def gae_advantages(
    rewards: torch.Tensor,
    values: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """
    Generalized advantage estimation over the action tokens of one episode, or of a padded batch of episodes.

    Each episode is the sequence of its action tokens (all its invocations' `output_ids`, in turn order), usually with
    the final reward on its last token and 0 elsewhere; the episode ends after its last token (the value there is 0).
    `delta_t = r_t + gamma * V_{t+1} - V_t` and `A_t = delta_t + gamma * lam * A_{t+1}`; `returns = A + V`.
    With `gamma = lam = 1` and only a final reward `R`, `returns` is `R` at every token.

    Args:
        rewards (`torch.Tensor` of shape `(num_tokens,)` or `(batch_size, num_tokens)`):
            Per-token rewards.
        values (`torch.Tensor`, same shape as `rewards`):
            Per-token value estimates (treated as constants).
        gamma (`float`, *optional*, defaults to `1.0`):
            Discount factor, in `[0, 1]`.
        lam (`float`, *optional*, defaults to `1.0`):
            GAE lambda, in `[0, 1]`.
        mask (`torch.Tensor`, bool, same shape as `rewards`, *optional*, defaults to `None`):
            Which positions are action tokens. Masked-out positions (padding, or tokens to skip inside a row) are
            stepped over: they neither receive nor pass on anything, and their rewards are ignored; their advantages
            and returns are 0. `None` means every position counts.

    Returns:
        `tuple[torch.Tensor, torch.Tensor]`: `(advantages, returns)`, each of the shape of `rewards`, detached.
    """
    where = "gae_advantages"
    if rewards.shape != values.shape:
        raise ValueError(
            f"{where}: `rewards` has shape {tuple(rewards.shape)} but `values` has shape {tuple(values.shape)}."
        )
    if rewards.dim() not in (1, 2):
        raise ValueError(
            f"{where}: `rewards` must be (num_tokens,) or (batch_size, num_tokens), got shape {tuple(rewards.shape)}."
        )
    if mask is not None and mask.shape != rewards.shape:
        raise ValueError(f"{where}: `mask` has shape {tuple(mask.shape)}, expected {tuple(rewards.shape)}.")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"{where}: `gamma` must be in [0, 1], got {gamma}.")
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"{where}: `lam` must be in [0, 1], got {lam}.")

    squeeze = rewards.dim() == 1
    dtype = torch.promote_types(torch.promote_types(rewards.dtype, values.dtype), torch.float32)
    rewards = rewards.detach().to(dtype).reshape(-1, rewards.shape[-1])  # (B, T)
    values = values.detach().to(dtype).reshape(rewards.shape)  # (B, T)
    mask = torch.ones_like(rewards, dtype=torch.bool) if mask is None else mask.to(torch.bool).reshape(rewards.shape)

    batch_size, num_tokens = rewards.shape
    advantages = torch.zeros_like(rewards)  # (B, T)
    next_value = rewards.new_zeros(batch_size)  # (B,): value of the next kept token, 0 past the end
    next_advantage = rewards.new_zeros(batch_size)  # (B,)
    for t in reversed(range(num_tokens)):
        kept = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = torch.where(kept, advantage, 0.0)
        next_value = torch.where(kept, values[:, t], next_value)
        next_advantage = torch.where(kept, advantage, next_advantage)
    returns = torch.where(mask, advantages + values, 0.0)
    if squeeze:
        return advantages[0], returns[0]
    return advantages, returns


def final_reward_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    tokens_per_episode: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """
    [`gae_advantages`] for episodes rewarded once, at their end: the episodes' action tokens, flat in canonical order,
    are laid out as one padded `(num_episodes, max_tokens)` batch with each final reward on its episode's last token.

    Args:
        rewards (`torch.Tensor` of shape `(num_episodes,)`):
            The final reward of each episode.
        values (`torch.Tensor` of shape `(N,)`):
            The value of every action token, flat in canonical order (episode by episode).
        tokens_per_episode (`torch.Tensor` of shape `(num_episodes,)`):
            The number of action tokens of each episode (they add up to `N`).
        gamma (`float`, *optional*, defaults to `1.0`), lam (`float`, *optional*, defaults to `1.0`):
            As in [`gae_advantages`].

    Returns:
        `tuple[torch.Tensor, torch.Tensor]`: `(advantages, returns)`, each `(N,)` in canonical order.
    """
    width = int(tokens_per_episode.max())
    mask = torch.arange(width) < tokens_per_episode[:, None]  # (E, T): the action tokens of each episode
    padded_values = torch.zeros(mask.shape).masked_scatter(mask, values)  # (E, T)
    last_token = (tokens_per_episode - 1).clamp(min=0)
    token_rewards = torch.zeros(mask.shape)  # (E, T): the final reward on each episode's last action token
    token_rewards[torch.arange(len(rewards)), last_token] = torch.where(tokens_per_episode > 0, rewards, 0.0)
    advantages, returns = gae_advantages(token_rewards, padded_values, gamma=gamma, lam=lam, mask=mask)
    return advantages[mask], returns[mask]  # row-major order over the mask is canonical order

def broadcast_to_tokens(
    values_per_episode: torch.Tensor, tokens_per_episode: torch.Tensor | list[int]
) -> torch.Tensor:
    """
    Repeats one scalar per episode (e.g. its group-normalized advantage) onto every action token of all its
    invocations, in the canonical order: episode by episode, then invocation and token order inside each.

    Args:
        values_per_episode (`torch.Tensor` of shape `(num_episodes,)`):
            One value per episode.
        tokens_per_episode (`torch.Tensor` of shape `(num_episodes,)` or `list[int]`):
            Number of action tokens of each episode (the sum of `len(inv.output_ids)` over its invocations), `>= 0`.

    Returns:
        `torch.Tensor` of shape `(sum(tokens_per_episode),)`: the per-token values.

    Example:

    ```python
    >>> import torch
    >>> from memopd_trl.losses import broadcast_to_tokens
    >>> broadcast_to_tokens(torch.tensor([0.5, -1.0]), [2, 3]).tolist()
    [0.5, 0.5, -1.0, -1.0, -1.0]
    ```
    """
    where = "broadcast_to_tokens"
    counts = torch.as_tensor(tokens_per_episode, dtype=torch.long, device=values_per_episode.device)
    _check_same_1d(where, values_per_episode=values_per_episode, tokens_per_episode=counts)
    if counts.numel() > 0 and int(counts.min()) < 0:
        raise ValueError(f"{where}: `tokens_per_episode` must be >= 0, got {counts.tolist()}.")
    return values_per_episode.repeat_interleave(counts)
