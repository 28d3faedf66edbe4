import pytest

from memopd_trl.envs.retrieval import BM25Retriever, corpus_from_records
from offline_lab import make_synthetic_world


CORPUS = [
    {"title": "Paris", "text": "Paris is the capital and largest city of France.", "id": 0},
    {"title": "Rome", "text": "Rome is the capital city of Italy.", "id": 1},
    {"title": "Berlin", "text": "The city hosts the Bundestag.", "id": 2},
    {"title": "Lyon", "text": "A city on the Rhone, known for its food.", "id": 3},
]


@pytest.fixture(scope="module")
def retriever():
    return BM25Retriever(CORPUS)


def test_search_returns_best_passages_first_with_scores(retriever):
    hits = retriever.search("capital of Italy", top_k=3)
    assert hits[0]["title"] == "Rome" and hits[0]["text"] == CORPUS[1]["text"] and hits[0]["id"] == 1
    scores = [h["score"] for h in hits]
    assert scores == sorted(scores, reverse=True) and all(s > 0 for s in scores)


def test_titles_are_indexed_with_the_text(retriever):
    assert retriever.search("Berlin", top_k=1)[0]["title"] == "Berlin"  # the word is only in the title


def test_top_k_limits_results_and_may_exceed_the_corpus(retriever):
    assert len(retriever.search("city", top_k=2)) == 2
    assert len(retriever.search("city", top_k=50)) == len(CORPUS)
    with pytest.raises(ValueError, match="top_k"):
        retriever.search("city", top_k=0)


@pytest.mark.parametrize("query", ["", "   ", "!!! ???", "the of and", "zzzqx unknownword"])
def test_empty_or_garbage_queries_return_nothing_without_raising(retriever, query):
    assert retriever.search(query) == []


def test_search_batch_matches_single_searches(retriever):
    queries = ["capital of France", "", "Rhone food", "Bundestag city"]
    assert retriever.search_batch(queries, top_k=2) == [retriever.search(q, top_k=2) for q in queries]
    assert retriever.search_batch([], top_k=2) == []


def test_results_are_copies_and_the_corpus_is_not_changed(retriever):
    hit = retriever.search("Rome")[0]
    hit["title"] = "changed"
    assert "score" not in CORPUS[1] and retriever.search("Rome")[0]["title"] == "Rome"


def test_empty_corpus_is_a_clear_error():
    with pytest.raises(ValueError, match="`corpus` is empty"):
        BM25Retriever([])


@pytest.mark.parametrize(
    "corpus, match",
    [
        ([{"title": "A", "text": "a"}, {"title": "B"}], "Passage 1 .* string 'text'"),
        ([{"title": 3, "text": "a"}], "Passage 0 .* string 'title'"),
        (["just text"], "Passage 0 of `corpus` must be a dict"),
        ("a string", "must be a list of passages"),
    ],
)
def test_bad_passages_are_named_in_errors(corpus, match):
    with pytest.raises(ValueError, match=match):
        BM25Retriever(corpus)


def test_non_string_query_is_a_type_error(retriever):
    with pytest.raises(TypeError, match="Query 1 must be a string"):
        retriever.search_batch(["ok", 7])


def test_corpus_from_records_joins_sentences_and_dedupes_by_title():
    records = [
        {"_id": "a", "context": [["X", ["X is one.", " It is two."]], ["Y", ["Y."]]]},
        {"_id": "b", "context": [["X", ["a different X text"]], ["Z", []]]},
    ]
    assert corpus_from_records(records) == [
        {"title": "X", "text": "X is one. It is two."},
        {"title": "Y", "text": "Y."},
        {"title": "Z", "text": ""},
    ]
    with pytest.raises(ValueError, match="Record 'c' has no list `context`"):
        corpus_from_records([{"_id": "c"}])


def test_recall_at_5_of_entity_queries_on_a_synthetic_world():
    world = make_synthetic_world(400, seed=3)
    retriever = BM25Retriever(world.corpus)
    titles = [title for record in world.records for title, _ in record["supporting_facts"]]
    results = retriever.search_batch(titles, top_k=5)
    pairs = list(zip(titles, results, strict=True))
    recall = sum(title in {h["title"] for h in hits} for title, hits in pairs) / len(pairs)
    top1 = sum(hits[0]["title"] == title for title, hits in pairs) / len(pairs)
    assert recall >= 0.95 and top1 >= 0.9


def test_real_hotpotqa_paragraphs_are_retrieved_for_their_questions(hotpot_sample_records):
    records = hotpot_sample_records
    corpus = corpus_from_records(records)
    assert len(corpus) > 10 * 40  # about 10 paragraphs per record, few shared
    retriever = BM25Retriever(corpus)
    found = 0
    for record in records:
        gold = {title for title, _ in record["supporting_facts"]}
        found += bool(gold & {h["title"] for h in retriever.search(record["question"], top_k=5)})
    assert found / len(records) >= 0.9  # measured: 52 of 53 questions bring back a gold paragraph
