"""A scripted policy for the synthetic world, and the supervised traces it produces.

The expert sees only what a model would see: the chat messages of the next call (the question, its latest memory and
action, the latest observation). It knows the world's sentence templates, so it reads facts from the observation
text; when a search misses, it has to search again, so its F1 reflects retrieval quality. It keeps in memory the fact
sentences it has found, copied verbatim, and acts:

- bridge question: search the named entity, keep its fact (which names the bridge entity), search the bridge entity,
  keep its fact, answer;
- lookup (single-hop): search the named entity, keep its fact, answer;
- comparison question: search the first entity, keep its fact, search the second, keep its fact, compare, answer;
- multi-objective task (numbered sub-questions, `memopd_trl.envs.multi`): work through the sub-questions in order as
  above, keeping every fact found so far, then answer all of them at once, joined by `" ; "`.

A *history-reading* expert (`reads="history"`) takes its facts from everything its messages show, not only from its
latest memory and observation. In the compact layout that is the same; under the growing history (memory policy
`full_history`) it also uses a passage that an earlier observation showed and the memory lost: it writes that fact
back into memory and answers from it. Labeling a forgetful agent's histories with it gives the demonstrations of a
teacher that is native to the history layout.

A *forgetful* expert (`memory="latest"`, `"none"` or `"searches"`) plays the same searches and answers in the same
format, but its memory keeps only the latest fact found, nothing, or only a note of its searches: at the answer step
it has forgotten the facts of earlier sub-questions and guesses those answers. It tells where it is in the task from its last query (which names the
entity it searched), so it needs no memory to go on; a bridge entity is recognized by the fact that names it, in the
memory or in the observation (which shows that passage too when `top_k >= 2`). When neither shows it, the forgetful
expert has lost its place and answers what it has.
"""

import random
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from memopd_trl.envs.base import ActionFormat, MemoryAgentEnv, parse_action
from memopd_trl.envs.multi import parse_sub_questions
from memopd_trl.metrics import MULTI_ANSWER_SEPARATOR

from .world import LOOKUP_ANSWER_FIELD, QUESTION_ENTITY_KIND, SyntheticWorld, find_fact, parse_question


NO_FACTS_MEMORY = "No facts yet."
MEMORY_MODES = ("full", "latest", "none", "searches")
READS = ("latest", "history")
# Words appended to a query that missed, per entity kind: the later, more specific tries.
_RETRY_WORDS = {"film": ("film", "directed"), "company": ("company", "founded"), "person": ("born", "later lived")}


class _Lookup(NamedTuple):
    """One search of the expert's plan: the entity of sub-question `question` it looks for, and its fact if known."""

    question: int
    name: str
    kind: str
    fact: dict[str, str] | None


