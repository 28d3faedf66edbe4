"""Benchmark: shared-prefix packing against plain packing, length-bucketed padding and padding (tokens and time).

Two sets of invocations:

- **recorded**: the invocations of real rollouts of the main job (the offline default's student start playing
  `--questions` training questions x `--num_generations` episodes at its sampling temperature), recorded once into
  `--recorded` (JSON token ids) from the cached set-up of `accelerate launch examples/hotpot.py` in `--setup_dir`;
- **synthetic**: `--synthetic_questions` questions x 8 generations x 6 turns, shaped like a memory agent's calls (a
  prompt of system prompt + task, then a memory and an observation per turn, a short action), random token ids.

For each, every layout scores the same invocations: padded (one batch), length-bucketed padded micro-batches,
plain packing and shared-prefix packing (`memopd_sdpa_varlen`) in one row and in rows of `--row_tokens` (one forward
for all rows, and one forward per row, as the trainer runs them), shared-prefix packing under `sdpa` with its dense
tree mask, and a diagnostic that forwards the shared-prefix packing one question at a time. It reports the tokens
each layout processes, the teacher forward (no grad) and the student forward + backward, medians of `--repeats`
interleaved repeats (random weights: time does not depend on them; by default the main job's model sizes), and the
persistent control (plain packing of the flattened episodes, teacher forward) that aligned scoring is compared with.

    python benchmarks/shared_prefix.py --setup_dir outputs/hotpot --write-docs
"""

import argparse
import gc
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch


os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))  # the offline lab

from memopd_trl.attention import VARLEN_SDPA  # noqa: E402
from memopd_trl.packing import PackedInvocationCollator, PaddedInvocationCollator, split_rows  # noqa: E402
from memopd_trl.records import Invocation  # noqa: E402
from memopd_trl.scoring import action_logprobs  # noqa: E402
from offline_lab import build_tiny_model  # noqa: E402  (examples/ is on sys.path)


SECTION = "## Shared-prefix packing"


def record_invocations(args: argparse.Namespace) -> list[Invocation]:
    """Play the cached student start of the main job on training questions; record (or reload) its invocations."""
    path = Path(args.recorded)
    if not path.exists():
        import hotpot

        import offline_lab as offline
        from memopd_trl import RolloutEngine

        script, config, _ = hotpot.parse_args(["--output_dir", args.setup_dir])
        env = dict(max_turns=script.max_turns, memory_policy=script.memory_policy, action_format=script.action_format)
        world = offline.make_offline_world(script, **env)
        setup = Path(args.setup_dir)
        if not (setup / "student_init").exists():
            raise SystemExit(f"No cached set-up in {setup}: run `accelerate launch examples/hotpot.py` first.")
        engine = RolloutEngine(
            offline.load_offline_model(setup / "student_init"), offline.load_offline_tokenizer(setup / "teacher"),
            world.env_factory, max_new_tokens=config.max_new_tokens, max_prompt_length=config.max_prompt_length,
            temperature=config.temperature,
        )  # fmt: skip
        torch.manual_seed(0)
        episodes, _ = engine.rollout(world.train[: args.questions], num_generations=args.num_generations)
        fields = ("input_ids", "output_ids", "episode_id", "turn", "observation_ids")
        records = [{f: getattr(inv, f) for f in fields} for ep in episodes for inv in ep.invocations]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(records))
    return [Invocation(**record) for record in json.loads(path.read_text())]


def synthetic_invocations(args: argparse.Namespace, vocab_size: int) -> list[Invocation]:
    """Memory-agent-shaped calls: prompt, then per turn a memory and an observation; every turn of a question shares
    the prompt, every generation the first call."""
    generator = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(1, vocab_size, (n,), generator=generator).tolist()

    def length(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=generator))

    invocations, episode = [], 0
    for _ in range(args.synthetic_questions):
        prompt = ids(length(60, 100))
        for _ in range(8):
            observation = []
            for turn in range(6):
                memory = ids(length(15, 60)) if turn else []
                context = prompt + memory + observation
                action = ids(length(10, 40))
                observation = ids(length(40, 120))
                invocations.append(
                    Invocation(context, action, episode_id=episode, turn=turn, observation_ids=observation)
                )
            episode += 1
    return invocations


