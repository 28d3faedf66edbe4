"""MemOPD on HotpotQA-format data: the main job.

    accelerate launch examples/hotpot.py                      # offline default: synthetic world, tiny models, CPU
    accelerate launch examples/hotpot.py --seeds 0 1 2        # the same, three seeds (the teacher is built once)
    accelerate launch examples/hotpot.py --preset smoke       # the whole pipeline in seconds (tests, CI)
    accelerate launch examples/hotpot.py --help               # every option, every MemOPDConfig field included

Offline default (no network; about 14 minutes on 2 CPU cores, see docs/results.md):

1. a seeded synthetic HotpotQA-format world (bridge questions over invented films, companies and people), a BM25
   retriever over its passages and a small BPE tokenizer trained on its texts;
2. a teacher (hidden 128, 2 layers) trained by imitation of the scripted expert's compact-memory trajectories, after a
   short copy warm-up (random strings to repeat), cached in `<output_dir>/teacher/`. A fifth of the expert's search
   turns are played with a mistake (garbled query, repeated search, forgotten fact) while the trace keeps the
   expert's own next actions, so the teacher has also seen how to recover from states a weak student reaches;
3. a smaller student (hidden 64, 2 layers) warm-started briefly the same way (it knows the action format and answers
   about half the held-out questions), cached in `<output_dir>/student_init/`;
4. three arms from that same student start, with the same seed and budget, all through `MemOPDTrainer`: PPO only
   (`distill_coef=0`), MemOPD (aligned teacher scoring) and MemOPD with persistent-history teacher scoring (the
   matched control), each evaluated greedily on held-out questions every `eval_steps` steps and at the end. The
   offline preset distills with the reverse KL (`beta=1`) and samples at temperature 0.7 (see docs/results.md);
5. an F1/EM table on stdout, `results.json` and `eval_f1.png` (held-out F1 against step) in the output directory.

Every number of the offline default comes from the synthetic world and tiny models: it shows the mechanics, not the
paper's results. Reruns reuse the cached teacher and student (delete them, or change their settings, to rebuild).

Real mode (not run in this repository's CI): point the same script at HotpotQA and Hub models, e.g.

    accelerate launch --config_file examples/accelerate_configs/ddp.yaml examples/hotpot.py \\
        --dataset hotpotqa/hotpot_qa --model_name_or_path Qwen/Qwen2.5-3B-Instruct \\
        --teacher_model_name_or_path Qwen/Qwen2.5-7B-Instruct --dtype bfloat16 --bf16 \\
        --attn_implementation flash_attention_2 --use_vllm --arms memopd --max_steps 500

`--dataset` is a Hub id (`hotpotqa/hotpot_qa`, config `--dataset_config distractor`) or a local HotpotQA .json/.jsonl
file; the retrieval corpus is the records' own context paragraphs. The imitation phases are skipped: the arms train
the given models (`--arms configured` trains exactly the given MemOPDConfig). `--use_peft` trains LoRA adapters.
Expected hardware for a 3B student and a 7B teacher in bf16: one node of 8 x 80 GB GPUs (A100/H100) with
`ddp.yaml` (the teacher is replicated on every GPU; ~20 GB of weights per GPU before activations and the vLLM cache),
or `deepspeed_zero2.yaml` to shard optimizer states; `--use_peft` fits a single 80 GB GPU.
"""

import os
import sys
from pathlib import Path


def _requests_hub(argv: list[str]) -> bool:
    """Whether the command line names a dataset or model that is neither synthetic nor a local path."""
    for flag in ("--dataset", "--model_name_or_path", "--teacher_model_name_or_path"):
        for i, arg in enumerate(argv):
            value = None
            if arg == flag and i + 1 < len(argv):
                value = argv[i + 1]
            elif arg.startswith(flag + "="):
                value = arg.split("=", 1)[1]
            if value is not None and value != "synthetic" and not Path(value).exists():
                return True
    return False


if __name__ == "__main__" and not _requests_hub(sys.argv[1:]):
    # The offline default never touches the network. Set before huggingface_hub is imported, which reads it then.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import dataclasses  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from accelerate import PartialState  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast  # noqa: E402
from trl import TrlParser  # noqa: E402

import memopd_trl.scoring  # noqa: E402, F401  (registers the "memopd_sdpa_varlen" attention)
from memopd_trl import HotpotQAEnv, MemOPDConfig, MemOPDTrainer, load_hotpotqa  # noqa: E402
from memopd_trl.envs.expert import expert_trajectories  # noqa: E402
from memopd_trl.envs.retrieval import corpus_from_records  # noqa: E402
from memopd_trl.envs.synthetic import NAME_SYLLABLES, make_synthetic_world  # noqa: E402
from memopd_trl.imitation import copy_task_invocations, expert_invocations, imitation_train  # noqa: E402
from memopd_trl.modeling import build_tiny_model  # noqa: E402
from memopd_trl.rollout import RolloutEngine  # noqa: E402
from memopd_trl.tokenizer import build_tokenizer  # noqa: E402


