"""Imitation learning on expert trajectories, on packed invocations.

Used to build the offline default: a teacher is fine-tuned on a scripted expert's compact-memory trajectories, and a
student is warm-started briefly so that it knows the action format. Each expert turn becomes an `Invocation` (the
rendered context as `input_ids`, the expert's action as `output_ids`), so training runs on the same packed,
padding-free rows and the same action-only scoring as MemOPD itself ([`expert_invocations`], [`imitation_train`]).
[`copy_task_invocations`] makes the copy warm-up that a model trained from scratch runs before imitation: random token
strings to repeat (why: docs/design.md, "The offline lab").
"""

import math
import random
from collections.abc import Callable, Sequence

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from memopd_trl.packing import PackedInvocationCollator, gather_actions
from memopd_trl.records import Invocation
from memopd_trl.scoring import action_logprobs, lm_head_params, packed_hidden_states


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


def copy_task_invocations(
    num_sequences: int,
    token_ids: Sequence[int],
    separator_id: int,
    min_length: int = 8,
    max_length: int = 24,
    seed: int = 0,
) -> list[Invocation]:
    """
    Random strings to repeat: the copy warm-up of a model trained from scratch (see the module docstring).

    Each invocation's `input_ids` is a string of `min_length` to `max_length` tokens drawn uniformly from `token_ids`,
    followed by `separator_id`; its `output_ids` is the same string. Lengths vary so that copying by a fixed offset
    does not work: the model has to find, by content, where the current token occurred before.

    Args:
        num_sequences (`int`): number of invocations.
        token_ids (`Sequence[int]`): the ids to draw from (e.g. every non-special id of the tokenizer).
        separator_id (`int`): id placed between a string and its copy (e.g. the EOS id).
        min_length (`int`, *optional*, defaults to `8`): shortest string.
        max_length (`int`, *optional*, defaults to `24`): longest string.
        seed (`int`, *optional*, defaults to `0`): same seed, same strings.

    Returns:
        `list[Invocation]`: `num_sequences` invocations, for [`imitation_train`].
    """
    if num_sequences < 1:
        raise ValueError(f"`num_sequences` must be >= 1, got {num_sequences}.")
    if not 1 <= min_length <= max_length:
        raise ValueError(f"Need 1 <= `min_length` <= `max_length`, got {min_length} and {max_length}.")
    token_ids = list(token_ids)
    if len(token_ids) < 2:
        raise ValueError(f"`token_ids` must hold at least 2 ids to draw random strings from, got {len(token_ids)}.")
    rng = random.Random(seed)
    invocations = []
    for index in range(num_sequences):
        string = [rng.choice(token_ids) for _ in range(rng.randint(min_length, max_length))]
        invocations.append(Invocation(input_ids=string + [separator_id], output_ids=string, episode_id=index))
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
    evaluate: Callable[[PreTrainedModel], float] | None = None,
    eval_epochs: float = 0.0,
) -> list[float]:
    """
    Maximum-likelihood training of `model` on the action tokens of `invocations`, and optionally on their contexts.

    Batches of about `tokens_per_batch` real tokens are packed into rows of `max_tokens_per_row` (no padding), and the
    mean negative log-likelihood of the action tokens (plus `context_weight` times that of the context tokens) is
    minimized with AdamW under a linear warm-up and cosine decay, gradient norm clipped at 1.

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
        context_weight (`float`, *optional*, defaults to `0.0`):
            Weight of the next-token NLL of the context tokens (every token of an invocation's `input_ids` but its
            first). 0 trains the actions only.
        evaluate (`Callable[[PreTrainedModel], float]`, *optional*):
            Scores the model (higher is better, e.g. greedy F1 on tasks set aside from `invocations`) every
            `eval_epochs` epochs and after the last step; the model ends with the weights of the best score (the
            latest of equal ones), not necessarily the last.
        eval_epochs (`float`, *optional*, defaults to `0.0`):
            Epochs between two calls of `evaluate`; 0 calls it only after the last step.

    Returns:
        `list[float]`: the mean action-token NLL of every optimizer step (without the context term).
    """
    if not invocations:
        raise ValueError("`invocations` is empty: nothing to imitate.")
    if epochs <= 0:
        raise ValueError(f"`epochs` must be > 0, got {epochs}.")
    if context_weight < 0:
        raise ValueError(f"`context_weight` must be >= 0, got {context_weight}.")
    if eval_epochs < 0:
        raise ValueError(f"`eval_epochs` must be >= 0, got {eval_epochs}.")
    rng = random.Random(seed)
    collator = PackedInvocationCollator(max_tokens_per_row=max_tokens_per_row, pad_token_id=pad_token_id)
    steps_per_epoch = len(_batches(invocations, tokens_per_batch, random.Random(seed)))
    total_steps = max(1, math.ceil(epochs * steps_per_epoch))
    warmup = max(1, int(warmup_fraction * total_steps))
    eval_steps = max(1, round(eval_epochs * steps_per_epoch)) if eval_epochs else 0
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=weight_decay)

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total_steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    device = next(model.parameters()).device
    model.train()
    losses: list[float] = []
    best: tuple[float, dict[str, torch.Tensor]] | None = None  # (score, weights) of the best evaluation so far

    def checkpoint() -> None:
        nonlocal best
        score = evaluate(model)
        model.train()
        if best is None or score >= best[0]:
            best = (score, {k: v.detach().clone() for k, v in model.state_dict().items()})
        if progress:
            bar.write(f"[{description}] step {len(losses)}/{total_steps}: score {score:.3f} (best {best[0]:.3f})")

    bar = tqdm(total=total_steps, desc=description, disable=not progress)
    while len(losses) < total_steps:
        for batch_invocations in _batches(invocations, tokens_per_batch, rng):
            if len(losses) >= total_steps:
                break
            batch = {
                k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in collator(batch_invocations).items()
            }
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
            if evaluate is not None and eval_steps and len(losses) % eval_steps == 0 and len(losses) < total_steps:
                checkpoint()
    if evaluate is not None:
        checkpoint()
        model.load_state_dict(best[1])
    bar.close()
    model.eval()
    return losses


