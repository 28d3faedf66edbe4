"""TRL's real `VLLMGeneration.sync_weights` over the student of a 2-process run, with only the vLLM engine faked:

    accelerate launch --config_file examples/accelerate_configs/fsdp_cpu.yaml tests/distributed/sharded_vllm_sync.py

(or under DDP, `--multi_gpu --num_processes 2`, or DeepSpeed ZeRO-3, `deepspeed_zero3_cpu.yaml`; one case per launch
under ZeRO-3, as in `sharded_training.py`). Cases: a plain student and a LoRA student. Each trains two steps with
`use_vllm=True`; every weight push (the trainer's, before each rollout, and one more after training) is checked on
every process: the engine receives each of its weights exactly once, under vLLM's name, equal to 1e-6 to the
student's whole weights of that moment (for LoRA: the base weights with the adapters merged, `W + scaling * B @ A`,
computed here from the gathered parameters), no adapter weight, and the sync leaves the student's own parameters as
they were (exactly; PEFT's merge and unmerge may round a merged base weight by an ulp). Also checks that the strategy
asked for ran (`MEMOPD_EXPECT_DISTRIBUTED_TYPE`), that the student is sharded at every push under FSDP2 and ZeRO-3,
and that the weights pushed after training differ from the first ones. Exits non-zero on any failure.
"""

import os
import sys
import tempfile
import types
import warnings
from collections import Counter
from pathlib import Path


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: its tiny models
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))  # the offline lab

import torch  # noqa: E402
from accelerate import PartialState  # noqa: E402
from sharded_training import whole_parameters  # noqa: E402  (this script's folder is on sys.path)
from trl.generation.vllm_generation import VLLMGeneration  # noqa: E402

import memopd_trl.trainer as trainer_module  # noqa: E402
from memopd_trl import HotpotQAEnv, MemOPDConfig, MemOPDTrainer  # noqa: E402
from offline_lab import build_tokenizer, make_synthetic_world  # noqa: E402
from tiny_models import tiny_causal_lm  # noqa: E402


class FakeEngine:
    """A colocated `vllm.LLM` as TRL's sync and the rollout backend use it: records the pushed weights by name."""

    def __init__(self, action: list[int]):
        self.pushes: list[tuple[str, torch.Tensor]] = []
        self.action = action
        runner = types.SimpleNamespace(model=types.SimpleNamespace(load_weights=self.load_weights))
        self.llm_engine = types.SimpleNamespace(
            model_config=types.SimpleNamespace(logprobs_mode="processed_logprobs"),
            model_executor=types.SimpleNamespace(driver_worker=types.SimpleNamespace(model_runner=runner)),
        )

    def load_weights(self, weights) -> None:
        self.pushes += [(name, tensor.detach().cpu().clone()) for name, tensor in weights]

    def reset_prefix_cache(self) -> None:
        pass

    def generate(self, prompts, sampling_params, use_tqdm):
        completion = types.SimpleNamespace(token_ids=self.action, logprobs=[{t: -1.0} for t in self.action])
        return [types.SimpleNamespace(outputs=[completion]) for _ in prompts]


def fake_init_vllm(self: VLLMGeneration) -> None:  # replaces `_init_vllm` only: the engine, not TRL's sync
    self.llm = FakeEngine(self.processing_class("<answer>a</answer>", add_special_tokens=False)["input_ids"])
    self._llm_weights_sleeping = False
    self.accelerator.wait_for_everyone()


def engine_weights(model: torch.nn.Module, whole: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What vLLM must receive: the whole weights; for PEFT, the base weights with the adapters merged, renamed."""
    expected = {n: t for n, t in whole.items() if "lora_" not in n}
    for name, module in model.named_modules():
        for adapter in getattr(module, "active_adapters", []) if hasattr(module, "lora_A") else []:
            delta = whole[f"{name}.lora_B.{adapter}.weight"] @ whole[f"{name}.lora_A.{adapter}.weight"]
            key = f"{name}.base_layer.weight"
            expected[key] = expected[key] + module.scaling[adapter] * delta
    return {n.removeprefix("base_model.model.").replace(".base_layer", ""): t for n, t in expected.items()}


def is_shard(param: torch.Tensor) -> bool:
    """Whether `param` is one process's part: an FSDP2 `DTensor`, or a ZeRO-3 partition."""
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor) or (hasattr(param, "ds_tensor") and param.ds_tensor.numel() < param.ds_numel)


