"""Rebuild recorded invocations as independent sequences and lay them out in rows for one forward pass.

Every invocation is rebuilt as its own sequence `input_ids + output_ids` with positions `0..len-1` (invariants 2
and 3 in docs/design.md). [`PackedInvocationCollator`] places whole sequences side by side in a few rows (first-fit decreasing), so the
cost of a forward follows real tokens, not padding; [`PaddedInvocationCollator`] gives each sequence a row of its own,
for comparison. With `history="persistent"` both build instead the control that a prior system used: each episode
flattened into one growing sequence, so the scorer sees earlier observations the student never saw.

Fields that live on action tokens are addressed in one *canonical order*: invocation order of the input list, then
token order inside `output_ids` (the concatenation of every `inv.output_ids`). `action_target_index` maps each action
token of the layout to its canonical index, so scores from two different layouts of the same invocations line up.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .records import Invocation


_HISTORIES = ("aligned", "persistent")


@dataclass
class _Sequence:
    """One sequence to be placed in a row: its tokens and, per token, where it came from."""

    name: str
    token_ids: list[int] = field(default_factory=list)
    invocation_index: list[int] = field(default_factory=list)  # index into the input list, per token
    action_target_index: list[int] = field(default_factory=list)  # canonical action index, -1 off-action

    def __len__(self) -> int:
        return len(self.token_ids)

    def extend(self, token_ids: list[int], invocation_index: int, action_offset: int | None = None) -> None:
        """Append a block of tokens; `action_offset` is the canonical index of its first token if it is an action."""
        n = len(token_ids)
        self.token_ids.extend(token_ids)
        self.invocation_index.extend([invocation_index] * n)
        if action_offset is None:
            self.action_target_index.extend([-1] * n)
        else:
            self.action_target_index.extend(range(action_offset, action_offset + n))


def _invocation_name(inv: Invocation, index: int) -> str:
    return f"invocation {index} (episode {inv.episode_id}, turn {inv.turn})"


def _canonical_offsets(invocations: list[Invocation]) -> list[int]:
    """Canonical index of the first action token of each invocation."""
    offsets, total = [], 0
    for inv in invocations:
        offsets.append(total)
        total += len(inv.output_ids)
    return offsets


def _aligned_sequences(invocations: list[Invocation]) -> list[_Sequence]:
    """One sequence per invocation: exactly the context it was conditioned on, then the tokens it sampled."""
    sequences = []
    for i, (inv, offset) in enumerate(zip(invocations, _canonical_offsets(invocations), strict=True)):
        seq = _Sequence(name=_invocation_name(inv, i))
        seq.extend(inv.input_ids, i)
        seq.extend(inv.output_ids, i, offset)
        sequences.append(seq)
    return sequences


def _persistent_sequences(invocations: list[Invocation]) -> list[_Sequence]:
    """
    One sequence per episode: `inv0.input_ids + inv0.output_ids + inv0.observation_ids + inv1.output_ids + ... +
    last.output_ids`. Later invocations' own `input_ids` are not used: this is the persistent history the prior system
    scored, not the state the student sampled in.
    """
    offsets = _canonical_offsets(invocations)
    episodes: dict[int, list[int]] = {}  # episode id -> indices into `invocations`, in order of first appearance
    for i, inv in enumerate(invocations):
        episodes.setdefault(inv.episode_id, []).append(i)

    sequences = []
    for episode_id, indices in episodes.items():
        indices = sorted(indices, key=lambda i: invocations[i].turn)
        turns = [invocations[i].turn for i in indices]
        if len(set(turns)) != len(turns):
            raise ValueError(
                f"Episode {episode_id} has several invocations with the same turn (turns {turns}); the persistent "
                "history needs one invocation per turn. Give each model call of an episode its own `turn`."
            )
        seq = _Sequence(name=f"episode {episode_id} (persistent history of turns {turns[0]}..{turns[-1]})")
        seq.extend(invocations[indices[0]].input_ids, indices[0])
        for k, i in enumerate(indices):
            inv = invocations[i]
            seq.extend(inv.output_ids, i, offsets[i])
            if k == len(indices) - 1:
                break
            if inv.observation_ids is None:
                raise ValueError(
                    f"Invocation {i} (episode {episode_id}, turn {inv.turn}) has no `observation_ids`, but the "
                    "persistent history needs them to join it to the next turn. Record `observation_ids` for every "
                    "non-final invocation, or use `history='aligned'`."
                )
            seq.extend(inv.observation_ids, i)
        sequences.append(seq)
    return sequences


def _build_sequences(
    invocations: list[Invocation], history: str = "aligned", max_model_length: int | None = None
) -> list[_Sequence]:
    """
    Rebuild invocations as independent token sequences (one per invocation, or one per episode for the persistent
    control), checking that each fits the model.

    Args:
        invocations (`list[Invocation]`):
            The recorded model calls.
        history (`str`, *optional*, defaults to `"aligned"`):
            `"aligned"` (each invocation in its own recorded state) or `"persistent"` (each episode flattened).
        max_model_length (`int`, *optional*):
            Longest sequence the model accepts; a longer one raises a `ValueError`.

    Returns:
        `list[_Sequence]`: the sequences, in the order of first appearance in `invocations`.
    """
    if not invocations:
        raise ValueError("Got an empty list of invocations: there is nothing to collate. Pass at least one.")
    if history not in _HISTORIES:
        raise ValueError(f"`history` must be one of {_HISTORIES}, got {history!r}.")
    sequences = _aligned_sequences(invocations) if history == "aligned" else _persistent_sequences(invocations)
    if max_model_length is not None:
        for seq in sequences:
            if len(seq) > max_model_length:
                raise ValueError(
                    f"The rebuilt sequence of {seq.name} has {len(seq)} tokens, more than `max_model_length` "
                    f"({max_model_length}). Raise `max_model_length` if the model accepts it, or cap the context "
                    "and generation budget of the environment so that every model call fits."
                )
    return sequences


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """
    Assign items to bins by first-fit decreasing: longest first (ties keep input order), each into the first bin with
    room. An item longer than `capacity` gets a bin of its own.

    Args:
        lengths (`list[int]`):
            Length of each item.
        capacity (`int`):
            Room in one bin.

    Returns:
        `list[list[int]]`: for each bin, in creation order, the indices of its items in placement order.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # `sorted` is stable: ties stay in input order
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max(capacity - lengths[i], 0))
    return bins


