"""The chunked losses on FSDP2-sharded LM heads equal them on the whole heads; run with

    python tests/distributed/sharded_head.py                                    # one process (world of 1)
    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/sharded_head.py   # the heads split in two

A tiny Qwen2 student and teacher are scored twice on the same packed batch: whole, and sharded the way the trainer
shards them (`fully_shard` per decoder layer, then the model; the teacher through `prepare_frozen_model`'s rule of
freeing its head after forward). The student's loss runs inside its forward (as the trainer routes it), where FSDP
has gathered the head; the teacher's head is read outside its forward, a `DTensor` shard, and gathered by
`gathered_lm_head`. Checks, to 1e-6: the per-token GJSD, the PPO loss, and the student head's gradient after the
backward (reduced by FSDP onto the shards). Also checks that reading the student's sharded head with gradients outside
its forward is refused. Exits non-zero on any failure.
"""

import copy
import os
import sys
import tempfile
from pathlib import Path


os.environ.setdefault("HF_HUB_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: its tiny models

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from trl.models.utils import _ForwardRedirection  # noqa: E402

from memopd_trl.losses import chunked_generalized_jsd, ppo_clip_loss  # noqa: E402
from memopd_trl.packing import PackedInvocationCollator  # noqa: E402
from memopd_trl.records import Invocation  # noqa: E402
from memopd_trl.scoring import action_hidden_states, action_logprobs_from_hidden, action_token_ids, gathered_lm_head  # noqa: E402
from tiny_models import tiny_causal_lm  # noqa: E402


VOCAB = 203  # odd: the two shards of a head have different numbers of rows


def losses(student, teacher, batch, old_logprobs, advantages):
    """Per-token GJSD, PPO loss and their sum, from the student's head read inside its own forward when sharded."""
    hidden = action_hidden_states(student, batch)
    with gathered_lm_head(student, VOCAB) as (weight, bias):
        logprobs, _ = action_logprobs_from_hidden(hidden, weight, bias, action_token_ids(batch), chunk_size=5)
        ppo, _ = ppo_clip_loss(logprobs, old_logprobs, advantages)
        with torch.no_grad():
            teacher_hidden = action_hidden_states(teacher, batch)
        with gathered_lm_head(teacher, VOCAB) as (teacher_weight, teacher_bias):
            jsd = chunked_generalized_jsd(
                hidden, weight, teacher_hidden, teacher_weight, beta=0.5, student_bias=bias,
                teacher_bias=teacher_bias, chunk_size=5,
            )  # fmt: skip
    return jsd, ppo, jsd.mean() + ppo


def shard(model, frozen: bool):
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    if frozen:
        model.set_reshard_after_forward(True, recurse=False)
    return model


def main() -> int:
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    student = tiny_causal_lm(VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=1, seed=0)  # fmt: skip
    teacher = tiny_causal_lm(VOCAB, hidden_size=48, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=1, seed=1).requires_grad_(False)  # fmt: skip
    generator = torch.Generator().manual_seed(0)

    def ids(n):
        return torch.randint(1, VOCAB, (n,), generator=generator).tolist()

    prefix = ids(20)
    invocations = [Invocation(prefix + ids(5 + 3 * i), ids(4 + i), episode_id=i) for i in range(4)]
    batch = PackedInvocationCollator(max_tokens_per_row=256, pad_token_id=0, share_prefix=True)(invocations)
    n = len(action_token_ids(batch))
    old_logprobs = -torch.rand(n, generator=generator) * 3
    advantages = torch.randn(n, generator=generator)

    whole_student, whole_teacher = copy.deepcopy(student), copy.deepcopy(teacher)
    jsd, ppo, loss = losses(whole_student, whole_teacher, batch, old_logprobs, advantages)
    loss.backward()
    head_grad = whole_student.lm_head.weight.grad

    student, teacher = shard(student, frozen=False), shard(teacher, frozen=True)
    failures = []
    if world > 1 and student.lm_head.weight.to_local().shape[0] == VOCAB:
        failures.append("the student's head is not split")
    try:
        with gathered_lm_head(student, VOCAB):
            failures.append("reading the sharded student head with gradients outside its forward was not refused")
    except RuntimeError:
        pass

    outputs = {}

    def inside_forward(model):
        outputs["jsd"], outputs["ppo"], total = losses(model, teacher, batch, old_logprobs, advantages)
        return total

    sharded_loss = _ForwardRedirection()(student, student, inside_forward, student)
    sharded_loss.backward()
    sharded_grad = student.lm_head.weight.grad
    sharded_grad = sharded_grad.full_tensor() if isinstance(sharded_grad, DTensor) else sharded_grad
    # Each process scored the same batch: FSDP averages the gradients, which equals the one process's gradient.
    for name, whole_value, sharded_value in (
        ("GJSD", jsd.detach(), outputs["jsd"].detach()),
        ("PPO loss", ppo.detach(), outputs["ppo"].detach()),
        ("student head gradient", head_grad, sharded_grad),
    ):
        error = (whole_value - sharded_value).abs().max().item()
        if not error <= 1e-6:
            failures.append(f"{name}: sharded differs from whole by {error:.3g}")
    for failure in failures:
        print(f"[rank {rank}] FAIL: {failure}", file=sys.stderr)
    if not failures:
        print(f"[rank {rank}] OK: GJSD, PPO and the head gradient equal on heads sharded over {world} process(es)")
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
