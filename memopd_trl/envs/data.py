"""Load HotpotQA records, in the official layout, from a local file or the Hugging Face Hub, and validate them.

The official layout (the JSON files of the HotpotQA release) has seven fields per record:

| field | type |
| --- | --- |
| `_id` | `str` |
| `answer` | `str` (absent from the official test file) |
| `question` | `str` |
| `supporting_facts` | `[[title, sent_id], ...]` (`[str, int]`; absent from the official test file) |
| `context` | `[[title, [sentence, ...]], ...]` |
| `type` | `"bridge"` or `"comparison"` (the synthetic world also has single-hop `"lookup"`) |
| `level` | `"easy"`, `"medium"` or `"hard"` |

The Hub copy (`hotpotqa/hotpot_qa`) stores the same data differently: `id` instead of `_id`, `context` as
`{"title": [...], "sentences": [[...], ...]}` and `supporting_facts` as `{"title": [...], "sent_id": [...]}`;
`hub_to_official` converts it. Every record is validated and a bad one raises; none is silently dropped.

A multi-objective record (k sub-questions in one task, made by `memopd_trl.envs.multi.make_multi_objective_tasks`)
has the same seven fields, with `type` `"multi"` and `answer` the sub-answers joined by `" ; "`, plus four lists of
length k: `sub_ids`, `sub_questions`, `sub_answers` and `sub_types` (each `"bridge"` or `"comparison"`).
"""

import json
from pathlib import Path
from typing import Any

from ..metrics import MULTI_ANSWER_SEPARATOR


LABEL_FIELDS = ("answer", "supporting_facts", "type", "level")
QUESTION_TYPES = ("bridge", "comparison", "lookup")  # "lookup": the synthetic world's single-hop questions
LEVELS = ("easy", "medium", "hard")
SETTINGS = ("distractor", "fullwiki")
MULTI_OBJECTIVE_TYPE = "multi"
MULTI_OBJECTIVE_FIELDS = ("sub_ids", "sub_questions", "sub_answers", "sub_types")


def is_multi_objective(record: dict[str, Any]) -> bool:
    """Whether `record` is a multi-objective task: it has a `sub_answers` field (or says `type` `"multi"`)."""
    return "sub_answers" in record or record.get("type") == MULTI_OBJECTIVE_TYPE


def multi_objective_problem(record: dict[str, Any]) -> str | None:
    """
    What is wrong with the multi-objective fields of `record`, if anything.

    A record with none of `sub_ids`, `sub_questions`, `sub_answers`, `sub_types` and a `type` other than `"multi"` is a
    single question: nothing to check. Otherwise `sub_answers` must be a non-empty list of non-empty strings, none
    holding the separator's `;`; `answer` (when present) must be them joined by `" ; "`; the other lists, when
    present, must have one entry per sub-answer (strings; `sub_types` each `"bridge"` or `"comparison"`).

    Returns:
        `str` or `None`: the problem, naming the field and what to do, or `None` when the fields are sound.
    """
    present = [name for name in MULTI_OBJECTIVE_FIELDS if name in record]
    if not present and record.get("type") != MULTI_OBJECTIVE_TYPE:
        return None
    hint = "make such records with memopd_trl.envs.multi.make_multi_objective_tasks"
    if "sub_answers" not in record:
        what = f"field(s) {present}" if present else "type 'multi'"
        return f"field 'sub_answers' is missing, yet the record has {what} of a multi-objective task; {hint}."
    sub_answers = record["sub_answers"]
    if not isinstance(sub_answers, list) or not sub_answers:
        return f"field 'sub_answers' must be a non-empty list of strings, got {sub_answers!r:.120}; {hint}."
    separator = MULTI_ANSWER_SEPARATOR.strip()
    for i, answer in enumerate(sub_answers):
        if not isinstance(answer, str) or not answer.strip():
            return f"field 'sub_answers'[{i}] must be a non-empty string, got {answer!r:.120}."
        if separator in answer:
            return (
                f"field 'sub_answers'[{i}] ({answer!r:.120}) holds {separator!r}, the separator of sub-answers; "
                "leave records whose answer holds it out of multi-objective tasks."
            )
    if "answer" in record and record["answer"] != MULTI_ANSWER_SEPARATOR.join(sub_answers):
        return (
            f"field 'answer' ({record['answer']!r:.120}) must be the sub-answers joined by "
            f"{MULTI_ANSWER_SEPARATOR!r}, i.e. {MULTI_ANSWER_SEPARATOR.join(sub_answers)!r:.120}."
        )
    for name in ("sub_ids", "sub_questions", "sub_types"):
        if name not in record:
            continue
        values = record[name]
        if not isinstance(values, list) or len(values) != len(sub_answers):
            return (
                f"field {name!r} must be a list with one entry per sub-answer ({len(sub_answers)}), got "
                f"{values!r:.120}."
            )
        for i, value in enumerate(values):
            if not isinstance(value, str) or not value.strip():
                return f"field {name!r}[{i}] must be a non-empty string, got {value!r:.120}."
            if name == "sub_types" and value not in QUESTION_TYPES:
                return f"field 'sub_types'[{i}] must be one of {QUESTION_TYPES}, got {value!r}."
    if record.get("type", MULTI_OBJECTIVE_TYPE) != MULTI_OBJECTIVE_TYPE:
        return f"field 'type' of a multi-objective task must be {MULTI_OBJECTIVE_TYPE!r}, got {record['type']!r}."
    return None


