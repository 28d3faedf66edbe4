"""Benchmark: what a real-weights recipe of the main job would cost on this machine, measured before it is built.

The recipe: SmolLM2-135M-Instruct as teacher and student start, on the offline world's memory-needing lookup tasks
(two-part, compact memory) rendered through SmolLM2's own chat template. The teacher imitates the full-memory expert
(in the compact layout, and for a fair persistent control also in the persistent one: the same expert rendered as one
growing history); the student start imitates the forgetful (`searches`-memory) expert. Then three arms train.

This measures, on the checkpoint (`--checkpoint`, float32):

- the expert data: tokens per task in each layout (SmolLM2's tokenizer and chat template), action tokens per task;
- one imitation step (forward + backward + AdamW) on a packed batch of `--tokens_per_batch` expert tokens, full
  fine-tuning and LoRA (rank 16 on every linear layer);
- decoding throughput of transformers' `generate` at the arms' batch (`--questions` x `--num_generations` rows);
- one trainer update's teacher and student time, through the scoring the trainer runs (packed forward of the expert's
  invocations, teacher no-grad, student forward + backward).

and extrapolates the set-up (`--setup_tasks` tasks, `--epochs`) and the arms (`--updates` each) in minutes.

    python benchmarks/real_recipe_cost.py --checkpoint CKPT

Numbers: the issue notes and docs/results.md once the recipe runs.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch


os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))  # the offline lab

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from memopd_trl import HotpotQAEnv, PackedInvocationCollator, RolloutEngine  # noqa: E402
from memopd_trl.attention import VARLEN_SDPA, register_varlen_attention  # noqa: E402
from memopd_trl.packing import split_rows  # noqa: E402
from memopd_trl.scoring import action_hidden_states, action_logprobs  # noqa: E402
from offline_lab import OfflineConfig, expert_invocations, expert_trajectories, make_offline_world  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="A float32 SmolLM2-135M-Instruct checkpoint directory.")
    parser.add_argument("--tasks", type=int, default=48, help="Expert tasks measured.")
    parser.add_argument("--tokens_per_batch", type=int, default=4096)
    parser.add_argument("--questions", type=int, default=4, help="Tasks per update.")
    parser.add_argument("--num_generations", type=int, default=4)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--setup_tasks", type=int, default=200, help="Tasks each set-up model imitates.")
    parser.add_argument("--epochs", type=float, default=2.0, help="Imitation epochs of each set-up model.")
    parser.add_argument("--updates", type=int, default=20, help="Updates per arm.")
    parser.add_argument("--output", default=None, help="Write the results as JSON here.")
    return parser.parse_args()


def world_and_layouts(num_tasks: int):
    """The offline main job's world (its defaults) and an environment factory per memory layout."""
    config = OfflineConfig(
        num_train_questions=2 * max(num_tasks, 50), num_eval_questions=20, lookup_fraction=1.0, short_names=True,
        num_sub_questions=2,
    )  # fmt: skip
    world = make_offline_world(config, max_turns=4, memory_policy="compact", action_format="memopd")
    settings = {**world.env_settings(), "corpus": world.world.corpus}
    layouts = {
        policy: HotpotQAEnv.factory(**{**settings, "memory_policy": policy}) for policy in ("compact", "full_history")
    }
    return world, layouts


