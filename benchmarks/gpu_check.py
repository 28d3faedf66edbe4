"""One script for a GPU machine: alignment of packed and shared-prefix scoring, layout timings, one trainer step.

Sized for one H200 in under 8 minutes. It prints one JSON object per section (and writes them all to `--out`):

1. **alignment**: action log-probs of plain packing and shared-prefix packing against each invocation scored alone,
   in fp32 and bf16, for `sdpa`, `memopd_sdpa_varlen` (torch's `varlen_attn` flash kernel in bf16 on CUDA) and
   `flash_attention_2` where flash-attn is installed. fp32 must agree to 1e-4; bf16 is reported (max and mean
   absolute difference of the log-probs; the bf16 bar is 0.1 nats max, set by bf16's 8-bit mantissa over a
   24-layer model);
2. **layouts**: teacher forward (no grad) and student forward + backward, bf16, Qwen2.5-0.5B-shaped random weights,
   `--invocations` invocations of 300-3000 tokens (questions x 8 generations, each question's calls sharing its
   prompt), laid out padded (micro-batches), length-bucketed padded, packed and shared-prefix packed;
3. **trainer**: one `MemOPDTrainer` step of tiny random models on the GPU, with shared-prefix packing;
4. **rollout**: one generation call of 4 questions x 8 episodes whose first contexts (1000-1250 tokens) repeat
   within each question, 32 new tokens, Qwen2.5-0.5B-shaped random weights in bf16, with the shared prompt prefill
   (`RolloutEngine(share_prefix=True)`) and without: times and whether the sampled tokens agree (in bf16
   a token may differ where the two batch shapes round a logit differently; fp32 agrees on CPU).

On the GPU machine (torch with CUDA; trl, datasets and bm25s from wheels):

    python benchmarks/gpu_check.py --out gpu_check.json

`--smoke` runs every section at toy sizes on whatever device there is (CPU here), to check the script itself.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))  # the offline lab

from transformers.utils import is_flash_attn_2_available  # noqa: E402

from memopd_trl.attention import VARLEN_SDPA  # noqa: E402
from memopd_trl.packing import PackedInvocationCollator, PaddedInvocationCollator, split_rows  # noqa: E402
from memopd_trl.records import Invocation  # noqa: E402
from memopd_trl.scoring import action_logprobs, full_logits_action_logprobs  # noqa: E402
from offline_lab import build_tiny_model  # noqa: E402


QWEN_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                intermediate_size=4864)  # fmt: skip


def invocations_with_shared_prompts(num_questions, generations, lengths, vocab_size, seed=0) -> list[Invocation]:
    """Each question: a prompt shared by all its calls, then per call a remainder; total lengths in `lengths`."""
    generator = torch.Generator().manual_seed(seed)
    low, high = lengths
    invocations = []
    for q in range(num_questions):
        prompt_length = int(torch.randint(low // 3, low, (1,), generator=generator))
        prompt = torch.randint(1, vocab_size, (prompt_length,), generator=generator).tolist()
        for g in range(generations):
            total = int(torch.randint(low, high + 1, (1,), generator=generator))
            outputs = int(torch.randint(8, 64, (1,), generator=generator))
            rest = torch.randint(1, vocab_size, (max(total - prompt_length - outputs, 1) + outputs,), generator=generator)
            invocations.append(
                Invocation(prompt + rest[:-outputs].tolist(), rest[-outputs:].tolist(), episode_id=q * generations + g)
            )
    return invocations


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def alignment(args, device) -> dict:
    implementations = ["sdpa", VARLEN_SDPA] + (["flash_attention_2"] if is_flash_attn_2_available() else [])
    sizes = dict(hidden_size=64, num_hidden_layers=2) if args.smoke else QWEN_05B
    vocab = 512 if args.smoke else 4096
    invocations = invocations_with_shared_prompts(4, 4, (40, 120) if args.smoke else (300, 1200), vocab, seed=1)
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        for impl in implementations:
            if impl == "flash_attention_2" and dtype == torch.float32:
                continue  # flash-attn kernels take half precision only
            model = build_tiny_model(vocab, attn_implementation=impl, dtype=dtype, **sizes).to(device)
            with torch.no_grad():
                alone = full_logits_action_logprobs(model, invocations).float()
                for share in (False, True):
                    if share and impl == "flash_attention_2":
                        continue  # transformers' flash path reads flat varlen fields only; trees go through ours
                    batch = PackedInvocationCollator(8192, share_prefix=share)(invocations)
                    batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
                    diff = (action_logprobs(model, batch).float() - alone).abs()
                    results.append({"dtype": str(dtype).removeprefix("torch."), "attn": impl, "shared": share,
                                    "max_abs": diff.max().item(), "mean_abs": diff.mean().item()})  # fmt: skip
            del model
    bars = {"float32": 1e-4, "bfloat16": 0.1}
    return {"section": "alignment", "results": results,
            "ok": all(r["max_abs"] <= bars[r["dtype"]] for r in results), "bars": bars}  # fmt: skip


def layouts(args, device) -> dict:
    sizes = dict(hidden_size=64, num_hidden_layers=2) if args.smoke else QWEN_05B
    vocab = 512 if args.smoke else 151936
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    num = 16 if args.smoke else args.invocations
    invocations = invocations_with_shared_prompts(num // 8, 8, (40, 200) if args.smoke else (300, 3000), vocab)
    row = 1024 if args.smoke else 16384
    by_length = sorted(invocations, key=lambda inv: inv.num_tokens)

    def padded(chunk):
        return [PaddedInvocationCollator()(invocations[i : i + chunk]) for i in range(0, len(invocations), chunk)]

    candidates = {
        "padded (micro-batches of 8)": ("sdpa", padded(8)),
        "length-bucketed padded (micro-batches of 8)": (
            "sdpa", [PaddedInvocationCollator()(by_length[i : i + 8]) for i in range(0, len(by_length), 8)]),
        f"packed, rows of {row}": (VARLEN_SDPA, [PackedInvocationCollator(row)(invocations)]),
        f"shared-prefix packed, rows of {row}": (VARLEN_SDPA, [PackedInvocationCollator(row, share_prefix=True)(invocations)]),
        "packed, one row": (VARLEN_SDPA, [PackedInvocationCollator(None)(invocations)]),
        "shared-prefix packed, one row": (VARLEN_SDPA, [PackedInvocationCollator(None, share_prefix=True)(invocations)]),
        # What the trainer runs: each row forwarded (and back-propagated) on its own, cut at its last token.
        f"shared-prefix packed, rows of {row}, one forward per row": (
            VARLEN_SDPA, split_rows(PackedInvocationCollator(row, share_prefix=True)(invocations))),
        f"shared-prefix packed, rows of {row // 4}, one forward per row": (
            VARLEN_SDPA, split_rows(PackedInvocationCollator(row // 4, share_prefix=True)(invocations))),
    }  # fmt: skip
    if is_flash_attn_2_available() and device.type == "cuda":
        candidates[f"packed, rows of {row}, flash_attention_2"] = (
            "flash_attention_2", candidates[f"packed, rows of {row}"][1])  # fmt: skip
    model = build_tiny_model(vocab, attn_implementation="sdpa", dtype=dtype, **sizes).to(device).train()
    model.gradient_checkpointing_enable()
    times = {(step, name): [] for step in ("teacher", "student") for name in candidates}
    for _ in range(1 if args.smoke else args.repeats):
        for name, (impl, batches) in candidates.items():
            model.set_attn_implementation(impl)
            for step in ("teacher", "student"):
                sync(device)
                start = time.perf_counter()
                for batch in batches:
                    batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
                    if step == "teacher":
                        with torch.no_grad():
                            action_logprobs(model, batch)
                    else:
                        action_logprobs(model, batch).float().mean().backward()
                sync(device)
                times[step, name].append(time.perf_counter() - start)
                model.zero_grad(set_to_none=True)
    tokens = {name: sum(b["input_ids"].numel() for b in batches) for name, (_, batches) in candidates.items()}
    return {"section": "layouts", "num_invocations": len(invocations), "dtype": str(dtype),
            "real_tokens": sum(inv.num_tokens for inv in invocations), "tokens_processed": tokens,
            "seconds": {f"{step}|{name}": statistics.median(v) for (step, name), v in times.items()}}  # fmt: skip


def trainer_step(args, device) -> dict:
    from memopd_trl import HotpotQAEnv, MemOPDConfig, MemOPDTrainer
    from offline_lab import build_tokenizer, make_synthetic_world

    world = make_synthetic_world(16, seed=0)
    tokenizer = build_tokenizer(world.texts(), vocab_size=600)

    def model(seed):
        return build_tiny_model(len(tokenizer), hidden_size=64, num_hidden_layers=2, attn_implementation=VARLEN_SDPA,
                                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, seed=seed)  # fmt: skip

    with tempfile.TemporaryDirectory() as out:
        config = MemOPDConfig(output_dir=out, use_cpu=device.type == "cpu", bf16=device.type == "cuda",
                              report_to="none", max_steps=1, per_device_train_batch_size=4, num_generations=4,
                              max_new_tokens=16, save_strategy="no", logging_steps=1, disable_tqdm=True)  # fmt: skip
        trainer = MemOPDTrainer(model=model(0), teacher_model=model(1), args=config, train_dataset=world.records,
                                env_factory=HotpotQAEnv.factory(corpus=world.corpus), processing_class=tokenizer)  # fmt: skip
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
    logged = next(m for m in trainer.state.log_history if "loss" in m)
    return {"section": "trainer", "seconds": seconds, "share_prefix": trainer.share_prefix,
            "loss": logged["loss"], "shared_fraction": logged.get("packing/shared_fraction"),
            "ok": bool(torch.isfinite(torch.tensor(logged["loss"])))}  # fmt: skip


def rollout_prefill(args, device) -> dict:
    from memopd_trl import RolloutEngine
    from offline_lab import build_tokenizer

    tokenizer = build_tokenizer(["a b c d e f g h"], vocab_size=300)
    vocab, sizes = len(tokenizer), dict(hidden_size=64, num_hidden_layers=2) if args.smoke else QWEN_05B
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = build_tiny_model(vocab, dtype=dtype, pad_token_id=tokenizer.pad_token_id, **sizes).to(device).eval()
    generator = torch.Generator().manual_seed(0)
    allowed = torch.tensor([t for t in range(vocab) if t not in set(tokenizer.all_special_ids)])
    low = 64 if args.smoke else 1000
    contexts = []
    for _ in range(4):
        length = low + int(torch.randint(0, low // 4 + 1, (1,), generator=generator))
        contexts += [allowed[torch.randint(0, len(allowed), (length,), generator=generator)].tolist()] * 8
    new_tokens = 8 if args.smoke else 32
    engines = {share: RolloutEngine(model, tokenizer, lambda: None, max_new_tokens=new_tokens, max_prompt_length=4 * low,
                                    eos_token_ids=[vocab + 1], share_prefix=share)
               for share in (False, True)}  # fmt: skip
    times, outputs = {False: [], True: []}, {}
    for _ in range(1 if args.smoke else args.repeats):
        for share, engine in engines.items():
            torch.manual_seed(0)
            sync(device)
            start = time.perf_counter()
            outputs[share] = engine._hf_generate(contexts, [()] * len(contexts), greedy=False)
            sync(device)
            times[share].append(time.perf_counter() - start)
    same = [o[0] for o in outputs[True]] == [o[0] for o in outputs[False]]
    off, on = statistics.median(times[False]), statistics.median(times[True])
    return {"section": "rollout", "contexts": len(contexts), "context_tokens": sum(map(len, contexts)),
            "new_tokens": new_tokens, "dtype": str(dtype), "seconds_per_episode_prefill": off,
            "seconds_shared_prefill": on, "speedup": off / on, "same_sampled_tokens": same}  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_check.json", help="Where to write the sections' results.")
    parser.add_argument("--invocations", type=int, default=256, help="Invocations of the layout timings.")
    parser.add_argument("--repeats", type=int, default=3, help="Interleaved repeats of the layout timings.")
    parser.add_argument("--smoke", action="store_true", help="Toy sizes on any device (checks the script).")
    parser.add_argument("--sections", nargs="+", default=["alignment", "layouts", "trainer", "rollout"])
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    environment = {"section": "environment", "torch": torch.__version__, "device": str(device),
                   "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
                   "flash_attn": is_flash_attn_2_available()}  # fmt: skip
    print(json.dumps(environment), flush=True)
    results = [environment]
    for name in args.sections:
        start = time.perf_counter()
        sections = {"alignment": alignment, "layouts": layouts, "trainer": trainer_step, "rollout": rollout_prefill}
        result = sections[name](args, device)
        result["wall_seconds"] = time.perf_counter() - start
        print(json.dumps(result), flush=True)
        results.append(result)
        Path(args.out).write_text(json.dumps(results, indent=1))
    failed = [r["section"] for r in results if r.get("ok") is False]
    if failed:
        raise SystemExit(f"failed: {failed}")


if __name__ == "__main__":
    main()