def _fail(record: Any, index: int | None, message: str) -> ValueError:
    record_id = record.get("_id") if isinstance(record, dict) else None
    usable = isinstance(record_id, str) and record_id.strip()
    where = f"record {record_id!r}" if usable else f"record at index {index}"
    return ValueError(f"HotpotQA {where}: {message}")


def _check_text(record: Any, index: int | None, field: str, text: str) -> None:
    # JSON's \u escapes can spell a lone surrogate (e.g. "\ud800"), which is not Unicode text: tokenizers refuse it.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise _fail(
            record,
            index,
            f"field {field} holds a lone surrogate ({text[err.start]!r}), which is not valid Unicode text; fix the "
            "file's \\u escapes (a surrogate must come in a high+low pair).",
        ) from None


def validate_record(
    record: Any, index: int | None = None, require_labels: bool = True, check_supporting_facts: bool = True
) -> None:
    """
    Check that a record has HotpotQA's official layout; raise a `ValueError` naming the record `_id` (or its index
    when it has no usable `_id`) and the field otherwise. Text fields must be valid Unicode (no lone surrogate from a
    bad `\\u` escape); `_id`, `question` and (when labels are required) `answer` must not be empty. A multi-objective
    record's `sub_*` fields are checked too (`multi_objective_problem`).

    Args:
        record (`dict`): the record.
        index (`int`, *optional*): its position in the file, named in errors when `_id` is missing.
        require_labels (`bool`, *optional*, defaults to `True`):
            Whether `answer`, `supporting_facts`, `type` and `level` must be present. The official test file has
            only `_id`, `question` and `context`; labels that are present are type-checked either way.
        check_supporting_facts (`bool`, *optional*, defaults to `True`):
            Whether every supporting fact must name a `context` paragraph and a sentence inside it. True in the
            distractor setting; in the fullwiki setting the gold paragraphs may be missing from `context`.
    """
    if not isinstance(record, dict):
        raise _fail(record, index, f"must be a JSON object (dict), got {type(record).__name__}.")
    required = ("_id", "question", "context") + (LABEL_FIELDS if require_labels else ())
    for name in required:
        if name not in record:
            raise _fail(record, index, f"missing field {name!r}.")
    for name in ("_id", "question", "answer", "type", "level"):
        if name in record and not isinstance(record[name], str):
            raise _fail(record, index, f"field {name!r} must be a string, got {type(record[name]).__name__}.")
        if name in record:
            _check_text(record, index, repr(name), record[name])
    for name in ("_id", "question") + (("answer",) if require_labels else ()):
        if not record[name].strip():
            hint = " (pass require_labels=False for unlabeled data)" if name == "answer" else ""
            raise _fail(record, index, f"field {name!r} is empty; it must hold text{hint}.")
    multi_problem = multi_objective_problem(record)
    if multi_problem is not None:
        raise _fail(record, index, multi_problem)
    types = QUESTION_TYPES + ((MULTI_OBJECTIVE_TYPE,) if is_multi_objective(record) else ())
    for name, allowed in (("type", types), ("level", LEVELS)):
        value = record.get(name)
        if value is not None and value not in allowed and (require_labels or value != ""):
            raise _fail(record, index, f"field {name!r} must be one of {allowed}, got {value!r}.")

    context = record["context"]
    if not isinstance(context, list):
        raise _fail(
            record, index, f"field 'context' must be a list of [title, sentences], got {type(context).__name__}."
        )
    paragraphs: dict[str, int] = {}
    for i, paragraph in enumerate(context):
        if not (isinstance(paragraph, list | tuple) and len(paragraph) == 2 and isinstance(paragraph[0], str)):
            raise _fail(record, index, f"field 'context'[{i}] must be [title, [sentences]], got {paragraph!r:.120}.")
        title, sentences = paragraph
        if not isinstance(sentences, list | tuple) or not all(isinstance(s, str) for s in sentences):
            raise _fail(record, index, f"field 'context'[{i}] ({title!r}): sentences must be a list of strings.")
        _check_text(record, index, f"'context'[{i}]", title + "".join(sentences))
        paragraphs.setdefault(title, len(sentences))

    if "supporting_facts" not in record:
        return
    facts = record["supporting_facts"]
    if not isinstance(facts, list):
        raise _fail(record, index, f"field 'supporting_facts' must be a list of [title, sent_id], got {facts!r:.120}.")
    for i, fact in enumerate(facts):
        valid = isinstance(fact, list | tuple) and len(fact) == 2 and isinstance(fact[0], str)
        if not valid or not isinstance(fact[1], int) or isinstance(fact[1], bool):
            raise _fail(record, index, f"field 'supporting_facts'[{i}] must be [title, sent_id], got {fact!r:.120}.")
        if not check_supporting_facts:
            continue
        title, sent_id = fact
        if title not in paragraphs:
            raise _fail(
                record,
                index,
                f"field 'supporting_facts'[{i}] names paragraph {title!r}, which is not in 'context' (pass "
                "check_supporting_facts=False, or name='fullwiki', for data whose contexts may lack gold paragraphs).",
            )
        if not 0 <= sent_id < paragraphs[title]:
            raise _fail(
                record,
                index,
                f"field 'supporting_facts'[{i}] points at sentence {sent_id} of {title!r}, which has "
                f"{paragraphs[title]} sentences (pass check_supporting_facts=False to skip this check).",
            )


