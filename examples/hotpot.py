"""MemOPD on HotpotQA-format data: the main job.

    accelerate launch examples/hotpot.py                               # offline: synthetic world, tiny models, CPU
    accelerate launch examples/hotpot.py --seeds 0 1 2                 # the same, three seeds (one teacher)
    accelerate launch examples/hotpot.py --config examples/smoke.yaml  # the whole pipeline in seconds (tests, CI)
    accelerate launch examples/hotpot.py --help                        # every flag, with the defaults a run uses

Offline (no flags, no network; about 12 minutes on 2 CPU cores and 6.5 more per further seed, see docs/results.md):
`memopd_trl.offline` builds a synthetic world of two-part lookup tasks whose first answer only the memory can carry,
and caches a tiny teacher (imitation of a scripted full-memory expert) and a student start (that teacher taught a
forgetful habit). Three arms train that same start with the same seed and budget: PPO only (`distill_coef=0`),
MemOPD (aligned teacher scoring) and MemOPD with persistent-history teacher scoring (the matched control), each
evaluated greedily on held-out tasks; `memopd_trl.offline.report` writes the F1/EM table, `results.json`,
`eval_f1.png` and the per-turn alignment audit `misalignment.png`. Tiny models: the numbers show the mechanics, not the paper's results.

Real mode: `--model_name_or_path` and `--dataset` (a Hub id or a local HotpotQA .json/.jsonl file).
`examples/real.yaml` sets what pretrained models need (the parser's defaults are the offline run's), e.g.

    accelerate launch --config_file examples/accelerate_configs/ddp.yaml examples/hotpot.py \\
        --config examples/real.yaml --attn_implementation flash_attention_2 --use_vllm --arms memopd

A 3B student and a 7B teacher in bf16 need 8 x 80 GB GPUs with `ddp.yaml` (the teacher is replicated on each), or
`deepspeed_zero2.yaml` to shard optimizer states; `--use_peft` (LoRA) fits a single 80 GB GPU. Or serve the teacher on
its own machine (`vllm serve Qwen/Qwen2.5-7B-Instruct --max-logprobs 64`) and pass `--teacher_model_server_url
http://HOST:8000 --loss_top_k 64`: it is then never loaded beside the student (docs/quickstart.md).
"""

import difflib
import json
import os
import sys
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import NoReturn

import torch
from accelerate import PartialState
from transformers import AutoTokenizer
from trl import ModelConfig, TrlParser, get_peft_config, get_quantization_config

from memopd_trl import HotpotQAEnv, MemOPDConfig, MemOPDTrainer, load_hotpotqa, offline
from memopd_trl.envs.retrieval import corpus_from_records
from memopd_trl.offline import eval_curve, misalignment_curve, summarize, write_report


