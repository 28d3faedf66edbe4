"""
The teacher of a `MemOPDTrainer`: what turns recorded invocations into teacher scores.

- `Teacher` is what the trainer asks of any teacher: `score` recorded actions, and say whether it `can_play` episodes
  of its own (`MemOPDConfig.teacher_generations`); one that can is a `PlayingTeacher` and has `play`.
- `LocalTeacher` is a model loaded in every training process (a whole copy, or sharded as the student is under FSDP2 /
  ZeRO-3). It scores packed rows of invocations and gives its final hidden state at each action position with its LM
  head (`TeacherScores`): full-vocabulary supervision, applied chunk by chunk in the losses. Restricted to its top-k
  (`top_k`), it gives what a server gives.
- `ServerTeacher` is a vLLM OpenAI-compatible server on its own machine (`MemOPDConfig.teacher_model_server_url`),
  never loaded in a training process. It is sent every recorded invocation as its own token ids (context, then
  action), or each episode's flattened history for the persistent control, and answers with its top-k log-probs and
  the sampled token's at every action position (`TopKTeacherScores`).
"""

import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import requests
import torch
from accelerate import Accelerator
from accelerate.utils import send_to_device
from torch import nn
from trl.models.utils import unwrap_model_for_generation

from .losses import topk_logprobs
from .packing import PackedInvocationCollator, rebuilt_sequences
from .records import Episode, Invocation
from .rollout import RolloutEngine
from .scoring import gathered_lm_head, rows_action_hidden_states, sampled_token_logprobs
from .sharding import forward_rows, gathered_for_generation
from .step import TeacherScores, TopKTeacherScores
from .validation import max_model_length


logger = logging.getLogger(__name__)


@runtime_checkable
class Teacher(Protocol):
    """
    What a `MemOPDTrainer` asks of a teacher: the scores of recorded actions, and whether it can play episodes of its
    own (`can_play`; a teacher that can is a [`PlayingTeacher`]).
    """

    can_play: bool

    def score(
        self,
        invocations: list[Invocation],
        history: str = "aligned",
        rows: list[dict[str, Any]] | None = None,
        action_ids: torch.Tensor | None = None,
    ) -> TeacherScores | TopKTeacherScores:
        """The teacher's scores of every action of `invocations`, `(N, ...)` in canonical order, in the layout
        `history` names (`"aligned"` or `"persistent"`)."""
        ...


@runtime_checkable
class PlayingTeacher(Teacher, Protocol):
    """A [`Teacher`] that plays episodes too (`MemOPDConfig.teacher_generations`): its weights are in this process."""

    def play(self, records: list[dict[str, Any]], num_generations: int) -> list[Episode]:
        """`num_generations` sampled episodes per record. Collective when sharded."""
        ...


