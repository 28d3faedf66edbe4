import statistics

import pytest

from memopd_trl.envs.base import ActionFormat, parse_action
from memopd_trl.envs.data import validate_record
from memopd_trl.envs.hotpot import HotpotQAEnv
from memopd_trl.envs.multi import (
    MULTI_ANSWER_SEPARATOR,
    make_multi_objective_tasks,
    multi_objective_max_turns,
    parse_sub_questions,
)
from memopd_trl.envs.retrieval import corpus_from_records
from offline_lab import expert_trajectories, make_synthetic_world, play_episode


FMT = ActionFormat()


@pytest.fixture(scope="module")
def world():
    return make_synthetic_world(300, seed=3)


# ----- the transform ------------------------------------------------------------------------------------------------
def test_a_task_asks_its_sub_questions_in_order_and_joins_their_answers(world):
    by_id = {r["_id"]: r for r in world.records}
    tasks = make_multi_objective_tasks(world.records, k=3, seed=0)
    assert len(tasks) == 100
    for task in tasks:
        subs = [by_id[i] for i in task["sub_ids"]]
        assert task["_id"] == "+".join(task["sub_ids"]) and task["type"] == "multi"
        assert task["question"] == "\n".join(f"Question {n}: {r['question']}" for n, r in enumerate(subs, start=1))
        assert parse_sub_questions(task["question"]) == task["sub_questions"] == [r["question"] for r in subs]
        assert task["answer"] == " ; ".join(r["answer"] for r in subs) and task["sub_answers"] == [
            r["answer"] for r in subs
        ]
        assert task["sub_types"] == [r["type"] for r in subs]
        titles = [title for title, _ in task["context"]]
        assert titles == list(dict.fromkeys(t for r in subs for t, _ in r["context"]))  # the union, in order
        assert task["supporting_facts"] == [f for r in subs for f in r["supporting_facts"]]
    used = [i for task in tasks for i in task["sub_ids"]]
    assert len(set(used)) == len(used) == 300  # every record once


def test_the_transform_is_seeded_and_keeps_comparison_questions(world):
    first = make_multi_objective_tasks(world.records, k=2, seed=7)
    assert make_multi_objective_tasks(world.records, k=2, seed=7) == first
    assert make_multi_objective_tasks(world.records, k=2, seed=8) != first
    types = {t for task in first for t in task["sub_types"]}
    assert types == {"bridge", "comparison"}
    bridge_only = make_synthetic_world(40, seed=1, comparison_fraction=0.0)
    assert {t for task in make_multi_objective_tasks(bridge_only.records) for t in task["sub_types"]} == {"bridge"}


def test_more_tasks_than_records_reuse_records_in_distinct_groups(world):
    records = world.records[:10]
    tasks = make_multi_objective_tasks(records, k=2, num_tasks=30, seed=0)
    groups = [tuple(task["sub_ids"]) for task in tasks]
    assert len(tasks) == 30 and len(set(groups)) == 30
    assert all(len(set(group)) == 2 for group in groups)
    with pytest.raises(ValueError, match="could not find 100 distinct groups of 2 among 10 records"):
        make_multi_objective_tasks(records, k=2, num_tasks=100, seed=0)  # 10 * 9 = 90 ordered pairs exist


def test_multi_objective_tasks_are_valid_hotpotqa_records(world):
    for index, task in enumerate(make_multi_objective_tasks(world.records, k=2, seed=0)):
        validate_record(task, index)


def test_the_transform_rejects_what_it_cannot_join(world):
    records = [dict(r) for r in world.records[:4]]
    records[2]["answer"] = "Dravik; Orsa"
    with pytest.raises(
        ValueError, match=rf"record {records[2]['_id']!r}: field 'answer' \('Dravik; Orsa'\) holds ';'"
    ):
        make_multi_objective_tasks(records)
    with pytest.raises(ValueError, match="already a multi-objective task"):
        make_multi_objective_tasks(make_multi_objective_tasks(world.records[:4]) + world.records[:2])
    with pytest.raises(ValueError, match=r"record 'q2': field 'question' must be a non-empty string"):
        make_multi_objective_tasks([world.records[0], {"_id": "q2", "answer": "x"}])
    with pytest.raises(ValueError, match="appears twice"):
        make_multi_objective_tasks([world.records[0], world.records[0]])
    with pytest.raises(ValueError, match="at least k=3 records"):
        make_multi_objective_tasks(world.records[:2], k=3)
    with pytest.raises(ValueError, match="`k` must be an int >= 1"):
        make_multi_objective_tasks(world.records, k=0)


