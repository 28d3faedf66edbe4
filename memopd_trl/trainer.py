"""`MemOPDTrainer`: Memory-Aligned On-Policy Distillation of a memory agent, on top of TRL's trainer base.

One training step, top to bottom (`_prepare_inputs`, then `compute_loss`):

1. rollout (`_rollout`): the student plays `num_generations` episodes per question, every model call recorded as
   token ids;
2. pack (`_score`): each invocation rebuilt as its own sequence, whole invocations packed into rows;
3. advantages (`_compute_advantages`): group-normalized final reward, or GAE with a value head that scores the packed
   rows, one per action token;
4. teacher scoring (`_score`, no grad): the teacher's hidden states at every action position, in the exact context the
   student sampled it in (`teacher_scoring="aligned"`), or under the flattened history (`"persistent"`, the control);
   with `sampled_kl_coef > 0`, the teacher's log-prob of each sampled token joins the advantages; every
   `audit_steps` steps the aligned teacher also scores under the flattened history (`_audit_alignment`, logged only);
   and the reference model's log-probs when `kl_coef > 0`;
5. student forward on the same packed rows (`_student_loss`), then
   `loss = distill_coef * GJSD(teacher || student) + ppo_coef * PPO-clip (+ kl_coef * KL + vf_coef * value loss)`,
   and the `distill/*` diagnostics (logged only).

With `num_iterations > 1` steps 1-4 run once per rollout batch and the following updates reuse it. An update that
has nothing to learn from, or a non-finite loss, is skipped on every process (`_UpdateSkipper`).

The trainer orchestrates; the maths lives in `losses.py`, the packing in `packing.py`, the forwards in `scoring.py`.
"""

import copy
import functools
import importlib
import itertools
import json
import os
import signal
import threading
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import DistributedType, gather_object, send_to_device
from datasets import Dataset
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_callback import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import is_peft_available, logging
from trl.import_utils import is_vllm_available
from trl.models.utils import _ForwardRedirection, unwrap_model_for_generation
from trl.trainer.base_trainer import _BaseTrainer
from trl.trainer.utils import (
    RepeatSampler,
    create_model_from_path,
    disable_dropout_in_model,
    identity,
    use_adapter,
)

from .config import MemOPDConfig
from .losses import (
    broadcast_to_tokens,
    chunked_generalized_jsd,
    distillation_diagnostics,
    gae_advantages,
    group_normalized_advantages,
    kl_penalty,
    ppo_clip_loss,
    sampled_kl_advantages,
    until_first_divergence,
    value_loss,
)
from .model_card import build_model_card
from .packing import PackedInvocationCollator, split_rows
from .records import Episode, Invocation
from .rollout import RolloutEngine
from .scoring import (
    TREE_ATTENTION_IMPLEMENTATIONS,
    action_hidden_states,
    action_logprobs_from_hidden,
    action_token_ids,
    gathered_lm_head,
)
from .sharding import (
    all_processes_agree,
    check_strategy,
    gathered_for_generation,
    is_sharded,
    prepare_frozen_model,
)


if is_peft_available():
    from peft import PeftConfig, PeftModel, get_peft_model


logger = logging.get_logger(__name__)


_PAPER = {
    "title": "Memory-Aligned On-Policy Distillation for Long-Horizon LLM Memory Agents",
    "id": "2608.07068",
    "citation": """\
@article{memopd2026,
    title        = {{Memory-Aligned On-Policy Distillation for Long-Horizon LLM Memory Agents}},
    year         = 2026,
    eprint       = {arXiv:2608.07068}
}""",
}


VALUE_HEAD_FILE = "value_head.safetensors"


