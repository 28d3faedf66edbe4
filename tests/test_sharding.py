"""Sharded training (FSDP2) on CPU processes: equal to DDP, the heads gathered exactly, the strategy asked for or an error."""

import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType

from memopd_trl import HotpotQAEnv, MemOPDConfig, MemOPDTrainer
from memopd_trl.sharding import check_strategy, requested_strategy
from offline_lab import build_tokenizer, make_synthetic_world
from tiny_models import tiny_causal_lm


pytestmark = pytest.mark.subprocess  # starts other processes: deselect with -m "not subprocess"


ROOT = Path(__file__).resolve().parent.parent
TRAINING = ROOT / "tests" / "distributed" / "sharded_training.py"
HEAD = ROOT / "tests" / "distributed" / "sharded_head.py"
VLLM_SYNC = ROOT / "tests" / "distributed" / "sharded_vllm_sync.py"
FSDP_CPU = ROOT / "examples" / "accelerate_configs" / "fsdp_cpu.yaml"
ZERO3_CPU = ROOT / "examples" / "accelerate_configs" / "deepspeed_zero3_cpu.yaml"
CASES = ("aligned", "persistent", "lora", "teacher_play", "rows")


def _env(**extra) -> dict:
    return dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", CUDA_VISIBLE_DEVICES="", **extra)


def _launch(args: list[str], cwd: Path, **env) -> str:
    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent)) or shutil.which("accelerate")
    assert accelerate, "the accelerate launcher is not installed"
    result = subprocess.run([accelerate, "launch", *args], capture_output=True, text=True, timeout=600,
                            env=_env(**env), cwd=cwd)  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "[rank 0] OK" in output and "[rank 1] OK" in output, output[-4000:]
    return output


def _max_relative_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).abs().max() / a[k].abs().max().clamp_min(1e-12)).item() for k in a)


@pytest.fixture(scope="module")
def ddp_and_fsdp_weights(tmp_path_factory):
    """The students after two steps of every case, trained under DDP and under FSDP2 (2 CPU processes each)."""
    root = tmp_path_factory.mktemp("sharded")
    _launch(["--multi_gpu", "--num_processes", "2", "--main_process_port", "29531", str(TRAINING), str(root / "ddp")],
            root, MEMOPD_EXPECT_DISTRIBUTED_TYPE="MULTI_CPU")  # fmt: skip
    _launch(["--config_file", str(FSDP_CPU), "--main_process_port", "29532", str(TRAINING), str(root / "fsdp")],
            root, MEMOPD_EXPECT_DISTRIBUTED_TYPE="FSDP")  # fmt: skip
    return {
        strategy: {case: torch.load(root / strategy / f"{case}.pt") for case in (*CASES, "one_row")}
        for strategy in ("ddp", "fsdp")
    }


@pytest.mark.parametrize("case", CASES)
def test_fsdp2_reaches_the_ddp_weights(ddp_and_fsdp_weights, case):
    ddp, fsdp = ddp_and_fsdp_weights["ddp"][case], ddp_and_fsdp_weights["fsdp"][case]
    assert ddp["distributed_type"] == "MULTI_CPU" and fsdp["distributed_type"] == "FSDP"
    assert _max_relative_difference(ddp["weights"], fsdp["weights"]) <= 1e-5


@pytest.mark.parametrize("case", CASES)
def test_zero3_reaches_the_ddp_weights(ddp_and_fsdp_weights, tmp_path, case):
    pytest.importorskip("deepspeed")
    # One launch per case: once a ZeRO-3 trainer ran, transformers builds every later model of the process
    # partitioned (`zero.Init`), from another random stream than the DDP run's.
    _launch(["--config_file", str(ZERO3_CPU), "--main_process_port", "29534", str(TRAINING), str(tmp_path), case],
            tmp_path, MEMOPD_EXPECT_DISTRIBUTED_TYPE="DEEPSPEED")  # fmt: skip
    zero3, ddp = torch.load(tmp_path / f"{case}.pt"), ddp_and_fsdp_weights["ddp"][case]
    assert zero3["distributed_type"] == "DEEPSPEED"
    # Not bit for bit as FSDP2: DeepSpeed reduces and steps flattened fp32 buckets (about 1e-6 apart here).
    worst = max((ddp["weights"][k] - zero3["weights"][k]).abs().max().item() for k in ddp["weights"])
    assert worst <= 1e-5
    assert _max_relative_difference(ddp["weights"], zero3["weights"]) <= 1e-4


def test_rows_forwarded_one_at_a_time_reach_the_weights_of_whole_batches(ddp_and_fsdp_weights):
    # "rows": 64-token rows, each forwarded and back-propagated on its own, the gradient reduction deferred to the
    # last row; "one_row": the same run with each batch in one row. The second process plays fewer turns than the
    # first, so under FSDP2 it runs idle rows to keep the collectives in step (and generates fewer times: decoding
    # must not sync across processes).
    for strategy in ("ddp", "fsdp"):
        rows, whole = ddp_and_fsdp_weights[strategy]["rows"], ddp_and_fsdp_weights[strategy]["one_row"]
        assert rows["forwards"][0] > 4 * whole["forwards"][0], "64-token rows: several forwards per batch"
        assert _max_relative_difference(whole["weights"], rows["weights"]) <= 1e-5, strategy
    assert ddp_and_fsdp_weights["ddp"]["rows"]["forwards"][1] == 0, "DDP forwards are not collective: no idle rows"
    assert ddp_and_fsdp_weights["fsdp"]["rows"]["forwards"][1] > 0, "uneven turns: the second process has fewer rows"