def test_max_turns_of_a_k_question_task():
    assert [multi_objective_max_turns(k) for k in (1, 2, 3, 4)] == [3, 5, 7, 9]
    assert multi_objective_max_turns(2, retries=1) == 9
    assert multi_objective_max_turns(3, searches_per_question=1) == 4
    with pytest.raises(ValueError, match="`k`"):
        multi_objective_max_turns(0)


def test_the_separator_joins_and_the_env_splits():
    assert MULTI_ANSWER_SEPARATOR == " ; "


# ----- real HotpotQA records ----------------------------------------------------------------------------------------
def test_real_records_become_tasks_over_the_union_of_their_passages(hotpot_sample_records):
    records = hotpot_sample_records
    tasks = make_multi_objective_tasks(records, k=2, seed=0)
    assert len(tasks) == 26
    by_id = {r["_id"]: r for r in records}
    corpus = corpus_from_records(tasks)
    assert {p["title"] for p in corpus} <= {p["title"] for p in corpus_from_records(records)}
    env = HotpotQAEnv.factory(corpus=corpus)()
    for task in tasks:
        subs = [by_id[i] for i in task["sub_ids"]]
        gold_titles = {t for r in subs for t, _ in r["supporting_facts"]}
        assert gold_titles <= {title for title, _ in task["context"]}
        env.reset(task)
        assert env.task.endswith(task["question"]) and task["question"].count("\n") == 1
        assert env.step(FMT.render_action("m", "answer", task["answer"])).reward == 1.0  # yes/no answers included
        env.reset(task)
        half = env.step(FMT.render_action("m", "answer", subs[0]["answer"] + " ; no idea")).reward
        assert half == pytest.approx(0.5)


# ----- memory matters: only the memory carries the earlier sub-questions' facts to the answer step -----------------
def gold_facts(record):
    """The gold fact sentences of a single question (its supporting sentences)."""
    paragraphs = {title: sentences for title, sentences in record["context"]}
    return [paragraphs[title][sent_id].strip() for title, sent_id in record["supporting_facts"]]


@pytest.mark.parametrize("k", [2, 3])
def test_at_the_answer_step_only_the_memory_carries_the_earlier_facts(world, k):
    by_id = {r["_id"]: r for r in world.records}
    tasks = make_multi_objective_tasks(world.records, k=k, seed=1)
    make = HotpotQAEnv.factory(corpus=world.corpus, memory_policy="compact", max_turns=multi_objective_max_turns(k))
    episodes = expert_trajectories(tasks, make)
    assert statistics.mean(e.f1 for e in episodes) == 1.0
    for task, episode in zip(tasks, episodes, strict=True):
        answer_messages, answer = episode.steps[-1]
        assert parse_action(answer, FMT).kind == "answer"
        assert [m["role"] for m in answer_messages] == ["system", "user", "assistant", "user"]  # compact
        observation = answer_messages[-1]["content"]
        memory = parse_action(answer_messages[-2]["content"], FMT).memory
        memories = [parse_action(action, FMT).memory for _, action in episode.steps]
        for sub_id in task["sub_ids"][:-1]:
            for fact in gold_facts(by_id[sub_id]):
                assert fact not in observation and fact not in answer_messages[1]["content"]
                assert fact in memory
                written = next(turn for turn, m in enumerate(memories) if fact in m)
                assert len(episode.steps) - 1 - written >= 2  # carried through at least 2 rewrites since


