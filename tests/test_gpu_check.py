"""benchmarks/gpu_check.py is run on GPU machines only now and then: its toy-size mode runs here so it does not rot."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


pytestmark = pytest.mark.subprocess  # starts other processes: deselect with -m "not subprocess"


SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def test_gpu_check_runs_every_section_at_toy_sizes(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(out)], capture_output=True, text=True, env=env,
        timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    sections = {entry["section"]: entry for entry in json.loads(out.read_text())}
    assert set(sections) == {"environment", "alignment", "layouts", "trainer", "rollout"}
    assert sections["rollout"]["same_sampled_tokens"] and sections["rollout"]["seconds_shared_prefill"] > 0
    fp32 = [r for r in sections["alignment"]["results"] if r["dtype"] == "float32"]
    assert {(r["attn"], r["shared"]) for r in fp32} >= {("sdpa", True), ("memopd_sdpa_varlen", True)}
    assert all(r["max_abs"] <= 1e-4 for r in fp32)
    assert sections["trainer"]["share_prefix"] and sections["trainer"]["ok"]
    layouts = sections["layouts"]["tokens_processed"]
    shared = next(v for k, v in layouts.items() if k.startswith("shared-prefix"))
    packed = next(v for k, v in layouts.items() if k.startswith("packed"))
    assert shared < packed
