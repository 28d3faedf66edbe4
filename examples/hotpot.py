"""MemOPD on HotpotQA-format data: the main job.

    accelerate launch examples/hotpot.py                               # offline: synthetic world, tiny models, CPU
    accelerate launch examples/hotpot.py --seeds 0 1 2                 # the same, three seeds (one teacher)
    accelerate launch examples/hotpot.py --config examples/smoke.yaml  # the whole pipeline in seconds (tests, CI)
    accelerate launch examples/hotpot.py --resume_from_checkpoint true # go on after a stop (SIGTERM, a failure)
    accelerate launch examples/hotpot.py --help                        # every flag, with the defaults a run uses

Offline (no flags, no network; about 12 minutes on 2 CPU cores, docs/results.md): the offline lab beside this script
(`offline_lab`) builds a synthetic world of two-part lookup tasks whose first answer only the memory can carry, and
caches a tiny teacher and a student start. Three arms train that start with the same seed and budget: PPO only,
MemOPD (aligned teacher scoring) and MemOPD with persistent-history teacher scoring, each evaluated greedily on
held-out tasks; the lab's report writes the F1/EM table, `results.json` and plots. Tiny models: the numbers show the
mechanics, not the paper's results.

Real mode: `--model_name_or_path` and `--dataset` (a Hub id or a local HotpotQA .json/.jsonl file), from
`examples/real.yaml`, e.g.

    accelerate launch --config_file examples/accelerate_configs/ddp.yaml examples/hotpot.py \\
        --config examples/real.yaml --attn_implementation flash_attention_2 --use_vllm --arms memopd

or with the teacher on its own vLLM server: `--teacher_model_server_url http://HOST:8000 --loss_top_k 64`
(docs/quickstart.md).
"""

import difflib
import gc
import sys
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import NoReturn

from accelerate import PartialState
from transformers import AutoTokenizer
from trl import ModelConfig, TrlParser, get_peft_config, get_quantization_config

import offline_lab as offline
from memopd_trl import HotpotQAEnv, MemOPDConfig, MemOPDTrainer, load_hotpotqa
from memopd_trl.envs.retrieval import corpus_from_records
from offline_lab.compare import OFFLINE_DEFAULTS, ComparisonArguments, check_arguments, log, run_arms


@dataclass
class ModelArguments(ModelConfig):
    """`trl.ModelConfig` without its own `--attn_implementation`: MemOPDConfig's loads the student and the teacher."""

    attn_implementation: str | None = field(default=None, init=False)


def parse_args(argv: list[str] | None) -> tuple[ComparisonArguments, MemOPDConfig, ModelArguments]:
    """Parse the command line (over a `--config` YAML file, over the offline defaults) and check what it asks for."""
    classes = (ComparisonArguments, MemOPDConfig, ModelArguments)
    parser = TrlParser(classes)
    parser.set_defaults(**OFFLINE_DEFAULTS)
    try:
        args, config, model_args, unknown = parser.parse_args_and_config(argv, return_remaining_strings=True)
    except ValueError as error:  # a value a config rejects
        fail(str(error))
    if unknown:
        flag = next((arg for arg in unknown if arg.startswith("-")), unknown[0]).split("=")[0]
        close = difflib.get_close_matches(flag, ["--" + f.name for c in classes for f in fields(c) if f.init], n=1)
        fail(f"unknown argument {flag}" + (f"; did you mean {close[0]}?" if close else " (--help lists them all)"))
    if (config.resume_from_checkpoint or "").lower() == "false":
        config.resume_from_checkpoint = None
    if model_args.model_name_or_path is not None:  # real mode: the trainer loads the models with these settings
        quantization = get_quantization_config(model_args)  # --load_in_4bit / --load_in_8bit (bitsandbytes, CUDA)
        config = replace(
            config,
            model_init_kwargs={"revision": model_args.model_revision, "dtype": model_args.dtype,
                               **({"quantization_config": quantization} if quantization else {}),
                               **(config.model_init_kwargs or {})},
            teacher_model_init_kwargs={"dtype": model_args.dtype, **(config.teacher_model_init_kwargs or {})},
        )  # fmt: skip
    refused = check_arguments(args, config, model_args)
    if refused:
        fail(refused)
    return args, config, model_args


def fail(message: str) -> NoReturn:
    """Stop with one line on stderr (exit status 1), not a traceback."""
    sys.exit(f"hotpot.py: error: {message}")


