"""Benchmark: the per-token gap between the engine that samples a rollout and the trainer that scores it.

PPO's ratio compares the trained policy's log-prob of each sampled token with the sampling engine's. Both should be
the same model, but kernels, dtype and batching differ. This plays real HotpotQA episodes with SmolLM2-135M-Instruct
(`--checkpoint`, a float32 checkpoint) through each engine, then scores every recorded invocation with the trainer's
packed fp32 forward (`memopd_trl.scoring.action_logprobs`) and reports `|log p_engine - log p_trainer|` over the
sampled tokens (mean, 99th percentile, max), and the importance weights `losses.importance_sampling_weights` would
give them (TRL's default `sequence_mask`, cap 3):

- `hf-fp32`: transformers' `generate` in float32, the trainer's own dtype;
- `hf-bf16`: transformers' `generate` with the model in bfloat16;
- `vllm-fp32`, `vllm-bf16`: vLLM's engine (when vLLM is installed: its CPU build runs here), eager mode.

    python benchmarks/sampling_gap.py --checkpoint CKPT --dataset ../shared/data/hotpotqa_dev_distractor_sample.json

Numbers: docs/benchmarks.md ("Engine against trainer: the per-token log-prob gap").
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from memopd_trl import HotpotQAEnv, PackedInvocationCollator, RolloutEngine, load_hotpotqa  # noqa: E402
from memopd_trl.envs.retrieval import corpus_from_records  # noqa: E402
from memopd_trl.losses import importance_sampling_weights  # noqa: E402
from memopd_trl.scoring import action_logprobs  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="A float32 SmolLM2-135M-Instruct checkpoint directory.")
    parser.add_argument("--dataset", required=True, help="A local HotpotQA .json file.")
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--num_generations", type=int, default=2)
    parser.add_argument("--max_new_tokens", type=int, default=48)
    parser.add_argument("--max_prompt_length", type=int, default=768)
    parser.add_argument("--engines", nargs="+", default=["hf-fp32", "hf-bf16", "vllm-fp32", "vllm-bf16"])
    parser.add_argument("--output", default=None, help="Write the results as JSON here.")
    return parser.parse_args()


def play(engine_name: str, args, model, tokenizer, env_factory, records) -> tuple[list, float]:
    """The episodes of one engine, and the seconds they took."""
    settings = dict(max_new_tokens=args.max_new_tokens, max_prompt_length=args.max_prompt_length, temperature=1.0)
    if engine_name.startswith("hf"):
        if engine_name.endswith("bf16"):  # a copy of its own: rounding the fp32 model in place would change it
            model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.bfloat16).eval()
        engine = RolloutEngine(model, tokenizer, env_factory, **settings)
    else:
        from vllm import LLM

        dtype = "bfloat16" if engine_name.endswith("bf16") else "float32"
        llm = LLM(model=args.checkpoint, dtype=dtype, max_model_len=args.max_prompt_length + args.max_new_tokens,
                  logprobs_mode="processed_logprobs", enable_prefix_caching=True, enforce_eager=True)  # fmt: skip
        engine = RolloutEngine(None, tokenizer, env_factory, backend="vllm", vllm_llm=llm, **settings)
    torch.manual_seed(0)
    start = time.perf_counter()
    episodes, _ = engine.rollout(records, num_generations=args.num_generations)
    return episodes, time.perf_counter() - start


def gap(model, tokenizer, episodes) -> dict[str, float]:
    """The gap between the recorded log-probs and the trainer's packed fp32 scores of the same tokens."""
    invocations = [inv for ep in episodes for inv in ep.invocations]
    packed = PackedInvocationCollator(max_tokens_per_row=None, pad_token_id=tokenizer.pad_token_id)(invocations)
    with torch.no_grad():
        trainer = action_logprobs(model, packed)  # (N,)
    engine = torch.tensor([lp for inv in invocations for lp in inv.logprobs])
    sequence_ids = torch.repeat_interleave(
        torch.arange(len(invocations)), torch.tensor([len(inv.output_ids) for inv in invocations])
    )
    difference = (engine - trainer).abs()
    weights = importance_sampling_weights(trainer, engine, sequence_ids)
    return {
        "tokens": len(engine),
        "invocations": len(invocations),
        "gap_mean": difference.mean().item(),
        "gap_p99": difference.quantile(0.99).item(),
        "gap_max": difference.max().item(),
        "masked_invocations": float((weights == 0).float().mean().item()),
    }


def main() -> None:
    args = parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
    records = load_hotpotqa(args.dataset)[: args.questions]
    env_factory = HotpotQAEnv.factory(corpus=corpus_from_records(records), top_k=2, max_turns=3, max_malformed=2)
    results = {}
    for name in args.engines:
        if name.startswith("vllm"):
            try:
                import vllm  # noqa: F401
            except ImportError:
                print(f"{name}: skipped (vLLM is not installed here)")
                continue
        episodes, seconds = play(name, args, model, tokenizer, env_factory, records)
        results[name] = {**gap(model, tokenizer, episodes), "rollout_seconds": seconds}
        row = results[name]
        print(f"{name:10s} tokens {row['tokens']:5d}  |gap| mean {row['gap_mean']:.2e}  p99 {row['gap_p99']:.2e}  "
              f"max {row['gap_max']:.2e}  masked invocations {row['masked_invocations']:.1%}  ({seconds:.1f} s)")  # fmt: skip
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