def _action_and_context_nll(model: PreTrainedModel, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """
    Mean next-token NLL over the action tokens (canonical order) and over the context tokens, from one forward.

    Context targets are the tokens of an invocation's `input_ids` after its first (the first has no predecessor in its
    sequence); row padding, which `invocation_index` marks -1, is never a target.
    """
    hidden = packed_hidden_states(model, batch)  # (rows, width, hidden_size)
    weight, bias = lm_head_params(model)
    # Column c - 1 predicts column c (the same shift as `scoring.action_hidden_states`).
    predictors = hidden[:, :-1]  # (rows, width - 1, hidden_size)
    targets = batch["input_ids"][:, 1:]  # (rows, width - 1)
    target_action_index = batch["action_target_index"][:, 1:]  # (rows, width - 1)
    in_sequence = (batch["position_ids"][:, 1:] > 0) & (batch["invocation_index"][:, 1:] >= 0)  # (rows, width - 1)
    is_context = in_sequence & (target_action_index < 0)  # (rows, width - 1)
    action_hidden = gather_actions(predictors, target_action_index)  # (N, hidden_size)
    action_targets = gather_actions(batch["input_ids"], batch["action_target_index"])  # (N,)
    all_hidden = torch.cat([action_hidden, predictors[is_context]])  # (N + C, hidden_size)
    logits = torch.nn.functional.linear(all_hidden, weight, bias).float()  # (N + C, vocab_size)
    nll = torch.nn.functional.cross_entropy(logits, torch.cat([action_targets, targets[is_context]]), reduction="none")
    num_actions = action_targets.numel()
    return nll[:num_actions].mean(), nll[num_actions:].mean()
