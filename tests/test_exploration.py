"""benchmarks/exploration.py (how much the start explores, for PPO) on the smoke preset, and its group statistics."""

from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def exploration(import_benchmark):
    return import_benchmark("exploration")


def test_group_stats_count_the_groups_a_group_relative_advantage_learns_from(exploration):
    stats = exploration.group_stats([[0.0, 0.0], [1.0, 0.0], [0.5, 0.5]])
    assert stats["differing_groups"] == pytest.approx(1 / 3)
    assert stats["reward_std"] == pytest.approx(0.5 / 3)
    assert exploration.group_stats([[0.2]])["differing_groups"] == 0.0
    with pytest.raises(ValueError, match="non-empty"):
        exploration.group_stats([[1.0], []])


def test_the_report_covers_each_temperature_and_group_size(exploration, tmp_path):
    report = exploration.main(["--config", str(ROOT / "examples" / "smoke.yaml"), "--output_dir", str(tmp_path),
                               "--temperatures", "0.5", "2.0", "--group_size", "4", "--num_tasks", "2"])  # fmt: skip
    assert (tmp_path / "exploration-0.json").is_file()
    assert set(report["temperatures"]) == {"0.5", "2.0"}
    for row in report["temperatures"].values():
        assert set(row) == {"f1", "entropy_per_token", "malformed_per_episode", "turns", "groups_of_4"}
        assert 0.0 <= row["groups_of_4"]["differing_groups"] <= 1.0 and row["entropy_per_token"] > 0
    # A hotter sampler is less certain of the tokens it samples.
    assert report["temperatures"]["2.0"]["entropy_per_token"] > report["temperatures"]["0.5"]["entropy_per_token"]
    with pytest.raises(SystemExit, match="group_size"):
        exploration.main(["--config", str(ROOT / "examples" / "smoke.yaml"), "--group_size", "1"])