class SyntheticExpert:
    """
    Scripted policy for `make_synthetic_world` questions (single or multi-objective), reading only the chat messages
    an agent would see.

    Args:
        action_format (`ActionFormat` or `str`, *optional*, defaults to `ActionFormat()`):
            The tags to write (must match the environment's).
        retries (`int`, *optional*, defaults to `1`):
            How many times (0 to 2) a query that did not bring back the needed passage is tried again, with a word
            of the entity's passage added, before the expert gives up and answers a guess.
        memory (`str`, *optional*, defaults to `"full"`):
            What the expert keeps in its memory: `"full"`, every fact sentence found so far; `"latest"`, only the
            latest fact found; `"none"`, nothing (`NO_FACTS_MEMORY`); `"searches"`, a note of each search made
            (`"Searched Kalo Venu."`) and none of the facts found: it knows where it is in the task, not what it
            learned. The searches and the answer format are the same in every mode; a forgetful expert guesses the
            answers whose facts it no longer has.
        reads (`str`, *optional*, defaults to `"latest"`):
            Where it looks for facts: `"latest"`, its latest memory and the latest observation (what a compact call
            shows); `"history"`, every action and observation the messages hold (under the `full_history` memory
            policy, the whole episode so far, so a fact the memory lost is still found).

    Example:

    ```python
    >>> from offline_lab import SyntheticExpert
    >>> expert = SyntheticExpert()
    >>> expert([{"role": "system", "content": "..."},
    ...         {"role": "user", "content": "Question: Where was the director of Kalo Venu born?"}])
    '<memory>No facts yet.</memory><search>Kalo Venu</search>'
    ```
    """

    def __init__(
        self, action_format: ActionFormat | str | None = None, retries: int = 1, memory: str = "full",
        reads: str = "latest",
    ):  # fmt: skip
        if isinstance(action_format, str):
            action_format = ActionFormat.preset(action_format)
        self.action_format = action_format or ActionFormat()
        if not 0 <= retries <= 2:
            raise ValueError(f"`retries` must be 0, 1 or 2, got {retries}.")
        if memory not in MEMORY_MODES:
            raise ValueError(f"`memory` must be one of {MEMORY_MODES}, got {memory!r}.")
        if reads not in READS:
            raise ValueError(f"`reads` must be one of {READS}, got {reads!r}.")
        self.retries = retries
        self.memory = memory
        self.reads = reads

    def __call__(self, messages: list[dict[str, str]]) -> str:
        return self.act(messages)

    def act(self, messages: list[dict[str, str]]) -> str:
        """
        Choose the next action.

        Args:
            messages (`list[dict]`): the chat messages of the next model call, as `MemoryAgentEnv.messages()` builds
                them (any memory policy).

        Returns:
            `str`: the action text, `<memory>...</memory>` then one `<search>` or `<answer>` block.
        """
        task, last_action, observation = _split_messages(messages)
        questions = _parse_task(task)
        previous = parse_action(last_action, self.action_format) if last_action is not None else None
        memory_text = previous.memory if previous is not None and previous.memory else ""
        last_query = previous.argument if previous is not None and previous.kind == "search" else None
        known = memory_text + "\n" + observation  # memory first: facts already kept win
        if self.reads == "history":  # and then every earlier action and observation the messages still show
            known += "\n" + _history_text(messages)

        plan = [
            lookup for index, (template, entities) in enumerate(questions)
            for lookup in _needed_entities(index, template, entities, known)
        ]  # fmt: skip
        start, latest = 0, None
        if self.memory != "full" and last_query is not None:
            # A forgetful expert cannot tell from its memory which sub-questions are done: its last query says.
            searched = next(
                (i for i, lookup in enumerate(plan) if last_query in _query_tries(lookup.name, lookup.kind, 2)), None
            )
            if searched is None:  # the entity it searched is unknown: it lost its place, and answers what it has
                memory = self._memory(plan, None, memory_text, last_query)
                return self._render(memory, "answer", _answers(questions, plan))
            latest = plan[searched].fact
            start = searched if latest is None else searched + 1
        memory = self._memory(plan, latest, memory_text, last_query)
        missing = next((lookup for lookup in plan[start:] if lookup.fact is None), None)
        if missing is None:
            return self._render(memory, "answer", _answers(questions, plan))
        tries = _query_tries(missing.name, missing.kind, self.retries)
        if last_query in tries:  # this entity was just searched and its passage did not come back
            position = tries.index(last_query)
            if position + 1 == len(tries):
                return self._render(memory, "answer", _answers(questions, plan))
            return self._render(memory, "search", tries[position + 1])
        return self._render(memory, "search", tries[0])

    def _memory(
        self, plan: list[_Lookup], latest: dict[str, str] | None, memory_text: str, last_query: str | None
    ) -> str:
        if self.memory == "searches":  # what it did, not what it found
            done = [] if memory_text in ("", NO_FACTS_MEMORY) else [memory_text]
            return " ".join(done + ([f"Searched {last_query}."] if last_query else [])) or NO_FACTS_MEMORY
        if self.memory == "full":
            return " ".join(lookup.fact["sentence"] for lookup in plan if lookup.fact is not None) or NO_FACTS_MEMORY
        if self.memory == "latest":
            return latest["sentence"] if latest is not None else (memory_text or NO_FACTS_MEMORY)
        return NO_FACTS_MEMORY

    def _render(self, memory: str, kind: str, argument: str) -> str:
        return self.action_format.render_action(memory or NO_FACTS_MEMORY, kind, argument)


def _parse_task(task: str) -> list[tuple[str, tuple[str, ...]]]:
    """The task's questions as `(template, entities)`: one for a single question, k for a multi-objective task."""
    sub_questions = parse_sub_questions(task)
    texts = sub_questions or [task]
    questions = []
    for number, text in enumerate(texts, start=1):
        parsed = parse_question(text)
        if parsed is None:
            where = f"sub-question {number} ({text[:200]!r})" if sub_questions else f"the task message {text[:200]!r}"
            raise ValueError(
                f"SyntheticExpert only plays synthetic-world questions; no known question template was found in {where}."
            )
        questions.append(parsed)
    return questions


