"""The main job continues a stopped run: `examples/hotpot.py --resume_from_checkpoint true` after a SIGTERM (a real
signal to a real subprocess), and after a teacher server that failed mid-run and came back. Either way the final
weights equal an uninterrupted run's."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from teacher_server import serve_teacher
from transformers import TrainerCallback

from memopd_trl.teacher import TeacherServerError
from offline_lab import make_synthetic_world
from tiny_models import tiny_causal_lm


ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "hotpot.py"
SMOKE = ["--config", str(ROOT / "examples" / "smoke.yaml"), "--report_to", "none", "--disable_tqdm", "true"]



def recording_first_steps(hotpot, monkeypatch) -> list[int]:
    """Makes the script's trainers record the global step each training starts at (a resumed one: its checkpoint's)."""
    first_steps = []

    class RecordFirstStep(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            first_steps.append(state.global_step)

    class Trainer(hotpot.MemOPDTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.add_callback(RecordFirstStep())

    monkeypatch.setattr(hotpot, "MemOPDTrainer", Trainer)
    return first_steps


def assert_same_weights(expected_dir: Path, resumed_dir: Path) -> None:
    expected, resumed = load_file(expected_dir / "model.safetensors"), load_file(resumed_dir / "model.safetensors")
    assert expected.keys() == resumed.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(resumed[name], tensor, atol=1e-6, rtol=1e-5, msg=f"{name} differs")


@pytest.mark.subprocess
def test_a_sigterm_then_resume_reaches_the_uninterrupted_runs_weights(hotpot, tmp_path, monkeypatch):
    # Two arms of four steps, every model saved; the SIGTERM lands in the second arm, after its first step.
    run = [*SMOKE, "--arms", "ppo", "memopd", "--max_steps", "4", "--save_models", "true", "--cpu_threads", "1"]
    straight = hotpot.main([*run, "--output_dir", str(tmp_path / "straight")])

    stopped = tmp_path / "stopped"
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", PYTHONUNBUFFERED="1")
    process = subprocess.Popen(
        [sys.executable, str(SCRIPT), *run, "--output_dir", str(stopped)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
    )  # fmt: skip
    lines, in_second_arm = [], False
    try:
        for line in process.stdout:  # the trainer prints each step's logs as a dict (logging_steps=1)
            lines.append(line)
            in_second_arm = in_second_arm or line.startswith("[ppo seed 0] validation F1")
            if in_second_arm and line.startswith("{") and "'loss" in line:
                process.send_signal(signal.SIGTERM)
                break
        output = "".join(lines) + process.communicate(timeout=300)[0]
    finally:
        process.kill()
    assert process.returncode == 0, output[-3000:]
    assert "--resume_from_checkpoint true" in output, output[-3000:]
    checkpoints = sorted(p.name for p in (stopped / "seed-0" / "memopd").glob("checkpoint-*"))
    assert checkpoints and checkpoints[-1] != "checkpoint-4", (checkpoints, output[-3000:])
    assert not (stopped / "results.json").exists()

    first_steps = recording_first_steps(hotpot, monkeypatch)
    resumed = hotpot.main([*run, "--output_dir", str(stopped), "--resume_from_checkpoint", "true"])
    # The finished arm is not trained again; the stopped one goes on from its checkpoint.
    assert first_steps == [int(checkpoints[-1].split("-")[1])]
    assert [r["arm"] for r in resumed["runs"]] == ["ppo", "memopd"]
    assert resumed["runs"][0] == json.loads((stopped / "seed-0" / "ppo" / "result.json").read_text())["run"]
    for arm in ("ppo", "memopd"):
        assert_same_weights(tmp_path / "straight" / "seed-0" / arm, stopped / "seed-0" / arm)
    assert [r["f1"] for r in resumed["runs"]] == [r["f1"] for r in straight["runs"]]


def real_mode_run(tmp_path: Path, tokenizer, url: str, output_dir: Path) -> list[str]:
    """Real mode on local checkpoints and a local HotpotQA-format file, the teacher on the server at `url`."""
    if not (tmp_path / "student").exists():
        model = tiny_causal_lm(
            len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, seed=0,
        )  # fmt: skip
        model.save_pretrained(tmp_path / "student")
        tokenizer.save_pretrained(tmp_path / "student")
        (tmp_path / "data.json").write_text(json.dumps(make_synthetic_world(8, seed=0).records))
    return [
        "--config", str(ROOT / "examples" / "real.yaml"), "--dataset", str(tmp_path / "data.json"),
        "--model_name_or_path", str(tmp_path / "student"), "--teacher_model_server_url", url, "--loss_top_k", "8",
        "--teacher_server_max_retries", "1", "--dtype", "float32", "--arms", "memopd", "--max_steps", "3",
        "--eval_strategy", "no", "--save_strategy", "steps", "--save_steps", "1", "--max_turns", "2",
        "--max_new_tokens", "8", "--max_prompt_length", "512", "--num_generations", "2",
        "--per_device_train_batch_size", "1", "--num_eval_questions", "2", "--use_cpu", "true", "--report_to", "none",
        "--disable_tqdm", "true", "--output_dir", str(output_dir),
    ]  # fmt: skip


def test_a_run_stopped_by_a_failed_teacher_server_resumes_once_it_is_back(
    hotpot, tmp_path, monkeypatch, make_tiny_model, tiny_tokenizer
):
    teacher = make_tiny_model(seed=1, hidden_size=48)
    with serve_teacher(teacher, tiny_tokenizer) as (server, url):
        hotpot.main(real_mode_run(tmp_path, tiny_tokenizer, url, tmp_path / "straight"))

        class ServerFailsAfterTheFirstStep(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                server.fail_next = 10**6  # every later request

        class Trainer(hotpot.MemOPDTrainer):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self.add_callback(ServerFailsAfterTheFirstStep())

        stopped = tmp_path / "stopped"
        with monkeypatch.context() as patch:
            patch.setattr(hotpot, "MemOPDTrainer", Trainer)
            with pytest.raises(TeacherServerError, match="failed POST /v1/completions"):
                hotpot.main(real_mode_run(tmp_path, tiny_tokenizer, url, stopped))
        run_dir = stopped / "seed-0" / "memopd"
        assert sorted(p.name for p in run_dir.glob("checkpoint-*")) == ["checkpoint-1"]

        server.fail_next = 0  # the server is back
        first_steps = recording_first_steps(hotpot, monkeypatch)
        resumed = hotpot.main(
            [*real_mode_run(tmp_path, tiny_tokenizer, url, stopped), "--resume_from_checkpoint", "true"]
        )
    assert first_steps == [1] and resumed["runs"][0]["curve"][-1][0] == 3
    assert_same_weights(tmp_path / "straight" / "seed-0" / "memopd", run_dir)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--resume_from_checkpoint", "some/checkpoint-3"], "names one checkpoint, but this run trains 3 arms"),
        (["--arms", "memopd", "--resume_from_checkpoint", "no/such/checkpoint-3"], "no such checkpoint directory"),
        (["--push_to_hub", "true"], "does not push"),
        (["--dtype", "bfloat16"], "--dtype apply to models loaded with --model_name_or_path"),
        (["--load_in_4bit", "true"], "--load_in_4bit apply to models loaded with --model_name_or_path"),
    ],
)
def test_what_the_script_cannot_honour_is_refused(hotpot, tmp_path, flags, message):
    with pytest.raises(SystemExit, match=message):
        hotpot.parse_args([*SMOKE, "--output_dir", str(tmp_path), *flags])


def test_an_arm_finished_under_other_settings_is_not_reused(hotpot, tmp_path):
    run = [*SMOKE, "--arms", "ppo", "--max_steps", "1", "--output_dir", str(tmp_path)]
    hotpot.main(run)
    with pytest.raises(SystemExit, match=r"trained with other settings \(learning_rate\)"):
        hotpot.main([*run, "--learning_rate", "0.5", "--resume_from_checkpoint", "true"])
