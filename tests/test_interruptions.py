"""No interruption costs a run: a kill at any moment (between steps, mid-step, mid-checkpoint) or a SIGTERM, then
`resume_from_checkpoint=True`, reaches the weights of an uninterrupted run. The interrupted runs are real
subprocesses (tests/interruption_run.py) stopped by real signals; the resumed runs are built here, in-process."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from interruption_run import MAX_STEPS, build_trainer


pytestmark = pytest.mark.subprocess  # starts other processes: deselect with -m "not subprocess"


SCRIPT = Path(__file__).resolve().parent / "interruption_run.py"
ENV = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", CUDA_VISIBLE_DEVICES="")


def start(output_dir: Path, *options: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), str(output_dir), *options],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=ENV,
    )


def wait_for(path: Path, process: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if process.poll() is not None:
            raise AssertionError(f"the run ended before {path.name}:\n{process.stdout.read()[-3000:]}")
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"no {path.name} after {timeout} s")
        time.sleep(0.02)


def resume(output_dir: Path):
    """What a user does after an interruption: resume if anything was saved, else start again."""
    trainer = build_trainer(output_dir)
    saved = any(output_dir.glob("checkpoint-*"))
    trainer.train(resume_from_checkpoint=True if saved else None)
    return trainer


def assert_same_weights(expected, trainer, context: str) -> None:
    assert trainer.state.global_step == MAX_STEPS, context
    for (name, a), b in zip(expected.named_parameters(), trainer.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=f"{name} differs ({context})")


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run, and how long its training took."""
    trainer = build_trainer(tmp_path_factory.mktemp("straight"))
    start_time = time.perf_counter()
    trainer.train()
    return trainer.model, time.perf_counter() - start_time


def test_resume_skips_a_checkpoint_cut_short_and_uses_the_last_complete_one(tmp_path, straight):
    # SIGKILL while checkpoint-3 is written: it holds the weights but no optimizer or trainer state.
    process = start(tmp_path, "--kill-in-checkpoint", "3")
    assert process.wait(timeout=300) == -signal.SIGKILL, process.stdout.read()[-3000:]
    cut = tmp_path / "checkpoint-3"
    assert (cut / "model.safetensors").exists() and not (cut / "trainer_state.json").exists()
    trainer = build_trainer(tmp_path)
    with pytest.warns(
        UserWarning, match=r"Skipping incomplete checkpoint\(s\) \['checkpoint-3'\].*resuming from checkpoint-2"
    ):
        trainer.train(resume_from_checkpoint=True)
    assert_same_weights(straight[0], trainer, "killed in checkpoint-3")


def test_resume_with_only_an_incomplete_checkpoint_starts_from_the_beginning(tmp_path, straight):
    process = start(tmp_path, "--kill-in-checkpoint", "1")
    assert process.wait(timeout=300) == -signal.SIGKILL, process.stdout.read()[-3000:]
    trainer = build_trainer(tmp_path)
    with pytest.warns(UserWarning, match=r"Every checkpoint .* is incomplete.*starts from the beginning"):
        trainer.train(resume_from_checkpoint=True)
    assert_same_weights(straight[0], trainer, "killed in checkpoint-1")


def test_sigterm_saves_a_checkpoint_exits_0_and_the_resume_continues_exactly(tmp_path, straight):
    # No checkpoints are planned (`save_strategy="no"`): without the handler SIGTERM lost every step.
    process = start(tmp_path, "--save-steps", "0", "--pause-after-step", "1")
    wait_for(tmp_path / "step-1", process)
    process.send_signal(signal.SIGTERM)
    output = process.communicate(timeout=300)[0]
    assert process.returncode == 0, output[-3000:]
    assert "SIGTERM: stopped after step 1 and saved checkpoint-1" in output, output[-3000:]
    assert [p.name for p in tmp_path.glob("checkpoint-*")] == ["checkpoint-1"]
    assert not (tmp_path / "step-2").exists(), "the run went on after the signal"
    assert_same_weights(straight[0], resume(tmp_path), "SIGTERM after step 1")


@pytest.mark.parametrize("saving", [["--save-steps", "0"], ["--save-best"]], ids=["no-saves-planned", "save-best"])
def test_sigterm_during_an_evaluation_stops_it_at_the_next_turn_and_saves_that_steps_checkpoint(
    tmp_path, straight, saving
):
    # An evaluation after every step; the signal arrives at the first model call of the one after step 1. Its episodes
    # last 2 turns: the evaluation must end before the second, and the run must not train step 2 first. With
    # `save_strategy="best"` the dropped evaluation has no metric to compare, and the checkpoint is saved all the same.
    process = start(tmp_path, *saving, "--eval-steps", "1", "--signal-in-eval", "1")
    output = process.communicate(timeout=300)[0]
    assert process.returncode == 0, output[-3000:]
    assert "SIGTERM during the evaluation at step 1: the evaluation is dropped" in output, output[-3000:]
    assert "SIGTERM: stopped after step 1 and saved checkpoint-1" in output, output[-3000:]
    assert [p.name for p in tmp_path.glob("eval-call-*")] == ["eval-call-1"], "the evaluation went on after the signal"
    assert "eval_f1" not in output, "a stopped evaluation was reported"
    assert [p.name for p in tmp_path.glob("checkpoint-*")] == ["checkpoint-1"]
    assert not (tmp_path / "step-2").exists(), "the run went on after the signal"
    assert_same_weights(straight[0], resume(tmp_path), "SIGTERM in the evaluation after step 1")


def test_sigterm_during_a_step_skips_the_evaluation_planned_after_it(tmp_path, straight):
    process = start(tmp_path, "--save-steps", "0", "--eval-steps", "1", "--pause-after-step", "1")
    wait_for(tmp_path / "step-1", process)
    process.send_signal(signal.SIGTERM)
    output = process.communicate(timeout=300)[0]
    assert process.returncode == 0, output[-3000:]
    assert "SIGTERM: stopped after step 1 and saved checkpoint-1" in output, output[-3000:]
    assert not list(tmp_path.glob("eval-call-*")), "an evaluation ran between the signal and the checkpoint"
    assert [p.name for p in tmp_path.glob("checkpoint-*")] == ["checkpoint-1"]
    assert_same_weights(straight[0], resume(tmp_path), "SIGTERM after step 1, before its evaluation")


@pytest.mark.slow
def test_a_kill_at_random_moments_then_resume_reaches_the_uninterrupted_weights(tmp_path, straight):
    # Five moments drawn at random, one in each fifth of the training time: with a checkpoint at every step they fall
    # between steps, mid-step and mid-checkpoint alike. Each interrupted run is SIGKILLed, then resumed.
    model, duration = straight
    rng = random.Random(15)
    moments = [duration * (fifth + rng.random()) / 5 for fifth in range(5)]
    resumed = 0
    for i, moment in enumerate(moments):
        output_dir = tmp_path / f"kill-{i}"
        output_dir.mkdir()
        process = start(output_dir)
        wait_for(output_dir / "started", process)
        time.sleep(moment)
        process.kill()
        process.wait(timeout=60)
        steps_done = sum((output_dir / f"step-{k}").exists() for k in range(1, MAX_STEPS + 1))
        context = f"killed {moment:.2f} s into training, after {steps_done} steps"
        resumed += any(output_dir.glob("checkpoint-*"))
        assert_same_weights(model, resume(output_dir), context)
        print(context)
    assert resumed, "no kill came after a checkpoint: the resume path was not exercised"
