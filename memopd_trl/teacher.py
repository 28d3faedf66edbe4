"""
The teacher of a `MemOPDTrainer`: what turns recorded invocations into `TeacherScores`.

`LocalTeacher` is a model loaded in every training process (a whole copy, or sharded as the student is under FSDP2 /
ZeRO-3). It scores packed rows of invocations and gives its final hidden state at each action position with its LM
head: full-vocabulary supervision, applied chunk by chunk in the losses. A teacher of another kind (for example one
served on its own machine, giving top-k log-probs) fills the same scores from the same recorded token ids.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import send_to_device
from torch import nn
from trl.models.utils import unwrap_model_for_generation

from .packing import PackedInvocationCollator
from .records import Episode, Invocation
from .rollout import RolloutEngine
from .scoring import rows_action_hidden_states, sampled_token_logprobs
from .sharding import gathered_for_generation
from .step import TeacherScores


@dataclass
class LocalTeacher:
    """
    A teacher model in the training process, scoring the student's recorded invocations.

    Args:
        model (`nn.Module`):
            The teacher, prepared for this process (`sharding.prepare_frozen_model`); frozen.
        accelerator (`Accelerator`):
            The trainer's accelerator.
        collators (`dict[str, PackedInvocationCollator]`):
            The teacher's packing of invocations by layout: `"aligned"` (each in the state it was sampled in), and
            `"persistent"` (each episode flattened into one growing history) where that layout is scored.
        forward_rows (`Callable[[dict], list[dict]]`):
            Splits a packed batch into the rows forwarded one at a time (the trainer's `_forward_rows`).
        vocab_size (`int`):
            The shared tokenizer's vocabulary size.
        temperature (`float`):
            The sampling temperature, at which `sampled_logprobs` are taken.
        chunk_size (`int`):
            Action tokens per chunk when the LM head is applied.
        engine (`RolloutEngine`, *optional*):
            The engine the teacher plays its own episodes with (`play`).
    """

    model: nn.Module
    accelerator: Accelerator
    collators: dict[str, PackedInvocationCollator]
    forward_rows: Callable[[dict], list[dict]]
    vocab_size: int
    temperature: float
    chunk_size: int
    engine: RolloutEngine | None = None
    unwrapped: nn.Module = field(init=False)  # what its forwards and its LM head are read from

    def __post_init__(self):
        self.unwrapped = self.accelerator.unwrap_model(self.model)

    def score(
        self,
        invocations: list[Invocation],
        history: str = "aligned",
        rows: list[dict[str, Any]] | None = None,
        action_ids: torch.Tensor | None = None,
    ) -> TeacherScores:
        """
        The teacher's scores of every action of `invocations`, `(N, ...)` in canonical order. Collective with sharded
        weights.

        Args:
            invocations (`list[Invocation]`):
                The recorded model calls.
            history (`str`, *optional*, defaults to `"aligned"`):
                `"aligned"`: each action in the exact state it was sampled in. `"persistent"`: under the flattened
                history of its episode (the control, and the alignment audit).
            rows (`list[dict]`, *optional*):
                The invocations already packed in the aligned layout (the student's rows): forwarded as they are.
            action_ids (`torch.Tensor` of shape `(N,)`, *optional*):
                The sampled tokens; when given, `sampled_logprobs` holds the teacher's log-prob of each.
        """
        if rows is None or history != "aligned":
            rows = self.forward_rows(send_to_device(self.collators[history](invocations), self.accelerator.device))
        with torch.no_grad():
            hidden = rows_action_hidden_states(self.unwrapped, rows)  # (N, H_teacher)
            scores = TeacherScores(hidden, self.unwrapped, self.vocab_size)
            if action_ids is not None:
                # The teacher's log-prob of each sampled token at the sampling temperature, as the rollout's.
                scores.sampled_logprobs = sampled_token_logprobs(
                    self.unwrapped, hidden, action_ids, self.vocab_size, self.temperature, self.chunk_size
                )  # (N,)
        return scores

    def play(self, records: list[dict[str, Any]], num_generations: int) -> list[Episode]:
        """
        The teacher plays `num_generations` sampled episodes per record with its `engine`, its weights whole while it
        decodes (gathered under ZeRO-3 and FSDP2, so that decoding runs no collective). Collective when sharded.
        """
        with (
            unwrap_model_for_generation(self.model, self.accelerator) as teacher,  # ZeRO-3: gathered
            gathered_for_generation(teacher),  # FSDP2: gathered
        ):
            self.engine.model = teacher
            episodes, _ = self.engine.rollout(records, num_generations=num_generations, greedy=False)
        return episodes
