import copy
import json

import pytest

from memopd_trl.envs.data import hub_to_official, load_hotpotqa, validate_record


RECORD = {
    "_id": "abc123",
    "answer": "Porto",
    "question": "Where was the author of The Grey Tide born?",
    "supporting_facts": [["The Grey Tide", 0], ["Ana Lee", 1]],
    "context": [
        ["The Grey Tide", ["The Grey Tide is a novel by Ana Lee."]],
        ["Ana Lee", ["Ana Lee is a novelist.", " She was born in Porto."]],
        ["Lisbon", ["Lisbon is a city."]],
    ],
    "type": "bridge",
    "level": "medium",
}
HUB_ROW = {
    "id": "abc123",
    "question": RECORD["question"],
    "answer": "Porto",
    "type": "bridge",
    "level": "medium",
    "supporting_facts": {"title": ["The Grey Tide", "Ana Lee"], "sent_id": [0, 1]},
    "context": {
        "title": ["The Grey Tide", "Ana Lee", "Lisbon"],
        "sentences": [
            ["The Grey Tide is a novel by Ana Lee."],
            ["Ana Lee is a novelist.", " She was born in Porto."],
            ["Lisbon is a city."],
        ],
    },
}


def changed(**fields):
    record = copy.deepcopy(RECORD)
    for name, value in fields.items():
        if value is ...:
            del record[name]
        else:
            record[name] = value
    return record


def write_json(tmp_path, data, name="data.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


# ----- the real sample ----------------------------------------------------------------------------------------------
def test_loads_the_real_dev_sample_unchanged(hotpot_sample_path):
    path = hotpot_sample_path
    records = load_hotpotqa(str(path))
    assert len(records) == 53
    assert records[0]["_id"] == "5a8b57f25542995d1e6f1371" and records[-1]["_id"] == "5a77724455429972597f153e"
    assert records == json.loads(path.read_text(encoding="utf-8"))  # nothing converted or dropped
    assert sum(r["type"] == "bridge" for r in records) == 39 and {r["level"] for r in records} == {"hard"}
    assert len(next(r for r in records if r["_id"] == "5abd259d55429924427fcf1a")["context"]) == 2


def test_limit_keeps_the_first_records(hotpot_sample_path):
    records = load_hotpotqa(hotpot_sample_path, limit=5)
    assert [r["_id"] for r in records] == [r["_id"] for r in load_hotpotqa(hotpot_sample_path)[:5]]


def test_jsonl_gives_the_same_records(tmp_path, hotpot_sample_path):
    records = load_hotpotqa(hotpot_sample_path, limit=7)
    path = tmp_path / "sample.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n", encoding="utf-8")
    assert load_hotpotqa(path) == records
    assert load_hotpotqa(path, limit=3) == records[:3]


# ----- validation errors name the record and the field --------------------------------------------------------------
@pytest.mark.parametrize("field", ["answer", "question", "supporting_facts", "context", "type", "level"])
def test_missing_field_names_the_record_id_and_field(field):
    with pytest.raises(ValueError, match=rf"record 'abc123': missing field '{field}'"):
        validate_record(changed(**{field: ...}), 4)


def test_missing_id_names_the_index():
    with pytest.raises(ValueError, match=r"record at index 4: missing field '_id'"):
        validate_record(changed(_id=...), 4)


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"answer": 3}, r"record 'abc123': field 'answer' must be a string, got int"),
        ({"question": None}, r"field 'question' must be a string, got NoneType"),
        ({"type": "trivia"}, r"field 'type' must be one of \('bridge', 'comparison', 'lookup'\), got 'trivia'"),
        ({"type": "multi"}, r"record 'abc123': field 'sub_answers' is missing, yet the record has type 'multi'"),
        ({"level": "HARD"}, r"field 'level' must be one of"),
        ({"context": {"title": []}}, r"field 'context' must be a list of \[title, sentences\], got dict"),
        ({"context": [["A", "one string"]]}, r"field 'context'\[0\] \('A'\): sentences must be a list of strings"),
        ({"context": [["A"]]}, r"field 'context'\[0\] must be \[title, \[sentences\]\]"),
        ({"supporting_facts": [["Ana Lee", "1"]]}, r"field 'supporting_facts'\[0\] must be \[title, sent_id\]"),
        ({"supporting_facts": [["Ana Lee", True]]}, r"field 'supporting_facts'\[0\] must be \[title, sent_id\]"),
        ({"supporting_facts": "Ana Lee"}, r"field 'supporting_facts' must be a list"),
        ({"supporting_facts": [["Rome", 0]]}, r"field 'supporting_facts'\[0\] names paragraph 'Rome'"),
        ({"supporting_facts": [["Ana Lee", 2]]}, r"points at sentence 2 of 'Ana Lee', which has 2 sentences"),
    ],
)
def test_ill_typed_fields_name_the_record_id_and_field(fields, match):
    with pytest.raises(ValueError, match=match):
        validate_record(changed(**fields), 0)


def test_a_record_that_is_not_an_object_is_named_by_index():
    with pytest.raises(ValueError, match=r"record at index 2: must be a JSON object"):
        validate_record(["not", "a", "record"], 2)


