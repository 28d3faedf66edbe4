"""Rebuild recorded invocations as independent sequences and lay them out in rows for one forward pass.

Every invocation is rebuilt as its own sequence `input_ids + output_ids` with positions `0..len-1` (invariants 2
and 3 in docs/design.md). [`PackedInvocationCollator`] places whole sequences side by side in a few balanced rows, so the
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


def rebuilt_sequences(
    invocations: list[Invocation], history: str = "aligned", max_model_length: int | None = None
) -> list[tuple[list[int], list[int]]]:
    """
    The sequences a scorer reads, unpacked: each invocation's context and action (`history="aligned"`), or each
    episode flattened into its persistent history (`"persistent"`), as a teacher server is sent them.

    Returns:
        `list[tuple[list[int], list[int]]]`: per sequence, its token ids and, per token, the canonical index of the
        action token it is (`-1` off actions). The model's distribution over a token at position `p` is read at
        position `p - 1`.
    """
    return [(seq.token_ids, seq.action_target_index) for seq in _build_sequences(invocations, history, max_model_length)]


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


def balanced_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """
    Assign items to as few rows as first-fit decreasing needs (or fewer), with loads as even as they can be made.

    Rows of one batch share a width, so a last row that first-fit decreasing leaves nearly empty is padding that every
    forward pays for. Starting from `ceil(sum(lengths) / capacity)` rows, items are placed longest first into the
    least loaded row (ties keep input order); the first row count whose loads all fit, and are no wider than
    first-fit decreasing's rows, is used; else first-fit decreasing's own rows.

    Args:
        lengths (`list[int]`):
            Length of each item.
        capacity (`int`):
            Room in one row.

    Returns:
        `list[list[int]]`: for each row, the indices of its items in placement order.
    """
    fallback = first_fit_decreasing(lengths, capacity)
    fallback_width = max(sum(lengths[i] for i in row) for row in fallback) if fallback else 0
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    for num_rows in range(max(-(-sum(lengths) // capacity), 1), len(fallback) + 1):
        rows: list[list[int]] = [[] for _ in range(num_rows)]
        loads = [0] * num_rows
        for i in order:
            r = loads.index(min(loads))
            rows[r].append(i)
            loads[r] += lengths[i]
        if max(loads) <= min(capacity, fallback_width):
            return rows
    return fallback


def _round_up(n: int, multiple: int | None) -> int:
    return n if not multiple else -(-n // multiple) * multiple


@dataclass
class _Group:
    """Sequences laid out as one tree: their first `prefix_length` tokens once, then the remainder of each member."""

    members: list[int]  # indices into the sequence list
    prefix_length: int = 0  # 0: one sequence laid out whole

    def length(self, sequences: list[_Sequence]) -> int:
        return self.prefix_length + sum(len(sequences[m]) - self.prefix_length for m in self.members)


def _shareable_length(seq: _Sequence) -> int:
    """
    Longest prefix of `seq` that may be shared: it stops at least one token before the first action token, so the
    token that predicts an invocation's first action always lies in its own remainder (the shift of
    `action_hidden_states` never crosses into a prefix).
    """
    first_action = next((i for i, a in enumerate(seq.action_target_index) if a >= 0), len(seq))
    return max(first_action - 1, 0)


def _common_prefix_length(a: list[int], b: list[int], limit: int) -> int:
    n = 0
    for x, y in zip(a[:limit], b[:limit], strict=False):
        if x != y:
            break
        n += 1
    return n


def shared_prefix_groups(sequences: list[_Sequence], min_prefix_length: int, capacity: int) -> list[_Group]:
    """
    Group sequences that begin with the same token ids (at least `min_prefix_length` of them) into trees.

    Sequences are sorted by their shareable tokens, so those with a common beginning (every turn of every episode of
    one question: the system prompt and the task) are neighbours; each is added to the current group while the
    prefix common to all members stays at least `min_prefix_length` long, the tokens the group saves do not fall
    (a preamble common to every question does not swallow the per-question groups) and the tree fits in `capacity`
    tokens.
    Prefixes come from token ids only. A sequence that shares with nobody is a group of its own, laid out whole.
    """
    shareable = [_shareable_length(seq) for seq in sequences]
    order = sorted(range(len(sequences)), key=lambda i: sequences[i].token_ids[: shareable[i]])
    groups: list[_Group] = []
    current: _Group | None = None
    for i in order:
        if current is not None:
            first = sequences[current.members[0]]
            # A group of one has no prefix yet: it may share all of its shareable tokens.
            limit = shareable[current.members[0]] if len(current.members) == 1 else current.prefix_length
            prefix = _common_prefix_length(first.token_ids, sequences[i].token_ids, min(limit, shareable[i]))
            candidate = _Group(current.members + [i], prefix)
            # Joining must not lose what the group shares already: a shorter prefix is shared by one more member.
            saved_now = (len(current.members) - 1) * current.prefix_length
            saves_more = len(current.members) * prefix >= saved_now
            if prefix >= min_prefix_length and saves_more and candidate.length(sequences) <= capacity:
                current = groups[-1] = candidate
                continue
        current = _Group([i])
        groups.append(current)
    return groups


def _layout(
    sequences: list[_Sequence], rows: list[list[_Group]], pad_token_id: int, pad_to_multiple_of: int | None
) -> tuple[dict[str, torch.Tensor | int | float], torch.Tensor]:
    """
    Write the groups into `(rows, width)` tensors; the padding of each row is one more sequence at positions `0..`.

    A group with a shared prefix writes the prefix once, at positions `0..P-1`, then each member's remainder at
    positions `P..len-1`. When some group shares, the batch also gets the tree-attention fields (see
    [`PackedInvocationCollator`]).

    Returns the batch dict and a `(rows, width)` boolean tensor that is True on real (non-padding) tokens.
    """
    width = _round_up(max(sum(group.length(sequences) for group in row) for row in rows), pad_to_multiple_of)
    shape = (len(rows), width)
    input_ids = torch.full(shape, pad_token_id, dtype=torch.long)  # (rows, width)
    position_ids = torch.zeros(shape, dtype=torch.long)  # (rows, width)
    invocation_index = torch.full(shape, -1, dtype=torch.long)  # (rows, width)
    action_target_index = torch.full(shape, -1, dtype=torch.long)  # (rows, width)
    real = torch.zeros(shape, dtype=torch.bool)  # (rows, width)
    # Attention segments in the flattened (rows * width,) layout: (start, length, start of the prefix it sees, P).
    segments: list[tuple[int, int, int, int]] = []

    def write(r: int, col: int, seq: _Sequence, start: int, end: int) -> int:
        n = end - start
        input_ids[r, col : col + n] = torch.tensor(seq.token_ids[start:end])
        position_ids[r, col : col + n] = torch.arange(start, end)
        invocation_index[r, col : col + n] = torch.tensor(seq.invocation_index[start:end])
        action_target_index[r, col : col + n] = torch.tensor(seq.action_target_index[start:end])
        real[r, col : col + n] = True
        return col + n

    num_tokens_saved = 0
    for r, row in enumerate(rows):
        col = 0
        for group in row:
            prefix_length, prefix_start = group.prefix_length, r * width + col
            if prefix_length:
                col = write(r, col, sequences[group.members[0]], 0, prefix_length)
                segments.append((prefix_start, prefix_length, prefix_start, 0))
                num_tokens_saved += (len(group.members) - 1) * prefix_length
            for m in group.members:
                start = r * width + col
                col = write(r, col, sequences[m], prefix_length, len(sequences[m]))
                segments.append((start, r * width + col - start, prefix_start, prefix_length))
        if col < width:
            position_ids[r, col:] = torch.arange(width - col)
            segments.append((r * width + col, width - col, r * width + col, 0))

    num_real_tokens = int(real.sum())
    batch = {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "invocation_index": invocation_index,
        "action_target_index": action_target_index,
        "num_action_tokens": int((action_target_index >= 0).sum()),
        "num_real_tokens": num_real_tokens,
        "num_tokens_saved": num_tokens_saved,
        "fill": num_real_tokens / (len(rows) * width),
    }
    if num_tokens_saved:
        batch.update(_tree_fields(segments))
    return batch, real


def _tree_fields(segments: list[tuple[int, int, int, int]]) -> dict[str, torch.Tensor | int]:
    """
    The tree-attention description of a layout: queries are the segments of the flattened rows, in order; the keys
    of a segment are the prefix it continues (if any) followed by its own tokens, gathered by `tree_key_index`.
    """
    query_lengths = [length for _, length, _, _ in segments]
    key_index = [
        torch.cat([torch.arange(prefix_start, prefix_start + prefix_length), torch.arange(start, start + length)])
        for start, length, prefix_start, prefix_length in segments
    ]
    key_lengths = [len(keys) for keys in key_index]
    return {
        "tree_cu_seq_lens_q": torch.tensor([0, *query_lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32),
        "tree_cu_seq_lens_k": torch.tensor([0, *key_lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32),
        "tree_key_index": torch.cat(key_index),  # (sum of key lengths,) indices into the flattened rows
        "tree_max_length_q": max(query_lengths),
        "tree_max_length_k": max(key_lengths),
    }


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
        self, invocations: list[Invocation], rows_of: Callable[[list[_Sequence]], list[list[_Group]]]
    ) -> tuple[dict[str, torch.Tensor | int | float], torch.Tensor]:
        """Rebuild `invocations`, place them in the rows of groups `rows_of(sequences)` gives, and lay them out."""
        sequences = _build_sequences(invocations, self.history, self.max_model_length)
        batch, real = _layout(sequences, rows_of(sequences), self.pad_token_id, self.pad_to_multiple_of)
        batch["num_invocations"] = len(invocations)
        return batch, real


class PackedInvocationCollator(_InvocationCollator):
    """
    Collate invocations into padding-free rows: whole rebuilt invocations side by side, positions restarting at 0,
    optionally with the prefix common to several invocations laid out once (`share_prefix`).

    Each invocation becomes the sequence `input_ids + output_ids` (positions `0..len-1`). Sequences are placed into
    as few rows as first-fit decreasing needs, loads balanced ([`balanced_rows`]; deterministic: ties keep input
    order), and never split; the width is the longest
    row. Row padding is one more sequence with its own positions `0..`, so the packed-sequence detection of
    transformers and flash-attention's varlen kernels treat it as a separate sequence and nothing attends across a
    boundary. Score the batch with [`~memopd_trl.scoring.action_logprobs`], which runs the packed forward correctly.

    Parameters:
        max_tokens_per_row (`int` or `None`, *optional*, defaults to `4096`):
            Room in one row. An invocation longer than this gets a row of its own. With transformers' `sdpa`/`eager`
            attention a packed row pays a dense `width x width` mask, so a value near the longest invocation is
            fastest; with flash-attention or `"memopd_sdpa_varlen"`
            (see [`~memopd_trl.attention.varlen_sdpa_attention`])
            attention follows the sequences, and wider (fuller) rows are faster (docs/benchmarks.md). `None` lays
            out everything in one row (TRL's padding-free layout): no row padding, and no tree is split.
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
        share_prefix (`bool`, *optional*, defaults to `False`):
            Lay out sequences that begin with the same token ids as a tree (shared-prefix packing): the common
            prefix once, at positions `0..P-1`, then each sequence's remainder at positions `P..len-1`, attending to
            the prefix and causally to itself, never to a sibling. Every turn of every episode of one question
            shares the system prompt and the task, so this removes most of the tokens aligned scoring repeats.
            Prefixes are found from token ids alone and end at least one token before a sequence's first action;
            rows still hold whole sequences (a tree that outgrows a row is split, its prefix repeated). Score such a
            batch with `attn_implementation` `"memopd_sdpa_varlen"`, `"sdpa"` or `"eager"`
            ([`~memopd_trl.scoring.packed_hidden_states`] refuses others).
        min_shared_prefix_length (`int`, *optional*, defaults to `16`):
            Shorter common prefixes are not shared (each shared prefix costs one more attention segment).

    The returned dict holds (`rows` and `width` as laid out; `N` = total number of output tokens):

    - `input_ids`, `position_ids`, `invocation_index` (-1 on padding), `action_target_index` (canonical action index,
      -1 elsewhere, so `action_target_index >= 0` is the action mask, True exactly on output tokens):
      `torch.LongTensor` of shape `(rows, width)`;
    - `cu_seq_lens_q`, `cu_seq_lens_k`: `torch.IntTensor` of shape `(num_sequences + 1,)`, cumulative sequence
      lengths over the row-major *flattened* layout `(rows * width,)`, every sequence and every row padding counted;
      `max_length_q`, `max_length_k` (`int`). transformers' flash-attention path reshapes query/key/value to
      `(rows * width, heads, head_dim)` when these are given, so they work for any number of rows (with one row,
      transformers could also infer them from `position_ids`; with several it cannot). Absent when a prefix is
      shared;
    - with a shared prefix instead, the tree-attention fields: `tree_cu_seq_lens_q` (`torch.IntTensor` of shape
      `(num_segments + 1,)`), cumulative lengths of the segments of the flattened rows (each shared prefix, each
      remainder, each unshared sequence, each row padding); `tree_key_index` (`torch.LongTensor` of shape `(K,)`),
      for each segment in turn the flattened indices of the keys it attends to (its prefix, if any, then its own
      tokens; causal with the queries aligned to the end of the keys); `tree_cu_seq_lens_k` (`(num_segments + 1,)`,
      cumulative key counts); `tree_max_length_q`, `tree_max_length_k` (`int`);
    - `num_invocations`, `num_action_tokens` (`N`), `num_real_tokens` (`int`, laid-out tokens), `num_tokens_saved`
      (`int`, prefix tokens that sharing did not lay out again) and `fill` (`float`, real tokens / (rows * width)).
      A shared prefix's `invocation_index` is that of the first sequence of its tree.

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
        max_tokens_per_row: int | None = 4096,
        pad_token_id: int = 0,
        max_model_length: int | None = None,
        history: str = "aligned",
        pad_to_multiple_of: int | None = None,
        share_prefix: bool = False,
        min_shared_prefix_length: int = 16,
    ):
        if max_tokens_per_row is not None and max_tokens_per_row < 1:
            raise ValueError(f"`max_tokens_per_row` must be a positive integer or None, got {max_tokens_per_row}.")
        if min_shared_prefix_length < 1:
            raise ValueError(f"`min_shared_prefix_length` must be a positive integer, got {min_shared_prefix_length}.")
        super().__init__(pad_token_id, max_model_length, history, pad_to_multiple_of)
        self.max_tokens_per_row = max_tokens_per_row
        self.share_prefix = share_prefix
        self.min_shared_prefix_length = min_shared_prefix_length

    def _rows(self, sequences: list[_Sequence]) -> list[list[_Group]]:
        capacity = self.max_tokens_per_row or sum(map(len, sequences))
        if self.share_prefix:
            groups = shared_prefix_groups(sequences, self.min_shared_prefix_length, capacity)
        else:
            groups = [_Group([s]) for s in range(len(sequences))]
        if self.max_tokens_per_row is None:
            return [groups]
        bins = balanced_rows([group.length(sequences) for group in groups], capacity)
        return [[groups[g] for g in row] for row in bins]

    def __call__(self, invocations: list[Invocation]) -> dict[str, torch.Tensor | int | float]:
        batch, _ = self._collate(invocations, self._rows)
        if "tree_key_index" in batch:
            return batch  # suffixes continue their prefix's positions: the flat varlen fields cannot describe it
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
        batch, real = self._collate(invocations, lambda sequences: [[_Group([s])] for s in range(len(sequences))])
        rows, width = batch["input_ids"].shape
        batch["position_ids"] = torch.arange(width).expand(rows, width).clone()  # (rows, width)
        batch["attention_mask"] = real.long()  # (rows, width)
        return batch


