"""
The live alignment audit (`MemOPDConfig.misalignment_audit_steps`): how far the teacher's targets move when the
student's actions are scored under the flattened persistent history instead of in the state they were sampled in.

The trainer scores the audited actions under both layouts and logs, per turn, `KL(teacher aligned || teacher
persistent)` at temperature 1 (`misalignment/kl_turn_{k}`). Turn 0 is exact in both layouts (nothing has been
rewritten yet), so its KL is 0 up to float rounding; later turns show what persistent scoring changes.
"""

import itertools
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .losses import chunked_generalized_jsd
from .records import Invocation
from .step import TeacherScores, TopKTeacherScores


if TYPE_CHECKING:
    from .teacher import LocalTeacher, ServerTeacher


def auditable_invocations(invocations: list[Invocation], max_length: int | None) -> tuple[list[int], torch.Tensor]:
    """
    The invocations whose episode can be flattened into one persistent history the teacher can take: no longer than
    `max_length` tokens, and every earlier turn's `observation_ids` recorded.

    Args:
        invocations (`list[Invocation]`):
            A rollout's invocations, in canonical order.
        max_length (`int`, *optional*):
            The longest sequence the teacher takes (`None`: no limit).

    Returns:
        `tuple[list[int], torch.Tensor]`: the indices (into `invocations`) of the audited invocations, and the
        canonical index of each of their action tokens, `(N_audited,)`.
    """
    limit = max_length or float("inf")
    episodes: dict[int, list[int]] = defaultdict(list)  # episode id -> indices into `invocations`
    for i, inv in enumerate(invocations):
        episodes[inv.episode_id].append(i)
    offsets = [0, *itertools.accumulate(len(inv.output_ids) for inv in invocations)]
    kept, tokens = [], [torch.zeros(0, dtype=torch.long)]
    for indices in episodes.values():
        episode = [invocations[i] for i in indices]
        history = len(episode[0].input_ids) + sum(len(inv.output_ids) for inv in episode)
        history += sum(len(inv.observation_ids or []) for inv in episode[:-1])
        if history > limit or any(inv.observation_ids is None for inv in episode[:-1]):
            continue
        kept.extend(indices)
        tokens.extend(torch.arange(offsets[i], offsets[i + 1]) for i in indices)
    return kept, torch.cat(tokens)


def mean_by_turn(values: torch.Tensor, invocations: list[Invocation]) -> dict[int, float]:
    """
    The mean of a per-token value over the action tokens of each turn.

    Args:
        values (`torch.Tensor` of shape `(N,)`):
            One value per action token of `invocations`, in their order.
        invocations (`list[Invocation]`):
            The invocations the tokens belong to.

    Returns:
        `dict[int, float]`: turn -> mean, for every turn with at least one action token.
    """
    turns = torch.repeat_interleave(
        torch.tensor([inv.turn for inv in invocations]), torch.tensor([len(inv.output_ids) for inv in invocations])
    )  # (N,)
    return {turn: values[turns == turn].mean().item() for turn in turns.unique().tolist()}


def misalignment_kl(
    aligned: TeacherScores, persistent_hidden: torch.Tensor, tokens: torch.Tensor, chunk_size: int
) -> torch.Tensor:
    """
    `KL(teacher aligned || teacher persistent)` at temperature 1 on each audited action token, `(N_audited,)` on the
    CPU: `aligned` holds the teacher's scores of every action in its own state, `persistent_hidden` `(N_audited, H)`
    its hidden states under the flattened history at the audited tokens, whose canonical indices are `tokens`.
    """
    with torch.no_grad(), aligned.lm_head() as (weight, bias):
        return chunked_generalized_jsd(
            persistent_hidden,
            weight,
            aligned.hidden[tokens],
            weight,
            beta=0.0,  # KL(teacher aligned || teacher persistent)
            student_bias=bias,
            teacher_bias=bias,
            chunk_size=chunk_size,
        ).cpu()


class AlignmentAudit:
    """
    The live alignment audit of a trainer: on the first rollout of every `period` steps (all its gradient-accumulation
    micro-batches), the teacher scores the rollout's actions again under the flattened persistent history, and
    `misalignment/kl_turn_{k}` is `KL(teacher aligned || teacher persistent)` at T=1, averaged over the action tokens
    of turn `k` (`misalignment/kl`: over all of them). Episodes whose flattened history the teacher cannot take are
    left out.

    Args:
        period (`int`):
            Steps between audits (`MemOPDConfig.misalignment_audit_steps`).
        every_process_has (`Callable[[bool], bool]`):
            Whether a flag holds on every process that must forward together (the trainer's; collective when
            sharded), so that every process skips an audit with nothing to audit at once.
    """

    def __init__(self, period: int, every_process_has: Callable[[bool], bool]):
        self.period = period
        self.every_process_has = every_process_has
        self._last: tuple[int | None, int | None] = (None, None)  # (period, step) of the last audit

    def due(self, step: int) -> bool:
        """Whether the rollout of `step` is audited (the first of its period, or another micro-batch of that step)."""
        period = step // self.period
        if period == self._last[0] and step != self._last[1]:
            return False
        self._last = (period, step)
        return True

    def __call__(
        self,
        teacher: "LocalTeacher | ServerTeacher",
        invocations: list[Invocation],
        aligned: "TeacherScores | TopKTeacherScores",
    ) -> dict[str, float]:
        """The audit's metrics for `invocations`, whose aligned scores are `aligned`; `{}` when nothing is audited."""
        kept, tokens = auditable_invocations(invocations, teacher.max_model_length)
        audited = [invocations[i] for i in kept]
        if not self.every_process_has(len(tokens) > 0):
            return {}
        if isinstance(aligned, TopKTeacherScores):  # the sampled tokens' log-probs in both layouts
            action_ids = torch.tensor([t for inv in audited for t in inv.output_ids], device=aligned.logprobs.device)
            persistent = teacher.score(audited, "persistent", action_ids=action_ids)  # (N_audited, ...)
            aligned_sampled = aligned.sampled_logprobs[tokens.to(aligned.logprobs.device)]
            gap = (aligned_sampled - persistent.sampled_logprobs).abs().cpu()
            name = "misalignment/sampled_logprob_gap"
            by_turn = {f"{name}_turn_{turn}": value for turn, value in mean_by_turn(gap, audited).items()}
            return {name: gap.mean().item(), **by_turn}
        persistent = teacher.score(audited, "persistent")  # (N_audited, ...), in the order of `audited`
        kl = misalignment_kl(aligned, persistent.hidden, tokens.to(aligned.hidden.device), teacher.chunk_size)
        by_turn = {f"misalignment/kl_turn_{turn}": value for turn, value in mean_by_turn(kl, audited).items()}
        return {"misalignment/kl": kl.mean().item(), **by_turn}