def _split_messages(messages: list[dict[str, str]]) -> tuple[str, str | None, str]:
    """Returns the task (first user message), the latest assistant message (or None) and what followed it."""
    if not messages:
        raise ValueError("`messages` is empty; pass the chat messages returned by the environment.")
    user_indices = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    if not user_indices:
        raise ValueError("`messages` holds no user message with the task.")
    task = messages[user_indices[0]]["content"]
    assistant_indices = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if not assistant_indices:
        return task, None, ""
    last = assistant_indices[-1]
    observation = "\n".join(m["content"] for m in messages[last + 1 :])
    return task, messages[last]["content"], observation


def _history_text(messages: list[dict[str, str]]) -> str:
    """Everything after the task message: every action and observation the context holds."""
    first_user = next(i for i, m in enumerate(messages) if m.get("role") == "user")
    return "\n".join(m["content"] for m in messages[first_user + 1 :])


def _needed_entities(question: int, template: str, entities: tuple[str, ...], known: str) -> list[_Lookup]:
    """The facts sub-question `question` needs, in the order they are searched (a bridge entity once it is known)."""
    kind = QUESTION_ENTITY_KIND[template]
    if template in LOOKUP_ANSWER_FIELD or len(entities) == 2:  # a lookup's one fact, or one per compared entity
        return [_Lookup(question, name, kind, find_fact(kind, name, known)) for name in entities]
    head = find_fact(kind, entities[0], known)
    needed = [_Lookup(question, entities[0], kind, head)]
    if head is not None:  # the bridge entity is named in the head entity's fact
        bridge = head["director"] if kind == "film" else head["founder"]
        needed.append(_Lookup(question, bridge, "person", find_fact("person", bridge, known)))
    return needed


def _query_tries(name: str, kind: str, retries: int) -> list[str]:
    return [name] + [f"{name} {word}" for word in _RETRY_WORDS[kind][:retries]]


def _answers(questions: list[tuple[str, tuple[str, ...]]], plan: list[_Lookup]) -> str:
    """The answer of the task: each question's answer from its facts, or a guess when one is missing, joined."""
    parts = []
    for index, (template, entities) in enumerate(questions):
        lookups = [lookup for lookup in plan if lookup.question == index]
        facts = [lookup.fact for lookup in lookups if lookup.fact is not None]
        needed = 1 if template in LOOKUP_ANSWER_FIELD else 2
        complete = len(facts) == len(lookups) == needed
        parts.append(_answer(template, facts) if complete else _guess(template, entities))
    return MULTI_ANSWER_SEPARATOR.join(parts)


def _answer(template: str, facts: list[dict[str, str]]) -> str:
    if template in LOOKUP_ANSWER_FIELD:
        return facts[0][LOOKUP_ANSWER_FIELD[template]]
    if template in ("director_birthplace", "founder_birthplace"):
        return facts[-1]["city"]
    if template == "director_occupation":
        return facts[-1]["occupation"]
    a, b = facts
    if template == "same_birthplace":
        return "yes" if a["city"] == b["city"] else "no"
    earlier, later = (a, b) if int(a["year"]) < int(b["year"]) else (b, a)
    return (earlier if template == "founded_first" else later)["name"]


def _guess(template: str, entities: tuple[str, ...]) -> str:
    """An answer when a needed fact is missing (never found, or forgotten): the right kind of string, rarely right."""
    if template == "same_birthplace":
        return "no"
    if len(entities) == 2:
        return entities[0]
    return "unknown"


@dataclass
class ExpertEpisode:
    """
    One episode played by the expert.

    Parameters:
        record_id (`str`): the record's `_id`.
        steps (`list[tuple[list[dict], str]]`): per turn, the chat messages the expert saw and the action it wrote.
        f1 (`float`): answer F1 (0 when the episode ended without an answer).
        em (`float`): answer exact match.
        reward (`float`): the environment's final reward.
        queries (`list[str]`): the search queries, in order.
        info (`dict`): the environment's end reason and counters.
    """

    record_id: str
    steps: list[tuple[list[dict[str, str]], str]]
    f1: float = 0.0
    em: float = 0.0
    reward: float = 0.0
    queries: list[str] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    def sft_examples(self) -> list[dict[str, list[dict[str, str]]]]:
        """
        Returns:
            `list[dict]`: one conversational prompt-completion example per turn,
            `{"prompt": messages, "completion": [{"role": "assistant", "content": action}]}` (TRL's SFT format).
        """
        return [
            {"prompt": [dict(m) for m in messages], "completion": [{"role": "assistant", "content": action}]}
            for messages, action in self.steps
        ]