def test_a_memory_less_agent_cannot_score_on_the_earlier_sub_questions():
    world = make_synthetic_world(200, seed=4, comparison_fraction=0.0)
    tasks = make_multi_objective_tasks(world.records, k=2, seed=0)
    make = HotpotQAEnv.factory(corpus=world.corpus, max_turns=multi_objective_max_turns(2))
    full = expert_trajectories(tasks, make)
    for memory in ("none", "latest"):
        forgetful = expert_trajectories(tasks, make, memory=memory)
        assert [e.queries for e in forgetful] == [e.queries for e in full]  # the same searches
        assert statistics.mean(e.info["sub_f1"][0] for e in forgetful) == 0.0  # the forgotten question
        assert statistics.mean(e.info["sub_f1"][1] for e in forgetful) == 1.0  # the last one, still in view
    assert statistics.mean(e.f1 for e in full) == 1.0


def test_on_mixed_tasks_a_memory_less_agent_only_guesses_the_earlier_comparisons(world):
    tasks = make_multi_objective_tasks(world.records, k=2, seed=2)
    make = HotpotQAEnv.factory(corpus=world.corpus, max_turns=multi_objective_max_turns(2))
    forgetful = expert_trajectories(tasks, make, memory="none")
    earlier = [(t["sub_types"][0], e.info["sub_f1"][0]) for t, e in zip(tasks, forgetful, strict=True)]
    assert all(f1 == 0.0 for kind, f1 in earlier if kind == "bridge")
    comparisons = [f1 for kind, f1 in earlier if kind == "comparison"]
    assert 0.2 < statistics.mean(comparisons) < 0.8  # a coin flip between the two named entities, or yes / no


def test_a_k_question_task_needs_its_max_turns(world):
    task = make_multi_objective_tasks(world.records, k=3, seed=0)[0]
    short = play_episode(HotpotQAEnv.factory(corpus=world.corpus)(), task)  # the default max_turns is 6
    assert short.info["end_reason"] == "max_turns" and short.f1 == 0.0
    enough = play_episode(HotpotQAEnv.factory(corpus=world.corpus, max_turns=multi_objective_max_turns(3))(), task)
    assert enough.info["end_reason"] == "answer" and enough.f1 == 1.0 and len(enough.steps) == 7


def test_on_lookup_tasks_the_forgetful_experts_lose_what_only_the_memory_carries():
    world = make_synthetic_world(120, seed=5, lookup_fraction=1.0)
    for k in (2, 3):
        tasks = make_multi_objective_tasks(world.records, k=k, seed=0)
        turns = multi_objective_max_turns(k, searches_per_question=1)
        make = HotpotQAEnv.factory(corpus=world.corpus, top_k=1, max_turns=turns)
        full = expert_trajectories(tasks, make)
        assert statistics.mean(e.f1 for e in full) == 1.0 and {len(e.steps) for e in full} == {turns}
        none = expert_trajectories(tasks, make, memory="none")
        latest = expert_trajectories(tasks, make, memory="latest")
        searches = expert_trajectories(tasks, make, memory="searches")
        assert [e.queries for e in none] == [e.queries for e in latest] == [e.queries for e in full]
        assert [e.queries for e in searches] == [e.queries for e in full]
        assert [e.info["sub_f1"] for e in searches] == [e.info["sub_f1"] for e in none]
        # A note of every search made, and none of the facts found.
        _, answer = searches[0].steps[-1]
        memory = parse_action(answer, FMT).memory
        assert memory == " ".join(f"Searched {query}." for query in searches[0].queries)
        assert all(fact not in memory for fact in gold_facts(tasks[0]))
        for position in range(k - 1):  # a memory-less agent guesses every earlier sub-question
            assert statistics.mean(e.info["sub_f1"][position] for e in none) == 0.0
        assert statistics.mean(e.info["sub_f1"][k - 1] for e in none) == 1.0
        # Only the latest fact kept: the one found just before the last search is still in memory at the answer.
        assert statistics.mean(e.f1 for e in latest) == pytest.approx(2 / k if k > 2 else 1.0)
