"""Two training steps of MemOPDTrainer on two CPU processes, under whatever strategy `accelerate launch` asked for;
writes the student's final (whole) weights of each case to `<out_dir>/<case>.pt` on rank 0. Run it twice, e.g.

    accelerate launch --multi_gpu --num_processes 2 tests/distributed/sharded_training.py OUT_DDP
    accelerate launch --config_file examples/accelerate_configs/fsdp_cpu.yaml tests/distributed/sharded_training.py OUT_FSDP

and compare (`tests/test_sharding.py` does; under DeepSpeed ZeRO-3 it runs one case per launch, because after a
ZeRO-3 trainer transformers builds every model of the process partitioned). Cases: aligned teacher scoring, persistent teacher scoring, a LoRA
student (aligned, with the KL term to the adapter-free base). Every case starts from the same weights and plays the
same questions with the same seeds, so the two strategies must reach the same weights.

Also checks, on every process, that the distributed type the trainer ran is the one asked for, and, under FSDP, that
the student and the teacher are really sharded (each process holds a part of their LM heads), under ZeRO-3 too. Exits non-zero on
any failure.
"""

import os
import sys
import tempfile
import warnings
from pathlib import Path


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: its tiny models
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))  # the offline lab

import torch  # noqa: E402
from accelerate import PartialState  # noqa: E402

from memopd_trl import HotpotQAEnv, MemOPDConfig, MemOPDTrainer  # noqa: E402
from offline_lab import build_tokenizer, make_synthetic_world  # noqa: E402
from tiny_models import tiny_causal_lm  # noqa: E402


# The untrained students earn no reward, so `sampled_kl_coef` gives the PPO term advantages (and a gradient).
CASES = {
    "aligned": {"sampled_kl_coef": 0.5},
    "persistent": {"teacher_scoring": "persistent", "kl_coef": 0.1},  # with a (sharded) reference model
    "lora": {"kl_coef": 0.1},
    "teacher_play": {"teacher_generations": 1},  # a second student forward inside one loss
    # Rows of 64 tokens, each forwarded and back-propagated on its own, must reach the weights of one row (plain SGD:
    # Adam's first step would turn rounding in near-zero gradients into visible differences). With sharded weights
    # a process with fewer rows than another runs idle forwards, to keep the collectives in step: in these two cases
    # the second process plays one turn per episode, the first two, so it has fewer rows.
    "rows": {"sampled_kl_coef": 0.5, "optim": "sgd", "learning_rate": 0.5, "max_tokens_per_row": 64},
    "one_row": {"sampled_kl_coef": 0.5, "optim": "sgd", "learning_rate": 0.5},
}


