"""
Why MemOPD first breaks its student: the main job's start and the same student after a few MemOPD updates (the
trough), measured per turn and per part of the action on the validation tasks.

    python benchmarks/trough.py --output_dir outputs/hotpot [--trough_step 20] [any flag of examples/hotpot.py]

`--output_dir` holds the main job's cached set-up (it is built there when missing). The MemOPD arm of the main job's
settings (seed 0 unless `--seeds` says otherwise) trains the start for `--trough_step` updates on the training tasks
that are not validation tasks; everything measured is on the validation tasks (`offline_lab.validation_tasks`):

1. **The loss at step 0**, on the start's own sampled episodes (the training temperature, `num_generations` per task):
   per turn and part, how many tokens the teacher gives less than `distill_divergence_threshold`, how many the
   episode-scoped divergence mask keeps, their share of the forward KL, the norm of the gradient each turn's kept
   loss alone gives the weights, and in which turn and part each episode first diverges. The same on the trough's own
   samples: what the loss covers once the student has moved.
2. **What moved**, start -> trough: the mean log-prob of the start's sampled tokens and of the teacher's greedy tokens
   (in the teacher's own states) under each model, per turn and part; on the teacher's tokens also at and after each
   episode's branch point (its first token the start gives less than `distill_divergence_threshold`).
3. **How the episodes change**: greedy and sampled F1 (and how many episodes score each value), turns, malformed
   actions per turn with their errors, outputs cut at `max_new_tokens`, the first episodes' actions; the same for the
   teacher's own episodes, which the student is distilled towards.
4. **Whether the teacher can recover from the student's states**: the teacher takes over each model's greedy episodes
   from turn k (`offline_lab.teacher_takeover`). **And whether each model can act in the teacher's states**: it
   finishes the teacher's greedy episodes from turn k.

Prints the tables and writes them to `<output_dir>/trough-<seed>-<step>.json`.
"""

import argparse
import copy
import json
import math
import sys
from collections import Counter, defaultdict
from dataclasses import replace
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import hotpot  # noqa: E402

import offline_lab as offline  # noqa: E402
from memopd_trl import MemOPDTrainer  # noqa: E402
from memopd_trl.envs.base import ActionFormat, parse_action  # noqa: E402
from memopd_trl.losses import until_first_divergence  # noqa: E402
from memopd_trl.rollout import RolloutEngine  # noqa: E402
from offline_lab.compare import arm_config  # noqa: E402


PARTS = ("format", "memory", "query", "answer", "other")


def token_parts(tokenizer, output_ids: list[int], action_format: ActionFormat) -> list[str]:
    """The part of the action each output token writes: a tag or the space between tags (`format`), the memory text,
    the search query, the answer, or text outside every block (`other`)."""
    tags = {f"<{action_format.memory_tag}>": "memory", f"<{action_format.search_tag}>": "query",
            f"<{action_format.answer_tag}>": "answer"}  # fmt: skip
    closing = {f"</{tag[1:]}" for tag in tags}
    inside, parts = None, []
    for token_id in output_ids:
        text = tokenizer.decode([token_id])
        if text in tags:
            inside = tags[text]
            parts.append("format")
        elif text in closing:
            inside = None
            parts.append("format")
        elif inside is None:
            parts.append("format" if not text.strip() else "other")
        else:
            parts.append(inside)
    return parts


@torch.no_grad()
def _distributions(model, invocation, temperature: float) -> torch.Tensor:
    """`(len(output_ids), vocab)`: the model's log-distribution at each action token, at `temperature`."""
    ids = torch.tensor([invocation.input_ids + invocation.output_ids])
    logits = model(input_ids=ids).logits[0, len(invocation.input_ids) - 1 : -1].float()
    return (logits / temperature).log_softmax(-1)


def token_rows(episodes, tokenizer, action_format, models: dict, temperature: float) -> list[dict]:
    """One row per action token of `episodes`: episode, turn, part, and each model's log-prob of the token."""
    rows = []
    for episode_index, episode in enumerate(episodes):
        for invocation in episode.invocations:
            if not invocation.output_ids:
                continue
            parts = token_parts(tokenizer, invocation.output_ids, action_format)
            targets = torch.tensor(invocation.output_ids)[:, None]
            logprobs = {name: _distributions(model, invocation, temperature).gather(-1, targets)[:, 0].tolist()
                        for name, model in models.items()}  # fmt: skip
            for i, part in enumerate(parts):
                rows.append({"episode": episode_index, "turn": invocation.turn, "part": part,
                             **{name: values[i] for name, values in logprobs.items()}})  # fmt: skip
    return rows


