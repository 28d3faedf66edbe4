"""Benchmark: the HF rollout's shared prompt prefill (`RolloutEngine(share_prefix=True)`) against encoding
every episode's first context on its own.

The `num_generations` episodes of a question start from the same context. With sharing, each distinct context of a
generation call is encoded once and its KV cache indexed out to its episodes; without, `generate` encodes every row.
Two settings, each timed with sharing on and off in interleaved repeats (medians), from the same seed:

- **main job**: one training step's rollout of the offline default (`--questions` x `--num_generations` episodes of
  up to 4 turns) by the cached student start of `accelerate launch examples/hotpot.py` in `--setup_dir`;
- **long first contexts**: one generation call of `--long_questions` x `--long_generations` contexts of
  `--long_context` tokens (random ids, so the model decodes the full `--long_new_tokens`), on a wider random Qwen2
  (`--long_hidden`, `--long_layers`): the regime of real agents, where the first context (instructions, task,
  retrieved passages) is long and actions are short.

    python benchmarks/rollout_prefill.py --setup_dir outputs/hotpot --write-docs
"""

import argparse
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
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))  # the offline lab and the main job

from memopd_trl import RolloutEngine  # noqa: E402
from offline_lab import build_tiny_model, build_tokenizer  # noqa: E402


SECTION = "## Rollout: shared prompt prefill"


