"""In-process sparse retrieval over a passage corpus, built on the `bm25s` library.

A corpus is a list of passages `{"title": str, "text": str}`. The title and the text are indexed together, so a query
naming an entity finds the passage about it. HotpotQA records carry their own paragraphs; `corpus_from_records` turns
them into such a corpus.
"""

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import bm25s
import numpy as np


class BM25Retriever:
    """
    Okapi BM25 over a list of passages, using `bm25s` for tokenization, indexing and scoring.

    Passages with the same title and identical text are indexed once (the first copy, in corpus order), so one fact
    never fills several of a search's `top_k` slots; `num_duplicates` counts the copies dropped, and `corpus` holds
    the passages indexed.

    Args:
        corpus (`list[dict]`):
            Passages, each a dict with string fields `"title"` and `"text"`. Other fields are kept and returned.
        k1 (`float`, *optional*, defaults to `1.5`):
            BM25 term-frequency saturation.
        b (`float`, *optional*, defaults to `0.75`):
            BM25 length normalization.
        method (`str`, *optional*, defaults to `"lucene"`):
            BM25 variant of `bm25s` (`"lucene"`, `"robertson"`, `"atire"`, `"bm25l"`, `"bm25+"`).
        stopwords (`str` or `list[str]` or `None`, *optional*, defaults to `"english"`):
            Stopwords removed from passages and queries (`bm25s` names such as `"english"`, a list, or `None`).
        stemmer (`Callable[[str], str]`, *optional*):
            A word stemmer (for instance `Stemmer.Stemmer("english").stemWord` from PyStemmer); none by default.

    Example:

    ```python
    >>> from memopd_trl import BM25Retriever
    >>> retriever = BM25Retriever([{"title": "Paris", "text": "Paris is the capital of France."},
    ...                            {"title": "Rome", "text": "Rome is the capital of Italy."}])
    >>> retriever.search("capital of Italy", top_k=1)[0]["title"]
    'Rome'
    ```
    """

    def __init__(
        self,
        corpus: Sequence[dict[str, Any]],
        k1: float = 1.5,
        b: float = 0.75,
        method: str = "lucene",
        stopwords: str | list[str] | None = "english",
        stemmer: Callable[[str], str] | None = None,
    ):
        if not isinstance(corpus, Sequence) or isinstance(corpus, str | bytes):
            raise ValueError(f"`corpus` must be a list of passages, got {type(corpus).__name__}.")
        if len(corpus) == 0:
            raise ValueError(
                "`corpus` is empty: BM25Retriever needs at least one passage {'title': ..., 'text': ...} to index."
            )
        for i, passage in enumerate(corpus):
            if not isinstance(passage, dict):
                raise ValueError(f"Passage {i} of `corpus` must be a dict with 'title' and 'text', got {passage!r}.")
            for key in ("title", "text"):
                if not isinstance(passage.get(key), str):
                    raise ValueError(
                        f"Passage {i} of `corpus` needs a string {key!r} field, got {passage.get(key)!r}; "
                        "every passage must look like {'title': str, 'text': str}."
                    )
        # A passage repeated under one title (same title, identical text) would fill several of the `top_k` slots
        # with one fact: keep its first copy only, and count the rest.
        seen: set[tuple[str, str]] = set()
        self.corpus = []
        for passage in corpus:
            key = (passage["title"], passage["text"])
            if key not in seen:
                seen.add(key)
                self.corpus.append(passage)
        self.num_duplicates = len(corpus) - len(self.corpus)
        self.k1, self.b = k1, b
        self._tokenizer = bm25s.tokenization.Tokenizer(stopwords=stopwords, stemmer=stemmer)
        documents = [f"{p['title']} {p['text']}" for p in self.corpus]
        # One list of vocabulary ids per passage; the vocabulary is frozen after this call.
        doc_ids = self._tokenizer.tokenize(documents, update_vocab=True, return_as="ids", show_progress=False)
        self._bm25 = bm25s.BM25(k1=k1, b=b, method=method)
        self._bm25.index((doc_ids, self._tokenizer.get_vocab_dict()), show_progress=False)
        # bm25s encodes a text without indexable words (empty, punctuation, stopwords only) as one "empty" token. It
        # must not match anything: otherwise a query with no known word would return every passage without words.
        self._empty_token_id = self._tokenizer.get_vocab_dict().get("")

    def __len__(self) -> int:
        return len(self.corpus)

    def search(self, query: str, top_k: int = 3) -> list[dict[str, Any]]:
        """
        Retrieve the passages that best match `query`.

        Args:
            query (`str`): free text. Words absent from the corpus are ignored; a query with no known word returns
                no passage.
            top_k (`int`, *optional*, defaults to `3`): maximum number of passages returned.

        Returns:
            `list[dict]`: up to `top_k` passages, best first, each a copy of the corpus entry with its `"score"`.
            Passages that share no word with the query are never returned.
        """
        return self.search_batch([query], top_k=top_k)[0]

    def search_batch(self, queries: Iterable[str], top_k: int = 3) -> list[list[dict[str, Any]]]:
        """
        Retrieve passages for many queries at once.

        Args:
            queries (`Iterable[str]`): the queries.
            top_k (`int`, *optional*, defaults to `3`): maximum number of passages per query.

        Returns:
            `list[list[dict]]`: for each query, what `search` returns.
        """
        queries = list(queries)
        if top_k < 1:
            raise ValueError(f"`top_k` must be >= 1, got {top_k}.")
        for i, query in enumerate(queries):
            if not isinstance(query, str):
                raise TypeError(f"Query {i} must be a string, got {type(query).__name__}.")
        if not queries:
            return []
        # Unknown words are dropped; a query left without words maps to bm25s' empty token, dropped here too.
        query_ids = self._tokenizer.tokenize(queries, update_vocab=False, return_as="ids", show_progress=False)
        results = []
        for ids in query_ids:
            ids = [i for i in ids if i != self._empty_token_id]
            scores = self._bm25.get_scores(ids) if ids else None  # (num_passages,)
            results.append([{**self.corpus[i], "score": float(scores[i])} for i in _top_k(scores, top_k)])
        return results


