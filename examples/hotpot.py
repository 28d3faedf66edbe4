"""MemOPD on HotpotQA-format data: the main job.

    accelerate launch examples/hotpot.py                    # offline default: synthetic world, tiny models, CPU
    accelerate launch examples/hotpot.py --preset smoke     # the same pipeline in seconds (tests, CI)
    accelerate launch examples/hotpot.py --help             # every option, including every MemOPDConfig field

Offline default (no network, 2 CPU cores): a seeded synthetic HotpotQA-format world, a tokenizer trained on it, a
tiny teacher fine-tuned by imitation of the scripted expert's compact-memory trajectories (cached in the output
directory), a smaller student warm-started briefly, then three arms from the same student start with the same seed
and budget: PPO only (`distill_coef=0`), MemOPD (aligned teacher scoring) and MemOPD with persistent-history scoring.
Each arm is evaluated greedily on held-out questions; the script prints an F1/EM table and writes `results.json` and
`eval_f1.png` into the output directory. All of its numbers come from the synthetic world and tiny models.

Real mode: `--dataset hotpotqa/hotpot_qa` (Hub, `distractor`) or a local HotpotQA .json/.jsonl file, with
`--model_name_or_path` and `--teacher_model_name_or_path` (e.g. Qwen/Qwen2.5-3B-Instruct and Qwen/Qwen2.5-7B-Instruct,
one tokenizer family), `--attn_implementation flash_attention_2`, `--bf16`, `--use_peft`. The imitation phases are
skipped and the configured arms train the given models. Expected hardware for 3B/7B: 8 x 80 GB GPUs
(`--config_file examples/accelerate_configs/ddp.yaml`; the teacher is replicated on every GPU).
"""

import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


_OFFLINE = "--dataset" not in " ".join(sys.argv) or "--dataset synthetic" in " ".join(sys.argv)
if _OFFLINE:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import torch  # noqa: E402
from accelerate import PartialState  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from peft import LoraConfig  # noqa: E402
from trl import TrlParser  # noqa: E402

import memopd_trl.scoring  # noqa: E402, F401  (registers the memopd_sdpa_varlen attention)
from memopd_trl import HotpotQAEnv, MemOPDConfig, MemOPDTrainer, load_hotpotqa  # noqa: E402
from memopd_trl.envs.expert import expert_trajectories  # noqa: E402
from memopd_trl.envs.retrieval import corpus_from_records  # noqa: E402
from memopd_trl.envs.synthetic import make_synthetic_world  # noqa: E402
from memopd_trl.imitation import expert_invocations, imitation_train  # noqa: E402
from memopd_trl.modeling import build_tiny_model  # noqa: E402
from memopd_trl.rollout import RolloutEngine  # noqa: E402
from memopd_trl.tokenizer import build_tokenizer  # noqa: E402


ARMS = {
    "ppo": {"distill_coef": 0.0},
    "memopd": {"teacher_scoring": "aligned"},
    "memopd_persistent": {"teacher_scoring": "persistent"},
}
SYSTEM_PROMPT = "Answer the question. Keep what you learn in memory; search one name at a time."

# Trainer settings of each preset, applied unless given on the command line.
PRESET_CONFIG = {
    "default": dict(max_new_tokens=64, num_generations=4, per_device_train_batch_size=4, learning_rate=2e-4,
                    temperature=1.0, max_prompt_length=1024, logging_steps=5),
    "smoke": dict(max_new_tokens=12, num_generations=2, per_device_train_batch_size=2, learning_rate=1e-3,
                  max_prompt_length=1024, logging_steps=1),
}

PRESETS = {
    # questions, eval, teacher (hidden, layers, epochs), student (hidden, layers, warm-up epochs), arm steps, eval every
    "default": dict(num_train_questions=600, num_eval_questions=100, teacher_hidden=128, teacher_layers=4,
                    teacher_epochs=2.0, student_hidden=64, student_layers=2, student_epochs=0.3, arm_steps=30,
                    eval_every=10, vocab_size=1024),
    "smoke": dict(num_train_questions=24, num_eval_questions=6, teacher_hidden=32, teacher_layers=1,
                  teacher_epochs=0.5, student_hidden=32, student_layers=1, student_epochs=0.2, arm_steps=2,
                  eval_every=2, vocab_size=512),
}