@dataclass
class LocalTeacher:
    """
    A teacher model in the training process, scoring the student's recorded invocations (a [`Teacher`]; a
    [`PlayingTeacher`] when given an `engine`).

    Args:
        model (`nn.Module`):
            The teacher, prepared for this process (`sharding.prepare_frozen_model`); frozen.
        accelerator (`Accelerator`):
            The trainer's accelerator.
        collators (`dict[str, PackedInvocationCollator]`):
            The teacher's packing of invocations by layout: `"aligned"` (each in the state it was sampled in), and
            `"persistent"` (each episode flattened into one growing history) where that layout is scored.
        pad_token_id (`int`):
            The padding token of the shared tokenizer (the packed rows are forwarded one at a time,
            `sharding.forward_rows`).
        vocab_size (`int`):
            The shared tokenizer's vocabulary size.
        temperature (`float`):
            The sampling temperature, at which `sampled_logprobs` are taken.
        chunk_size (`int`):
            Action tokens per chunk when the LM head is applied.
        engine (`RolloutEngine`, *optional*):
            The engine the teacher plays its own episodes with (`play`), built on the teacher's unwrapped model;
            without it the teacher cannot play (`can_play` is `False`).
        top_k (`int`, *optional*, defaults to `0`):
            When > 0, `score` gives only the teacher's `top_k` most likely tokens at each action position, at
            `distill_temperature` (`TopKTeacherScores`), as a teacher server would: `MemOPDConfig.loss_top_k`.
        distill_temperature (`float`, *optional*, defaults to `1.0`):
            The temperature of those top-k log-probs.
    """

    model: nn.Module
    accelerator: Accelerator
    collators: dict[str, PackedInvocationCollator]
    pad_token_id: int
    vocab_size: int
    temperature: float
    chunk_size: int
    engine: RolloutEngine | None = None
    top_k: int = 0
    distill_temperature: float = 1.0
    unwrapped: nn.Module = field(init=False)  # what its forwards and its LM head are read from

    def __post_init__(self):
        self.unwrapped = self.accelerator.unwrap_model(self.model)

    @property
    def can_play(self) -> bool:
        """Whether it plays episodes of its own: it was given an engine."""
        return self.engine is not None

    @property
    def max_model_length(self) -> int | None:
        """The longest sequence the teacher takes."""
        return next(iter(self.collators.values())).max_model_length

    def score(
        self,
        invocations: list[Invocation],
        history: str = "aligned",
        rows: list[dict[str, Any]] | None = None,
        action_ids: torch.Tensor | None = None,
    ) -> TeacherScores | TopKTeacherScores:
        """
        The teacher's scores of every action of `invocations`, `(N, ...)` in canonical order (its top-k only when
        `top_k` is set). Collective with sharded weights.

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
            packed = send_to_device(self.collators[history](invocations), self.accelerator.device)
            rows = forward_rows(packed, self.accelerator, self.pad_token_id)
        with torch.no_grad():
            hidden = rows_action_hidden_states(self.unwrapped, rows)  # (N, H_teacher)
            scores = TeacherScores(hidden, self.unwrapped, self.vocab_size)
            if action_ids is not None:
                # The teacher's log-prob of each sampled token at the sampling temperature, as the rollout's.
                scores.sampled_logprobs = sampled_token_logprobs(
                    self.unwrapped, hidden, action_ids, self.vocab_size, self.temperature, self.chunk_size
                )  # (N,)
            if self.top_k:
                with gathered_lm_head(self.unwrapped, self.vocab_size) as (weight, bias):
                    logprobs, token_ids = topk_logprobs(
                        hidden, weight, bias, self.top_k, self.distill_temperature, self.chunk_size
                    )  # (N, k) each
                return TopKTeacherScores(logprobs, token_ids, scores.sampled_logprobs)
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
            with self.engine.decoding_with(teacher):
                episodes, _ = self.engine.rollout(records, num_generations=num_generations, greedy=False)
        return episodes


class TeacherServerError(RuntimeError):
    """A teacher server that cannot be used: it does not answer, serves another vocabulary, or answers wrongly."""


# A string whose ids the server's tokenizer must give exactly as the student's does (words, digits, a code point
# outside ASCII, the chat markup's characters, spaces and a newline).
_PROBE = "Memory: the 1987 Lunar Orbiter <answer>Tyrannosaurus</answer>\n  café 東京 ✓"


@dataclass
class ServerTeacher:
    """
    A teacher served by vLLM's OpenAI-compatible server (`vllm serve TEACHER --max-logprobs K`), scoring the student's
    recorded invocations in the exact states they were sampled in: a [`Teacher`] that cannot play (`can_play` is
    `False`: its weights are not in this process).

    Each invocation is sent as its own token ids, context then action (`history="aligned"`), or each episode's
    flattened history (`"persistent"`), to `/v1/completions` with `prompt_logprobs=top_k` and `max_tokens=1`: the
    request TRL's `VLLMClient.get_sequence_logprobs` sends. The answer holds, at every prompt position, the teacher's
    top-k log-probs and the prompt token's own (the sampled token's, at an action position). vLLM reads no prefix
    cache for requests with prompt log-probs, so the prompts a group's episodes share are computed for each of them
    (docs/benchmarks.md, "A teacher on its own server").

    This client is the project's own rather than TRL's `VLLMClient`: that one refuses to start in a process without
    vLLM installed, which a training process with its teacher on another machine does not need; the requests and
    their reading are the same.

    Construction checks the server before any rollout: that it answers, that its tokenizer gives the student's ids for
    a probe string and has the student's vocabulary size, and that it returns `top_k` log-probs. Any failure raises
    `TeacherServerError` naming the URL. A request that fails later (connection, timeout, 5xx) is retried
    `max_retries` times with exponential backoff, then raises `TeacherServerError` naming the URL and the attempts;
    an answer with missing positions, the wrong length, or a non-finite log-prob raises it too.

    Args:
        url (`str`): the server's base URL, e.g. `http://127.0.0.1:8000`.
        tokenizer (`PreTrainedTokenizerBase`): the student's tokenizer.
        top_k (`int`): log-probs per position (at most the server's `--max-logprobs`).
        device (`torch.device`): where the scores are put.
        timeout (`float`, *optional*, defaults to `300.0`): seconds one request may take.
        max_retries (`int`, *optional*, defaults to `3`): retries of a failed request.
        backoff (`float`, *optional*, defaults to `1.0`): seconds before the first retry, doubled at each.
        sequences_per_request (`int`, *optional*, defaults to `16`): sequences in one request.
        max_concurrent_requests (`int`, *optional*, defaults to `4`): requests in flight at once.
    """

    url: str
    tokenizer: Any
    top_k: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    timeout: float = 300.0
    max_retries: int = 3
    backoff: float = 1.0
    sequences_per_request: int = 16
    max_concurrent_requests: int = 4
    can_play = False  # its weights are on the server: it scores, and plays no episode here
    model_name: str = field(init=False)
    max_model_length: int | None = field(init=False, default=None)
    vocab_size: int = field(init=False)

    def __post_init__(self):
        self.url = self.url.strip().rstrip("/")
        if self.top_k < 1:
            raise ValueError(f"A teacher server gives its top-k log-probs: `top_k` must be >= 1, got {self.top_k}.")
        self.vocab_size = len(self.tokenizer)
        self.session = requests.Session()
        self._connect()

    # -- requests ------------------------------------------------------------------------------------------------------

    def _request(self, method: str, path: str, payload: dict | None = None, attempts: int | None = None) -> dict:
        """One request, retried on connection errors, timeouts and 5xx answers with exponential backoff."""
        attempts = self.max_retries + 1 if attempts is None else attempts
        last = None
        for attempt in range(attempts):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                response = self.session.request(method, self.url + path, json=payload, timeout=self.timeout)
            except requests.RequestException as error:  # refused, reset, timed out
                last = f"{type(error).__name__}: {error}"
                continue
            if response.status_code >= 500:
                last = f"HTTP {response.status_code}: {response.text[:300]}"
                continue
            if response.status_code != 200:  # the request itself is wrong: another try gives the same answer
                raise TeacherServerError(
                    f"The teacher server at {self.url} refused {method} {path} (HTTP {response.status_code}): "
                    f"{response.text[:500]}"
                )
            try:
                return response.json()
            except ValueError:
                last = f"an answer that is not JSON: {response.text[:200]!r}"
        raise TeacherServerError(
            f"The teacher server at {self.url} failed {method} {path} after {attempts} attempt(s); last error: {last}"
        )

    def _connect(self) -> None:
        """Checks the server before any rollout (see the class docstring)."""
        try:
            models = self._request("GET", "/v1/models", attempts=1)
            self.model_name = models["data"][0]["id"]
        except (TeacherServerError, KeyError, IndexError, TypeError) as error:
            raise TeacherServerError(
                f"No teacher server answers at {self.url} ({error}). Start one (`vllm serve TEACHER --max-logprobs "
                f"{self.top_k}`, see docs/quickstart.md) or fix `teacher_model_server_url`."
            ) from None
        self.max_model_length = models["data"][0].get("max_model_len")
        ours = self.tokenizer(_PROBE, add_special_tokens=False)["input_ids"]
        theirs = self._request(
            "POST", "/tokenize", {"model": self.model_name, "prompt": _PROBE, "add_special_tokens": False}
        )
        if theirs.get("tokens") != ours:
            raise TeacherServerError(
                f"The teacher server at {self.url} ({self.model_name}) tokenizes differently from the student: "
                f"{_PROBE!r} is {theirs.get('tokens')} there and {ours} here. The teacher must share the student's "
                "tokenizer (its scores are read at the student's token ids)."
            )
        # The vocabulary size: the server decodes the student's last id as the student does, and nothing past it.
        last = self.vocab_size - 1
        decoded = self._request("POST", "/detokenize", {"model": self.model_name, "tokens": [last]}).get("prompt")
        if decoded != self.tokenizer.decode([last]) or self._decodes(self.vocab_size):
            raise TeacherServerError(
                f"The teacher server at {self.url} ({self.model_name}) has another vocabulary than the student's "
                f"{self.vocab_size} tokens (id {last} decodes to {decoded!r} there, to "
                f"{self.tokenizer.decode([last])!r} here; or id {self.vocab_size} exists there)."
            )
        # The scoring request works, with `top_k` log-probs: the probe's tokens after its first, as if an action.
        self._score_sequences([(ours, [-1, *range(len(ours) - 1)])], len(ours) - 1)

    def _decodes(self, token_id: int) -> bool:
        """Whether the server's tokenizer knows `token_id` (vLLM decodes an unknown id to nothing, or refuses it)."""
        try:
            answer = self._request("POST", "/detokenize", {"model": self.model_name, "tokens": [token_id]}, attempts=1)
        except TeacherServerError:
            return False
        return bool(answer.get("prompt"))

    # -- scoring -------------------------------------------------------------------------------------------------------

    def _read(self, choice: dict, token_ids: list[int], targets: list[int], where: str, out: tuple) -> None:
        """Reads one sequence's answer into `out` = (logprobs (N, k), token ids (N, k), sampled (N,)) at `targets`."""
        logprobs, top_ids, sampled = out
        positions = choice.get("prompt_logprobs") if isinstance(choice, dict) else None
        if not isinstance(positions, list) or len(positions) != len(token_ids):
            found = "none" if not isinstance(positions, list) else len(positions)
            raise TeacherServerError(
                f"The teacher server at {self.url} answered {where} with {found} prompt positions for "
                f"{len(token_ids)} tokens sent."
            )
        for p, target in enumerate(targets):
            if target < 0:
                continue
            entry = positions[p]
            token = str(token_ids[p])
            if not isinstance(entry, dict) or token not in entry:
                raise TeacherServerError(
                    f"The teacher server at {self.url} gave no log-prob for the sampled token at position {p} of "
                    f"{where} (token {token_ids[p]})."
                )
            ranked = sorted(
                (
                    (item["rank"], int(tid), float(item["logprob"]))
                    for tid, item in entry.items()
                    if item["rank"] <= self.top_k
                )
            )
            values = [value for _, _, value in ranked] + [float(entry[token]["logprob"])]
            if len(ranked) != self.top_k or not all(math.isfinite(value) for value in values):
                raise TeacherServerError(
                    f"The teacher server at {self.url} answered position {p} of {where} with {len(ranked)} top "
                    f"log-probs (expected {self.top_k}) or a non-finite one: {values[:8]}."
                )
            if any(tid >= self.vocab_size for _, tid, _ in ranked):
                raise TeacherServerError(
                    f"The teacher server at {self.url} ranked a token id >= the student's vocabulary size "
                    f"({self.vocab_size}) at position {p} of {where}."
                )
            logprobs[target] = torch.tensor([value for _, _, value in ranked])
            top_ids[target] = torch.tensor([tid for _, tid, _ in ranked])
            sampled[target] = values[-1]

    def _score_sequences(self, sequences: list[tuple[list[int], list[int]]], num_actions: int) -> TopKTeacherScores:
        """The teacher's scores of the action tokens of `sequences` (each: token ids, canonical action index)."""
        out = (
            torch.full((num_actions, self.top_k), float("-inf")),
            torch.zeros(num_actions, self.top_k, dtype=torch.long),
            torch.full((num_actions,), float("nan")),
        )
        chunks = [
            list(range(start, min(start + self.sequences_per_request, len(sequences))))
            for start in range(0, len(sequences), self.sequences_per_request)
        ]

        def send(chunk: list[int]) -> None:
            payload = {
                "model": self.model_name,
                "prompt": [sequences[i][0] for i in chunk],
                "max_tokens": 1,
                "temperature": 1.0,
                "prompt_logprobs": self.top_k,
            }
            choices = self._request("POST", "/v1/completions", payload).get("choices")
            if not isinstance(choices, list) or len(choices) != len(chunk):
                raise TeacherServerError(
                    f"The teacher server at {self.url} answered {len(choices) if isinstance(choices, list) else 'no'} "
                    f"choices for {len(chunk)} sequences sent."
                )
            for i, choice in zip(chunk, choices, strict=True):  # one choice per prompt, in order
                self._read(choice, *sequences[i], f"sequence {i}", out)

        with ThreadPoolExecutor(max_workers=max(1, min(self.max_concurrent_requests, len(chunks)))) as pool:
            list(pool.map(send, chunks))  # re-raises the first failure
        missing = torch.isnan(out[2])
        if missing.any():
            raise TeacherServerError(
                f"The teacher server at {self.url} left {int(missing.sum())} of {num_actions} action tokens unscored."
            )
        return TopKTeacherScores(*(tensor.to(self.device) for tensor in out))

    def score(
        self,
        invocations: list[Invocation],
        history: str = "aligned",
        rows: list[dict[str, Any]] | None = None,
        action_ids: torch.Tensor | None = None,
    ) -> TopKTeacherScores:
        """
        The teacher's top-k log-probs and sampled-token log-prob at every action token of `invocations`, `(N, ...)`
        in canonical order (`rows` and `action_ids` are a local teacher's and not needed: the server reads the
        sampled tokens from the sequences it is sent).
        """
        sequences = rebuilt_sequences(invocations, history, self.max_model_length)
        num_actions = sum(len(inv.output_ids) for inv in invocations)
        return self._score_sequences(sequences, num_actions)


def build_teacher(
    args,
    teacher_model: nn.Module | None,
    accelerator: Accelerator,
    processing_class,
    packing: dict[str, Any],
    generation: dict[str, Any],
    audited: bool = False,
) -> Teacher | None:
    """
    The teacher a `MemOPDTrainer` with `args` (a `MemOPDConfig`) scores with: a `ServerTeacher` at
    `args.teacher_model_server_url` (checked now, before any rollout), or a `LocalTeacher` on `teacher_model`
    (prepared for this process) with the packing of each layout it scores (`args.teacher_scoring`, and the persistent
    history too when `audited`, the live alignment audit) and, with `args.teacher_generations > 0`, an engine to play
    with (`generation`: the `RolloutEngine` settings of the student's). `None` without a teacher.
    """
    if args.teacher_model_server_url is not None:
        teacher = ServerTeacher(
            args.teacher_model_server_url,
            processing_class,
            args.loss_top_k,
            device=accelerator.device,
            timeout=args.teacher_server_timeout,
            max_retries=args.teacher_server_max_retries,
        )
    elif teacher_model is not None:
        unwrapped = accelerator.unwrap_model(teacher_model)
        length = max_model_length(unwrapped)
        layouts = {args.teacher_scoring} | ({"persistent"} if audited else set())
        collators = {name: PackedInvocationCollator(max_model_length=length, history=name, **packing) for name in layouts}
        engine = RolloutEngine(model=unwrapped, **generation) if args.teacher_generations > 0 else None
        teacher = LocalTeacher(
            teacher_model,
            accelerator,
            collators,
            packing["pad_token_id"],
            len(processing_class),
            args.temperature,
            args.logit_chunk_size,
            engine=engine,
            top_k=args.loss_top_k,
            distill_temperature=args.distill_temperature,
        )
    else:
        return None
    if args.teacher_generations > 0 and not teacher.can_play:
        raise ValueError(
            f"`teacher_generations` ({args.teacher_generations}) asks the teacher to play episodes, but a "
            f"{type(teacher).__name__} cannot play: set `teacher_generations=0`."
        )
    return teacher