def hub_to_official(record: dict[str, Any], index: int | None = None) -> dict[str, Any]:
    """
    Convert a record of the Hub dataset `hotpotqa/hotpot_qa` to the official layout.

    Args:
        record (`dict`): a Hub row: `id`, `question`, `answer`, `type`, `level`,
            `supporting_facts` = `{"title": [...], "sent_id": [...]}`, `context` = `{"title": [...], "sentences": [...]}`.
        index (`int`, *optional*): its position, named in errors.

    Returns:
        `dict`: the record with `_id`, `answer`, `question`, `supporting_facts` (`[[title, sent_id], ...]`),
        `context` (`[[title, [sentences]], ...]`), `type`, `level` (fields absent from the row stay absent).
    """
    if not isinstance(record, dict):
        raise ValueError(f"Hub record at index {index} must be a dict, got {type(record).__name__}.")
    where = f"Hub record {record.get('id', record.get('_id'))!r} (index {index})"
    out: dict[str, Any] = {"_id": record.get("id", record.get("_id"))}
    for name in ("answer", "question"):
        if name in record:
            out[name] = record[name]
    for name, keys in (("supporting_facts", ("title", "sent_id")), ("context", ("title", "sentences"))):
        if name not in record:
            continue
        value = record[name]
        if isinstance(value, list):  # already in the official layout
            out[name] = value
            continue
        if not isinstance(value, dict) or any(key not in value for key in keys):
            raise ValueError(f"{where}: field {name!r} must be a dict with keys {keys}, got {value!r:.120}.")
        first, second = (list(value[key]) for key in keys)
        if len(first) != len(second):
            raise ValueError(
                f"{where}: field {name!r} has {len(first)} {keys[0]!r} entries but {len(second)} {keys[1]!r} entries."
            )
        out[name] = [[a, list(b) if name == "context" else b] for a, b in zip(first, second, strict=True)]
    for name in ("type", "level"):
        if name in record:
            out[name] = record[name]
    if out["_id"] is None:
        del out["_id"]
    return out


