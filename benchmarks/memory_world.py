"""The memory-needing world: a teacher and a student start on multi-objective tasks, and the teacher's takeover F1.

Builds (or reuses, cached by recipe in `--output_dir`) the offline world with `num_sub_questions=2`: each task asks
two synthetic-world questions one after the other, so at the answer step the facts of the first one are carried by
the memory alone. Both tiny models share the copy warm-up and the pretraining on the full expert's single-question
turns (the capability); then the teacher imitates the full expert on the tasks, the student start the forgetful
expert (`student_expert_memory`, default `"latest"`: same searches and answer format, only the latest fact kept).

It prints, and writes to `--output_dir/memory_world.json`:

- the start's and the teacher's held-out F1 on single questions (capability) and on the tasks (memory policy);
- the teacher takeover F1 by k: the start plays the first k turns of each held-out task, the teacher finishes.

Every `OfflineConfig` field is a flag (`--help`); the defaults here are the measured setting of docs/results.md
("Memory-needing world (multi-objective tasks)", with its timing): `python benchmarks/memory_world.py`. A rerun with
the same recipe reuses the cached models and only measures the takeover.
"""

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))  # the offline lab

import torch  # noqa: E402
from transformers import HfArgumentParser  # noqa: E402

from memopd_trl import MemOPDConfig, MemOPDTrainer  # noqa: E402
from memopd_trl.envs.multi import multi_objective_max_turns  # noqa: E402
from memopd_trl.rollout import RolloutEngine  # noqa: E402
from offline_lab import (  # noqa: E402
    OfflineConfig,
    load_offline_model,
    load_offline_tokenizer,
    make_offline_world,
    prepare_offline_models,
    teacher_takeover,
)


# The measured setting: two sub-questions, one passage per search (a forgetful expert cannot read an earlier fact
# off the observation), a shared pretraining on single questions, a smaller world than the main job's default.
DEFAULTS = dict(
    num_sub_questions=2, retrieval_top_k=1, student_expert_memory="latest", num_train_questions=2000,
    num_eval_questions=200, pretrain_questions=2000, pretrain_epochs=1.0, teacher_epochs=1.5,
    student_warmup_questions=1000, student_epochs=1.0,
)  # fmt: skip


@dataclass
class BenchmarkArguments:
    output_dir: str = field(
        default="outputs/memory_world", metadata={"help": "Where the models are cached and the JSON is written."}
    )
    max_turns: int | None = field(
        default=None,
        metadata={"help": "Turns per episode; defaults to multi_objective_max_turns(num_sub_questions, retries=1)."},
    )
    max_new_tokens: int = field(
        default=128,
        metadata={"help": "Tokens per model call. The full expert's actions on two-question tasks reach 95 tokens (the "
                  "memory carries the first sub-question's facts): 64 truncates them (docs/results.md)."},
    )  # fmt: skip
    max_prompt_length: int = field(default=768, metadata={"help": "Context tokens per model call."})
    threads: int = field(default=2, metadata={"help": "torch CPU threads."})
    signal_steps: int = field(
        default=8,
        metadata={"help": "Rollouts on which the training signal at the start is measured (the `distill/*` diagnostics "
                  "and the alignment audit's `misalignment/*`), with the learning rate at 0 so that the student stays "
                  "the start; 0 skips it."},
    )  # fmt: skip
    signal_temperature: float = field(
        default=0.7, metadata={"help": "Sampling temperature of those rollouts (the main job's)."}
    )


