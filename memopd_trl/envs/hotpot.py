"""HotpotQA as a memory agent's environment: search a passage corpus, then answer; the reward is the answer's F1."""

from collections.abc import Callable, Sequence
from typing import Any

from ..metrics import MULTI_ANSWER_SEPARATOR, exact_match, multi_answer_scores, qa_f1
from .base import MemoryAgentEnv
from .data import is_multi_objective, multi_objective_problem
from .retrieval import BM25Retriever


_REQUIRED_FIELDS = ("_id", "question", "answer")


class HotpotQAEnv(MemoryAgentEnv):
    """
    Multi-hop question answering over a retriever: `<search>query</search>` returns the top passages,
    `<answer>text</answer>` ends the episode with reward F1(answer, gold answer) (HotpotQA's official normalization).

    Works on real HotpotQA records (see `memopd_trl.envs.data.load_hotpotqa`) and on the synthetic world
    (`offline_lab.make_synthetic_world`), which share one record layout, and on multi-objective tasks
    made from either (`memopd_trl.envs.multi.make_multi_objective_tasks`): k numbered sub-questions answered at once,
    the sub-answers joined by `" ; "`, rewarded with the mean per-sub-question F1 (`metrics.multi_answer_f1`; their
    scores are also in `info["sub_f1"]` / `info["sub_em"]` and `env.sub_f1` / `env.sub_em`). Such a task needs
    `max_turns >= multi_objective_max_turns(k)` (`2 * k + 1` in the synthetic world), more than the default 6 from
    k = 3 on.

    Args:
        retriever:
            Any object with `search(query: str, top_k: int) -> list[dict]` returning passages with `"title"` and
            `"text"`, such as `BM25Retriever`.
        top_k (`int`, *optional*, defaults to `3`):
            Passages shown per search.
        **base_kwargs:
            Arguments of `MemoryAgentEnv` (`action_format`, `memory_policy`, `max_turns`, `max_malformed`,
            `max_memory_chars`, `max_observation_chars`, `format_penalty`, `system_prompt`).

    Example:

    ```python
    >>> from memopd_trl import HotpotQAEnv
    >>> make_env = HotpotQAEnv.factory(corpus=[{"title": "Rome", "text": "Rome is the capital of Italy."}])
    >>> env = make_env()
    >>> _ = env.reset({"_id": "q1", "question": "What is the capital of Italy?", "answer": "Rome"})
    >>> env.step("<memory>nothing yet</memory><search>capital of Italy</search>").observation
    '<information>[1] Rome: Rome is the capital of Italy.</information>'
    >>> env.step("<memory>Rome is the capital.</memory><answer>Rome</answer>").reward
    1.0
    ```
    """

    role = "You are a research agent answering questions by searching a passage corpus."

    def __init__(self, retriever: Any, top_k: int = 3, **base_kwargs):
        if not callable(getattr(retriever, "search", None)):
            raise TypeError(
                f"`retriever` must have a `search(query, top_k)` method (for example a BM25Retriever), got "
                f"{type(retriever).__name__}."
            )
        if top_k < 1:
            raise ValueError(f"`top_k` must be >= 1, got {top_k}.")
        self.retriever = retriever
        self.top_k = top_k
        super().__init__(**base_kwargs)

    def reset(self, record: dict[str, Any]) -> list[dict[str, str]]:
        """
        Start an episode on a HotpotQA-format record (it needs string `_id`, `question` and `answer` fields).

        Returns:
            `list[dict]`: the chat messages of the first model call.
        """
        self.validate_record(record)
        messages = super().reset(record)
        self.sub_f1: list[float] = []
        self.sub_em: list[float] = []
        return messages

    def validate_record(self, record: dict[str, Any]) -> None:
        """Raise a `ValueError` naming the record and the field unless `record` has string `_id`, `question` and
        `answer` fields (and, for a multi-objective task, consistent sub-questions); see `validate_env_record`."""
        validate_env_record(record)

    def task_text(self, record: dict[str, Any]) -> str:
        if is_multi_objective(record):
            return (
                f"Answer the {len(record['sub_answers'])} questions, searching for the facts you need. Give their "
                f'answers in order, separated by "{MULTI_ANSWER_SEPARATOR.strip()}".\n{record["question"]}'
            )
        return f"Answer the question, searching for the facts you need.\nQuestion: {record['question']}"

    def search(self, query: str) -> str:
        passages = self.retriever.search(query, top_k=self.top_k)
        if not passages:
            return "No results found."
        return "\n".join(f"[{i}] {p['title']}: {p['text']}" for i, p in enumerate(passages, start=1))

    def score(self, answer: str) -> dict[str, float]:
        if is_multi_objective(self.record):
            scores = multi_answer_scores(answer, self.record["sub_answers"])
            self.sub_f1, self.sub_em = scores["sub_f1"], scores["sub_em"]
            return scores
        gold = self.record["answer"]
        return {"f1": qa_f1(answer, gold), "em": exact_match(answer, gold)}

    @classmethod
    def factory(
        cls,
        corpus: Sequence[dict[str, Any]] | None = None,
        retriever: Any = None,
        top_k: int = 3,
        **kwargs,
    ) -> Callable[[], "HotpotQAEnv"]:
        """
        Make a factory of environments that all share one retriever.

        Args:
            corpus (`list[dict]`, *optional*):
                Passages `{"title", "text"}`; a `BM25Retriever` is built over them once, here.
            retriever (*optional*):
                A ready retriever to share instead (give `corpus` or `retriever`, not both).
            top_k (`int`, *optional*, defaults to `3`):
                Passages shown per search.
            **kwargs:
                Other arguments of `HotpotQAEnv` / `MemoryAgentEnv`.

        Returns:
            `Callable[[], HotpotQAEnv]`: a zero-argument function making a fresh environment; its `env_class`,
            `kwargs` and `retriever` attributes say what it makes.
        """
        if (corpus is None) == (retriever is None):
            raise ValueError(
                "HotpotQAEnv.factory needs exactly one of `corpus` (a list of {'title', 'text'} passages to index) "
                "or `retriever` (an object with `search(query, top_k)`)."
            )
        if retriever is None:
            retriever = BM25Retriever(corpus)
        make = super().factory(retriever=retriever, top_k=top_k, **kwargs)
        make.retriever = retriever
        return make


def validate_env_record(record: Any) -> None:
    """
    Raise a `ValueError` naming the record and the field when `record` lacks a string `_id`, `question`, `answer`, or
    when the fields of a multi-objective task are broken (see `memopd_trl.envs.data.multi_objective_problem`).
    """
    if not isinstance(record, dict):
        raise ValueError(f"A HotpotQA record must be a dict, got {type(record).__name__}.")
    record_id = record.get("_id", "<no _id>")
    for name in _REQUIRED_FIELDS:
        if name not in record:
            raise ValueError(
                f"Record {record_id!r} has no {name!r} field; HotpotQAEnv needs '_id', 'question', 'answer'."
            )
        if not isinstance(record[name], str):
            raise ValueError(
                f"Record {record_id!r}: field {name!r} must be a string, got {type(record[name]).__name__} "
                f"({record[name]!r})."
            )
    problem = multi_objective_problem(record)
    if problem is not None:
        raise ValueError(f"Record {record_id!r}: {problem}")