def _round_up(n: int, multiple: int | None) -> int:
    return n if not multiple else -(-n // multiple) * multiple


def _layout(
    sequences: list[_Sequence], rows: list[list[int]], pad_token_id: int, pad_to_multiple_of: int | None
) -> tuple[dict[str, torch.Tensor | int | float], torch.Tensor]:
    """
    Write the sequences into `(rows, width)` tensors; the padding of each row is one more sequence at positions `0..`.

    Returns the batch dict and a `(rows, width)` boolean tensor that is True on real (non-padding) tokens.
    """
    width = _round_up(max(sum(len(sequences[s]) for s in row) for row in rows), pad_to_multiple_of)
    shape = (len(rows), width)
    input_ids = torch.full(shape, pad_token_id, dtype=torch.long)  # (rows, width)
    position_ids = torch.zeros(shape, dtype=torch.long)  # (rows, width)
    invocation_index = torch.full(shape, -1, dtype=torch.long)  # (rows, width)
    action_target_index = torch.full(shape, -1, dtype=torch.long)  # (rows, width)
    real = torch.zeros(shape, dtype=torch.bool)  # (rows, width)

    for r, row in enumerate(rows):
        col = 0
        for s in row:
            seq = sequences[s]
            end = col + len(seq)
            input_ids[r, col:end] = torch.tensor(seq.token_ids)
            position_ids[r, col:end] = torch.arange(len(seq))
            invocation_index[r, col:end] = torch.tensor(seq.invocation_index)
            action_target_index[r, col:end] = torch.tensor(seq.action_target_index)
            real[r, col:end] = True
            col = end
        position_ids[r, col:] = torch.arange(width - col)

    num_real_tokens = int(real.sum())
    batch = {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "invocation_index": invocation_index,
        "action_target_index": action_target_index,
        "num_action_tokens": int((action_target_index >= 0).sum()),
        "num_real_tokens": num_real_tokens,
        "fill": num_real_tokens / (len(rows) * width),
    }
    return batch, real


class _InvocationCollator:
    """What both collators share: their settings, and rebuilding the invocations as sequences that fit the model."""

    def __init__(
        self,
        pad_token_id: int = 0,
        max_model_length: int | None = None,
        history: str = "aligned",
        pad_to_multiple_of: int | None = None,
    ):
        if history not in _HISTORIES:
            raise ValueError(f"`history` must be one of {_HISTORIES}, got {history!r}.")
        if max_model_length is not None and max_model_length < 1:
            raise ValueError(f"`max_model_length` must be a positive integer or None, got {max_model_length}.")
        if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
            raise ValueError(f"`pad_to_multiple_of` must be a positive integer or None, got {pad_to_multiple_of}.")
        if pad_token_id is None:
            raise ValueError(
                "`pad_token_id` is None: the tokenizer has no pad token. Set `tokenizer.pad_token` (the EOS token "
                "will do) and pass `pad_token_id=tokenizer.pad_token_id`."
            )
        if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int) or pad_token_id < 0:
            raise ValueError(f"`pad_token_id` must be a valid (non-negative) token id, got {pad_token_id!r}.")
        self.pad_token_id = pad_token_id
        self.max_model_length = max_model_length
        self.history = history
        self.pad_to_multiple_of = pad_to_multiple_of

    def _collate(
        self, invocations: list[Invocation], rows_of: Callable[[list[_Sequence]], list[list[int]]]
    ) -> tuple[dict[str, torch.Tensor | int | float], torch.Tensor]:
        """Rebuild `invocations`, place them in the rows `rows_of(sequences)` gives, and lay the rows out."""
        sequences = _build_sequences(invocations, self.history, self.max_model_length)
        batch, real = _layout(sequences, rows_of(sequences), self.pad_token_id, self.pad_to_multiple_of)
        batch["num_invocations"] = len(invocations)
        return batch, real


