"""The padding-free attention of packed rows: `"memopd_sdpa_varlen"`, causal attention per segment with torch's sdpa.

A packed row holds several sequences (invocations), told apart by the collator's flash-attention varlen fields
(`cu_seq_lens_q/k`, `max_length_q/k`) or, in a shared-prefix layout, by its tree fields (`tree_*`). This module holds
the attention that reads those fields without a flash kernel ([`varlen_sdpa_attention`]), the plan of its padded calls
([`segment_plan`]) and the dense mask of a shared-prefix batch for transformers' own `sdpa` / `eager` attention
([`tree_attention_mask`]). Nothing is registered with transformers at import: [`register_varlen_attention`] does it
(`MemOPDTrainer` calls it when it is built). Why our own kernel: docs/benchmarks.md ("The padding-free attention").

>>> from memopd_trl.attention import VARLEN_SDPA, register_varlen_attention
>>> register_varlen_attention()
>>> model.set_attn_implementation(VARLEN_SDPA)  # or `attn_implementation=VARLEN_SDPA` when loading
"""

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask


# Name under which `varlen_sdpa_attention` is registered with transformers (see `register_varlen_attention`).
VARLEN_SDPA = "memopd_sdpa_varlen"

# Attention implementations that read the flash-attention varlen kwargs (`cu_seq_lens_*`, `max_length_*`).
VARLEN_ATTENTION_IMPLEMENTATIONS = {
    VARLEN_SDPA,
    "flash_attention_2",
    "flash_attention_3",
    "kernels-community/flash-attn",
    "kernels-community/flash-attn2",
    "kernels-community/flash-attn3",
    "kernels-community/vllm-flash-attn3",
}
# The varlen fields of a packed batch (see PackedInvocationCollator), in the order flash kernels take them.
VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
# The tree-attention fields of a shared-prefix batch (see PackedInvocationCollator(share_prefix=True)).
TREE_KEYS = ("tree_cu_seq_lens_q", "tree_cu_seq_lens_k", "tree_key_index", "tree_max_length_q", "tree_max_length_k")
# Attention implementations that score shared-prefix batches: ours reads the tree fields, sdpa and eager get a mask.
TREE_ATTENTION_IMPLEMENTATIONS = (VARLEN_SDPA, "sdpa", "eager")
# Keyword under which a forward passes a ready `SegmentPlan` to every layer of `varlen_sdpa_attention`.
SEGMENT_PLAN_KEY = "memopd_segment_plan"


def register_varlen_attention() -> None:
    """
    Register [`varlen_sdpa_attention`] with transformers as `"memopd_sdpa_varlen"` (and `sdpa`'s mask function for
    it, used where the varlen fields are absent: generation, padded batches). Calling it again changes nothing.

    After it, a model can be loaded with `attn_implementation="memopd_sdpa_varlen"` or switched to it with
    `model.set_attn_implementation("memopd_sdpa_varlen")`.
    """
    AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(VARLEN_SDPA, sdpa_mask)


@dataclass
class SegmentPlan:
    """
    How [`varlen_sdpa_attention`] runs the segments of a packed batch without a flash kernel: segments bucketed by
    key count (powers of two), each bucket one padded `scaled_dot_product_attention` call.

    Each bucket is `(query_index, key_index, mask, valid_index)`: `(n, Lq)` and `(n, Lk)` indices into the flattened
    rows, the `(n, 1, Lq, Lk)` boolean mask (causal, queries aligned to the end of their keys) and the positions of
    the real queries in the bucket's flattened `(n * Lq)` outputs. `inverse` puts the bucket outputs back in the order
    of the flattened rows. All indices are applied with `index_select` (its backward is `index_add_`).
    """

    buckets: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
    inverse: torch.Tensor


def segment_plan(
    cu_seq_lens_q: torch.Tensor, cu_seq_lens_k: torch.Tensor | None = None, key_index: torch.Tensor | None = None
) -> SegmentPlan:
    """
    Plan the attention of packed segments: segment `s` has queries `cu_seq_lens_q[s]:cu_seq_lens_q[s + 1]` of the
    flattened rows and keys `key_index[cu_seq_lens_k[s]:cu_seq_lens_k[s + 1]]` (its own tokens when `key_index` is
    None: plain packing). Built once per forward by [`~memopd_trl.scoring.packed_hidden_states`] and shared by every
    layer.
    """
    device = cu_seq_lens_q.device
    cu_q = cu_seq_lens_q.long()
    num_tokens = int(cu_q[-1])
    if key_index is None:
        cu_k, key_index = cu_q, torch.arange(num_tokens, device=device)
    else:
        cu_k = cu_seq_lens_k.long()
    query_lengths, key_lengths = cu_q.diff(), cu_k.diff()  # (num_segments,)
    bucket_of = torch.tensor([(int(n) - 1).bit_length() for n in key_lengths.tolist()], device=device)
    buckets, order = [], []
    for bucket in bucket_of.unique().tolist():
        segments = (bucket_of == bucket).nonzero().view(-1)
        lq, lk = query_lengths[segments], key_lengths[segments]  # (n,)
        jq = torch.arange(int(lq.max()), device=device)
        jk = torch.arange(int(lk.max()), device=device)
        valid_q, valid_k = jq[None] < lq[:, None], jk[None] < lk[:, None]  # (n, Lq), (n, Lk)
        query_index = torch.where(valid_q, cu_q[segments, None] + jq, 0)
        keys = key_index[torch.where(valid_k, cu_k[segments, None] + jk, 0)]  # (n, Lk)
        offset = (lk - lq)[:, None, None]
        mask = valid_k[:, None, :] & (jk[None, None, :] <= jq[None, :, None] + offset)  # (n, Lq, Lk)
        buckets.append((query_index, keys, mask[:, None], valid_q.view(-1).nonzero().view(-1)))
        order.append(query_index[valid_q])
    order = torch.cat(order)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(num_tokens, device=device)
    return SegmentPlan(buckets, inverse)


