"""
The data of one training step, as `MemOPDTrainer` passes it from stage to stage: a `Rollout` is scored into a
`ScoredBatch` (or a `SkippedBatch`), whose rows become `LossPiece`s, one student forward and backward each.

Per-token tensors are `(N,)` (or `(N, ...)`) over the `N` action tokens of the rollout, in canonical order: episode by
episode, then invocation by invocation, then token by token (`Rollout.invocations` flattened).
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from torch import nn

from .losses import chunked_generalized_jsd, logprobs_at, topk_generalized_jsd
from .records import Episode, Invocation
from .scoring import gathered_lm_head


@dataclass
class Rollout:
    """
    One rollout batch of the student.

    Args:
        episodes (`list[Episode]`): the episodes, record by record, every model call recorded.
        stats (`dict[str, float]`): the rollout statistics of `RolloutEngine.rollout`.
        seconds (`dict[str, float]`): the seconds each stage of the step took (`rollout`, `teacher`, ...), for the
            `time/*` logs.
    """

    episodes: list[Episode]
    stats: dict[str, float]
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def invocations(self) -> list[Invocation]:
        """Every model call of the batch, episode by episode (the canonical order of the per-token tensors)."""
        return [inv for ep in self.episodes for inv in ep.invocations]

    def sequence_ids(self) -> torch.Tensor:
        """`(N,)`: the index of the invocation of each action token."""
        tokens = torch.tensor([len(inv.output_ids) for inv in self.invocations], dtype=torch.long)
        return torch.repeat_interleave(torch.arange(len(tokens)), tokens)

    def tokens_per_episode(self) -> list[int]:
        """The number of action tokens of each episode."""
        return [sum(len(inv.output_ids) for inv in ep.invocations) for ep in self.episodes]

    def metrics(self, packed: dict[str, Any] | None = None) -> dict[str, float]:
        """
        This process's statistics of the rollout, and of its `packed` batch when it was packed, by log name:
        invocation sizes, `packing/*`, `rollout/*` and the `time/*` of each stage.
        """
        metrics, invocations, stats = {}, self.invocations, self.stats
        generated = sum(len(inv.output_ids) for inv in invocations)
        if invocations:
            metrics["context_tokens_per_invocation"] = sum(len(inv.input_ids) for inv in invocations) / len(invocations)
            metrics["action_tokens_per_invocation"] = generated / len(invocations)
        if packed is not None:
            # Rows are forwarded one at a time, cut at their last token: no row padding, one forward per row.
            metrics["packing/rows"] = float(packed["input_ids"].shape[0])
            # Share of the rebuilt tokens that shared-prefix packing did not lay out again.
            saved = packed.get("num_tokens_saved", 0)
            metrics["packing/shared_fraction"] = saved / max(packed["num_real_tokens"] + saved, 1)
        for key in ("num_context_truncations", "num_failed_episodes", "num_prompt_too_long", "num_truncated_outputs"):
            if key in stats:
                metrics[f"rollout/{key.removeprefix('num_')}"] = float(stats[key])
        if stats.get("num_prompt_tokens"):
            # Share of the context tokens the rollout did not encode again (shared prompt prefill).
            shared = stats.get("num_shared_prefill_tokens", 0)
            metrics["rollout/shared_prefill_fraction"] = shared / stats["num_prompt_tokens"]
        for key, value in self.seconds.items():
            metrics[f"time/{key}"] = value
        if self.seconds.get("rollout"):
            metrics["rollout/tokens_per_second"] = generated / self.seconds["rollout"]
        return metrics


@dataclass
class TeacherScores:
    """
    What the teacher says about a sequence of action tokens: its distribution at each of them, in the exact state (or,
    for the control, the flattened history) the action was scored in.

    A local teacher gives its final hidden state at each action position and the model whose LM head turns it into
    full-vocabulary logits (`lm_head()`): the losses apply the head chunk by chunk, so the `(N, vocab)` logits are
    never held at once.

    Args:
        hidden (`torch.Tensor` of shape `(N, hidden_size)`): the teacher's final hidden state at each action position.
        model (`nn.Module`): the teacher, whose LM head `lm_head()` yields (gathered when it is sharded).
        vocab_size (`int`): the shared tokenizer's vocabulary size (the head's rows beyond it are never scored).
        sampled_logprobs (`torch.Tensor` of shape `(N,)`, *optional*): the teacher's log-prob of each sampled token
            at the sampling temperature; set when a loss term needs it (`sampled_kl_coef`,
            `distill_divergence_threshold`).
    """

    hidden: torch.Tensor
    model: nn.Module
    vocab_size: int
    sampled_logprobs: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.hidden.shape[0]

    @contextmanager
    def lm_head(self) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        """The teacher's LM head `(weight, bias)`, gathered for the duration when it is sharded. Collective then."""
        with gathered_lm_head(self.model, self.vocab_size) as head:
            yield head

    def divergence(self, student_hidden, student_head, index, teacher_head, beta, temperature, chunk_size, **_):
        """
        `(n,)`: the generalized JSD between the teacher and the student over the full vocabulary at the action tokens
        `index` of these scores, from the student's hidden states there and its LM head `(weight, bias)`, and the
        teacher's LM head (`lm_head()`), chunk by chunk (`losses.chunked_generalized_jsd`).
        """
        (weight, bias), (teacher_weight, teacher_bias) = student_head, teacher_head
        return chunked_generalized_jsd(
            student_hidden, weight, self.hidden[index], teacher_weight, beta=beta, temperature=temperature,
            student_bias=bias, teacher_bias=teacher_bias, chunk_size=chunk_size,
        )  # fmt: skip