def load_hotpotqa(
    source: str | Path,
    split: str = "validation",
    name: str = "distractor",
    limit: int | None = None,
    require_labels: bool = True,
) -> list[dict[str, Any]]:
    """
    Load HotpotQA records in the official layout, validating every one.

    Args:
        source (`str` or `Path`):
            A local `.json` file (one array, as in the official release), a local `.jsonl` file (one record per
            line), or a Hub dataset id such as `"hotpotqa/hotpot_qa"`.
        split (`str`, *optional*, defaults to `"validation"`):
            Hub split (ignored for local files).
        name (`str`, *optional*, defaults to `"distractor"`):
            The setting: `"distractor"` or `"fullwiki"`. For the Hub it is the dataset config; for every source it
            decides whether supporting facts must point into `context` (distractor) or not (fullwiki).
        limit (`int`, *optional*):
            Keep only the first `limit` records.
        require_labels (`bool`, *optional*, defaults to `True`):
            Require `answer`, `supporting_facts`, `type` and `level` (set `False` for an unlabeled test file).

    Returns:
        `list[dict]`: the records, in file order. Every record is kept as it is: none is dropped or repaired, and a
        bad one, a file that is not UTF-8 (its line is named) or a line that is not JSON raises a `ValueError`.
    """
    if name not in SETTINGS:
        raise ValueError(f"`name` must be one of {SETTINGS}, got {name!r}.")
    if limit is not None and limit < 0:
        raise ValueError(f"`limit` must be None or >= 0, got {limit}.")
    path = Path(source)
    suffix = path.suffix.lower()
    if suffix in (".json", ".jsonl") or path.exists():
        if not path.is_file():
            raise FileNotFoundError(f"HotpotQA file {str(path)!r} does not exist.")
        records = _read_local(path, suffix, limit)
    else:
        records = _read_hub(str(source), split, name, limit)
    for index, record in enumerate(records):
        validate_record(record, index, require_labels=require_labels, check_supporting_facts=name == "distractor")
    return records


def _read_local(path: Path, suffix: str, limit: int | None) -> list[dict[str, Any]]:
    if suffix == ".jsonl":
        records = []
        with path.open("rb") as file:
            for line_number, raw in enumerate(file, start=1):
                if limit is not None and len(records) >= limit:
                    break
                line = _decode(path, raw, line_number)
                if not line.strip():
                    continue
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}: line {line_number} is not valid JSON ({err.msg}).") from None
        return records
    if suffix != ".json":
        raise ValueError(f"{path}: unknown file type {suffix!r}; give a .json (array) or .jsonl (one record a line).")
    try:
        data = json.loads(_decode(path, path.read_bytes()))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err.msg} at line {err.lineno}).") from None
    if not isinstance(data, list):
        raise ValueError(
            f"{path} must hold a JSON array of records (HotpotQA's official layout), got {type(data).__name__}."
        )
    return data[:limit] if limit is not None else data


def _decode(path: Path, raw: bytes, line_number: int | None = None) -> str:
    """Decodes the UTF-8 bytes of `path` (the whole file, or its line `line_number`), naming where a bad byte is."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        if line_number is None:
            line_number = raw.count(b"\n", 0, err.start) + 1
            column = err.start - raw.rfind(b"\n", 0, err.start)
        else:
            column = err.start + 1
        raise ValueError(
            f"{path}: line {line_number}, byte {column} of the line is not valid UTF-8 ({raw[err.start]:#04x}: "
            f"{err.reason}); HotpotQA files must be UTF-8, so re-encode this one (e.g. with `iconv -t UTF-8`)."
        ) from None


def _read_hub(source: str, split: str, name: str, limit: int | None) -> list[dict[str, Any]]:
    from datasets import load_dataset

    dataset = load_dataset(source, name, split=split)
    if limit is not None:
        dataset = dataset.select(range(min(limit, len(dataset))))
    return [hub_to_official(row, index) for index, row in enumerate(dataset)]
