"""
The statistics of played episodes across processes: what the trainer logs after each rollout (`rollout_metrics`),
what `evaluate()` reports (`evaluation_metrics`), and the distillation diagnostics split by reward
(`diagnostics_by_reward`).
"""

import torch
from accelerate.utils import gather_object

from .records import Episode
from .step import Rollout


def episode_table(episodes: list[Episode], device: torch.device) -> tuple[list[str], torch.Tensor]:
    """
    The statistics of `episodes`, one row each, `(num_episodes, len(names))` on this process, and their names:
    `reward`, the environment's metrics (`Episode.metrics`, e.g. `f1`, `em`, in name order), `turns`,
    `malformed_actions`, `failed_episodes`.

    Collective: every process calls it, with any number of episodes (even none), and gets the same names.
    """
    local_names = sorted({name for ep in episodes for name in ep.metrics})
    metric_names = sorted(set().union(*gather_object([local_names])))
    names = ["reward", *metric_names, "turns", "malformed_actions", "failed_episodes"]
    rows = [
        [ep.reward, *(ep.metrics.get(name, 0.0) for name in metric_names), ep.num_turns, ep.num_malformed]
        + [float(ep.failed)]
        for ep in episodes
    ]
    table = torch.tensor(rows, dtype=torch.float32, device=device).reshape(-1, len(names))
    return names, table


def rollout_metrics(rollout: Rollout, packed: dict | None, accelerator) -> dict[str, float]:
    """The logged statistics of one rollout: the means of its episodes' (`episode_table`) over every process, the
    spread of their rewards (`reward_std`), and its own (`Rollout.metrics`, with its `packed` batch). Collective."""
    names, table = episode_table(rollout.episodes, accelerator.device)
    gathered = accelerator.gather(table)  # (num_episodes of all processes, len(names))
    metrics = {name: gathered[:, i].mean().item() for i, name in enumerate(names)}
    metrics["reward_std"] = gathered[:, 0].std().item() if len(gathered) > 1 else 0.0
    return {**metrics, **rollout.metrics(packed)}


def diagnostics_by_reward(rows: list[tuple[dict[str, torch.Tensor], torch.Tensor]]) -> dict[str, float]:
    """
    `distill/{name}` over the action tokens of every row (each a dict of per-token diagnostics, and whether each
    token's episode was rewarded), and `distill/{name}_rewarded` / `_unrewarded` over those of rewarded / unrewarded
    episodes.
    """
    diagnostics = {name: torch.cat([values[name] for values, _ in rows]) for name in rows[0][0]}
    rewarded = torch.cat([rewarded for _, rewarded in rows])
    logged = {}
    for suffix, tokens in (("", slice(None)), ("_rewarded", rewarded), ("_unrewarded", ~rewarded)):
        for name, values in diagnostics.items():
            if values[tokens].numel():
                logged[f"distill/{name}{suffix}"] = values[tokens].mean().item()
    return logged


def evaluation_metrics(episodes: list[Episode], accelerator, prefix: str) -> dict[str, float]:
    """
    The means over every process's `episodes` of their statistics (`episode_table`), and the number of episodes and
    of failed ones, as `{prefix}_{name}`. A `RuntimeError` naming the first error when every episode failed (nothing
    was scored). Collective.
    """
    names, table = episode_table(episodes, accelerator.device)
    # Sums and counts (same shape on every process, whatever the number of records each one played): the statistics
    # without `failed_episodes`, then the number of episodes, then the number of failed ones.
    local = torch.cat([table[:, :-1], torch.ones_like(table[:, :1]), table[:, -1:]], dim=1).sum(0)
    totals = accelerator.reduce(local, reduction="sum")
    count, failed = totals[-2].item(), totals[-1].item()
    if count > 0 and failed == count:  # on every process alike: the totals are reduced
        errors = [ep.info.get("error") or ep.info.get("end_reason") for ep in episodes if ep.failed]
        raise RuntimeError(
            f"`evaluate()` scored no episode: all {int(count)} episodes failed, so there is no {prefix} score to "
            "report." + (f" The first error on this process: {errors[0]}." if errors else "")
            + " See the warnings of the `memopd_trl.rollout` logger for each one."
        )
    metrics = {f"{prefix}_{name}": totals[i].item() / max(1.0, count) for i, name in enumerate(names[:-1])}
    metrics[f"{prefix}_num_episodes"] = count
    metrics[f"{prefix}_num_failed_episodes"] = failed
    return metrics
