"""Multi-objective tasks (MEM1 style): k questions in one task, so facts found early must be carried in memory.

In a single bridge question the answer's passage is in the last observation, which the compact context always shows:
the memory can say anything. A task made of k sub-questions asked one after the other needs, at the answer step, the
facts of the first k - 1 sub-questions, which only the memory still carries.

`make_multi_objective_tasks` turns HotpotQA-format records (real ones from `load_hotpotqa`, or the synthetic world's)
into such tasks:

- `question`: the sub-questions numbered in order, one a line::

      Question 1: Where was the director of Kalo Venu born?
      Question 2: Which company was founded first, Drava Menko or Sela Brin?

- `answer`: the sub-answers joined by `MULTI_ANSWER_SEPARATOR` (`" ; "`), e.g. `"Dravik ; Drava Menko"`;
- `context`: the union of the sub-records' paragraphs; `supporting_facts`: the union of theirs;
- `sub_ids`, `sub_questions`, `sub_answers`, `sub_types`: the sub-records' `_id`, question, answer and type;
- `type`: `"multi"`; `level`: the hardest of the sub-records' levels; `_id`: the sub-records' ids joined by `+`.

`HotpotQAEnv` scores such a record with the mean per-sub-question F1 (`memopd_trl.metrics.multi_answer_f1`). An
episode needs `multi_objective_max_turns(k)` turns: two searches per sub-question in the synthetic world, and the
answer.
"""

import random
from collections.abc import Sequence
from typing import Any

from ..metrics import MULTI_ANSWER_SEPARATOR
from .data import LEVELS, MULTI_OBJECTIVE_TYPE, QUESTION_TYPES, is_multi_objective, multi_objective_problem


__all__ = [
    "MULTI_ANSWER_SEPARATOR",
    "format_sub_questions",
    "make_multi_objective_tasks",
    "multi_objective_max_turns",
    "parse_sub_questions",
]


def format_sub_questions(questions: Sequence[str]) -> str:
    """
    The `question` of a multi-objective task: `"Question 1: ...\\nQuestion 2: ..."`.

    Args:
        questions (`Sequence[str]`): the sub-questions, in order; runs of whitespace (newlines included) in each
            become one space, so that every sub-question stays on its line.

    Returns:
        `str`: the numbered sub-questions, one a line.
    """
    return "\n".join(f"Question {i}: {' '.join(q.split())}" for i, q in enumerate(questions, start=1))


def parse_sub_questions(text: str) -> list[str]:
    """
    The numbered sub-questions of a multi-objective task, read from its question or from a task message holding it.

    Returns:
        `list[str]`: the sub-questions in order (empty when `text` has no `Question 1: ...` line).
    """
    questions = []
    for line in text.splitlines():
        prefix = f"Question {len(questions) + 1}: "
        if line.startswith(prefix):
            questions.append(line[len(prefix) :])
    return questions


def multi_objective_max_turns(k: int, searches_per_question: int = 2, retries: int = 0) -> int:
    """
    The turns a k-question task needs: every search of every sub-question, then the answer.

    Args:
        k (`int`): sub-questions per task.
        searches_per_question (`int`, *optional*, defaults to `2`):
            Searches one sub-question needs when every search finds its passage (2 in the synthetic world: the two
            entities of a comparison, or the entity and then its bridge entity).
        retries (`int`, *optional*, defaults to `0`):
            Extra tries allowed per search (e.g. `SyntheticExpert(retries=...)`), to budget for searches that miss.

    Returns:
        `int`: `searches_per_question * (1 + retries) * k + 1`, the `max_turns` to give `HotpotQAEnv`.

    Example:

    ```python
    >>> from memopd_trl.envs.multi import multi_objective_max_turns
    >>> multi_objective_max_turns(3)
    7
    ```
    """
    if k < 1 or searches_per_question < 1 or retries < 0:
        raise ValueError(
            f"`k` and `searches_per_question` must be >= 1 and `retries` >= 0, got k={k}, "
            f"searches_per_question={searches_per_question}, retries={retries}."
        )
    return searches_per_question * (1 + retries) * k + 1


def _check_sub_record(record: Any, index: int) -> None:
    if not isinstance(record, dict):
        raise ValueError(f"make_multi_objective_tasks: record at index {index} must be a dict, got {type(record)}.")
    record_id = record.get("_id")
    where = f"record {record_id!r}" if isinstance(record_id, str) and record_id else f"record at index {index}"
    if is_multi_objective(record):
        raise ValueError(
            f"make_multi_objective_tasks: {where} is already a multi-objective task; give single questions."
        )
    for name in ("_id", "question", "answer"):
        if not isinstance(record.get(name), str) or not record[name].strip():
            raise ValueError(
                f"make_multi_objective_tasks: {where}: field {name!r} must be a non-empty string, got "
                f"{record.get(name)!r:.120}; every sub-question needs an id, a question and a gold answer."
            )
    separator = MULTI_ANSWER_SEPARATOR.strip()
    if separator in record["answer"]:
        raise ValueError(
            f"make_multi_objective_tasks: {where}: field 'answer' ({record['answer']!r:.120}) holds {separator!r}, "
            f"which separates sub-answers; leave it out, e.g. [r for r in records if {separator!r} not in r['answer']]."
        )
    if not isinstance(record.get("context", []), list):
        raise ValueError(
            f"make_multi_objective_tasks: {where}: field 'context' must be a list of [title, sentences], got "
            f"{type(record['context']).__name__}."
        )


