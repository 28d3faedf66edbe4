from collections import Counter

import pytest

from memopd_trl.envs.data import validate_record
from offline_lab.world import (
    LOOKUP_ANSWER_FIELD,
    LOOKUP_TEMPLATES,
    NAME_SYLLABLES,
    QUESTION_TEMPLATES,
    SyntheticWorld,
    find_fact,
    make_synthetic_world,
    parse_question,
)


@pytest.fixture(scope="module")
def world():
    return make_synthetic_world(300, seed=7)


def passage_texts(world):
    return {p["title"]: p["text"] for p in world.corpus}


def test_same_seed_same_world_and_other_seed_other_world():
    first, second = make_synthetic_world(50, seed=11), make_synthetic_world(50, seed=11)
    assert first == second
    other = make_synthetic_world(50, seed=12)
    assert [r["question"] for r in other.records] != [r["question"] for r in first.records]


def test_records_follow_hotpotqa_schema(world):
    assert len(world.records) == 300
    for index, record in enumerate(world.records):
        assert list(record) == ["_id", "answer", "question", "supporting_facts", "context", "type", "level"]
        validate_record(record, index)  # types, values, supporting facts inside the context
        assert len(record["_id"]) == 24 and int(record["_id"], 16) >= 0
        assert len(record["context"]) == 10 and len(record["supporting_facts"]) == 2
        for _, sentences in record["context"]:
            assert 1 <= len(sentences) <= 3
            assert all(s.startswith(" ") for s in sentences[1:])  # HotpotQA's joining rule
    assert len({r["_id"] for r in world.records}) == 300


def test_context_paragraphs_are_corpus_passages_and_titles_are_unique(world):
    texts = passage_texts(world)
    assert len(texts) == len(world.corpus)
    for record in world.records:
        for title, sentences in record["context"]:
            assert texts[title] == "".join(sentences)


def test_every_question_template_and_both_types_appear(world):
    kinds = Counter(parse_question(r["question"])[0] for r in world.records)
    assert set(kinds) == set(QUESTION_TEMPLATES) - set(LOOKUP_TEMPLATES)  # lookups only with lookup_fraction > 0
    types = Counter(r["type"] for r in world.records)
    assert 0.25 < types["comparison"] / 300 < 0.55


def test_bridge_answers_need_the_passage_named_in_the_other(world):
    texts = passage_texts(world)
    for record in (r for r in world.records if r["type"] == "bridge"):
        (head, _), (bridge, _) = record["supporting_facts"]
        template, entities = parse_question(record["question"])
        assert entities == (head,) and bridge not in record["question"]
        assert bridge in texts[head]  # the first passage names the bridge entity...
        assert record["answer"] in texts[bridge] and record["answer"] not in texts[head]  # ...whose passage answers
        fact = find_fact("person", bridge, texts[bridge])
        expected = fact["occupation"] if template == "director_occupation" else fact["city"]
        assert record["answer"] == expected


def test_comparison_answers_follow_from_both_passages(world):
    texts = passage_texts(world)
    answers = Counter()
    for record in (r for r in world.records if r["type"] == "comparison"):
        template, (a, b) = parse_question(record["question"])
        assert [t for t, _ in record["supporting_facts"]] == [a, b]
        if template == "same_birthplace":
            fa, fb = find_fact("person", a, texts[a]), find_fact("person", b, texts[b])
            assert record["answer"] == ("yes" if fa["city"] == fb["city"] else "no")
            answers[record["answer"]] += 1
            continue
        kind = "company" if template == "founded_first" else "film"
        ya, yb = int(find_fact(kind, a, texts[a])["year"]), int(find_fact(kind, b, texts[b])["year"])
        assert ya != yb
        earlier, later = (a, b) if ya < yb else (b, a)
        assert record["answer"] == (earlier if template == "founded_first" else later)
    assert answers["yes"] > 0 and answers["no"] > 0


def test_distractors_share_a_name_word_with_each_gold_passage(world):
    words = Counter(word for p in world.corpus for word in p["title"].split())
    for record in world.records:
        for title, _ in record["supporting_facts"]:
            assert max(words[w] for w in title.split()) >= 2


def test_names_are_unique_even_as_word_sets(world):
    word_sets = [frozenset(p["title"].split()) for p in world.corpus]
    assert len(set(word_sets)) == len(word_sets)
    assert all(len(s) == 2 for s in word_sets)


def test_num_distractors_sets_passages_per_question():
    assert len(make_synthetic_world(40, seed=0, num_distractors=0).corpus) == 2 * 40
    assert len(make_synthetic_world(40, seed=0, num_distractors=3).corpus) == 5 * 40
    assert make_synthetic_world(4, seed=0, num_distractors=0).records[0]["level"] == "easy"


def test_comparison_fraction_and_context_size_are_honoured():
    assert {r["type"] for r in make_synthetic_world(30, comparison_fraction=0.0).records} == {"bridge"}
    assert {r["type"] for r in make_synthetic_world(30, comparison_fraction=1.0).records} == {"comparison"}
    assert all(len(r["context"]) == 4 for r in make_synthetic_world(30, context_size=4).records)
    tiny = make_synthetic_world(1, num_distractors=0)
    assert len(tiny.records[0]["context"]) == 2  # a one-question world has only its own passages