def load_records(args: ComparisonArguments) -> tuple[list[dict], list[dict]]:
    """HotpotQA training and held-out records: Hub splits, or a local file whose last questions are held out."""
    source, name, limit = args.dataset, args.dataset_config, args.num_train_questions
    if not Path(source).exists():
        train = load_hotpotqa(source, split=args.dataset_train_split, name=name, limit=limit)
        return train, load_hotpotqa(source, split=args.dataset_test_split, name=name, limit=args.num_eval_questions)
    records = load_hotpotqa(source, name=name)
    held = min(args.num_eval_questions, len(records) - 1)
    return records[: len(records) - held][:limit], records[len(records) - held :]


def main(argv: list[str] | None = None) -> dict:
    """Run the main job on `argv` (defaults to `sys.argv[1:]`); returns what `results.json` holds."""
    started = time.perf_counter()
    args, config, model_args = parse_args(argv)
    config.device  # noqa: B018  (sets up the process group before anything asks for the process state)
    state, threads = PartialState(), offline.set_cpu_threads(args.cpu_threads)
    log(f"[run] {state.num_processes} process(es) on {state.device.type}, {threads} torch threads each")
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)

    # Data and models: HotpotQA and the models the config names (real mode), or the offline world and its cached tiny
    # teacher and student start.
    real = model_args.model_name_or_path is not None
    if real:
        train, evaluation = load_records(args)
        env_factory = HotpotQAEnv.factory(
            corpus=corpus_from_records(train + evaluation), top_k=args.retrieval_top_k,
            max_malformed=args.max_malformed, system_prompt=args.system_prompt, **args.env_settings(),
        )  # fmt: skip
        tokenizer = AutoTokenizer.from_pretrained(
            model_args.model_name_or_path, revision=model_args.model_revision, trust_remote_code=config.trust_remote_code
        )  # fmt: skip
        setup, test = {}, None  # the held-out questions give the curves (no validation split)
    else:
        world = offline.make_offline_world(args, **args.env_settings())
        # Settings are chosen on validation tasks (the curves); the held-out tasks are read once per arm, at the end.
        train, evaluation, test, env_factory = world.train, world.evaluation, None, world.env_factory
        if args.teacher_select_tasks > 0:
            (train, evaluation), test = offline.validation_tasks(world, args), world.evaluation
        else:
            log("[arms] no validation tasks (--teacher_select_tasks 0): the curves are on the held-out tasks")
        generation = dict(max_new_tokens=config.max_new_tokens, max_prompt_length=config.max_prompt_length)
        setup = offline.prepare_offline_models(args, world, output_dir, **generation)
        refused = offline.check_student_start(setup, args) or offline.check_teacher_gain(setup, args)
        if refused:
            fail(refused)
        tokenizer = offline.load_offline_tokenizer(output_dir / "teacher")
    peft_config = get_peft_config(model_args)

    # The trainer of one arm: the models the config names (real mode), or fresh copies of the cached ones.
    def build_trainer(arm_config: MemOPDConfig) -> MemOPDTrainer:
        teacher, student = None, model_args.model_name_or_path
        if not real:
            teacher = offline.load_offline_model(output_dir / "teacher") if arm_config.distill_coef > 0 else None
            student = offline.load_offline_model(output_dir / "student_init")
        return MemOPDTrainer(
            model=student, teacher_model=teacher, args=arm_config, train_dataset=train, eval_dataset=evaluation,
            env_factory=env_factory, processing_class=tokenizer, peft_config=peft_config,
        )  # fmt: skip

    # Train and evaluate every arm x seed from the same start (resumable: --resume_from_checkpoint true).
    log(f"[arms] {', '.join(args.arms)} x seeds {args.seeds}: {config.max_steps} steps each")
    runs = run_arms(build_trainer, config, args, test=test)

    # Report.
    command = "examples/hotpot.py " + " ".join(sys.argv[1:] if argv is None else argv)
    results = {"mode": "real" if real else "offline", "command": command, "seeds": args.seeds,
               "num_processes": state.num_processes, "distributed_type": state.distributed_type.value,
               "setup": setup, "runs": runs, "summary": offline.summarize(runs),
               "seconds": time.perf_counter() - started}  # fmt: skip
    if state.is_main_process:
        table = offline.write_report(results, output_dir)
        print(f"\n{table}\n\nresults: {output_dir / 'results.json'}, plot: {output_dir / 'eval_f1.png'} "
              f"({results['seconds'] / 60:.1f} min)")  # fmt: skip
    return results


if __name__ == "__main__":
    main()
    if PartialState().num_processes > 1:
        # The arms' trainers (their DDP reducers hold the process group and its gloo worker threads) are freed now,
        # then the group: left to the interpreter's shutdown, a worker thread's last tensor can abort the exit.
        gc.collect()
        PartialState().destroy_process_group()