def _combine(group: Sequence[dict[str, Any]]) -> dict[str, Any]:
    context, titles = [], set()
    supporting_facts, seen_facts = [], set()
    for record in group:
        for paragraph in record.get("context", []):
            if paragraph[0] not in titles:  # deduplicated by title, the first kept (as `corpus_from_records` does)
                titles.add(paragraph[0])
                context.append([paragraph[0], list(paragraph[1])])
        for fact in record.get("supporting_facts", []):
            key = (fact[0], fact[1])
            if key not in seen_facts:
                seen_facts.add(key)
                supporting_facts.append([fact[0], fact[1]])
    sub_answers = [record["answer"] for record in group]
    task = {
        "_id": "+".join(record["_id"] for record in group),
        "answer": MULTI_ANSWER_SEPARATOR.join(sub_answers),
        "question": format_sub_questions([record["question"] for record in group]),
        "supporting_facts": supporting_facts,
        "context": context,
        "type": MULTI_OBJECTIVE_TYPE,
    }
    levels = [record.get("level") for record in group]
    if all(level in LEVELS for level in levels):
        task["level"] = max(levels, key=LEVELS.index)
    task["sub_ids"] = [record["_id"] for record in group]
    task["sub_questions"] = [" ".join(record["question"].split()) for record in group]
    task["sub_answers"] = sub_answers
    types = [record.get("type") for record in group]
    if all(t in QUESTION_TYPES for t in types):
        task["sub_types"] = types
    return task


def make_multi_objective_tasks(
    records: Sequence[dict[str, Any]],
    k: int = 2,
    num_tasks: int | None = None,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """
    Turn single HotpotQA-format questions into k-question tasks (MEM1's multi-objective setting).

    The records are shuffled with `seed` and cut into groups of `k`: each task asks its group's questions in order,
    its context is the union of their passages and its answer joins their answers with `MULTI_ANSWER_SEPARATOR`
    (the record layout is in this module's docstring). Bridge and comparison questions are taken as they come, so a
    world made with `comparison_fraction > 0` gives mixed tasks.

    Args:
        records (`Sequence[dict]`):
            Single questions with string `_id`, `question` and `answer` (real HotpotQA records or
            `make_synthetic_world(...).records`); an answer holding `;` (the separator) is rejected.
        k (`int`, *optional*, defaults to `2`):
            Sub-questions per task.
        num_tasks (`int`, *optional*):
            Number of tasks. Defaults to `len(records) // k`, every record used at most once; more tasks than that
            reuse records (never twice in one task, never the same records in the same order twice).
        seed (`int`, *optional*, defaults to `0`):
            Same records, `k` and seed: same tasks.

    Returns:
        `list[dict]`: the tasks, valid for `validate_record` and `HotpotQAEnv`.

    Example:

    ```python
    >>> from memopd_trl.envs.multi import make_multi_objective_tasks
    >>> from offline_lab import make_synthetic_world  # the offline lab's world
    >>> task = make_multi_objective_tasks(make_synthetic_world(10, seed=0).records, k=2)[0]
    >>> task["question"].splitlines()[1].startswith("Question 2: ")
    True
    ```
    """
    records = list(records)
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"`k` must be an int >= 1 (sub-questions per task), got {k!r}.")
    if len(records) < k:
        raise ValueError(f"make_multi_objective_tasks needs at least k={k} records, got {len(records)}.")
    for index, record in enumerate(records):
        _check_sub_record(record, index)
    ids = [record["_id"] for record in records]
    if len(set(ids)) != len(ids):
        duplicate = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"make_multi_objective_tasks: record id {duplicate!r} appears twice; ids must be unique.")
    if num_tasks is None:
        num_tasks = len(records) // k
    if num_tasks < 0:
        raise ValueError(f"`num_tasks` must be None or >= 0, got {num_tasks}.")

    rng = random.Random(seed)
    groups: list[tuple[int, ...]] = []
    seen: set[tuple[int, ...]] = set()
    stale_rounds = 0
    while len(groups) < num_tasks:
        order = list(range(len(records)))
        rng.shuffle(order)
        added = 0
        for start in range(0, len(order) - k + 1, k):
            group = tuple(order[start : start + k])
            if group in seen:
                continue
            seen.add(group)
            groups.append(group)
            added += 1
            if len(groups) == num_tasks:
                break
        stale_rounds = 0 if added else stale_rounds + 1
        if stale_rounds >= 100:
            raise ValueError(
                f"make_multi_objective_tasks could not find {num_tasks} distinct groups of {k} among {len(records)} "
                f"records (found {len(groups)}); ask for fewer tasks."
            )
    tasks = [_combine([records[i] for i in group]) for group in groups]
    for task in tasks:  # a guard on this function's own output
        problem = multi_objective_problem(task)
        if problem is not None:
            raise AssertionError(f"multi-objective task {task['_id']!r}: {problem}")
    return tasks
