"""The rollout hook: a memory agent's environment, its action grammar and its memory policies.

An episode is a dialogue between a model and an environment. At every turn the model writes its updated memory and
exactly one action::

    free thinking (ignored) <memory>what I know so far</memory> <search>a query</search>
    free thinking (ignored) <memory>what I know so far</memory> <answer>the answer</answer>

and a search comes back as ``<information>...</information>``. The tag names are configuration
(:class:`ActionFormat`), so a model trained in another format (for example MEM1's, whose memory lives in
``<think>...</think>``) can act in the format it knows.

What the *next* model call sees is decided by a :class:`MemoryPolicy`: ``compact`` (the MemOPD / MEM1 setting: the
task, the latest memory and action, the latest observation) or ``full_history`` (every turn so far, the baseline whose
context grows). Environments speak text and chat messages; they never tokenize.
"""

import functools
import numbers
import re
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple


@dataclass(frozen=True)
class ActionFormat:
    """
    Tag names of the action grammar.

    Parameters:
        memory_tag (`str`, *optional*, defaults to `"memory"`):
            Tag holding the rewritten memory; it must come before the action.
        search_tag (`str`, *optional*, defaults to `"search"`):
            Tag of a search action; its content is the query.
        answer_tag (`str`, *optional*, defaults to `"answer"`):
            Tag of the final answer.
        information_tag (`str`, *optional*, defaults to `"information"`):
            Tag wrapping search results in observations.
        require_memory (`bool`, *optional*, defaults to `True`):
            Whether an action without a memory block is malformed.

    Example:

    ```python
    >>> from memopd_trl import ActionFormat
    >>> ActionFormat.preset("mem1").memory_tag
    'think'
    ```
    """

    memory_tag: str = "memory"
    search_tag: str = "search"
    answer_tag: str = "answer"
    information_tag: str = "information"
    require_memory: bool = True

    def __post_init__(self):
        tags = (self.memory_tag, self.search_tag, self.answer_tag, self.information_tag)
        for tag in tags:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_\-]*", tag):
                raise ValueError(f"Tag names must be simple identifiers like 'memory', got {tag!r}.")
        if len(set(tags)) != len(tags):
            raise ValueError(f"Tag names must be distinct, got {tags}.")

    @classmethod
    def preset(cls, name: str) -> "ActionFormat":
        """
        A named tag set: `"memopd"` (`<memory>`, `<search>`, `<answer>`, `<information>`) or `"mem1"` (memory in
        `<think>`, as the released MEM1 checkpoints were trained).

        Returns:
            `ActionFormat`: the preset.
        """
        if name not in ACTION_FORMAT_PRESETS:
            raise ValueError(f"Unknown action format {name!r}; choose one of {sorted(ACTION_FORMAT_PRESETS)}.")
        return ACTION_FORMAT_PRESETS[name]

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """Strings that end a generation: the closing tags of the two actions."""
        return (f"</{self.search_tag}>", f"</{self.answer_tag}>")

    @property
    def special_tokens(self) -> list[str]:
        """Every opening and closing tag, e.g. to add them to a tokenizer as single tokens."""
        tags = (self.memory_tag, self.search_tag, self.answer_tag, self.information_tag)
        return [t for tag in tags for t in (f"<{tag}>", f"</{tag}>")]

    def wrap(self, tag: str, text: str) -> str:
        """Returns `<tag>text</tag>`."""
        return f"<{tag}>{text}</{tag}>"

    def render_action(self, memory: str | None, kind: str, argument: str) -> str:
        """
        Render a well-formed action.

        Args:
            memory (`str` or `None`): memory text, or `None` for no memory block.
            kind (`str`): `"search"` or `"answer"`.
            argument (`str`): the query or the answer.

        Returns:
            `str`: e.g. `<memory>...</memory><search>...</search>`.
        """
        if kind not in ("search", "answer"):
            raise ValueError(f"`kind` must be 'search' or 'answer', got {kind!r}.")
        tag = self.search_tag if kind == "search" else self.answer_tag
        head = "" if memory is None else self.wrap(self.memory_tag, memory)
        return head + self.wrap(tag, argument)

    def describe(self) -> str:
        """A short instruction stating the expected format, used in system prompts and format-error observations."""
        m, s, a = self.memory_tag, self.search_tag, self.answer_tag
        return (
            f"Write your updated memory inside <{m}>...</{m}>, then exactly one action: "
            f"<{s}>query</{s}> to search, or <{a}>final answer</{a}> to answer. "
            f"Search results come back inside <{self.information_tag}>...</{self.information_tag}>."
        )