def step_seconds(model, batch_rows, optimizer) -> float:
    """One imitation step: the action tokens' NLL over packed rows, backward, optimizer step."""
    start = time.perf_counter()
    for row in batch_rows:
        (-action_logprobs(model, row).mean()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    register_varlen_attention()
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    world, layouts = world_and_layouts(args.tasks)
    tasks = world.train[: args.tasks]
    results = {"tasks": args.tasks, "layouts": {}}
    data = {}
    for name, memory in (("teacher", None), ("student_start", "searches")):
        for policy, factory in layouts.items():
            if name == "student_start" and policy != "compact":
                continue
            trajectories = expert_trajectories(tasks, factory, memory=memory)
            steps = [step for trajectory in trajectories for step in trajectory.steps]
            invocations = expert_invocations(steps, tokenizer)
            key = f"{name}/{policy}"
            data[key] = invocations
            results["layouts"][key] = {
                "expert_f1": sum(t.f1 for t in trajectories) / len(trajectories),
                "turns_per_task": len(steps) / len(tasks),
                "tokens_per_task": sum(inv.num_tokens for inv in invocations) / len(tasks),
                "action_tokens_per_task": sum(len(inv.output_ids) for inv in invocations) / len(tasks),
            }
            print(key, json.dumps({k: round(v, 3) for k, v in results["layouts"][key].items()}))

    # One imitation step, full fine-tuning and LoRA.
    invocations = data["teacher/compact"]
    collator = PackedInvocationCollator(pad_token_id=tokenizer.pad_token_id, max_tokens_per_row=2048, share_prefix=False)
    batch, total = [], 0
    for inv in invocations:
        if total + inv.num_tokens > args.tokens_per_batch:
            break
        batch.append(inv)
        total += inv.num_tokens
    rows = split_rows(collator(batch), pad_token_id=tokenizer.pad_token_id)
    results["imitation_batch_tokens"] = total
    for mode in ("full", "lora"):
        model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32, attn_implementation=VARLEN_SDPA)
        if mode == "lora":
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
        model.train()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
        step_seconds(model, rows, optimizer)  # warm-up
        seconds = min(step_seconds(model, rows, optimizer) for _ in range(2))
        results[f"imitation_step_seconds/{mode}"] = seconds
        print(f"imitation step, {mode}: {seconds:.1f} s for {total} tokens")
        del model, optimizer

    # Decoding throughput at the arms' batch, and one update's teacher and student passes.
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32, attn_implementation=VARLEN_SDPA)
    engine = RolloutEngine(model, tokenizer, layouts["compact"], max_new_tokens=args.max_new_tokens, max_prompt_length=768)
    start = time.perf_counter()
    episodes, _ = engine.rollout(tasks[: args.questions], num_generations=args.num_generations)
    seconds = time.perf_counter() - start
    generated = sum(len(inv.output_ids) for ep in episodes for inv in ep.invocations)
    results["decode_tokens_per_second"] = generated / seconds
    print(f"decoding: {generated} tokens in {seconds:.1f} s ({generated / seconds:.1f} tokens/s)")
    per_update = data["teacher/compact"][: round(args.questions * results["layouts"]["teacher/compact"]["turns_per_task"])]
    update_invocations = per_update * args.num_generations  # the expert's episodes as the trained student's would be
    shared = PackedInvocationCollator(pad_token_id=tokenizer.pad_token_id, max_tokens_per_row=4096, share_prefix=True)
    rows = split_rows(shared(update_invocations), pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        start = time.perf_counter()
        for row in rows:
            action_hidden_states(model, row)
        teacher_seconds = time.perf_counter() - start
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    actor_seconds = step_seconds(model, rows, optimizer)
    action_tokens = sum(len(inv.output_ids) for inv in update_invocations)
    rollout_seconds = action_tokens / results["decode_tokens_per_second"]
    results["update"] = {
        "invocations": len(update_invocations),
        "action_tokens": action_tokens,
        "rollout_seconds_estimate": rollout_seconds,
        "teacher_seconds": teacher_seconds,
        "actor_seconds": actor_seconds,
    }
    print("one update:", json.dumps({k: round(v, 1) for k, v in results["update"].items()}))

    # Extrapolation.
    layouts_tokens = results["layouts"]
    steps_per_epoch = {
        key: args.setup_tasks * value["tokens_per_task"] / total for key, value in layouts_tokens.items()
    }  # imitation steps of `total` tokens per epoch
    lora = results["imitation_step_seconds/lora"]
    full = results["imitation_step_seconds/full"]
    teacher_both = steps_per_epoch["teacher/compact"] + steps_per_epoch["teacher/full_history"]
    setup = {
        mode: (teacher_both + steps_per_epoch["student_start/compact"]) * args.epochs * seconds / 60
        for mode, seconds in (("full", full), ("lora", lora))
    }
    ppo_update = rollout_seconds + actor_seconds
    memopd_update = ppo_update + teacher_seconds
    persistent_update = ppo_update + teacher_seconds * (
        layouts_tokens["teacher/full_history"]["tokens_per_task"] / layouts_tokens["teacher/compact"]["tokens_per_task"]
    )
    arms = (ppo_update + memopd_update + persistent_update) * args.updates / 60
    results["estimate_minutes"] = {"setup_full": setup["full"], "setup_lora": setup["lora"], "arms": arms}
    print(
        f"estimate: set-up {setup['full']:.0f} min (full fine-tuning) or {setup['lora']:.0f} min (LoRA) for "
        f"{args.setup_tasks} tasks x {args.epochs} epochs per model (the teacher in both layouts); three arms x "
        f"{args.updates} updates {arms:.0f} min, without evaluation"
    )
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
