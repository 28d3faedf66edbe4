"""Multi-process training through accelerate (two CPU processes, gloo): gradients are all-reduced, groups stay local."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


pytestmark = pytest.mark.subprocess  # starts other processes: deselect with -m "not subprocess"


SCRIPT = Path(__file__).resolve().parent / "distributed" / "two_process_training.py"


@pytest.mark.parametrize("options", [[], ["--gae"]], ids=["group", "gae"])
def test_two_processes_train_in_sync_on_different_questions(tmp_path, options):
    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent)) or shutil.which("accelerate")
    assert accelerate, "the accelerate launcher is not installed"
    # On a machine without GPUs `--multi_gpu` starts torchrun processes that fall back to CPU with the gloo backend
    # (`--cpu` alone starts a single process).
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(
        [accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--main_process_port", "29517", str(SCRIPT),
         *options],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "[rank 0] OK" in output and "[rank 1] OK" in output, output[-4000:]
