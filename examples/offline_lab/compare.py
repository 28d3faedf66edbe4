"""
The main job's comparison (examples/hotpot.py): its command-line arguments and defaults, the checks of what it is
asked, and the arms x seeds loop that trains every arm from the same student start, each arm resumable.

An arm is a change of the `MemOPDConfig` given on the command line ([`ARMS`]): PPO only, MemOPD with aligned teacher
scoring, MemOPD with persistent-history scoring (the control), or the config as given. Each arm of each seed trains in
`<output_dir>/seed-<s>/<arm>/` and leaves its result there (`result.json`, with the settings it ran under), which a
resumed run reuses.
"""

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from accelerate import PartialState

from memopd_trl import MemOPDConfig, MemOPDTrainer

from .report import eval_curve, misalignment_curve
from .setup import VARLEN_ATTENTION, OfflineConfig


# What each arm changes in the MemOPDConfig given on the command line ("configured" changes nothing).
ARMS = {
    # PPO alone: no teacher, so none of the settings that only shape the distillation loss either.
    "ppo": {
        "distill_coef": 0.0,
        "teacher_model_name_or_path": None,
        "teacher_model_server_url": None,
        "teacher_generations": 0,
        "distill_divergence_threshold": 0.0,
        "distill_warmup_steps": 0,
        "distill_warmup_kl_coef": 0.0,
        "distill_warmup_anchor_coef": 0.0,
        "distill_warmup_release_loss": 0.0,
    },  # fmt: skip
    "memopd": {"teacher_scoring": "aligned"},
    "memopd_persistent": {"teacher_scoring": "persistent"},
    "configured": {},
}
# The offline run's trainer settings, set as the parser's defaults so that `--help` shows what a run uses. A `--config`
# file (examples/smoke.yaml, examples/real.yaml) overrides them, and flags override both.
OFFLINE_DEFAULTS = dict(
    # The world where memory matters (docs/results.md): two-part lookup tasks whose first answer must be carried in
    # memory; the teacher and the student share a pretraining, and the student start is the teacher taught a
    # forgetful habit (the `searches`-memory expert's imitation), the memory policy it has to relearn.
    lookup_fraction=1.0, short_names=True, num_sub_questions=2, pretrain_questions=6000, share_pretraining=True,
    replay_questions=1000, student_hidden_size=128, student_expert_memory="searches", student_from_teacher=True,
    # The teacher: two epochs of imitation, keeping the checkpoint (every half epoch) with the best greedy F1 on 100
    # training tasks it does not imitate; a fixed single epoch landed anywhere between 0.62 and 0.87 held-out F1.
    teacher_epochs=2.0, teacher_select_tasks=100, teacher_select_epochs=0.5,
    # Trainer: forward KL (beta=0) on each episode's tokens up to the first the teacher gives < 0.1 (the teacher's
    # targets after that are for states it never saw), plus one teacher-played episode per question.
    output_dir="outputs/hotpot", max_steps=220, num_iterations=4, per_device_train_batch_size=8, num_generations=4,
    learning_rate=3e-4, lr_scheduler_type="constant_with_warmup", warmup_steps=20, temperature=0.7, beta=0.0,
    distill_divergence_threshold=0.1, distill_divergence_scope="episode", teacher_generations=1,
    # The warm-up distills the teacher's episodes only, each without its branch point, while the start teaches the
    # student's own episodes (the anchor, heavy enough to hold them): the student learns to act where the teacher's
    # choices lead before it is taught to make them. It ends once the student can act in the teacher's states at
    # every turn (the teacher-play loss of its worst turn at most 0.2), by step 140 at the latest; a release before
    # then falls into the turns it cannot yet play (docs/results.md, "What the release falls into").
    distill_warmup_steps=140, distill_warmup_anchor_coef=100.0, distill_warmup_release_loss=0.2,
    max_turns=4, memory_policy="compact", action_format="memopd", max_new_tokens=96, max_prompt_length=512,
    eval_strategy="steps", eval_steps=40, logging_steps=20, save_strategy="no", report_to="none", bf16=False,
    attn_implementation=VARLEN_ATTENTION,
    # Without `use_cpu`, processes that `accelerate launch` starts on a machine without GPUs would each run alone.
    use_cpu=not torch.accelerator.is_available(),
)  # fmt: skip
# Settings that do not change what an arm learns: an arm finished under other values of these is still reused.
NOT_RESULTS = ("resume_from_checkpoint", "disable_tqdm", "report_to", "logging_dir", "run_name", "save_strategy",
               "save_steps", "save_total_limit")  # fmt: skip


