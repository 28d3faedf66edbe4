"""benchmarks/trough.py (why MemOPD first breaks its student) on the smoke preset, and the validation split it uses."""

import json
import math
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def trough(import_benchmark):
    return import_benchmark("trough")


def test_the_validation_tasks_are_neither_trained_on_nor_imitated(hotpot):
    import offline_lab as offline

    args, _, _ = hotpot.parse_args(["--config", str(ROOT / "examples" / "smoke.yaml")])
    world = offline.make_offline_world(args, **args.env_settings())
    train, validation = offline.validation_tasks(world, args)
    assert len(validation) == args.teacher_select_tasks and train + validation == world.train
    ids = {task["_id"] for task in validation}
    assert not ids & {task["_id"] for task in train}
    assert not ids & {task["_id"] for task in world.train[: args.student_warmup_questions]}, "the start imitated them"
    assert not ids & {task["_id"] for task in world.evaluation}
    with pytest.raises(ValueError, match="teacher_select_tasks"):
        offline.validation_tasks(world, type(args)(**{**vars(args), "teacher_select_tasks": 0}))


def test_the_trough_report_splits_the_step0_loss_and_the_moves_by_turn_and_part(trough, tmp_path):
    report = trough.main(["--config", str(ROOT / "examples" / "smoke.yaml"), "--output_dir", str(tmp_path),
                          "--trough_step", "1", "--num_tasks", "2", "--distill_divergence_threshold", "0.1"])  # fmt: skip
    assert json.loads((tmp_path / "trough-0-1.json").read_text())["trough_step"] == 1
    for name in ("step0_loss", "trough_loss"):
        loss = dict(report[name])
        first = loss.pop("first divergence")  # each episode once: where its first divergent token is, or none
        assert sum(first.values()) == 2 * 2  # num_tasks x the smoke's num_generations
        totals = {key: cell for key, cell in loss.items() if key.endswith("/all")}
        assert sum(cell["loss_share"] for cell in totals.values()) == pytest.approx(1.0, abs=1e-6)
        for key, cell in loss.items():
            assert 0 <= cell["kept"] <= cell["tokens"] and 0 <= cell["below"] <= cell["tokens"], key
            assert key.split("/")[1] in (*trough.PARTS, "all")
        parts = [cell for key, cell in loss.items() if not key.endswith("/all")]
        assert sum(cell["tokens"] for cell in parts) == sum(cell["tokens"] for cell in totals.values())
        # The mask keeps every token up to the first divergence: an episode that never diverges is kept whole.
        below = sum(cell["below"] for cell in totals.values())
        assert (below == 0) == (first["none"] == sum(first.values()))
    for name in ("start", "trough"):
        assert set(report[f"{name}_greedy"]) >= {"f1", "turns", "malformed_per_episode", "by_turn"}
        assert 0 in report[f"{name}_takeover"]
        own, finishing = report[f"{name}_greedy"]["f1"], report[f"{name}_finishes_teacher"]
        assert finishing[0]["f1"] == pytest.approx(own), "from turn 0 the model plays the teacher's episodes alone"
    for name in ("teacher_greedy", "teacher_sampled", "trough_sampled"):  # the episodes per F1 add up, and average
        stats = report[name]
        counts = stats["f1_counts"]
        total = sum(float(f1) * n for f1, n in counts.items())
        assert sum(counts.values()) * stats["f1"] == pytest.approx(total, abs=0.01)
        assert 1 <= len(stats["examples"]) <= 2 and all(isinstance(text, str) for text in stats["examples"][0])
    assert sum(report["teacher_sampled"]["f1_counts"].values()) == 2 * 2  # num_tasks x the smoke's num_generations
    moved = report["logprobs_on_start_samples"]
    assert all(cell["start"] <= 0 and cell["trough"] <= 0 for cell in moved.values())
    # On the teacher's tokens, the branch point is one token per episode at most, the start's first below the bound.
    teacher = report["logprobs_on_teacher_greedy"]
    at = [cell for key, cell in teacher.items() if key.endswith("/at the branch")]
    assert sum(cell["tokens"] for cell in at) <= 2 and all(cell["start"] < math.log(0.1) for cell in at)


def test_branch_points_split_each_episode_at_its_first_unlikely_token(trough):
    rows = [{"episode": e, "start": lp} for e, lp in ((0, -0.1), (0, -3.0), (0, -0.1), (0, -5.0), (1, -0.2))]
    marks = [row["branch"] for row in trough.mark_branch_points(rows, threshold=0.1)]
    assert marks == ["before", "at", "after", "after", "before"]


def test_token_parts_follow_the_tags(trough, tiny_tokenizer):
    from memopd_trl.envs.base import ActionFormat

    text = "<memory>facts</memory> <search>query</search>"
    ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    parts = trough.token_parts(tiny_tokenizer, ids, ActionFormat())
    decoded = [tiny_tokenizer.decode([i]) for i in ids]
    by_part = {part: "".join(d for d, p in zip(decoded, parts, strict=True) if p == part) for part in set(parts)}
    assert by_part["memory"].strip() == "facts" and by_part["query"].strip() == "query"
    assert "<memory>" in by_part["format"] and "</search>" in by_part["format"]