def test_the_weight_comparison_tells_runs_apart(ddp_and_fsdp_weights):
    # Two steps of different settings from the same start: the tolerance above is far below what a wrong gradient
    # (here: another teacher scoring) moves the weights by.
    ddp, fsdp = ddp_and_fsdp_weights["ddp"], ddp_and_fsdp_weights["fsdp"]
    assert _max_relative_difference(ddp["aligned"]["weights"], fsdp["persistent"]["weights"]) > 1e-3


@pytest.mark.parametrize("processes", [1, 2])
def test_sharded_heads_give_the_whole_heads_losses(tmp_path, processes):
    command = [sys.executable, str(HEAD)]
    if processes > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
                   "--master_port", "29533", str(HEAD)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=_env(), cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert all(f"[rank {rank}] OK" in output for rank in range(processes)), output[-4000:]


# TRL's real `VLLMGeneration.sync_weights` (only the vLLM engine faked): every push gives the engine the student's
# whole current weights (LoRA merged in), once each, and leaves the student as it was (see sharded_vllm_sync.py).
@pytest.mark.parametrize(
    ("launcher", "port", "distributed_type"),
    [
        (["--multi_gpu", "--num_processes", "2"], "29535", "MULTI_CPU"),
        (["--config_file", str(FSDP_CPU)], "29536", "FSDP"),
    ],
    ids=["ddp", "fsdp2"],
)
def test_vllm_sync_pushes_the_whole_student(tmp_path, launcher, port, distributed_type):
    output = _launch([*launcher, "--main_process_port", port, str(VLLM_SYNC)], tmp_path,
                     MEMOPD_EXPECT_DISTRIBUTED_TYPE=distributed_type)  # fmt: skip
    for case in ("plain", "lora"):
        assert f"{case} under {distributed_type}: 3 pushes" in output


@pytest.mark.parametrize("case", ["plain", "lora"])
def test_vllm_sync_pushes_the_whole_student_under_zero3(tmp_path, case):
    pytest.importorskip("deepspeed")  # one launch per case, as in test_zero3_reaches_the_ddp_weights
    output = _launch(["--config_file", str(ZERO3_CPU), "--main_process_port", "29537", str(VLLM_SYNC), case], tmp_path,
                     MEMOPD_EXPECT_DISTRIBUTED_TYPE="DEEPSPEED")  # fmt: skip
    assert f"{case} under DEEPSPEED: 3 pushes" in output


def _state(distributed_type, fsdp_version=2, num_processes=2):
    plugin = SimpleNamespace(fsdp_version=fsdp_version) if distributed_type == DistributedType.FSDP else None
    state = SimpleNamespace(distributed_type=distributed_type, fsdp_plugin=plugin, num_processes=num_processes,
                            device=torch.device("cpu"), mixed_precision="no")  # fmt: skip
    return SimpleNamespace(state=state)


def test_the_strategy_asked_for_is_read_from_the_arguments_and_the_launcher(monkeypatch):
    for name in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"):
        monkeypatch.delenv(name, raising=False)
    assert requested_strategy(SimpleNamespace(fsdp="", deepspeed=None, fsdp_plugin_args=None)) is None
    assert requested_strategy(SimpleNamespace(fsdp="full_shard", deepspeed=None, fsdp_plugin_args=None)) == "fsdp"
    assert requested_strategy(SimpleNamespace(fsdp="", deepspeed="ds.json", fsdp_plugin_args=None)) == "deepspeed"
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert requested_strategy(SimpleNamespace(fsdp="", deepspeed=None, fsdp_plugin_args=None)) == "fsdp"


def test_a_strategy_that_cannot_run_is_an_error_not_a_fallback(monkeypatch):
    for name in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"):
        monkeypatch.delenv(name, raising=False)
    plain = SimpleNamespace(fsdp="", deepspeed=None, fsdp_plugin_args=None)
    check_strategy(_state(DistributedType.MULTI_CPU), plain)  # DDP asked (nothing asked) and run: fine
    with pytest.raises(ValueError, match="asked for DEEPSPEED, but accelerate prepared MULTI_CPU"):
        check_strategy(_state(DistributedType.MULTI_CPU), SimpleNamespace(fsdp="", deepspeed="ds.json"))
    with pytest.raises(ValueError, match="FSDP version 2 only"):
        check_strategy(_state(DistributedType.FSDP, fsdp_version=1), plain)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ValueError, match="single process"):
        check_strategy(_state(DistributedType.NO, num_processes=1), plain)
    with pytest.raises(ValueError, match="asked for FSDP, but accelerate prepared MULTI_GPU"):
        check_strategy(_state(DistributedType.MULTI_GPU), plain)


def test_trainer_refuses_fsdp_on_a_single_process(monkeypatch, tmp_path):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    world = make_synthetic_world(4, seed=0)
    tokenizer = build_tokenizer(world.texts(), vocab_size=320)
    model = tiny_causal_lm(len(tokenizer), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=1, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    with pytest.raises(ValueError, match="single process that shards nothing"):
        MemOPDTrainer(
            model=model,
            args=MemOPDConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", distill_coef=0.0,
                              per_device_train_batch_size=2, num_generations=2),  # fmt: skip
            train_dataset=world.records,
            env_factory=HotpotQAEnv.factory(corpus=world.corpus),
            processing_class=tokenizer,
        )
