"""Plain records of what happened during a rollout.

These dataclasses are the contract between the rollout engine, the packing collator, the losses and the trainer.
They hold token ids, never text to be re-tokenized, so that every later stage scores exactly what the student was
conditioned on and sampled (invariant 1, provenance, in docs/design.md).
"""

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Invocation:
    """
    One model call of a memory agent: the exact context it was conditioned on and the exact tokens it sampled.

    Parameters:
        input_ids (`list[int]`):
            Token ids the model was conditioned on, without any padding. Their positions are `0..len(input_ids)-1`.
        output_ids (`list[int]`):
            Token ids the model sampled, in order (the action). May be empty for an empty generation.
        logprobs (`list[float]` or `None`, *optional*, defaults to `None`):
            Sampling log-probability of each output token under the policy that generated it (one per output id).
        episode_id (`int`, *optional*, defaults to `0`):
            Index of the episode this call belongs to.
        turn (`int`, *optional*, defaults to `0`):
            0-based turn index of this call inside its episode.
        truncated (`bool`, *optional*, defaults to `False`):
            Whether the output was cut by the token limit (`max_new_tokens`) before the action closed.
        observation_ids (`list[int]` or `None`, *optional*, defaults to `None`):
            Token ids that follow this action in a persistent (flattened) history: the end of the assistant turn, the
            next observation message and the next generation prompt. Used only by the persistent-history control.
        group_id (`int`, *optional*, defaults to `0`):
            Index of the question this episode answers; episodes with one `group_id` form a group.

    Example:

    ```python
    >>> from memopd_trl import Invocation
    >>> inv = Invocation(input_ids=[1, 2, 3], output_ids=[4, 5])
    >>> inv.num_tokens
    5
    ```
    """

    input_ids: list[int]
    output_ids: list[int]
    logprobs: list[float] | None = None
    episode_id: int = 0
    turn: int = 0
    truncated: bool = False
    observation_ids: list[int] | None = None
    group_id: int = 0

    def __post_init__(self):
        self.input_ids = [int(t) for t in self.input_ids]
        self.output_ids = [int(t) for t in self.output_ids]
        if not self.input_ids:
            raise ValueError(f"Invocation (episode {self.episode_id}, turn {self.turn}) has empty `input_ids`.")
        if self.logprobs is not None and len(self.logprobs) != len(self.output_ids):
            raise ValueError(
                f"Invocation (episode {self.episode_id}, turn {self.turn}): `logprobs` has {len(self.logprobs)} "
                f"entries but `output_ids` has {len(self.output_ids)}; give one log-prob per sampled token."
            )

    @property
    def num_tokens(self) -> int:
        """Length of the rebuilt sequence `input_ids + output_ids`."""
        return len(self.input_ids) + len(self.output_ids)


@dataclass
class Episode:
    """
    One played episode of a memory agent: its model calls in order and how it ended.

    Parameters:
        invocations (`list[Invocation]`):
            The model calls, in turn order.
        episode_id (`int`, *optional*, defaults to `0`):
            Index of the episode inside its rollout batch.
        group_id (`int`, *optional*, defaults to `0`):
            Index of the question (dataset record) this episode answers.
        record_id (`str`, *optional*, defaults to `""`):
            The `_id` of the dataset record.
        answer (`str` or `None`, *optional*, defaults to `None`):
            The final answer, or `None` when the episode ended without one.
        reward (`float`, *optional*, defaults to `0.0`):
            The final task reward.
        metrics (`dict[str, float]`, *optional*):
            The environment's final scores, by name (for `HotpotQAEnv`: answer `f1` and `em` against the gold
            answer); 0 for each when the episode ended without an answer. The trainer logs each one under its name.
        num_turns (`int`, *optional*, defaults to `0`):
            Number of agent turns played.
        num_malformed (`int`, *optional*, defaults to `0`):
            Number of malformed actions.
        failed (`bool`, *optional*, defaults to `False`):
            Whether the episode was aborted by an environment or retriever error (its reward is then 0).
        info (`dict`, *optional*):
            Free-form extra statistics (memory cuts, retriever errors, ...).
    """

    invocations: list[Invocation]
    episode_id: int = 0
    group_id: int = 0
    record_id: str = ""
    answer: str | None = None
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    num_turns: int = 0
    num_malformed: int = 0
    failed: bool = False
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def f1(self) -> float:
        """`metrics["f1"]` (0 when the environment reports no F1)."""
        return self.metrics.get("f1", 0.0)

    @property
    def em(self) -> float:
        """`metrics["em"]` (0 when the environment reports no exact match)."""
        return self.metrics.get("em", 0.0)