def _resolve_expert(expert: Any, memory: str | None, action_format: ActionFormat) -> Any:
    """The policy to play: `expert`, or a `SyntheticExpert` with `memory` when it is `None`; they must agree."""
    if expert is None:
        return SyntheticExpert(action_format, memory=memory or "full")
    if memory is not None and getattr(expert, "memory", None) != memory:
        raise ValueError(
            f"`memory={memory!r}` was given with a policy whose memory mode is {getattr(expert, 'memory', None)!r}; "
            "pass one of them (e.g. SyntheticExpert(memory=...) alone)."
        )
    return expert


def play_episode(
    env: MemoryAgentEnv,
    record: dict[str, Any],
    policy: Callable[[list[dict[str, str]]], str] | None = None,
    explore: Callable[[str], str] | None = None,
    memory: str | None = None,
    behavior: Callable[[list[dict[str, str]]], str] | None = None,
) -> ExpertEpisode:
    """
    Play one episode of `policy` (a function from chat messages to action text) in `env`.

    Args:
        env (`MemoryAgentEnv`): the environment (reset here).
        record (`dict`): the question.
        policy (`Callable[[list[dict]], str]`, *optional*):
            The labeler: its action in each state is what `steps` records. Defaults to a `SyntheticExpert` in the
            environment's action format with memory mode `memory`.
        explore (`Callable[[str], str]`, *optional*):
            Maps the policy's action to the action actually played (e.g. [`make_mistake`]); the next state follows
            the played action while the step still records the policy's. `None` plays the policy's actions.
        memory (`str`, *optional*):
            The expert's memory mode (`"full"`, `"latest"`, `"none"`, see `SyntheticExpert`) when `policy` is not
            given; when it is, it must be that policy's mode.
        behavior (`Callable[[list[dict]], str]`, *optional*):
            The policy whose actions are played, in place of `policy`'s: the states follow its choices while each
            step records what `policy` would write there (relabeling another agent's states, as in DAgger). `explore`
            then applies to its actions. `None` plays the labeler's own.

    Returns:
        `ExpertEpisode`: the turns (messages and the policy's action), the queries played and the scores (with
        `info["sub_f1"]` / `info["sub_em"]` on a multi-objective task).
    """
    policy = _resolve_expert(policy, memory, env.action_format)
    messages = env.reset(record)
    steps, queries = [], []
    while not env.done:
        action = policy(messages)
        steps.append((messages, action))
        played = behavior(messages) if behavior is not None else action
        played = explore(played) if explore is not None else played
        result = env.step(played)
        if result.info.get("kind") == "search":
            queries.append(parse_action(played, env.action_format).argument)
        if not result.done:
            messages = env.messages()
    info = {
        "end_reason": env.end_reason,
        "num_malformed": env.num_malformed,
        "num_retriever_errors": env.num_retriever_errors,
    }
    if getattr(env, "sub_f1", None):
        info["sub_f1"], info["sub_em"] = list(env.sub_f1), list(env.sub_em)
    return ExpertEpisode(record.get("_id", ""), steps, env.f1, env.em, env.reward, queries, info)