@dataclass
class HotpotScriptArguments:
    """Arguments of the main job (the trainer's own options are MemOPDConfig's)."""

    preset: str = field(
        default="default", metadata={"help": "Sizes of the offline run.", "choices": list(PRESETS)}
    )
    dataset: str = field(
        default="synthetic",
        metadata={"help": "`synthetic` (offline), a Hub id such as `hotpotqa/hotpot_qa`, or a local .json/.jsonl."},
    )
    dataset_config: str = field(default="distractor", metadata={"help": "Hub config: `distractor` or `fullwiki`."})
    arms: str = field(
        default="ppo,memopd,memopd_persistent",
        metadata={"help": f"Comma-separated arms to run, among {list(ARMS)}."},
    )
    seeds: str = field(default="0", metadata={"help": "Comma-separated seeds; each seed runs every arm."})
    world_seed: int = field(default=0, metadata={"help": "Seed of the synthetic world."})
    passages_per_search: int = field(default=1, metadata={"help": "Passages shown per search."})
    env_max_turns: int = field(default=4, metadata={"help": "Turns per episode."})
    num_train_questions: int | None = field(default=None, metadata={"help": "Overrides the preset."})
    num_eval_questions: int | None = field(default=None, metadata={"help": "Overrides the preset."})
    arm_steps: int | None = field(default=None, metadata={"help": "Training steps per arm; overrides the preset."})
    eval_every: int | None = field(default=None, metadata={"help": "Evaluate every this many steps."})
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Student model id or path (real mode); the offline default builds its own."}
    )
    use_peft: bool = field(default=False, metadata={"help": "Train LoRA adapters on the student."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha."})
    lora_target_modules: str = field(
        default="q_proj,k_proj,v_proj,o_proj", metadata={"help": "Comma-separated module names to adapt."}
    )


def log(message: str) -> None:
    if PartialState().is_main_process:
        print(message, flush=True)


def settings_of(script_args: HotpotScriptArguments) -> dict:
    settings = dict(PRESETS[script_args.preset])
    for name in ("num_train_questions", "num_eval_questions", "arm_steps", "eval_every"):
        if getattr(script_args, name) is not None:
            settings[name] = getattr(script_args, name)
    return settings


def greedy_f1(model, tokenizer, env_factory, records, max_new_tokens: int) -> dict[str, float]:
    engine = RolloutEngine(model, tokenizer, env_factory, max_new_tokens=max_new_tokens, max_prompt_length=2048)
    episodes, _ = engine.rollout(records, num_generations=1, greedy=True)
    n = max(1, len(episodes))
    return {"f1": sum(e.f1 for e in episodes) / n, "em": sum(e.em for e in episodes) / n}


def offline_setup(script_args, config, settings, output_dir: Path):
    """World, tokenizer, imitation-trained teacher and warm-started student (cached in `output_dir`)."""
    state = PartialState()
    total = settings["num_train_questions"] + settings["num_eval_questions"]
    world = make_synthetic_world(total, seed=script_args.world_seed)
    train, evaluation = world.records[: settings["num_train_questions"]], world.records[settings["num_train_questions"] :]
    env_factory = HotpotQAEnv.factory(
        corpus=world.corpus, top_k=script_args.passages_per_search, max_turns=script_args.env_max_turns, system_prompt=SYSTEM_PROMPT
    )
    teacher_dir, student_dir = output_dir / "teacher", output_dir / "student_init"
    with state.main_process_first():
        if not (teacher_dir / "config.json").exists() or not (student_dir / "config.json").exists():
            if state.is_main_process:
                build_and_cache(world, train, evaluation, env_factory, settings, config, teacher_dir, student_dir)
    tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    return train, evaluation, env_factory, tokenizer, teacher_dir, student_dir


def build_and_cache(world, train, evaluation, env_factory, settings, config, teacher_dir, student_dir):
    start = time.perf_counter()
    trajectories = expert_trajectories(train, env_factory)
    steps = [step for trajectory in trajectories for step in trajectory.steps]
    tokenizer = build_tokenizer(world.texts() + [a for _, a in steps[:2000]], vocab_size=settings["vocab_size"])
    invocations = expert_invocations(steps, tokenizer)
    log(f"[setup] {len(train)} train / {len(evaluation)} eval questions, {len(invocations)} expert turns")

    def tiny(hidden, layers, seed):
        return build_tiny_model(
            len(tokenizer), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
            attn_implementation="memopd_sdpa_varlen", seed=seed,
        )

    teacher = tiny(settings["teacher_hidden"], settings["teacher_layers"], seed=1)
    imitation_train(teacher, invocations, epochs=settings["teacher_epochs"], learning_rate=3e-3,
                    tokens_per_batch=4096, max_tokens_per_row=2048, pad_token_id=tokenizer.pad_token_id,
                    description="teacher imitation")
    student = tiny(settings["student_hidden"], settings["student_layers"], seed=2)
    imitation_train(student, invocations, epochs=settings["student_epochs"], learning_rate=3e-3,
                    tokens_per_batch=4096, max_tokens_per_row=2048, pad_token_id=tokenizer.pad_token_id,
                    description="student warm-up")
    for model, path in ((teacher, teacher_dir), (student, student_dir)):
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    teacher_scores = greedy_f1(teacher, tokenizer, env_factory, evaluation, config.max_new_tokens)
    student_scores = greedy_f1(student, tokenizer, env_factory, evaluation, config.max_new_tokens)
    (teacher_dir / "eval.json").write_text(json.dumps(teacher_scores))
    (student_dir / "eval.json").write_text(json.dumps(student_scores))
    log(f"[setup] teacher held-out F1 {teacher_scores['f1']:.3f}, student start F1 {student_scores['f1']:.3f} "
        f"({time.perf_counter() - start:.0f} s)")


class EvalEvery(TrainerCallback):
    """Greedy held-out evaluation every `every` steps, recorded as (step, F1, EM)."""

    def __init__(self, every: int):
        self.every, self.trainer, self.curve = every, None, []

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every == 0 or state.global_step == state.max_steps:
            metrics = self.trainer.evaluate()
            self.curve.append([state.global_step, metrics["eval_f1"], metrics["eval_em"]])


def run_arm(arm, seed, config, settings, model_path, teacher_path, tokenizer, train, evaluation, env_factory, peft):
    args = dataclasses.replace(
        config, output_dir=str(Path(config.output_dir) / f"{arm}-seed{seed}"), seed=seed,
        max_steps=settings["arm_steps"], **ARMS[arm],
    )
    evaluator = EvalEvery(settings["eval_every"])
    init = {"attn_implementation": args.attn_implementation}
    trainer = MemOPDTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_path, **init) if Path(str(model_path)).exists() else str(model_path),
        teacher_model=None if args.distill_coef == 0 else teacher_path,
        args=args,
        train_dataset=train,
        eval_dataset=evaluation,
        env_factory=env_factory,
        processing_class=tokenizer,
        callbacks=[evaluator],
        peft_config=peft,
    )
    evaluator.trainer = trainer
    start = time.perf_counter()
    trainer.train()
    final = trainer.evaluate()
    return {
        "arm": arm, "seed": seed, "f1": final["eval_f1"], "em": final["eval_em"], "curve": evaluator.curve,
        "train_seconds": time.perf_counter() - start,
    }


