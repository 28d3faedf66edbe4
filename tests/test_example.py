"""The main job, examples/hotpot.py: the smoke run end to end, --help, CLI errors, and real mode on local checkpoints."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import offline_lab
from tiny_models import tiny_causal_lm


ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "hotpot.py"
SMOKE = ["--config", str(ROOT / "examples" / "smoke.yaml"), "--report_to", "none"]



def _run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_smoke_run_trains_every_arm_writes_results_and_never_touches_the_network(hotpot, tmp_path, monkeypatch):
    connections = []

    def refuse(sock, address):
        connections.append(address)
        raise OSError(f"network access to {address} in an offline run")

    # Even with the Hub not marked offline, the offline run makes no connection.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    out = tmp_path / "smoke"
    summary = hotpot.main([*SMOKE, "--output_dir", str(out)])
    assert connections == []
    results = json.loads((out / "results.json").read_text())
    assert [run["arm"] for run in results["runs"]] == ["ppo", "memopd", "memopd_persistent"]
    assert all(0.0 <= run["f1"] <= 1.0 and [step for step, *_ in run["curve"]] == [0, 1, 2] for run in results["runs"])
    assert {"teacher", "student_init"} <= set(results["setup"]) and results["num_processes"] == 1
    assert results["mode"] == "offline" and "smoke.yaml" in results["command"]
    assert (out / "eval_f1.png").stat().st_size > 0
    # The aligned arm's alignment audit, per turn; PPO only and persistent scoring are never audited.
    audits = {run["arm"]: run["misalignment"] for run in results["runs"]}
    assert audits["memopd"] and "0" in audits["memopd"][0][1], audits
    assert audits["ppo"] == [] and audits["memopd_persistent"] == []
    assert (out / "misalignment.png").stat().st_size > 0
    assert (out / "teacher" / "config.json").exists(), "the teacher is cached for reruns"
    # Each arm keeps only its result (what `--resume_from_checkpoint true` reuses), no model or checkpoint.
    for run in results["runs"]:
        run_dir = out / "seed-0" / run["arm"]
        assert [p.name for p in run_dir.iterdir()] == ["result.json"], list(run_dir.iterdir())
        assert json.loads((run_dir / "result.json").read_text())["run"] == run
    assert summary["runs"] == results["runs"]


def test_a_student_start_outside_its_intended_range_is_refused_before_any_arm(hotpot, tmp_path, capsys):
    out = tmp_path / "smoke"
    with pytest.raises(SystemExit) as stop:
        hotpot.main([*SMOKE, "--output_dir", str(out), "--student_start_f1_range", "1.5", "2.0"])
    assert "The student start's held-out task F1 is" in str(stop.value) and "outside its intended range" in str(stop.value)
    assert "--student_start_f1_range 0 1" in str(stop.value)
    assert (out / "student_init" / "config.json").exists() and not (out / "results.json").exists()


def test_a_teacher_no_better_than_its_start_is_refused_before_any_arm(hotpot, tmp_path):
    out = tmp_path / "smoke"
    with pytest.raises(SystemExit) as stop:  # no teacher is 2 above its start: F1 lies in [0, 1]
        hotpot.main([*SMOKE, "--output_dir", str(out), "--teacher_min_f1_gain", "2.0"])
    assert "The teacher's held-out task F1 is" in str(stop.value) and "less than 2.0 above" in str(stop.value)
    assert "--teacher_min_f1_gain 0" in str(stop.value)
    assert (out / "student_init" / "config.json").exists() and not (out / "results.json").exists()
    setup = {"teacher": {"f1": 0.502}, "student_init": {"f1": 0.475}}  # world seed 7's set-up, rebuilt
    config = offline_lab.OfflineConfig()
    assert "0.502, less than 0.2 above the student start's (0.475)" in offline_lab.check_teacher_gain(setup, config)
    setup["teacher"]["f1"] = 0.695  # world seed 0's
    assert offline_lab.check_teacher_gain(setup, config) is None


def test_help_shows_the_defaults_a_run_uses():
    result = _run_script("--help")
    assert result.returncode == 0, result.stderr[-2000:]
    text = " ".join(result.stdout.split())  # argparse wraps the help text
    for flag in ("--config", "--dataset", "--arms", "--seeds", "--distill_coef", "--teacher_scoring", "--use_peft"):
        assert flag in text, flag
    # The offline run's values, not the dataclasses' (learning_rate 1e-06, max_steps -1, beta 0.5).
    offline_run = (("--learning_rate", "0.0003"), ("--max_steps", "220"), ("--beta", "0.0"), ("--lookup_fraction", "1.0"),
                   ("--teacher_generations", "1"))  # fmt: skip
    for flag, default in offline_run:
        help_of_flag = text.rsplit(f"{flag} {flag.upper()[2:]}", 1)[1][:400]  # the help, after the usage
        assert f"(default: {default})" in help_of_flag, (flag, help_of_flag)
    assert "only where a CUDA GPU is available" in text
    assert "defaults to `True` if `fp16` is not set" not in text


def test_a_mistyped_flag_is_one_line_naming_the_closest_flag():
    result = _run_script("--lerning_rate", "1e-3")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "hotpot.py: error: unknown argument --lerning_rate; did you mean --learning_rate?"
    ]


def test_unknown_keys_of_a_config_file_are_named_too(hotpot, tmp_path):
    config = tmp_path / "typo.yaml"
    config.write_text("max_step: 3\n")
    with pytest.raises(SystemExit, match="unknown argument --max_step; did you mean --max_steps"):
        hotpot.main(["--config", str(config)])


@pytest.mark.parametrize(
    "extra", [[], ["--model_name_or_path", "some/model", "--teacher_model_name_or_path", "some/teacher"]]
)
def test_a_missing_dataset_file_says_so_whatever_other_flags(hotpot, tmp_path, extra):
    missing = tmp_path / "nope" / "hotpot_dev.json"
    with pytest.raises(SystemExit, match=f"--dataset {missing}: no such file"):
        hotpot.main(["--dataset", str(missing), *extra])


def test_cpu_threads_default_to_the_cores_shared_among_local_processes(hotpot, monkeypatch):
    before = torch.get_num_threads()
    try:
        assert offline_lab.set_cpu_threads(1) == 1
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        cores = len(os.sched_getaffinity(0))
        assert offline_lab.set_cpu_threads(None) == cores
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores + 1))
        assert offline_lab.set_cpu_threads(None) == 1
        with pytest.raises(ValueError, match="--cpu_threads"):
            offline_lab.set_cpu_threads(0)
    finally:
        torch.set_num_threads(before)


def test_unknown_arm_is_a_clear_error(hotpot, tmp_path, capsys):
    with pytest.raises(SystemExit):
        hotpot.main([*SMOKE, "--arms", "ppo", "magic", "--output_dir", str(tmp_path)])
    assert "invalid choice: 'magic'" in capsys.readouterr().err


def test_dataset_without_models_is_a_clear_error(hotpot, tmp_path, hotpot_sample_path):
    with pytest.raises(SystemExit, match="--model_name_or_path"):
        hotpot.main(["--dataset", str(hotpot_sample_path), "--output_dir", str(tmp_path)])


def test_memopd_arms_refuse_distill_coef_zero(hotpot, tmp_path):
    # The offline recipe's teacher episodes need a distillation term: the config says so first.
    with pytest.raises(SystemExit, match="`distill_coef` is 0"):
        hotpot.main([*SMOKE, "--distill_coef", "0", "--output_dir", str(tmp_path)])
    off = ["--teacher_generations", "0", "--distill_divergence_threshold", "0", "--distill_warmup_steps", "0",
           "--distill_warmup_anchor_coef", "0"]  # fmt: skip
    with pytest.raises(SystemExit, match="--distill_coef 0"):
        hotpot.main([*SMOKE, "--distill_coef", "0", *off, "--output_dir", str(tmp_path)])


def test_ppo_arm_runs_under_a_distillation_recipe(hotpot, tmp_path):
    # The MemOPD recipe's distillation-only settings (teacher episodes, the divergence mask) are refused with
    # distill_coef 0; the PPO arm drops them instead of failing after the set-up.
    argv = [*SMOKE, "--arms", "ppo", "--max_steps", "1", "--output_dir", str(tmp_path)]
    results = hotpot.main(argv + ["--teacher_generations", "1", "--distill_divergence_threshold", "0.1"])
    assert [run["arm"] for run in results["runs"]] == ["ppo"]


def test_an_arm_the_settings_break_fails_before_the_set_up(hotpot, tmp_path, monkeypatch):
    # An arm whose overrides clash with the given settings (here a PPO arm that keeps the teacher episodes) stops
    # with the arm's name before any model is built.
    monkeypatch.setitem(offline_lab.ARMS, "ppo", {"distill_coef": 0.0, "teacher_model_name_or_path": None})
    with pytest.raises(SystemExit, match="arm ppo: .*teacher_generations"):
        hotpot.main([*SMOKE, "--teacher_generations", "1", "--output_dir", str(tmp_path)])
    assert not (tmp_path / "teacher").exists()


def test_rerun_reuses_the_cached_teacher_and_student(hotpot, tmp_path, monkeypatch):
    out = tmp_path / "cache"
    argv = [*SMOKE, "--arms", "ppo", "--max_steps", "1", "--output_dir", str(out)]
    evaluated_at = []
    evaluate = hotpot.MemOPDTrainer.evaluate

    def recording_evaluate(self, *args, **kwargs):
        evaluated_at.append((self.state.global_step, kwargs.get("metric_key_prefix", "eval")))
        return evaluate(self, *args, **kwargs)

    monkeypatch.setattr(hotpot.MemOPDTrainer, "evaluate", recording_evaluate)
    first = hotpot.main(argv)
    stamps = {role: (out / role / "model.safetensors").stat().st_mtime_ns for role in ("teacher", "student_init")}
    second = hotpot.main(argv)
    assert stamps == {role: (out / role / "model.safetensors").stat().st_mtime_ns for role in stamps}
    # The curves are on the validation tasks: the start is scored there once per run (step 0), and the held-out
    # tasks once per arm, at its end; the held-out score of the start is the set-up's.
    assert evaluated_at == 2 * [(0, "eval"), (1, "eval"), (1, "test")], evaluated_at
    for results in (first, second):
        assert results["runs"][0]["curve_tasks"] == "validation"
    # A different student recipe rebuilds the student only.
    hotpot.main(argv + ["--student_epochs", "0.25"])
    assert (out / "teacher" / "model.safetensors").stat().st_mtime_ns == stamps["teacher"]
    assert (out / "student_init" / "model.safetensors").stat().st_mtime_ns != stamps["student_init"]


def test_real_mode_trains_local_checkpoints_on_a_local_hotpotqa_file(
    hotpot, tmp_path, tiny_tokenizer, hotpot_sample_path
):
    for name, hidden in (("student", 32), ("teacher", 48)):
        model = tiny_causal_lm(
            len(tiny_tokenizer), hidden_size=hidden, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, pad_token_id=tiny_tokenizer.pad_token_id, eos_token_id=tiny_tokenizer.eos_token_id,
        )  # fmt: skip
        model.save_pretrained(tmp_path / name)
        tiny_tokenizer.save_pretrained(tmp_path / name)
    out = tmp_path / "real"
    summary = hotpot.main([
        "--config", str(ROOT / "examples" / "real.yaml"), "--dataset", str(hotpot_sample_path),
        "--model_name_or_path", str(tmp_path / "student"), "--teacher_model_name_or_path", str(tmp_path / "teacher"),
        "--dtype", "float32", "--arms", "memopd", "--max_steps", "1", "--eval_strategy", "steps", "--eval_steps", "1",
        "--max_turns", "2", "--max_new_tokens", "8", "--max_prompt_length", "512", "--num_generations", "2",
        "--per_device_train_batch_size", "1", "--num_eval_questions", "2", "--output_dir", str(out),
        "--report_to", "none", "--use_cpu", "true", "--use_peft", "--lora_target_modules", "q_proj", "v_proj",
    ])  # fmt: skip
    (run,) = summary["runs"]
    assert summary["mode"] == "real" and run["arm"] == "memopd" and run["curve"][-1][0] == 1
    assert (out / "results.json").exists()
    saved = out / "seed-0" / "memopd"
    assert (saved / "adapter_config.json").exists(), "real.yaml saves each arm's model (LoRA adapters with --use_peft)"
    assert set(json.loads((saved / "adapter_config.json").read_text())["target_modules"]) == {"q_proj", "v_proj"}
    assert "MemOPD" in (saved / "README.md").read_text()


def test_the_offline_worlds_sizes_are_checked_offline_only(hotpot, tmp_path, hotpot_sample_path):
    # Offline, a held-out set too small for one two-part task stops before the set-up, in one line; in real mode the
    # same flag only limits the dataset's held-out questions.
    with pytest.raises(SystemExit, match=r"`num_sub_questions` \(2\) exceeds"):
        hotpot.parse_args(["--num_eval_questions", "1", "--output_dir", str(tmp_path)])
    real = ["--model_name_or_path", "local/model", "--teacher_model_name_or_path", "local/model"]
    args, _, _ = hotpot.parse_args(
        ["--num_eval_questions", "1", *real, "--dataset", str(hotpot_sample_path), "--output_dir", str(tmp_path)]
    )
    assert args.num_eval_questions == 1


@pytest.mark.real_weights
def test_the_smollm2_recipe_fine_tunes_both_models_from_the_checkpoint_with_its_chat_template(
    hotpot, tmp_path, smollm2_checkpoint
):
    # examples/smollm2.yaml in miniature: a few tasks, a fraction of an epoch, one update of one arm (no learning).
    out = tmp_path / "smollm2"
    tiny = ["--num_train_questions", "8", "--num_eval_questions", "4", "--student_warmup_questions", "4",
            "--teacher_epochs", "0.25", "--student_epochs", "0.25", "--max_steps", "1", "--eval_steps", "1",
            "--per_device_train_batch_size", "1", "--num_generations", "2", "--max_new_tokens", "16",
            "--student_start_f1_range", "0", "1", "--teacher_min_f1_gain", "0", "--arms", "memopd",
            "--cpu_threads", "1"]  # fmt: skip
    recipe = ["--config", str(ROOT / "examples" / "smollm2.yaml"), "--base_model", str(smollm2_checkpoint)]
    results = hotpot.main([*recipe, "--output_dir", str(out), "--report_to", "none", *tiny])
    base = AutoModelForCausalLM.from_pretrained(smollm2_checkpoint).state_dict()
    template = AutoTokenizer.from_pretrained(smollm2_checkpoint).chat_template
    for role in ("teacher", "student_init"):
        setup = results["setup"][role]
        assert setup["base_model"] == str(smollm2_checkpoint) and setup["parameters"] > 100e6
        assert AutoTokenizer.from_pretrained(out / role).chat_template == template
        tuned = AutoModelForCausalLM.from_pretrained(out / role).state_dict()
        assert tuned.keys() == base.keys() and not all(torch.equal(tuned[k], base[k]) for k in base)
    assert "full_history_f1" in results["setup"]["teacher"]  # the fair teacher plays both layouts
    assert "single_f1" in results["setup"]["student_init"]  # the start's capability beside its task F1
    assert [run["arm"] for run in results["runs"]] == ["memopd"] and results["runs"][0]["curve"][-1][0] == 1