@dataclass
class ComparisonArguments(OfflineConfig):
    """The offline world's `OfflineConfig` (its sizes and environment settings also apply in real mode), and the
    comparison's own arguments."""

    seeds: list[int] = field(
        default_factory=lambda: [0],
        metadata={"help": "Training seeds (e.g. `--seeds 0 1 2`); every arm runs once per seed from the same start."},
    )
    arms: list[str] = field(
        default_factory=lambda: ["ppo", "memopd", "memopd_persistent"],
        metadata={"help": "Arms to run, in order: `ppo` (distill_coef=0), `memopd` (aligned teacher scoring), "
                  "`memopd_persistent` (persistent-history teacher scoring), `configured` (the MemOPDConfig as "
                  "given).", "choices": list(ARMS)},
    )  # fmt: skip
    dataset: str = field(
        default="synthetic",
        metadata={"help": "`synthetic` (the offline world), a Hub dataset id such as `hotpotqa/hotpot_qa`, or a "
                  "local HotpotQA .json/.jsonl file (real mode: needs --model_name_or_path)."},
    )  # fmt: skip
    dataset_config: str = field(default="distractor", metadata={"help": "HotpotQA setting: `distractor`/`fullwiki`."})
    dataset_train_split: str = field(default="train", metadata={"help": "Hub split to train on."})
    dataset_test_split: str = field(default="validation", metadata={"help": "Hub split of the held-out questions "
                                    "(a local file holds out its last questions instead)."})  # fmt: skip
    cpu_threads: int | None = field(
        default=None,
        metadata={"help": "Torch threads per process on CPU; defaults to the available cores shared among the local "
                  "processes (`accelerate launch` would otherwise leave one thread per process)."},
    )  # fmt: skip
    save_models: bool = field(
        default=False, metadata={"help": "Save each arm's model in <output_dir>/seed-<s>/<arm>."}
    )
    # The environment's settings: the script gives them to the env factory (the library's config does not take them).
    max_turns: int = field(default=6, metadata={"help": "Turns after which an unanswered episode ends (reward 0)."})
    memory_policy: str = field(
        default="compact",
        metadata={"help": "Context the agent sees each turn: `compact` (task, latest memory, latest observation) or "
                  "`full_history` (every turn so far).", "choices": ["compact", "full_history"]},
    )  # fmt: skip
    action_format: str = field(
        default="memopd", metadata={"help": "Tag preset of the action grammar.", "choices": ["memopd", "mem1"]}
    )

    def env_settings(self) -> dict[str, Any]:
        return dict(max_turns=self.max_turns, memory_policy=self.memory_policy, action_format=self.action_format)


def arm_config(config: MemOPDConfig, arm: str, seed: int) -> MemOPDConfig:
    """The config one arm of one seed trains with, in its own directory."""
    run_dir = Path(config.output_dir) / f"seed-{seed}" / arm
    return replace(config, output_dir=str(run_dir), seed=seed, **ARMS[arm])