def layouts(args, invocations: list[Invocation], generations: int) -> list[tuple[str, str, list[dict]]]:
    """(name, attention implementation, batches that together hold every invocation once). The first four are the
    references of the tables (padded; length-bucketed; plain and shared-prefix packing in one row); the last is a
    diagnostic: the shared-prefix packing forwarded one question at a time."""
    by_length = sorted(invocations, key=lambda inv: inv.num_tokens)
    size, rows = args.bucket_size, args.row_tokens
    questions: dict[int, list[Invocation]] = {}
    for inv in invocations:  # episodes are numbered question by question, `generations` per question
        questions.setdefault(inv.episode_id // generations, []).append(inv)
    return [
        ("padded, one batch", "sdpa", [PaddedInvocationCollator()(invocations)]),
        (
            f"length-bucketed padded, micro-batches of {size}",
            "sdpa",
            [PaddedInvocationCollator()(by_length[i : i + size]) for i in range(0, len(by_length), size)],
        ),
        ("plain packing, one row", VARLEN_SDPA, [PackedInvocationCollator(None)(invocations)]),
        (
            "shared-prefix packing, one row",
            VARLEN_SDPA,
            [PackedInvocationCollator(None, share_prefix=True)(invocations)],
        ),
        (f"plain packing, rows of {rows}", VARLEN_SDPA, [PackedInvocationCollator(rows)(invocations)]),
        (
            f"shared-prefix packing, rows of {rows}",
            VARLEN_SDPA,
            [PackedInvocationCollator(rows, share_prefix=True)(invocations)],
        ),
        (
            f"shared-prefix packing, rows of {args.dense_row_tokens}, sdpa tree mask, one forward per row",
            "sdpa",
            split_rows(PackedInvocationCollator(args.dense_row_tokens, share_prefix=True)(invocations)),
        ),
        (
            f"plain packing, rows of {rows}, one forward per row",
            VARLEN_SDPA,
            split_rows(PackedInvocationCollator(rows)(invocations)),
        ),
        (
            f"shared-prefix packing, rows of {rows}, one forward per row (the trainer's layout)",
            VARLEN_SDPA,
            split_rows(PackedInvocationCollator(rows, share_prefix=True)(invocations)),
        ),
        (
            "shared-prefix packing, one forward per question (diagnostic)",
            VARLEN_SDPA,
            [PackedInvocationCollator(None, share_prefix=True)(group) for group in questions.values()],
        ),
    ]


def student_step(model, batch: dict) -> None:
    action_logprobs(model, batch).mean().backward()


def teacher_step(model, batch: dict) -> None:
    with torch.no_grad():
        action_logprobs(model, batch)


def measure(args, invocations: list[Invocation], vocab_size: int, generations: int) -> dict:
    def model(hidden, layers):
        return build_tiny_model(
            vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=args.heads,
            num_key_value_heads=2,
        ).train()

    student, teacher = model(args.student_hidden, args.layers), model(args.teacher_hidden, args.layers)
    candidates = layouts(args, invocations, generations)
    persistent = (f"persistent control, plain packing, rows of {args.row_tokens}, one forward per row", VARLEN_SDPA,
                  split_rows(PackedInvocationCollator(args.row_tokens, history="persistent")(invocations)))  # fmt: skip
    runs = [("teacher", teacher, teacher_step, c) for c in [*candidates, persistent]]
    runs += [("student", student, student_step, c) for c in candidates]
    times = {(role, c[0]): [] for role, _, _, c in runs}
    for m in (student, teacher):
        teacher_step(m, PackedInvocationCollator()(invocations[:4]))  # warm-up
    for repeat in range(args.repeats):
        for role, m, fn, (name, impl, batches) in runs:  # interleaved: load drift hits every layout alike
            m.set_attn_implementation(impl)
            gc.collect()
            start = time.perf_counter()
            for batch in batches:
                fn(m, batch)
            times[role, name].append(time.perf_counter() - start)
            m.zero_grad(set_to_none=True)
        print(f"  repeat {repeat + 1}/{args.repeats}", file=sys.stderr)
    tokens = {name: sum(b["input_ids"].numel() for b in batches) for name, _, batches in [*candidates, persistent]}
    return {
        "num_invocations": len(invocations),
        "real_tokens": sum(inv.num_tokens for inv in invocations),
        "action_tokens": sum(len(inv.output_ids) for inv in invocations),
        "tokens": tokens,
        "times": {f"{role}|{name}": statistics.median(values) for (role, name), values in times.items()},
        "layouts": [name for name, _, _ in candidates],
        "persistent": persistent[0],
    }


def table(title: str, result: dict) -> list[str]:
    times, tokens, names = result["times"], result["tokens"], result["layouts"]
    trainer = next(name for name in names if "the trainer's layout" in name)
    plain = next(name for name in names if name.startswith("plain packing") and "one forward per row" in name)
    lines = [
        f"**{title}**: {result['num_invocations']} invocations, {result['real_tokens']} rebuilt tokens "
        f"({result['action_tokens']} action tokens).",
        "",
        "| layout | tokens processed | teacher forward (s) | student forward + backward (s) | trainer's speed-up |",
        "|---|---|---|---|---|",
    ]
    for name in names:
        speedup = times[f"student|{name}"] / times[f"student|{trainer}"]
        lines.append(
            f"| {name} | {tokens[name]} | {times[f'teacher|{name}']:.3f} | {times[f'student|{name}']:.3f} | "
            f"{speedup:.2f}x |"
        )
    persistent = result["persistent"]
    lines.append(f"| {persistent} | {tokens[persistent]} | {times[f'teacher|{persistent}']:.3f} | - | - |")
    aligned_plain = times[f"teacher|{plain}"] / times[f"teacher|{persistent}"]
    aligned_shared = times[f"teacher|{trainer}"] / times[f"teacher|{persistent}"]
    lines += [
        "",
        f"Aligned teacher scoring / persistent control (rows of the same budget, one forward per row): "
        f"{aligned_plain:.2f}x with plain packing, {aligned_shared:.2f}x with shared-prefix packing.",
    ]
    return lines


def write_docs(lines: list[str]) -> None:
    path = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
    text = path.read_text()
    section = "\n".join([SECTION, "", *lines]) + "\n"
    pattern = re.compile(rf"^{re.escape(SECTION)}\n.*?(?=^## |\Z)", re.S | re.M)
    text = pattern.sub(lambda _: section + "\n", text) if pattern.search(text) else text.rstrip() + "\n\n" + section
    path.write_text(text)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setup_dir", default="outputs/hotpot", help="Output dir of a main-job run (its cache).")
    parser.add_argument("--recorded", default="outputs/benchmarks/recorded_invocations.json",
                        help="Where the recorded invocations are kept (recorded once, reloaded after).")  # fmt: skip
    parser.add_argument("--questions", type=int, default=8, help="Questions of the recorded rollout.")
    parser.add_argument("--num_generations", type=int, default=4, help="Episodes per question (recorded rollout).")
    parser.add_argument("--synthetic_questions", type=int, default=4, help="Questions of the synthetic mix.")
    parser.add_argument("--bucket_size", type=int, default=16, help="Invocations per length-bucketed micro-batch.")
    parser.add_argument("--row_tokens", type=int, default=4096,
                        help="Row budget of the varlen layouts with rows (the trainer's one-row layout is also run).")  # fmt: skip
    parser.add_argument("--dense_row_tokens", type=int, default=1024, help="Row budget of the sdpa tree-mask layout.")
    parser.add_argument("--student_hidden", type=int, default=128, help="Student width (the main job's).")
    parser.add_argument("--teacher_hidden", type=int, default=128, help="Teacher width (the main job's).")
    parser.add_argument("--layers", type=int, default=2, help="Layers of both models.")
    parser.add_argument("--heads", type=int, default=2, help="Attention heads of both models (2 key-value heads).")
    parser.add_argument("--vocab_size", type=int, default=0, help="Vocabulary (0: just above the largest token id).")
    parser.add_argument("--repeats", type=int, default=5, help="Interleaved repeats (medians are reported).")
    parser.add_argument("--threads", type=int, default=2, help="torch threads.")
    parser.add_argument("--write-docs", action="store_true", help=f"Replace '{SECTION}' in docs/benchmarks.md.")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    recorded = record_invocations(args)
    vocab_size = args.vocab_size or max(max(inv.input_ids + inv.output_ids) for inv in recorded) + 1
    results = {
        "recorded rollouts of the main job": measure(args, recorded, vocab_size, args.num_generations),
        "synthetic, 6-turn episodes x 8 generations": measure(
            args, synthetic_invocations(args, vocab_size), vocab_size, 8
        ),
    }
    command = "python benchmarks/shared_prefix.py " + " ".join(sys.argv[1:])
    lines = [
        f"Command: `{command}`. Machine: {os.cpu_count()} CPU cores ({platform.machine()}), {args.threads} torch "
        f"threads, torch {torch.__version__}. Models: Qwen2, hidden {args.student_hidden} (student) and "
        f"{args.teacher_hidden} (teacher), {args.layers} layers, {args.heads} heads, vocabulary {vocab_size}, fp32, "
        "random weights; "
        f"medians of {args.repeats} interleaved repeats. Every layout scores the same invocations and gives the same "
        "scores (tests/test_shared_prefix.py).",
        "",
    ]
    for title, result in results.items():
        lines += table(title, result) + [""]
    print("\n".join(lines))
    if args.write_docs:
        write_docs(lines)


if __name__ == "__main__":
    main()