def own_samples_loss(episodes, student, teacher, tokenizer, action_format, config) -> dict:
    """The distillation loss on `student`'s own `episodes`, per turn and part: tokens, those the teacher gives less
    than `distill_divergence_threshold` (0.1 where it is 0), those the episode-scoped mask keeps, their share of the
    forward KL, each turn's gradient norm; and under `"first divergence"`, how many episodes first diverge in each
    turn and part (where the mask stops; `"none"`: never)."""
    temperature, rows, losses = config.temperature, [], []
    threshold = config.distill_divergence_threshold or 0.1  # the default's mask where the setting distills every token
    for episode_index, episode in enumerate(episodes):
        for invocation in episode.invocations:
            if not invocation.output_ids:
                continue
            ids = torch.tensor([invocation.input_ids + invocation.output_ids])
            start = len(invocation.input_ids) - 1
            student_logp = (student(input_ids=ids).logits[0, start:-1].float() / temperature).log_softmax(-1)
            teacher_logp = _distributions(teacher, invocation, temperature)
            kl = (teacher_logp.exp() * (teacher_logp - student_logp)).sum(-1)  # forward KL per token
            sampled = teacher_logp.gather(-1, torch.tensor(invocation.output_ids)[:, None])[:, 0]
            for i, part in enumerate(token_parts(tokenizer, invocation.output_ids, action_format)):
                rows.append({"episode": episode_index, "turn": invocation.turn, "part": part,
                             "teacher_sampled": sampled[i].item(), "kl": kl[i].item()})  # fmt: skip
            losses.append(kl)
    kl_all = torch.cat(losses)
    keep = until_first_divergence(
        torch.tensor([row["teacher_sampled"] for row in rows]),
        torch.tensor([row["episode"] for row in rows]),
        threshold,
    )
    total = (kl_all * keep).sum().detach()
    turns = torch.tensor([row["turn"] for row in rows])
    grad_norms = {}
    for turn in sorted(set(turns.tolist())):
        student.zero_grad()
        ((kl_all * keep * (turns == turn)).sum() / keep.sum()).backward(retain_graph=True)
        grad_norms[turn] = torch.cat([p.grad.flatten() for p in student.parameters() if p.grad is not None]).norm()
    student.zero_grad()
    table = defaultdict(lambda: {"tokens": 0, "below": 0, "kept": 0, "kl_kept": 0.0})
    below, first = math.log(threshold), Counter()
    for row, kept, kl in zip(rows, keep.tolist(), kl_all.tolist(), strict=True):
        for key in ((row["turn"], row["part"]), (row["turn"], "all")):
            table[key]["tokens"] += 1
            table[key]["below"] += row["teacher_sampled"] < below
            table[key]["kept"] += kept
            table[key]["kl_kept"] += kl * kept
        if kept and row["teacher_sampled"] < below:  # the last token the mask keeps in its episode
            first[f"{row['turn']}/{row['part']}"] += 1
    out = {}
    for (turn, part), cell in sorted(table.items()):
        out[f"{turn}/{part}"] = {"tokens": cell["tokens"], "below": cell["below"], "kept": cell["kept"],
                                 "loss_share": cell["kl_kept"] / max(total.item(), 1e-12),
                                 "kl_per_kept_token": cell["kl_kept"] / max(cell["kept"], 1)}  # fmt: skip
        if part == "all":
            out[f"{turn}/{part}"]["grad_norm"] = float(grad_norms[turn])
    out["first divergence"] = {**dict(first.most_common()), "none": len(episodes) - sum(first.values())}
    return out


def episode_stats(episodes, tokenizer, action_format) -> dict:
    """F1 (mean, and how many episodes score each value), turns, malformed actions per turn (and their errors),
    actions cut at the token limit, and the first two episodes' actions."""
    by_turn, examples = defaultdict(Counter), defaultdict(list)
    for episode in episodes:
        for invocation in episode.invocations:
            parsed = parse_action(tokenizer.decode(invocation.output_ids), action_format)
            cell = by_turn[invocation.turn]
            cell["actions"] += 1
            cell["truncated"] += invocation.truncated
            if parsed.error:
                cell["malformed"] += 1
                cell["error: " + parsed.error.split(";")[0][:40]] += 1
                examples[invocation.turn].append(tokenizer.decode(invocation.output_ids))
    n = max(1, len(episodes))
    f1_counts = Counter(f"{e.f1:.2f}" for e in episodes)
    actions = [[tokenizer.decode(invocation.output_ids) for invocation in e.invocations] for e in episodes[:2]]
    return {"f1": sum(e.f1 for e in episodes) / n, "f1_counts": dict(sorted(f1_counts.items())), "examples": actions,
            "turns": sum(e.num_turns for e in episodes) / n,
            "malformed_per_episode": sum(e.num_malformed for e in episodes) / n,
            "by_turn": {turn: dict(cell) for turn, cell in sorted(by_turn.items())},
            "malformed_examples": {turn: texts[:3] for turn, texts in sorted(examples.items())}}  # fmt: skip