def test_fullwiki_setting_skips_the_supporting_fact_context_check(tmp_path):
    record = changed(supporting_facts=[["Rome", 0]])
    validate_record(record, 0, check_supporting_facts=False)
    path = write_json(tmp_path, [record])
    assert load_hotpotqa(path, name="fullwiki") == [record]
    with pytest.raises(ValueError, match="names paragraph 'Rome'"):
        load_hotpotqa(path, name="distractor")


def test_unlabeled_test_records_need_only_id_question_and_context(tmp_path):
    record = {"_id": "t1", "question": "q?", "context": [["A", ["a."]]]}
    with pytest.raises(ValueError, match="missing field 'answer'"):
        validate_record(record, 0)
    validate_record(record, 0, require_labels=False)
    validate_record({**record, "answer": "", "type": "", "level": ""}, 0, require_labels=False)  # Hub test rows
    with pytest.raises(ValueError, match="field 'answer' must be a string"):
        validate_record({**record, "answer": 1}, 0, require_labels=False)
    assert load_hotpotqa(write_json(tmp_path, [record]), require_labels=False) == [record]


def test_loader_fails_on_the_first_bad_record_instead_of_dropping_it(tmp_path):
    path = write_json(tmp_path, [RECORD, changed(_id="bad1", answer=...), RECORD])
    with pytest.raises(ValueError, match="record 'bad1': missing field 'answer'"):
        load_hotpotqa(path)


def test_file_errors_say_what_is_wrong(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hotpotqa(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="must hold a JSON array"):
        load_hotpotqa(write_json(tmp_path, {"data": [RECORD]}))
    broken = tmp_path / "broken.json"
    broken.write_text("[{", encoding="utf-8")
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_hotpotqa(broken)
    lines = tmp_path / "broken.jsonl"
    lines.write_text(json.dumps(RECORD) + "\n{oops\n", encoding="utf-8")
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        load_hotpotqa(lines)
    other = tmp_path / "data.csv"
    other.write_text("a,b", encoding="utf-8")
    with pytest.raises(ValueError, match="unknown file type '.csv'"):
        load_hotpotqa(other)
    with pytest.raises(ValueError, match="`name` must be one of"):
        load_hotpotqa(other, name="open")


# ----- the Hub layout -----------------------------------------------------------------------------------------------
def test_hub_rows_convert_to_the_official_layout():
    converted = hub_to_official(HUB_ROW, 0)
    assert converted == RECORD
    assert list(converted) == list(RECORD)  # the official key order
    validate_record(converted, 0)


def test_hub_conversion_reports_inconsistent_rows():
    row = copy.deepcopy(HUB_ROW)
    row["supporting_facts"]["sent_id"] = [0]
    with pytest.raises(ValueError, match=r"Hub record 'abc123' \(index 3\): field 'supporting_facts' has 2 'title'"):
        hub_to_official(row, 3)
    row = copy.deepcopy(HUB_ROW)
    del row["context"]["sentences"]
    with pytest.raises(ValueError, match="field 'context' must be a dict with keys"):
        hub_to_official(row, 0)


def test_hub_source_is_loaded_through_datasets_and_converted(monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(path, name, split):
        calls.append((path, name, split))
        other = {**copy.deepcopy(HUB_ROW), "id": "def456"}
        return datasets.Dataset.from_list([copy.deepcopy(HUB_ROW), other])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    records = load_hotpotqa("hotpotqa/hotpot_qa", split="train", name="distractor", limit=1)
    assert calls == [("hotpotqa/hotpot_qa", "distractor", "train")]
    assert records == [RECORD]


# ----- multi-objective records --------------------------------------------------------------------------------------
def test_multi_objective_records_of_real_questions_validate(hotpot_sample_records):
    from memopd_trl.envs.multi import make_multi_objective_tasks

    tasks = make_multi_objective_tasks(hotpot_sample_records, k=2, seed=0)
    for index, task in enumerate(tasks):
        validate_record(task, index)  # supporting facts of every sub-question point into the united context
    assert {task["type"] for task in tasks} == {"multi"}


@pytest.mark.parametrize(
    "fields, match",
    [
        (
            {"answer": "Porto ; Lisbon"},
            r"record 'abc123': field 'answer' \('Porto ; Lisbon'\) must be the sub-answers",
        ),
        (
            {"sub_answers": ["Porto;"], "answer": "Porto;"},
            r"record 'abc123': field 'sub_answers'\[0\] \('Porto;'\) holds",
        ),
        ({"type": "bridge"}, r"record 'abc123': field 'type' of a multi-objective task must be 'multi'"),
    ],
)
def test_broken_multi_objective_records_name_the_record_and_field(fields, match):
    record = changed(type="multi", sub_answers=["Porto"], sub_ids=["abc123"], sub_types=["bridge"])
    record["sub_questions"] = [RECORD["question"]]
    validate_record(record, 0)  # sound as it is
    record.update(fields)
    with pytest.raises(ValueError, match=match):
        validate_record(record, 0)