ACTION_FORMAT_PRESETS = {"memopd": ActionFormat(), "mem1": ActionFormat(memory_tag="think")}


@dataclass
class ParsedAction:
    """
    An agent turn parsed against an :class:`ActionFormat`.

    Parameters:
        kind (`str`): `"search"`, `"answer"` or `"malformed"`.
        memory (`str` or `None`): the memory block's content (stripped), `None` when absent.
        argument (`str`): the query or answer (stripped); empty when malformed.
        error (`str` or `None`): why the action is malformed, `None` otherwise.
    """

    kind: Literal["search", "answer", "malformed"]
    memory: str | None = None
    argument: str = ""
    error: str | None = None


class _Block(NamedTuple):
    start: int  # index of the opening tag
    end: int  # index just after the closing tag
    content: str


def _blocks(text: str, tag: str) -> tuple[list[_Block], int, int]:
    """
    The `<tag>...</tag>` blocks of `text` (each opening tag matched with the next closing tag), in linear time: a
    regular expression search retries from every unclosed opening tag, which takes seconds on degenerate generations
    such as `"<memory>" * 10_000`.

    Returns:
        `tuple[list[_Block], int, int]`: the blocks, the number of opening tags and the number of closing tags.
    """
    opening, closing = f"<{tag}>", f"</{tag}>"
    blocks: list[_Block] = []
    position = 0
    while (start := text.find(opening, position)) != -1:
        stop = text.find(closing, start + len(opening))
        if stop == -1:  # no later opening tag can be closed either
            break
        blocks.append(_Block(start, stop + len(closing), text[start + len(opening) : stop]))
        position = stop + len(closing)
    return blocks, text.count(opening), text.count(closing)


def parse_action(text: str, action_format: ActionFormat) -> ParsedAction:
    """
    Parse one agent turn. Never raises on agent text.

    Rules: text outside the tags is ignored; every tag must be closed; at most one memory block, which must end before
    the action starts; exactly one action block (search or answer) with non-empty content; a missing memory block is
    malformed when `action_format.require_memory`.

    Returns:
        `ParsedAction`: the parsed action, or one of kind `"malformed"` whose `error` says what was wrong.
    """
    if not isinstance(text, str):
        return ParsedAction("malformed", error=f"the action must be text, got {type(text).__name__}")
    fmt = action_format
    for tag in (fmt.memory_tag, fmt.search_tag, fmt.answer_tag):
        matches, opens, closes = _blocks(text, tag)
        if opens != closes or len(matches) != opens:
            return ParsedAction("malformed", error=f"unclosed or unbalanced <{tag}> tag")
    memories, _, _ = _blocks(text, fmt.memory_tag)
    searches, _, _ = _blocks(text, fmt.search_tag)
    answers, _, _ = _blocks(text, fmt.answer_tag)
    if len(memories) > 1:
        return ParsedAction("malformed", error=f"more than one <{fmt.memory_tag}> block")
    actions = searches + answers
    if not actions:
        return ParsedAction("malformed", error=f"no <{fmt.search_tag}> or <{fmt.answer_tag}> action")
    if len(actions) > 1:
        return ParsedAction("malformed", error="more than one action; write exactly one")
    action = actions[0]
    memory = memories[0].content.strip() if memories else None
    if memories and memories[0].end > action.start:
        return ParsedAction("malformed", error=f"the <{fmt.memory_tag}> block must come before the action")
    if memory is None and fmt.require_memory:
        return ParsedAction("malformed", error=f"missing <{fmt.memory_tag}> block")
    kind = "search" if searches else "answer"
    argument = action.content.strip()
    if not argument:
        tag = fmt.search_tag if searches else fmt.answer_tag
        return ParsedAction("malformed", memory=memory, error=f"empty <{tag}> block")
    return ParsedAction(kind, memory=memory, argument=argument)


@dataclass
class Turn:
    """
    One played turn, as the memory policies see it.

    Parameters:
        action_text (`str`): the assistant message kept for later contexts (canonical rendering of a valid action, or
            the raw text, cut to the memory budget, of a malformed one).
        observation (`str`): what the environment answered.
        parsed (`ParsedAction`): the parsed action.
    """

    action_text: str
    observation: str
    parsed: ParsedAction