def make_mistake(action: str, action_format: ActionFormat, rng: random.Random) -> str:
    """
    A slip of a weak agent, made on a search action, that leads somewhere clean play never goes:

    - a garbled query (two names run together, a syllable lost), which usually finds nothing;
    - a search for the entity already found (its memory's first name), which brings back a known passage;
    - a memory that lost its last fact, which has to be searched again.

    Answers are returned unchanged (a wrong answer ends the episode: there is nothing to recover from).

    Returns:
        `str`: the action with one mistake, still well formed.
    """
    parsed = parse_action(action, action_format)
    if parsed.kind != "search":
        return action
    memory, query = parsed.memory or "", parsed.argument
    facts = [sentence for sentence in memory.split(". ") if sentence]
    choice = rng.random()
    if choice < 0.25 and len(facts) > 1:
        memory = ". ".join(facts[:-1]).rstrip(".") + "."
    elif choice < 0.5 and memory.split(":")[0] != NO_FACTS_MEMORY and facts:
        query = " ".join(facts[0].split()[:2])
    else:
        words = query.split()
        cut = rng.randrange(1, max(2, len(words[-1])))
        query = words[0][: max(2, len(words[0]) // 2)] + words[-1][cut:]
    return action_format.render_action(memory, "search", query)


def reading_steps(
    episodes: Iterable[ExpertEpisode], action_format: ActionFormat
) -> list[tuple[list[dict[str, str]], str]]:
    """
    One reading state per expert episode of a multi-objective task: the task and the episode's first search, then
    every passage its searches found, in one observation, labelled with the episode's last action (each fact in
    memory, every answer). With every fact in front of the model nothing is carried from an earlier turn: the state
    teaches answering several questions from what it reads, not the memory policy.

    Args:
        episodes (`Iterable[ExpertEpisode]`): the full expert's clean episodes (no mistakes).
        action_format (`ActionFormat`): the environment's tags.

    Returns:
        `list[tuple[list[dict], str]]`: `(messages, action)` pairs, one per episode that searched once per question,
        each query new, then answered; the others (a single question, a retried search) give none.
    """
    opening, closing = f"<{action_format.information_tag}>", f"</{action_format.information_tag}>"
    steps = []
    for episode in episodes:
        searches = episode.steps[1:]
        if len(searches) < 2 or len(set(episode.queries)) != len(searches) or len(episode.queries) != len(searches):
            continue
        if parse_action(episode.steps[-1][1], action_format).kind != "answer":
            continue
        passages = []
        for messages, _ in searches:
            text = messages[-1]["content"]
            if not (text.startswith(opening) and text.endswith(closing)):
                break
            passages += re.findall(r"^\[\d+\] (.*)$", text[len(opening) : -len(closing)], flags=re.MULTILINE)
        else:
            numbered = "\n".join(f"[{i}] {passage}" for i, passage in enumerate(passages, start=1))
            observation = {"role": "user", "content": f"{opening}{numbered}{closing}"}
            steps.append(([*searches[0][0][:-1], observation], episode.steps[-1][1]))
    return steps


def expert_trajectories(
    world: SyntheticWorld | Iterable[dict[str, Any]],
    env_factory: Callable[[], MemoryAgentEnv],
    expert: SyntheticExpert | None = None,
    limit: int | None = None,
    min_f1: float | None = None,
    mistake_prob: float = 0.0,
    seed: int = 0,
    memory: str | None = None,
    behavior: Callable[[list[dict[str, str]]], str] | None = None,
) -> list[ExpertEpisode]:
    """
    Play the scripted expert on the world's questions: the traces a teacher is fine-tuned on.

    Args:
        world (`SyntheticWorld` or `Iterable[dict]`):
            The world, or its records.
        env_factory (`Callable[[], MemoryAgentEnv]`):
            Makes the environment, e.g. `HotpotQAEnv.factory(corpus=world.corpus)`.
        expert (`SyntheticExpert`, *optional*):
            The policy; defaults to one using the environment's action format.
        limit (`int`, *optional*):
            Play only the first `limit` questions.
        min_f1 (`float`, *optional*):
            Keep only episodes whose answer F1 is at least this (e.g. `1.0` for clean SFT data); all by default.
        mistake_prob (`float`, *optional*, defaults to `0.0`):
            Probability that a search turn is played with a mistake ([`make_mistake`]) while the step records the
            expert's own action: the traces then also show how to recover from states a weak agent reaches (missed
            searches, a fact lost from memory), which clean expert play never visits. A teacher trained only on clean
            play is confidently wrong in those states, and on-policy distillation asks it about exactly them.
        seed (`int`, *optional*, defaults to `0`): seed of the mistakes.
        memory (`str`, *optional*):
            The expert's memory mode when `expert` is not given: `"full"` (the default), `"latest"` or `"none"` (a
            forgetful expert, see `SyntheticExpert`); when `expert` is given, it must be that expert's mode.
        behavior (`Callable[[list[dict]], str]`, *optional*):
            Plays the episodes while the expert labels their states ([`play_episode`]); the scores are the
            behavior's. `None`: the expert plays.

    Returns:
        `list[ExpertEpisode]`: one per question played (and kept), in order.
    """
    records = world.records if isinstance(world, SyntheticWorld) else list(world)
    if limit is not None:
        records = records[:limit]
    env = env_factory()
    expert = _resolve_expert(expert, memory, env.action_format)
    if not 0.0 <= mistake_prob <= 1.0:
        raise ValueError(f"`mistake_prob` must be in [0, 1], got {mistake_prob}.")
    rng = random.Random(seed)
    explore = None
    if mistake_prob > 0:
        def explore(action: str) -> str:
            return make_mistake(action, env.action_format, rng) if rng.random() < mistake_prob else action

    episodes = []
    for record in records:
        episode = play_episode(env, record, expert, explore=explore, behavior=behavior)
        if min_f1 is None or episode.f1 >= min_f1:
            episodes.append(episode)
    return episodes
