"""Benchmark: the actor's (student's) forward + backward on real weights, packed vs padded layouts.

SmolLM2-135M-Instruct (the float32 checkpoint of `tests/real_weights.py`) plays `--questions` HotpotQA questions of
the bundled dev sample x `--num_generations` episodes once; the recorded invocations are kept in `--recorded` (JSON
token ids) and reused by later runs. The student then scores them (sum of the action log-probs, `.backward()`) under
four layouts: shared-prefix packing and plain packing (one row, with `memopd_sdpa_varlen` and with `sdpa`),
length-bucketed padding and plain padding (`sdpa`). Times are medians of `--repeats` interleaved repeats; ratios are
against plain padding, from the same run.

    python benchmarks/real_actor.py --recorded outputs/benchmarks/real_actor_invocations.json
"""

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path


os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
from real_weights import smollm2_checkpoint  # noqa: E402

from memopd_trl.attention import VARLEN_SDPA, register_varlen_attention  # noqa: E402
from memopd_trl.packing import PackedInvocationCollator, PaddedInvocationCollator  # noqa: E402
from memopd_trl.records import Invocation  # noqa: E402
from memopd_trl.scoring import action_logprobs  # noqa: E402


OPTIONS = (  # integer options: flag, default, help
    ("--questions", 6, "HotpotQA questions of the recording."),
    ("--num_generations", 2, "Episodes per question (recording)."),
    ("--max_new_tokens", 32, "Tokens per action (recording)."),
    ("--max_prompt_length", 768, "Prompt budget (recording)."),
    ("--limit", 0, "Time only the first N invocations (0: all)."),
    ("--bucket_size", 4, "Invocations per length-bucketed micro-batch."),
    ("--repeats", 3, "Interleaved repeats (medians are reported)."),
    ("--threads", 2, "torch threads while timing."),
)
FIELDS = ("input_ids", "output_ids", "episode_id", "turn", "observation_ids")


def load_model(checkpoint: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="sdpa")


def recorded_invocations(args: argparse.Namespace) -> list[Invocation]:
    """Play real HotpotQA questions with SmolLM2 once (1 thread); afterwards reload the saved invocations."""
    path = Path(args.recorded)
    if not path.exists():
        from transformers import AutoTokenizer

        from memopd_trl import HotpotQAEnv, RolloutEngine, load_hotpotqa
        from memopd_trl.envs.retrieval import corpus_from_records

        records = load_hotpotqa(ROOT.parent / "shared" / "data" / "hotpotqa_dev_distractor_sample.json")
        checkpoint = smollm2_checkpoint()
        factory = HotpotQAEnv.factory(corpus=corpus_from_records(records), top_k=2, max_turns=3, max_malformed=2)
        engine = RolloutEngine(
            load_model(checkpoint).eval(), AutoTokenizer.from_pretrained(checkpoint), factory,
            max_new_tokens=args.max_new_tokens, max_prompt_length=args.max_prompt_length,
        )  # fmt: skip
        torch.set_num_threads(1)
        torch.manual_seed(0)
        episodes, _ = engine.rollout(records[: args.questions], num_generations=args.num_generations)
        rows = [{f: getattr(inv, f) for f in FIELDS} for ep in episodes for inv in ep.invocations]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(rows))
    return [Invocation(**row) for row in json.loads(path.read_text())]


def candidate_layouts(invocations: list[Invocation], bucket: int) -> list[tuple[str, str, list[dict]]]:
    """(name, attention, batches holding every invocation once); plain padding last (the reference)."""
    shared = PackedInvocationCollator(None, share_prefix=True)(invocations)
    plain = PackedInvocationCollator(None)(invocations)
    ordered = sorted(invocations, key=lambda inv: inv.num_tokens)
    buckets = [PaddedInvocationCollator()(ordered[i : i + bucket]) for i in range(0, len(ordered), bucket)]
    return [
        (f"shared-prefix packing, one row, {VARLEN_SDPA}", VARLEN_SDPA, [shared]),
        ("shared-prefix packing, one row, sdpa (tree mask)", "sdpa", [shared]),
        (f"plain packing, one row, {VARLEN_SDPA}", VARLEN_SDPA, [plain]),
        ("plain packing, one row, sdpa", "sdpa", [plain]),
        (f"length-bucketed padding, micro-batches of {bucket}, sdpa", "sdpa", buckets),
        ("plain padding, one batch, sdpa", "sdpa", [PaddedInvocationCollator()(invocations)]),
    ]


def actor_seconds(model, attention: str, batches: list[dict]) -> float:
    """One forward + backward of the student over `batches` (sum of action log-probs), in seconds."""
    model.set_attn_implementation(attention)
    gc.collect()
    start = time.perf_counter()
    for batch in batches:
        action_logprobs(model, batch).sum().backward()
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recorded", default="outputs/benchmarks/real_actor_invocations.json",
                        help="Recorded invocations (written on the first run, reloaded after).")  # fmt: skip
    for flag, default, help_text in OPTIONS:
        parser.add_argument(flag, type=int, default=default, help=help_text)
    args = parser.parse_args()

    invocations = recorded_invocations(args)
    invocations = invocations[: args.limit] if args.limit else invocations
    torch.set_num_threads(args.threads)
    register_varlen_attention()
    model = load_model(smollm2_checkpoint()).train()
    candidates = candidate_layouts(invocations, args.bucket_size)
    actor_seconds(model, VARLEN_SDPA, [PackedInvocationCollator(None)(invocations[:2])])  # warm-up
    times = {name: [] for name, _, _ in candidates}
    for repeat in range(args.repeats):
        for name, attention, batches in candidates:  # interleaved: load drift hits every layout alike
            times[name].append(actor_seconds(model, attention, batches))
        print(f"  repeat {repeat + 1}/{args.repeats}", file=sys.stderr)

    real = sum(inv.num_tokens for inv in invocations)
    reference = statistics.median(times[candidates[-1][0]])
    command = " ".join(["python benchmarks/real_actor.py", *sys.argv[1:]])
    lines = [
        f"Command: `{command}`. Machine: {os.cpu_count()} CPU cores ({platform.machine()}), other work may be "
        f"running; {args.threads} torch threads, torch {torch.__version__}. SmolLM2-135M-Instruct, fp32; "
        f"{len(invocations)} recorded invocations of {len({inv.episode_id for inv in invocations})} episodes, "
        f"{real} rebuilt tokens ({sum(len(inv.output_ids) for inv in invocations)} action tokens); medians of "
        f"{args.repeats} interleaved repeats.",
        "",
        "| layout | tokens laid out | laid out / real | forward + backward (s) | speed-up vs plain padding |",
        "|---|---|---|---|---|",
    ]
    for name, _, batches in candidates:
        tokens = sum(b["input_ids"].numel() for b in batches)
        median = statistics.median(times[name])
        lines.append(f"| {name} | {tokens} | {tokens / real:.2f} | {median:.2f} | {reference / median:.2f}x |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