# What each arm changes in the MemOPDConfig given on the command line ("configured" changes nothing).
ARMS = {
    "ppo": {"distill_coef": 0.0},
    "memopd": {"teacher_scoring": "aligned"},
    "memopd_persistent": {"teacher_scoring": "persistent"},
    "configured": {},
}
OFFLINE_ARMS = ["ppo", "memopd", "memopd_persistent"]
# A one-line system prompt keeps the tiny models' contexts short; real models get the environment's default prompt,
# which states the action format.
OFFLINE_SYSTEM_PROMPT = "Act."
VARLEN_ATTENTION = "memopd_sdpa_varlen"

# Defaults of each preset, applied before the command line (and a `--config` file), which override them.
# Script arguments of the smoke preset (the default preset is the dataclass defaults below).
SCRIPT_PRESETS = {
    "default": {},
    "smoke": dict(
        num_train_questions=40, num_eval_questions=8, vocab_size=400, teacher_hidden_size=32, teacher_layers=1,
        student_hidden_size=32, student_layers=1, copy_warmup_sequences=64, teacher_epochs=0.5,
        student_warmup_questions=16, student_epochs=0.5, imitation_tokens_per_batch=1024,
    ),
}  # fmt: skip
# MemOPDConfig settings of the offline world (the library's own defaults suit real models).
OFFLINE_CONFIG_PRESETS = {
    "default": dict(
        output_dir="outputs/hotpot", max_steps=160, num_iterations=4, per_device_train_batch_size=8,
        num_generations=4, learning_rate=3e-4, lr_scheduler_type="constant_with_warmup", warmup_steps=20,
        temperature=0.7, beta=1.0, max_turns=4, max_new_tokens=64, max_prompt_length=512, eval_strategy="steps",
        eval_steps=80, logging_steps=20, save_strategy="no", report_to="none", bf16=False,
        attn_implementation=VARLEN_ATTENTION,
    ),
    "smoke": dict(
        output_dir="outputs/hotpot-smoke", max_steps=2, per_device_train_batch_size=2, num_generations=2,
        learning_rate=1e-3, max_turns=3, max_new_tokens=12, max_prompt_length=512, eval_strategy="steps",
        eval_steps=1, logging_steps=1, save_strategy="no", report_to="none", bf16=False,
        attn_implementation=VARLEN_ATTENTION,
    ),
}  # fmt: skip
REAL_CONFIG_PRESETS = {
    "default": dict(output_dir="outputs/hotpot-real", save_strategy="no"),
    "smoke": dict(
        output_dir="outputs/hotpot-real-smoke", max_steps=1, per_device_train_batch_size=1, num_generations=2,
        max_turns=2, max_new_tokens=8, eval_strategy="no", logging_steps=1, save_strategy="no", report_to="none",
    ),
}  # fmt: skip
REAL_SCRIPT_PRESETS = {"default": {}, "smoke": dict(num_train_questions=8, num_eval_questions=2)}


