"""Score collated invocations: forwards over packed rows, LM head and log-probabilities only at action positions.

Every score comes back as a per-action tensor of shape `(N, ...)` in the canonical action order of
[`~memopd_trl.packing.PackedInvocationCollator`] (invocation order, then token order inside `output_ids`), whatever
the layout it was computed on, so a teacher scored on one layout and a student scored on another line up.
"""

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers.utils import is_peft_available, logging
from trl.trainer.utils import maybe_gather_lm_head_ctx, selective_log_softmax

from .attention import (
    SEGMENT_PLAN_KEY,
    TREE_ATTENTION_IMPLEMENTATIONS,
    TREE_KEYS,
    VARLEN_ATTENTION_IMPLEMENTATIONS,
    VARLEN_KEYS,
    VARLEN_SDPA,
    segment_plan_from_fields,
    tree_attention_mask,
)
from .packing import gather_actions
from .records import Invocation


logger = logging.get_logger(__name__)


def attend_over_trees(models: list[torch.nn.Module]) -> bool:
    """
    Whether every model of `models` (unwrapped) runs an attention that attends over a tree of invocations
    (`TREE_ATTENTION_IMPLEMENTATIONS`), as shared-prefix packing needs; when one does not, the rows pack whole
    invocations instead, which is said once.
    """
    trees = all(model.config._attn_implementation in TREE_ATTENTION_IMPLEMENTATIONS for model in models)
    if not trees:
        logger.info(
            "share_prefix: packing whole invocations, because not every scoring model runs one of %s attention.",
            TREE_ATTENTION_IMPLEMENTATIONS,
        )
    return trees


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model under distributed wrappers (DDP, DeepSpeed), which keep it in `.module`."""
    while not hasattr(model, "config") and hasattr(model, "module"):
        model = model.module
    return model


def _decoder(model: torch.nn.Module) -> torch.nn.Module | None:
    """
    The decoder body of `model` if it may be called directly, else `None`.

    Calling a submodule skips the wrapper's own forward: harmless for PEFT (LoRA layers live inside the decoder), but
    DDP's forward prepares the gradient all-reduce and FSDP's root forward gathers the embedding weights, so those
    wrappers are run through their top-level forward instead.
    """
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return None
    if torch.distributed.is_available():
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

        if isinstance(model, (FSDPModule, FullyShardedDataParallel)):
            return None
    get_decoder = getattr(model, "get_decoder", None)
    return get_decoder() if callable(get_decoder) else None


def _has_packed_rows(position_ids: torch.Tensor) -> bool:
    """Whether some row holds several sequences (its positions restart somewhere)."""
    return bool((position_ids.diff(dim=-1) != 1).any())


def packed_hidden_states(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """
    Run the decoder body over a collated batch and return its last hidden states (after the final norm).

    This is the one place where packed rows are forwarded, because the rule is subtle and fails silently. A packed
    row holds several invocations, told apart only by `position_ids` restarting at 0. transformers keeps them from
    attending to each other only if it *detects* packing (`masking_utils.find_packed_sequence_indices`, for sdpa,
    eager and flex attention), and it looks for packing only when `attention_mask is None` **and** there is no KV
    cache. With the default `use_cache=True` a cache object is created, and with an all-ones `attention_mask` the
    mask is trusted: in both cases every token silently attends to the earlier invocations of its row (no error,
    log-probs off by ~0.5 nats). So this function always passes `use_cache=False`, drops an all-ones mask on packed
    rows, and refuses any other mask there. For flash-attention implementations and for
    [`~memopd_trl.attention.varlen_sdpa_attention`] (`"memopd_sdpa_varlen"`) it passes the varlen kwargs
    (`cu_seq_lens_q/k`, `max_length_q/k`) computed by the collator over the flattened rows, which work for any number
    of rows. Padded batches (with an `attention_mask` and no restarting positions) go through unchanged.

    Args:
        model (`torch.nn.Module`):
            A causal LM (`PreTrainedModel`), possibly wrapped by PEFT, DDP or FSDP.
        batch (`dict`):
            Output of [`~memopd_trl.packing.PackedInvocationCollator`] or
            [`~memopd_trl.packing.PaddedInvocationCollator`], on the model's device.

    Returns:
        `torch.Tensor` of shape `(rows, width, hidden_size)`: hidden states, one per token of the layout.
    """
    config = _unwrap(model).config
    attn_implementation = config._attn_implementation
    input_ids, position_ids = batch["input_ids"], batch["position_ids"]
    attention_mask = batch.get("attention_mask")
    if attention_mask is not None and _has_packed_rows(position_ids):
        if not bool(attention_mask.all()):
            raise ValueError(
                "The batch has packed rows (positions restart inside a row) and an `attention_mask` with zeros. "
                "Packed rows are described by `position_ids` alone; remove `attention_mask` from the batch "
                "(PackedInvocationCollator does not emit one)."
            )
        attention_mask = None  # An all-ones mask carries no information but would switch packing detection off.

    varlen_kwargs = {}
    if "tree_key_index" in batch:  # a shared-prefix layout: the tree fields or a mask built from them
        if attn_implementation == VARLEN_SDPA:
            varlen_kwargs = {key: batch[key] for key in TREE_KEYS}
        elif attn_implementation in TREE_ATTENTION_IMPLEMENTATIONS:
            mask_dtype = torch.bool if attn_implementation == "sdpa" else _unwrap(model).dtype
            attention_mask = tree_attention_mask(batch, mask_dtype)
        else:
            raise ValueError(
                f"The batch shares prefixes (PackedInvocationCollator(share_prefix=True)), which {attn_implementation!r} "
                f"attention cannot score: use one of {TREE_ATTENTION_IMPLEMENTATIONS}, or collate with "
                "`share_prefix=False`."
            )
    elif attention_mask is None and attn_implementation in VARLEN_ATTENTION_IMPLEMENTATIONS:
        missing = [key for key in VARLEN_KEYS if key not in batch]
        if missing:
            raise ValueError(
                f"The model uses {attn_implementation!r}, which needs the varlen fields {missing} to keep packed "
                "invocations apart; build the batch with PackedInvocationCollator."
            )
        varlen_kwargs = {key: batch[key] for key in VARLEN_KEYS}
    if attn_implementation == VARLEN_SDPA and varlen_kwargs:
        # Planned once per forward, not once per layer.
        varlen_kwargs[SEGMENT_PLAN_KEY] = segment_plan_from_fields(varlen_kwargs)
        # transformers would otherwise build a dense (rows, 1, width, width) packed mask that this attention never
        # reads (docs/benchmarks.md); a ready 4-D mask is passed through as is.
        attention_mask = torch.ones(input_ids.shape[0], 1, 1, 1, dtype=torch.bool, device=input_ids.device)

    if (
        attn_implementation == "flex_attention"
        and input_ids.device.type == "cpu"
        and torch.is_grad_enabled()
        and any(p.requires_grad for p in model.parameters())
    ):
        raise ValueError(
            "flex_attention has no backward pass on CPU in this torch version. On CPU, use flex_attention only for "
            "scoring without gradients (e.g. the teacher, under `torch.no_grad()`), and load the student with "
            "`attn_implementation='sdpa'` or `'eager'`; or run on a GPU."
        )

    decoder = _decoder(model)
    if decoder is not None:
        outputs = decoder(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            use_cache=False,
            **varlen_kwargs,
        )
        return outputs.last_hidden_state
    # Wrapped model (DDP/FSDP): go through its forward, keep no logits and read the final hidden states.
    outputs = model(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        use_cache=False,
        output_hidden_states=True,
        logits_to_keep=torch.zeros(0, dtype=torch.long, device=input_ids.device),
        **varlen_kwargs,
    )
    return outputs.hidden_states[-1]


def action_hidden_states(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """
    Hidden states at the positions that predict each action token, in canonical action order.

    The logits at position `t` predict the token at `t + 1`, so the hidden state that scores the action token at
    column `c` of a row is the one at column `c - 1`. This is the only place where that shift is made. Every
    invocation has a non-empty `input_ids`, so that predecessor always belongs to the same invocation.

    Args:
        model (`torch.nn.Module`):
            A causal LM, possibly wrapped (see [`packed_hidden_states`]).
        batch (`dict`):
            Output of a collator of [`memopd_trl.packing`].

    Returns:
        `torch.Tensor` of shape `(N, hidden_size)`: one hidden state per action token.
    """
    action_target_index = batch["action_target_index"]  # (rows, width)
    is_action = action_target_index >= 0
    if bool(is_action[:, 0].any()) or bool((batch["position_ids"][is_action] == 0).any()):
        raise ValueError(
            "An action token starts a sequence of the batch, so no earlier token predicts it. Every invocation must "
            "have non-empty `input_ids`; build the batch with a collator of memopd_trl.packing."
        )
    hidden = packed_hidden_states(model, batch)  # (rows, width, hidden_size)
    # Shift once: column c - 1 predicts column c.
    return gather_actions(hidden[:, :-1], action_target_index[:, 1:])  # (N, hidden_size)


def action_token_ids(batch: dict) -> torch.Tensor:
    """
    The sampled action tokens of a collated batch, in canonical action order.

    Returns:
        `torch.LongTensor` of shape `(N,)`.
    """
    return gather_actions(batch["input_ids"], batch["action_target_index"])


def lm_head_params(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """
    The weights of the model's output projection (LM head).

    Args:
        model (`torch.nn.Module`):
            A causal LM, possibly wrapped by PEFT (a head in `modules_to_save` is fine), DDP or DeepSpeed.

    Returns:
        `tuple`: `weight` of shape `(vocab_size, hidden_size)` and `bias` of shape `(vocab_size,)` or `None`.
    """
    head = _unwrap(model).get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(_unwrap(model)).__name__} has no output embeddings (LM head) to score tokens with.")
    if is_peft_available():
        from peft.tuners.tuners_utils import BaseTunerLayer

        if isinstance(head, BaseTunerLayer) and not head.merged and not head.disable_adapters:
            raise ValueError(
                "The LM head carries a PEFT adapter, whose update the head weights alone do not include. Leave "
                "`lm_head` out of the adapter's `target_modules` (list it in `modules_to_save` to train it), or "
                "merge the adapter first."
            )
    return head.weight, head.bias


@contextmanager
def gathered_lm_head(
    model: torch.nn.Module, vocab_size: int | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
    """
    The LM-head weight and bias of `model` for a loss that reads them directly, cut to the tokenizer's vocabulary.

    Under DeepSpeed ZeRO-3 the head's parameters are partitioned and only gathered inside the head's own forward, which
    the chunked losses never call, so they are gathered here for as long as the context lasts (TRL's
    `maybe_gather_lm_head_ctx`). Under FSDP2 a head read inside its model's forward is already whole (FSDP gathered it,
    and reduces its gradient after the backward); one read outside it is a `DTensor` shard, gathered here without
    gradient (a teacher's, a reference's, the student's under `no_grad`). A null context otherwise. Heads are often padded past the tokenizer (e.g. 151936 rows
    for 151665 Qwen2.5 tokens): the extra rows are cut, so that teacher and student distributions cover the same ids.
    The backward pass of the chunked losses reads the tensors they saved in the forward.

    Args:
        model (`torch.nn.Module`):
            A causal LM, possibly wrapped (see [`lm_head_params`]).
        vocab_size (`int`, *optional*):
            Number of rows to keep (the tokenizer's length); all when `None`.

    Returns:
        A context manager giving `(weight, bias)`: `(vocab_size, hidden_size)` and `(vocab_size,)` or `None`.
    """
    weight, bias = lm_head_params(model)
    if _is_dtensor(weight):  # FSDP2, outside the model's forward: the head is this process's shard
        if torch.is_grad_enabled() and weight.requires_grad:
            raise RuntimeError(
                "The LM head is an FSDP2 shard here and the loss needs its gradient: run the loss inside the model's "
                "forward (the trainer routes it through the wrapper with `_ForwardRedirection`), where FSDP has "
                "gathered the head and reduces its gradient."
            )
        with torch.no_grad():  # gathered for this use only, freed with the context
            weight = weight.full_tensor()
            bias = bias.full_tensor() if _is_dtensor(bias) else bias
    with maybe_gather_lm_head_ctx(weight, bias):
        rows = slice(None, vocab_size)
        yield weight[rows], None if bias is None else bias[rows]


def _is_dtensor(tensor: torch.Tensor | None) -> bool:
    if tensor is None or not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _scaled_logits(hidden: torch.Tensor, weight, bias, logit_scale, softcap, temperature) -> torch.Tensor:
    """fp32 logits `(n, vocab_size)` of `hidden` `(n, hidden_size)`, with the model's own logit transforms."""
    logits = F.linear(hidden, weight, bias).float()  # (n, vocab_size)
    if logit_scale is not None:
        logits = logits * logit_scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return logits / temperature


def _chunk_logprobs(hidden, targets, weight, bias, *, logit_scale, softcap, temperature, with_entropy):
    """
    Log-probs `(n,)` of `targets` and optionally the entropy `(n,)`, from one chunk of hidden states.

    Not TRL's `selective_log_softmax` + `entropy_from_logits`: one log-softmax here feeds both outputs (those make two
    passes over the `(n, vocab_size)` tile on CPU), and it is the operation the rollout records its log-probs with, so
    the first PPO ratio of a rollout is 1 up to forward noise (TRL's log-sum-exp form differs by ~2e-6).
    """
    log_probs = _scaled_logits(hidden, weight, bias, logit_scale, softcap, temperature).log_softmax(-1)  # (n, V)
    token_log_probs = log_probs.gather(-1, targets[:, None]).squeeze(-1)  # (n,)
    if not with_entropy:
        return token_log_probs
    entropy = -(log_probs.exp() * log_probs).sum(-1)  # (n,)
    return token_log_probs, entropy


def _logit_transforms(model: torch.nn.Module) -> dict:
    config = _unwrap(model).config
    return {
        "logit_scale": getattr(config, "logit_scale", None),
        "softcap": getattr(config, "final_logit_softcapping", None),
    }


def action_logprobs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    return_entropy: bool = False,
    logit_scale: float | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """
    Log-probabilities of `targets` under the head `hidden @ weight.T + bias`, computed `chunk_size` tokens at a time.

    When gradients are needed each chunk is checkpointed, so its `(chunk_size, vocab_size)` logits are recomputed in
    the backward pass instead of kept: peak memory of the head is about `chunk_size x vocab_size` fp32 values (a few
    times that during the backward of one chunk), whatever the number of tokens. On CPU this is faster than TRL's
    `ChunkedLogProbFunction` at equal memory (see docs/benchmarks.md).

    Args:
        hidden (`torch.Tensor` of shape `(N, hidden_size)`):
            Hidden states that predict the targets, e.g. from [`action_hidden_states`].
        weight (`torch.Tensor` of shape `(vocab_size, hidden_size)`):
            LM-head weight, e.g. from [`lm_head_params`].
        bias (`torch.Tensor` of shape `(vocab_size,)` or `None`):
            LM-head bias.
        targets (`torch.LongTensor` of shape `(N,)`):
            Token ids to score, e.g. from [`action_token_ids`].
        temperature (`float`, *optional*, defaults to `1.0`):
            The logits are divided by it before the softmax.
        chunk_size (`int`, *optional*, defaults to `1024`):
            Number of tokens whose full-vocabulary logits exist at once.
        return_entropy (`bool`, *optional*, defaults to `False`):
            Also compute the entropy of each token's distribution.
        logit_scale (`float`, *optional*):
            Factor applied to the logits first (models such as Cohere).
        softcap (`float`, *optional*):
            Final logit soft-capping `softcap * tanh(logits / softcap)` (models such as Gemma 2).

    Returns:
        `tuple`: the log-probs, a `torch.FloatTensor` of shape `(N,)`, and the entropy, a `torch.FloatTensor` of
        shape `(N,)` with `return_entropy=True`, else `None`.
    """
    if chunk_size < 1:
        raise ValueError(f"`chunk_size` must be a positive integer, got {chunk_size}.")
    if hidden.shape[0] != targets.shape[0]:
        raise ValueError(f"`hidden` has {hidden.shape[0]} rows but `targets` has {targets.shape[0]}; give one each.")
    chunk_fn = functools.partial(
        _chunk_logprobs, logit_scale=logit_scale, softcap=softcap, temperature=temperature, with_entropy=return_entropy
    )
    needs_grad = torch.is_grad_enabled() and (
        hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    log_probs, entropies = [], []
    for start in range(0, hidden.shape[0], chunk_size):
        args = (hidden[start : start + chunk_size], targets[start : start + chunk_size], weight, bias)
        out = checkpoint(chunk_fn, *args, use_reentrant=False) if needs_grad else chunk_fn(*args)
        log_probs.append(out[0] if return_entropy else out)
        if return_entropy:
            entropies.append(out[1])
    empty = hidden.new_zeros(0, dtype=torch.float32)
    log_probs = torch.cat(log_probs) if log_probs else empty  # (N,)
    if not return_entropy:
        return log_probs, None
    return log_probs, (torch.cat(entropies) if entropies else empty)


def action_logprobs(
    model: torch.nn.Module,
    batch: dict,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """
    Log-probabilities of the sampled action tokens, with the LM head applied only at action positions.

    Hidden states are taken at the positions that predict action tokens ([`action_hidden_states`]); the head then
    runs on chunks of `chunk_size` of them ([`action_logprobs_from_hidden`]), checkpointed when gradients are needed, so
    peak memory of the head is about `chunk_size x vocab_size` fp32 values whatever the number of action tokens. The
    result is differentiable with respect to the model's parameters (for the student).

    Args:
        model (`torch.nn.Module`):
            A causal LM, possibly wrapped (see [`packed_hidden_states`]).
        batch (`dict`):
            Output of a collator of [`memopd_trl.packing`], on the model's device.
        temperature (`float`, *optional*, defaults to `1.0`):
            The logits are divided by it before the softmax (use the sampling temperature).
        chunk_size (`int`, *optional*, defaults to `1024`):
            Number of action tokens whose full-vocabulary logits exist at once.
        return_entropy (`bool`, *optional*, defaults to `False`):
            Also return the entropy of each action position's distribution.

    Returns:
        `torch.FloatTensor` of shape `(N,)` in canonical action order, and, with `return_entropy=True`, the entropy
        as a second `torch.FloatTensor` of shape `(N,)`.
    """
    hidden = action_hidden_states(model, batch)  # (N, hidden_size)
    targets = action_token_ids(batch).to(hidden.device)  # (N,)
    weight, bias = lm_head_params(model)
    log_probs, entropy = action_logprobs_from_hidden(
        hidden, weight, bias, targets, temperature, chunk_size, return_entropy, **_logit_transforms(model)
    )
    return (log_probs, entropy) if return_entropy else log_probs


@torch.no_grad()
def action_log_distributions(model: torch.nn.Module, batch: dict, temperature: float = 1.0) -> torch.Tensor:
    """
    Full-vocabulary log-softmax at every action position (no gradients; for tests, inspection and small batches).

    Takes `model`, `batch` and `temperature` as [`action_logprobs`] does.

    Returns:
        `torch.FloatTensor` of shape `(N, vocab_size)`: log-probabilities of every token at each action position.
    """
    hidden = action_hidden_states(model, batch)  # (N, hidden_size)
    weight, bias = lm_head_params(model)
    return _scaled_logits(hidden, weight, bias, temperature=temperature, **_logit_transforms(model)).log_softmax(-1)


def full_logits_action_logprobs(
    model: torch.nn.Module,
    invocations: list[Invocation],
    temperature: float = 1.0,
    return_distributions: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """
    Reference path: score each invocation alone with a plain forward (`model(input_ids)`, full logits, no packing).

    Slow and memory-hungry by design; it exists so that tests can show the packed, head-at-actions path gives the
    same numbers. Gradients flow if enabled.

    Args:
        model (`torch.nn.Module`):
            A causal LM.
        invocations (`list[Invocation]`):
            The recorded model calls.
        temperature (`float`, *optional*, defaults to `1.0`):
            The logits are divided by it before the softmax.
        return_distributions (`bool`, *optional*, defaults to `False`):
            Also return the full-vocabulary log-softmax at each action position.

    Returns:
        `torch.FloatTensor` of shape `(N,)` in canonical action order and, with `return_distributions=True`, a
        `torch.FloatTensor` of shape `(N, vocab_size)`.
    """
    device = next(model.parameters()).device
    log_probs, distributions = [], []
    for inv in invocations:
        if not inv.output_ids:
            continue
        ids = torch.tensor([inv.input_ids + inv.output_ids], device=device)  # (1, seq_len)
        logits = model(input_ids=ids).logits[0].float()  # (seq_len, vocab_size)
        # The logits at the last input token and at every output token but the last predict the output tokens.
        start = len(inv.input_ids) - 1
        action_logits = logits[start : start + len(inv.output_ids)]  # (num_outputs, vocab_size)
        log_probs.append(selective_log_softmax(action_logits, ids[0, start + 1 :], temperature=temperature))
        if return_distributions:
            distributions.append((action_logits / temperature).log_softmax(-1))
    if not log_probs:
        empty = torch.zeros(0, device=device)
        return (empty, empty.view(0, _unwrap(model).config.vocab_size)) if return_distributions else empty
    if return_distributions:
        return torch.cat(log_probs), torch.cat(distributions)
    return torch.cat(log_probs)


def sampled_token_logprobs(
    model: torch.nn.Module,
    hidden: torch.Tensor,
    action_ids: torch.Tensor,
    vocab_size: int,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """
    `(N,)`: the log-prob under `model`'s LM head (gathered when sharded) on `hidden` `(N, H)` of each sampled token
    `action_ids` `(N,)`, at `temperature`.
    """
    with gathered_lm_head(model, vocab_size) as (weight, bias):
        return action_logprobs_from_hidden(
            hidden, weight, bias, action_ids, temperature=temperature, chunk_size=chunk_size
        )[0]


def rows_action_hidden_states(model: torch.nn.Module, rows: list[dict]) -> torch.Tensor:
    """`(N, H)`: the hidden states at every action position of a batch forwarded row by row, in canonical order."""
    parts = [(row["action_index"], action_hidden_states(model, row)) for row in rows]
    hidden = parts[0][1].new_empty(sum(len(index) for index, _ in parts), parts[0][1].shape[-1])
    for index, part in parts:
        hidden[index] = part
    return hidden
