"""Batched multi-turn rollouts of memory agents, recorded as exact token-level invocations.

At every turn the engine asks each live episode's environment for its next context (chat messages built by the memory
policy), renders all of them with the tokenizer's chat template, generates one action per episode in a single batched
call, and hands the decoded actions back to the environments. Each model call is recorded as an
:class:`~memopd_trl.records.Invocation`: the exact token ids the model was conditioned on (padding removed, so their
positions are `0..len-1`), the exact token ids it sampled (never re-tokenized from text) and their sampling
log-probabilities. Later stages score exactly these tokens (invariant 1, provenance, in docs/design.md).
"""

import inspect
import logging
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from tqdm.auto import tqdm
from transformers import (
    DynamicCache,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)

from .envs.base import EnvContractError
from .records import Episode, Invocation


logger = logging.getLogger(__name__)

_BACKENDS = ("hf", "vllm")
# Assistant content that no template or model output contains; the text a template renders after it is the end of
# the assistant turn followed by the next message (see `RolloutEngine._observation_ids`).
_SENTINEL = "[[memopd-assistant-content-sentinel]]"
# Fields of a model's `generation_config` that would change the logits before the log-prob recorder sees them and that
# the engine cannot switch off explicitly (the common ones, like `repetition_penalty` and `top_k`, it overrides).
_UNSUPPORTED_GENERATION_FIELDS = (
    "bad_words_ids",
    "sequence_bias",
    "suppress_tokens",
    "begin_suppress_tokens",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "min_new_tokens",
    "exponential_decay_length_penalty",
    "guidance_scale",
)


class RolloutStopped(Exception):
    """Raised by [`~RolloutEngine.rollout`] when its `should_stop` asked it to stop before a turn."""


class GeneratedAction(NamedTuple):
    """
    One generated action, cut right after its stop.

    Parameters:
        output_ids (`list[int]`): the sampled token ids, up to and including the token that completed the stop string
            or the EOS token (no padding).
        logprobs (`list[float]`): the sampling log-probability of each id in `output_ids`.
        truncated (`bool`): whether `max_new_tokens` was reached before any stop string or EOS.
    """

    output_ids: list[int]
    logprobs: list[float]
    truncated: bool


@dataclass
class _LiveEpisode:
    env: Any
    episode: Episode
    record: dict[str, Any]
    closed: bool = False
    context_truncations: int = 0
    info: dict[str, Any] = field(default_factory=dict)


# The scores every `MemoryAgentEnv` keeps after its final step (`score()` returns at least these; they are 0 until
# an answer is scored). An environment reports other or more scores with a `metrics` dict of its own.
_ENV_SCORE_NAMES = ("f1", "em")