def test_passages_are_short_and_regular(world):
    for passage in world.corpus:
        assert passage["text"].startswith(passage["title"] + " is ")
        assert passage["text"].count(".") <= 2 and len(passage["text"]) < 140


def test_json_round_trip_gives_the_same_world(world, tmp_path):
    path = tmp_path / "world.json"
    world.to_json(path)
    assert SyntheticWorld.from_json(path) == world
    (tmp_path / "other.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a synthetic world"):
        SyntheticWorld.from_json(tmp_path / "other.json")


def test_texts_cover_passages_questions_and_answers(world):
    texts = world.texts()
    joined = "\n".join(texts)
    assert all(p["text"] in texts for p in world.corpus)
    assert all(r["question"] in texts and r["answer"] in joined for r in world.records)


def test_parse_question_and_find_fact_read_the_templates():
    assert parse_question("Question: Where was the director of Kalo Venu born?") == (
        "director_birthplace",
        ("Kalo Venu",),
    )
    assert parse_question("Were Ana Bo and Li Ra born in the same city?") == ("same_birthplace", ("Ana Bo", "Li Ra"))
    assert parse_question("Who is the president of France?") is None
    text = (
        "[1] Kalo Venu: Kalo Venu is a 1987 film directed by Tamir Oslen.\n"
        "[2] Tamir Oslen: Tamir Oslen is an engineer born in Dravik."
    )
    assert find_fact("film", "Kalo Venu", text)["director"] == "Tamir Oslen"
    assert find_fact("person", "Tamir Oslen", text) == {
        "sentence": "Tamir Oslen is an engineer born in Dravik.",
        "name": "Tamir Oslen",
        "occupation": "engineer",
        "city": "Dravik",
    }
    assert find_fact("film", "Alo Venu", "Kalo Venu is a 1987 film directed by Tamir Oslen.") is None
    with pytest.raises(ValueError, match="Unknown entity kind"):
        find_fact("city", "X", text)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_questions": 0}, "num_questions"),
        ({"num_questions": 5, "num_distractors": -1}, "num_distractors"),
        ({"num_questions": 5, "comparison_fraction": 1.5}, "comparison_fraction"),
        ({"num_questions": 5, "context_size": 1}, "context_size"),
        ({"num_questions": 5, "filler_prob": -0.1}, "filler_prob"),
    ],
)
def test_bad_arguments_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_synthetic_world(**kwargs)


@pytest.mark.slow
def test_a_100k_question_world_builds():
    # Its time is measured by benchmarks/linear_time.py (docs/benchmarks.md).
    world = make_synthetic_world(100_000, seed=0)
    assert len(world.records) == 100_000 and len(world.corpus) == 400_000


def test_lookups_are_answered_by_their_one_passage_and_leave_other_worlds_unchanged():
    mixed = make_synthetic_world(300, seed=7, lookup_fraction=0.5)
    texts = passage_texts(mixed)
    lookups = [r for r in mixed.records if r["type"] == "lookup"]
    assert 0.4 < len(lookups) / 300 < 0.6
    assert {parse_question(r["question"])[0] for r in lookups} == set(LOOKUP_TEMPLATES)
    for index, record in enumerate(mixed.records):
        validate_record(record, index)
    for record in lookups:
        template, (name,) = parse_question(record["question"])
        assert record["supporting_facts"] == [[name, 0]]
        title = name
        kind = {"film_director": "film", "company_founder": "company"}.get(template, "person")
        assert find_fact(kind, name, texts[title])[LOOKUP_ANSWER_FIELD[template]] == record["answer"]
    # At lookup_fraction 0 the world is the one made before lookups existed: these are its first questions.
    first = [r["question"] for r in make_synthetic_world(3, seed=7, lookup_fraction=0.0).records]
    assert first == [r["question"] for r in make_synthetic_world(3, seed=7).records]
    assert all(parse_question(q)[0] not in LOOKUP_TEMPLATES for q in first)
    with pytest.raises(ValueError, match="lookup_fraction"):
        make_synthetic_world(3, lookup_fraction=1.5)


def test_short_names_are_two_syllable_words_with_no_syllable_repeated():
    world = make_synthetic_world(200, seed=7, short_names=True, lookup_fraction=1.0)
    syllables = sorted(NAME_SYLLABLES, key=len, reverse=True)

    def split(word):  # the word's syllables (unambiguous here: every word is two of them)
        for first in syllables:
            rest = word.lower()[len(first):]
            if word.lower().startswith(first) and rest in syllables:
                return [first, rest]
        raise AssertionError(f"{word} is not two syllables")

    names = [p["title"] for p in world.corpus]
    for name in names:
        parts = [syllable for word in name.split() for syllable in split(word)]
        assert len(parts) == 4 and len(set(parts)) == 4, name
    for record in world.records:
        validate_record(record, 0)
    default = make_synthetic_world(200, seed=7, lookup_fraction=1.0)
    assert any(len(split_or_none(w)) != 2 for p in default.corpus for w in p["title"].split())


def split_or_none(word):
    """The word's syllables when it is two of them, else []."""
    for first in NAME_SYLLABLES:
        if word.lower().startswith(first) and word.lower()[len(first):] in NAME_SYLLABLES:
            return [first, word.lower()[len(first):]]
    return []