def interleaved(runs: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each `name -> fn` over `repeats` rounds, the runs interleaved inside each round."""
    times = {name: [] for name in runs}
    for repeat in range(repeats):
        for name, fn in runs.items():
            torch.manual_seed(0)
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
        print(f"  repeat {repeat + 1}/{repeats}", file=sys.stderr)
    return {name: statistics.median(values) for name, values in times.items()}


def main_job(args) -> dict | None:
    """One training step's rollout of the main job's student start, with and without sharing."""
    setup = Path(args.setup_dir)
    if not (setup / "student_init").exists():
        print(
            f"No cached set-up in {setup}: run `accelerate launch examples/hotpot.py` first; skipped.", file=sys.stderr
        )
        return None
    import hotpot

    import offline_lab as offline

    script, config, _ = hotpot.parse_args(["--output_dir", args.setup_dir])
    env = dict(max_turns=script.max_turns, memory_policy=script.memory_policy, action_format=script.action_format)
    world = offline.make_offline_world(script, **env)
    model = offline.load_offline_model(setup / "student_init").eval()
    tokenizer = offline.load_offline_tokenizer(setup / "teacher")
    records = world.train[: args.questions]
    engines = {
        share: RolloutEngine(
            model,
            tokenizer,
            world.env_factory,
            max_new_tokens=config.max_new_tokens,
            max_prompt_length=config.max_prompt_length,
            temperature=config.temperature,
            share_prefix=share,
        )
        for share in (False, True)
    }
    stats = {}

    def play(share: bool):
        episodes, stats[share] = engines[share].rollout(records, num_generations=args.num_generations)
        return episodes

    times = interleaved({"off": lambda: play(False), "on": lambda: play(True)}, args.repeats)
    torch.manual_seed(0)
    same = [[i.output_ids for i in e.invocations] for e in play(True)]
    torch.manual_seed(0)
    same = same == [[i.output_ids for i in e.invocations] for e in play(False)]
    return {
        "setting": f"main job: {len(records)} questions x {args.num_generations} episodes, student start "
        f"(hidden {model.config.hidden_size}, {model.config.num_hidden_layers} layers), temperature "
        f"{config.temperature}, max_new_tokens {config.max_new_tokens}",
        "times": times,
        "prompt_tokens": stats[False]["num_prompt_tokens"],
        "saved_tokens": stats[True]["num_shared_prefill_tokens"],
        "generated_tokens": stats[False]["num_generated_tokens"],
        "model_calls": stats[False]["num_turns"],
        "same_actions": same,
    }


def long_contexts(args) -> dict:
    """One generation call over long, repeated first contexts, with and without sharing."""
    tokenizer = build_tokenizer(["a b c d e f g h"], vocab_size=300)
    vocab = len(tokenizer)
    model = build_tiny_model(vocab, hidden_size=args.long_hidden, num_hidden_layers=args.long_layers,
                             num_attention_heads=args.long_hidden // 64, num_key_value_heads=2,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id).eval()  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    specials = set(tokenizer.all_special_ids)
    allowed = torch.tensor([t for t in range(vocab) if t not in specials])
    contexts = []
    for _ in range(args.long_questions):
        length = args.long_context + int(torch.randint(0, args.long_context // 4 + 1, (1,), generator=generator))
        ids = allowed[torch.randint(0, len(allowed), (length,), generator=generator)].tolist()
        contexts += [ids] * args.long_generations
    stops = [()] * len(contexts)
    engines = {
        share: RolloutEngine(
            model,
            tokenizer,
            lambda: None,
            max_new_tokens=args.long_new_tokens,
            max_prompt_length=4 * args.long_context,
            eos_token_ids=[vocab + 1],
            share_prefix=share,
        )
        for share in (False, True)
    }
    outputs = {}

    def generate(share: bool):
        outputs[share] = engines[share]._hf_generate(contexts, stops, greedy=False)

    times = interleaved({"off": lambda: generate(False), "on": lambda: generate(True)}, args.repeats)
    distinct = {tuple(c) for c in contexts}
    return {
        "setting": f"long first contexts: {args.long_questions} questions x {args.long_generations} episodes, "
        f"contexts of {min(map(len, contexts))}-{max(map(len, contexts))} tokens, {args.long_new_tokens} new tokens, "
        f"random Qwen2 (hidden {args.long_hidden}, {args.long_layers} layers)",
        "times": times,
        "prompt_tokens": sum(map(len, contexts)),
        "saved_tokens": sum(map(len, contexts)) - sum(len(c) - 1 for c in distinct) - len(contexts),
        "generated_tokens": len(contexts) * args.long_new_tokens,
        "model_calls": len(contexts),
        "same_actions": [o[0] for o in outputs[True]] == [o[0] for o in outputs[False]],
    }


def rows(result: dict) -> list[str]:
    off, on = result["times"]["off"], result["times"]["on"]
    return [
        f"**{result['setting']}**: {result['model_calls']} model calls, {result['prompt_tokens']} context tokens of "
        f"which {result['saved_tokens']} are not encoded again with sharing, {result['generated_tokens']} sampled "
        f"tokens; same sampled tokens with and without: {'yes' if result['same_actions'] else 'NO'}.",
        "",
        "| prompt prefill | time (s) | speed-up |",
        "|---|---|---|",
        f"| once per episode | {off:.3f} | 1.00x |",
        f"| once per distinct context (shared) | {on:.3f} | {off / on:.2f}x |",
        "",
    ]


def write_docs(lines: list[str]) -> None:
    path = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
    text = path.read_text()
    block = SECTION + "\n\n" + "\n".join(lines).rstrip() + "\n"
    pattern = re.compile(re.escape(SECTION) + r"\n.*?(?=\n## |\Z)", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block
    path.write_text(text)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setup_dir", default="outputs/hotpot", help="Output dir of a main-job run (its cache).")
    parser.add_argument("--questions", type=int, default=8, help="Questions of the main job's rollout.")
    parser.add_argument("--num_generations", type=int, default=4, help="Episodes per question (main job).")
    parser.add_argument("--long_questions", type=int, default=4, help="Questions of the long-context call.")
    parser.add_argument("--long_generations", type=int, default=8, help="Episodes per question (long contexts).")
    parser.add_argument("--long_context", type=int, default=1024, help="Shortest long first context, in tokens.")
    parser.add_argument("--long_new_tokens", type=int, default=32, help="Tokens sampled per long context.")
    parser.add_argument("--long_hidden", type=int, default=256, help="Width of the long-context model.")
    parser.add_argument("--long_layers", type=int, default=4, help="Layers of the long-context model.")
    parser.add_argument("--repeats", type=int, default=5, help="Interleaved repeats (medians are reported).")
    parser.add_argument("--threads", type=int, default=2, help="torch threads.")
    parser.add_argument("--write-docs", action="store_true", help=f"Replace '{SECTION}' in docs/benchmarks.md.")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    results = [r for r in (main_job(args), long_contexts(args)) if r is not None]
    command = "python benchmarks/rollout_prefill.py " + " ".join(sys.argv[1:])
    lines = [
        f"Command: `{command}`. Machine: {os.cpu_count()} CPU cores ({platform.machine()}), {args.threads} torch "
        f"threads, torch {torch.__version__}, fp32, medians of {args.repeats} interleaved repeats.",
        "",
    ]
    for result in results:
        lines += rows(result)
    print("\n".join(lines))
    if args.write_docs:
        write_docs(lines)


if __name__ == "__main__":
    main()