class PackedInvocationCollator(_InvocationCollator):
    """
    Collate invocations into padding-free rows: whole rebuilt invocations side by side, positions restarting at 0.

    Each invocation becomes the sequence `input_ids + output_ids` (positions `0..len-1`). Sequences are placed into
    rows by first-fit decreasing (deterministic: ties keep input order) and never split; the width is the longest
    row. Row padding is one more sequence with its own positions `0..`, so the packed-sequence detection of
    transformers and flash-attention's varlen kernels treat it as a separate sequence and nothing attends across a
    boundary. Score the batch with [`~memopd_trl.scoring.action_logprobs`], which runs the packed forward correctly.

    Parameters:
        max_tokens_per_row (`int`, *optional*, defaults to `4096`):
            Room in one row. An invocation longer than this gets a row of its own. With transformers' `sdpa`/`eager`
            attention a packed row pays a dense `width x width` mask, so a value near the longest invocation is
            fastest; with flash-attention or `"memopd_sdpa_varlen"` (see [`~memopd_trl.scoring.varlen_sdpa_attention`])
            attention follows the sequences, and wider (fuller) rows are faster (docs/benchmarks.md).
        pad_token_id (`int`, *optional*, defaults to `0`):
            Token id written into row padding.
        max_model_length (`int`, *optional*):
            Longest sequence the model accepts; a longer rebuilt sequence raises a `ValueError` naming it.
        history (`str`, *optional*, defaults to `"aligned"`):
            `"aligned"`: each invocation in exactly the state the student sampled in (MemOPD). `"persistent"`: the
            control; each episode (by `episode_id`, ordered by `turn`) flattened into one growing sequence
            `inv0.input_ids + inv0.output_ids + inv0.observation_ids + inv1.output_ids + ... + last.output_ids`.
        pad_to_multiple_of (`int`, *optional*):
            Round the row width up to a multiple of this.

    The returned dict holds (`rows` and `width` as laid out; `N` = total number of output tokens):

    - `input_ids`, `position_ids`, `invocation_index` (-1 on padding), `action_target_index` (canonical action index,
      -1 elsewhere, so `action_target_index >= 0` is the action mask, True exactly on output tokens):
      `torch.LongTensor` of shape `(rows, width)`;
    - `cu_seq_lens_q`, `cu_seq_lens_k`: `torch.IntTensor` of shape `(num_sequences + 1,)`, cumulative sequence
      lengths over the row-major *flattened* layout `(rows * width,)`, every sequence and every row padding counted;
      `max_length_q`, `max_length_k` (`int`). transformers' flash-attention path reshapes query/key/value to
      `(rows * width, heads, head_dim)` when these are given, so they work for any number of rows (with one row,
      transformers could also infer them from `position_ids`; with several it cannot);
    - `num_invocations`, `num_action_tokens` (`N`), `num_real_tokens` (`int`) and `fill` (`float`, real tokens /
      (rows * width)).

    Example:

    ```python
    >>> from memopd_trl import Invocation, PackedInvocationCollator
    >>> collator = PackedInvocationCollator(max_tokens_per_row=8)
    >>> batch = collator([Invocation([1, 2, 3], [4, 5]), Invocation([6, 7], [8])])
    >>> batch["position_ids"].tolist()
    [[0, 1, 2, 3, 4, 0, 1, 2]]
    >>> batch["action_target_index"].tolist()
    [[-1, -1, -1, 0, 1, -1, -1, 2]]
    ```
    """

    def __init__(
        self,
        max_tokens_per_row: int = 4096,
        pad_token_id: int = 0,
        max_model_length: int | None = None,
        history: str = "aligned",
        pad_to_multiple_of: int | None = None,
    ):
        if max_tokens_per_row < 1:
            raise ValueError(f"`max_tokens_per_row` must be a positive integer, got {max_tokens_per_row}.")
        super().__init__(pad_token_id, max_model_length, history, pad_to_multiple_of)
        self.max_tokens_per_row = max_tokens_per_row

    def _rows(self, sequences: list[_Sequence]) -> list[list[int]]:
        return first_fit_decreasing([len(seq) for seq in sequences], self.max_tokens_per_row)

    def __call__(self, invocations: list[Invocation]) -> dict[str, torch.Tensor | int | float]:
        batch, _ = self._collate(invocations, self._rows)
        # Every sequence (row padding included) starts where its position is 0; flash varlen kernels read the
        # flattened `(rows * width,)` layout, so the boundaries are flat offsets.
        flat_positions = batch["position_ids"].reshape(-1)  # (rows * width,)
        starts = (flat_positions == 0).nonzero().view(-1)
        cu_seq_lens = torch.cat([starts, torch.tensor([flat_positions.numel()])]).to(torch.int32)
        max_length = int(cu_seq_lens.diff().max())
        batch.update(cu_seq_lens_q=cu_seq_lens, cu_seq_lens_k=cu_seq_lens, max_length_q=max_length)
        batch["max_length_k"] = max_length
        return batch


