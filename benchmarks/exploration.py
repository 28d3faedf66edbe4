"""
What PPO can learn from: how much the main job's start explores on the validation tasks, per sampling temperature
and group size.

    python benchmarks/exploration.py --output_dir outputs/hotpot [--temperatures 0.7 1.0 1.3] [--group_size 16]
        [--num_tasks 100] [any flag of examples/hotpot.py]

`--output_dir` holds the main job's cached set-up (it is built there when missing). The start samples `--group_size`
episodes of each of the first `--num_tasks` validation tasks (`offline_lab.validation_tasks`) at each temperature.
A group-relative advantage (PPO's here, GRPO's in TRL) is zero for a group whose rewards are all equal, so the share of
groups whose rewards differ is the share of tasks PPO gets any signal from. Groups of 4 and 8 are the first episodes of
each group of `--group_size`. Also reported: the mean F1, the within-group reward standard deviation, the entropy per
action token (the mean negative log-prob of the sampled tokens, at that temperature) and the malformed actions per
episode.

Prints the table and writes it to `<output_dir>/exploration-<seed>.json`.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from trough import load_setup  # noqa: E402  (this script's folder is on sys.path)

import offline_lab as offline  # noqa: E402
from memopd_trl.rollout import RolloutEngine  # noqa: E402


def group_stats(groups: list[list[float]]) -> dict:
    """
    For groups of rewards (one list per task): the share of groups whose rewards are not all equal (those a
    group-relative advantage learns from) and the mean within-group population standard deviation.
    """
    if not groups or any(not group for group in groups):
        raise ValueError("`groups` must hold at least one non-empty group of rewards.")
    differing = sum(max(group) > min(group) for group in groups)
    return {
        "differing_groups": differing / len(groups),
        "reward_std": statistics.fmean(statistics.pstdev(group) for group in groups),
    }


def explore(engine: RolloutEngine, tasks: list[dict], group_size: int, sizes: tuple[int, ...]) -> dict:
    """Samples `group_size` episodes of each task; returns the start's statistics for groups of each of `sizes`."""
    episodes, _ = engine.rollout(tasks, num_generations=group_size)
    by_task: dict[int, list] = {}
    for episode in episodes:
        by_task.setdefault(episode.group_id, []).append(episode)
    groups = [[episode.reward for episode in group] for group in by_task.values()]
    logprobs = [lp for episode in episodes for inv in episode.invocations for lp in inv.logprobs]
    report = {
        "f1": statistics.fmean(episode.reward for episode in episodes),
        "entropy_per_token": -statistics.fmean(logprobs) if logprobs else 0.0,
        "malformed_per_episode": statistics.fmean(episode.num_malformed for episode in episodes),
        "turns": statistics.fmean(episode.num_turns for episode in episodes),
    }
    for size in sizes:
        report[f"groups_of_{size}"] = group_stats([group[:size] for group in groups])
    return report


def main(argv: list[str] | None = None) -> dict:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0, 1.3], help="Sampling temperatures.")
    own.add_argument("--group_size", type=int, default=16, help="Episodes sampled per task (groups of 4 and 8 are "
                     "their first episodes).")  # fmt: skip
    own.add_argument("--num_tasks", type=int, default=100, help="Validation tasks measured (the first ones).")
    ours, rest = own.parse_known_args(argv)
    if ours.group_size < 2 or any(t <= 0 for t in ours.temperatures):
        raise SystemExit("--group_size must be at least 2 and every temperature > 0.")
    args, _, output_dir, world, generation, _, validation, tokenizer = load_setup(rest)
    tasks = validation[: ours.num_tasks]
    start = offline.load_offline_model(output_dir / "student_init").eval()
    seed = args.seeds[0]
    sizes = tuple(size for size in (4, 8) if size < ours.group_size) + (ours.group_size,)
    report = {"seed": seed, "num_tasks": len(tasks), "group_size": ours.group_size, "temperatures": {}}
    for temperature in ours.temperatures:
        torch.manual_seed(seed)
        engine = RolloutEngine(start, tokenizer, world.env_factory, temperature=temperature, **generation)
        report["temperatures"][str(temperature)] = explore(engine, tasks, ours.group_size, sizes)
    path = output_dir / f"exploration-{seed}.json"
    path.write_text(json.dumps(report, indent=1))
    print_report(report, sizes)
    print(f"\n{path}")
    return report


def print_report(report: dict, sizes: tuple[int, ...]) -> None:
    heads = " | ".join(f"groups of {size}: differing / reward std" for size in sizes)
    print(f"\n| T | F1 | entropy per token | malformed per episode | {heads} |")
    print("|---:|---:|---:|---:|" + "---:|" * len(sizes))
    for temperature, row in report["temperatures"].items():
        cells = " | ".join(
            f"{row[f'groups_of_{size}']['differing_groups']:.2f} / {row[f'groups_of_{size}']['reward_std']:.3f}"
            for size in sizes
        )
        print(f"| {temperature} | {row['f1']:.3f} | {row['entropy_per_token']:.3f} | "
              f"{row['malformed_per_episode']:.2f} | {cells} |")  # fmt: skip


if __name__ == "__main__":
    main()