@dataclass
class TopKTeacherScores:
    """
    What a teacher that gives only its `k` most likely tokens says about the action tokens (a teacher on its own
    server, or a local one restricted to its top-k, `MemOPDConfig.loss_top_k`): the losses are then taken on that
    support plus a tail bucket (`losses.topk_generalized_jsd`).

    Args:
        logprobs (`torch.Tensor` of shape `(N, k)`): the teacher's top-k log-probs at each action token, in
            descending order, at temperature 1 (`-inf` pads a position that has fewer).
        token_ids (`torch.Tensor` of shape `(N, k)`): their token ids.
        sampled_logprobs (`torch.Tensor` of shape `(N,)`, *optional*): the teacher's log-prob of each sampled token.
    """

    logprobs: torch.Tensor
    token_ids: torch.Tensor
    sampled_logprobs: torch.Tensor | None = None

    @contextmanager
    def lm_head(self) -> Iterator[tuple[None, None]]:
        """No LM head: the scores are the log-probs themselves."""
        yield None, None

    def divergence(self, student_hidden, student_head, index, teacher_head, beta, temperature, chunk_size, add_tail):
        """
        `(n,)`: the generalized JSD on the teacher's top-k support (plus a tail bucket with `add_tail`) at the action
        tokens `index` of these scores, from the student's hidden states there and its LM head `(weight, bias)`
        (`losses.topk_generalized_jsd`; `teacher_head` is not needed).
        """
        teacher = self.logprobs[index]  # (n, k)
        student, rest = logprobs_at(
            student_hidden, *student_head, self.token_ids[index], torch.isfinite(teacher), temperature, chunk_size
        )  # (n, k), (n,)
        return topk_generalized_jsd(student, teacher, beta, add_tail, rest)

    def __len__(self) -> int:
        return self.logprobs.shape[0]


@dataclass
class TeacherPlay:
    """
    The teacher's own episodes (`teacher_generations`), distilled into the student beside its rollout.

    Args:
        invocations (`list[Invocation]`): the teacher's model calls.
        teacher (`TeacherScores`): the teacher's scores of their actions, `(N_play, ...)`.
        joint_rows (`list[dict]`): the rollout's invocations, then these, packed together and split into rows: the
            student's forwards run on these (a row can hold actions of both).
        distill_mask (`torch.Tensor` of shape `(N_play,)`, *optional*): the tokens the distillation keeps (during
            `distill_warmup_steps`); `None` keeps all.
    """

    invocations: list[Invocation]
    teacher: "TeacherScores | TopKTeacherScores"
    joint_rows: list[dict[str, Any]]
    distill_mask: torch.Tensor | None = None

    @cached_property
    def turns(self) -> torch.Tensor:
        """`(N_play,)`: the turn of each action token, in the canonical order (on the CPU)."""
        return torch.tensor([inv.turn for inv in self.invocations for _ in inv.output_ids], dtype=torch.long)