def segment_plan_from_fields(fields: dict) -> SegmentPlan:
    """
    The [`SegmentPlan`] of the segments that a batch's tree fields ([`TREE_KEYS`]) or, without them, its varlen
    fields describe; the plan under [`SEGMENT_PLAN_KEY`] when `fields` already holds one.
    """
    if fields.get(SEGMENT_PLAN_KEY) is not None:
        return fields[SEGMENT_PLAN_KEY]
    if fields.get("tree_key_index") is not None:
        return segment_plan(fields["tree_cu_seq_lens_q"], fields["tree_cu_seq_lens_k"], fields["tree_key_index"])
    return segment_plan(fields["cu_seq_lens_q"])


def _flash_varlen(query, key, value, scaling, kwargs) -> torch.Tensor | None:
    """The segments through torch's varlen flash kernel (CUDA, half precision), or None where it cannot run."""
    if not query.is_cuda or query.dtype not in (torch.float16, torch.bfloat16):
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    batch_size, num_heads, seq_len, head_dim = query.shape
    num_kv_heads = key.shape[1]
    q = query.transpose(1, 2).reshape(batch_size * seq_len, num_heads, head_dim)
    k, v = (x.transpose(1, 2).reshape(batch_size * seq_len, num_kv_heads, head_dim) for x in (key, value))
    tree = kwargs.get("tree_key_index") is not None
    if tree:  # each segment's keys gathered: its prefix, then itself
        k, v = k[kwargs["tree_key_index"]], v[kwargs["tree_key_index"]]
    fields = [kwargs[f"tree_{name}" if tree else name] for name in VARLEN_KEYS]
    parameters = inspect.signature(varlen_attn).parameters
    if num_heads != num_kv_heads and "enable_gqa" not in parameters:
        k, v = (x.repeat_interleave(num_heads // num_kv_heads, dim=1) for x in (k, v))
    options = {"enable_gqa": True} if num_heads != num_kv_heads and "enable_gqa" in parameters else {}
    # Causal, aligned to the end of the keys (a suffix sees its whole prefix).
    options.update({"window_size": (-1, 0)} if "window_size" in parameters else {"is_causal": True})
    out = varlen_attn(q, k, v, *fields, scale=scaling, **options)  # (tokens, heads, head_dim)
    return out.view(batch_size, seq_len, num_heads, head_dim)


def _segment_attention(query, key, value, dropout, scaling, kwargs) -> torch.Tensor:
    """Attention of every segment over its own keys; shapes as in [`varlen_sdpa_attention`]."""
    if dropout == 0.0:
        out = _flash_varlen(query, key, value, scaling, kwargs)
        if out is not None:
            return out
    plan = segment_plan_from_fields(kwargs)
    batch_size, num_heads, seq_len, head_dim = query.shape
    num_kv_heads = key.shape[1]
    # (heads, tokens, head_dim) over the flattened rows; gathering (not slicing) the keys of each segment makes the
    # backward pass add the gradient of every suffix into its one shared prefix.
    q_flat, k_flat, v_flat = (
        x.transpose(0, 1).reshape(x.shape[1], batch_size * seq_len, head_dim) for x in (query, key, value)
    )

    def gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # (h, tokens, d), (n, L) -> (n, h, L, d)
        return x.index_select(1, index.view(-1)).view(x.shape[0], *index.shape, head_dim).transpose(0, 1)

    outputs = []
    for query_index, key_index, mask, valid_index in plan.buckets:
        q, k, v = gather(q_flat, query_index), gather(k_flat, key_index), gather(v_flat, key_index)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=num_heads != num_kv_heads
        )  # (n, heads, Lq, head_dim)
        out = out.transpose(1, 2).reshape(-1, num_heads, head_dim)  # (n * Lq, heads, head_dim)
        outputs.append(out.index_select(0, valid_index))  # (real queries, heads, head_dim)
    out = torch.cat(outputs).index_select(0, plan.inverse)  # (tokens, heads, head_dim) in the flattened rows' order
    return out.view(batch_size, seq_len, num_heads, head_dim)


def _tree_segments(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """
    Two `(rows, width)` tensors of a shared-prefix batch: the segment of each token in the flattened rows (a shared
    prefix, a remainder, an unshared sequence or a row's padding), and the prefix segment its segment continues (-1
    where it continues none).
    """
    rows, width = batch["input_ids"].shape
    device = batch["input_ids"].device
    query_lengths = batch["tree_cu_seq_lens_q"].diff().long()
    cu_k = batch["tree_cu_seq_lens_k"].long()
    segment = torch.repeat_interleave(torch.arange(len(query_lengths), device=device), query_lengths)  # (rows*width,)
    # A segment whose keys outnumber its queries continues a prefix: the segment of its first key.
    first_key_segment = segment[batch["tree_key_index"][cu_k[:-1]]]  # (num_segments,)
    prefix_segment = torch.where(cu_k.diff() > query_lengths, first_key_segment, -1)
    return segment.view(rows, width), prefix_segment[segment].view(rows, width)


def tree_attention_mask(batch: dict, dtype: torch.dtype = torch.bool) -> torch.Tensor:
    """
    The dense attention mask of a shared-prefix batch, for transformers' `sdpa` and `eager` attention.

    Token `t` of a row sees token `s` when `s <= t` and `s` lies in `t`'s own segment or in the prefix that segment
    continues; nothing else (no sibling, no other tree, no other row padding).

    Not transformers' mask functions: they build the same mask 1.6-1.9x slower (docs/benchmarks.md).

    Args:
        batch (`dict`):
            Output of `PackedInvocationCollator(share_prefix=True)` with a shared prefix (the `tree_*` fields).
        dtype (`torch.dtype`, *optional*, defaults to `torch.bool`):
            `torch.bool` (True where attending, for `sdpa`) or a floating dtype (0 where attending, the dtype's
            minimum elsewhere: the additive mask `eager` attention expects).

    Returns:
        `torch.Tensor` of shape `(rows, 1, width, width)`.
    """
    width = batch["input_ids"].shape[1]
    device = batch["input_ids"].device
    segment, prefix_segment = _tree_segments(batch)  # (rows, width) each
    visible = (segment[:, None, :] == segment[:, :, None]) | (segment[:, None, :] == prefix_segment[:, :, None])
    visible &= torch.ones(width, width, dtype=torch.bool, device=device).tril()
    visible = visible[:, None]  # (rows, 1, width, width)
    if dtype == torch.bool:
        return visible
    return torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill(~visible, torch.finfo(dtype).min)


def varlen_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """
    Padding-free attention with plain torch sdpa: causal attention inside each sequence of `cu_seq_lens_q`, or over
    the tree of a shared-prefix batch.

    transformers runs packed rows under `sdpa`/`eager` with a dense `(rows, 1, width, width)` block mask, so attention
    costs `width` per token whatever the sequence lengths. Given the flash varlen fields of
    [`~memopd_trl.packing.PackedInvocationCollator`] (or, for `share_prefix=True`, its `tree_*` fields), this function
    instead attends within each segment of the flattened rows over that segment's keys (its own tokens; for a
    remainder of a tree, its prefix and then itself, causal with the queries at the end of the keys). Segments are
    bucketed by key count in powers of two and each bucket is one padded `scaled_dot_product_attention` call with a
    boolean mask (a [`SegmentPlan`], built once per forward): cost about `sum(len_q * len_k)` in a few calls. On CUDA
    in half precision it runs torch's own varlen flash kernel (`torch.nn.attention.varlen.varlen_attn`,
    torch >= 2.9) instead. Without those fields (generation, padded batches) it is exactly transformers' `sdpa`.
    [`register_varlen_attention`] registers it as `"memopd_sdpa_varlen"`; then select it with
    `model.set_attn_implementation("memopd_sdpa_varlen")` or `attn_implementation="memopd_sdpa_varlen"` when loading.
    Sliding-window attention is not supported.

    Args:
        module (`torch.nn.Module`):
            The attention layer calling it.
        query (`torch.Tensor` of shape `(batch_size, num_heads, seq_len, head_dim)`):
            Queries.
        key, value (`torch.Tensor` of shape `(batch_size, num_kv_heads, seq_len, head_dim)`):
            Keys and values.
        attention_mask (`torch.Tensor`, *optional*):
            Mask built by transformers; ignored when the varlen fields are given.
        dropout (`float`, *optional*, defaults to `0.0`):
            Attention dropout probability.
        scaling (`float`, *optional*):
            Softmax scale; defaults to `head_dim ** -0.5`.

    Returns:
        `tuple`: attention output of shape `(batch_size, seq_len, num_heads, head_dim)` and `None` (no weights).
    """
    if kwargs.get("cu_seq_lens_q") is None and kwargs.get("tree_key_index") is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if kwargs.get("sliding_window") is not None:
        raise ValueError(f"{VARLEN_SDPA!r} does not support sliding-window attention; use 'sdpa' for this model.")
    return _segment_attention(query, key, value, dropout, scaling, kwargs), None
