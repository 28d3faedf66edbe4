"""Benchmark: packed vs padded invocation scoring (time), chunked LM head, and head-at-actions memory.

Builds a realistic mix of recorded invocations (long inputs, short outputs, random token ids, fixed seed) and a small
randomly initialised model, then measures on CPU:

1. student forward + backward and teacher forward (no grad) over several layouts of the same invocations: one padded
   batch, length-bucketed padded micro-batches, and packed rows (a few row widths, with transformers' `sdpa` and with
   the padding-free `memopd_sdpa_varlen` attention). Times are medians of interleaved repeats, shown next to the
   ideal ratio (padded tokens / real tokens);
2. the LM-head step alone (forward + backward): full logits vs chunked implementations;
3. peak memory of teacher scoring with the head at action positions (chunked) vs full logits, for a few vocabulary
   sizes.

Peak memory is measured in a child process started with `MALLOC_MMAP_THRESHOLD_=65536`, so that every tensor larger
than 64 KiB is its own mapping and freed memory leaves the resident set at once: the peak is the rise of the
resident-set high-water mark (`VmHWM`, reset through `/proc/self/clear_refs` before each call) over the resident set
just before the call. Linux only.

Run `python benchmarks/packing.py --help` for the options; `--write-docs` replaces the "Packing and scoring" section
of docs/benchmarks.md with the printed tables.
"""

import argparse
import gc
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))  # the offline lab

from memopd_trl.attention import VARLEN_SDPA  # noqa: E402
from memopd_trl.packing import PackedInvocationCollator, PaddedInvocationCollator, gather_actions  # noqa: E402
from memopd_trl.records import Invocation  # noqa: E402
from memopd_trl.scoring import action_logprobs, action_logprobs_from_hidden, action_token_ids  # noqa: E402
from offline_lab import build_tiny_model  # noqa: E402


SECTION = "## Packing and scoring"