class MemoryPolicy(ABC):
    """Decides which chat messages the next model call sees. Subclass it to try another memory scheme."""

    name: str = "base"

    def describe(self) -> str:
        """
        Returns:
            `str`: what each model call sees under this policy, for the system prompt (empty unless a policy says).
        """
        return ""

    @abstractmethod
    def build_messages(self, system: str, task: str, turns: list[Turn]) -> list[dict[str, str]]:
        """
        Returns:
            `list[dict]`: chat messages (`{"role": ..., "content": ...}`) for the next model call.
        """

    def carried_turns(self, turns: list[Turn]) -> list[Turn]:
        """
        Returns:
            `list[Turn]`: the turns whose texts `build_messages` puts in the next context (all of them unless a
            policy says otherwise); `MemoryAgentEnv.messages(char_budget=...)` shrinks only these.
        """
        return turns


class CompactMemoryPolicy(MemoryPolicy):
    """The MemOPD / MEM1 setting: system, task, the latest action (holding the latest memory), the latest observation."""

    name = "compact"

    def describe(self) -> str:
        return "Each turn you see only the task, your last memory and action, and its result: keep what you need in memory."

    def carried_turns(self, turns: list[Turn]) -> list[Turn]:
        return turns[-1:]

    def build_messages(self, system: str, task: str, turns: list[Turn]) -> list[dict[str, str]]:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": task}]
        if turns:
            last = turns[-1]
            messages += [
                {"role": "assistant", "content": last.action_text},
                {"role": "user", "content": last.observation},
            ]
        return messages


class FullHistoryMemoryPolicy(MemoryPolicy):
    """The growing baseline: system, task, then every action and observation so far."""

    name = "full_history"

    def describe(self) -> str:
        return "Each turn you see the task and every earlier action and result."

    def build_messages(self, system: str, task: str, turns: list[Turn]) -> list[dict[str, str]]:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": task}]
        for turn in turns:
            messages += [
                {"role": "assistant", "content": turn.action_text},
                {"role": "user", "content": turn.observation},
            ]
        return messages


MEMORY_POLICIES: dict[str, type[MemoryPolicy]] = {
    "compact": CompactMemoryPolicy,
    "full_history": FullHistoryMemoryPolicy,
}
# The memory policy's name before "persistent" came to mean only `teacher_scoring="persistent"` (the control).
PersistentMemoryPolicy = FullHistoryMemoryPolicy


def get_memory_policy(policy: "str | MemoryPolicy") -> MemoryPolicy:
    """Returns the policy named `policy` (`"compact"` or `"full_history"`), or `policy` itself if it is one already."""
    if isinstance(policy, MemoryPolicy):
        return policy
    if policy == "persistent":
        warnings.warn(
            'memory_policy="persistent" is deprecated and will be removed in the next release; use "full_history" '
            '(the name "persistent" is kept for `teacher_scoring="persistent"`, the persistent-history control).',
            FutureWarning,
            stacklevel=3,
        )
        policy = "full_history"
    if policy not in MEMORY_POLICIES:
        raise ValueError(f"Unknown memory policy {policy!r}; choose one of {sorted(MEMORY_POLICIES)}.")
    return MEMORY_POLICIES[policy]()


@dataclass
class StepResult:
    """
    What `MemoryAgentEnv.step` returns.

    Parameters:
        observation (`str`): the environment's answer (search results, a format error, or the end of the episode).
        reward (`float`): the reward of this step (non-zero only at the end of an episode).
        done (`bool`): whether the episode is over.
        info (`dict`): details: `kind` of the action, `error`, `memory_truncated`, `retriever_error`, `f1`, `em`, ...
    """

    observation: str
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


class EnvContractError(TypeError):
    """
    An environment broke the `MemoryAgentEnv` contract (e.g. `score()` returned no dict with `f1` and `em`). It is a
    bug in the environment's code, the same for every episode: the rollout engine lets it through instead of failing
    the episode, so a run stops with the message rather than failing every episode in silence.
    """


def _cut(text: str, limit: int | None, marker: str = " ...") -> tuple[str, bool]:
    if limit is None or len(text) <= limit:
        return text, False
    return text[: max(0, limit - len(marker))] + marker, True