def mark_branch_points(rows: list[dict], threshold: float) -> list[dict]:
    """Mark each row (`token_rows` of one model's episodes) by where it lies against its episode's branch point, the
    first token the start gives a probability below `threshold` (the token the warm-up leaves out): `"before"`, `"at"`
    or `"after"`."""
    start = torch.tensor([row["start"] for row in rows])
    below = start < math.log(threshold)
    first = until_first_divergence(start, torch.tensor([row["episode"] for row in rows]), threshold)
    for row, is_below, kept in zip(rows, below.tolist(), first.tolist(), strict=True):
        row["branch"] = ("at" if is_below else "before") if kept else "after"
    return rows


def mean_logprobs(rows: list[dict], names: list[str]) -> dict:
    """Each model's mean log-prob per turn and part, and per turn against the branch point where rows are marked."""
    cells = defaultdict(list)
    for row in rows:
        cells[f"{row['turn']}/{row['part']}"].append(row)
        cells[f"{row['turn']}/all"].append(row)
        if "branch" in row and row["branch"] != "before":
            cells[f"{row['turn']}/{row['branch']} the branch"].append(row)
    return {key: {"tokens": len(group), **{name: sum(r[name] for r in group) / len(group) for name in names}}
            for key, group in sorted(cells.items())}  # fmt: skip


def load_setup(argv: list[str]) -> tuple:
    """
    The main job's arguments (`argv`: any flag of examples/hotpot.py) and its cached set-up, built when missing:
    `(args, config, output_dir, world, generation, train, validation, tokenizer)`, where `generation` holds the
    rollout's length limits and `train` / `validation` are `offline_lab.validation_tasks`.
    """
    args, config, _ = hotpot.parse_args(argv)
    offline.set_cpu_threads(args.cpu_threads)
    output_dir = Path(config.output_dir)
    world = offline.make_offline_world(args, **args.env_settings())
    generation = dict(max_new_tokens=config.max_new_tokens, max_prompt_length=config.max_prompt_length)
    offline.prepare_offline_models(args, world, output_dir, **generation)
    train, validation = offline.validation_tasks(world, args)
    tokenizer = offline.load_offline_tokenizer(output_dir / "teacher")
    return args, config, output_dir, world, generation, train, validation, tokenizer


def main(argv: list[str] | None = None) -> dict:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--trough_step", type=int, default=20, help="MemOPD updates from the start to the trough.")
    own.add_argument("--num_tasks", type=int, default=50, help="Validation tasks measured (the first ones).")
    own.add_argument("--quick", action="store_true", help="Only the trough's greedy and sampled episodes (a variant's "
                     "check): no step-0 loss, no log-probs, no takeover.")
    ours, rest = own.parse_known_args(argv)
    args, config, output_dir, world, generation, train, validation, tokenizer = load_setup(rest)
    tasks = validation[: ours.num_tasks]
    teacher = offline.load_offline_model(output_dir / "teacher").eval()
    start = offline.load_offline_model(output_dir / "student_init")
    seed = args.seeds[0]
    settings = replace(arm_config(config, "memopd", seed), max_steps=ours.trough_step, eval_strategy="no",
                       output_dir=str(output_dir / f"trough-{seed}"), logging_steps=ours.trough_step)  # fmt: skip
    trainer = MemOPDTrainer(model=copy.deepcopy(start), teacher_model=teacher, args=settings, train_dataset=train,
                            env_factory=world.env_factory, processing_class=tokenizer)  # fmt: skip
    action_format = world.env_factory().action_format
    torch.manual_seed(seed)

    def engine(model, temperature=config.temperature):
        return RolloutEngine(model.eval(), tokenizer, world.env_factory, temperature=temperature, **generation)

    report = {"trough_step": ours.trough_step, "seed": seed, "num_tasks": len(tasks)}
    sampled, _ = engine(start).rollout(tasks, num_generations=config.num_generations)
    if not ours.quick:
        start.train()
        report["step0_loss"] = own_samples_loss(sampled, start, teacher, tokenizer, action_format, settings)
        start.eval()
    trainer.train()
    trough = trainer.model.eval()
    trainer.save_model(settings.output_dir)
    if ours.quick:
        for mode, greedy in (("greedy", True), ("sampled", False)):
            episodes, _ = engine(trough).rollout(tasks, num_generations=1 if greedy else config.num_generations,
                                                 greedy=greedy)  # fmt: skip
            report[f"trough_{mode}"] = episode_stats(episodes, tokenizer, action_format)
            print(f"trough {mode}: F1 {report[f'trough_{mode}']['f1']:.3f}, malformed "
                  f"{report[f'trough_{mode}']['malformed_per_episode']:.2f} per episode, by turn "
                  f"{report[f'trough_{mode}']['by_turn']}\n  e.g. {report[f'trough_{mode}']['malformed_examples']}")  # fmt: skip
        return report
    teacher_greedy, _ = engine(teacher).rollout(tasks, greedy=True)
    models = {"start": start, "trough": trough}
    for name, model in models.items():
        greedy, _ = engine(model).rollout(tasks, greedy=True)
        sampled_now, _ = engine(model).rollout(tasks, num_generations=config.num_generations)
        report[f"{name}_greedy"] = episode_stats(greedy, tokenizer, action_format)
        report[f"{name}_sampled"] = episode_stats(sampled_now, tokenizer, action_format)
        if name == "trough":  # what the loss covers once the student has moved (after a release, say)
            report["trough_loss"] = own_samples_loss(sampled_now, model, teacher, tokenizer, action_format, settings)
        report[f"{name}_takeover"] = offline.teacher_takeover(engine(model), engine(teacher), tasks)
        report[f"{name}_finishes_teacher"] = offline.teacher_takeover(engine(teacher), engine(model), tasks)
    report["teacher_greedy"] = episode_stats(teacher_greedy, tokenizer, action_format)
    teacher_sampled, _ = engine(teacher).rollout(tasks, num_generations=config.num_generations)
    report["teacher_sampled"] = episode_stats(teacher_sampled, tokenizer, action_format)
    rows = token_rows(sampled, tokenizer, action_format, models, config.temperature)
    report["logprobs_on_start_samples"] = mean_logprobs(rows, list(models))
    rows = token_rows(teacher_greedy, tokenizer, action_format, models, config.temperature)
    rows = mark_branch_points(rows, config.distill_divergence_threshold or 0.1)
    report["logprobs_on_teacher_greedy"] = mean_logprobs(rows, list(models))
    path = output_dir / f"trough-{seed}-{ours.trough_step}.json"
    path.write_text(json.dumps(report, indent=1, default=str))
    print_report(report)
    print(f"\n{path}")
    return report