@dataclass
class HotpotScriptArguments:
    """
    Arguments of the main job; the trainer's own options are those of `MemOPDConfig` (and `TrainingArguments`).
    Defaults are those of the offline default run; `--preset smoke` shrinks them.
    """

    preset: str = field(
        default="default",
        metadata={
            "help": "Sizes of the run: `default` (offline: ~14 min on 2 CPU cores) or `smoke` (the same pipeline in "
            "seconds). Flags given on the command line override the preset.",
            "choices": ["default", "smoke"],
        },
    )
    seeds: list[int] = field(
        default_factory=lambda: [0],
        metadata={"help": "Training seeds (e.g. `--seeds 0 1 2`); every arm runs once per seed from the same start."},
    )
    arms: list[str] | None = field(
        default=None,
        metadata={
            "help": "Arms to run, in order: `ppo` (distill_coef=0), `memopd` (aligned teacher scoring), "
            "`memopd_persistent` (persistent-history teacher scoring), `configured` (the MemOPDConfig as given). "
            "Defaults to the first three offline and to `configured` in real mode.",
            "choices": list(ARMS),
        },
    )

    # Data
    dataset: str = field(
        default="synthetic",
        metadata={
            "help": "`synthetic` (the offline world), a Hub dataset id such as `hotpotqa/hotpot_qa`, or a local "
            "HotpotQA .json/.jsonl file (real mode)."
        },
    )
    dataset_config: str = field(
        default="distractor", metadata={"help": "HotpotQA setting: `distractor` or `fullwiki`."}
    )
    dataset_train_split: str = field(default="train", metadata={"help": "Hub split to train on."})
    dataset_test_split: str = field(
        default="validation",
        metadata={"help": "Hub split of the held-out questions (a local file holds out its last questions instead)."},
    )
    num_train_questions: int | None = field(
        default=6000,
        metadata={"help": "Training questions (offline: questions of the world the teacher imitates; real: a limit)."},
    )
    num_eval_questions: int = field(default=200, metadata={"help": "Held-out questions evaluated greedily."})
    world_seed: int = field(
        default=0, metadata={"help": "Seed of the synthetic world, the tokenizer and the teacher and student start."}
    )
    comparison_fraction: float = field(
        default=0.0,
        metadata={"help": "Fraction of comparison questions in the synthetic world (the rest are bridge questions)."},
    )
    retrieval_top_k: int | None = field(
        default=None, metadata={"help": "Passages returned per search; defaults to 1 offline and 3 in real mode."}
    )
    max_malformed: int | None = field(
        default=None,
        metadata={"help": "Malformed actions that end an episode with reward 0; defaults to 1 offline (a tiny model's "
                  "turn after a format error is noise that no model was trained on) and to the environment's 2 in "
                  "real mode."},
    )  # fmt: skip
    system_prompt: str | None = field(
        default=None,
        metadata={"help": "System prompt of the environment; defaults to a one-line prompt offline and to the "
                  "environment's own (which states the action format) in real mode."},
    )  # fmt: skip

    # Offline teacher and student
    vocab_size: int = field(default=768, metadata={"help": "Vocabulary size of the offline tokenizer."})
    teacher_hidden_size: int = field(default=128, metadata={"help": "Hidden size of the offline teacher."})
    teacher_layers: int = field(default=2, metadata={"help": "Layers of the offline teacher."})
    student_hidden_size: int = field(default=64, metadata={"help": "Hidden size of the offline student."})
    student_layers: int = field(default=2, metadata={"help": "Layers of the offline student."})
    copy_warmup_sequences: int = field(
        default=16000,
        metadata={"help": "Random strings to repeat before imitation (the induction warm-up of both tiny models)."},
    )
    expert_mistake_prob: float = field(
        default=0.2,
        metadata={"help": "Probability that a search turn of the expert's imitation traces is played with a mistake "
                  "(garbled query, repeated search, forgotten fact) while the trace keeps the expert's own action: "
                  "the teacher then also learns to recover in states a weak student reaches."},
    )  # fmt: skip
    teacher_epochs: float = field(default=2.0, metadata={"help": "Epochs of teacher imitation."})
    teacher_learning_rate: float = field(default=3e-3, metadata={"help": "Peak learning rate of teacher imitation."})
    student_warmup_questions: int = field(
        default=1500, metadata={"help": "Questions whose expert turns warm-start the student."}
    )
    student_epochs: float = field(default=1.0, metadata={"help": "Epochs of the student warm-start."})
    student_learning_rate: float = field(default=3e-3, metadata={"help": "Peak learning rate of the warm-start."})
    copy_learning_rate: float = field(default=5e-3, metadata={"help": "Peak learning rate of the copy warm-up."})
    imitation_tokens_per_batch: int = field(
        default=2048, metadata={"help": "Real tokens per optimizer step of imitation and copy warm-up."}
    )
    context_weight: float = field(
        default=0.5,
        metadata={"help": "Weight of the context tokens' next-token loss in imitation (0 = actions only)."},
    )

    # Real models
    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Student model id or path (real mode). The teacher is `--teacher_model_name_or_path`."},
    )
    dtype: str | None = field(
        default=None,
        metadata={
            "help": "Weights dtype of models loaded by name, unless `model_init_kwargs` says otherwise.",
            "choices": ["auto", "bfloat16", "float16", "float32"],
        },
    )
    use_peft: bool = field(default=False, metadata={"help": "Train LoRA adapters on the student instead of it all."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha."})
    lora_dropout: float = field(default=0.05, metadata={"help": "LoRA dropout."})
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        metadata={"help": "Modules that get LoRA adapters (leave `lm_head` out)."},
    )
    cpu_threads: int | None = field(
        default=None,
        metadata={"help": "Torch threads per process on CPU; defaults to the available cores shared among the local "
                  "processes (`accelerate launch` would otherwise leave one thread per process)."},
    )  # fmt: skip
    save_models: bool | None = field(
        default=None,
        metadata={"help": "Save each arm's final model in `<output_dir>/seed-<s>/<arm>`; defaults to True in real "
                  "mode and False offline."},
    )  # fmt: skip

    @property
    def real(self) -> bool:
        return self.model_name_or_path is not None


def set_cpu_threads(threads: int | None) -> int:
    """
    Set torch's intra-op threads when running on CPU (`None`: the available cores divided among the local processes).

    Returns:
        `int`: the number of threads torch now uses.
    """
    state = PartialState()
    if state.device.type == "cpu":
        if threads is None:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", state.num_processes))
            threads = max(1, cores // max(1, local_processes))
        if threads < 1:
            raise ValueError(f"--cpu_threads must be >= 1, got {threads}.")
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def log(message: str) -> None:
    if PartialState().is_main_process:
        print(message, flush=True)


# ----------------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> tuple[HotpotScriptArguments, MemOPDConfig]:
    """
    Parse the command line (and a `--config` YAML file) over the script arguments and `MemOPDConfig`, with the
    preset's values as defaults.

    Returns:
        `tuple`: the script arguments and the trainer configuration.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    # First pass: which preset and which mode (offline or real), to choose the defaults of the second.
    script_args, _ = TrlParser((HotpotScriptArguments, MemOPDConfig)).parse_args_and_config(args=argv)
    real = script_args.real
    if not real and script_args.dataset != "synthetic":
        raise ValueError(
            f"--dataset {script_args.dataset} needs models that can act on real questions: pass "
            "--model_name_or_path and --teacher_model_name_or_path (one tokenizer family). The offline default trains "
            "its tiny models on the synthetic world only (--dataset synthetic)."
        )
    defaults = {
        **(REAL_SCRIPT_PRESETS if real else SCRIPT_PRESETS)[script_args.preset],
        **(REAL_CONFIG_PRESETS if real else OFFLINE_CONFIG_PRESETS)[script_args.preset],
    }
    if not torch.accelerator.is_available():
        # Without `use_cpu`, processes started by `accelerate launch` on a machine without GPUs would each run alone.
        defaults["use_cpu"] = True
    parser = TrlParser((HotpotScriptArguments, MemOPDConfig))
    parser.set_defaults_with_config(**defaults)
    script_args, config = parser.parse_args_and_config(args=argv)
    if script_args.arms is None:
        script_args.arms = ["configured"] if real else list(OFFLINE_ARMS)
    if script_args.save_models is None:
        script_args.save_models = real
    if script_args.retrieval_top_k is None:
        script_args.retrieval_top_k = 3 if real else 1
    if script_args.max_malformed is None:
        script_args.max_malformed = 2 if real else 1
    if not real and script_args.system_prompt is None:
        script_args.system_prompt = OFFLINE_SYSTEM_PROMPT
    if real and config.teacher_model_name_or_path is None and any(arm != "ppo" for arm in script_args.arms):
        raise ValueError(
            f"Arms {script_args.arms} distill from a teacher: pass --teacher_model_name_or_path (same tokenizer "
            "family as --model_name_or_path), or run `--arms ppo`."
        )
    if config.distill_coef == 0 and any(arm.startswith("memopd") for arm in script_args.arms):
        raise ValueError("--distill_coef 0 turns the memopd arms into PPO only; give it > 0 or run `--arms ppo`.")
    return script_args, config


# ----------------------------------------------------------------------------------------------------------------
# Offline set-up: world, tokenizer, imitation teacher, warm-started student (cached)
# ----------------------------------------------------------------------------------------------------------------
def offline_data(script_args: HotpotScriptArguments, config: MemOPDConfig):
    """
    The synthetic world split into training and held-out questions, and its environment factory.

    Returns:
        `tuple`: the world, the training records, the held-out records and the environment factory.
    """
    num_train = script_args.num_train_questions
    world = make_synthetic_world(
        num_train + script_args.num_eval_questions,
        seed=script_args.world_seed,
        comparison_fraction=script_args.comparison_fraction,
        filler_prob=0.0,
    )
    env_factory = make_env_factory(script_args, config, corpus=world.corpus)
    return world, world.records[:num_train], world.records[num_train:], env_factory


def make_env_factory(script_args: HotpotScriptArguments, config: MemOPDConfig, corpus: list[dict[str, str]]):
    """The environment of every episode, with the config's `max_turns` / `memory_policy` / `action_format` if set."""
    settings = {name: getattr(config, name) for name in ("max_turns", "memory_policy", "action_format")}
    settings = {name: value for name, value in settings.items() if value is not None}
    return HotpotQAEnv.factory(
        corpus=corpus,
        top_k=script_args.retrieval_top_k,
        max_malformed=script_args.max_malformed,
        system_prompt=script_args.system_prompt,
        **settings,
    )


def offline_recipes(script_args: HotpotScriptArguments, config: MemOPDConfig) -> dict[str, dict[str, Any]]:
    """
    Everything the cached teacher and student start depend on; a cache made with another recipe is rebuilt.

    Returns:
        `dict`: the `"teacher"` recipe (world, environment, tokenizer, teacher training) and the `"student_init"` one
        (the teacher's, whose tokenizer it shares, plus the student's own settings).
    """
    shared = [
        "num_train_questions", "num_eval_questions", "world_seed", "comparison_fraction", "retrieval_top_k",
        "max_malformed", "system_prompt", "vocab_size", "copy_warmup_sequences", "copy_learning_rate",
        "imitation_tokens_per_batch", "context_weight", "expert_mistake_prob",
    ]  # fmt: skip
    teacher = {name: getattr(script_args, name) for name in shared}
    teacher.update(max_turns=config.max_turns, memory_policy=config.memory_policy, action_format=config.action_format)
    student = dict(teacher)
    for name in ("hidden_size", "layers", "epochs", "learning_rate"):
        teacher[name] = getattr(script_args, f"teacher_{name}")
        student[name] = getattr(script_args, f"student_{name}")
    student["warmup_questions"] = script_args.student_warmup_questions
    return {"teacher": teacher, "student_init": student}


def build_offline_tokenizer(world, expert_steps, vocab_size: int):
    """
    A BPE tokenizer trained on the world's texts and the rendered expert turns (task wording, tags, memories).

    The capitalized syllables that invented names start with are kept as single tokens: a name then tokenizes the
    same after a space (in a question or passage) and right after a tag (in a query, memory or answer), so a tiny
    model can copy it token by token. Pretrained LLMs learned the mapping between such variants long ago; a model
    trained for minutes would spend most of its budget on it.
    """
    texts = world.texts()
    for messages, action in expert_steps[:1000]:
        texts += [message["content"] for message in messages] + [action]
    return build_tokenizer(texts, vocab_size=vocab_size, extra_tokens=[s.capitalize() for s in NAME_SYLLABLES])


def greedy_scores(model, tokenizer, env_factory, records, config: MemOPDConfig) -> dict[str, float]:
    """Greedy held-out F1 / EM of a model outside the trainer (the cached teacher and student start)."""
    engine = RolloutEngine(
        model, tokenizer, env_factory, max_new_tokens=config.max_new_tokens, max_prompt_length=config.max_prompt_length
    )
    episodes, _ = engine.rollout(records, num_generations=1, greedy=True)
    count = max(1, len(episodes))
    return {"f1": sum(e.f1 for e in episodes) / count, "em": sum(e.em for e in episodes) / count}


def train_tiny_agent(name, hidden_size, layers, invocations, copy_data, epochs, learning_rate, tokenizer, args, seed):
    """A tiny model from scratch: copy warm-up, then imitation of the expert's turns."""
    model = build_tiny_model(
        len(tokenizer), hidden_size=hidden_size, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=2, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        attn_implementation=VARLEN_ATTENTION, seed=seed,
    )  # fmt: skip
    common = dict(tokens_per_batch=args.imitation_tokens_per_batch, pad_token_id=tokenizer.pad_token_id, seed=seed)
    if copy_data:
        imitation_train(
            model, copy_data, learning_rate=args.copy_learning_rate, description=f"{name} copy warm-up", **common
        )
    losses = imitation_train(
        model, invocations, epochs=epochs, learning_rate=learning_rate, context_weight=args.context_weight,
        description=f"{name} imitation", **common,
    )  # fmt: skip
    return model, losses


def prepare_offline_models(script_args, config, world, train, evaluation, env_factory, output_dir: Path) -> dict:
    """
    Build (or reuse) the teacher in `output_dir/teacher` and the student start in `output_dir/student_init`.

    Only the main process trains; the others wait, then everyone reads the cache.

    Returns:
        `dict`: per role (`"teacher"`, `"student_init"`), its held-out `f1` / `em`, training time and recipe.
    """
    state = PartialState()
    recipes = offline_recipes(script_args, config)
    paths = {role: output_dir / role for role in recipes}
    with state.main_process_first():
        if state.is_main_process:
            stale = [role for role in recipes if _cached_recipe(paths[role]) != recipes[role]]
            if "teacher" in stale and "student_init" not in stale:
                stale.append("student_init")  # the student shares the teacher's tokenizer
            for role in recipes:
                what = "building" if role in stale else "reusing the cached"
                log(f"[setup] {what} {role} in {paths[role]}")
            if stale:
                build_offline_models(script_args, config, world, train, evaluation, env_factory, paths, stale)
    return {role: json.loads((path / "memopd_setup.json").read_text()) for role, path in paths.items()}


def eval_settings(script_args, config: MemOPDConfig, evaluation: list[dict]) -> dict[str, Any]:
    """What a greedy held-out score depends on besides the model (to know when a cached score still holds)."""
    return {
        "questions": [record["_id"] for record in evaluation],
        "max_turns": config.max_turns,
        "max_new_tokens": config.max_new_tokens,
        "max_prompt_length": config.max_prompt_length,
        "max_malformed": script_args.max_malformed,
        "retrieval_top_k": script_args.retrieval_top_k,
        "system_prompt": script_args.system_prompt,
    }


def _cached_recipe(path: Path) -> dict | None:
    info = path / "memopd_setup.json"
    return json.loads(info.read_text()).get("recipe") if info.exists() else None


def build_offline_models(script_args, config, world, train, evaluation, env_factory, paths, roles) -> None:
    """Train the models of `roles` (`"teacher"` first: it trains the tokenizer both share) and cache them."""
    args, recipes = script_args, offline_recipes(script_args, config)
    start = time.perf_counter()
    num_expert = len(train) if "teacher" in roles else args.student_warmup_questions
    trajectories = expert_trajectories(
        train[:num_expert], env_factory, mistake_prob=args.expert_mistake_prob, seed=args.world_seed
    )
    if "teacher" in roles:
        steps = [step for trajectory in trajectories for step in trajectory.steps]
        tokenizer = build_offline_tokenizer(world, steps, args.vocab_size)
    else:
        tokenizer = load_offline_tokenizer(paths["teacher"])
    copy_data = []
    if args.copy_warmup_sequences > 0:
        special = set(tokenizer.all_special_ids)
        ordinary_ids = [i for i in range(len(tokenizer)) if i not in special]
        copy_data = copy_task_invocations(
            args.copy_warmup_sequences, ordinary_ids, tokenizer.eos_token_id, seed=args.world_seed
        )
    expert_f1 = sum(t.f1 for t in trajectories) / len(trajectories)
    log(
        f"[setup] world: {len(train)} training / {len(evaluation)} held-out questions, {len(world.corpus)} passages; "
        f"expert F1 {expert_f1:.3f} on {len(trajectories)} of them; tokenizer of {len(tokenizer)} tokens "
        f"({time.perf_counter() - start:.1f} s)"
    )
    for role in ("teacher", "student_init"):
        if role not in roles:
            continue
        recipe = recipes[role]
        num_questions = len(train) if role == "teacher" else recipe["warmup_questions"]
        steps = [step for trajectory in trajectories[:num_questions] for step in trajectory.steps]
        start = time.perf_counter()
        model, losses = train_tiny_agent(
            role, recipe["hidden_size"], recipe["layers"], expert_invocations(steps, tokenizer), copy_data,
            recipe["epochs"], recipe["learning_rate"], tokenizer, args, seed=1 if role == "teacher" else 2,
        )  # fmt: skip
        seconds = time.perf_counter() - start
        scores = greedy_scores(model, tokenizer, env_factory, evaluation, config)
        paths[role].mkdir(parents=True, exist_ok=True)
        model.save_pretrained(paths[role])
        tokenizer.save_pretrained(paths[role])
        tail = losses[-max(1, len(losses) // 20) :]
        info = {
            **scores,
            "train_seconds": round(seconds, 1),
            "parameters": sum(p.numel() for p in model.parameters()),
            "expert_turns": len(steps),
            "final_action_nll": sum(tail) / len(tail),
            "recipe": recipe,
            "eval_settings": eval_settings(script_args, config, evaluation),
        }
        (paths[role] / "memopd_setup.json").write_text(json.dumps(info, indent=2))
        log(
            f"[setup] {role}: hidden {recipe['hidden_size']}, {recipe['layers']} layers "
            f"({info['parameters'] / 1e6:.2f}M parameters), {len(steps)} expert turns, action NLL "
            f"{info['final_action_nll']:.3f}, held-out F1 {scores['f1']:.3f} EM {scores['em']:.3f} ({seconds:.0f} s)"
        )


def load_offline_tokenizer(path: Path) -> PreTrainedTokenizerFast:
    """
    The offline tokenizer saved beside a tiny model. Not through `AutoTokenizer`: next to a Qwen2 `config.json` it
    would build a `Qwen2Tokenizer`, whose pre-tokenizer splits numbers into digits, silently changing the token ids
    the models were trained on.
    """
    return PreTrainedTokenizerFast.from_pretrained(path)


def load_offline_model(path: Path):
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation=VARLEN_ATTENTION, dtype=torch.float32)


# ----------------------------------------------------------------------------------------------------------------
# Real mode: HotpotQA records and Hub (or local) models
# ----------------------------------------------------------------------------------------------------------------
def real_data(script_args: HotpotScriptArguments, config: MemOPDConfig):
    """
    HotpotQA training and held-out records, and an environment over their context paragraphs.

    Returns:
        `tuple`: the training records, the held-out records and the environment factory.
    """
    source, name = script_args.dataset, script_args.dataset_config
    limit = script_args.num_train_questions
    if Path(source).exists():
        records = load_hotpotqa(source, name=name)
        held = min(script_args.num_eval_questions, len(records) - 1)
        train, evaluation = records[: len(records) - held], records[len(records) - held :]
        train = train[:limit] if limit else train
    else:
        train = load_hotpotqa(source, split=script_args.dataset_train_split, name=name, limit=limit)
        evaluation = load_hotpotqa(
            source, split=script_args.dataset_test_split, name=name, limit=script_args.num_eval_questions
        )
    env_factory = make_env_factory(script_args, config, corpus=corpus_from_records(train + evaluation))
    return train, evaluation, env_factory


def peft_config_of(script_args: HotpotScriptArguments):
    if not script_args.use_peft:
        return None
    from peft import LoraConfig

    return LoraConfig(
        r=script_args.lora_r,
        lora_alpha=script_args.lora_alpha,
        lora_dropout=script_args.lora_dropout,
        target_modules=script_args.lora_target_modules,
        task_type="CAUSAL_LM",
    )


def with_dtype(config: MemOPDConfig, dtype: str | None) -> MemOPDConfig:
    """Fill `model_init_kwargs` / `teacher_model_init_kwargs` with `--dtype` where they do not set one."""
    if dtype is None:
        return config
    kwargs = {}
    for name in ("model_init_kwargs", "teacher_model_init_kwargs"):
        value = dict(getattr(config, name) or {})
        value.setdefault("dtype", dtype)
        kwargs[name] = value
    return dataclasses.replace(config, **kwargs)


# ----------------------------------------------------------------------------------------------------------------
# Arms
# ----------------------------------------------------------------------------------------------------------------
def run_arm(
    arm: str, seed: int, config: MemOPDConfig, models: dict, data: dict, script_args, start: dict | None = None
) -> dict:
    """
    Train one arm from the student start and evaluate it greedily on the held-out questions along the way.

    `start` holds the greedy held-out `f1` / `em` of the student start when they are already known (from the set-up
    offline, else from the first arm run): the arm reuses them instead of replaying the same greedy evaluation.

    Returns:
        `dict`: `arm`, `seed`, final `f1` / `em`, the `curve` of `[step, f1, em]` (step 0 is the start) and timings.
    """
    run_dir = Path(config.output_dir) / f"seed-{seed}" / arm
    args = dataclasses.replace(config, output_dir=str(run_dir), seed=seed, **ARMS[arm])
    teacher = models["teacher"]() if args.distill_coef > 0 else None
    trainer = MemOPDTrainer(
        model=models["student"](),
        teacher_model=teacher,
        args=args,
        train_dataset=data["train"],
        eval_dataset=data["eval"],
        env_factory=data["env_factory"],
        processing_class=models["tokenizer"],
        peft_config=models["peft_config"],
    )
    started = time.perf_counter()
    if start is None:
        initial = trainer.evaluate()
        start = {"f1": initial["eval_f1"], "em": initial["eval_em"]}
    trainer.train()
    curve = [[0, start["f1"], start["em"]]]
    curve += [[e["step"], e["eval_f1"], e["eval_em"]] for e in trainer.state.log_history if "eval_f1" in e]
    if curve[-1][0] != trainer.state.global_step:
        final = trainer.evaluate()
        curve.append([trainer.state.global_step, final["eval_f1"], final["eval_em"]])
    seconds = time.perf_counter() - started
    if script_args.save_models:
        trainer.save_model(str(run_dir))
    log(f"[{arm} seed {seed}] held-out F1 {curve[0][1]:.3f} -> {curve[-1][1]:.3f} ({seconds:.0f} s)")
    return {"arm": arm, "seed": seed, "f1": curve[-1][1], "em": curve[-1][2], "curve": curve, "seconds": seconds}


def summarize(runs: list[dict]) -> dict[str, dict[str, Any]]:
    """Mean, standard deviation and per-seed values of the final F1 and EM of each arm."""
    summary = {}
    for arm in dict.fromkeys(run["arm"] for run in runs):
        f1 = [run["f1"] for run in runs if run["arm"] == arm]
        em = [run["em"] for run in runs if run["arm"] == arm]
        summary[arm] = {
            "f1_mean": statistics.fmean(f1),
            "f1_std": statistics.stdev(f1) if len(f1) > 1 else 0.0,
            "em_mean": statistics.fmean(em),
            "em_std": statistics.stdev(em) if len(em) > 1 else 0.0,
            "f1_per_seed": f1,
        }
    return summary


def format_table(summary: dict, setup: dict) -> str:
    """A markdown table of held-out F1 / EM (mean ± std over seeds)."""
    lines = ["| model | held-out F1 | held-out EM | seeds |", "|---|---:|---:|---:|"]
    for role in ("teacher", "student_init"):
        if role in setup:
            lines.append(f"| {role} | {setup[role]['f1']:.3f} | {setup[role]['em']:.3f} | - |")
    for arm, s in summary.items():
        n = len(s["f1_per_seed"])
        lines.append(
            f"| {arm} | {s['f1_mean']:.3f} ± {s['f1_std']:.3f} | {s['em_mean']:.3f} ± {s['em_std']:.3f} | {n} |"
        )
    return "\n".join(lines)


def plot_curves(runs: list[dict], setup: dict, path: Path) -> None:
    """Held-out F1 against training step, one colour per arm (thin: each seed, thick: mean over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for index, arm in enumerate(dict.fromkeys(run["arm"] for run in runs)):
        color = f"C{index}"
        curves = [run["curve"] for run in runs if run["arm"] == arm]
        for curve in curves:
            ax.plot([c[0] for c in curve], [c[1] for c in curve], color=color, alpha=0.35, linewidth=1)
        steps = sorted({c[0] for curve in curves for c in curve})
        mean = [statistics.fmean(c[1] for curve in curves for c in curve if c[0] == s) for s in steps]
        ax.plot(
            steps, mean, color=color, linewidth=2.2, marker="o", markersize=3, label=f"{arm} ({len(curves)} seeds)"
        )
    if "teacher" in setup:
        ax.axhline(setup["teacher"]["f1"], color="gray", linestyle="--", linewidth=1, label="teacher")
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out F1 (greedy)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict:
    """
    Run the main job.

    Args:
        argv (`list[str]`, *optional*): command-line arguments; defaults to `sys.argv[1:]`.

    Returns:
        `dict`: what `results.json` holds (`setup`, `runs`, `summary`, `seconds`, ...).
    """
    start = time.perf_counter()
    script_args, config = parse_args(argv)
    config.device  # noqa: B018  (sets up the process group before anything asks for the process state)
    threads = set_cpu_threads(script_args.cpu_threads)
    log(f"[run] {PartialState().num_processes} process(es) on {PartialState().device.type}, {threads} torch threads each")
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)

    if script_args.real:
        train, evaluation, env_factory = real_data(script_args, config)
        config = with_dtype(config, script_args.dtype)
        tokenizer = AutoTokenizer.from_pretrained(
            script_args.model_name_or_path, trust_remote_code=config.trust_remote_code
        )
        teacher_name = config.teacher_model_name_or_path
        models = {"student": lambda: script_args.model_name_or_path, "teacher": lambda: teacher_name}
        setup = {}
    else:
        world, train, evaluation, env_factory = offline_data(script_args, config)
        setup = prepare_offline_models(script_args, config, world, train, evaluation, env_factory, output_dir)
        tokenizer = load_offline_tokenizer(output_dir / "teacher")
        models = {
            "student": lambda: load_offline_model(output_dir / "student_init"),
            "teacher": lambda: load_offline_model(output_dir / "teacher"),
        }
    models.update(tokenizer=tokenizer, peft_config=peft_config_of(script_args))
    data = {"train": train, "eval": evaluation, "env_factory": env_factory}
    start_scores = None  # the student start's held-out score, if the set-up measured it under the same settings
    if setup and setup["student_init"].get("eval_settings") == eval_settings(script_args, config, evaluation):
        start_scores = {key: setup["student_init"][key] for key in ("f1", "em")}
    log(f"[arms] {', '.join(script_args.arms)} x seeds {script_args.seeds}: {config.max_steps} steps each")

    runs = []
    for seed in script_args.seeds:
        for arm in script_args.arms:
            runs.append(run_arm(arm, seed, config, models, data, script_args, start=start_scores))
            # Every arm starts from the same model and is scored greedily on the same questions: measure it once.
            start_scores = start_scores or dict(zip(("f1", "em"), runs[-1]["curve"][0][1:], strict=True))
    summary = summarize(runs)
    results = {
        "mode": "real" if script_args.real else "offline",
        "preset": script_args.preset,
        "command": "examples/hotpot.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "seeds": script_args.seeds,
        "num_processes": PartialState().num_processes,
        "setup": setup,
        "runs": runs,
        "summary": summary,
        "seconds": time.perf_counter() - start,
    }
    if PartialState().is_main_process:
        (output_dir / "results.json").write_text(json.dumps(results, indent=2))
        plot_curves(runs, setup, output_dir / "eval_f1.png")
        print("\n" + format_table(summary, setup))
        print(f"\nresults: {output_dir / 'results.json'}, plot: {output_dir / 'eval_f1.png'} "
              f"({results['seconds'] / 60:.1f} min)")  # fmt: skip
    return results


if __name__ == "__main__":
    main()
