import json
from pathlib import Path

import pytest

from memopd_trl.envs.base import ActionFormat
from memopd_trl.envs.data import validate_record
from memopd_trl.envs.hotpot import HotpotQAEnv
from memopd_trl.envs.multi import (
    MULTI_ANSWER_SEPARATOR,
    make_multi_objective_tasks,
    multi_objective_max_turns,
    parse_sub_questions,
)
from memopd_trl.envs.retrieval import corpus_from_records
from memopd_trl.envs.synthetic import make_synthetic_world


SAMPLE = Path(__file__).resolve().parents[2] / "shared" / "data" / "hotpotqa_dev_distractor_sample.json"
FMT = ActionFormat()


def load_sample():
    if not SAMPLE.is_file():
        pytest.skip(f"HotpotQA sample not found at {SAMPLE} (the shared data folder beside the repository)")
    return json.loads(SAMPLE.read_text(encoding="utf-8"))


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
def test_real_records_become_tasks_over_the_union_of_their_passages():
    records = load_sample()
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
