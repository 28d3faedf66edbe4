"""The report of a comparison of arms over seeds: summary, markdown table, `results.json` and plots.

A run is a `dict` with its `arm`, `seed`, final held-out `f1` / `em` and `curve`, the `[step, f1, em]` of every greedy
evaluation (step 0 is the start), and optionally `misalignment`, the `[step, {turn: KL}]` of its alignment audits
(see [`misalignment_curve`]). The set-up, if any, maps a role (`"teacher"`, `"student_init"`) to its held-out
`f1` / `em`.

>>> from offline_lab.report import format_table, summarize
>>> runs = [{"arm": "ppo", "seed": s, "f1": f, "em": f, "curve": [[0, 0.1, 0.1], [2, f, f]]} for s, f in [(0, .2), (1, .4)]]
>>> print(format_table(summarize(runs), setup={}))
| model | held-out F1 | held-out EM | seeds |
|---|---:|---:|---:|
| ppo (PPO on the final F1 only, no teacher) | 0.300 ± 0.141 | 0.300 ± 0.141 | 2 |
"""

import json
import os
import statistics
from pathlib import Path
from typing import Any


def eval_curve(log_history: list[dict[str, Any]], start: dict[str, float]) -> list[list[float]]:
    """
    The held-out F1 / EM curve of a training run, from its trainer's `state.log_history`.

    Args:
        log_history (`list[dict]`): the trainer's logs; those with `eval_f1` are greedy evaluations.
        start (`dict[str, float]`): the start's `f1` and `em`, the curve's step 0.

    Returns:
        `list[list[float]]`: `[step, f1, em]` per evaluation, step 0 first.
    """
    curve = [[0, start["f1"], start["em"]]]
    return curve + [[e["step"], e["eval_f1"], e["eval_em"]] for e in log_history if "eval_f1" in e]


def misalignment_curve(log_history: list[dict[str, Any]]) -> list[list[Any]]:
    """
    The per-turn misalignment of a training run, from its trainer's `state.log_history`: for each logged entry with
    `misalignment/kl_turn_{k}` (the alignment audit, `MemOPDConfig.misalignment_audit_steps`), the KL in nats per action
    token KL(teacher in the student's own contexts || teacher under the persistent history), by turn.

    Returns:
        `list[list]`: `[step, {turn: kl}]` per entry with an audit (turns as strings, JSON keys); empty when the run
        was never audited (PPO only, persistent scoring, `misalignment_audit_steps=0`).
    """
    prefix = "misalignment/kl_turn_"
    curve = []
    for entry in log_history:
        turns = {key[len(prefix) :]: value for key, value in entry.items() if key.startswith(prefix)}
        if turns:
            curve.append([entry["step"], dict(sorted(turns.items(), key=lambda item: int(item[0])))])
    return curve


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """
    Mean, standard deviation and per-seed values of the final F1 and EM of each arm, arms in their first order.

    Returns:
        `dict[str, dict]`: per arm, `f1_mean`, `f1_std`, `em_mean`, `em_std` (sample std, 0 for one seed) and
        `f1_per_seed`.
    """
    summary = {}
    for arm in dict.fromkeys(run["arm"] for run in runs):
        f1 = [run["f1"] for run in runs if run["arm"] == arm]
        em = [run["em"] for run in runs if run["arm"] == arm]
        summary[arm] = {
            "f1_mean": statistics.fmean(f1),
            "f1_std": statistics.stdev(f1) if len(f1) > 1 else 0.0,
            "em_mean": statistics.fmean(em),
            "em_std": statistics.stdev(em) if len(em) > 1 else 0.0,
            "f1_per_seed": f1,
        }
    return summary


def describe(name: str, setup: dict[str, dict[str, Any]]) -> str:
    """
    What a row of the table is: a set-up role or an arm, named with what it rests on (the teacher's layouts, the start
    it came from). Unknown names are returned as they are.
    """
    teacher = setup.get("teacher", {})
    layouts = "both layouts" if "full_history_f1" in teacher else "compact contexts only"
    recipe = teacher.get("recipe", {})
    if recipe.get("history_native"):
        layouts = "both layouts, the history read whole"
        if recipe.get("history_memory"):
            layouts += f", {recipe['history_memory']!r} memory there"
    if name == "teacher":
        if recipe.get("history_native"):
            memory = f"{recipe['history_memory']!r} memory" if recipe.get("history_memory") else "full memory"
            return (
                "teacher (imitated the full-memory expert in compact contexts, and in the growing history an expert "
                f"that reads all of it with {memory}, on its own and the forgetful expert's histories)"
            )
        return f"teacher (imitated the full-memory expert, {layouts})"
    if name == "student_init":
        start = setup.get("student_init", {})
        if start.get("from_teacher") is None:
            return "student start"
        origin = "the teacher's weights" if start["from_teacher"] else "the shared pretraining"
        return f"student start (from {origin}, taught the forgetful expert)"
    arms = {
        "ppo": "ppo (PPO on the final F1 only, no teacher)",
        "memopd": "memopd (aligned: teacher scores each action in the student's state)",
        "memopd_persistent": f"memopd_persistent (control: teacher scores the flattened history; it saw {layouts})",
    }
    return arms.get(name, name)


