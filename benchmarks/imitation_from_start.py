"""
Whether the student start can learn the teacher's behaviour by plain supervised imitation, and whether it can do so
without first breaking: the question behind MemOPD's trough, asked without MemOPD.

    python benchmarks/imitation_from_start.py --output_dir DIR [--learning_rate 3e-3] [--anchor 1.0] \
        [--hold_updates 300] [--release_updates 60] [any flag of examples/hotpot.py]

`--output_dir` holds the main job's cached set-up (built there when missing; `--student_from_teacher false` is the
start that never had the policy). From its start, on the training tasks that are not validation tasks, with AdamW at
`--learning_rate` (a linear warm-up of 10 updates, then constant), `--episodes` episodes of each kind per update:

1. **Hold** (`--hold_updates`): the negative log-likelihood of the full-memory expert's episodes (the behaviour the
   teacher imitated) without each episode's branch point, the first token the start gives a probability below
   `--threshold` (as `distill_warmup_steps` leaves it out), plus `--anchor` times the negative log-likelihood of the
   start's own greedy episodes.
2. **Release** (`--release_updates`): the expert's whole episodes, the branch point included, without the anchor.

`--hold_updates 0` is plain imitation of the expert from the start. Greedy F1 on the first `--num_tasks` validation
tasks every `--every` updates; prints the curve and writes it to `<output_dir>/imitation-<name>.json`.
"""

import argparse
import copy
import json
import random
import sys
import time
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).resolve().parent))

from trough import load_setup  # noqa: E402

import offline_lab as offline  # noqa: E402
from memopd_trl.losses import without_first_divergence  # noqa: E402
from memopd_trl.packing import PackedInvocationCollator  # noqa: E402
from memopd_trl.rollout import RolloutEngine  # noqa: E402
from memopd_trl.scoring import action_logprobs  # noqa: E402
from offline_lab.expert import expert_trajectories  # noqa: E402
from offline_lab.imitation import expert_invocations  # noqa: E402


def branch_masks(start, episodes: list[list], collator, threshold: float) -> list[torch.Tensor]:
    """For each episode (its invocations), every action token but the first the start gives < `threshold`, as the
    trainer's warm-up keeps them (`losses.without_first_divergence`)."""
    with torch.no_grad():
        logprobs = [action_logprobs(start, collator(invocations)) for invocations in episodes]
    return [without_first_divergence(lp, torch.zeros_like(lp, dtype=torch.long), threshold) for lp in logprobs]


def main(argv: list[str] | None = None) -> dict:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--learning_rate", type=float, default=3e-3, dest="lr", help="AdamW learning rate.")
    own.add_argument("--anchor", type=float, default=1.0, help="Weight of the start's own episodes while holding.")
    own.add_argument("--hold_updates", type=int, default=300, help="Updates without the branch points.")
    own.add_argument("--release_updates", type=int, default=60, help="Updates on whole expert episodes after.")
    own.add_argument("--episodes", type=int, default=8, help="Expert (and own) episodes per update.")
    own.add_argument("--threshold", type=float, default=0.1, help="Probability below which a token is a branch.")
    own.add_argument("--every", type=int, default=20, help="Updates between two evaluations.")
    own.add_argument("--num_tasks", type=int, default=50, help="Validation tasks evaluated (the first ones).")
    ours, rest = own.parse_known_args(argv)
    args, config, output_dir, world, generation, train, validation, tokenizer = load_setup(rest)
    tasks = validation[: ours.num_tasks]
    model = offline.load_offline_model(output_dir / "student_init")
    start = copy.deepcopy(model).eval()
    collator = PackedInvocationCollator(max_tokens_per_row=4096, pad_token_id=tokenizer.pad_token_id)
    expert = expert_trajectories(
        train, env_factory=world.env_factory, mistake_prob=args.expert_mistake_prob, seed=args.world_seed
    )
    expert_episodes = [expert_invocations(list(trajectory.steps), tokenizer) for trajectory in expert]
    masks = branch_masks(start, expert_episodes, collator, ours.threshold)
    own_episodes = []
    if ours.hold_updates and ours.anchor > 0:
        played, _ = RolloutEngine(start, tokenizer, world.env_factory, **generation).rollout(train, greedy=True)
        own_episodes = [list(episode.invocations) for episode in played if episode.invocations]

    def evaluate(update: int) -> float:
        f1 = offline.greedy_scores(model, tokenizer, world.env_factory, tasks, **generation)["f1"]
        model.train()
        print(f"update {update}: greedy F1 {f1:.3f}", flush=True)
        return f1

    optimizer = torch.optim.AdamW(model.parameters(), lr=ours.lr, weight_decay=0.0)
    rng, began = random.Random(args.world_seed), time.perf_counter()
    curve, losses = [(0, evaluate(0))], []
    for update in range(1, ours.hold_updates + ours.release_updates + 1):
        for group in optimizer.param_groups:
            group["lr"] = ours.lr * min(1.0, update / 10)
        holding = update <= ours.hold_updates
        picked = rng.sample(range(len(expert_episodes)), ours.episodes)
        logprobs = action_logprobs(model, collator([inv for k in picked for inv in expert_episodes[k]]))
        kept = torch.cat([masks[k] for k in picked]) if holding else torch.ones_like(logprobs, dtype=torch.bool)
        loss = -logprobs[kept].mean()
        losses.append(loss.item())
        if holding and own_episodes:
            mine = rng.sample(range(len(own_episodes)), ours.episodes)
            loss = loss - ours.anchor * action_logprobs(model, collator([i for k in mine for i in own_episodes[k]])).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if update % ours.every == 0:
            print(f"  expert NLL per kept token (last {ours.every}): {sum(losses[-ours.every:]) / ours.every:.3f}")
            curve.append((update, evaluate(update)))
    report = {"settings": vars(ours), "curve": curve, "expert_nll": losses,
              "seconds": round(time.perf_counter() - began, 1)}  # fmt: skip
    name = f"lr{ours.lr:g}-anchor{ours.anchor:g}-hold{ours.hold_updates}-release{ours.release_updates}"
    path = output_dir / f"imitation-{name}.json"
    path.write_text(json.dumps(report))
    print(" / ".join(f"{f1:.3f}" for _, f1 in curve), f"\n{path}")
    return report


if __name__ == "__main__":
    main()