def main(argv: list[str] | None = None) -> dict:
    parser = HfArgumentParser((OfflineConfig, BenchmarkArguments))
    parser.set_defaults(**DEFAULTS)
    config, args = parser.parse_args_into_dataclasses(args=argv)
    torch.set_num_threads(args.threads)
    max_turns = args.max_turns or multi_objective_max_turns(config.num_sub_questions, retries=1)
    generation = {"max_new_tokens": args.max_new_tokens, "max_prompt_length": args.max_prompt_length}
    output_dir = Path(args.output_dir)
    start = time.perf_counter()
    world = make_offline_world(config, max_turns=max_turns, memory_policy="compact", action_format="memopd")
    setup = prepare_offline_models(config, world, output_dir, **generation)
    setup_seconds = time.perf_counter() - start

    start = time.perf_counter()
    tokenizer = load_offline_tokenizer(output_dir / "teacher")
    engines = {
        role: RolloutEngine(load_offline_model(output_dir / role), tokenizer, world.env_factory, **generation)
        for role in ("student_init", "teacher")
    }
    takeover = teacher_takeover(engines["student_init"], engines["teacher"], world.evaluation)
    takeover_seconds = time.perf_counter() - start

    signal = {}
    if args.signal_steps > 0:
        start = time.perf_counter()
        signal = training_signal(world, output_dir, tokenizer, args, **generation)
        signal["seconds"] = round(time.perf_counter() - start, 1)

    def scores(role: str) -> dict:
        info = setup[role]
        return {"single_question_f1": info.get("single_f1", info["f1"]), "multi_objective_f1": info["f1"]}

    results = {
        "command": "python benchmarks/memory_world.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "settings": {**config.settings(), "max_turns": max_turns, **generation},
        "held_out_tasks": len(world.evaluation),
        "held_out_single_questions": len(world.eval_questions),
        "student_start": scores("student_init"),
        "teacher": scores("teacher"),
        "takeover_f1_by_k": {k: round(v["f1"], 4) for k, v in takeover.items()},
        "takeover_taken_over_by_k": {k: round(v["taken_over"], 4) for k, v in takeover.items()},
        "signal_at_start": signal,
        "setup_seconds": round(setup_seconds, 1),
        "takeover_seconds": round(takeover_seconds, 1),
    }
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "memory_world.json").write_text(json.dumps(results, indent=2))
    print(f"{'model':<14} {'single-question F1':>19} {'multi-objective F1':>19}")
    for name, role in (("student start", "student_start"), ("teacher", "teacher")):
        row = results[role]
        print(f"{name:<14} {row['single_question_f1']:>19.3f} {row['multi_objective_f1']:>19.3f}")
    print("teacher takeover (start plays k turns, teacher finishes), held-out F1 by k:")
    for k, value in takeover.items():
        print(f"  k={k}: F1 {value['f1']:.3f} ({value['taken_over']:.0%} of episodes still running at turn k)")
    if signal:
        print(f"training signal at the start ({args.signal_steps} rollouts at T={args.signal_temperature}):")
        for key, value in signal.items():
            print(f"  {key}: {value}")
    print(
        f"set-up {setup_seconds:.0f} s, takeover {takeover_seconds:.0f} s; written to {output_dir / 'memory_world.json'}"
    )
    return results


def training_signal(world, output_dir: Path, tokenizer, args, **settings) -> dict[str, float]:
    """
    The trainer's own metrics on the student start's sampled episodes (aligned teacher scoring, an alignment audit at
    every rollout), with the learning rate at 0: the `distill/*` diagnostics and the per-turn `misalignment/*` of the
    start, averaged over `args.signal_steps` rollouts of training tasks.
    """
    config = MemOPDConfig(
        output_dir=str(output_dir / "signal"), max_steps=args.signal_steps, learning_rate=0.0,
        lr_scheduler_type="constant", per_device_train_batch_size=8, num_generations=4, temperature=args.signal_temperature,
        beta=1.0, misalignment_audit_steps=1, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
        bf16=False,
        disable_tqdm=True, seed=0, **settings,
    )  # fmt: skip
    trainer = MemOPDTrainer(
        model=load_offline_model(output_dir / "student_init"), teacher_model=load_offline_model(output_dir / "teacher"),
        args=config, train_dataset=world.train, env_factory=world.env_factory, processing_class=tokenizer,
    )  # fmt: skip
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    keys = sorted({key for entry in logs for key in entry if key.startswith(("distill/", "misalignment/"))})
    keys += ["f1", "reward"]
    return {key: round(sum(e[key] for e in logs if key in e) / sum(key in e for e in logs), 4) for key in keys}


if __name__ == "__main__":
    main()