# What each arm changes in the MemOPDConfig given on the command line ("configured" changes nothing).
ARMS = {
    # PPO alone: no teacher, so none of the settings that only shape the distillation loss either.
    "ppo": {
        "distill_coef": 0.0,
        "teacher_model_name_or_path": None,
        "teacher_model_server_url": None,
        "teacher_generations": 0,
        "distill_divergence_threshold": 0.0,
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
    output_dir="outputs/hotpot", max_steps=160, num_iterations=4, per_device_train_batch_size=8, num_generations=4,
    learning_rate=3e-4, lr_scheduler_type="constant_with_warmup", warmup_steps=20, temperature=0.7, beta=0.0,
    distill_divergence_threshold=0.1, distill_divergence_scope="episode", teacher_generations=1,
    max_turns=4, memory_policy="compact", action_format="memopd", max_new_tokens=96, max_prompt_length=512,
    eval_strategy="steps", eval_steps=40, logging_steps=20, save_strategy="no", report_to="none", bf16=False,
    attn_implementation=offline.VARLEN_ATTENTION,
    # Without `use_cpu`, processes that `accelerate launch` starts on a machine without GPUs would each run alone.
    use_cpu=not torch.accelerator.is_available(),
)  # fmt: skip


@dataclass
class ScriptArguments(offline.OfflineConfig):
    """The offline world's `OfflineConfig` (its sizes and environment settings also apply in real mode), and more."""

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
    # The environment's settings: this script gives them to the env factory (the library's config does not take them).
    max_turns: int = field(default=6, metadata={"help": "Turns after which an unanswered episode ends (reward 0)."})
    memory_policy: str = field(
        default="compact",
        metadata={"help": "Context the agent sees each turn: `compact` (task, latest memory, latest observation) or "
                  "`full_history` (every turn so far).", "choices": ["compact", "full_history"]},
    )  # fmt: skip
    action_format: str = field(
        default="memopd", metadata={"help": "Tag preset of the action grammar.", "choices": ["memopd", "mem1"]}
    )


@dataclass
class TrainerArguments(MemOPDConfig):
    """`MemOPDConfig` without its deprecated environment settings, which `ScriptArguments` holds here."""

    memory_policy: str | None = field(default=None, init=False)
    action_format: str | None = field(default=None, init=False)
    max_turns: int | None = field(default=None, init=False)


@dataclass
class ModelArguments(ModelConfig):
    """`trl.ModelConfig` without its own `--attn_implementation`: MemOPDConfig's loads the student and the teacher."""

    attn_implementation: str | None = field(default=None, init=False)


def parse_args(argv: list[str] | None) -> tuple[ScriptArguments, MemOPDConfig, ModelArguments]:
    """Parse the command line (over a `--config` YAML file, over the offline defaults) and check what it asks for."""
    parser = TrlParser((ScriptArguments, TrainerArguments, ModelArguments))
    parser.set_defaults(**OFFLINE_DEFAULTS)
    try:
        args, parsed, model_args, unknown = parser.parse_args_and_config(argv, return_remaining_strings=True)
        # A plain `MemOPDConfig` for the trainer (it is pickled into checkpoints, where a script's class cannot be).
        config = MemOPDConfig(**{f.name: getattr(parsed, f.name) for f in fields(parsed) if f.init})
    except ValueError as error:  # a value a config rejects
        fail(str(error))
    if unknown:
        flag = next((arg for arg in unknown if arg.startswith("-")), unknown[0]).split("=")[0]
        dataclasses = (ScriptArguments, TrainerArguments, ModelArguments)
        valid = ["--" + f.name for dc in dataclasses for f in fields(dc) if f.init]
        close = difflib.get_close_matches(flag, valid, n=1)
        fail(f"unknown argument {flag}" + (f"; did you mean {close[0]}?" if close else " (--help lists them all)"))
    path, real = Path(args.dataset), model_args.model_name_or_path is not None
    if not real:  # the offline world's sizes (in real mode they only limit the dataset)
        try:
            args.check_world_sizes()
        except ValueError as error:
            fail(str(error))
    looks_local = path.suffix in (".json", ".jsonl") or args.dataset.startswith(("/", ".", "~")) or len(path.parts) > 2
    if args.dataset != "synthetic" and not path.exists() and looks_local:
        fail(f"--dataset {args.dataset}: no such file. Give a HotpotQA .json/.jsonl file, a Hub id such as "
             "hotpotqa/hotpot_qa, or `synthetic`.")  # fmt: skip
    if not real and args.dataset != "synthetic":
        fail(f"--dataset {args.dataset} needs models that can act on real questions: pass --model_name_or_path and "
             "--teacher_model_name_or_path (one tokenizer family), e.g. with --config examples/real.yaml.")  # fmt: skip
    teacher_given = config.teacher_model_name_or_path is not None or config.teacher_model_server_url is not None
    if real and not teacher_given and any(arm != "ppo" for arm in args.arms):
        fail(f"arms {args.arms} distill from a teacher: pass --teacher_model_name_or_path (same tokenizer family as "
             "--model_name_or_path) or --teacher_model_server_url, or run `--arms ppo`.")  # fmt: skip
    if not real and config.teacher_model_server_url is not None:
        fail("--teacher_model_server_url serves the teacher of real mode (pass --model_name_or_path too); the offline "
             "run builds and loads its own tiny teacher.")  # fmt: skip
    if config.distill_coef == 0 and any(arm.startswith("memopd") for arm in args.arms):
        fail("--distill_coef 0 turns the memopd arms into PPO only; give it > 0 or run `--arms ppo`.")
    if (config.resume_from_checkpoint or "").lower() == "false":
        config.resume_from_checkpoint = None
    refused = unsupported_options(args, config, model_args)
    if refused:
        fail(refused)
    for arm in args.arms:  # each arm's settings are checked now, not after minutes of set-up
        try:
            replace(config, **ARMS[arm])
        except ValueError as error:
            fail(f"arm {arm}: {error}")
    return args, config, model_args


def unsupported_options(args: ScriptArguments, config: MemOPDConfig, model_args: ModelArguments) -> str | None:
    """What the parser accepts but this script cannot honour, as an error message (`None`: everything is honoured)."""
    runs = len(args.seeds) * len(args.arms)
    resume = config.resume_from_checkpoint
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


def resume_point(resume: str | None, run_dir: Path) -> str | bool | None:
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


# Settings that do not change what an arm learns: an arm finished under other values of these is still reused.
NOT_RESULTS = ("resume_from_checkpoint", "disable_tqdm", "report_to", "logging_dir", "run_name", "save_strategy",
               "save_steps", "save_total_limit")  # fmt: skip


def finished_run(run_dir: Path, settings: dict) -> dict | None:
    """The result an arm saved when it finished (`result.json`), if it trained with these settings."""
    path = run_dir / "result.json"
    if not path.exists():
        return None
    saved = json.loads(path.read_text())
    differ = sorted(k for k in settings.keys() | saved["settings"].keys()
                    if k not in NOT_RESULTS and settings.get(k) != saved["settings"].get(k))  # fmt: skip
    if differ:
        fail(f"{path} was trained with other settings ({', '.join(differ)}); resume with the same ones, or use "
             "another --output_dir.")  # fmt: skip
    return saved["run"]


def fail(message: str) -> NoReturn:
    """Stop with one line on stderr (exit status 1), not a traceback."""
    sys.exit(f"hotpot.py: error: {message}")


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


def load_records(args: ScriptArguments) -> tuple[list[dict], list[dict]]:
    """HotpotQA training and held-out records: Hub splits, or a local file whose last questions are held out."""
    source, name, limit = args.dataset, args.dataset_config, args.num_train_questions
    if not Path(source).exists():
        train = load_hotpotqa(source, split=args.dataset_train_split, name=name, limit=limit)
        return train, load_hotpotqa(source, split=args.dataset_test_split, name=name, limit=args.num_eval_questions)
    records = load_hotpotqa(source, name=name)
    held = min(args.num_eval_questions, len(records) - 1)
    return records[: len(records) - held][:limit], records[len(records) - held :]


def log(message: str) -> None:
    if PartialState().is_main_process:
        print(message, flush=True)


def main(argv: list[str] | None = None) -> dict:
    """Run the main job on `argv` (defaults to `sys.argv[1:]`); returns what `results.json` holds."""
    started = time.perf_counter()
    args, config, model_args = parse_args(argv)
    config.device  # noqa: B018  (sets up the process group before anything asks for the process state)
    threads, state = set_cpu_threads(args.cpu_threads), PartialState()
    log(f"[run] {state.num_processes} process(es) on {state.device.type}, {threads} torch threads each")
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    env = dict(max_turns=args.max_turns, memory_policy=args.memory_policy, action_format=args.action_format)

    # Data and models: HotpotQA and given models (real mode), or the offline world and its cached tiny models.
    real = model_args.model_name_or_path is not None
    if real:
        train, evaluation = load_records(args)
        env_factory = HotpotQAEnv.factory(
            corpus=corpus_from_records(train + evaluation), top_k=args.retrieval_top_k,
            max_malformed=args.max_malformed, system_prompt=args.system_prompt, **env,
        )  # fmt: skip
        quantization = get_quantization_config(model_args)  # --load_in_4bit / --load_in_8bit (bitsandbytes, CUDA)
        config = replace(
            config,
            model_init_kwargs={"revision": model_args.model_revision, "dtype": model_args.dtype,
                               **({"quantization_config": quantization} if quantization else {}),
                               **(config.model_init_kwargs or {})},
            teacher_model_init_kwargs={"dtype": model_args.dtype, **(config.teacher_model_init_kwargs or {})},
        )  # fmt: skip
        tokenizer = AutoTokenizer.from_pretrained(
            model_args.model_name_or_path, revision=model_args.model_revision, trust_remote_code=config.trust_remote_code
        )  # fmt: skip
        setup, start = {}, None  # the start's score is measured by the first arm
    else:
        world = offline.make_offline_world(args, **env)
        train, evaluation, env_factory = world.train, world.evaluation, world.env_factory
        generation = dict(max_new_tokens=config.max_new_tokens, max_prompt_length=config.max_prompt_length)
        setup = offline.prepare_offline_models(args, world, output_dir, **generation)
        refused = offline.check_student_start(setup, args)
        if refused:
            fail(refused)
        tokenizer = offline.load_offline_tokenizer(output_dir / "teacher")
        start = offline.cached_start_scores(setup, world, **generation)  # every arm's step 0
    peft_config = get_peft_config(model_args)
    log(f"[arms] {', '.join(args.arms)} x seeds {args.seeds}: {config.max_steps} steps each")

    # Arms: each trains the same student start with the same seed and budget, and is evaluated greedily.
    runs = []
    for seed in args.seeds:
        for arm in args.arms:
            run_dir = output_dir / f"seed-{seed}" / arm
            arm_config = replace(config, output_dir=str(run_dir), seed=seed, **ARMS[arm])
            settings = json.loads(arm_config.to_json_string())
            finished = finished_run(run_dir, settings) if config.resume_from_checkpoint else None
            if finished is not None:  # resumed: this arm had finished before the run stopped
                log(
                    f"[{arm} seed {seed}] finished before: held-out F1 {finished['f1']:.3f} ({run_dir / 'result.json'})"
                )
                start = start or {"f1": finished["curve"][0][1], "em": finished["curve"][0][2]}
                runs.append(finished)
                continue
            # Real mode: the trainer loads the models the config names. Offline: fresh copies of the cached ones.
            teacher, student = None, model_args.model_name_or_path
            if not real:
                teacher = offline.load_offline_model(output_dir / "teacher") if arm_config.distill_coef > 0 else None
                student = offline.load_offline_model(output_dir / "student_init")
            trainer = MemOPDTrainer(
                model=student, teacher_model=teacher, args=arm_config, train_dataset=train,
                eval_dataset=evaluation, env_factory=env_factory, processing_class=tokenizer, peft_config=peft_config,
            )  # fmt: skip
            arm_started = time.perf_counter()
            if start is None:  # measured once: every arm starts from the same model
                metrics = trainer.evaluate()
                start = {"f1": metrics["eval_f1"], "em": metrics["eval_em"]}
            try:
                trainer.train(resume_from_checkpoint=resume_point(config.resume_from_checkpoint, run_dir))
            except SystemExit:  # a SIGTERM: the trainer saved a checkpoint of this arm
                log(f"[{arm} seed {seed}] stopped; run the same command with --resume_from_checkpoint true to go on")
                raise
            curve = eval_curve(trainer.state.log_history, start)
            if curve[-1][0] != trainer.state.global_step:
                metrics = trainer.evaluate()
                curve.append([trainer.state.global_step, metrics["eval_f1"], metrics["eval_em"]])
            seconds = time.perf_counter() - arm_started
            if args.save_models:
                trainer.save_model(str(run_dir))
            log(f"[{arm} seed {seed}] held-out F1 {curve[0][1]:.3f} -> {curve[-1][1]:.3f} ({seconds:.0f} s)")
            runs.append({"arm": arm, "seed": seed, "f1": curve[-1][1], "em": curve[-1][2], "curve": curve,
                         "misalignment": misalignment_curve(trainer.state.log_history), "seconds": seconds})  # fmt: skip
            if state.is_main_process:  # what `--resume_from_checkpoint true` reuses if a later arm is stopped
                (run_dir / "result.json").write_text(json.dumps({"settings": settings, "run": runs[-1]}, indent=1))

    command = "examples/hotpot.py " + " ".join(sys.argv[1:] if argv is None else argv)
    results = {"mode": "real" if real else "offline", "command": command, "seeds": args.seeds,
               "num_processes": state.num_processes, "distributed_type": PartialState().distributed_type.value,
               "setup": setup, "runs": runs, "summary": summarize(runs),
               "seconds": time.perf_counter() - started}  # fmt: skip
    if state.is_main_process:
        table = write_report(results, output_dir)
        print(f"\n{table}\n\nresults: {output_dir / 'results.json'}, plot: {output_dir / 'eval_f1.png'} "
              f"({results['seconds'] / 60:.1f} min)")  # fmt: skip
    return results


if __name__ == "__main__":
    main()
    if PartialState().num_processes > 1:
        PartialState().destroy_process_group()
        # Even with the group torn down, a gloo worker thread still joinable at interpreter shutdown can abort a
        # finished run ("terminate called without an active exception", exit code -6). Everything is written by
        # now, so leave without the C++ teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
