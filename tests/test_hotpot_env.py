import pytest

from memopd_trl.envs.base import ActionFormat
from memopd_trl.envs.hotpot import HotpotQAEnv
from memopd_trl.envs.retrieval import BM25Retriever, corpus_from_records


CORPUS = [
    {"title": "Ana Lee", "text": "Ana Lee is a novelist born in Porto."},
    {"title": "The Grey Tide", "text": "The Grey Tide is a novel written by Ana Lee."},
    {"title": "Porto", "text": "Porto is a city in Portugal."},
]
RECORD = {"_id": "r1", "question": "Where was the author of The Grey Tide born?", "answer": "Porto"}
FMT = ActionFormat()


class FakeRetriever:
    def __init__(self):
        self.queries = []

    def search(self, query, top_k=3):
        self.queries.append((query, top_k))
        return [{"title": f"T{i}", "text": f"text {i} for {query}"} for i in range(top_k)]


def test_task_is_the_question_with_a_short_instruction():
    env = HotpotQAEnv.factory(corpus=CORPUS)()
    messages = env.reset(RECORD)
    assert messages[0]["role"] == "system" and "<search>" in messages[0]["content"]
    assert messages[1]["content"].endswith("Question: Where was the author of The Grey Tide born?")


def test_search_shows_top_k_passages_with_titles():
    env = HotpotQAEnv.factory(corpus=CORPUS, top_k=2)()
    env.reset(RECORD)
    result = env.step(FMT.render_action("nothing yet", "search", "The Grey Tide by Ana Lee"))
    lines = result.observation.removeprefix("<information>").removesuffix("</information>").split("\n")
    assert lines[0] == "[1] The Grey Tide: The Grey Tide is a novel written by Ana Lee."
    assert len(lines) == 2 and lines[1].startswith("[2] ")


def test_search_without_hits_says_so():
    env = HotpotQAEnv.factory(corpus=CORPUS)()
    env.reset(RECORD)
    assert (
        env.step(FMT.render_action("m", "search", "zebra")).observation
        == "<information>No results found.</information>"
    )


@pytest.mark.parametrize(
    "answer, f1, em", [("Porto", 1.0, 1.0), ("the city of Porto", 0.5, 0.0), ("Lisbon", 0.0, 0.0)]
)
def test_answer_is_scored_with_hotpotqa_f1_and_em(answer, f1, em):
    env = HotpotQAEnv.factory(corpus=CORPUS)()
    env.reset(RECORD)
    result = env.step(FMT.render_action("Ana Lee was born in Porto.", "answer", answer))
    assert result.done and result.reward == pytest.approx(f1)
    assert result.info["f1"] == pytest.approx(f1) and result.info["em"] == em


@pytest.mark.parametrize(
    "record, match",
    [
        ({"question": "q", "answer": "a"}, "Record '<no _id>' has no '_id' field"),
        ({"_id": "x1", "answer": "a"}, "Record 'x1' has no 'question' field"),
        ({"_id": "x2", "question": "q"}, "Record 'x2' has no 'answer' field"),
        ({"_id": "x3", "question": "q", "answer": ["a"]}, "Record 'x3': field 'answer' must be a string, got list"),
        ({"_id": "x4", "question": None, "answer": "a"}, "Record 'x4': field 'question' must be a string"),
        (["not", "a", "dict"], "must be a dict"),
    ],
)
def test_reset_rejects_records_naming_the_id_and_field(record, match):
    env = HotpotQAEnv.factory(corpus=CORPUS)()
    with pytest.raises(ValueError, match=match):
        env.reset(record)


def test_factory_builds_the_retriever_once_and_shares_it():
    make = HotpotQAEnv.factory(corpus=CORPUS, top_k=2, max_turns=4, memory_policy="full_history")
    first, second = make(), make()
    assert first is not second
    assert isinstance(make.retriever, BM25Retriever)
    assert first.retriever is make.retriever and second.retriever is make.retriever
    assert make.env_class is HotpotQAEnv
    assert make.kwargs["top_k"] == 2 and make.kwargs["max_turns"] == 4 and make.kwargs["retriever"] is make.retriever
    assert (first.top_k, first.max_turns, first.memory_policy.name) == (2, 4, "full_history")


def test_factory_uses_a_given_retriever():
    fake = FakeRetriever()
    env = HotpotQAEnv.factory(retriever=fake, top_k=4)()
    env.reset(RECORD)
    observation = env.step(FMT.render_action("m", "search", "grey")).observation
    assert fake.queries == [("grey", 4)] and "[4] T3: text 3 for grey" in observation


@pytest.mark.parametrize("kwargs", [{}, {"corpus": CORPUS, "retriever": FakeRetriever()}])
def test_factory_needs_exactly_one_of_corpus_or_retriever(kwargs):
    with pytest.raises(ValueError, match="exactly one of `corpus`"):
        HotpotQAEnv.factory(**kwargs)


def test_constructor_checks_the_retriever_and_top_k():
    with pytest.raises(TypeError, match="search"):
        HotpotQAEnv(retriever=object())
    with pytest.raises(ValueError, match="top_k"):
        HotpotQAEnv(retriever=FakeRetriever(), top_k=0)