def _cache_keyword(model) -> str:
    """The keyword a transformers model's forward takes its KV cache by: `cache` in the transformers this project pins,
    `past_key_values` in the older one that vLLM's CPU build pins (5.17)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _final_metrics(env) -> dict[str, float]:
    """The scalar final scores of an environment, by name: its `metrics` dict if it has one, else `f1` and `em`."""
    metrics = getattr(env, "metrics", None)
    if not isinstance(metrics, dict):
        metrics = {name: getattr(env, name, 0.0) for name in _ENV_SCORE_NAMES}
    return {name: float(value) for name, value in metrics.items() if isinstance(value, (int, float))}


def _decoded_window(tokenizer, ids: Sequence[int], end: int, window: int) -> str:
    return tokenizer.decode(list(ids[max(0, end - window) : end]), skip_special_tokens=False)


def find_stop(tokenizer, ids: Sequence[int], stop_strings: Sequence[str]) -> int | None:
    """
    Find where a generation stops on text.

    Args:
        tokenizer: the tokenizer that decodes `ids`.
        ids (`Sequence[int]`): generated token ids.
        stop_strings (`Sequence[str]`): strings that end a generation.

    Returns:
        `int` or `None`: the smallest `k` such that the decoded text of `ids[:k]` contains a stop string (the ids are
        then cut to `ids[:k]`), or `None` if none occurs.
    """

    def has_stop(k: int) -> bool:
        text = tokenizer.decode(list(ids[:k]), skip_special_tokens=False)
        return any(s in text for s in stop_strings)

    if not stop_strings or not has_stop(len(ids)):
        return None
    # Once a stop string is in the decoded prefix it stays there as the prefix grows: binary search the first k.
    low, high = 1, len(ids)
    while low < high:
        middle = (low + high) // 2
        if has_stop(middle):
            high = middle
        else:
            low = middle + 1
    return low


class _StopOnText(StoppingCriteria):
    """
    Ends each row of a batched `generate` call once its generated text contains one of that row's stop strings.

    A stop string first appearing at this step ends inside the last token, so a row is decoded (a short window: a stop
    string spans at most one token per UTF-8 byte) only when its last token holds the last character of a stop string,
    or ends a character split across tokens (alone it decodes to U+FFFD, e.g. the last byte of a byte-level `→`).

    Not `StopStringCriteria`: no per-row strings, matches into the prompt, slow at 150k tokens (docs/benchmarks.md).
    """

    def __init__(self, tokenizer, stop_strings: list[tuple[str, ...]], prompt_width: int):
        self.tokenizer = tokenizer
        self.stop_strings = stop_strings
        self.prompt_width = prompt_width
        self.windows = [max((len(s.encode()) for s in stops), default=0) + 8 for stops in stop_strings]
        self.last_chars = [{s[-1] for s in stops if s} for stops in stop_strings]
        self.done: list[bool] = [False] * len(stop_strings)
        self._token_text: dict[int, str] = {}

    def _text_of(self, token_id: int) -> str:
        if token_id not in self._token_text:
            self._token_text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return self._token_text[token_id]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        generated = input_ids[:, self.prompt_width :].tolist()  # (batch_size, num_generated)
        for row, ids in enumerate(generated):
            stops = self.stop_strings[row]
            if self.done[row] or not stops:
                continue
            last = self._text_of(ids[-1])
            if "\ufffd" not in last and not any(c in last for c in self.last_chars[row]):
                continue
            text = _decoded_window(self.tokenizer, ids, len(ids), self.windows[row])
            self.done[row] = any(s in text for s in stops)
        return torch.tensor(self.done, dtype=torch.bool, device=input_ids.device)


class _SampledLogprobRecorder(LogitsProcessor):
    """
    Records `log_softmax(logits / temperature)` at each sampled token, from the raw logits, during `generate`.

    It must run first among the logits processors, on the unmodified logits. It keeps one step of log-probs at a time:
    at step t+1 the token sampled at step t is the last column of `input_ids`, so it is gathered then; `finish` gathers
    the last step. (Keeping every step's logits, as `output_logits=True` does, costs steps x batch x vocab memory.)
    """

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.pending: torch.Tensor | None = None  # (batch_size, vocab_size)
        self.steps: list[torch.Tensor] = []  # each (batch_size,)

    def _gather(self, sampled: torch.LongTensor) -> None:
        if self.pending is not None:
            self.steps.append(self.pending.gather(-1, sampled[:, None].to(self.pending.device)).squeeze(-1))
            self.pending = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self._gather(input_ids[:, -1])
        self.pending = torch.log_softmax(scores.float() / self.temperature, dim=-1)  # (batch_size, vocab_size)
        return scores

    def finish(self, last_sampled: torch.LongTensor) -> torch.Tensor:
        """Returns the recorded log-probs, `(batch_size, num_generated)`."""
        self._gather(last_sampled)
        return torch.stack(self.steps, dim=1)


class RolloutEngine:
    """
    Plays batched, multi-turn episodes of memory agents and records every model call as an `Invocation`.

    Every turn, the contexts of all live episodes are built by their environments (`env.messages()`), rendered with
    the tokenizer's chat template (`add_generation_prompt=True`) and generated in one batched call (left padding,
    correct position ids, KV cache). Each output is cut right after the first stop string of its environment (the
    closing tag of an action) or EOS; its decoded text goes to `env.step`. Finished episodes leave the batch.

    Recorded log-probs are `log_softmax(logits / temperature)` of the raw model logits at each sampled token: the
    tempered distribution *before* top-k / top-p filtering. This is what a trainer recomputes when it scores the same
    tokens with the same temperature, so the two can be compared directly. (With `top_k` or `top_p` set, the tokens
    are sampled from the filtered distribution, so these log-probs slightly under-state the sampling probability.)

    A context longer than `max_prompt_length` tokens is first rebuilt smaller by the environment
    (`env.messages(char_budget=...)`, the budget shrinking geometrically); the sampled actions are never cut. If no
    budget fits, the episode ends as failed (`info["end_reason"] = "prompt_too_long"`). An environment that raises, or
    whose observation the tokenizer cannot encode, fails its episode (`info["end_reason"] = "env_error"`) and the
    rollout goes on. Failed episodes have reward 0. An environment that breaks the `MemoryAgentEnv` contract
    (`EnvContractError`, e.g. a `score()` that returns no dict) is a bug in its code, not in one episode: the error
    stops the rollout.

    Args:
        model (`PreTrainedModel` or `None`):
            The policy, used by the `"hf"` backend. May be `None` with `backend="vllm"`.
        tokenizer (`PreTrainedTokenizerBase`):
            Its tokenizer, with a chat template.
        env_factory (`Callable[[], MemoryAgentEnv]`):
            Makes a fresh environment; called once per episode (e.g. `HotpotQAEnv.factory(corpus=...)`).
        max_new_tokens (`int`, *optional*, defaults to `64`):
            Longest action, in tokens.
        max_prompt_length (`int`, *optional*, defaults to `1024`):
            Longest context, in tokens.
        temperature (`float`, *optional*, defaults to `1.0`):
            Sampling temperature; also the temperature of the recorded log-probs (also under greedy decoding).
        top_p (`float`, *optional*, defaults to `1.0`):
            Nucleus sampling mass; `1.0` disables it.
        top_k (`int`, *optional*, defaults to `0`):
            Top-k sampling; `0` disables it.
        backend (`str`, *optional*, defaults to `"hf"`):
            `"hf"` (transformers `generate`) or `"vllm"` (needs a GPU and the `vllm` extra).
        vllm_llm (`vllm.LLM`, *optional*):
            The vLLM engine of the `"vllm"` backend; built from `model` (a path or Hub id) when not given.
        eos_token_ids (`Sequence[int]`, *optional*):
            Token ids that end a generation. Defaults to the tokenizer's EOS, `<|im_end|>` when the vocabulary has it,
            and the model's `generation_config.eos_token_id`.
        context_shrink (`float`, *optional*, defaults to `0.5`):
            Factor applied to the character budget at each retry of an overlong context.
        generation_batch_size (`int`, *optional*):
            Most contexts in one generation call; by default all live episodes go in one call.
        generation_kwargs (`dict`, *optional*):
            Extra keyword arguments for `model.generate` (e.g. `logits_processor`) with the `"hf"` backend.
        share_prefix (`bool`, *optional*, defaults to `True`):
            Shared prompt prefill: with the `"hf"` backend, encode each distinct context of a generation call once
            and give its KV cache to every episode that has the same context (the `num_generations` episodes of a
            question at their first turn), instead of encoding it once per episode. Same tokens and log-probs up to
            float rounding. The vLLM backend gets the same from the engine's automatic prefix caching. (The same
            name as `MemOPDConfig.share_prefix` and `PackedInvocationCollator(share_prefix=...)`, which share common
            prefixes when scoring.)
        share_prompt_prefill (`bool`, *optional*):
            Deprecated: now `share_prefix`.

    Example:

    ```python
    >>> from memopd_trl import HotpotQAEnv, RolloutEngine
    >>> from offline_lab import build_tiny_model, build_tokenizer, make_synthetic_world  # the offline lab
    >>> world = make_synthetic_world(4, seed=0)
    >>> tokenizer = build_tokenizer(world.texts(), vocab_size=600)
    >>> model = build_tiny_model(len(tokenizer), hidden_size=32, num_hidden_layers=1)
    >>> engine = RolloutEngine(model, tokenizer, HotpotQAEnv.factory(corpus=world.corpus), temperature=0.7)
    >>> episodes, stats = engine.rollout(world.records, num_generations=2)
    >>> stats["num_episodes"], episodes[1].group_id, episodes[2].group_id
    (8, 0, 1)
    ```
    """

    def __init__(
        self,
        model,
        tokenizer,
        env_factory: Callable[[], Any],
        max_new_tokens: int = 64,
        max_prompt_length: int = 1024,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        backend: str = "hf",
        vllm_llm=None,
        eos_token_ids: Sequence[int] | None = None,
        context_shrink: float = 0.5,
        generation_batch_size: int | None = None,
        generation_kwargs: dict[str, Any] | None = None,
        share_prefix: bool = True,
        share_prompt_prefill: bool | None = None,
    ):
        if share_prompt_prefill is not None:
            warnings.warn(
                "`RolloutEngine(share_prompt_prefill=...)` is deprecated and will be removed in the next release; use "
                "`share_prefix` instead.",
                FutureWarning,
                stacklevel=2,
            )
            share_prefix = share_prompt_prefill
        if backend not in _BACKENDS:
            raise ValueError(f"`backend` must be one of {_BACKENDS}, got {backend!r}.")
        if max_new_tokens < 1:
            raise ValueError(f"`max_new_tokens` must be >= 1, got {max_new_tokens}.")
        if max_prompt_length < 1:
            raise ValueError(f"`max_prompt_length` must be >= 1, got {max_prompt_length}.")
        # Kept although `MemOPDConfig` checks it too: scripts build the engine directly, and 0 would divide the
        # recorded logits by 0 (transformers' `generate` does not refuse it).
        if not temperature > 0:
            raise ValueError(f"`temperature` must be > 0 (use `greedy=True` for greedy decoding), got {temperature}.")
        if not 0 < top_p <= 1:
            raise ValueError(f"`top_p` must be in (0, 1], got {top_p}.")
        if top_k < 0:
            raise ValueError(f"`top_k` must be >= 0 (0 disables it), got {top_k}.")
        if not 0 < context_shrink < 1:
            raise ValueError(f"`context_shrink` must be in (0, 1), got {context_shrink}.")
        if generation_batch_size is not None and generation_batch_size < 1:
            raise ValueError(f"`generation_batch_size` must be None or >= 1, got {generation_batch_size}.")
        if backend == "hf" and model is None:
            raise ValueError("The 'hf' backend needs a `model`; pass one, or use `backend='vllm'` with `vllm_llm`.")
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                "The tokenizer has no chat template; set `tokenizer.chat_template` (the offline lab's "
                "offline_lab.build_tokenizer makes a ChatML one) before building a RolloutEngine."
            )
        if not callable(env_factory):
            raise TypeError(f"`env_factory` must be a callable returning a fresh environment, got {env_factory!r}.")
        self.model = model
        self.tokenizer = tokenizer
        self.env_factory = env_factory
        self.max_new_tokens = max_new_tokens
        self.max_prompt_length = max_prompt_length
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.backend = backend
        self.context_shrink = context_shrink
        self.generation_batch_size = generation_batch_size
        self.generation_kwargs = dict(generation_kwargs or {})
        self.share_prefix = share_prefix
        self._shared_prefill_tokens = 0  # context tokens this rollout did not encode again (shared prompt prefill)
        self.eos_token_ids = self._default_eos_ids() if eos_token_ids is None else [int(t) for t in eos_token_ids]
        if not self.eos_token_ids:
            raise ValueError("No EOS token id found; pass `eos_token_ids` or give the tokenizer an `eos_token`.")
        self._observation_ids([], "")  # fails now, not mid-rollout, if the chat template cannot be used
        pad = tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else self.eos_token_ids[0])
        model_config = getattr(model, "generation_config", None)
        set_fields = [name for name in _UNSUPPORTED_GENERATION_FIELDS if getattr(model_config, name, None) is not None]
        if backend == "hf" and set_fields:
            warnings.warn(
                f"The model's generation_config sets {set_fields}; these change the logits during generation, so the "
                "recorded log-probs would not be the model's own. Set them to None on `model.generation_config`.",
                stacklevel=2,
            )
        self._vllm = None
        if backend == "vllm":
            from .vllm_backend import VLLMBackend

            self._vllm = VLLMBackend.from_engine_settings(self, llm=vllm_llm)

    def _default_eos_ids(self) -> list[int]:
        ids: list[int] = []
        candidates = [self.tokenizer.eos_token_id]
        if "<|im_end|>" in self.tokenizer.get_vocab():
            candidates.append(self.tokenizer.convert_tokens_to_ids("<|im_end|>"))
        model_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        candidates += model_eos if isinstance(model_eos, list) else [model_eos]
        for token_id in candidates:
            if token_id is not None and int(token_id) not in ids:
                ids.append(int(token_id))
        return ids

    # ----- one rollout ----------------------------------------------------------------------------------------------
    @contextmanager
    def decoding_with(self, model: Any) -> Iterator[None]:
        """
        Decode with `model` instead of the engine's own model inside the block: the same weights seen another way, as
        a trainer gathers or unwraps them for one rollout (ZeRO-3, FSDP2, DDP). The engine's model is back after it.
        """
        own, self.model = self.model, model
        try:
            yield
        finally:
            self.model = own

    def rollout(
        self,
        records: list[dict[str, Any]],
        num_generations: int = 1,
        greedy: bool = False,
        group_offset: int = 0,
        progress: bool = False,
        should_stop: Callable[[], bool] | None = None,
    ) -> tuple[list[Episode], dict[str, float]]:
        """
        Play `num_generations` episodes per record, all in lock-step batches.

        Each turn is one call of [`~RolloutEngine.generate`] with the contexts of every live episode, all at that
        turn: the t-th call of a rollout (0-based) generates turn t of each episode it is given.

        Args:
            records (`list[dict]`):
                Dataset records (HotpotQA format, with an `_id`), one question each.
            num_generations (`int`, *optional*, defaults to `1`):
                Episodes per record; they share a `group_id`.
            greedy (`bool`, *optional*, defaults to `False`):
                Greedy decoding (for evaluation) instead of sampling.
            group_offset (`int`, *optional*, defaults to `0`):
                Added to the record index to make `group_id`, so groups stay unique across calls.
            progress (`bool`, *optional*, defaults to `False`):
                Show a progress bar over turns.
            should_stop (`Callable[[], bool]`, *optional*):
                Asked before every turn; when it answers `True` the rollout raises [`RolloutStopped`] there and its
                unfinished episodes are dropped. The trainer's evaluation passes one that watches for a SIGTERM.

        Returns:
            `tuple[list[Episode], dict[str, float]]`: the episodes, record by record (episode ids `0..N-1`), and
            statistics: `num_episodes`, `num_turns` (model calls), `num_generated_tokens`, `num_prompt_tokens`,
            `num_context_truncations`, `num_truncated_outputs`, `num_failed_episodes` (of which
            `num_prompt_too_long` and `num_env_errors`), `num_shared_prefill_tokens` (context tokens not encoded again
            because an identical context of the same call was, see `share_prefix`), `mean_reward` and
            `wall_time_s`.
        """
        if num_generations < 1:
            raise ValueError(f"`num_generations` must be >= 1, got {num_generations}.")
        start = time.perf_counter()
        self._shared_prefill_tokens = 0
        stats = dict.fromkeys(
            (
                "num_episodes",
                "num_turns",
                "num_generated_tokens",
                "num_prompt_tokens",
                "num_context_truncations",
                "num_truncated_outputs",
                "num_failed_episodes",
                "num_prompt_too_long",
                "num_env_errors",
            ),
            0,
        )
        live = [
            self._start_episode(record, index, generation, num_generations, group_offset, stats)
            for index, record in enumerate(records)
            for generation in range(num_generations)
        ]
        episodes = [state.episode for state in live]
        bar = tqdm(desc="rollout turns", unit="turn", disable=not progress)
        while live := [state for state in live if not state.closed]:
            if should_stop is not None and should_stop():
                bar.close()
                raise RolloutStopped(f"stopped after {stats['num_turns']} model calls, {len(live)} episodes unfinished")
            contexts = [(state, self._build_context(state, stats)) for state in live]
            contexts = [(state, prompt_ids) for state, prompt_ids in contexts if prompt_ids is not None]
            if not contexts:
                break
            actions = self.generate(
                [prompt_ids for _, prompt_ids in contexts],
                [tuple(state.env.stop_strings) for state, _ in contexts],
                greedy,
            )
            for (state, prompt_ids), action in zip(contexts, actions, strict=True):
                self._play_action(state, prompt_ids, action, stats)
            bar.update(1)
        bar.close()
        stats["num_episodes"] = len(episodes)
        stats["num_shared_prefill_tokens"] = self._shared_prefill_tokens
        stats["mean_reward"] = sum(e.reward for e in episodes) / len(episodes) if episodes else 0.0
        stats["wall_time_s"] = time.perf_counter() - start
        return episodes, stats

    def _start_episode(
        self, record: dict[str, Any], index: int, generation: int, num_generations: int, group_offset: int, stats
    ) -> _LiveEpisode:
        episode = Episode(
            invocations=[],
            episode_id=index * num_generations + generation,
            group_id=index + group_offset,
            record_id=str(record.get("_id", index + group_offset)) if isinstance(record, dict) else str(index),
        )
        state = _LiveEpisode(env=None, episode=episode, record=record)
        try:
            state.env = self.env_factory()
            state.env.reset(record)
        except Exception as err:  # a bad record must not stop the other episodes
            self._fail(state, "env_error", stats, f"environment creation or reset raised {type(err).__name__}: {err}")
        return state

    # ----- contexts -------------------------------------------------------------------------------------------------
    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """
        The token ids a model call is conditioned on: `messages` rendered with the tokenizer's chat template and the
        generation prompt, encoded without special tokens of the tokenizer's own (the template writes them).

        Args:
            messages (`list[dict[str, str]]`): the chat messages of one model call (`env.messages()`).

        Returns:
            `list[int]`: the context's ids, as the engine records them in `Invocation.input_ids` (before any
            shortening to `max_prompt_length`).
        """
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # The template already wrote every special token it wants; adding BOS again would change the context.
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _build_context(self, state: _LiveEpisode, stats: dict) -> list[int] | None:
        try:
            messages = state.env.messages()
            prompt_ids = self.prompt_ids(messages)
            if len(prompt_ids) <= self.max_prompt_length:
                return prompt_ids
            # The carried turns (everything after the system prompt and the task) are what the env can shorten.
            carried = sum(len(m["content"]) for m in messages[2:])
            budget = int(carried * self.max_prompt_length / len(prompt_ids))
            while carried > 0:
                shorter = self.prompt_ids(state.env.messages(char_budget=budget))
                if len(shorter) <= self.max_prompt_length:
                    state.context_truncations += 1
                    stats["num_context_truncations"] += 1
                    return shorter
                if budget == 0:
                    break
                budget = int(budget * self.context_shrink)
        except Exception as err:
            self._fail(state, "env_error", stats, f"building the context raised {type(err).__name__}: {err}")
            return None
        self._fail(
            state,
            "prompt_too_long",
            stats,
            f"the context has {len(prompt_ids)} tokens, more than `max_prompt_length`={self.max_prompt_length}, even "
            "at the smallest memory/observation budget; raise `max_prompt_length` or shorten the task or system prompt",
        )
        return None

    def _observation_ids(self, output_ids: list[int], observation: str) -> list[int]:
        """
        Token ids that follow an action in a persistent (flattened) history: the end of the assistant turn, the
        observation as a user message and the next generation prompt, as the chat template renders them.
        """
        messages = [
            {"role": "user", "content": "?"},
            {"role": "assistant", "content": _SENTINEL},
            {"role": "user", "content": observation},
        ]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # An observation is untrusted text (retrieved passages) and may itself hold the sentinel; the assistant
        # message comes first, so the first occurrence is the one that marks where its content was written.
        if text.count(_SENTINEL) != 1 + observation.count(_SENTINEL):
            raise ValueError(
                "The tokenizer's chat template does not render assistant messages verbatim, so the tokens that follow "
                "an action cannot be derived; use a template that writes `message['content']` as is."
            )
        ids = self.tokenizer(text.split(_SENTINEL, 1)[1], add_special_tokens=False)["input_ids"]
        # An action that ended on the end-of-turn token already holds it.
        if output_ids and ids and output_ids[-1] == ids[0] and ids[0] in self.eos_token_ids:
            ids = ids[1:]
        return ids

    # ----- acting ---------------------------------------------------------------------------------------------------
    def action_text(self, output_ids: list[int], stop_strings: Sequence[str]) -> str:
        """
        The action text an environment receives for generated ids: decoded without special tokens and cut right
        after the first stop string it holds.

        Args:
            output_ids (`list[int]`): the generated ids of one model call (`Invocation.output_ids`).
            stop_strings (`Sequence[str]`): the environment's stop strings (`env.stop_strings`).

        Returns:
            `str`: the text handed to `env.step`.
        """
        text = self.tokenizer.decode(output_ids, skip_special_tokens=True)
        ends = [text.index(s) + len(s) for s in stop_strings if s in text]
        return text[: min(ends)] if ends else text

    def _play_action(self, state: _LiveEpisode, prompt_ids: list[int], action: GeneratedAction, stats: dict) -> None:
        episode = state.episode
        invocation = Invocation(
            input_ids=prompt_ids,
            output_ids=action.output_ids,
            logprobs=action.logprobs,
            episode_id=episode.episode_id,
            turn=len(episode.invocations),
            truncated=action.truncated,
            group_id=episode.group_id,
        )
        episode.invocations.append(invocation)
        stats["num_turns"] += 1
        stats["num_prompt_tokens"] += len(prompt_ids)
        stats["num_generated_tokens"] += len(action.output_ids)
        stats["num_truncated_outputs"] += int(action.truncated)
        try:
            result = state.env.step(self.action_text(action.output_ids, state.env.stop_strings))
        except EnvContractError:  # a bug in the environment's code, the same for every episode: stop with it
            raise
        except Exception as err:  # a failing environment must not stop the other episodes
            self._fail(state, "env_error", stats, f"env.step raised {type(err).__name__}: {err}")
            return
        if result.done or state.env.done:
            self._close(state, failed=False, reason=getattr(state.env, "end_reason", None) or "done")
            return
        try:
            invocation.observation_ids = self._observation_ids(action.output_ids, result.observation)
        except Exception as err:  # an observation the tokenizer cannot encode must not stop the other episodes
            self._fail(state, "env_error", stats, f"encoding the observation raised {type(err).__name__}: {err}")

    def _close(self, state: _LiveEpisode, failed: bool, reason: str) -> None:
        env, episode = state.env, state.episode
        state.closed = True
        if episode.invocations:
            episode.invocations[-1].observation_ids = None
        episode.failed = failed
        episode.num_turns = len(episode.invocations)
        episode.num_malformed = int(getattr(env, "num_malformed", 0) or 0)
        episode.info.update(state.info)
        episode.info["end_reason"] = reason
        episode.info["context_truncations"] = state.context_truncations
        for name in ("num_memory_cuts", "num_retriever_errors"):
            if hasattr(env, name):
                episode.info[name] = getattr(env, name)
        metrics = _final_metrics(env)
        if failed:
            episode.answer, episode.reward, episode.metrics = None, 0.0, dict.fromkeys(metrics, 0.0)
        else:
            episode.answer = getattr(env, "answer", None)
            episode.reward = float(getattr(env, "reward", 0.0))
            episode.metrics = metrics

    def _fail(self, state: _LiveEpisode, reason: str, stats: dict, message: str) -> None:
        episode = state.episode
        logger.warning(
            "Episode %d (record %r, turn %d) failed: %s.",
            episode.episode_id,
            episode.record_id,
            len(episode.invocations),
            message,
        )
        state.info["error"] = message
        stats["num_failed_episodes"] += 1
        stats["num_prompt_too_long" if reason == "prompt_too_long" else "num_env_errors"] += 1
        self._close(state, failed=True, reason=reason)

    # ----- generation -----------------------------------------------------------------------------------------------
    def generate(
        self, batch_prompt_ids: list[list[int]], stop_strings: list[tuple[str, ...]], greedy: bool = False
    ) -> list[GeneratedAction]:
        """
        Generate one action per context with this engine's model and settings, `generation_batch_size` contexts per
        backend call. [`~RolloutEngine.rollout`] calls it once per turn; a subclass may override it to generate the
        actions otherwise (another model for some turns, a scripted policy).

        Args:
            batch_prompt_ids (`list[list[int]]`): the unpadded contexts, e.g. from [`~RolloutEngine.prompt_ids`].
            stop_strings (`list[tuple[str, ...]]`): the stop strings of each context.
            greedy (`bool`, *optional*, defaults to `False`): greedy decoding instead of sampling.

        Returns:
            `list[GeneratedAction]`: one per context, in order, each cut right after its stop string or EOS; its
            log-probs are `log_softmax(logits / temperature)` of this engine's model at the sampled tokens.
        """
        size = self.generation_batch_size or len(batch_prompt_ids)
        actions: list[GeneratedAction] = []
        for start in range(0, len(batch_prompt_ids), size):
            chunk = slice(start, start + size)
            actions += self._generate(batch_prompt_ids[chunk], stop_strings[chunk], greedy)
        return actions

    def _generate(
        self, batch_prompt_ids: list[list[int]], stop_strings: list[tuple[str, ...]], greedy: bool = False
    ) -> list[GeneratedAction]:
        """
        Generate one action per context with the configured backend, each cut right after its stop.

        Args:
            batch_prompt_ids (`list[list[int]]`): the unpadded contexts.
            stop_strings (`list[tuple[str, ...]]`): the stop strings of each context.
            greedy (`bool`, *optional*, defaults to `False`): greedy decoding instead of sampling.

        Returns:
            `list[GeneratedAction]`: one `(output_ids, logprobs, truncated)` per context, in order.
        """
        if self._vllm is not None:
            raw = self._vllm.generate(batch_prompt_ids, stop_strings, greedy)
        else:
            raw = self._hf_generate(batch_prompt_ids, stop_strings, greedy)
        return [self._cut(ids, logprobs, stops) for (ids, logprobs), stops in zip(raw, stop_strings, strict=True)]

    def _cut(self, ids: list[int], logprobs: list[float], stop_strings: Sequence[str]) -> GeneratedAction:
        """Cuts a raw generation right after its first stop string or EOS; without either it was truncated."""
        ends = [k for k in (find_stop(self.tokenizer, ids, stop_strings),) if k is not None]
        ends += [i + 1 for i, token in enumerate(ids) if token in self.eos_token_ids][:1]
        if ends:
            end = min(ends)
            return GeneratedAction(list(ids[:end]), list(logprobs[:end]), False)
        return GeneratedAction(list(ids), list(logprobs), len(ids) >= self.max_new_tokens)

    def _generation_config(self, greedy: bool) -> GenerationConfig:
        # Every field that would change the sampling distribution is set explicitly, so that values from the model's
        # own `generation_config` (a repetition penalty, a default top-k) cannot leak in.
        sampling = {} if greedy else {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}
        return GenerationConfig(
            max_new_tokens=self.max_new_tokens,
            do_sample=not greedy,
            num_beams=1,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            typical_p=1.0,
            min_length=0,
            pad_token_id=self.pad_token_id,
            eos_token_id=list(self.eos_token_ids),
            use_cache=True,
            return_dict_in_generate=True,
            **sampling,
        )

    @torch.no_grad()
    def _hf_generate(
        self, batch_prompt_ids: list[list[int]], stop_strings: list[tuple[str, ...]], greedy: bool
    ) -> list[tuple[list[int], list[float]]]:
        model = self.model
        device = model.device
        width = max(len(ids) for ids in batch_prompt_ids)
        input_ids = torch.full((len(batch_prompt_ids), width), self.pad_token_id, dtype=torch.long)  # (batch, width)
        attention_mask = torch.zeros_like(input_ids)  # (batch, width)
        for row, ids in enumerate(batch_prompt_ids):
            input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, width - len(ids) :] = 1
        # Left padding: each context's real tokens get positions 0..len-1, as when it is scored alone later.
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (batch, width)

        recorder = _SampledLogprobRecorder(self.temperature)
        kwargs = dict(self.generation_kwargs)
        logits_processor = LogitsProcessorList([recorder, *kwargs.pop("logits_processor", [])])
        stopping_criteria = StoppingCriteriaList(
            [_StopOnText(self.tokenizer, stop_strings, width), *kwargs.pop("stopping_criteria", [])]
        )
        was_training = model.training
        model.eval()
        try:
            if self.share_prefix and "cache" not in kwargs and "past_key_values" not in kwargs:
                try:
                    cache = self._prefill_repeated_contexts(
                        input_ids.to(device), attention_mask.to(device), position_ids.to(device)
                    )
                except TypeError as error:  # a forward without transformers' `cache` / `logits_to_keep` arguments
                    warnings.warn(
                        f"share_prefix (shared prompt prefill) is turned off: the model's forward does not take a KV cache as "
                        f"transformers' models do ({error}); every context is encoded on its own.",
                        stacklevel=2,
                    )
                    self.share_prefix, cache = False, None
                if cache is not None:
                    kwargs[_cache_keyword(model)] = cache
            out = model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                position_ids=position_ids.to(device),
                generation_config=self._generation_config(greedy),
                logits_processor=logits_processor,
                stopping_criteria=stopping_criteria,
                **kwargs,
            )
        finally:
            model.train(was_training)
        sequences = out.sequences[:, width:]  # (batch, num_generated)
        logprobs = recorder.finish(sequences[:, -1])  # (batch, num_generated)
        return list(zip(sequences.tolist(), logprobs.tolist(), strict=True))

    @torch.no_grad()
    def _prefill_repeated_contexts(
        self, input_ids: torch.LongTensor, attention_mask: torch.LongTensor, position_ids: torch.LongTensor
    ) -> DynamicCache | None:
        """
        Encodes each distinct context of a left-padded batch once and returns a KV cache for the whole batch.

        Identical contexts are identical rows (same tokens, same left padding). Every distinct row but its last token
        is run through the model once; the cache is then indexed so that each row gets its twin's keys and values,
        and `generate` only encodes the last token of every row before it samples. Returns `None` (nothing to
        share) when every row is distinct or the rows are one token wide.

        Args:
            input_ids (`torch.LongTensor` of shape `(batch_size, width)`): the left-padded contexts.
            attention_mask (`torch.LongTensor` of shape `(batch_size, width)`): 1 on real tokens.
            position_ids (`torch.LongTensor` of shape `(batch_size, width)`): 0.. over each row's real tokens.

        Returns:
            `DynamicCache` or `None`: keys and values of the first `width - 1` columns, `batch_size` rows.
        """
        if input_ids.shape[1] < 2:
            return None
        distinct, inverse = torch.unique(input_ids, dim=0, return_inverse=True)  # (num_distinct, width), (batch_size,)
        if len(distinct) == len(input_ids):
            return None
        # One representative row per distinct context (its mask and positions are its twins').
        first = torch.full((len(distinct),), len(input_ids), dtype=torch.long, device=input_ids.device)
        first = first.scatter_reduce(0, inverse, torch.arange(len(input_ids), device=input_ids.device), "amin")
        cache = DynamicCache(config=self.model.config)
        self.model(
            input_ids=input_ids[first, :-1],
            attention_mask=attention_mask[first, :-1],
            position_ids=position_ids[first, :-1],
            use_cache=True,
            logits_to_keep=1,
            **{_cache_keyword(self.model): cache},
        )
        cache.batch_select_indices(inverse)  # (batch_size, ...) per layer: every row its twin's keys and values
        saved = attention_mask[:, :-1].sum() - attention_mask[first, :-1].sum()
        self._shared_prefill_tokens += int(saved)
        return cache