def print_report(report: dict) -> None:
    for name, model in (("step0", "start"), ("trough", "trough")):
        print(f"\n## The loss on the {model}'s own samples (T = training temperature), seed {report['seed']}")
        print("| turn/part | tokens | teacher < threshold | kept | share of kept loss | KL per kept token | grad norm |\n"
              "|---|---:|---:|---:|---:|---:|---:|")  # fmt: skip
        table = dict(report[f"{name}_loss"])
        first = table.pop("first divergence")
        for key, cell in table.items():
            if cell["kept"] or key.endswith("/all"):
                print(f"| {key} | {cell['tokens']} | {cell['below']} | {cell['kept']} | "
                      f"{cell['loss_share']:.3f} | {cell['kl_per_kept_token']:.2f} | "
                      f"{cell.get('grad_norm', float('nan')):.3g} |")  # fmt: skip
        print(f"  episodes by the turn/part of their first divergence (where the mask stops): {first}")
    for source in ("start_samples", "teacher_greedy"):
        print(f"\n## Mean log-prob of the {source.replace('_', ' ')}' tokens (T = training temperature)")
        print("| turn/part | tokens | start | trough | moved |\n|---|---:|---:|---:|---:|")
        for key, cell in report[f"logprobs_on_{source}"].items():
            print(f"| {key} | {cell['tokens']} | {cell['start']:.3f} | {cell['trough']:.3f} | "
                  f"{cell['trough'] - cell['start']:+.3f} |")  # fmt: skip
    for name in ("start", "trough", "teacher"):
        for mode in ("greedy", "sampled"):
            stats = report.get(f"{name}_{mode}")
            if stats is None:
                continue
            print(f"\n## {name}, {mode}: F1 {stats['f1']:.3f}, turns {stats['turns']:.2f}, "
                  f"malformed {stats['malformed_per_episode']:.2f} per episode")  # fmt: skip
            print(f"  episodes per F1: {stats['f1_counts']}")
            for turn, cell in stats["by_turn"].items():
                print(f"  turn {turn}: {cell}")
            for actions in stats["examples"]:
                print("  e.g. " + " | ".join(actions))
    for name in ("start", "trough"):
        print(f"\n## Teacher takeover of the {name}'s greedy episodes from turn k")
        for k, cell in report[f"{name}_takeover"].items():
            print(f"  k={k}: F1 {cell['f1']:.3f}, turns {cell['mean_turns']:.2f}, taken over {cell['taken_over']:.2f}")
        print(f"\n## The {name} finishing the teacher's greedy episodes from turn k")
        for k, cell in report[f"{name}_finishes_teacher"].items():
            print(f"  k={k}: F1 {cell['f1']:.3f}, turns {cell['mean_turns']:.2f}, taken over {cell['taken_over']:.2f}")


if __name__ == "__main__":
    main()
