"""Per-step time split of MemOPDTrainer (rollout / teacher scoring / actor update / audit), by arm.

Tiny offline setup: a synthetic world, a local tokenizer, random tiny Qwen2 student and teacher. Random models write
malformed actions, so every episode runs `--max_turns` turns: the contexts a persistent history grows are the longest
this setup can produce, which is the case where persistent scoring costs the teacher most.

Arms (`--arms`): `aligned` and `persistent` teacher scoring with the diagnostics and the audit off;
`aligned+diagnostics` (the `distill/*` metrics, computed in the actor step); `aligned+audit` (the alignment audit at
every step, `misalignment_audit_steps=1`, timed as `time/audit`).

    python benchmarks/trainer_step.py --steps 6
    python benchmarks/trainer_step.py --steps 5 --arms aligned aligned+diagnostics aligned+audit
"""

import argparse
import os
import statistics
import sys
import tempfile
import warnings
from pathlib import Path


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))  # the offline lab

from memopd_trl import HotpotQAEnv, MemOPDConfig, MemOPDTrainer  # noqa: E402
from offline_lab import build_tiny_model, build_tokenizer, make_synthetic_world  # noqa: E402


ARMS = {
    "aligned": dict(teacher_scoring="aligned", distill_diagnostics=False, misalignment_audit_steps=0),
    "persistent": dict(teacher_scoring="persistent", distill_diagnostics=False, misalignment_audit_steps=0),
    "aligned+diagnostics": dict(teacher_scoring="aligned", distill_diagnostics=True, misalignment_audit_steps=0),
    "aligned+audit": dict(teacher_scoring="aligned", distill_diagnostics=False, misalignment_audit_steps=1),
}


def run(arm: str, args, world, tokenizer) -> dict[str, float]:
    def model(hidden, layers, seed):
        return build_tiny_model(
            len(tokenizer), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
            attn_implementation=args.attn_implementation, seed=seed,
        )

    with tempfile.TemporaryDirectory() as out:
        config = MemOPDConfig(
            output_dir=out, use_cpu=True, report_to="none", max_steps=args.steps, save_strategy="no",
            per_device_train_batch_size=args.questions, num_generations=args.num_generations,
            max_new_tokens=args.max_new_tokens, logging_steps=1, disable_tqdm=True, seed=0, **ARMS[arm],
        )
        trainer = MemOPDTrainer(
            model=model(args.student_hidden, 2, 0),
            teacher_model=model(args.teacher_hidden, 4, 1),
            args=config,
            train_dataset=world.records,
            env_factory=HotpotQAEnv.factory(
                corpus=world.corpus, top_k=2, max_turns=args.max_turns, max_malformed=args.max_turns
            ),
            processing_class=tokenizer,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
    logs = [e for e in trainer.state.log_history if "time/rollout" in e][1:]  # drop the warm-up step
    keys = ["time/rollout", "time/teacher", "time/actor", "time/audit", "context_tokens_per_invocation", "packing/fill"]
    return {key: statistics.median(e.get(key, 0.0) for e in logs) for key in keys}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="Training steps per arm (the first is not counted).")
    parser.add_argument("--questions", type=int, default=4, help="Questions per step.")
    parser.add_argument("--num_generations", type=int, default=4, help="Episodes per question.")
    parser.add_argument("--max_turns", type=int, default=4, help="Turns per episode.")
    parser.add_argument("--max_new_tokens", type=int, default=32, help="Tokens sampled per model call.")
    parser.add_argument("--student_hidden", type=int, default=64, help="Student width.")
    parser.add_argument("--teacher_hidden", type=int, default=128, help="Teacher width.")
    parser.add_argument("--attn_implementation", default="memopd_sdpa_varlen", help="Attention of both models.")
    parser.add_argument("--arms", nargs="+", default=["aligned", "persistent"], choices=list(ARMS), help="Arms to time.")
    args = parser.parse_args()

    world = make_synthetic_world(64, seed=0)
    tokenizer = build_tokenizer(world.texts(), vocab_size=1024)
    results = {arm: run(arm, args, world, tokenizer) for arm in args.arms}
    print("| arm | rollout s | teacher s | actor s | audit s | context tokens / invocation | packing fill |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for arm, r in results.items():
        print(
            f"| {arm} | {r['time/rollout']:.3f} | {r['time/teacher']:.3f} | {r['time/actor']:.3f} "
            f"| {r['time/audit']:.3f} | {r['context_tokens_per_invocation']:.0f} | {r['packing/fill']:.2f} |"
        )
    if {"aligned", "persistent"} <= set(results):
        ratio = results["persistent"]["time/teacher"] / results["aligned"]["time/teacher"]
        print(f"\nteacher time, persistent / aligned: {ratio:.2f}x")


if __name__ == "__main__":
    main()