def _top_k(scores: np.ndarray | None, k: int) -> list[int]:
    """
    Indices of the `k` highest positive scores, best first (ties: lower index first).

    Only passages sharing a word with the query have a positive score, usually a handful; selecting among those is
    much faster than a partition of the whole score array, which numpy does slowly when most scores tie at 0.
    """
    if scores is None:
        return []
    candidates = np.flatnonzero(scores > 0)  # (num_matching,)
    if len(candidates) > k:
        candidates = candidates[np.argpartition(-scores[candidates], k - 1)[:k]]
    order = np.lexsort((candidates, -scores[candidates]))  # by score descending, then index
    return candidates[order].tolist()


def corpus_from_records(records: Iterable[dict[str, Any]]) -> list[dict[str, str]]:
    """
    Build a passage corpus from the `context` paragraphs of HotpotQA-format records.

    Each paragraph `[title, sentences]` becomes `{"title": title, "text": "".join(sentences)}` (HotpotQA sentences after
    the first already start with a space). Paragraphs are deduplicated by title; the first one seen is kept.

    Args:
        records (`Iterable[dict]`): records in HotpotQA's official layout.

    Returns:
        `list[dict]`: the passages, in order of first appearance.
    """
    corpus: list[dict[str, str]] = []
    seen: set[str] = set()
    for index, record in enumerate(records):
        context = record.get("context") if isinstance(record, dict) else None
        if not isinstance(context, list):
            record_id = record.get("_id", index) if isinstance(record, dict) else index
            raise ValueError(
                f"Record {record_id!r} has no list `context`; expected HotpotQA's layout [[title, [sentences]], ...]."
            )
        for title, sentences in context:
            if title not in seen:
                seen.add(title)
                corpus.append({"title": title, "text": "".join(sentences)})
    return corpus