def test_mem1_format_is_accepted():
    env = HotpotQAEnv.factory(corpus=CORPUS, action_format="mem1")()
    env.reset(RECORD)
    assert "<think>" in env.system_prompt
    result = env.step("<think>The author is Ana Lee.</think><answer>Porto</answer>")
    assert result.reward == 1.0


def test_episodes_on_real_hotpotqa_records_show_real_passages(hotpot_sample_records):
    records = hotpot_sample_records
    corpus = corpus_from_records(records)
    titles = {p["title"] for p in corpus}
    env = HotpotQAEnv.factory(corpus=corpus, max_observation_chars=None)()
    rewards, gold_seen = [], 0
    for record in records:
        env.reset(record)
        result = env.step(FMT.render_action("", "search", record["question"]))
        body = result.observation.removeprefix("<information>").removesuffix("</information>")
        shown = [line.split(": ", 1)[0].split("] ", 1)[1] for line in body.split("\n") if line.startswith("[")]
        assert len(shown) == 3 and set(shown) <= titles  # real paragraphs, by title
        gold_seen += bool({t for t, _ in record["supporting_facts"]} & set(shown))
        answer = env.step(FMT.render_action(body[:200], "answer", record["answer"]))
        rewards.append(answer.reward)
    assert rewards == [1.0] * len(records)  # the gold answer scores 1 on every record, yes/no included
    assert gold_seen / len(records) >= 0.8


# ----- multi-objective tasks ---------------------------------------------------------------------------------------
MULTI_RECORD = {
    "_id": "r1+r2",
    "question": "Question 1: Where was the author of The Grey Tide born?\nQuestion 2: What is Ana Lee's job?",
    "answer": "Porto ; novelist",
    "sub_answers": ["Porto", "novelist"],
    "sub_questions": ["Where was the author of The Grey Tide born?", "What is Ana Lee's job?"],
}


def test_multi_objective_task_lists_its_questions_and_the_separator():
    env = HotpotQAEnv.factory(corpus=CORPUS)()
    task = env.reset(MULTI_RECORD)[1]["content"]
    instruction = (
        'Answer the 2 questions, searching for the facts you need. Give their answers in order, separated by ";".'
    )
    assert task.startswith(instruction + "\n")
    assert task.endswith(
        "\nQuestion 1: Where was the author of The Grey Tide born?\nQuestion 2: What is Ana Lee's job?"
    )


@pytest.mark.parametrize(
    "answer, f1, sub_f1",
    [
        ("Porto ; novelist", 1.0, [1.0, 1.0]),
        ("Porto;a novelist", 1.0, [1.0, 1.0]),
        ("Porto", 0.5, [1.0, 0.0]),  # the second part is missing
        ("novelist ; Porto", 0.0, [0.0, 0.0]),  # parts align by position
        ("the city of Porto ; novelist", 0.75, [0.5, 1.0]),
        ("Porto novelist", 1 / 3, [2 / 3, 0.0]),  # without the separator it is one part
    ],
)
def test_multi_objective_reward_is_the_mean_sub_question_f1(answer, f1, sub_f1):
    env = HotpotQAEnv.factory(corpus=CORPUS)()
    env.reset(MULTI_RECORD)
    result = env.step(FMT.render_action("m", "answer", answer))
    assert result.reward == pytest.approx(f1) and env.f1 == pytest.approx(f1)
    assert result.info["sub_f1"] == pytest.approx(sub_f1) and env.sub_f1 == pytest.approx(sub_f1)
    assert result.info["em"] == pytest.approx(sum(s == 1.0 for s in sub_f1) / 2)


def test_single_questions_are_scored_as_before_even_with_a_semicolon():
    env = HotpotQAEnv.factory(corpus=CORPUS)()
    env.reset(RECORD)
    result = env.step(FMT.render_action("m", "answer", "Porto ; Lisbon"))
    assert result.reward == pytest.approx(2 / 3) and "sub_f1" not in result.info and env.sub_f1 == []


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"sub_answers": "Porto"}, r"Record 'r1\+r2': field 'sub_answers' must be a non-empty list"),
        ({"sub_answers": []}, r"field 'sub_answers' must be a non-empty list"),
        ({"sub_answers": ["Porto", ""]}, r"field 'sub_answers'\[1\] must be a non-empty string"),
        ({"sub_answers": ["Porto", "a;b"], "answer": "Porto ; a;b"}, r"'sub_answers'\[1\] \('a;b'\) holds ';'"),
        ({"answer": "Porto, novelist"}, r"field 'answer' \('Porto, novelist'\) must be the sub-answers joined by"),
        ({"sub_questions": ["only one"]}, r"field 'sub_questions' must be a list with one entry per sub-answer \(2\)"),
        ({"sub_types": ["bridge", "trivia"]}, r"field 'sub_types'\[1\] must be one of \('bridge', 'comparison', 'lookup'\)"),
        ({"type": "bridge"}, r"field 'type' of a multi-objective task must be 'multi'"),
        ({"sub_answers": ...}, r"field 'sub_answers' is missing, yet the record has field\(s\) \['sub_questions'\]"),
    ],
)
def test_reset_rejects_broken_multi_objective_records(fields, match):
    record = dict(MULTI_RECORD)
    for name, value in fields.items():
        if value is ...:
            del record[name]
        else:
            record[name] = value
    env = HotpotQAEnv.factory(corpus=CORPUS)()
    with pytest.raises(ValueError, match=match):
        env.reset(record)