class MemOPDTrainer(_BaseTrainer):
    """
    Trainer for Memory-Aligned On-Policy Distillation (MemOPD) of a memory agent.

    Args:
        model (`str` or `PreTrainedModel`):
            The student: a model id/path (loaded with `args.model_init_kwargs`) or a loaded causal LM. With
            `args.use_vllm`, the vLLM engine loads its own copy from the student's `name_or_path` and then receives
            the student's weights, so that path must be readable by vLLM.
        teacher_model (`str` or `PreTrainedModel`, *optional*):
            The teacher; defaults to `args.teacher_model_name_or_path`. Not needed when `args.distill_coef == 0`.
            It must share the student's tokenizer: full-vocabulary supervision compares distributions id by id.
        args (`MemOPDConfig`, *optional*):
            Configuration; defaults to `MemOPDConfig(output_dir="<model name>-MemOPD")`.
        train_dataset (`datasets.Dataset` or `list[dict]`, *optional*):
            HotpotQA-format records (`_id`, `question`, `answer`, ...).
        eval_dataset (`datasets.Dataset` or `list[dict]`, *optional*):
            Records for `evaluate()`, played greedily once each.
        env_factory (`Callable[[], MemoryAgentEnv]`):
            Makes one fresh environment per episode, e.g. `HotpotQAEnv.factory(corpus=...)`.
        processing_class (`PreTrainedTokenizerBase`, *optional*):
            The tokenizer (with a chat template); loaded from `model` when it is a string.
        teacher_processing_class (`PreTrainedTokenizerBase`, *optional*):
            The teacher's tokenizer, only to check that it equals the student's.
        callbacks (`list[TrainerCallback]`, *optional*):
            Extra callbacks.
        optimizers (`tuple`, *optional*, defaults to `(None, None)`):
            Optimizer and scheduler, as in `transformers.Trainer`.
        peft_config (`peft.PeftConfig`, *optional*):
            When given, the student is wrapped with it (e.g. LoRA) and only the adapters train.

    Example:

    ```python
    >>> from memopd_trl import HotpotQAEnv, MemOPDConfig, MemOPDTrainer
    >>> trainer = MemOPDTrainer(
    ...     model="Qwen/Qwen2.5-3B-Instruct",
    ...     teacher_model="Qwen/Qwen2.5-7B-Instruct",
    ...     args=MemOPDConfig(output_dir="memopd-hotpot"),
    ...     train_dataset=records,
    ...     env_factory=HotpotQAEnv.factory(corpus=corpus),
    ... )
    >>> trainer.train()
    ```
    """

    _tag_names = ["trl", "memopd"]
    _name = "MemOPD"
    _paper = _PAPER

    def __init__(
        self,
        model: "str | PreTrainedModel",
        teacher_model: "str | PreTrainedModel | None" = None,
        args: MemOPDConfig | None = None,
        train_dataset: "Dataset | list[dict] | None" = None,
        eval_dataset: "Dataset | list[dict] | None" = None,
        env_factory: Callable[[], Any] | None = None,
        processing_class: PreTrainedTokenizerBase | None = None,
        teacher_processing_class: PreTrainedTokenizerBase | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple = (None, None),
        peft_config: "PeftConfig | None" = None,
    ):
        # Paths may come as `os.PathLike`; the loading code below expects strings.
        model = os.fspath(model) if isinstance(model, os.PathLike) else model
        teacher_model = os.fspath(teacher_model) if isinstance(teacher_model, os.PathLike) else teacher_model
        model_id = model if isinstance(model, str) else model.config._name_or_path
        if args is None:
            args = MemOPDConfig(output_dir=f"{Path(model_id).name or 'model'}-MemOPD")
        if args.use_vllm:
            _check_vllm_support(args)
        if env_factory is None or not callable(env_factory):
            raise ValueError(
                "`env_factory` is required: a zero-argument callable making one environment per episode, e.g. "
                "`HotpotQAEnv.factory(corpus=...)`."
            )
        if train_dataset is None:
            raise ValueError("`train_dataset` is required: HotpotQA-format records to play episodes on.")
        train_dataset = _as_dataset(train_dataset, "train_dataset")
        eval_dataset = _as_dataset(eval_dataset, "eval_dataset") if eval_dataset is not None else None

        # Student and tokenizer
        if isinstance(model, str):
            model = _load_model(model, args.model_init_kwargs, args.attn_implementation, args)
        if processing_class is None:
            processing_class = AutoTokenizer.from_pretrained(model_id, trust_remote_code=args.trust_remote_code)
        if processing_class.pad_token is None:
            if processing_class.eos_token is None:
                raise ValueError(
                    f"The tokenizer ({type(processing_class).__name__}) has neither a pad token nor an EOS token: the "
                    "packed rows need a pad token and generation needs an EOS token to stop. Set "
                    "`tokenizer.eos_token` (e.g. the chat template's end-of-turn token, such as '<|im_end|>'), and "
                    "`tokenizer.pad_token` if it should differ from it."
                )
            processing_class.pad_token = processing_class.eos_token
        if not getattr(processing_class, "chat_template", None):
            raise ValueError(
                "The tokenizer has no chat template; the environment speaks chat messages. Set "
                "`tokenizer.chat_template` (e.g. from the model family's instruct tokenizer) and try again."
            )
        if peft_config is not None:
            if not is_peft_available():
                raise ImportError("`peft_config` was given but peft is not installed: `pip install peft`.")
            model = get_peft_model(model, peft_config)

        # Teacher
        if teacher_model is None:
            teacher_model = args.teacher_model_name_or_path
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
        # For the model card: what the student and the teacher were loaded from ("" for a model built from a config).
        self._student_name = model_id
        self._teacher_name = teacher_model if isinstance(teacher_model, str) else None
        if teacher_model is not None and not isinstance(teacher_model, str):
            self._teacher_name = getattr(teacher_model.config, "_name_or_path", "")
        if isinstance(teacher_model, str):
            if teacher_processing_class is None:
                teacher_processing_class = AutoTokenizer.from_pretrained(
                    teacher_model, trust_remote_code=args.trust_remote_code
                )
            teacher_model = _load_model(
                teacher_model,
                args.teacher_model_init_kwargs,
                args.teacher_attn_implementation or args.attn_implementation,
                args,
            )
        self.vocab_size = len(processing_class)
        _check_shared_vocabulary(model, teacher_model, processing_class, teacher_processing_class)

        if args.disable_dropout:
            disable_dropout_in_model(model)
            if teacher_model is not None:
                disable_dropout_in_model(teacher_model)

        env_factory = _apply_env_overrides(env_factory, args)
        _check_one_batch_fits(train_dataset, args)
        _validate_records(env_factory, train_dataset, "train_dataset")
        if eval_dataset is not None:
            _validate_records(env_factory, eval_dataset, "eval_dataset")
        _check_logit_transforms(model, teacher_model)
        _warn_low_precision_weights(model, args)
        self.env_factory = env_factory
        self._metrics: dict[str, dict[str, list[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._buffers: dict[int, dict[str, Any]] = {}  # rollout batch of each gradient-accumulation slot
        self._loss_sums: defaultdict[str, float] = defaultdict(float)  # loss terms of this batch, over its rows
        self._diagnostics: list[tuple[dict[str, torch.Tensor], torch.Tensor]] = []  # per row, with `rewarded`
        self._micro_step: int | None = None

        super().__init__(
            model=model,
            args=args,
            data_collator=identity,  # the records go to the rollout as they are
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        self._forward_redirection = _ForwardRedirection()
        self._update_skipper = _UpdateSkipper(self)
        self.add_callback(self._update_skipper)
        self.add_callback(_ClearValueHeadGradients(self))
        self._preemption = _SaveOnSigterm(self)
        self.add_callback(self._preemption)

        self.teacher_model = None
        if teacher_model is not None:
            teacher_model.requires_grad_(False)
            # A full copy per process, or sharded as the student is (FSDP2, ZeRO-3).
            self.teacher_model = prepare_frozen_model(teacher_model, self.accelerator)

        self.ref_model = None
        if args.kl_coef > 0 and not _is_peft(self.model):
            self.ref_model = self._load_reference(self.accelerator.unwrap_model(self.model))

        self.value_head = None
        if args.advantage_estimator == "gae":
            hidden = self.accelerator.unwrap_model(self.model).config.get_text_config().hidden_size
            self.value_head = nn.Linear(hidden, 1).to(self.accelerator.device)
            nn.init.zeros_(self.value_head.weight)
            nn.init.zeros_(self.value_head.bias)

        # Shared-prefix packing where every model that scores the student's batch can attend over a tree.
        scorers = [self.model] + ([self.teacher_model] if self.teacher_model is not None else [])
        self.share_prefix = args.share_prefix and all(
            self.accelerator.unwrap_model(m).config._attn_implementation in TREE_ATTENTION_IMPLEMENTATIONS
            for m in scorers
        )
        if args.share_prefix and not self.share_prefix:
            logger.info(
                "share_prefix: packing whole invocations, because not every scoring model runs one of %s attention.",
                TREE_ATTENTION_IMPLEMENTATIONS,
            )
        # Each row is forwarded on its own (`_forward_rows`): the budget bounds the tokens of one forward.
        row_budget = args.max_tokens_per_row
        self.collator = PackedInvocationCollator(
            max_tokens_per_row=row_budget,
            pad_token_id=processing_class.pad_token_id,
            max_model_length=_max_length(self.model),
            share_prefix=self.share_prefix,
        )
        self.teacher_collator = PackedInvocationCollator(
            max_tokens_per_row=row_budget,
            pad_token_id=processing_class.pad_token_id,
            max_model_length=(
                _max_length(self.accelerator.unwrap_model(self.teacher_model)) if self.teacher_model is not None else None
            ),
            history=args.teacher_scoring,
            share_prefix=self.share_prefix,
        )
        # The live alignment audit scores the aligned teacher's actions again under the persistent history.
        self.audit_collator = None
        self._audited: tuple[int | None, int | None] = (None, None)  # (audit period, step) of the last audit
        if self.teacher_model is not None and args.teacher_scoring == "aligned" and args.audit_steps > 0:
            self.audit_collator = PackedInvocationCollator(
                max_tokens_per_row=row_budget,
                pad_token_id=processing_class.pad_token_id,
                max_model_length=self.teacher_collator.max_model_length,
                history="persistent",
                share_prefix=self.share_prefix,
            )
        # With vLLM, TRL's `VLLMGeneration` owns the engine (built from the student's checkpoint, colocated on this
        # process's GPU) and its weight sync; the rollout engine generates with its `vllm.LLM`.
        self.vllm_generation = None
        self._vllm_synced_step: int | None = None  # `global_step` of the weights in the vLLM engine (None: unknown)
        if args.use_vllm:
            # Imported here, not at the top: with vLLM installed this module imports it, and a vLLM version TRL does
            # not support must not break `import memopd_trl` for runs that do not use vLLM.
            from trl.generation.vllm_generation import VLLMGeneration

            self.vllm_generation = VLLMGeneration(
                model=self.model,
                accelerator=self.accelerator,
                processing_class=processing_class,
                mode="colocate",
                gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                max_model_length=args.vllm_max_model_length or args.max_prompt_length + args.max_new_tokens,
                enable_sleep_mode=args.vllm_enable_sleep_mode,
                trust_remote_code=args.trust_remote_code,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                max_completion_length=args.max_new_tokens,
            )
        # Both models generate with whole weights (gathered when sharded: `_play`, `_teacher_play`), so decoding runs
        # no collective: processes may sample different numbers of tokens and play different numbers of turns.
        # (transformers would otherwise sync every decoding step across processes under FSDP / ZeRO-3, and a process
        # whose episodes ended sooner would leave the others waiting.)
        generation = dict(
            tokenizer=processing_class, env_factory=env_factory, max_new_tokens=args.max_new_tokens,
            max_prompt_length=args.max_prompt_length, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            generation_kwargs={"synced_gpus": False},
        )  # fmt: skip
        self.rollout_engine = RolloutEngine(
            model=self.accelerator.unwrap_model(self.model),
            backend="vllm" if args.use_vllm else "hf",
            vllm_llm=self.vllm_generation.llm if args.use_vllm else None,
            **generation,
        )
        self.teacher_engine = None  # plays `teacher_generations` episodes per question (always the HF backend)
        if args.teacher_generations > 0:
            self.teacher_engine = RolloutEngine(model=self.accelerator.unwrap_model(self.teacher_model), **generation)

    # ------------------------------------------------------------------------------------------------------------
    # Set-up helpers
    # ------------------------------------------------------------------------------------------------------------
    def _load_reference(self, student: PreTrainedModel) -> nn.Module:
        # A copy, not a model rebuilt from the config: under ZeRO-3 transformers builds models from configs partitioned
        # (`zero.Init`), and a partitioned model cannot load a whole state dict. The student is not prepared yet.
        reference = copy.deepcopy(student)
        reference.requires_grad_(False)
        return prepare_frozen_model(reference, self.accelerator)

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        # FSDP on CPU processes (which accelerate would quietly replace by DDP), or an error where the strategy asked
        # for cannot run.
        check_strategy(self.accelerator, self.args)
        self.is_fsdp_enabled = getattr(self.accelerator.state, "fsdp_plugin", None) is not None

    @property
    def num_skipped_updates(self) -> int:
        """Optimizer updates skipped so far (see `_UpdateSkipper`)."""
        return self._update_skipper.num_skipped

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """
        `transformers.Trainer.train`, with three differences:

        - `resume_from_checkpoint=True` resumes from the last *complete* checkpoint of `args.output_dir` (one whose
          `trainer_state.json`, written last, is there and readable); a newer checkpoint cut short by a kill is
          skipped with a warning, and with only such checkpoints training starts from the beginning.
        - SIGTERM (a cluster's preemption) during training finishes the current optimizer step, saves a checkpoint
          and exits with status 0 (`SystemExit(0)`); `resume_from_checkpoint=True` then continues exactly.
        - A run whose every optimizer update was skipped (every batch had nothing to learn from, or a non-finite
          loss) raises a `RuntimeError`: it changed nothing and must not look like a success. The checkpoints and
          logs it wrote stay.
        """
        if resume_from_checkpoint is True:
            resume_from_checkpoint = _last_complete_checkpoint(self.args.output_dir)
        skipper = self._update_skipper
        votes, skipped = skipper.num_votes, skipper.num_skipped
        self._preemption.reset()
        with _sigterm_requests(self._preemption):
            output = super().train(resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs)
        if self._preemption.saved_step is not None:
            logger.warning(
                f"SIGTERM: stopped after step {self._preemption.saved_step} and saved checkpoint-"
                f"{self._preemption.saved_step} in {self.args.output_dir}; exiting with status 0. Resume with "
                "`trainer.train(resume_from_checkpoint=True)`."
            )
            raise SystemExit(0)
        votes, skipped = skipper.num_votes - votes, skipper.num_skipped - skipped
        if votes > 0 and skipped == votes:
            raise RuntimeError(
                f"Every optimizer update of this run was skipped ({skipped} of {votes}): the weights did not change. "
                f"The last reason: {skipper.last_reason}. Look for failed episodes (`failed_episodes`, "
                "`rollout/failed_episodes` in the logs, warnings of the `memopd_trl.rollout` logger) or non-finite "
                "scores."
            )
        return output

    def _get_train_sampler(self, train_dataset=None) -> torch.utils.data.Sampler:
        # The questions of one optimizer step (all processes, all gradient-accumulation micro-batches) are yielded
        # `num_iterations` times in a row; each micro-batch is rolled out on its first occurrence and the
        # following updates reuse it (see `_prepare_inputs`).
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        args = self.args
        return RepeatSampler(
            data_source=dataset,
            mini_repeat_count=1,
            batch_size=args.per_device_train_batch_size * self.accelerator.num_processes * args.gradient_accumulation_steps,
            repeat_count=self.args.num_iterations,
            shuffle=True,
            seed=self.args.seed,
        )

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model) if model is not None else super().create_optimizer()
        if self.value_head is not None:
            optimizer.add_param_group({"params": list(self.value_head.parameters()), "weight_decay": 0.0})
        return optimizer

    # ------------------------------------------------------------------------------------------------------------
    # One training step
    # ------------------------------------------------------------------------------------------------------------
    def _rollout_and_score(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """Steps 1-4 for one micro-batch of records (once per rollout: with `num_iterations > 1` later updates reuse it)."""
        accumulation = self.args.gradient_accumulation_steps
        if self._micro_step is None:  # first call of this run (or of a resumed run)
            self._micro_step = self.state.global_step * accumulation
        slot = self._micro_step % accumulation
        first_update_of_round = (self._micro_step // accumulation) % self.args.num_iterations == 0
        if first_update_of_round or slot not in self._buffers:
            rollout = self._rollout(records)  # 1. play episodes
            self._buffers[slot] = self._score(rollout)  # 2-4. pack, advantages, teacher and reference scoring
            if self.teacher_engine is not None and "skip_reason" not in self._buffers[slot]:
                self._buffers[slot]["teacher_play"] = self._teacher_play(records, rollout.invocations)
            self._log_rollout(rollout, self._buffers[slot])
        self._micro_step += 1
        return self._buffers[slot]

    def _rollout(self, records: list[dict[str, Any]]) -> "_Rollout":
        """Step 1: the student plays `num_generations` sampled episodes per record, every model call recorded."""
        start = time.perf_counter()
        episodes, stats = self._play(records, greedy=False)
        return _Rollout(episodes, stats, {"rollout": time.perf_counter() - start})

    def _score(self, rollout: "_Rollout") -> dict[str, Any]:
        """
        Steps 2-4 on one rollout: pack the invocations, compute the advantages, score the actions with the teacher
        (and the reference model for the KL term). Returns the inputs of `compute_loss`; their per-token tensors are
        `(N,)`, in the canonical action order of the packed batch.
        """
        args, device = self.args, self.accelerator.device
        invocations = rollout.invocations
        if not self._every_process_has(bool(invocations)):
            # Every episode failed before its first model call (e.g. prompts that cannot fit): nothing to learn from.
            # With sharded weights every forward is collective, so every process skips when one has nothing.
            if invocations:
                return {"skip_reason": "Another process's batch reached no model call (sharded weights: all skip)"}
            return {"skip_reason": f"No episode of this batch reached a model call ({rollout.stats})"}

        # 2. pack: every invocation rebuilt as its own sequence, whole invocations packed into rows; each row is
        # forwarded on its own (bounded activations)
        student_batch = send_to_device(self.collator(invocations), device)
        student_rows = self._forward_rows(student_batch)
        batch: dict[str, Any] = {
            "student_batch": student_batch,
            "student_rows": student_rows,
            "sequence_ids": torch.repeat_interleave(
                torch.arange(len(invocations)), torch.tensor([len(inv.output_ids) for inv in invocations])
            ).to(device),  # (N,)
            "old_logprobs": torch.tensor(
                [lp for inv in invocations for lp in inv.logprobs], dtype=torch.float32, device=device
            ),  # (N,)
        }

        # 3. advantages, one per action token
        batch.update(self._compute_advantages(rollout.episodes, student_rows))
        tokens_per_episode = [sum(len(inv.output_ids) for inv in ep.invocations) for ep in rollout.episodes]
        rewarded = torch.tensor([ep.reward > 0 for ep in rollout.episodes])
        batch["rewarded"] = broadcast_to_tokens(rewarded, tokens_per_episode).to(device)  # (N,), for the diagnostics

        # 4. teacher scoring: hidden states at every action position, aligned (same rows) or persistent history
        start = time.perf_counter()
        if self.teacher_model is not None and (args.distill_coef > 0 or args.sampled_kl_coef > 0):
            teacher_rows = student_rows
            if args.teacher_scoring == "persistent":
                teacher_rows = self._forward_rows(send_to_device(self.teacher_collator(invocations), device))
            teacher = self.accelerator.unwrap_model(self.teacher_model)
            with torch.no_grad():
                batch["teacher_hidden"] = self._row_hidden_states(teacher, teacher_rows)  # (N, H_teacher)
                if args.sampled_kl_coef > 0 or args.distill_until_divergence > 0:
                    # The teacher's log-prob of each sampled token at the sampling temperature, as `old_logprobs`.
                    teacher_logprobs = self._sampled_token_logprobs(teacher, batch["teacher_hidden"], student_batch)
                if args.distill_until_divergence > 0:
                    segments = batch["sequence_ids"]  # each action on its own
                    if args.distill_divergence_scope == "episode":
                        segments = broadcast_to_tokens(torch.arange(len(rollout.episodes)), tokens_per_episode)
                    batch["distill_mask"] = until_first_divergence(
                        teacher_logprobs, segments.to(device), args.distill_until_divergence
                    )  # (N,)
                    self._metrics["train"]["distill/kept_tokens"].append(batch["distill_mask"].float().mean().item())
                if args.sampled_kl_coef > 0:
                    token_rewards = sampled_kl_advantages(teacher_logprobs, batch["old_logprobs"])  # (N,)
                    batch["advantages"] = batch["advantages"] + args.sampled_kl_coef * token_rewards
                    self._metrics["train"]["distill/sampled_reverse_kl"].append(-token_rewards.mean().item())
        rollout.seconds["teacher"] = time.perf_counter() - start
        if "teacher_hidden" in batch and self.audit_collator is not None and self._audit_due():
            start = time.perf_counter()
            self._audit_alignment(invocations, batch["teacher_hidden"])
            rollout.seconds["audit"] = time.perf_counter() - start
        if args.kl_coef > 0:
            start = time.perf_counter()
            with torch.no_grad(), self._reference_model() as reference:
                ref_hidden = self._row_hidden_states(reference, student_rows)  # (N, H)
                batch["ref_logprobs"] = self._sampled_token_logprobs(reference, ref_hidden, student_batch)  # (N,)
            rollout.seconds["reference"] = time.perf_counter() - start
        return batch

    def _teacher_play(self, records: list[dict[str, Any]], rollout_invocations: list[Invocation]) -> dict[str, Any] | None:
        """
        The teacher plays `teacher_generations` sampled episodes per record; returns their invocations, the
        teacher's hidden states at every action position (scored as `teacher_scoring` says, as the student's actions
        are), and `joint_rows`: the rollout's invocations then these, packed together for the student's forwards
        (`_student_loss`: a row can hold actions of both). `None` when no episode reached a model call. Collective.
        """
        args, device = self.args, self.accelerator.device
        start = time.perf_counter()
        with (
            unwrap_model_for_generation(self.teacher_model, self.accelerator) as teacher,  # ZeRO-3: gathered
            gathered_for_generation(teacher),  # FSDP2: gathered
        ):
            self.teacher_engine.model = teacher
            episodes, _ = self.teacher_engine.rollout(records, num_generations=args.teacher_generations, greedy=False)
        invocations = [inv for ep in episodes for inv in ep.invocations]
        metrics = self._metrics["train"]
        f1 = torch.tensor([sum(ep.f1 for ep in episodes) / max(len(episodes), 1)], device=device)
        metrics["teacher_play/f1"].append(self.accelerator.gather(f1).mean().item())
        play = None
        if self._every_process_has(bool(invocations)):
            collator = self.teacher_collator if args.teacher_scoring == "persistent" else self.collator
            teacher_rows = self._forward_rows(send_to_device(collator(invocations), device))
            with torch.no_grad():
                teacher = self.accelerator.unwrap_model(self.teacher_model)
                teacher_hidden = self._row_hidden_states(teacher, teacher_rows)  # (N_play, H_teacher)
            joint_rows = self._forward_rows(send_to_device(self.collator(rollout_invocations + invocations), device))
            play = {"invocations": invocations, "joint_rows": joint_rows, "teacher_hidden": teacher_hidden}
        metrics["time/teacher_play"].append(time.perf_counter() - start)
        return play

    def _sampled_token_logprobs(self, model: nn.Module, hidden: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
        """`(N,)`: the log-prob under `model`'s LM head on `hidden` of each sampled token, at the sampling temperature."""
        with gathered_lm_head(model, self.vocab_size) as (weight, bias):
            return action_logprobs_from_hidden(
                hidden,
                weight,
                bias,
                action_token_ids(batch),
                temperature=self.args.temperature,
                chunk_size=self.args.logit_chunk_size,
            )[0]

    def _audit_due(self) -> bool:
        """Whether this rollout is audited: the first rollout of every `audit_steps` steps (all its micro-batches)."""
        step = self.state.global_step
        period = step // self.args.audit_steps
        if period == self._audited[0] and step != self._audited[1]:
            return False
        self._audited = (period, step)
        return True

    def _audit_alignment(self, invocations: list[Invocation], aligned_hidden: torch.Tensor) -> None:
        """
        The live alignment audit (`audit_steps`): the teacher scores the same actions again under the flattened
        persistent history, and `misalignment/kl_turn_{k}` logs KL(teacher aligned || teacher persistent) at T=1,
        averaged over the action tokens of turn `k` (`misalignment/kl`: over all of them). Episodes whose flattened
        history the teacher cannot take (longer than its context, or missing `observation_ids`) are left out.
        """
        limit = self.audit_collator.max_model_length or float("inf")
        episodes: dict[int, list[int]] = defaultdict(list)  # episode id -> indices into `invocations`
        for i, inv in enumerate(invocations):
            episodes[inv.episode_id].append(i)
        offsets = torch.tensor([0, *itertools.accumulate(len(inv.output_ids) for inv in invocations)])
        kept, tokens = [], []  # the invocations audited, and the canonical index of each of their action tokens
        for indices in episodes.values():
            episode = [invocations[i] for i in indices]
            history = len(episode[0].input_ids) + sum(len(inv.output_ids) for inv in episode)
            history += sum(len(inv.observation_ids or []) for inv in episode[:-1])
            if history > limit or any(inv.observation_ids is None for inv in episode[:-1]):
                continue
            kept.extend(indices)
            tokens.extend(torch.arange(int(offsets[i]), int(offsets[i + 1])) for i in indices)
        audited = [invocations[i] for i in kept]
        if not self._every_process_has(sum(len(inv.output_ids) for inv in audited) > 0):
            return
        tokens = torch.cat(tokens)  # (N_audited,)
        device = self.accelerator.device
        teacher = self.accelerator.unwrap_model(self.teacher_model)
        with torch.no_grad():
            persistent_rows = self._forward_rows(send_to_device(self.audit_collator(audited), device))
            persistent_hidden = self._row_hidden_states(teacher, persistent_rows)  # (N_audited, H), order of `audited`
        with torch.no_grad(), gathered_lm_head(teacher, self.vocab_size) as (weight, bias):
            kl = chunked_generalized_jsd(
                persistent_hidden,
                weight,
                aligned_hidden[tokens.to(device)],
                weight,
                beta=0.0,  # KL(teacher aligned || teacher persistent)
                student_bias=bias,
                teacher_bias=bias,
                chunk_size=self.args.logit_chunk_size,
            ).cpu()  # (N_audited,)
        turns = torch.repeat_interleave(
            torch.tensor([inv.turn for inv in audited]), torch.tensor([len(inv.output_ids) for inv in audited])
        )  # (N_audited,)
        metrics = self._metrics["train"]
        metrics["misalignment/kl"].append(kl.mean().item())
        for turn in turns.unique().tolist():
            metrics[f"misalignment/kl_turn_{turn}"].append(kl[turns == turn].mean().item())

    def _compute_advantages(self, episodes: list[Episode], student_rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """
        Step 3: the advantage of every action token, `(N,)` in canonical order (episode by episode, then invocation
        and token order), from the episodes' final rewards.

        - `"group"`: each episode's reward normalized within its group (the episodes of one question), on all its
          tokens.
        - `"gae"`: the value head scores every action token; the episodes, padded to one `(num_episodes, T)` batch with
          the final reward on each one's last token, go through `gae_advantages` at once. Also returns the `returns`
          (value targets) and `old_values` (the values now, for the clipped value loss).
        """
        args, device = self.args, self.accelerator.device
        rewards = torch.tensor([ep.reward for ep in episodes], dtype=torch.float32)  # (E,)
        tokens_per_episode = torch.tensor([sum(len(inv.output_ids) for inv in ep.invocations) for ep in episodes])
        if args.advantage_estimator == "group":
            group_ids = torch.tensor([ep.group_id for ep in episodes])
            advantages = group_normalized_advantages(rewards, group_ids, scale=args.scale_rewards)  # (E,)
            return {"advantages": broadcast_to_tokens(advantages, tokens_per_episode).to(device)}

        with torch.no_grad():
            hidden = self._row_hidden_states(self.accelerator.unwrap_model(self.model), student_rows)  # (N, H)
            values = self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float().cpu()  # (N,)
        width = int(tokens_per_episode.max())
        mask = torch.arange(width) < tokens_per_episode[:, None]  # (E, T): the action tokens of each episode
        padded_values = torch.zeros(mask.shape).masked_scatter(mask, values)  # (E, T)
        last_token = (tokens_per_episode - 1).clamp(min=0)
        token_rewards = torch.zeros(mask.shape)  # (E, T): the final reward on each episode's last action token
        token_rewards[torch.arange(len(episodes)), last_token] = torch.where(tokens_per_episode > 0, rewards, 0.0)
        advantages, returns = gae_advantages(token_rewards, padded_values, gamma=args.gamma, lam=args.lam, mask=mask)
        return {
            "advantages": advantages[mask].to(device),  # (N,): row-major order over the mask is canonical order
            "returns": returns[mask].to(device),  # (N,)
            "old_values": values.to(device),  # (N,)
        }

    def _forward_rows(self, batch: dict[str, Any]) -> list[dict[str, Any]]:
        """
        The rows of a packed batch, each forwarded on its own (`split_rows`): a forward holds at most one row's tokens
        (`max_tokens_per_row`), so activations stay bounded however large the batch. With sharded weights every
        forward (and the LM heads' gathering in the loss) is collective, so every process runs as many rows as the
        process with the most: the others get rows of one padding token and no action, which go through the same
        code. Collective then.
        """
        num_rows = None
        if is_sharded(self.accelerator) and self.accelerator.num_processes > 1:
            count = torch.tensor([batch["input_ids"].shape[0]], device=self.accelerator.device)
            num_rows = int(self.accelerator.gather(count).max())
        return split_rows(batch, num_rows, self.processing_class.pad_token_id)

    def _row_hidden_states(self, model: nn.Module, rows: list[dict[str, Any]]) -> torch.Tensor:
        """`(N, H)`: the hidden states at every action position of a batch forwarded row by row, in canonical order."""
        parts = [(row["action_index"], action_hidden_states(model, row)) for row in rows]
        hidden = parts[0][1].new_empty(sum(len(index) for index, _ in parts), parts[0][1].shape[-1])
        for index, part in parts:
            hidden[index] = part
        return hidden

    def _every_process_has(self, flag: bool) -> bool:
        """
        `flag` on this process, or, with sharded weights (FSDP, ZeRO-3), on every process (collective): there every
        forward is collective, so a forward that one process would skip is skipped by all.
        """
        if not is_sharded(self.accelerator):
            return flag
        return all_processes_agree(self.accelerator, flag)

    @contextmanager
    def _reference_model(self) -> Iterator[nn.Module]:
        """The model of the KL term: the frozen copy of the student's start, or a PEFT student with its adapters off."""
        if self.ref_model is not None:
            yield self.accelerator.unwrap_model(self.ref_model)
            return
        student = self.accelerator.unwrap_model(self.model)
        with use_adapter(student, adapter_name=None):
            yield student

    def _play(self, records: list[dict[str, Any]], greedy: bool) -> tuple[list[Episode], dict[str, float]]:
        """
        Play `records` with the current student: `num_generations` sampled episodes each, or one greedy episode.

        Every process must call it at the same point, even with no records: gathering the student's weights for
        generation (DeepSpeed ZeRO-3, FSDP2, vLLM weight sync) is collective.

        Returns:
            `tuple[list[Episode], dict[str, float]]`: the episodes and the rollout statistics of
            `RolloutEngine.rollout`.
        """
        num_generations = 1 if greedy else self.args.num_generations
        if self.vllm_generation is not None:
            return self._play_with_vllm(records, num_generations, greedy)
        start = time.perf_counter()
        with (
            unwrap_model_for_generation(self.model_wrapped, self.accelerator) as unwrapped,
            gathered_for_generation(unwrapped),  # FSDP2: decoding on shards would make every token collective
        ):
            if is_sharded(self.accelerator):  # the cost of gathering the student for this rollout
                self._metrics["train" if not greedy else "eval"]["time/rollout_gather"].append(
                    time.perf_counter() - start
                )
            was_training = unwrapped.training
            unwrapped.eval()
            self.rollout_engine.model = unwrapped
            try:
                return self.rollout_engine.rollout(records, num_generations=num_generations, greedy=greedy)
            finally:
                unwrapped.train(was_training)

    def _play_with_vllm(
        self, records: list[dict[str, Any]], num_generations: int, greedy: bool
    ) -> tuple[list[Episode], dict[str, float]]:
        """
        `_play` through the vLLM engine, after pushing the student's weights into it if they changed since the last
        push (or were never pushed: the engine starts from the checkpoint on disk, not the in-memory student).

        Returns:
            `tuple[list[Episode], dict[str, float]]`: as `_play`.
        """
        generation = self.vllm_generation
        if self._vllm_synced_step != self.state.global_step:
            generation.sync_weights()  # collective: every process calls it (merges PEFT adapters, gathers shards)
            self._vllm_synced_step = self.state.global_step
        if not self.args.vllm_enable_sleep_mode:
            return self.rollout_engine.rollout(records, num_generations=num_generations, greedy=greedy)
        # `sync_weights` woke the weights; the KV cache is only needed while the rollout runs.
        generation.llm.wake_up(tags=["kv_cache"])
        try:
            return self.rollout_engine.rollout(records, num_generations=num_generations, greedy=greedy)
        finally:
            # Level 2 discards the weights as well, so the next rollout must push them again.
            generation.llm.sleep(level=2)
            self._vllm_synced_step = None

    def training_step(self, model: nn.Module, inputs, num_items_in_batch=None) -> torch.Tensor:
        """
        One micro-batch: the rollout and its scoring (`_prepare_inputs`), then the student's forward and backward
        passes, one per packed row (`_loss_pieces`). Every row is a `transformers.Trainer.training_step` of its own
        (loss scaling, `accelerator.backward`), and the rows' gradients add up to the gradient of the whole batch's
        loss: each row's loss carries its share of every batch-level mean. The gradient reduction across processes
        (DDP, FSDP2, DeepSpeed) waits for the last row, as it would for the last micro-batch of an accumulation.
        """
        model.train()
        pieces = self._loss_pieces(self._prepare_inputs(inputs))
        loss = None
        for k, piece in enumerate(pieces):
            with nullcontext() if k == len(pieces) - 1 else self._deferred_gradient_sync(model):
                piece_loss = super().training_step(model, piece, num_items_in_batch)
            loss = piece_loss if loss is None else loss + piece_loss
        self._log_loss_sums()
        return loss

    @contextmanager
    def _deferred_gradient_sync(self, model: nn.Module) -> Iterator[None]:
        """No gradient reduction across processes for the backward passes inside (all rows of a batch but its last)."""
        accelerator = self.accelerator
        sync = accelerator.sync_gradients
        if accelerator.num_processes == 1:
            yield
        elif accelerator.distributed_type == DistributedType.DEEPSPEED:
            # `accelerator.backward` tells the engine it is not at an accumulation boundary: no reduction, no step.
            accelerator.gradient_state._set_sync_gradients(False)
            try:
                yield
            finally:
                accelerator.gradient_state._set_sync_gradients(sync)
        elif accelerator.is_fsdp2:
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(sync)  # as the accumulation around this micro-batch wants it
        else:
            with accelerator.no_sync(model):
                yield

    def _prepare_inputs(self, inputs):
        if isinstance(inputs, _LossPiece):  # `transformers.Trainer.training_step` on one row of a prepared batch
            return inputs
        return self._rollout_and_score(inputs)

    def _loss_pieces(self, batch: dict[str, Any]) -> list["_LossPiece"]:
        """
        The student's forward and backward passes of one batch: one piece per packed row (of the joint rows when the
        teacher plays too), each with the batch-level counts that its loss terms are shares of. A batch that is
        skipped is one piece with no row.
        """
        if "skip_reason" in batch:
            return [_LossPiece(batch, None)]
        play = batch.get("teacher_play")
        rows = batch["student_rows"] if play is None else play["joint_rows"]
        num_actions = len(batch["old_logprobs"])
        kept = int(batch["distill_mask"].sum()) if "distill_mask" in batch else num_actions
        counts = {
            "actions": num_actions,
            "sequences": int(batch["sequence_ids"].unique().numel()),
            "distilled": kept + (len(play["teacher_hidden"]) if play is not None else 0),
            "play": len(play["teacher_hidden"]) if play is not None else 0,
        }
        return [_LossPiece(batch, row, counts) for row in rows]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("MemOPDTrainer does not return model outputs from `compute_loss`.")
        start = time.perf_counter()
        reason = inputs.batch.get("skip_reason")
        if reason is None:
            unwrapped = self.accelerator.unwrap_model(model)
            # Route the student forward through the wrapper (DDP/FSDP) so gradient synchronization hooks fire.
            loss = self._forward_redirection(model, unwrapped, self._student_loss, unwrapped, inputs)
            self._loss_sums["time/actor"] += time.perf_counter() - start
            if torch.isfinite(loss):
                return loss
            # A NaN/inf (teacher or student log-probs, an overflow) would poison the weights.
            reason = f"Non-finite loss ({loss.item()})"
            self._update_skipper.request(f"{reason} at step {self.state.global_step}")
            if is_sharded(self.accelerator):
                # The backward must still run through the sharded model's hooks, whose gradient reduction is
                # collective; the vote drops the gradients before the optimizer step.
                return torch.nan_to_num(loss, nan=0.0, posinf=0.0, neginf=0.0) * 0.0
            return self._idle_loss(model)
        self._update_skipper.request(f"{reason} at step {self.state.global_step}")
        return self._idle_loss(model)

    def _idle_loss(self, model: nn.Module) -> torch.Tensor:
        """
        A zero loss for an update that is skipped. This process still runs a backward pass, because the others'
        gradients are reduced with its own (their batches may be fine). Under DDP a sum over every trained parameter
        gives each a (zero) gradient, so the reducer joins the same all-reduce as the other processes. With sharded
        weights the parameters are shards outside a forward, so a one-token forward gives the zero gradients and runs
        the same collectives as the others' forward and backward (every process skips there together).
        """
        if not is_sharded(self.accelerator):
            return sum(p.sum() for p in model.parameters() if p.requires_grad) * 0.0
        token = torch.full((1, 1), self.processing_class.pad_token_id, dtype=torch.long, device=self.accelerator.device)
        return model(input_ids=token, use_cache=False).logits.sum() * 0.0

    def _student_loss(self, model: nn.Module, piece: "_LossPiece") -> torch.Tensor:
        """
        Step 5 on one row: the student forward and this row's share of the loss, from the inputs `_score` made.

        Every term of the loss is a mean over the batch (tokens, sequences, distilled tokens); a row's term is its own
        mean times the share of the batch it holds (`n_row / n`), so the rows' losses (and gradients) add up to the
        batch's, and one row is exactly the batch. The logged values are added up the same way (`_log_loss_sums`).
        """
        args, inputs, row, counts = self.args, piece.batch, piece.row, piece.counts
        # Canonical index of each action of the row, in the joint order: the rollout's actions, then (with teacher
        # play) the teacher's own episodes'.
        index = row["action_index"]
        num_actions = len(inputs["old_logprobs"])
        rollout = index < num_actions
        actions, play_actions = index[rollout], index[~rollout] - num_actions
        joint = action_hidden_states(model, row)  # (n_row, H)
        hidden, play_hidden = joint[rollout], joint[~rollout]
        share = len(actions) / counts["actions"]
        sums = self._loss_sums
        with gathered_lm_head(model, self.vocab_size) as (weight, bias):
            logprobs, entropy = action_logprobs_from_hidden(
                hidden,
                weight,
                bias,
                action_token_ids(row)[rollout],
                temperature=args.temperature,
                chunk_size=args.logit_chunk_size,
                return_entropy=True,
            )  # (n,), (n,)
            # Zero, but on the forward's graph: a row with no action (see `_forward_rows`) still runs the backward. Its
            # LM head is joined too: ZeRO-3 reduces each parameter's gradient, and expects every one on every process.
            loss = joint.sum() * 0.0
            if not len(index):
                loss = loss + sum(p.sum() * 0.0 for p in (weight, bias) if p is not None and p.requires_grad)
            if args.ppo_coef > 0:
                sequence_ids = inputs["sequence_ids"][actions]
                ppo, stats = ppo_clip_loss(
                    logprobs,
                    inputs["old_logprobs"][actions],
                    inputs["advantages"][actions],
                    epsilon=args.epsilon,
                    epsilon_high=args.epsilon_high,
                    sequence_ids=sequence_ids,
                    aggregation=args.loss_aggregation,
                )
                if args.loss_aggregation == "sequence_mean":  # a row holds whole sequences
                    ppo = ppo * (sequence_ids.unique().numel() / counts["sequences"])
                else:
                    ppo = ppo * share
                loss = loss + args.ppo_coef * ppo
                sums["loss/ppo"] += ppo.item()
                sums["clip_fraction"] += float(stats["clip_fraction"]) * share
                sums["approx_kl_old"] += float(stats["approx_kl"]) * share
            if "teacher_hidden" in inputs:
                teacher = self.accelerator.unwrap_model(self.teacher_model)
                with gathered_lm_head(teacher, self.vocab_size) as (teacher_weight, teacher_bias):
                    jsd = functools.partial(
                        chunked_generalized_jsd,
                        student_weight=weight,
                        teacher_weight=teacher_weight,
                        beta=args.beta,
                        temperature=args.distill_temperature,
                        student_bias=bias,
                        teacher_bias=teacher_bias,
                        chunk_size=args.logit_chunk_size,
                    )
                    if args.distill_coef > 0:
                        divergence = jsd(hidden, teacher_hidden=inputs["teacher_hidden"][actions])  # (n,)
                        if "distill_mask" in inputs:  # the tokens up to each action's first divergence
                            divergence = divergence[inputs["distill_mask"][actions]]
                        if counts["play"]:
                            play = inputs["teacher_play"]
                            play_divergence = jsd(play_hidden, teacher_hidden=play["teacher_hidden"][play_actions])
                            sums["loss/distill_teacher_play"] += play_divergence.sum().item() / counts["play"]
                            divergence = torch.cat([divergence, play_divergence])
                        distill = divergence.mean() if divergence.numel() else joint.new_zeros(())
                        distill = distill * (divergence.numel() / max(counts["distilled"], 1))
                        loss = loss + args.distill_coef * distill
                        sums["loss/distill"] += distill.item()
                    if args.distill_diagnostics and len(actions):
                        diagnostics = distillation_diagnostics(
                            hidden.detach(),
                            weight.detach(),
                            inputs["teacher_hidden"][actions],
                            teacher_weight,
                            student_bias=None if bias is None else bias.detach(),
                            teacher_bias=teacher_bias,
                            chunk_size=args.logit_chunk_size,
                        )  # each (n,)
                        self._diagnostics.append((diagnostics, inputs["rewarded"][actions]))
        if "ref_logprobs" in inputs:
            kl = kl_penalty(logprobs, inputs["ref_logprobs"][actions]).mean() * share if len(actions) else 0.0 * loss
            loss = loss + args.kl_coef * kl
            sums["kl_ref"] += kl.item()
        if self.value_head is not None:
            values = self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float()
            returns, old_values = inputs["returns"][actions], inputs["old_values"][actions]
            v_loss = value_loss(values, returns, old_values=old_values, clip=args.cliprange_value) * share
            loss = loss + args.vf_coef * v_loss
            sums["loss/value"] += v_loss.item()
        sums["entropy"] += entropy.mean().item() * share if entropy.numel() else 0.0
        return loss

    def _batch_loss(self, model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        """The loss of a whole scored batch, logged: the sum of its rows' losses (every row forwarded, no backward)."""
        loss = sum(self._student_loss(model, piece) for piece in self._loss_pieces(batch))
        self._log_loss_sums()
        return loss

    def _log_loss_sums(self) -> None:
        """Log the batch's loss terms, added up over its rows, and its distillation diagnostics over all its rows."""
        metrics = self._metrics["train"]
        for name, value in self._loss_sums.items():
            metrics[name].append(value)
        if self._diagnostics:
            names = self._diagnostics[0][0]
            diagnostics = {name: torch.cat([d[name] for d, _ in self._diagnostics]) for name in names}
            self._log_diagnostics(diagnostics, torch.cat([rewarded for _, rewarded in self._diagnostics]))
        self._loss_sums, self._diagnostics = defaultdict(float), []

    # ------------------------------------------------------------------------------------------------------------
    # Logging, evaluation, model card
    # ------------------------------------------------------------------------------------------------------------
    def _log_diagnostics(self, diagnostics: dict[str, torch.Tensor], rewarded: torch.Tensor) -> None:
        """`distill/{name}` over the action tokens of this update, and over those of rewarded / unrewarded episodes."""
        metrics = self._metrics["train"]
        for suffix, tokens in (("", slice(None)), ("_rewarded", rewarded), ("_unrewarded", ~rewarded)):
            for name, values in diagnostics.items():
                if values[tokens].numel():
                    metrics[f"distill/{name}{suffix}"].append(values[tokens].mean().item())

    def _episode_table(self, episodes: list[Episode]) -> tuple[list[str], torch.Tensor]:
        """
        The statistics of `episodes`, one row each, `(num_episodes, len(names))` on this process, and their names:
        `reward`, the environment's metrics (`Episode.metrics`, e.g. `f1`, `em`, in name order), `turns`,
        `malformed_actions`, `failed_episodes`.

        Collective: every process calls it, with any number of episodes (even none), and gets the same names.
        """
        local_names = sorted({name for ep in episodes for name in ep.metrics})
        metric_names = sorted(set().union(*gather_object([local_names])))
        names = ["reward", *metric_names, "turns", "malformed_actions", "failed_episodes"]
        rows = [
            [ep.reward, *(ep.metrics.get(name, 0.0) for name in metric_names), ep.num_turns, ep.num_malformed]
            + [float(ep.failed)]
            for ep in episodes
        ]
        table = torch.tensor(rows, dtype=torch.float32, device=self.accelerator.device).reshape(-1, len(names))
        return names, table

    def _log_rollout(self, rollout: "_Rollout", batch: dict[str, Any]) -> None:
        """Record the statistics of one rollout (and of its packed batch) for the next `log`. Collective."""
        metrics = self._metrics["train"]
        names, table = self._episode_table(rollout.episodes)
        gathered = self.accelerator.gather(table)  # (num_episodes of all processes, len(names))
        for i, name in enumerate(names):
            metrics[name].append(gathered[:, i].mean().item())
        metrics["reward_std"].append(gathered[:, 0].std().item() if len(gathered) > 1 else 0.0)
        invocations = rollout.invocations
        if invocations:
            metrics["context_tokens_per_invocation"].append(
                sum(len(inv.input_ids) for inv in invocations) / len(invocations)
            )
            metrics["action_tokens_per_invocation"].append(
                sum(len(inv.output_ids) for inv in invocations) / len(invocations)
            )
        if "student_batch" in batch:
            # Rows are forwarded one at a time, cut at their last token: no row padding, one forward per row.
            metrics["packing/rows"].append(float(batch["student_batch"]["input_ids"].shape[0]))
            # Share of the rebuilt tokens that shared-prefix packing did not lay out again.
            student_batch = batch["student_batch"]
            saved = student_batch.get("num_tokens_saved", 0)
            metrics["packing/shared_fraction"].append(saved / max(student_batch["num_real_tokens"] + saved, 1))
        for key in ("num_context_truncations", "num_failed_episodes", "num_prompt_too_long", "num_truncated_outputs"):
            if key in rollout.stats:
                metrics[f"rollout/{key.removeprefix('num_')}"].append(float(rollout.stats[key]))
        if rollout.stats.get("num_prompt_tokens"):
            # Share of the context tokens the rollout did not encode again (shared prompt prefill).
            shared = rollout.stats.get("num_shared_prefill_tokens", 0) / rollout.stats["num_prompt_tokens"]
            metrics["rollout/shared_prefill_fraction"].append(shared)
        for key, value in rollout.seconds.items():
            metrics[f"time/{key}"].append(value)
        generated = sum(len(inv.output_ids) for inv in invocations)
        if rollout.seconds.get("rollout"):
            metrics["rollout/tokens_per_second"].append(generated / rollout.seconds["rollout"])

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        averaged = {key: sum(v) / len(v) for key, v in self._metrics[mode].items() if v}
        if mode == "eval":
            averaged = {f"eval_{key}": value for key, value in averaged.items()}
        logs = {**logs, **averaged}
        super().log(logs, start_time)
        self._metrics[mode].clear()

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """
        Play one greedy episode per record of `eval_dataset` (or the trainer's) and report the means of the
        environment's metrics (for `HotpotQAEnv`: answer F1 and EM) and of the episodes' statistics.

        A failed episode (an environment error, a prompt too long for `max_prompt_length`) counts with reward and
        scores 0; `{prefix}_num_failed_episodes` says how many there were. When every episode failed nothing was
        scored, and `evaluate()` raises a `RuntimeError` naming the first error instead of reporting scores of 0.

        Returns:
            `dict[str, float]`: `{prefix}_{name}` for each name of `Episode.metrics` (`{prefix}_f1`, `{prefix}_em`
            for `HotpotQAEnv`), and `{prefix}_reward`, `{prefix}_turns`, `{prefix}_malformed_actions`,
            `{prefix}_num_episodes`, `{prefix}_num_failed_episodes`.
        """
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("`evaluate()` needs an `eval_dataset` (given here or to the trainer).")
        dataset = _as_dataset(dataset, "eval_dataset")
        if eval_dataset is not None:  # the trainer's own was checked at construction
            _validate_records(self.env_factory, dataset, "eval_dataset")
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        records = [dataset[i] for i in range(rank, len(dataset), world)]
        self.model.eval()
        episodes, _ = self._play(records, greedy=True)  # on every process, even without records (collectives)
        names, table = self._episode_table(episodes)
        # Sums and counts (same shape on every process, whatever the number of records each one played): the
        # statistics without `failed_episodes`, then the number of episodes, then the number of failed ones.
        local = torch.cat([table[:, :-1], torch.ones_like(table[:, :1]), table[:, -1:]], dim=1).sum(0)
        totals = self.accelerator.reduce(local, reduction="sum")
        count, failed = totals[-2].item(), totals[-1].item()
        if count > 0 and failed == count:  # on every process alike: the totals are reduced
            self.model.train()
            errors = [ep.info.get("error") or ep.info.get("end_reason") for ep in episodes if ep.failed]
            raise RuntimeError(
                f"`evaluate()` scored no episode: all {int(count)} episodes failed, so there is no "
                f"{metric_key_prefix} score to report."
                + (f" The first error on this process: {errors[0]}." if errors else "")
                + " See the warnings of the `memopd_trl.rollout` logger for each one."
            )
        count = max(1.0, count)
        metrics = {f"{metric_key_prefix}_{name}": totals[i].item() / count for i, name in enumerate(names[:-1])}
        metrics[f"{metric_key_prefix}_num_episodes"] = totals[-2].item()
        metrics[f"{metric_key_prefix}_num_failed_episodes"] = failed
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        self.model.train()
        return metrics

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """`transformers.Trainer.save_model`, and the model card (`README.md`) beside the weights."""
        super().save_model(output_dir, _internal_call)
        if not _internal_call and self.is_world_process_zero():
            target = output_dir or self.args.output_dir
            self.create_model_card(model_name=Path(target).name, output_dir=target)

    def create_model_card(
        self,
        model_name: str | None = None,
        dataset_name: str | None = None,
        tags: str | list[str] | None = None,
        output_dir: str | None = None,
    ):
        """
        Write the model card (`README.md`) into `output_dir` (defaults to `args.output_dir`): the student's base
        model, the teacher, the distillation and PPO settings, the action format and memory policy, and a snippet
        that plays one `HotpotQAEnv` episode with the saved agent. See `memopd_trl.model_card`.
        """
        if not self.is_world_process_zero():
            return
        target = output_dir or self.args.output_dir
        tags = {tags} if isinstance(tags, str) else set(tags or ())
        tags.update(self._tag_names)
        card = build_model_card(
            model_name=model_name or Path(target).name,
            model_path=self.hub_model_id or str(target),
            student_name=self._student_name,
            teacher_name=self._teacher_name,
            args=self.args,
            env=self.env_factory(),
            trainer_name=self._name,
            paper=self._paper,
            tags=sorted(tags),
            dataset_name=dataset_name,
            global_step=self.state.global_step,
        )
        os.makedirs(target, exist_ok=True)
        card.save(os.path.join(target, "README.md"))

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True, **kwargs):
        """
        `transformers.Trainer.push_to_hub`. When the Hub cannot be reached (no network, `HF_HUB_OFFLINE=1`), the
        model and its card are saved in `args.output_dir` and a `ConnectionError` says what failed and how to push
        them later.
        """
        try:
            return super().push_to_hub(commit_message=commit_message, blocking=blocking, **kwargs)
        except _network_errors() as err:
            self.save_model()  # the Hub is reached before anything is saved: keep the work
            repo = self.args.hub_model_id or Path(self.args.output_dir).absolute().name
            raise ConnectionError(
                f"push_to_hub could not reach the Hugging Face Hub ({type(err).__name__}: {err}). Nothing was "
                f"uploaded; the model and its card are saved in {self.args.output_dir!r}. Push them later, once "
                f"online (and without HF_HUB_OFFLINE=1), with `trainer.push_to_hub()`, or from a shell: "
                f"`hf upload {repo} {self.args.output_dir}`."
            ) from err

    def _save(self, output_dir: str | None = None, state_dict=None):
        super()._save(output_dir, state_dict)
        if self.value_head is not None:
            target = output_dir or self.args.output_dir
            save_file(self.value_head.state_dict(), os.path.join(target, VALUE_HEAD_FILE))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        path = os.path.join(resume_from_checkpoint, VALUE_HEAD_FILE)
        if self.value_head is not None and os.path.exists(path):
            self.value_head.load_state_dict(load_file(path, device=str(self.accelerator.device)))

    def _save_checkpoint(self, model, trial):
        if self.args.hub_model_id is None:
            model_name = Path(self.args.output_dir).name
        else:
            model_name = self.args.hub_model_id.split("/")[-1]
        self.create_model_card(model_name=model_name)
        super()._save_checkpoint(model, trial)


def _network_errors() -> tuple[type[BaseException], ...]:
    """What the Hub client raises when the Hub cannot be reached: `OfflineModeIsEnabled` and socket errors are
    `ConnectionError`s; the HTTP client's transport errors (connection, timeout, proxy) are its own."""
    errors: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module in ("httpx2", "httpx", "requests"):
        try:
            library = importlib.import_module(module)
        except ImportError:
            continue
        error = getattr(library, "TransportError", None) or getattr(library, "ConnectionError", None)
        if isinstance(error, type) and issubclass(error, BaseException):
            errors.append(error)
    return tuple(errors)


def _is_peft(model) -> bool:
    return is_peft_available() and isinstance(model, PeftModel)

def _load_model(name: str, init_kwargs: dict | None, attn_implementation: str, args: MemOPDConfig) -> PreTrainedModel:
    """Load a model from an id or path with TRL's `create_model_from_path` (`dtype` defaults to float32 there)."""
    kwargs = dict(init_kwargs or {})
    kwargs.setdefault("attn_implementation", attn_implementation)
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    kwargs.setdefault("use_safetensors", True)
    # As in TRL's trainers: distributed training places each process's copy itself (`device_map="auto"` fails there).
    if args.distributed_state.distributed_type in ["MULTI_GPU", "DEEPSPEED", "FSDP"]:
        kwargs["device_map"] = None
    return create_model_from_path(name, **kwargs)


@dataclass
class _LossPiece:
    """One forward and backward pass of the student: a row of a scored batch (`None`: a batch that is skipped)."""

    batch: dict[str, Any]
    row: dict[str, Any] | None
    counts: dict[str, int] = field(default_factory=dict)  # batch-level counts the row's loss terms are shares of


@dataclass
class _Rollout:
    """One rollout batch: the episodes, the rollout statistics, and the seconds each stage took (for the logs)."""

    episodes: list[Episode]
    stats: dict[str, float]
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def invocations(self) -> list[Invocation]:
        """Every model call of the batch, episode by episode (the canonical order of the per-token tensors)."""
        return [inv for ep in self.episodes for inv in ep.invocations]


class _UpdateSkipper(TrainerCallback):
    """
    The one place where an optimizer update is skipped: a process asks (`request`) when its batch has nothing to
    learn from or its loss is not finite; right before the optimizer step every process votes, and if any asked, all
    drop their gradients, so the step leaves the weights and the optimizer state untouched.

    The vote must be collective. Under DDP every process all-reduces its gradients and steps the same optimizer on
    the result: a process that skipped on its own would hold other weights than the rest from then on (and one that
    left the collective calls early would leave the others waiting forever).
    """

    def __init__(self, trainer: "MemOPDTrainer"):
        self.trainer = trainer
        self.num_skipped = 0
        self.num_votes = 0  # optimizer steps voted on (taken or skipped)
        self.last_reason: str | None = None  # of this process's last request
        self._requested = False  # by this process, since the last optimizer step

    def request(self, reason: str) -> None:
        """Ask for the current update to be skipped (on this process; the vote makes it collective)."""
        self._requested = True
        self.last_reason = reason
        warnings.warn(
            f"{reason}: this update is skipped ({self.num_skipped + 1} skipped so far, counting this one).",
            stacklevel=3,
        )

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        trainer = self.trainer
        requested = torch.tensor(float(self._requested), device=trainer.accelerator.device)
        self._requested = False
        self.num_votes += 1
        if trainer.accelerator.reduce(requested, reduction="sum").item() > 0:
            # torch optimizers step only parameters that have a gradient: with none, nothing moves, not even the
            # Adam moments (the value head is in the optimizer, so this covers it too).
            trainer.optimizer.zero_grad(set_to_none=True)
            self.num_skipped += 1
        trainer._metrics["train"]["skipped_updates"].append(float(self.num_skipped))


class _SaveOnSigterm(TrainerCallback):
    """
    After a SIGTERM (`requested`, set by the signal handler of `_sigterm_requests`), the next step end saves a
    checkpoint and stops training; `MemOPDTrainer.train` then exits with status 0. With several processes they vote
    at every step end (any one signalled stops them all at the same step), since saving is collective.
    """

    def __init__(self, trainer: "MemOPDTrainer"):
        self.trainer = trainer
        self.reset()

    def reset(self) -> None:
        self.requested = False
        self.saved_step: int | None = None

    def on_step_end(self, args, state, control, **kwargs):
        requested = self.requested
        accelerator = self.trainer.accelerator
        if accelerator.num_processes > 1:
            vote = torch.tensor(float(requested), device=accelerator.device)
            requested = accelerator.reduce(vote, reduction="sum").item() > 0
        if requested:
            control.should_save = True
            control.should_training_stop = True
            self.saved_step = state.global_step


@contextmanager
def _sigterm_requests(callback: _SaveOnSigterm) -> Iterator[None]:
    """While training, SIGTERM asks `callback` for a checkpoint and a stop instead of killing the process."""
    if threading.current_thread() is not threading.main_thread():  # handlers can only be set from the main thread
        yield
        return

    def request(signum, frame):
        callback.requested = True
        logger.warning("SIGTERM received: finishing this step, then saving a checkpoint and exiting.")

    previous = signal.signal(signal.SIGTERM, request)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _last_complete_checkpoint(output_dir: str) -> str | bool | None:
    """
    The newest `checkpoint-N` of `output_dir` whose `trainer_state.json` (the last file transformers writes into a
    checkpoint) is there and parses; newer incomplete ones are warned about. Returns `True` when there is no
    checkpoint at all (transformers then raises its own error), `None` when all are incomplete (start afresh).
    """
    folders = [path for path in Path(output_dir).glob(f"{PREFIX_CHECKPOINT_DIR}-*") if path.is_dir()]
    folders = sorted(
        (path for path in folders if path.name.removeprefix(f"{PREFIX_CHECKPOINT_DIR}-").isdigit()),
        key=lambda path: int(path.name.removeprefix(f"{PREFIX_CHECKPOINT_DIR}-")),
        reverse=True,
    )
    if not folders:
        return True
    skipped = []
    for folder in folders:
        try:
            json.loads((folder / TRAINER_STATE_NAME).read_text())
        except (OSError, ValueError):
            skipped.append(folder.name)
            continue
        if skipped:
            warnings.warn(
                f"Skipping incomplete checkpoint(s) {skipped} in {output_dir} (no readable {TRAINER_STATE_NAME}: the "
                f"run was killed while writing them); resuming from {folder.name}.",
                UserWarning,
                stacklevel=3,
            )
        return str(folder)
    warnings.warn(
        f"Every checkpoint in {output_dir} ({skipped}) is incomplete (no readable {TRAINER_STATE_NAME}: the run was "
        "killed while writing it); training starts from the beginning.",
        UserWarning,
        stacklevel=3,
    )
    return None


class _ClearValueHeadGradients(TrainerCallback):
    """
    Drops the value head's gradients after every optimizer step. transformers clears gradients with
    `model.zero_grad()`, which does not reach the value head (it lives beside the model, not in it): without this its
    gradients would add up over all the steps of a run.
    """

    def __init__(self, trainer: "MemOPDTrainer"):
        self.trainer = trainer

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.trainer.value_head is not None:
            self.trainer.value_head.zero_grad(set_to_none=True)



class RecordDataset(torch.utils.data.Dataset):
    """A list of HotpotQA-format records as a map-style dataset (their mixed-type fields do not fit Arrow tables)."""

    def __init__(self, records: list[dict[str, Any]]):
        self.records = records

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.records[index]


def _as_dataset(data, name: str) -> "Dataset | RecordDataset":
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


def _check_one_batch_fits(train_dataset, args: MemOPDConfig) -> None:
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


def _validate_records(env_factory: Callable[[], Any], dataset, name: str) -> None:
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


def _warn_low_precision_weights(model: nn.Module, args: MemOPDConfig) -> None:
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


def _check_vllm_support(args: MemOPDConfig) -> None:
    """Fail before any model is loaded when `use_vllm=True` cannot run here (no vLLM, or no CUDA device)."""
    if not is_vllm_available():
        raise ImportError(
            "`use_vllm=True` needs vLLM, which is not installed: `pip install memopd-trl[vllm]` (NVIDIA GPU only), or "
            "set `use_vllm=False` to generate with transformers."
        )
    if args.use_cpu or not torch.cuda.is_available():
        reason = "`use_cpu=True` is set" if args.use_cpu else "no CUDA device is visible to this process"
        raise ValueError(
            f"`use_vllm=True` needs an NVIDIA GPU (CUDA), but {reason}. Set `use_vllm=False` to generate with "
            "transformers."
        )


def _apply_env_overrides(env_factory: Callable[[], Any], args: MemOPDConfig) -> Callable[[], Any]:
    """The env factory with the config's `memory_policy` / `action_format` / `max_turns` when they are set."""
    overrides = {
        name: getattr(args, name)
        for name in ("memory_policy", "action_format", "max_turns")
        if getattr(args, name) is not None
    }
    if not overrides:
        return env_factory
    if not isinstance(env_factory, functools.partial):
        raise ValueError(
            f"The config sets {sorted(overrides)}, but `env_factory` is a plain callable the trainer cannot rebuild. "
            "Set these on the environment itself, or pass `YourEnv.factory(...)` or "
            "`functools.partial(YourEnv, ...)`, whose arguments the trainer can change."
        )
    return functools.partial(env_factory.func, *env_factory.args, **{**env_factory.keywords, **overrides})


def _check_logit_transforms(*models) -> None:
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


def _max_length(model) -> int | None:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return getattr(config, "max_position_embeddings", None)


def _check_shared_vocabulary(student, teacher, tokenizer, teacher_tokenizer) -> None:
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
