"""offline_lab.report: the summary over seeds, the markdown table, results.json and the F1 plot."""

import json
import statistics

import pytest

from offline_lab.report import (
    describe,
    eval_curve,
    format_table,
    misalignment_curve,
    plot_curves,
    plot_misalignment,
    summarize,
    write_report,
)


RUNS = [
    {"arm": "ppo", "seed": 0, "f1": 0.2, "em": 0.1, "curve": [[0, 0.1, 0.0], [2, 0.2, 0.1]]},
    {"arm": "memopd", "seed": 0, "f1": 0.5, "em": 0.4, "curve": [[0, 0.1, 0.0], [2, 0.5, 0.4]]},
    {"arm": "ppo", "seed": 1, "f1": 0.4, "em": 0.3, "curve": [[0, 0.1, 0.0], [2, 0.4, 0.3]]},
    {"arm": "memopd", "seed": 1, "f1": 0.7, "em": 0.6, "curve": [[0, 0.1, 0.0], [2, 0.7, 0.6]]},
]
SETUP = {"teacher": {"f1": 0.8, "em": 0.7}, "student_init": {"f1": 0.1, "em": 0.0}}


def test_eval_curve_starts_at_step_zero_and_keeps_only_evaluations():
    log_history = [
        {"step": 1, "loss": 0.3},
        {"step": 1, "eval_f1": 0.25, "eval_em": 0.2},
        {"step": 2, "loss": 0.2},
        {"step": 2, "eval_f1": 0.5, "eval_em": 0.4},
    ]
    assert eval_curve(log_history, {"f1": 0.1, "em": 0.0}) == [[0, 0.1, 0.0], [1, 0.25, 0.2], [2, 0.5, 0.4]]


def test_misalignment_curve_keeps_the_audited_entries_by_turn():
    log_history = [
        {
            "step": 10,
            "loss": 0.3,
            "misalignment/kl": 0.5,
            "misalignment/kl_turn_10": 0.1,
            "misalignment/kl_turn_2": 1.5,
        },
        {"step": 20, "loss": 0.2},
        {"step": 20, "eval_f1": 0.5, "eval_em": 0.4},
        {"step": 30, "misalignment/kl_turn_0": 0.0},
    ]
    curve = misalignment_curve(log_history)
    assert curve == [
        [10, {"2": 1.5, "10": 0.1}],
        [30, {"0": 0.0}],
    ]  # turns in numeric order; the overall mean left out
    assert list(curve[0][1]) == ["2", "10"]
    assert misalignment_curve([{"step": 1, "loss": 0.1}]) == []


def test_misalignment_plot_only_when_a_run_was_audited(tmp_path):
    assert not plot_misalignment(RUNS, tmp_path / "none.png") and not (tmp_path / "none.png").exists()
    audited = [{**RUNS[1], "misalignment": [[10, {"0": 0.0, "2": 1.5}]]}, {**RUNS[3], "misalignment": []}]
    assert plot_misalignment(audited, tmp_path / "kl.png")
    assert (tmp_path / "kl.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_summary_is_the_mean_and_sample_std_over_seeds_in_first_arm_order():
    summary = summarize(RUNS)
    assert list(summary) == ["ppo", "memopd"]
    assert summary["ppo"]["f1_mean"] == pytest.approx(0.3)
    assert summary["ppo"]["f1_std"] == pytest.approx(statistics.stdev([0.2, 0.4]))
    assert summary["memopd"]["em_mean"] == pytest.approx(0.5)
    assert summary["memopd"]["f1_per_seed"] == [0.5, 0.7]
    (single,) = summarize(RUNS[:1]).values()
    assert single["f1_std"] == 0.0 and single["em_std"] == 0.0


def test_table_lists_the_setup_then_every_arm():
    lines = format_table(summarize(RUNS), SETUP).splitlines()
    assert lines[:2] == ["| model | held-out F1 | held-out EM | seeds |", "|---|---:|---:|---:|"]
    assert lines[2] == "| teacher (imitated the full-memory expert, compact contexts only) | 0.800 | 0.700 | - |"
    assert lines[3] == "| student start | 0.100 | 0.000 | - |"
    assert lines[4] == "| ppo (PPO on the final F1 only, no teacher) | 0.300 ± 0.141 | 0.200 ± 0.141 | 2 |"
    assert lines[5].startswith("| memopd (aligned: teacher scores each action in the student's state) | 0.600 ± 0.141 |")
    assert len(lines) == 6
    assert len(format_table(summarize(RUNS), {}).splitlines()) == 4


def test_each_row_is_named_for_what_it_rests_on():
    setup = {"teacher": {"f1": 0.8, "em": 0.7, "full_history_f1": 0.7}, "student_init": {"f1": 0.1, "em": 0.0, "from_teacher": False}}
    lines = format_table(summarize([{**RUNS[0], "arm": "memopd_persistent"}]), setup).splitlines()
    assert lines[2].startswith("| teacher (imitated the full-memory expert, both layouts) |")
    assert lines[3].startswith("| student start (from the shared pretraining, taught the forgetful expert) |")
    assert lines[4].startswith("| memopd_persistent (control: teacher scores the flattened history; it saw both layouts) |")
    from_teacher = {"student_init": {"from_teacher": True}}
    assert describe("student_init", from_teacher) == "student start (from the teacher's weights, taught the forgetful expert)"
    assert describe("configured", setup) == "configured"
    native = {"teacher": {"full_history_f1": 0.7, "recipe": {"full_history": True, "history_native": True}}}
    assert describe("teacher", native).startswith("teacher (imitated the full-memory expert in compact contexts, and ")
    assert describe("memopd_persistent", native).endswith("it saw both layouts, the history read whole)")
    native["teacher"]["recipe"]["history_memory"] = "searches"
    assert "reads all of it with 'searches' memory" in describe("teacher", native)
    assert describe("memopd_persistent", native).endswith("the history read whole, 'searches' memory there)")


def test_write_report_writes_results_and_the_plot(tmp_path):
    results = {"runs": RUNS, "setup": SETUP, "summary": summarize(RUNS), "seeds": [0, 1]}
    table = write_report(results, tmp_path)
    assert json.loads((tmp_path / "results.json").read_text()) == results
    assert (tmp_path / "eval_f1.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "misalignment.png").exists(), "no run was audited"
    assert table == format_table(results["summary"], SETUP)
    results["runs"] = [{**RUNS[1], "misalignment": [[10, {"0": 0.0, "2": 1.5}]]}]
    write_report(results, tmp_path)
    assert (tmp_path / "misalignment.png").stat().st_size > 0


def test_plot_without_a_teacher(tmp_path):
    plot_curves(RUNS[:1], {}, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 0