def format_table(summary: dict[str, dict[str, Any]], setup: dict[str, dict[str, Any]]) -> str:
    """
    A markdown table of held-out F1 / EM: the set-up's models first, then each arm's mean ± std over seeds, each row
    named for what it is ([`describe`]).

    Returns:
        `str`: the table, one row per model.
    """
    lines = ["| model | held-out F1 | held-out EM | seeds |", "|---|---:|---:|---:|"]
    for role in ("teacher", "student_init"):
        if role in setup:
            lines.append(f"| {describe(role, setup)} | {setup[role]['f1']:.3f} | {setup[role]['em']:.3f} | - |")
    for arm, s in summary.items():
        n, f1, em = len(s["f1_per_seed"]), f"{s['f1_mean']:.3f} ± {s['f1_std']:.3f}", f"{s['em_mean']:.3f} ± {s['em_std']:.3f}"
        lines.append(f"| {describe(arm, setup)} | {f1} | {em} | {n} |")
    return "\n".join(lines)


def _pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_curves(runs: list[dict[str, Any]], setup: dict[str, dict[str, Any]], path: str | os.PathLike) -> None:
    """
    Plot held-out F1 against training step to `path`: one colour per arm (thin: each seed, thick: the mean over
    seeds) and the teacher's F1 as a dashed line.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for index, arm in enumerate(dict.fromkeys(run["arm"] for run in runs)):
        color = f"C{index}"
        curves = [run["curve"] for run in runs if run["arm"] == arm]
        for curve in curves:
            ax.plot([c[0] for c in curve], [c[1] for c in curve], color=color, alpha=0.35, linewidth=1)
        steps = sorted({c[0] for curve in curves for c in curve})
        mean = [statistics.fmean(c[1] for curve in curves for c in curve if c[0] == s) for s in steps]
        ax.plot(
            steps, mean, color=color, linewidth=2.2, marker="o", markersize=3, label=f"{arm} ({len(curves)} seeds)"
        )
    if "teacher" in setup:
        ax.axhline(setup["teacher"]["f1"], color="gray", linestyle="--", linewidth=1, label="teacher")
    ax.set_xlabel("training step")
    tasks = {run.get("curve_tasks", "test") for run in runs}
    ax.set_ylabel(("validation" if tasks == {"validation"} else "held-out") + " F1 (greedy)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_misalignment(runs: list[dict[str, Any]], path: str | os.PathLike) -> bool:
    """
    Plot the per-turn misalignment of the runs that have it (see [`misalignment_curve`]) to `path`: for each arm, the
    mean over its audits and seeds of the KL at each turn, with the range over seeds. Returns whether anything was
    plotted (nothing is written when no run was audited).
    """
    kls: dict[str, dict[int, dict[int, list[float]]]] = {}  # arm -> turn -> seed -> the KL of each audit
    for run in runs:
        for _, turns in run.get("misalignment") or []:
            for turn, kl in turns.items():
                kls.setdefault(run["arm"], {}).setdefault(int(turn), {}).setdefault(run["seed"], []).append(kl)
    if not kls:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    width = 0.8 / len(kls)
    for index, (arm, by_turn) in enumerate(kls.items()):
        turns = sorted(by_turn)
        per_seed = [[statistics.fmean(values) for values in by_turn[turn].values()] for turn in turns]
        means = [statistics.fmean(values) for values in per_seed]
        below = [mean - min(values) for mean, values in zip(means, per_seed, strict=True)]
        above = [max(values) - mean for mean, values in zip(means, per_seed, strict=True)]
        offsets = [turn + (index - (len(kls) - 1) / 2) * width for turn in turns]
        ax.bar(offsets, means, width=width, color=f"C{index}", yerr=[below, above], capsize=3, label=arm)
    ax.set_xlabel("turn of the episode")
    ax.set_ylabel("KL(teacher aligned || persistent)\n(nats per action token, T=1)")
    ax.set_xticks(sorted({turn for by_turn in kls.values() for turn in by_turn}))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_report(results: dict[str, Any], output_dir: str | os.PathLike) -> str:
    """
    Write `results.json` (`results` as given), `eval_f1.png` and, when a run was audited, `misalignment.png` to
    `output_dir`.

    Args:
        results (`dict`): holds at least `runs` and `setup` (see the module docstring), and `summary` from
            [`summarize`].
        output_dir (`str` or `os.PathLike`): an existing directory.

    Returns:
        `str`: the markdown table of [`format_table`].
    """
    output_dir = Path(output_dir)
    (output_dir / "results.json").write_text(json.dumps(results, indent=2))
    plot_curves(results["runs"], results["setup"], output_dir / "eval_f1.png")
    if not plot_misalignment(results["runs"], output_dir / "misalignment.png"):
        # An earlier run's plot in the same directory would not describe these runs.
        (output_dir / "misalignment.png").unlink(missing_ok=True)
    return format_table(results["summary"], results["setup"])