def make_invocations(args: argparse.Namespace, num_invocations: int, vocab_size: int) -> list[Invocation]:
    """Random invocations with uniformly drawn input and output lengths (fixed seed)."""
    generator = torch.Generator().manual_seed(args.seed)
    invocations = []
    for i in range(num_invocations):
        num_inputs = int(torch.randint(args.input_range[0], args.input_range[1] + 1, (1,), generator=generator))
        num_outputs = int(torch.randint(args.output_range[0], args.output_range[1] + 1, (1,), generator=generator))
        ids = torch.randint(1, vocab_size, (num_inputs + num_outputs,), generator=generator).tolist()
        invocations.append(Invocation(ids[:num_inputs], ids[num_inputs:], episode_id=i // 4, turn=i % 4))
    return invocations


def make_model(args: argparse.Namespace, vocab_size: int):
    return build_tiny_model(
        vocab_size,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        attn_implementation="sdpa",
    )


def layouts(args: argparse.Namespace, invocations: list[Invocation]) -> list[tuple[str, str, list[dict]]]:
    """(name, attention implementation, batches that together hold every invocation once), padded first."""
    longest = max(inv.num_tokens for inv in invocations)
    by_length = sorted(invocations, key=lambda inv: inv.num_tokens)
    size = args.bucket_size
    result = [
        ("padded, one batch", "sdpa", [PaddedInvocationCollator()(invocations)]),
        (
            f"length-bucketed padded, micro-batches of {size}",
            "sdpa",
            [PaddedInvocationCollator()(by_length[i : i + size]) for i in range(0, len(by_length), size)],
        ),
    ]
    for impl, specs in (("sdpa", args.sdpa_row_tokens), (VARLEN_SDPA, args.varlen_row_tokens)):
        for spec in specs:
            width = int(float(spec[:-1]) * longest) if spec.endswith("x") else int(spec)
            batch = PackedInvocationCollator(max_tokens_per_row=width)(invocations)
            result.append((f"packed, rows of {width} ({spec} longest), {impl}", impl, [batch]))
    return result


def student_step(model, batch: dict) -> None:
    action_logprobs(model, batch, chunk_size=1024).mean().backward()


def teacher_step(model, batch: dict) -> None:
    with torch.no_grad():
        action_logprobs(model, batch, chunk_size=1024)


def speed_table(args: argparse.Namespace) -> list[str]:
    invocations = make_invocations(args, args.num_invocations, args.vocab_size)
    model = make_model(args, args.vocab_size).train()  # dropout is 0 in these configs
    real = sum(inv.num_tokens for inv in invocations)
    candidates = layouts(args, invocations)
    steps = {"student": student_step, "teacher": teacher_step}
    times = {(step, name): [] for step in steps for name, _, _ in candidates}
    teacher_step(model, PackedInvocationCollator()(invocations[:2]))  # warm-up
    for repeat in range(args.repeats):
        for step, fn in steps.items():
            for name, impl, batches in candidates:  # interleaved, so load drift hits every layout alike
                model.set_attn_implementation(impl)
                gc.collect()
                start = time.perf_counter()
                for batch in batches:
                    fn(model, batch)
                times[step, name].append(time.perf_counter() - start)
                model.zero_grad(set_to_none=True)
        print(f"  speed: repeat {repeat + 1}/{args.repeats} done", file=sys.stderr)

    padded_name, _, padded_batches = candidates[0]
    padded_tokens = sum(b["input_ids"].numel() for b in padded_batches)
    median = {key: statistics.median(values) for key, values in times.items()}
    best = {key: min(values) for key, values in times.items()}
    lines = [
        f"{len(invocations)} invocations, inputs {args.input_range[0]}-{args.input_range[1]} tokens, outputs "
        f"{args.output_range[0]}-{args.output_range[1]} tokens: {real} real tokens, {padded_tokens} when padded, "
        f"**ideal ratio padded / real = {padded_tokens / real:.2f}x**. Model: hidden {args.hidden_size}, "
        f"{args.num_layers} layers, {args.num_heads} heads ({args.num_kv_heads} kv), vocab {args.vocab_size}, fp32; "
        "log-probs with the head at action positions in every layout. Times: median of "
        f"{args.repeats} interleaved repeats (fastest repeat in brackets); speedups vs the padded batch, from "
        "medians (from fastest repeats in brackets).",
        "",
        "| layout | rows x width | fill | layout tokens vs padded | student fwd+bwd (s) | speedup | "
        "teacher fwd (s) | speedup |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, _, batches in candidates:
        tokens = sum(b["input_ids"].numel() for b in batches)
        shapes = " + ".join(f"{b['input_ids'].shape[0]}x{b['input_ids'].shape[1]}" for b in batches[:2])
        shapes += " + ..." if len(batches) > 2 else ""
        cells = []
        for step in steps:
            cells.append(f"{median[step, name]:.2f} ({best[step, name]:.2f})")
            cells.append(
                f"{median[step, padded_name] / median[step, name]:.2f}x "
                f"({best[step, padded_name] / best[step, name]:.2f}x)"
            )
        lines.append(
            f"| {name} | {shapes} | {real / tokens:.2f} | {padded_tokens / tokens:.2f}x | {' | '.join(cells)} |"
        )
    return lines


def _status_kib(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def peak_rss_rise_mib(fn, *args):
    """
    Run `fn(*args)`; return the rise of the resident-set high-water mark during the call over the resident set just
    before it (MiB), and the call's result.
    """
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current VmRSS
    before = _status_kib("VmRSS")
    result = fn(*args)
    return (_status_kib("VmHWM") - before) / 1024, result


def full_logits_teacher(model, batch: dict) -> torch.Tensor:
    """The naive teacher: logits for every position of every row, then pick the action positions."""
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    log_probs = logits.float().log_softmax(-1)  # (rows, width, vocab_size)
    ati = batch["action_target_index"]
    per_action = gather_actions(log_probs[:, :-1], ati[:, 1:])  # (N, vocab_size)
    return per_action.gather(-1, action_token_ids(batch)[:, None]).squeeze(-1)


def head_variants(weight: torch.Tensor, targets: torch.Tensor) -> dict:
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    def naive(hidden):
        return F.linear(hidden, weight).log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)

    def ours(chunk_size):
        return lambda hidden: action_logprobs_from_hidden(hidden, weight, None, targets, chunk_size=chunk_size)[0]

    def trl(vocab_chunk):
        return lambda hidden: ChunkedLogProbFunction.apply(
            hidden, weight, None, targets, 1.0, vocab_chunk, None, 1.0, ()
        )[0]

    return {
        "full logits (naive)": naive,
        "ours (action_logprobs_from_hidden), token chunks of 256, checkpointed": ours(256),
        "ours (action_logprobs_from_hidden), token chunks of 1024, checkpointed": ours(1024),
        "TRL ChunkedLogProbFunction, vocab chunks of 4096": trl(4096),
        "TRL ChunkedLogProbFunction, vocab chunks of 16384": trl(16384),
    }


def head_inputs(args: argparse.Namespace):
    generator = torch.Generator().manual_seed(args.seed)
    hidden = torch.randn(args.head_tokens, args.hidden_size, generator=generator)
    weight = torch.nn.Parameter(torch.randn(args.head_vocab_size, args.hidden_size, generator=generator) * 0.02)
    targets = torch.randint(0, args.head_vocab_size, (args.head_tokens,), generator=generator)
    return hidden, weight, targets


def head_step(fn, hidden0: torch.Tensor, weight: torch.nn.Parameter) -> tuple[torch.Tensor, torch.Tensor]:
    hidden = hidden0.clone().requires_grad_(True)
    weight.grad = None
    fn(hidden).mean().backward()
    return hidden.grad, weight.grad


def head_times(args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    """Median forward + backward time of each head implementation, and its max abs gradient diff vs naive."""
    hidden0, weight, targets = head_inputs(args)
    variants = head_variants(weight, targets)
    runs = {name: [] for name in variants}
    grads = {}
    for _ in range(args.repeats):
        for name, fn in variants.items():
            start = time.perf_counter()
            grads[name] = head_step(fn, hidden0, weight)
            runs[name].append(time.perf_counter() - start)
    reference = grads["full logits (naive)"]
    return {
        name: (
            statistics.median(runs[name]),
            max((a - b).abs().max().item() for a, b in zip(grads[name], reference, strict=True)),
        )
        for name in variants
    }


def memory_child(args: argparse.Namespace) -> dict:
    """Runs in the child process: peak memory of the head variants and of teacher scoring."""
    hidden0, weight, targets = head_inputs(args)
    head = {
        name: peak_rss_rise_mib(head_step, fn, hidden0, weight)[0]
        for name, fn in head_variants(weight, targets).items()
    }
    teacher = []
    for vocab_size in args.memory_vocab_sizes:
        invocations = make_invocations(args, args.memory_invocations, vocab_size)
        model = make_model(args, vocab_size)
        batch = PackedInvocationCollator(max_tokens_per_row=max(inv.num_tokens for inv in invocations))(invocations)
        with torch.no_grad():
            full, full_scores = peak_rss_rise_mib(full_logits_teacher, model, batch)
            chunked, chunked_scores = peak_rss_rise_mib(action_logprobs, model, batch)
        teacher.append(
            {
                "vocab_size": vocab_size,
                "real_tokens": batch["num_real_tokens"],
                "action_tokens": batch["num_action_tokens"],
                "full": full,
                "chunked": chunked,
                "diff": (full_scores - chunked_scores).abs().max().item(),
            }
        )
        del model, batch
    return {"head": head, "teacher": teacher}


def run_memory_child(args: argparse.Namespace, argv: list[str]) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run(
        [sys.executable, __file__, *argv, "--memory-child"], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def head_table(args: argparse.Namespace, memory: dict | None) -> list[str]:
    lines = [
        f"{args.head_tokens} action tokens, hidden {args.hidden_size}, vocab {args.head_vocab_size}, fp32: forward + "
        f"backward of the mean log-prob, median of {args.repeats} repeats.",
        "",
        "| implementation | time (s) | peak memory (MiB) | max abs grad diff vs naive |",
        "|---|---|---|---|",
    ]
    for name, (seconds, diff) in head_times(args).items():
        peak = f"{memory['head'][name]:.0f}" if memory else "-"
        lines.append(f"| {name} | {seconds:.3f} | {peak} | {diff:.1e} |")
    return lines


def memory_table(args: argparse.Namespace, memory: dict) -> list[str]:
    lines = [
        f"Teacher scoring (no grad) of {args.memory_invocations} invocations packed into rows; hidden "
        f"{args.hidden_size}, {args.num_layers} layers, fp32. Head at actions uses `action_logprobs` (chunks of 1024 "
        "action tokens); full logits runs `model(...)` and takes `log_softmax` over every position.",
        "",
        "| vocab | real tokens | action tokens | full logits peak (MiB) | head at actions peak (MiB) | ratio "
        "| max abs log-prob diff |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in memory["teacher"]:
        lines.append(
            f"| {row['vocab_size']} | {row['real_tokens']} | {row['action_tokens']} | {row['full']:.0f} | "
            f"{row['chunked']:.0f} | {row['full'] / max(row['chunked'], 1e-9):.1f}x | {row['diff']:.1e} |"
        )
    return lines


def write_docs(path: Path, body: str) -> None:
    """Replace (or append) this benchmark's section of `path`, leaving every other section as it is."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    pattern = re.compile(rf"^{re.escape(SECTION)}\n.*?(?=^## |\Z)", re.S | re.M)
    section = f"{SECTION}\n\n{body.strip()}\n\n"
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + section
    path.write_text(text.rstrip("\n") + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-invocations", type=int, default=32)
    parser.add_argument("--input-range", type=int, nargs=2, default=(100, 700), metavar=("MIN", "MAX"))
    parser.add_argument("--output-range", type=int, nargs=2, default=(10, 80), metavar=("MIN", "MAX"))
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument(
        "--sdpa-row-tokens",
        nargs="*",
        default=["1x"],
        help="Row widths to try for packed rows under transformers' sdpa (dense block mask): an integer, or a "
        "multiple of the longest invocation such as 1.5x.",
    )
    parser.add_argument(
        "--varlen-row-tokens",
        nargs="*",
        default=["1x", "2x"],
        help="Row widths to try for packed rows under memopd_sdpa_varlen (attention per sequence).",
    )
    parser.add_argument("--bucket-size", type=int, default=8, help="Invocations per length-bucketed micro-batch.")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--memory-invocations", type=int, default=8)
    parser.add_argument("--memory-vocab-sizes", type=int, nargs="+", default=[32000, 150000])
    parser.add_argument("--head-tokens", type=int, default=2048)
    parser.add_argument("--head-vocab-size", type=int, default=32000)
    parser.add_argument("--skip", nargs="*", default=[], choices=["speed", "head", "memory"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--write-docs", action="store_true", help="Write the tables into docs/benchmarks.md.")
    parser.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    if args.memory_child:
        print(json.dumps(memory_child(args)))
        return
    body = [
        f"Command: `{' '.join(['python benchmarks/packing.py', *argv])}`",
        "",
        f"Machine: {os.cpu_count()} CPU cores ({platform.machine()}), {torch.get_num_threads()} torch threads, torch "
        f"{torch.__version__}, shared with other jobs (times are noisy; layouts are interleaved).",
    ]
    print("\n".join(body), flush=True)
    memory = None
    if "memory" not in args.skip or "head" not in args.skip:
        print("measuring memory in a child process ...", file=sys.stderr)
        memory = run_memory_child(args, [a for a in argv if a != "--write-docs"])
    sections = [
        ("speed", "### Padded vs bucketed vs packed (time)", lambda: speed_table(args)),
        ("head", "### LM head alone: chunked log-probs, forward + backward", lambda: head_table(args, memory)),
        (
            "memory",
            "### Teacher scoring peak memory: head at actions vs full logits",
            lambda: memory_table(args, memory),
        ),
    ]
    for key, title, fn in sections:
        if key in args.skip:
            continue
        print(f"running {key} ...", file=sys.stderr)
        part = ["", title, "", *fn()]
        print("\n".join(part), flush=True)
        body += part
    if args.write_docs:
        write_docs(Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md", "\n".join(body))


if __name__ == "__main__":
    main()