def check_arguments(args: ComparisonArguments, config: MemOPDConfig, model_args) -> str | None:
    """Everything the main job refuses before its set-up, as one message (`None`: the run can start)."""
    path, real = Path(args.dataset), model_args.model_name_or_path is not None
    if not real:  # the offline world's sizes (in real mode they only limit the dataset)
        try:
            args.check_world_sizes()
        except ValueError as error:
            return str(error)
    looks_local = path.suffix in (".json", ".jsonl") or args.dataset.startswith(("/", ".", "~")) or len(path.parts) > 2
    if args.dataset != "synthetic" and not path.exists() and looks_local:
        return (f"--dataset {args.dataset}: no such file. Give a HotpotQA .json/.jsonl file, a Hub id such as "
                "hotpotqa/hotpot_qa, or `synthetic`.")  # fmt: skip
    if not real and args.dataset != "synthetic":
        return (f"--dataset {args.dataset} needs models that can act on real questions: pass --model_name_or_path "
                "and --teacher_model_name_or_path (one tokenizer family), e.g. with --config examples/real.yaml.")  # fmt: skip
    teacher_given = config.teacher_model_name_or_path is not None or config.teacher_model_server_url is not None
    if real and not teacher_given and any(arm != "ppo" for arm in args.arms):
        return (f"arms {args.arms} distill from a teacher: pass --teacher_model_name_or_path (same tokenizer family "
                "as --model_name_or_path) or --teacher_model_server_url, or run `--arms ppo`.")  # fmt: skip
    if not real and config.teacher_model_server_url is not None:
        return ("--teacher_model_server_url serves the teacher of real mode (pass --model_name_or_path too); the "
                "offline run builds and loads its own tiny teacher.")  # fmt: skip
    if config.distill_coef == 0 and any(arm.startswith("memopd") for arm in args.arms):
        return "--distill_coef 0 turns the memopd arms into PPO only; give it > 0 or run `--arms ppo`."
    refused = _unsupported_options(args, config, model_args)
    if refused:
        return refused
    for seed in args.seeds:  # each arm's settings are checked now, not after minutes of set-up
        for arm in args.arms:
            try:
                settings = arm_config(config, arm, seed)
            except ValueError as error:
                return f"arm {arm}: {error}"
            refused = _check_finished(settings) if config.resume_from_checkpoint else None
            if refused:
                return refused
    return None


def _unsupported_options(args: ComparisonArguments, config: MemOPDConfig, model_args) -> str | None:
    """What the parser accepts but the main job cannot honour."""
    runs, resume = len(args.seeds) * len(args.arms), config.resume_from_checkpoint
    if resume is not None and resume.lower() != "true" and runs > 1:
        return (f"--resume_from_checkpoint {resume} names one checkpoint, but this run trains {runs} arms x seeds; "
                "pass `true` to resume each from its own directory (<output_dir>/seed-<s>/<arm>), or run one arm "
                "and one seed.")  # fmt: skip
    if resume is not None and resume.lower() != "true" and not Path(resume).is_dir():
        return f"--resume_from_checkpoint {resume}: no such checkpoint directory."
    if config.push_to_hub:
        return ("--push_to_hub: this script trains several arms and does not push; run with --save_models true, then "
                "push the arm you want (`MemOPDTrainer.push_to_hub`, docs/quickstart.md).")  # fmt: skip
    if model_args.model_name_or_path is None:  # the offline run loads its own cached tiny models in float32
        given = [f"--{name}" for name, default in (("model_revision", "main"), ("dtype", "float32"))
                 if getattr(model_args, name) != default]  # fmt: skip
        given += [f"--{name}" for name in ("load_in_8bit", "load_in_4bit") if getattr(model_args, name)]
        if given:
            return (f"{', '.join(given)} apply to models loaded with --model_name_or_path; the offline run builds "
                    "its own tiny float32 models.")  # fmt: skip
    return None


def _check_finished(config: MemOPDConfig) -> str | None:
    """A resumed arm that finished under other settings than `config`'s, as a message."""
    path = Path(config.output_dir) / "result.json"
    if not path.exists():
        return None
    saved, settings = json.loads(path.read_text())["settings"], json.loads(config.to_json_string())
    differ = sorted(k for k in settings.keys() | saved.keys() if k not in NOT_RESULTS and settings.get(k) != saved.get(k))
    if differ:
        return (f"{path} was trained with other settings ({', '.join(differ)}); resume with the same ones, or use "
                "another --output_dir.")  # fmt: skip
    return None


def set_cpu_threads(threads: int | None) -> int:
    """Torch's intra-op threads on CPU (`None`: the available cores divided among the local processes); returns them."""
    state = PartialState()
    if state.device.type == "cpu":
        if threads is None:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            threads = max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", state.num_processes))))
        if threads < 1:
            raise ValueError(f"--cpu_threads must be >= 1, got {threads}.")
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def log(message: str) -> None:
    if PartialState().is_main_process:
        print(message, flush=True)