@dataclass
class ScoredBatch:
    """
    One rollout, packed and scored: everything the student's loss needs, `(N,)` per action token in canonical order.

    Args:
        packed (`dict`): the rollout's invocations packed (`PackedInvocationCollator`).
        rows (`list[dict]`): `packed` split into rows, each forwarded on its own (`split_rows`).
        sequence_ids (`torch.Tensor` of shape `(N,)`): the invocation of each action token.
        old_logprobs (`torch.Tensor` of shape `(N,)`): PPO's old log-prob of each token: the one the rollout sampled
            it with, or with `importance_sampling_correction` the student's own at the rollout.
        advantages (`torch.Tensor` of shape `(N,)`): the advantage of each token.
        rewarded (`torch.Tensor` of shape `(N,)`): whether the token's episode has a reward > 0 (diagnostics).
        returns (`torch.Tensor` of shape `(N,)`, *optional*): the value targets (`advantage_estimator="gae"`).
        old_values (`torch.Tensor` of shape `(N,)`, *optional*): the values at the rollout (clipped value loss).
        teacher (`TeacherScores`, *optional*): the teacher's scores of the rollout's actions.
        distill_mask (`torch.Tensor` of shape `(N,)`, *optional*): the tokens the distillation loss keeps
            (`distill_divergence_threshold`); `None` keeps every token.
        ref_logprobs (`torch.Tensor` of shape `(N,)`, *optional*): the reference model's log-probs (`kl_coef > 0`).
        anchor (`TeacherScores`, *optional*): the student's start's scores of the rollout's actions, its teacher on
            them during the distillation warm-up (`distill_warmup_anchor_coef > 0`).
        teacher_play (`TeacherPlay`, *optional*): the teacher's own episodes (`teacher_generations > 0`).
        sampling_logprobs (`torch.Tensor` of shape `(N,)`, *optional*): with `importance_sampling_correction`, the
            log-prob the sampling engine gave each token.
        sampling_weights (`torch.Tensor` of shape `(N,)`, *optional*): with `importance_sampling_correction`, the
            importance weight of each token's PPO loss (`losses.importance_sampling_weights`).
    """

    packed: dict[str, Any]
    rows: list[dict[str, Any]]
    sequence_ids: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    rewarded: torch.Tensor
    returns: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    teacher: TeacherScores | TopKTeacherScores | None = None
    distill_mask: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    anchor: TeacherScores | None = None
    teacher_play: TeacherPlay | None = None
    sampling_logprobs: torch.Tensor | None = None
    sampling_weights: torch.Tensor | None = None

    @property
    def num_actions(self) -> int:
        return len(self.old_logprobs)

    def sampling_metrics(self) -> dict[str, float]:
        """
        With `importance_sampling_correction`, the gap between the sampling engine and the student, by TRL's log names:
        `sampling/sampling_logp_difference/{mean,max}` (per token, nats) and
        `sampling/importance_sampling_ratio/{min,mean,max}` (the weights).
        """
        if self.sampling_weights is None:
            return {}
        gap = (self.old_logprobs - self.sampling_logprobs).abs()
        gap = gap[~gap.isnan()]  # tokens the engine did not score
        metrics = {}
        if len(gap):
            metrics["sampling/sampling_logp_difference/mean"] = gap.mean().item()
            metrics["sampling/sampling_logp_difference/max"] = gap.max().item()
        weights = self.sampling_weights
        for name, value in (("min", weights.min()), ("mean", weights.mean()), ("max", weights.max())):
            metrics[f"sampling/importance_sampling_ratio/{name}"] = value.item()
        return metrics

    @property
    def student_rows(self) -> list[dict[str, Any]]:
        """The rows the student's loss forwards: the rollout's, or the joint rows with the teacher's episodes."""
        return self.rows if self.teacher_play is None else self.teacher_play.joint_rows


@dataclass
class SkippedBatch:
    """A rollout with nothing to learn from: its update is skipped on every process, for `reason`."""

    reason: str


@dataclass
class LossPiece:
    """
    One forward and backward pass of the student: a row of a scored batch (`row=None` for a skipped batch), with the
    batch-level counts its loss terms are shares of (`actions`, `sequences`, `distilled`, `play`).
    """

    batch: ScoredBatch | SkippedBatch
    row: dict[str, Any] | None
    counts: dict[str, int] = field(default_factory=dict)
