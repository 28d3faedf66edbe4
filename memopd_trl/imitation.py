"""Imitation learning on expert trajectories, on packed invocations.

Used to build the offline default: a teacher is fine-tuned on a scripted expert's compact-memory trajectories, and a
student is warm-started briefly so that it knows the action format. Each expert turn becomes an `Invocation` (the
rendered context as `input_ids`, the expert's action as `output_ids`), so training runs on the same packed,
padding-free rows and the same action-only scoring as MemOPD itself.
"""

import math
import random
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .packing import PackedInvocationCollator, gather_actions
from .records import Invocation
from .scoring import action_logprobs, lm_head_params, packed_hidden_states


def expert_invocations(
    steps: Sequence[tuple[list[dict[str, str]], str]], tokenizer: PreTrainedTokenizerBase
) -> list[Invocation]:
    """
    Turn expert turns into invocations, tokenized exactly as the rollout engine conditions the model.

    Args:
        steps (`Sequence[tuple[list[dict], str]]`):
            `(messages, action_text)` pairs: the chat messages the agent saw and the expert's action.
        tokenizer (`PreTrainedTokenizerBase`):
            Tokenizer with a chat template.

    Returns:
        `list[Invocation]`: one per step; `input_ids` is the rendered context with the generation prompt, `output_ids`
        the tokenized action (without an end-of-turn token: generation stops at the action's closing tag).
    """
    invocations = []
    for index, (messages, action) in enumerate(steps):
        input_ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        output_ids = tokenizer(action, add_special_tokens=False)["input_ids"]
        invocations.append(Invocation(input_ids=list(input_ids), output_ids=output_ids, episode_id=index))
    return invocations


def _batches(invocations: list[Invocation], tokens_per_batch: int, rng: random.Random) -> list[list[Invocation]]:
    order = list(range(len(invocations)))
    rng.shuffle(order)
    batches, current, size = [], [], 0
    for i in order:
        n = invocations[i].num_tokens
        if current and size + n > tokens_per_batch:
            batches.append(current)
            current, size = [], 0
        current.append(invocations[i])
        size += n
    if current:
        batches.append(current)
    return batches


def imitation_train(
    model: PreTrainedModel,
    invocations: list[Invocation],
    epochs: float = 1.0,
    learning_rate: float = 1e-3,
    tokens_per_batch: int = 8192,
    max_tokens_per_row: int = 2048,
    pad_token_id: int = 0,
    weight_decay: float = 0.0,
    warmup_fraction: float = 0.05,
    seed: int = 0,
    progress: bool = True,
    description: str = "imitation",
    context_weight: float = 0.0,
) -> list[float]:
    """
    Maximum-likelihood training of `model` on the action tokens of `invocations` (context tokens are not trained).

    Batches of about `tokens_per_batch` real tokens are packed into rows of `max_tokens_per_row` (no padding), and the
    negative log-likelihood of the action tokens is minimized with AdamW under a linear warm-up and cosine decay.

    Args:
        model (`PreTrainedModel`): the causal LM to train, in place.
        invocations (`list[Invocation]`): the expert turns (see [`expert_invocations`]).
        epochs (`float`, *optional*, defaults to `1.0`): passes over the data; fractions stop part-way.
        learning_rate (`float`, *optional*, defaults to `1e-3`): peak learning rate.
        tokens_per_batch (`int`, *optional*, defaults to `8192`): real tokens per optimizer step.
        max_tokens_per_row (`int`, *optional*, defaults to `2048`): packed row budget.
        pad_token_id (`int`, *optional*, defaults to `0`): id used for row padding.
        weight_decay (`float`, *optional*, defaults to `0.0`): AdamW weight decay.
        warmup_fraction (`float`, *optional*, defaults to `0.05`): fraction of steps of linear warm-up.
        seed (`int`, *optional*, defaults to `0`): seed of the data order.
        progress (`bool`, *optional*, defaults to `True`): show a progress bar.
        description (`str`, *optional*, defaults to `"imitation"`): label of the progress bar.

    Returns:
        `list[float]`: the mean action-token NLL of every optimizer step.
    """
    if not invocations:
        raise ValueError("`invocations` is empty: nothing to imitate.")
    if epochs <= 0:
        raise ValueError(f"`epochs` must be > 0, got {epochs}.")
    rng = random.Random(seed)
    collator = PackedInvocationCollator(max_tokens_per_row=max_tokens_per_row, pad_token_id=pad_token_id)
    steps_per_epoch = len(_batches(invocations, tokens_per_batch, random.Random(seed)))
    total_steps = max(1, math.ceil(epochs * steps_per_epoch))
    warmup = max(1, int(warmup_fraction * total_steps))
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=weight_decay)

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total_steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    device = next(model.parameters()).device
    model.train()
    losses: list[float] = []
    bar = tqdm(total=total_steps, desc=description, disable=not progress)
    while len(losses) < total_steps:
        for batch_invocations in _batches(invocations, tokens_per_batch, rng):
            if len(losses) >= total_steps:
                break
            batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in collator(batch_invocations).items()}
            if context_weight > 0:
                action_nll, context_nll = _action_and_context_nll(model, batch)
                loss = action_nll + context_weight * context_nll
            else:
                action_nll = loss = -action_logprobs(model, batch).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            losses.append(action_nll.item())
            bar.update(1)
            bar.set_postfix(nll=f"{losses[-1]:.3f}")
    bar.close()
    model.eval()
    return losses


def _action_and_context_nll(model: PreTrainedModel, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean next-token NLL over action tokens and over context tokens (after a sequence's first), from one forward."""
    hidden = packed_hidden_states(model, batch)  # (rows, width, hidden_size)
    weight, bias = lm_head_params(model)
    # Column c - 1 predicts column c, as in `scoring.action_hidden_states`.
    targets = batch["input_ids"][:, 1:]  # (rows, width - 1)
    invocation = batch["invocation_index"]
    same_sequence = (batch["position_ids"][:, 1:] > 0) & (invocation[:, 1:] >= 0)  # (rows, width - 1)
    is_action = batch["action_target_index"][:, 1:] >= 0
    action_hidden = gather_actions(hidden[:, :-1], batch["action_target_index"][:, 1:])  # (N, hidden_size)
    action_targets = gather_actions(batch["input_ids"], batch["action_target_index"])  # (N,)
    context = same_sequence & ~is_action
    logits = torch.nn.functional.linear(torch.cat([action_hidden, hidden[:, :-1][context]]), weight, bias).float()
    nll = torch.nn.functional.cross_entropy(logits, torch.cat([action_targets, targets[context]]), reduction="none")
    n = action_targets.numel()
    return nll[:n].mean(), nll[n:].mean()