def whole(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu().clone()


def whole_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, on every process: FSDP2 `DTensor`s gathered, ZeRO-3 partitions gathered."""
    named = list(model.named_parameters())
    if any(hasattr(p, "ds_id") for _, p in named):
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in named]):
            return {n: p.detach().cpu().clone() for n, p in named}
    return {n: whole(p) for n, p in named}


def local_rows(tensor: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).shape[0]


def run_case(name: str, overrides: dict, out_dir: Path, state: PartialState) -> list[str]:
    world = make_synthetic_world(16, seed=0)
    tokenizer = build_tokenizer(world.texts(), vocab_size=512)

    def model(seed: int, hidden: int):
        return tiny_causal_lm(
            len(tokenizer), hidden_size=hidden, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, seed=seed,
        )

    peft_config = None
    if name == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    student, teacher = model(0, 32), model(1, 48)
    # The untrained models write malformed actions only: the second process's episodes end after one, the first's
    # after two (uneven turns across processes). The launcher's rank: the process group is not set up yet.
    max_malformed = 2 - int(os.environ["RANK"]) if name in ("rows", "one_row", "teacher_play") else 2
    teacher_before = {n: p.detach().clone() for n, p in teacher.named_parameters()}
    torch.manual_seed(0)  # the same LoRA initialisation whatever the launcher consumed of the random stream
    trainer = MemOPDTrainer(
        model=student,
        teacher_model=teacher,
        args=MemOPDConfig(
            output_dir=tempfile.mkdtemp(prefix=f"memopd-{name}-{state.process_index}-"), use_cpu=True,
            report_to="none", max_steps=2, per_device_train_batch_size=2, num_generations=2, max_new_tokens=8,
            save_strategy="no", disable_tqdm=True, seed=0, misalignment_audit_steps=1,
            **{"learning_rate": 1e-2, **overrides},
        ),
        train_dataset=world.records,
        env_factory=HotpotQAEnv.factory(corpus=world.corpus, top_k=1, max_turns=2, max_malformed=max_malformed),
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    before = whole_parameters(trainer.accelerator.unwrap_model(trainer.model))
    forward_rows, row_counts = trainer._forward_rows, []  # (rows, idle forwards) of every packed batch
    trainer._forward_rows = lambda batch: row_counts.append(forward_rows(batch)) or row_counts[-1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()

    failures = []
    distributed = trainer.accelerator.distributed_type.value
    if trainer.accelerator.num_processes != 2:
        failures.append(f"{name}: expected 2 processes, got {trainer.accelerator.num_processes}")
    expected = os.environ.get("MEMOPD_EXPECT_DISTRIBUTED_TYPE")
    if expected and distributed != expected:
        failures.append(f"{name}: ran {distributed}, expected {expected}")
    if distributed == "FSDP":
        vocab = trainer.accelerator.unwrap_model(trainer.model).get_output_embeddings().weight
        teacher_head = trainer.accelerator.unwrap_model(trainer.teacher_model).get_output_embeddings().weight
        for label, head in (("student", vocab), ("teacher", teacher_head)):
            if local_rows(head) * 2 > len(tokenizer) + 1:
                failures.append(f"{name}: the {label}'s LM head is not sharded ({local_rows(head)} local rows)")
    if distributed == "DEEPSPEED":  # ZeRO-3: each process holds a partition of every parameter
        for label, m in (("student", trainer.model), ("teacher", trainer.teacher_model)):
            head = trainer.accelerator.unwrap_model(m).get_output_embeddings().weight
            if not (hasattr(head, "ds_tensor") and head.ds_tensor.numel() < head.ds_numel):
                failures.append(f"{name}: the {label}'s LM head is not partitioned")
    weights = whole_parameters(trainer.accelerator.unwrap_model(trainer.model))
    trained = {n for n, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters() if p.requires_grad}
    if all(torch.equal(weights[n], before[n]) for n in trained):
        failures.append(f"{name}: the student did not change")
    teacher_after = whole_parameters(trainer.accelerator.unwrap_model(trainer.teacher_model))
    if any(not torch.equal(teacher_after[n], teacher_before[n]) for n in teacher_before):
        failures.append(f"{name}: the teacher changed")
    counts = torch.tensor([[len(rows), sum(r["num_real_tokens"] == 0 for r in rows)] for rows in row_counts]).sum(0)
    print(f"[rank {state.process_index}] {name}: {counts.tolist()} (forwards, idle forwards)")
    torch.distributed.all_reduce(counts)  # over both processes
    if state.is_main_process:
        torch.save({"weights": weights, "distributed_type": distributed, "forwards": counts.tolist()},
                   out_dir / f"{name}.pt")  # fmt: skip
    return failures


def main() -> int:
    state = PartialState()
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    cases = sys.argv[2:] or list(CASES)
    failures = []
    for name in cases:
        failures += run_case(name, CASES[name], out_dir, state)
    for failure in failures:
        print(f"[rank {state.process_index}] FAIL: {failure}", file=sys.stderr)
    if not failures:
        print(f"[rank {state.process_index}] OK: {', '.join(cases)}")
    # Torn down before exit, then leave without the C++ teardown (see two_process_training.py).
    state.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