class MemoryAgentEnv(ABC):
    """
    Base class of a memory agent's environment: the action grammar, the memory policy, the limits. Subclasses say what
    the task is, how a search is answered and how an answer is scored.

    Life of an episode: `reset(record)`, then repeatedly `messages()` (the chat messages for the next model call)
    and `step(action_text)` until `done`. Agent mistakes never raise: a malformed action gets an observation stating
    the expected format and counts toward `max_malformed`; when that many malformed actions have been made the
    episode ends with reward 0. A search that raises gives an error observation and is counted in `info`.

    Args:
        action_format (`ActionFormat` or `str`, *optional*, defaults to `"memopd"`):
            The tag names, or the name of a preset (`"memopd"`, `"mem1"`).
        memory_policy (`str` or `MemoryPolicy`, *optional*, defaults to `"compact"`):
            Which context the next call sees: `"compact"` or `"full_history"`.
        max_turns (`int`, *optional*, defaults to `6`):
            Turns after which an unanswered episode ends with reward 0.
        max_malformed (`int`, *optional*, defaults to `2`):
            Number of malformed actions that ends the episode with reward 0.
        max_memory_chars (`int` or `None`, *optional*, defaults to `1024`):
            Memory longer than this is cut (its head is kept) before it enters later contexts; reported in
            `info["memory_truncated"]`.
        max_observation_chars (`int` or `None`, *optional*, defaults to `2048`):
            Observations longer than this are cut.
        format_penalty (`float`, *optional*, defaults to `0.0`):
            Subtracted from the final reward for each malformed action (the reward never goes below 0).
        system_prompt (`str`, *optional*):
            Overrides the default system prompt (`default_system_prompt()`: the environment's `role`, what the
            memory policy shows each call, and the action format).
    """

    role: str = "You are an agent solving a task over several turns."
    """The first sentence of the default system prompt: who the agent is in this environment (a subclass sets its own)."""

    def __init__(
        self,
        action_format: ActionFormat | str = "memopd",
        memory_policy: "str | MemoryPolicy" = "compact",
        max_turns: int = 6,
        max_malformed: int = 2,
        max_memory_chars: int | None = 1024,
        max_observation_chars: int | None = 2048,
        format_penalty: float = 0.0,
        system_prompt: str | None = None,
    ):
        if max_turns < 1:
            raise ValueError(f"`max_turns` must be >= 1, got {max_turns}.")
        if max_malformed < 1:
            raise ValueError(f"`max_malformed` must be >= 1, got {max_malformed}.")
        for name, value in (("max_memory_chars", max_memory_chars), ("max_observation_chars", max_observation_chars)):
            if value is not None and value < 16:
                raise ValueError(f"`{name}` must be None or >= 16, got {value}.")
        if format_penalty < 0:
            raise ValueError(f"`format_penalty` must be >= 0, got {format_penalty}.")
        self.action_format = ActionFormat.preset(action_format) if isinstance(action_format, str) else action_format
        self.memory_policy = get_memory_policy(memory_policy)
        self.max_turns = max_turns
        self.max_malformed = max_malformed
        self.max_memory_chars = max_memory_chars
        self.max_observation_chars = max_observation_chars
        self.format_penalty = format_penalty
        self.system_prompt = system_prompt or self.default_system_prompt()
        self._record: dict[str, Any] | None = None

    # ----- what a subclass provides -------------------------------------------------------------------------------
    @abstractmethod
    def task_text(self, record: dict[str, Any]) -> str:
        """Returns the task as the user message of the first turn."""

    @abstractmethod
    def search(self, query: str) -> str:
        """Returns the body of the observation for `query` (it is wrapped in the information tag by the base class)."""

    @abstractmethod
    def score(self, answer: str) -> dict[str, float]:
        """
        Returns at least `{"f1": ..., "em": ...}` (numbers) for a final answer against the current record (`record`).
        `step` checks this contract and raises `EnvContractError` naming the method when it is broken.
        """

    def validate_record(self, record: dict[str, Any]) -> None:
        """
        Raise a `ValueError` naming the record and the field when `record` cannot be played. The trainer calls it on
        every record of its datasets before training. The default builds the task text (`task_text`); a subclass
        with a schema checks it here (as `HotpotQAEnv` does).
        """
        if not isinstance(record, dict):
            raise ValueError(f"A record must be a dict, got {type(record).__name__}.")
        try:
            task = self.task_text(record)
        except (KeyError, TypeError, ValueError) as err:
            record_id = record.get("_id", "<no _id>")
            raise ValueError(
                f"Record {record_id!r}: {type(self).__name__}.task_text raised {type(err).__name__}: {err}"
            ) from err
        if not isinstance(task, str):
            raise EnvContractError(
                f"{type(self).__name__}.task_text() must return a str, got {type(task).__name__} ({task!r})."
            )

    def default_system_prompt(self) -> str:
        """
        Returns the system prompt: the environment's `role`, what the memory policy shows each model call, and the
        action format.
        """
        parts = (self.role, self.memory_policy.describe(), self.action_format.describe())
        return " ".join(part for part in parts if part)

    @property
    def record(self) -> dict[str, Any]:
        """The record of the current episode (the one given to `reset`), e.g. to read its answer in `score`."""
        if self._record is None:
            raise RuntimeError("No episode yet: call `reset(record)` first.")
        return self._record

    # ----- episode life -------------------------------------------------------------------------------------------
    def reset(self, record: dict[str, Any]) -> list[dict[str, str]]:
        """
        Start an episode on `record`.

        Returns:
            `list[dict]`: the chat messages of the first model call.
        """
        task = self.task_text(record)  # first, so that a rejected record leaves the previous episode untouched
        self._record = record
        self.task = task
        self.turns: list[Turn] = []
        self.done = False
        self.answer: str | None = None
        self.memory: str | None = None
        self.reward = 0.0
        self.f1 = 0.0
        self.em = 0.0
        self.num_malformed = 0
        self.num_retriever_errors = 0
        self.num_memory_cuts = 0
        self.end_reason: str | None = None
        return self.messages()

    @property
    def num_turns(self) -> int:
        """Number of actions taken so far."""
        return len(self.turns)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """Strings that end a generation (the action closing tags)."""
        return self.action_format.stop_strings

    def messages(self, char_budget: int | None = None) -> list[dict[str, str]]:
        """
        The chat messages of the next model call, built by the memory policy.

        Args:
            char_budget (`int`, *optional*):
                When the rendered context is too long for the model, the caller may ask for a smaller one: the
                memory and observation texts of the carried turns are cut so that together they fit in this many
                characters (observations are shortened first, then memory). The task is never cut, nor is any
                sampled action, which lives only in the recorded token ids.

        Returns:
            `list[dict]`: chat messages `{"role", "content"}`.
        """
        if self._record is None:
            raise RuntimeError("Call `reset(record)` before `messages()`.")
        turns = self.turns
        carried = self.memory_policy.carried_turns(turns)
        if char_budget is not None and carried:
            shrunk = {id(old): new for old, new in zip(carried, self._shrink(carried, char_budget), strict=True)}
            turns = [shrunk.get(id(turn), turn) for turn in turns]
        return self.memory_policy.build_messages(self.system_prompt, self.task, turns)

    def _shrink(self, turns: list[Turn], char_budget: int) -> list[Turn]:
        total_obs = sum(len(t.observation) for t in turns) or 1
        obs_budget = max(0, char_budget - sum(len(t.action_text) for t in turns))
        shrunk = []
        for t in turns:
            obs, _ = _cut(t.observation, max(16, obs_budget * len(t.observation) // total_obs))
            action = t.action_text
            if obs_budget == 0 and t.parsed.memory is not None and t.parsed.kind != "malformed":
                memory, _ = _cut(t.parsed.memory, max(16, char_budget // max(1, len(turns))))
                action = self.action_format.render_action(memory, t.parsed.kind, t.parsed.argument)
            shrunk.append(Turn(action, obs, t.parsed))
        return shrunk

    def step(self, action_text: str) -> StepResult:
        """
        Play one agent turn.

        Args:
            action_text (`str`): the text the model generated (thinking, memory block and one action).

        Returns:
            `StepResult`: next observation, reward, whether the episode is done, and details in `info`.
        """
        if self._record is None:
            raise RuntimeError("Call `reset(record)` before `step()`.")
        if self.done:
            raise RuntimeError("The episode is over; call `reset(record)` to start another.")
        parsed = parse_action(action_text, self.action_format)
        info: dict[str, Any] = {"kind": parsed.kind, "turn": len(self.turns)}
        fmt = self.action_format
        if parsed.kind == "malformed":
            self.num_malformed += 1
            info["error"] = parsed.error
            kept, _ = _cut(action_text if isinstance(action_text, str) else "", self.max_memory_chars)
            observation = f"Invalid action ({parsed.error}). {fmt.describe()}"
            self.turns.append(Turn(kept, observation, parsed))
            if self.num_malformed >= self.max_malformed:
                return self._finish(0.0, "malformed", observation, info)
        else:
            memory = parsed.memory
            info["memory_truncated"] = False
            if memory is not None:
                memory, cut = _cut(memory, self.max_memory_chars)
                info["memory_truncated"] = cut
                self.num_memory_cuts += int(cut)
                self.memory = memory
            kept = fmt.render_action(memory, parsed.kind, parsed.argument)
            if parsed.kind == "answer":
                self.answer = parsed.argument
                self.turns.append(Turn(kept, "", parsed))
                scores = self._checked_scores(self.score(parsed.argument))
                self.f1, self.em = scores["f1"], scores["em"]
                info.update(scores)
                reward = max(0.0, self.f1 - self.format_penalty * self.num_malformed)
                return self._finish(reward, "answer", "", info)
            try:
                body = self.search(parsed.argument)
            except Exception as err:  # a failing retriever must not end training
                self.num_retriever_errors += 1
                info["retriever_error"] = f"{type(err).__name__}: {err}"
                body = "Search failed; try another query."
            body, cut = _cut(body, self.max_observation_chars)
            info["observation_truncated"] = cut
            observation = fmt.wrap(fmt.information_tag, body)
            self.turns.append(Turn(kept, observation, parsed))
        if len(self.turns) >= self.max_turns:
            return self._finish(0.0, "max_turns", self.turns[-1].observation, info)
        return StepResult(self.turns[-1].observation, 0.0, False, info)

    def _checked_scores(self, scores: Any) -> dict[str, Any]:
        """`score()`'s result, with `f1` and `em` as floats; an `EnvContractError` naming the method if it is not
        a dict holding them as numbers."""
        method = f"{type(self).__name__}.score()"
        if not isinstance(scores, dict):
            raise EnvContractError(
                f"{method} must return a dict with at least 'f1' and 'em', got {type(scores).__name__} "
                f'({scores!r}); for example `return {{"f1": f1, "em": em}}`.'
            )
        missing = [name for name in ("f1", "em") if name not in scores]
        if missing:
            raise EnvContractError(f"{method} returned {scores!r}, which lacks {missing}; it must hold 'f1' and 'em'.")
        for name in ("f1", "em"):
            value = scores[name]
            if not isinstance(value, numbers.Real):
                raise EnvContractError(f"{method}[{name!r}] must be a number, got {type(value).__name__} ({value!r}).")
        return {**scores, "f1": float(scores["f1"]), "em": float(scores["em"])}

    def _finish(self, reward: float, reason: str, observation: str, info: dict[str, Any]) -> StepResult:
        self.done = True
        self.reward = reward
        self.end_reason = reason
        info["end_reason"] = reason
        return StepResult(observation, reward, True, info)

    @classmethod
    def factory(cls, **kwargs) -> "EnvFactory":
        """
        Returns:
            `EnvFactory`: a `functools.partial` of the class that makes a fresh environment with these arguments, so a
            trainer can give every episode its own. Heavy shared objects (a retriever) are passed once and shared.
        """
        return EnvFactory(cls, **kwargs)


class EnvFactory(functools.partial):
    """
    `functools.partial(env_class, **kwargs)`: each call makes a fresh environment. Any `functools.partial` of an
    environment class works as an `env_factory`; this one also names its parts `env_class` (`func`) and `kwargs`
    (`keywords`).

    Example:

    ```python
    >>> from memopd_trl import HotpotQAEnv
    >>> make_env = HotpotQAEnv.factory(corpus=[{"title": "Rome", "text": "Rome is the capital of Italy."}], top_k=1)
    >>> make_env.env_class is HotpotQAEnv, make_env.kwargs["top_k"]
    (True, 1)
    ```
    """

    @property
    def env_class(self) -> type:
        """The environment class (`func`)."""
        return self.func

    @property
    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments every environment is made with (`keywords`)."""
        return self.keywords