def split_rows(batch: dict, num_rows: int | None = None, pad_token_id: int = 0) -> list[dict]:
    """
    The rows of a packed batch, each as a batch of its own: one row, cut at its last real token (no row padding).

    A row holds whole sequences (or whole trees of a shared prefix), so each row scores alone exactly as it does
    inside the batch; forwarding a batch row by row bounds the tokens of one forward by the collator's
    `max_tokens_per_row`. Each row batch numbers its own action tokens `0..n-1` in canonical order and adds
    `action_index` (`torch.LongTensor` of shape `(n,)`, increasing): the canonical index in the whole batch of each,
    so per-token values of the whole batch are read for a row with `values[action_index]`, and a row's scores are put
    back with `out[action_index] = scores`.

    Args:
        batch (`dict`):
            Output of [`PackedInvocationCollator`] (not of [`PaddedInvocationCollator`]: its rows are single
            sequences already).
        num_rows (`int`, *optional*):
            Return at least this many rows: the missing ones hold one `pad_token_id` token and no action (for
            processes that must run as many forwards as each other, e.g. with sharded weights).
        pad_token_id (`int`, *optional*, defaults to `0`):
            The token of such a row.

    Returns:
        `list[dict]`: one batch per row, in row order, with the fields of [`PackedInvocationCollator`] for one row
        (`fill` 1.0; `num_tokens_saved` 0 when the batch shares no prefix) and `action_index`.
    """
    if "attention_mask" in batch:
        raise ValueError("`split_rows` takes a packed batch (PackedInvocationCollator); this one has an attention mask")
    rows, width = batch["input_ids"].shape
    is_tree = "tree_key_index" in batch
    if is_tree:
        cu_q, cu_k = batch["tree_cu_seq_lens_q"].long(), batch["tree_cu_seq_lens_k"].long()
        segment_starts = cu_q[:-1]
    out = []
    for r in range(rows):
        length = int((batch["invocation_index"][r] >= 0).sum())  # real tokens come first in a row
        field = {key: batch[key][r : r + 1, :length] for key in ("input_ids", "position_ids", "invocation_index")}
        row_targets = batch["action_target_index"][r, :length]
        is_action = row_targets >= 0
        action_index, _ = row_targets[is_action].sort()
        action_target_index = row_targets.clone()
        action_target_index[is_action] = torch.searchsorted(action_index, row_targets[is_action])
        row = {
            **field,
            "action_target_index": action_target_index[None],
            "action_index": action_index,
            "num_invocations": int(field["invocation_index"].unique().numel()),
            "num_action_tokens": int(is_action.sum()),
            "num_real_tokens": length,
            "num_tokens_saved": 0,
            "fill": 1.0,
        }
        start = r * width
        if is_tree:
            segments = ((segment_starts >= start) & (segment_starts < start + length)).nonzero().view(-1)
            first, end = int(segments[0]), int(segments[-1]) + 1
            query_lengths = cu_q[first + 1 : end + 1] - cu_q[first:end]
            key_lengths = cu_k[first + 1 : end + 1] - cu_k[first:end]
            key_index = batch["tree_key_index"][cu_k[first] : cu_k[end]] - start
            # Tokens sharing saved in this row: each prefix (told apart by its first key) once per extra member.
            prefix_lengths = (key_lengths - query_lengths).tolist()
            first_keys = key_index[cu_k[first:end] - cu_k[first]].tolist()
            prefixes = {key: p for key, p in zip(first_keys, prefix_lengths, strict=True) if p}
            row["num_tokens_saved"] = sum(prefix_lengths) - sum(prefixes.values())
            row.update(
                tree_cu_seq_lens_q=torch.cat([query_lengths.new_zeros(1), query_lengths.cumsum(0)]).int(),
                tree_cu_seq_lens_k=torch.cat([key_lengths.new_zeros(1), key_lengths.cumsum(0)]).int(),
                tree_key_index=key_index,
                tree_max_length_q=int(query_lengths.max()),
                tree_max_length_k=int(key_lengths.max()),
            )
        else:
            starts = (field["position_ids"][0] == 0).nonzero().view(-1)
            cu_seq_lens = torch.cat([starts, starts.new_tensor([length])]).to(torch.int32)
            max_length = int(cu_seq_lens.diff().max())
            row.update(cu_seq_lens_q=cu_seq_lens, cu_seq_lens_k=cu_seq_lens, max_length_q=max_length)
            row["max_length_k"] = max_length
        out.append(row)
    device = batch["input_ids"].device
    for _ in range(len(out), num_rows or 0):
        token = torch.full((1, 1), pad_token_id, dtype=torch.long, device=device)
        cu_seq_lens = torch.tensor([0, 1], dtype=torch.int32, device=device)
        out.append(
            {
                "input_ids": token,
                "position_ids": torch.zeros_like(token),
                "invocation_index": torch.full_like(token, -1),
                "action_target_index": torch.full_like(token, -1),
                "action_index": torch.zeros(0, dtype=torch.long, device=device),
                "cu_seq_lens_q": cu_seq_lens,
                "cu_seq_lens_k": cu_seq_lens,
                "max_length_q": 1,
                "max_length_k": 1,
                "num_invocations": 0,
                "num_action_tokens": 0,
                "num_real_tokens": 0,
                "num_tokens_saved": 0,
                "fill": 0.0,
            }
        )
    return out


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