def check_push(pushes: list, before: dict, after: dict, expected: dict, worst: list[float]) -> list[str]:
    """The weights one sync pushed (`pushes`) against the student's whole weights `before` and `after` it."""
    failures = []
    if Counter(n for n, _ in pushes) != Counter(expected.keys()):
        failures.append(f"pushed {sorted(n for n, _ in pushes)}, expected each of {sorted(expected)} once")
    for n, tensor in pushes:
        if n not in expected or tensor.shape != expected[n].shape:
            failures.append(f"{n} pushed with shape {tuple(tensor.shape)}, not as a whole weight of the student")
            continue
        worst[0] = max(worst[0], (tensor - expected[n]).abs().max().item())
        if not torch.allclose(tensor, expected[n], rtol=0, atol=1e-6):
            failures.append(f"{n} differs from the student's by {(tensor - expected[n]).abs().max()}")
    # The sync must leave the student as it was. PEFT's merge then unmerge, `(W + d) - d`, rounds a merged weight
    # by up to an ulp of `W + d`, so those (only those) may move by that; every other parameter must not move.
    for n in before:
        drift, merged = (after[n] - before[n]).abs().max().item(), n.removeprefix("base_model.model.")
        bound = 0.0
        if ".base_layer." in n:
            bound = 2 * torch.finfo(before[n].dtype).eps * expected[merged.replace(".base_layer", "")].abs().max()
        worst[1] = max(worst[1], drift)
        if drift > bound:
            failures.append(f"the sync changed the student's {n} by {drift} (allowed {bound})")
    return failures


def run_case(name: str, state: PartialState) -> list[str]:
    world = make_synthetic_world(16, seed=0)
    tokenizer = build_tokenizer(world.texts(), vocab_size=512)
    shape = dict(
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, pad_token_id=tokenizer.pad_token_id
    )
    student = tiny_causal_lm(len(tokenizer), hidden_size=32, eos_token_id=tokenizer.eos_token_id, seed=0, **shape)
    teacher = tiny_causal_lm(len(tokenizer), hidden_size=48, eos_token_id=tokenizer.eos_token_id, seed=1, **shape)
    peft_config = None
    if name == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    output_dir = tempfile.mkdtemp(prefix=f"memopd-vllm-{name}-{state.process_index}-")
    settings = dict(max_steps=2, per_device_train_batch_size=2, num_generations=2, max_new_tokens=8, seed=0)
    settings.update(output_dir=output_dir, save_strategy="no", disable_tqdm=True, report_to="none")
    torch.manual_seed(0)
    trainer = MemOPDTrainer(
        model=student,
        teacher_model=teacher,  # the distillation term moves the student, whatever the fake engine answers
        args=MemOPDConfig(use_cpu=True, use_vllm=True, learning_rate=1e-2, **settings),
        train_dataset=world.records,
        env_factory=HotpotQAEnv.factory(corpus=world.corpus, top_k=1, max_turns=2, max_malformed=2),
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    generation, failures, pushed, worst = trainer.vllm_generation.generation, [], [], [0.0, 0.0]  # TRL's
    student = trainer.accelerator.unwrap_model(trainer.model)
    distributed = trainer.accelerator.distributed_type.value
    if distributed != os.environ.get("MEMOPD_EXPECT_DISTRIBUTED_TYPE", distributed):
        failures.append(f"{name}: ran {distributed}, expected {os.environ['MEMOPD_EXPECT_DISTRIBUTED_TYPE']}")

    def checked_sync() -> None:  # TRL's sync, between two gathers of the student (collective: every process)
        if distributed in ("FSDP", "DEEPSPEED") and not all(map(is_shard, student.parameters())):
            failures.append(f"{name}: the student is not sharded at the push")
        before = whole_parameters(student)
        generation.llm.pushes.clear()
        VLLMGeneration.sync_weights(generation)
        after, pushes = whole_parameters(student), generation.llm.pushes
        label = f"{name}, push {len(pushed)} (step {trainer.state.global_step})"
        failures.extend(
            f"{label}: {f}" for f in check_push(pushes, before, after, engine_weights(student, before), worst)
        )
        pushed.append(dict(pushes))

    trainer.vllm_generation.sync_weights = checked_sync  # the trainer's pushes, before its rollouts
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    checked_sync()  # and the weights after the last step
    if trainer.state.global_step != 2 or len(pushed) != 3:
        failures.append(f"{name}: {len(pushed)} pushes in {trainer.state.global_step} steps, expected 3 in 2")
    elif pushed[0].keys() == pushed[-1].keys() and all(torch.equal(pushed[0][n], pushed[-1][n]) for n in pushed[0]):
        failures.append(f"{name}: the last push equals the first: the student did not change")
    print(
        f"[rank {state.process_index}] {name} under {distributed}: {len(pushed)} pushes, largest difference to the "
        f"student's weights {worst[0]:.1e}, largest change of the student by a sync {worst[1]:.1e}"
    )
    return failures


def main() -> int:
    state = PartialState()
    # use_vllm on CPU: no vLLM or GPU check, and only `SamplingParams` of vLLM itself (the rollout backend's).
    trainer_module.check_vllm_support = lambda args: None
    sys.modules["vllm"] = types.SimpleNamespace(SamplingParams=lambda **kwargs: kwargs)
    VLLMGeneration._init_vllm = fake_init_vllm
    cases = sys.argv[1:] or ["plain", "lora"]
    failures = [failure for name in cases for failure in run_case(name, state)]
    for failure in failures:
        print(f"[rank {state.process_index}] FAIL: {failure}", file=sys.stderr)
    if not failures:
        print(f"[rank {state.process_index}] OK: {', '.join(cases)}")
    state.destroy_process_group()  # then leave without the C++ teardown (see two_process_training.py)
    return 1 if failures else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