class PaddedInvocationCollator(_InvocationCollator):
    """
    Collate invocations one per row with right padding and an `attention_mask` (the baseline that packing beats).

    Same fields as [`PackedInvocationCollator`] (without the flash varlen fields) plus `attention_mask`
    (`torch.LongTensor` of shape `(rows, width)`, 1 on real tokens). Positions are `0..width-1` in every row, so the
    real tokens of each row sit at `0..len-1`.

    Parameters:
        pad_token_id (`int`, *optional*, defaults to `0`):
            Token id written into padding.
        max_model_length (`int`, *optional*):
            Longest sequence the model accepts; a longer rebuilt sequence raises a `ValueError` naming it.
        history (`str`, *optional*, defaults to `"aligned"`):
            `"aligned"` (one invocation per row) or `"persistent"` (one flattened episode per row).
        pad_to_multiple_of (`int`, *optional*):
            Round the row width up to a multiple of this.

    Example:

    ```python
    >>> from memopd_trl import Invocation, PaddedInvocationCollator
    >>> batch = PaddedInvocationCollator()([Invocation([1, 2, 3], [4, 5]), Invocation([6, 7], [8])])
    >>> batch["attention_mask"].tolist()
    [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    ```
    """

    def __call__(self, invocations: list[Invocation]) -> dict[str, torch.Tensor | int | float]:
        batch, real = self._collate(invocations, lambda sequences: [[s] for s in range(len(sequences))])
        rows, width = batch["input_ids"].shape
        batch["position_ids"] = torch.arange(width).expand(rows, width).clone()  # (rows, width)
        batch["attention_mask"] = real.long()  # (rows, width)
        return batch


def gather_actions(values: torch.Tensor, action_target_index: torch.Tensor) -> torch.Tensor:
    """
    Read the values at the action tokens of a layout, in canonical action order (differentiable).

    Args:
        values (`torch.Tensor` of shape `(rows, width, ...)`):
            Per-token values laid out like the batch (token ids, log-probs, hidden states...).
        action_target_index (`torch.LongTensor` of shape `(rows, width)`):
            Canonical action index of each token, -1 off-action, as returned by the collators.

    Returns:
        `torch.Tensor` of shape `(N, ...)`: the values at action tokens, ordered by canonical action index.
    """
    if values.shape[:2] != action_target_index.shape:
        raise ValueError(
            f"`values` has leading shape {tuple(values.shape[:2])} but `action_target_index` has shape "
            f"{tuple(action_target_index.shape)}; they must describe the same (rows, width) layout."
        )
    is_action = action_target_index >= 0  # (rows, width)
    targets = action_target_index[is_action]  # (N,) canonical index of each action token in layout order
    sorted_targets, order = torch.sort(targets)
    if not torch.equal(sorted_targets, torch.arange(targets.numel(), device=targets.device)):
        raise ValueError(
            "`action_target_index` must number the action tokens 0..N-1, each exactly once; build the batch with "
            "PackedInvocationCollator or PaddedInvocationCollator."
        )
    return values[is_action][order]
