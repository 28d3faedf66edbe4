"""Two training steps of MemOPDTrainer across processes; run with

    accelerate launch --num_processes 2 --cpu tests/distributed/two_process_training.py [--gae]

Checks, on every process: the student changed, the teacher did not, the processes played different questions, and
after the steps every process holds the same student weights (the gradient all-reduce went through the trainer's
forward redirection). With `--gae` (`advantage_estimator="gae"`) the value head, which lives beside the model, must
have changed and be the same on every process too. Exits non-zero on any failure. `tests/test_distributed.py` runs
it.
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


class PayingEnv(HotpotQAEnv):
    """Random tiny models write malformed actions, which earn 0: here an episode's end pays a reward that depends on
    its last action, so that GAE's returns, and the value head's gradients, differ between episodes and processes."""

    def step(self, action_text: str):
        result = super().step(action_text)
        if result.done:
            self.reward = result.reward = len(action_text) % 5 / 4
        return result


def main() -> int:
    state = PartialState()
    gae = "--gae" in sys.argv[1:]
    world = make_synthetic_world(16, seed=0)
    tokenizer = build_tokenizer(world.texts(), vocab_size=512)

    def model(seed: int, hidden: int):
        return tiny_causal_lm(
            len(tokenizer), hidden_size=hidden, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, seed=seed,
        )

    student, teacher = model(0, 32), model(1, 48)
    student_before = [p.detach().clone() for p in student.parameters()]
    teacher_before = [p.detach().clone() for p in teacher.parameters()]
    output_dir = tempfile.mkdtemp(prefix=f"memopd-ddp-{state.process_index}-")
    trainer = MemOPDTrainer(
        model=student,
        teacher_model=teacher,
        args=MemOPDConfig(
            output_dir=output_dir, use_cpu=True, report_to="none", max_steps=2, per_device_train_batch_size=2,
            num_generations=2, max_new_tokens=8, learning_rate=1e-2, save_strategy="no", disable_tqdm=True, seed=0,
            advantage_estimator="gae" if gae else "group",
        ),
        train_dataset=world.records,
        env_factory=(PayingEnv if gae else HotpotQAEnv).factory(corpus=world.corpus, top_k=1, max_turns=2, max_malformed=2),
        processing_class=tokenizer,
    )
    played = []
    rollout = trainer._rollout

    def record(records):
        played.extend(r["_id"] for r in records)
        return rollout(records)

    trainer._rollout = record
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()

    failures = []
    if trainer.accelerator.num_processes != 2:
        failures.append(f"expected 2 processes, got {trainer.accelerator.num_processes}")
    if all(torch.equal(a, b) for a, b in zip(student_before, student.parameters(), strict=True)):
        failures.append("the student did not change")
    if not all(torch.equal(a, b) for a, b in zip(teacher_before, teacher.parameters(), strict=True)):
        failures.append("the teacher changed")
    flat = torch.cat([p.detach().flatten() for p in student.parameters()])
    gathered = trainer.accelerator.gather(flat[None])  # (num_processes, num_params)
    if not torch.allclose(gathered[0], gathered[-1]):
        failures.append("the processes hold different student weights after the steps")
    if gae:
        head = torch.cat([p.detach().flatten() for p in trainer.value_head.parameters()])
        heads = trainer.accelerator.gather(head[None])  # (num_processes, hidden + 1)
        if not heads.abs().sum() > 0:
            failures.append("the value head did not change")
        if not torch.equal(heads[0], heads[-1]):
            difference = (heads[0] - heads[-1]).abs().max().item()
            failures.append(f"the processes hold different value heads after the steps (max difference {difference:.3g})")
    ids = trainer.accelerator.gather_for_metrics([played], use_gather_object=True)
    if len(ids) == 2 and set(ids[0]) == set(ids[1]):
        failures.append("both processes played the same questions")
    for failure in failures:
        print(f"[rank {state.process_index}] FAIL: {failure}", file=sys.stderr)
    if not failures:
        print(f"[rank {state.process_index}] OK: 2 steps on 2 processes, weights in sync, questions {played}")
    # Torn down before exit: a gloo group left to the interpreter's shutdown can abort the process
    # ("terminate called without an active exception") after every check passed. It did once even so, so the
    # process then leaves without the C++ teardown.
    state.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