def run_arms(
    build_trainer: Callable[[MemOPDConfig], MemOPDTrainer],
    config: MemOPDConfig,
    args: ComparisonArguments,
    test: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """
    Train every arm of `args.arms` for every seed of `args.seeds`, each from the student start `build_trainer` gives
    it, and evaluate it greedily: every `eval_steps` on the trainer's evaluation tasks (its curve), and at the end on
    the held-out `test` tasks when they are given (then the trainer's tasks are the validation tasks, where settings
    are chosen, and the test tasks are read once per arm, for the final table).

    With `config.resume_from_checkpoint` (`"true"`, or one checkpoint's path for a run of one arm and one seed), an arm
    that had finished is reused from its `result.json`, the arm that was stopped resumes from its last complete
    checkpoint, and an arm with no checkpoint starts from the beginning.

    Args:
        build_trainer (`Callable[[MemOPDConfig], MemOPDTrainer]`): a fresh trainer of the start for an arm's config.
        config (`MemOPDConfig`): the settings every arm changes (`ARMS`).
        args (`ComparisonArguments`): the arms, seeds and `save_models`.
        test (`list[dict]`, *optional*): the held-out tasks of the final scores; without them the final scores are
            the curve's last point.

    Returns:
        `list[dict]`: per arm and seed, in order: `arm`, `seed`, the final `f1` / `em` (on `test` when given), the
        evaluation `curve` and the tasks it is on (`curve_tasks`: `"validation"` or `"test"`), the per-turn alignment
        audit (`misalignment`) and the training time (`seconds`).
    """
    runs, resume = [], config.resume_from_checkpoint
    start = None  # the start's f1 and em on the trainer's evaluation tasks (every curve's step 0), measured once
    for seed in args.seeds:
        for arm in args.arms:
            settings = arm_config(config, arm, seed)
            run_dir = Path(settings.output_dir)
            if resume and (run_dir / "result.json").exists():  # it had finished before the run stopped
                runs.append(json.loads((run_dir / "result.json").read_text())["run"])
                log(f"[{arm} seed {seed}] finished before: held-out F1 {runs[-1]['f1']:.3f} ({run_dir / 'result.json'})")
                start = start or {"f1": runs[-1]["curve"][0][1], "em": runs[-1]["curve"][0][2]}
                continue
            trainer = build_trainer(settings)
            started = time.perf_counter()
            if start is None:  # measured once: every arm starts from the same model
                metrics = trainer.evaluate()
                start = {"f1": metrics["eval_f1"], "em": metrics["eval_em"]}
            try:
                trainer.train(resume_from_checkpoint=_resume_point(resume, run_dir))
            except SystemExit:  # a SIGTERM: the trainer saved a checkpoint of this arm
                log(f"[{arm} seed {seed}] stopped; run the same command with --resume_from_checkpoint true to go on")
                raise
            curve = eval_curve(trainer.state.log_history, start)
            if curve[-1][0] != trainer.state.global_step:
                metrics = trainer.evaluate()
                curve.append([trainer.state.global_step, metrics["eval_f1"], metrics["eval_em"]])
            final, tasks = {"f1": curve[-1][1], "em": curve[-1][2]}, "test"
            if test is not None:
                metrics = trainer.evaluate(eval_dataset=test, metric_key_prefix="test")
                final, tasks = {"f1": metrics["test_f1"], "em": metrics["test_em"]}, "validation"
            seconds = time.perf_counter() - started
            if args.save_models:
                trainer.save_model(str(run_dir))
            log(f"[{arm} seed {seed}] {tasks} F1 {curve[0][1]:.3f} -> {curve[-1][1]:.3f}"
                + (f", held-out F1 {final['f1']:.3f}" if test is not None else "") + f" ({seconds:.0f} s)")  # fmt: skip
            runs.append({"arm": arm, "seed": seed, **final, "curve": curve, "curve_tasks": tasks,
                         "misalignment": misalignment_curve(trainer.state.log_history), "seconds": seconds})  # fmt: skip
            if PartialState().is_main_process:  # what `--resume_from_checkpoint true` reuses if a later arm is stopped
                settings_json = json.loads(settings.to_json_string())
                (run_dir / "result.json").write_text(json.dumps({"settings": settings_json, "run": runs[-1]}, indent=1))
    return runs


def _resume_point(resume: str | None, run_dir: Path) -> str | bool | None:
    """What `trainer.train(resume_from_checkpoint=...)` gets for one arm: `true` resumes from the arm's last complete
    checkpoint, or starts it afresh when it saved none (it had not started, or was stopped before its first save)."""
    if resume is None:
        return None
    if resume.lower() != "true":
        return resume
    if not any(run_dir.glob("checkpoint-*")):
        log(f"[resume] no checkpoint in {run_dir}: this arm starts from the beginning")
        return None
    return True
