"""The main job, examples/hotpot.py: the smoke preset end to end, --help, and real mode on local checkpoints."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from memopd_trl.modeling import build_tiny_model


ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "hotpot.py"
HOTPOT_SAMPLE = ROOT.parent / "shared" / "data" / "hotpotqa_dev_distractor_sample.json"


@pytest.fixture(scope="module")
def hotpot():
    spec = importlib.util.spec_from_file_location("hotpot_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_preset_runs_every_arm_and_writes_results_and_plot(hotpot, tmp_path):
    out = tmp_path / "smoke"
    summary = hotpot.main(["--preset", "smoke", "--output_dir", str(out), "--report_to", "none"])
    results = json.loads((out / "results.json").read_text())
    assert [run["arm"] for run in results["runs"]] == ["ppo", "memopd", "memopd_persistent"]
    assert all(0.0 <= run["f1"] <= 1.0 and run["curve"] for run in results["runs"])
    assert {"teacher", "student_init"} <= set(results["setup"]) and results["num_processes"] == 1
    assert (out / "eval_f1.png").stat().st_size > 0
    assert (out / "teacher" / "config.json").exists(), "the teacher is cached for reruns"
    assert summary["runs"] == results["runs"]


def test_help_lists_script_and_trainer_options():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-2000:]
    for flag in ("--preset", "--dataset", "--arms", "--seeds", "--distill_coef", "--teacher_scoring", "--use_peft"):
        assert flag in result.stdout, flag


def test_cpu_threads_default_to_the_cores_shared_among_local_processes(hotpot, monkeypatch):
    before = torch.get_num_threads()
    try:
        assert hotpot.set_cpu_threads(1) == 1
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        cores = len(os.sched_getaffinity(0))
        assert hotpot.set_cpu_threads(None) == cores
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores + 1))
        assert hotpot.set_cpu_threads(None) == 1
        with pytest.raises(ValueError, match="--cpu_threads"):
            hotpot.set_cpu_threads(0)
    finally:
        torch.set_num_threads(before)


def test_unknown_arm_is_a_clear_error(hotpot, tmp_path, capsys):
    with pytest.raises(SystemExit):
        hotpot.main(["--preset", "smoke", "--arms", "ppo", "magic", "--output_dir", str(tmp_path)])
    assert "invalid choice: 'magic'" in capsys.readouterr().err


def test_dataset_without_models_is_a_clear_error(hotpot, tmp_path):
    with pytest.raises(ValueError, match="--model_name_or_path"):
        hotpot.main(["--dataset", str(HOTPOT_SAMPLE), "--output_dir", str(tmp_path)])


def test_memopd_arms_refuse_distill_coef_zero(hotpot, tmp_path):
    with pytest.raises(ValueError, match="--distill_coef 0"):
        hotpot.main(["--preset", "smoke", "--distill_coef", "0", "--output_dir", str(tmp_path)])


def test_rerun_reuses_the_cached_teacher_and_student(hotpot, tmp_path, monkeypatch):
    out = tmp_path / "cache"
    argv = ["--preset", "smoke", "--arms", "ppo", "--max_steps", "1", "--output_dir", str(out), "--report_to", "none"]
    evaluated_at = []
    evaluate = hotpot.MemOPDTrainer.evaluate

    def recording_evaluate(self, *args, **kwargs):
        evaluated_at.append(self.state.global_step)
        return evaluate(self, *args, **kwargs)

    monkeypatch.setattr(hotpot.MemOPDTrainer, "evaluate", recording_evaluate)
    first = hotpot.main(argv)
    stamps = {role: (out / role / "model.safetensors").stat().st_mtime_ns for role in ("teacher", "student_init")}
    second = hotpot.main(argv)
    assert stamps == {role: (out / role / "model.safetensors").stat().st_mtime_ns for role in stamps}
    # The set-up's greedy score of the student start is every arm's step 0: the trainer never replays it.
    assert 0 not in evaluated_at
    for results in (first, second):
        assert results["runs"][0]["curve"][0][1:] == [results["setup"]["student_init"][k] for k in ("f1", "em")]
    # Under other evaluation settings the cached score does not hold, and the start is evaluated again.
    hotpot.main(argv + ["--max_new_tokens", "10"])
    assert evaluated_at.count(0) == 1
    # A different student recipe rebuilds the student only.
    hotpot.main(argv + ["--student_epochs", "0.25"])
    assert (out / "teacher" / "model.safetensors").stat().st_mtime_ns == stamps["teacher"]
    assert (out / "student_init" / "model.safetensors").stat().st_mtime_ns != stamps["student_init"]


def test_real_mode_trains_local_checkpoints_on_a_local_hotpotqa_file(hotpot, tmp_path, tiny_tokenizer):
    if not HOTPOT_SAMPLE.exists():
        pytest.skip(f"HotpotQA sample not found at {HOTPOT_SAMPLE}")
    for name, hidden in (("student", 32), ("teacher", 48)):
        model = build_tiny_model(
            len(tiny_tokenizer), hidden_size=hidden, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, pad_token_id=tiny_tokenizer.pad_token_id, eos_token_id=tiny_tokenizer.eos_token_id,
        )
        model.save_pretrained(tmp_path / name)
        tiny_tokenizer.save_pretrained(tmp_path / name)
    out = tmp_path / "real"
    summary = hotpot.main([
        "--dataset", str(HOTPOT_SAMPLE), "--model_name_or_path", str(tmp_path / "student"),
        "--teacher_model_name_or_path", str(tmp_path / "teacher"), "--arms", "memopd", "--max_steps", "1",
        "--eval_steps", "1", "--max_turns", "2", "--max_new_tokens", "8", "--num_generations", "2",
        "--per_device_train_batch_size", "1", "--num_eval_questions", "2", "--output_dir", str(out),
        "--report_to", "none", "--use_cpu", "--use_peft", "--lora_target_modules", "q_proj", "v_proj",
    ])
    (run,) = summary["runs"]
    assert run["arm"] == "memopd" and run["curve"][-1][0] == 1
    assert (out / "results.json").exists()
    saved = out / "seed-0" / "memopd"
    assert (saved / "adapter_config.json").exists(), "real mode saves each arm's model (LoRA adapters with --use_peft)"
    assert "MemOPD" in (saved / "README.md").read_text()