def write_results(results, setup_scores, output_dir: Path) -> None:
    (output_dir / "results.json").write_text(json.dumps({"setup": setup_scores, "runs": results}, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for run in results:
        steps, f1 = [c[0] for c in run["curve"]], [c[1] for c in run["curve"]]
        ax.plot(steps, f1, marker="o", label=f"{run['arm']} (seed {run['seed']})")
    if "teacher" in setup_scores:
        ax.axhline(setup_scores["teacher"]["f1"], linestyle="--", color="gray", label="teacher")
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out F1 (greedy)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(output_dir / "eval_f1.png", dpi=120)
    print("\n| arm | seed | F1 | EM |\n|---|---:|---:|---:|")
    for run in results:
        print(f"| {run['arm']} | {run['seed']} | {run['f1']:.3f} | {run['em']:.3f} |")


def main(argv: list[str] | None = None) -> dict:
    parser = TrlParser((HotpotScriptArguments, MemOPDConfig))
    script_args, config = parser.parse_args_and_config(args=argv)[:2]
    for arm in script_args.arms.split(","):
        if arm not in ARMS:
            raise ValueError(f"Unknown arm {arm!r} in --arms; choose among {list(ARMS)}.")
    settings = settings_of(script_args)
    given = set(argv if argv is not None else sys.argv[1:])
    if script_args.dataset == "synthetic":
        overrides = {k: v for k, v in PRESET_CONFIG[script_args.preset].items() if f"--{k}" not in given}
        config = dataclasses.replace(config, **overrides)
    if config.output_dir in (None, "trainer_output"):
        config.output_dir = "outputs/hotpot"
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    peft = None
    if script_args.use_peft:
        peft = LoraConfig(
            r=script_args.lora_r, lora_alpha=script_args.lora_alpha,
            target_modules=script_args.lora_target_modules.split(","), task_type="CAUSAL_LM",
        )

    if script_args.dataset == "synthetic":
        if not config.use_cpu and not torch.cuda.is_available():
            config = dataclasses.replace(config, use_cpu=True)
        train, evaluation, env_factory, tokenizer, teacher_path, student_path = offline_setup(
            script_args, config, settings, output_dir
        )
        model_path = script_args.model_name_or_path or student_path
        config = dataclasses.replace(config, attn_implementation="memopd_sdpa_varlen")
        setup_scores = {
            "teacher": json.loads((teacher_path / "eval.json").read_text()),
            "student_init": json.loads((student_path / "eval.json").read_text()),
        }
    else:
        records = load_hotpotqa(script_args.dataset, split="train", name=script_args.dataset_config)
        cut = max(1, len(records) // 20)
        train, evaluation = records[cut:], records[:cut]
        env_factory = HotpotQAEnv.factory(
            corpus=corpus_from_records(records), top_k=script_args.passages_per_search, max_turns=script_args.env_max_turns
        )
        if script_args.model_name_or_path is None or config.teacher_model_name_or_path is None:
            raise ValueError("Real mode needs --model_name_or_path and --teacher_model_name_or_path.")
        model_path, teacher_path = script_args.model_name_or_path, config.teacher_model_name_or_path
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        setup_scores = {}

    results = []
    for seed in [int(s) for s in script_args.seeds.split(",")]:
        for arm in script_args.arms.split(","):
            log(f"[arm] {arm}, seed {seed}")
            results.append(run_arm(arm, seed, config, settings, model_path, teacher_path, tokenizer, train,
                                   evaluation, env_factory, peft))
    if PartialState().is_main_process:
        write_results(results, setup_scores, output_dir)
    return {"setup": setup_scores, "runs": results}


if __name__ == "__main__":
    main()
