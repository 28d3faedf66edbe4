"""`MemOPDTrainer`: Memory-Aligned On-Policy Distillation of a memory agent, on top of TRL's trainer base.

One training step, top to bottom (`_prepare_inputs`, then `training_step` once per packed row):

1. rollout (`_rollout`): the student plays `num_generations` episodes per question, every model call recorded as
   token ids (a `Rollout`);
2. pack (`_score`): each invocation rebuilt as its own sequence, whole invocations packed into rows;
3. advantages (`_compute_advantages`): group-normalized final reward, or GAE with a value head, one per action token;
4. teacher scores (`_teacher_scores`, no grad, a `LocalTeacher`'s): the teacher's distribution at every action
   position, in the exact context the student sampled it in (`teacher_scoring="aligned"`), or under the flattened
   history (`"persistent"`, the control), as `TeacherScores`; with them the divergence mask and the sampled-token KL
   reward; the live alignment audit (`audit.AlignmentAudit`, logged only) and the reference model's log-probs
   (`_sampled_logprobs`, `kl_coef > 0`). Steps 2-4 give a `ScoredBatch` (`memopd_trl.step`);
5. student forward and backward on each packed row (`_student_loss`):
   `loss = distill_coef * GJSD(teacher || student) + ppo_coef * PPO-clip (+ kl_coef * KL + vf_coef * value loss)`.

With `num_iterations > 1` steps 1-4 run once per rollout batch and the following updates reuse it. An update that
has nothing to learn from, or a non-finite loss, is skipped on every process (`callbacks.UpdateSkipper`).

The trainer orchestrates; the maths lives in `losses.py`, the packing in `packing.py`, the forwards in `scoring.py`.
"""

import copy
import json
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import gather_object, send_to_device
from datasets import Dataset
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.trainer_callback import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import is_peft_available, logging
from trl.models.utils import _ForwardRedirection, unwrap_model_for_generation
from trl.trainer.base_trainer import _BaseTrainer
from trl.trainer.utils import RepeatSampler, disable_dropout_in_model, identity, use_adapter

from .attention import register_varlen_attention
from .audit import AlignmentAudit
from .callbacks import (
    EvaluationStopped,
    SaveOnSigterm,
    UpdateSkipper,
    ValueHeadGradients,
    last_complete_checkpoint,
    sigterm_requests,
)
from .config import MemOPDConfig
from .losses import (
    broadcast_to_tokens,
    distillation_diagnostics,
    final_reward_gae,
    group_normalized_advantages,
    importance_sampling_weights,
    kl_penalty,
    ppo_clip_loss,
    sampled_kl_advantages,
    until_first_divergence,
    value_loss,
    without_first_divergence,
)
from .model_card import PAPER, build_model_card, hub_network_errors, hub_unreachable_error
from .packing import PackedInvocationCollator
from .records import Episode, Invocation
from .rollout import RolloutEngine, RolloutStopped
from .scoring import (
    action_hidden_states,
    action_logprobs_from_hidden,
    action_token_ids,
    attend_over_trees,
    gathered_lm_head,
    rows_action_hidden_states,
    sampled_token_logprobs,
)
from .sharding import (
    all_processes_agree,
    check_strategy,
    deferred_gradient_sync,
    forward_rows,
    gathered_for_generation,
    idle_loss,
    is_sharded,
    prepare_frozen_model,
)
from .stats import diagnostics_by_reward, evaluation_metrics, rollout_metrics
from .step import LossPiece, Rollout, ScoredBatch, SkippedBatch, TeacherPlay, TeacherScores
from .teacher import build_teacher
from .validation import (
    as_dataset,
    check_env_and_datasets,
    check_inputs,
    check_shared_vocabulary,
    check_vllm_support,
    load_student,
    load_teacher,
    max_model_length,
    validate_records,
)
from .vllm_backend import ColocatedVLLM


if is_peft_available():
    from peft import PeftConfig, PeftModel


logger = logging.get_logger(__name__)


VALUE_HEAD_FILE = "value_head.safetensors"
WARMUP_STATE_FILE = "distill_warmup.json"  # a checkpoint's warm-up release (`distill_warmup_release_loss`)
RELEASE_WINDOW = 3  # rollouts over which `distill_warmup_release_loss` measures the teacher-play loss


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
    _paper = PAPER

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
        register_varlen_attention()  # `attn_implementation="memopd_sdpa_varlen"`, the padding-free scoring attention
        # Paths may come as `os.PathLike`; the loading code below expects strings.
        model = os.fspath(model) if isinstance(model, os.PathLike) else model
        teacher_model = os.fspath(teacher_model) if isinstance(teacher_model, os.PathLike) else teacher_model
        model_id = model if isinstance(model, str) else model.config._name_or_path
        if args is None:
            args = MemOPDConfig(output_dir=f"{Path(model_id).name or 'model'}-MemOPD")
        if args.use_vllm:
            check_vllm_support(args)
        train_dataset, eval_dataset = check_env_and_datasets(env_factory, train_dataset, eval_dataset)

        # Student and tokenizer
        model, processing_class = load_student(model, processing_class, peft_config, args)

        # Teacher, and what the student and it were loaded from (for the model card)
        teacher_model, self._teacher_name, teacher_processing_class = load_teacher(
            teacher_model, args, teacher_processing_class
        )
        self._student_name = model_id
        self.vocab_size = len(processing_class)
        check_shared_vocabulary(model, teacher_model, processing_class, teacher_processing_class)

        for dropped in (model, teacher_model) if args.disable_dropout else ():
            if dropped is not None:
                disable_dropout_in_model(dropped)

        check_inputs(env_factory, train_dataset, eval_dataset, model, teacher_model, args)
        self.env_factory = env_factory
        self._metrics: dict[str, dict[str, list[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._buffers: dict[int, ScoredBatch | SkippedBatch] = {}  # rollout batch of each gradient-accumulation slot
        self._loss_sums: defaultdict[str, float] = defaultdict(float)  # loss terms of this batch, over its rows
        self._diagnostics: list[tuple[dict[str, torch.Tensor], torch.Tensor]] = []  # per row, with `rewarded`
        self._micro_step: int | None = None
        self._fresh_batch = False  # whether this micro-batch is a new rollout's first update
        self._warmup_released = False  # `distill_warmup_release_loss` ended the warm-up
        # The teacher-play loss by turn ({turn: [sum, tokens]}): this batch's, and each new rollout's before training on it.
        self._play_by_turn: defaultdict[int, list[float]] = defaultdict(lambda: [0.0, 0])
        self._release_losses: list[dict[int, list[float]]] = []

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
        self.value_head = None
        if args.advantage_estimator == "gae":
            hidden = self.accelerator.unwrap_model(self.model).config.get_text_config().hidden_size
            self.value_head = nn.Linear(hidden, 1).to(self.accelerator.device)
            nn.init.zeros_(self.value_head.weight)
            nn.init.zeros_(self.value_head.bias)
            # Before the update vote: the gradients are averaged on every process, then dropped by all if it skips.
            self.add_callback(ValueHeadGradients(self.value_head, self.accelerator))
        self._update_skipper = UpdateSkipper(self.accelerator, self._record_metric)
        self.add_callback(self._update_skipper)
        self._preemption = SaveOnSigterm(self.accelerator)
        self.add_callback(self._preemption)

        # A full copy per process, or sharded as the student is (FSDP2, ZeRO-3).
        self.teacher_model = None if teacher_model is None else prepare_frozen_model(teacher_model, self.accelerator)

        self.ref_model = None
        if max(args.kl_coef, args.distill_warmup_kl_coef, args.distill_warmup_anchor_coef) > 0 and not _is_peft(
            self.model
        ):
            self.ref_model = self._load_reference(self.accelerator.unwrap_model(self.model))

        self._build_scorers()
        # PPO corrected for the sampling engine's gap to the student (on by default with vLLM).
        correct = args.importance_sampling_correction
        self.correct_sampling = args.use_vllm if correct is None else correct

    def _build_scorers(self) -> None:
        """The packing of the student's rows, the student's rollout engine (transformers or vLLM), and the teacher
        (`teacher.build_teacher`) with its packing of each layout it scores and, when it plays, its own engine."""
        args = self.args
        # Shared-prefix packing where every model that scores the student's batch can attend over a tree.
        scorers = [self.accelerator.unwrap_model(m) for m in (self.model, self.teacher_model) if m is not None]
        self.share_prefix = args.share_prefix and attend_over_trees(scorers)
        # Each row is forwarded on its own (`_forward_rows`): the budget bounds the tokens of one forward.
        packing = dict(
            max_tokens_per_row=args.max_tokens_per_row,
            pad_token_id=self.processing_class.pad_token_id,
            share_prefix=self.share_prefix,
        )
        self.collator = PackedInvocationCollator(max_model_length=max_model_length(self.model), **packing)
        # With vLLM, TRL's `VLLMGeneration` owns the engine and its weight sync; the rollout engine generates with it.
        self.vllm_generation = None
        if args.use_vllm:
            self.vllm_generation = ColocatedVLLM(self.model, self.accelerator, self.processing_class, args)
        # Both models generate with whole weights (gathered when sharded: `_play`, `LocalTeacher.play`), so decoding
        # runs no collective: processes may sample different numbers of tokens and play different numbers of turns.
        # (transformers would otherwise sync every decoding step across processes under FSDP / ZeRO-3, and a process
        # whose episodes ended sooner would leave the others waiting.)
        generation = dict(
            tokenizer=self.processing_class, env_factory=self.env_factory, max_new_tokens=args.max_new_tokens,
            max_prompt_length=args.max_prompt_length, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            share_prefix=args.share_prefix, generation_kwargs={"synced_gpus": False},
        )  # fmt: skip
        self.rollout_engine = RolloutEngine(
            model=self.accelerator.unwrap_model(self.model),
            backend="vllm" if args.use_vllm else "hf",
            vllm_llm=self.vllm_generation.llm if args.use_vllm else None,
            **generation,
        )
        # The live alignment audit scores the aligned teacher's actions again under the persistent history.
        self.audit = None
        has_teacher = self.teacher_model is not None or args.teacher_model_server_url is not None
        if has_teacher and args.teacher_scoring == "aligned" and args.misalignment_audit_steps > 0:
            self.audit = AlignmentAudit(args.misalignment_audit_steps, self._every_process_has)
        self.teacher = build_teacher(
            args, self.teacher_model, self.accelerator, self.processing_class, packing, generation, self.audit is not None
        )

    def _load_reference(self, student: PreTrainedModel) -> nn.Module:
        # A copy, not a model rebuilt from the config: under ZeRO-3 transformers builds models from configs partitioned
        # (`zero.Init`), and a partitioned model cannot load a whole state dict. The student is not prepared yet.
        return prepare_frozen_model(copy.deepcopy(student), self.accelerator)

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        # FSDP on CPU processes (which accelerate would quietly replace by DDP), or an error where the strategy asked
        # for cannot run.
        check_strategy(self.accelerator, self.args)
        self.is_fsdp_enabled = getattr(self.accelerator.state, "fsdp_plugin", None) is not None

    @property
    def num_skipped_updates(self) -> int:
        """Optimizer updates skipped so far (see `callbacks.UpdateSkipper`)."""
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
            resume_from_checkpoint = last_complete_checkpoint(self.args.output_dir)
        self._update_skipper.start_run()
        self._preemption.reset()
        with sigterm_requests(self._preemption):
            output = super().train(resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs)
        self._preemption.exit_if_saved(self.args.output_dir)
        self._update_skipper.check_run_updated()
        return output

    def _get_train_sampler(self, train_dataset=None) -> torch.utils.data.Sampler:
        # The questions of one optimizer step (all processes, all gradient-accumulation micro-batches) are yielded
        # `num_iterations` times in a row; each micro-batch is rolled out on its first occurrence and the
        # following updates reuse it (see `_prepare_inputs`).
        args, dataset = self.args, train_dataset if train_dataset is not None else self.train_dataset
        batch_size = args.per_device_train_batch_size * self.accelerator.num_processes * args.gradient_accumulation_steps
        return RepeatSampler(dataset, mini_repeat_count=1, batch_size=batch_size, repeat_count=args.num_iterations,
                             shuffle=True, seed=args.seed)  # fmt: skip

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model) if model is not None else super().create_optimizer()
        if self.value_head is not None:
            optimizer.add_param_group({"params": list(self.value_head.parameters()), "weight_decay": 0.0})
        return optimizer

    def _rollout_and_score(self, records: list[dict[str, Any]]) -> ScoredBatch | SkippedBatch:
        """Steps 1-4 for one micro-batch of records (once per rollout: with `num_iterations > 1` later updates reuse it)."""
        accumulation = self.args.gradient_accumulation_steps
        if self._micro_step is None:  # first call of this run (or of a resumed run)
            self._micro_step = self.state.global_step * accumulation
        slot = self._micro_step % accumulation
        first_update_of_round = (self._micro_step // accumulation) % self.args.num_iterations == 0
        self._fresh_batch = first_update_of_round or slot not in self._buffers
        if self._fresh_batch:
            if slot == 0:  # the warm-up ends between rollouts
                self._maybe_release_warmup()
            rollout = self._rollout(records)  # 1. play episodes
            batch = self._score(rollout)  # 2-4. pack, advantages, teacher and reference scoring
            if self.args.teacher_generations > 0 and isinstance(batch, ScoredBatch):
                batch.teacher_play = self._teacher_play(records, rollout.invocations)
            self._log_rollout(rollout, batch)
            self._buffers[slot] = batch
        self._micro_step += 1
        return self._buffers[slot]

    def _rollout(self, records: list[dict[str, Any]]) -> Rollout:
        """Step 1: the student plays `num_generations` sampled episodes per record, every model call recorded."""
        start = time.perf_counter()
        episodes, stats = self._play(records, greedy=False)
        return Rollout(episodes, stats, {"rollout": time.perf_counter() - start})

    def _score(self, rollout: Rollout) -> ScoredBatch | SkippedBatch:
        """Steps 2-4 on one rollout: pack, advantages, the teacher's and the reference's scores. Collective."""
        args, device, invocations = self.args, self.accelerator.device, rollout.invocations
        if not self._every_process_has(bool(invocations)):
            # Every episode failed before its first model call (e.g. prompts that cannot fit): nothing to learn from.
            # With sharded weights every forward is collective, so every process skips when one has nothing.
            if invocations:
                return SkippedBatch("Another process's batch reached no model call (sharded weights: all skip)")
            return SkippedBatch(f"No episode of this batch reached a model call ({rollout.stats})")
        # 2. pack: every invocation rebuilt as its own sequence, whole invocations packed into rows, each forwarded on
        # its own (bounded activations)
        packed = send_to_device(self.collator(invocations), device)
        rows = self._forward_rows(packed)
        # 3. advantages, one per action token
        advantages, returns, old_values = self._compute_advantages(rollout, rows)
        rewarded = torch.tensor([ep.reward > 0 for ep in rollout.episodes])
        batch = ScoredBatch(
            packed=packed,
            rows=rows,
            sequence_ids=rollout.sequence_ids().to(device),
            old_logprobs=torch.tensor(
                [lp for inv in invocations for lp in inv.logprobs], dtype=torch.float32, device=device
            ),
            advantages=advantages,
            rewarded=broadcast_to_tokens(rewarded, rollout.tokens_per_episode()).to(device),  # for the diagnostics
            returns=returns,
            old_values=old_values,
        )
        if self.correct_sampling:  # the engine's log-probs are not the student's: weigh the gap
            self._correct_sampling(batch)
        # 4. the teacher's scores (aligned: on the same rows; or the persistent history), and the reference's
        start = time.perf_counter()
        if self.teacher is not None and (args.distill_coef > 0 or args.sampled_kl_coef > 0):
            self._teacher_scores(rollout, batch)
        rollout.seconds["teacher"] = time.perf_counter() - start
        if batch.teacher is not None and self.audit is not None and self.audit.due(self.state.global_step):
            start = time.perf_counter()
            for name, value in self.audit(self.teacher, invocations, batch.teacher).items():
                self._metrics["train"][name].append(value)
            rollout.seconds["audit"] = time.perf_counter() - start
        kl, anchored = self._kl_coef() > 0, args.distill_warmup_anchor_coef > 0 and self._in_distill_warmup()
        if kl or anchored:  # one forward of the reference serves both
            start = time.perf_counter()
            with self._reference_model() as reference, torch.no_grad():
                hidden = rows_action_hidden_states(reference, batch.rows)  # (N, H)
                if kl:
                    batch.ref_logprobs = sampled_token_logprobs(
                        reference, hidden, action_token_ids(batch.packed), self.vocab_size, args.temperature,
                        args.logit_chunk_size,
                    )  # (N,)  # fmt: skip
                if anchored:  # a PEFT student's head is read outside the context: adapters never change its base weight
                    batch.anchor = TeacherScores(hidden, reference, self.vocab_size)
            rollout.seconds["reference"] = time.perf_counter() - start
        return batch

    def _teacher_scores(self, rollout: Rollout, batch: ScoredBatch) -> None:
        """
        Step 4: the teacher's scores of the rollout's actions (`batch.teacher`), and what the loss derives from them:
        the tokens the distillation keeps (`distill_divergence_threshold`) and the sampled-token KL reward added to the
        advantages (`sampled_kl_coef`).
        """
        args = self.args
        need_sampled = args.sampled_kl_coef > 0 or args.distill_divergence_threshold > 0
        need_sampled = need_sampled or (args.loss_top_k > 0 and self.audit is not None)  # its top-k audit reads them
        action_ids = action_token_ids(batch.packed) if need_sampled else None
        batch.teacher = self.teacher.score(rollout.invocations, args.teacher_scoring, batch.rows, action_ids)
        if args.distill_divergence_threshold > 0 and args.distill_divergence_scope != "none":
            batch.distill_mask = self._distill_mask(rollout, batch)
        if self._in_distill_warmup():  # the teacher's own episodes only, for now
            batch.distill_mask = torch.zeros_like(batch.old_logprobs, dtype=torch.bool)
        if args.sampled_kl_coef > 0:
            token_rewards = sampled_kl_advantages(batch.teacher.sampled_logprobs, batch.old_logprobs)  # (N,)
            batch.advantages = batch.advantages + args.sampled_kl_coef * token_rewards
            self._metrics["train"]["distill/sampled_reverse_kl"].append(-token_rewards.mean().item())

    def _sampled_logprobs(self, model: nn.Module, rows: list[dict], packed: dict) -> torch.Tensor:
        """`(N,)`: `model`'s log-prob of each sampled token of `packed` (forwarded as `rows`) at the sampling
        temperature (no grad): the reference's for the KL term, the student's own at the rollout or on the teacher's
        episodes."""
        args = self.args
        with torch.no_grad():
            hidden = rows_action_hidden_states(model, rows)  # (N, H)
            action_ids = action_token_ids(packed)
            vocab, chunk = self.vocab_size, args.logit_chunk_size
            return sampled_token_logprobs(model, hidden, action_ids, vocab, args.temperature, chunk)  # (N,)

    def _correct_sampling(self, batch: ScoredBatch) -> None:
        """
        The importance sampling correction (`importance_sampling_correction`, as TRL's GRPO with vLLM): the student's
        own log-probs at the rollout become PPO's old log-probs, and each token's PPO loss is weighted by
        `p_student / p_engine` (`losses.importance_sampling_weights`), its gap to the engine logged as TRL logs it.
        """
        args = self.args
        batch.sampling_logprobs = batch.old_logprobs
        batch.old_logprobs = self._sampled_logprobs(self.accelerator.unwrap_model(self.model), batch.rows, batch.packed)
        batch.sampling_weights = importance_sampling_weights(
            batch.old_logprobs, batch.sampling_logprobs, batch.sequence_ids, mode=args.importance_sampling_mode,
            clip_min=args.importance_sampling_clip_min, clip_max=args.importance_sampling_clip_max,
        )  # (N,)  # fmt: skip
        for name, value in batch.sampling_metrics().items():
            self._metrics["train"][name].append(value)

    def _compute_advantages(
        self, rollout: Rollout, rows: list[dict[str, Any]]
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """
        Step 3: the advantage of every action token, `(N,)` in canonical order, from the episodes' final rewards;
        with GAE also the value targets (`returns`) and the values now (`old_values`, for the clipped value loss).

        - `"group"`: each episode's reward normalized within its group (the episodes of one question), on all its
          tokens.
        - `"gae"`: the value head scores every action token on the packed `rows` (`final_reward_gae`).
        """
        args, device, episodes = self.args, self.accelerator.device, rollout.episodes
        rewards = torch.tensor([ep.reward for ep in episodes], dtype=torch.float32)  # (E,)
        tokens_per_episode = torch.tensor(rollout.tokens_per_episode())
        if args.advantage_estimator == "group":
            group_ids = torch.tensor([ep.group_id for ep in episodes])
            advantages = group_normalized_advantages(rewards, group_ids, scale=args.scale_rewards)  # (E,)
            return broadcast_to_tokens(advantages, tokens_per_episode).to(device), None, None
        with torch.no_grad():
            hidden = rows_action_hidden_states(self.accelerator.unwrap_model(self.model), rows)  # (N, H)
            values = self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float().cpu()  # (N,)
        advantages, returns = final_reward_gae(rewards, values, tokens_per_episode, gamma=args.gamma, lam=args.lam)
        return advantages.to(device), returns.to(device), values.to(device)

    def _distill_mask(self, rollout: Rollout, batch: ScoredBatch) -> torch.Tensor:
        """`(N,)`: the tokens the distillation loss keeps, up to each action's (or episode's) first token the teacher
        gives less than `distill_divergence_threshold`."""
        args = self.args
        segments = batch.sequence_ids  # each action on its own
        if args.distill_divergence_scope == "episode":
            segments = broadcast_to_tokens(torch.arange(len(rollout.episodes)), rollout.tokens_per_episode())
        mask = until_first_divergence(
            batch.teacher.sampled_logprobs, segments.to(self.accelerator.device), args.distill_divergence_threshold
        )  # (N,)
        self._metrics["train"]["distill/kept_tokens"].append(mask.float().mean().item())
        return mask

    def _teacher_play(self, records: list[dict], rollout_invocations: list[Invocation]) -> TeacherPlay | None:
        """
        The teacher plays `teacher_generations` sampled episodes per record; returns their invocations, the teacher's
        scores of their actions (laid out as `teacher_scoring` says, as the student's actions are), and the rollout's
        invocations then these packed together for the student's forwards. `None` when no episode reached a model
        call. Collective.
        """
        start, device = time.perf_counter(), self.accelerator.device
        episodes = self.teacher.play(records, self.args.teacher_generations)
        invocations = [inv for ep in episodes for inv in ep.invocations]
        f1 = torch.tensor([sum(ep.f1 for ep in episodes) / max(len(episodes), 1)], device=device)
        self._record_metric("teacher_play/f1", self.accelerator.gather(f1).mean().item())
        play = None
        if self._every_process_has(bool(invocations)):
            scores = self.teacher.score(invocations, self.args.teacher_scoring)  # (N_play, ...)
            joint_rows = self._forward_rows(send_to_device(self.collator(rollout_invocations + invocations), device))
            play = TeacherPlay(invocations, scores, joint_rows)
            if self._in_distill_warmup():
                play.distill_mask = self._continuations_only(episodes, invocations)
        self._record_metric("time/teacher_play", time.perf_counter() - start)
        return play

    def _in_distill_warmup(self) -> bool:
        """Whether this step is in the distillation warm-up (`distill_warmup_steps`, or less once
        `distill_warmup_release_loss` ended it)."""
        return self.state.global_step < self.args.distill_warmup_steps and not self._warmup_released

    def _kl_coef(self) -> float:
        """The weight of the KL to the student's start now: `distill_warmup_kl_coef` during the distillation warm-up,
        `kl_coef` after it."""
        args = self.args
        return args.distill_warmup_kl_coef if self._in_distill_warmup() else args.kl_coef

    def _continuations_only(self, episodes: list[Episode], invocations: list[Invocation]) -> torch.Tensor:
        """`(N_play,)`: the teacher's action tokens the warm-up distills, all but each episode's branch point
        (`losses.without_first_divergence` on the student's log-probs): the student learns to act in the states the
        teacher's choices lead to before it is taught to make them. Collective when sharded."""
        packed = send_to_device(self.collator(invocations), self.accelerator.device)
        logprobs = self._sampled_logprobs(self.accelerator.unwrap_model(self.model), self._forward_rows(packed), packed)
        lengths = torch.tensor([sum(len(inv.output_ids) for inv in episode.invocations) for episode in episodes])
        episode_ids = torch.repeat_interleave(torch.arange(len(episodes)), lengths).to(logprobs.device)
        mask = without_first_divergence(logprobs, episode_ids, self.args.distill_divergence_threshold)
        self._record_metric("distill/warmup_branch_tokens", float((~mask).sum()))
        return mask

    def _forward_rows(self, batch: dict[str, Any]) -> list[dict[str, Any]]:
        """The rows of a packed batch, each forwarded on its own (`sharding.forward_rows`). Collective when sharded."""
        return forward_rows(batch, self.accelerator, self.processing_class.pad_token_id)

    def _every_process_has(self, flag: bool) -> bool:
        """
        `flag` on this process, or, with sharded weights (FSDP, ZeRO-3), on every process (collective): there every
        forward is collective, so a forward that one process would skip is skipped by all.
        """
        return all_processes_agree(self.accelerator, flag) if is_sharded(self.accelerator) else flag

    @contextmanager
    def _reference_model(self) -> Iterator[nn.Module]:
        """The model of the KL term: the frozen copy of the student's start, or a PEFT student with its adapters off."""
        if self.ref_model is not None:
            yield self.accelerator.unwrap_model(self.ref_model)
            return
        student = self.accelerator.unwrap_model(self.model)
        with use_adapter(student, adapter_name=None):
            yield student

    def _play(
        self, records: list[dict[str, Any]], greedy: bool, should_stop: Callable[[], bool] | None = None
    ) -> tuple[list[Episode], dict[str, float]]:
        """
        Play `records` with the current student: `num_generations` sampled episodes each, or one greedy episode.
        `should_stop` is `RolloutEngine.rollout`'s.

        Every process must call it at the same point, even with no records: gathering the student's weights for
        generation (DeepSpeed ZeRO-3, FSDP2, vLLM weight sync) is collective.

        Returns:
            `tuple[list[Episode], dict[str, float]]`: the episodes and the rollout statistics of
            `RolloutEngine.rollout`.
        """
        num_generations = 1 if greedy else self.args.num_generations
        if self.vllm_generation is not None:
            step = self.state.global_step
            return self.vllm_generation.play(self.rollout_engine, records, num_generations, greedy, step, should_stop)
        start = time.perf_counter()
        with (
            unwrap_model_for_generation(self.model_wrapped, self.accelerator) as unwrapped,
            gathered_for_generation(unwrapped),  # FSDP2: decoding on shards would make every token collective
        ):
            if is_sharded(self.accelerator):  # the cost of gathering the student for this rollout
                self._metrics["eval" if greedy else "train"]["time/rollout_gather"].append(time.perf_counter() - start)
            was_training = unwrapped.training
            try:
                with self.rollout_engine.decoding_with(unwrapped.eval()):
                    return self.rollout_engine.rollout(records, num_generations, greedy, should_stop=should_stop)
            finally:
                unwrapped.train(was_training)

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
            last = k == len(pieces) - 1
            with nullcontext() if last else deferred_gradient_sync(self.accelerator, model):
                piece_loss = super().training_step(model, piece, num_items_in_batch)
            loss = piece_loss if loss is None else loss + piece_loss
        by_turn = self._log_loss_sums()
        if self._fresh_batch and self.args.distill_warmup_release_loss > 0 and self._in_distill_warmup():
            self._record_release_loss(by_turn)
        return loss

    def _record_release_loss(self, by_turn: dict[int, list[float]]) -> None:
        """Keep `by_turn`, a rollout's teacher-play loss by turn at its first update on this process, added up over
        the processes, for `_maybe_release_warmup`. Collective."""
        merged = _sum_by_turn(gather_object([by_turn]))
        if merged:
            self._release_losses = [*self._release_losses, merged][-RELEASE_WINDOW:]

    def _release_loss(self) -> float | None:
        """The teacher-play loss of the last `RELEASE_WINDOW` rollouts, each before training on it, in its worst turn
        (nats per distilled token); `None` until that many were measured."""
        if len(self._release_losses) < RELEASE_WINDOW:
            return None
        return max(total / tokens for total, tokens in _sum_by_turn(self._release_losses).values())

    def _maybe_release_warmup(self) -> None:
        """End the warm-up before `distill_warmup_steps` once the student can act in the teacher's states at every turn:
        `_release_loss` is at most `distill_warmup_release_loss`."""
        threshold = self.args.distill_warmup_release_loss
        if threshold > 0 and self._in_distill_warmup():
            worst = self._release_loss()
            if worst is not None and worst <= threshold:
                self._warmup_released = True
                logger.info(
                    f"Distillation warm-up released at step {self.state.global_step}: the loss on the teacher's "
                    f"episodes is {worst:.3f} nats per token in its worst turn (at most {threshold})."
                )
        if threshold > 0:
            self._record_metric("distill/warmup", float(self._in_distill_warmup()))

    def _prepare_inputs(self, inputs):
        if isinstance(inputs, LossPiece):  # `transformers.Trainer.training_step` on one row of a prepared batch
            return inputs
        return self._rollout_and_score(inputs)

    def _loss_pieces(self, batch: ScoredBatch | SkippedBatch) -> list[LossPiece]:
        """
        The student's forward and backward passes of one batch: one piece per packed row (of the joint rows when the
        teacher plays too), each with the batch-level counts that its loss terms are shares of. A batch that is
        skipped is one piece with no row.
        """
        if isinstance(batch, SkippedBatch):
            return [LossPiece(batch, None)]
        play = len(batch.teacher_play.teacher) if batch.teacher_play is not None else 0
        if play and batch.teacher_play.distill_mask is not None:
            play = int(batch.teacher_play.distill_mask.sum())
        kept = int(batch.distill_mask.sum()) if batch.distill_mask is not None else batch.num_actions
        counts = {
            "actions": batch.num_actions,
            "sequences": int(batch.sequence_ids.unique().numel()),
            "distilled": kept + play,
            "play": play,
        }
        return [LossPiece(batch, row, counts) for row in batch.student_rows]

    def compute_loss(self, model, inputs: LossPiece, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("MemOPDTrainer does not return model outputs from `compute_loss`.")
        start = time.perf_counter()
        if isinstance(inputs.batch, SkippedBatch):
            self._update_skipper.request(f"{inputs.batch.reason} at step {self.state.global_step}")
            return idle_loss(model, self.accelerator, self.processing_class.pad_token_id)
        unwrapped = self.accelerator.unwrap_model(model)
        # Route the student forward through the wrapper (DDP/FSDP) so gradient synchronization hooks fire.
        loss = self._forward_redirection(model, unwrapped, self._student_loss, unwrapped, inputs)
        self._loss_sums["time/actor"] += time.perf_counter() - start
        if torch.isfinite(loss):
            return loss
        # A NaN/inf (teacher or student log-probs, an overflow) would poison the weights.
        self._update_skipper.request(f"Non-finite loss ({loss.item()}) at step {self.state.global_step}")
        if is_sharded(self.accelerator):
            # The backward must still run through the sharded model's hooks, whose gradient reduction is collective;
            # the vote drops the gradients before the optimizer step.
            return torch.nan_to_num(loss, nan=0.0, posinf=0.0, neginf=0.0) * 0.0
        return idle_loss(model, self.accelerator, self.processing_class.pad_token_id)

    def _student_loss(self, model: nn.Module, piece: LossPiece) -> torch.Tensor:
        """
        Step 5 on one row: the student forward and this row's share of the loss.

        Every term of the loss is a mean over the batch (tokens, sequences, distilled tokens); a row's term is its own
        mean times the share of the batch it holds (`n_row / n`), so the rows' losses (and gradients) add up to the
        batch's, and one row is exactly the batch. The logged values are added up the same way (`_log_loss_sums`).
        """
        args, batch, row, counts = self.args, piece.batch, piece.row, piece.counts
        # Canonical index of each action of the row, in the joint order: the rollout's actions, then (with teacher
        # play) the teacher's own episodes'.
        index = row["action_index"]
        rollout = index < batch.num_actions
        actions, play_actions = index[rollout], index[~rollout] - batch.num_actions
        joint = action_hidden_states(model, row)  # (n_row, H)
        hidden, play_hidden = joint[rollout], joint[~rollout]
        share = len(actions) / counts["actions"]
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
                loss = loss + args.ppo_coef * self._ppo_term(batch, actions, logprobs, share, counts)
            if batch.teacher is not None:
                student_head = (weight, bias)
                term = self._distill_term(batch, actions, hidden, play_actions, play_hidden, student_head, counts)
                loss = loss + term
            if batch.anchor is not None:  # the distillation warm-up: the start teaches the student's own actions
                with batch.anchor.lm_head() as start_head:  # collective when sharded: every row enters it
                    anchor = hidden.new_zeros(())
                    if len(actions):
                        anchor = batch.anchor.divergence(
                            hidden, (weight, bias), actions, start_head, beta=0.0,
                            temperature=args.distill_temperature, chunk_size=args.logit_chunk_size,
                        ).mean() * share  # fmt: skip
                loss = loss + args.distill_warmup_anchor_coef * anchor
                self._loss_sums["loss/anchor"] += anchor.item()
        if batch.ref_logprobs is not None:
            kl = kl_penalty(logprobs, batch.ref_logprobs[actions]).mean() * share if len(actions) else 0.0 * loss
            loss = loss + self._kl_coef() * kl
            self._loss_sums["kl_ref"] += kl.item()
        if self.value_head is not None:
            values = self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float()
            returns, old_values = batch.returns[actions], batch.old_values[actions]
            v_loss = value_loss(values, returns, old_values=old_values, clip=args.cliprange_value) * share
            loss = loss + args.vf_coef * v_loss
            self._loss_sums["loss/value"] += v_loss.item()
        self._loss_sums["entropy"] += entropy.mean().item() * share if entropy.numel() else 0.0
        return loss

    def _ppo_term(self, batch: ScoredBatch, actions, logprobs, share: float, counts: dict[str, int]) -> torch.Tensor:
        """The row's share of the PPO-clip loss (unweighted), logged with its clip fraction and KL to the rollout."""
        args, sums = self.args, self._loss_sums
        sequence_ids = batch.sequence_ids[actions]
        ppo, stats = ppo_clip_loss(
            logprobs,
            batch.old_logprobs[actions],
            batch.advantages[actions],
            epsilon=args.epsilon,
            epsilon_high=args.epsilon_high,
            sequence_ids=sequence_ids,
            aggregation=args.loss_aggregation,
            sampling_weights=None if batch.sampling_weights is None else batch.sampling_weights[actions],
        )
        if args.loss_aggregation == "sequence_mean":  # a row holds whole sequences
            ppo = ppo * (sequence_ids.unique().numel() / counts["sequences"])
        else:
            ppo = ppo * share
        sums["loss/ppo"] += ppo.item()
        sums["clip_fraction"] += float(stats["clip_fraction"]) * share
        sums["approx_kl_old"] += float(stats["approx_kl"]) * share
        return ppo

    def _distill_term(self, batch: ScoredBatch, actions, hidden, play_actions, play_hidden, student_head, counts):
        """
        The row's share of the distillation loss, `distill_coef` times the generalized JSD over the kept tokens of the
        rollout and the teacher's own episodes (on the full vocabulary, or on the teacher's top-k plus a tail bucket);
        also collects the `distill/*` diagnostics (logged only; full-vocabulary teachers).
        """
        args, sums = self.args, self._loss_sums
        weight, bias = student_head
        settings = dict(beta=args.beta, temperature=args.distill_temperature, chunk_size=args.logit_chunk_size,
                        add_tail=args.loss_add_tail)  # fmt: skip
        with batch.teacher.lm_head() as teacher_head:

            def divergence(student_hidden, scores, index):  # (n,) on the tokens `index` of `scores`
                return scores.divergence(student_hidden, student_head, index, teacher_head, **settings)

            term = hidden.new_zeros(())
            if args.distill_coef > 0:
                distilled = divergence(hidden, batch.teacher, actions)  # (n,)
                if batch.distill_mask is not None:  # the tokens up to each action's first divergence
                    distilled = distilled[batch.distill_mask[actions]]
                if counts["play"]:
                    play_divergence = divergence(play_hidden, batch.teacher_play.teacher, play_actions)
                    play_turns = batch.teacher_play.turns[play_actions.cpu()]
                    if batch.teacher_play.distill_mask is not None:  # the warm-up: each episode's branch point left out
                        kept = batch.teacher_play.distill_mask[play_actions]
                        play_divergence, play_turns = play_divergence[kept], play_turns[kept.cpu()]
                    sums["loss/distill_teacher_play"] += play_divergence.sum().item() / counts["play"]
                    totals = torch.bincount(play_turns, weights=play_divergence.detach().float().cpu())
                    for turn, tokens in enumerate(torch.bincount(play_turns).tolist()):
                        if tokens:
                            self._play_by_turn[turn][0] += totals[turn].item()
                            self._play_by_turn[turn][1] += tokens
                    distilled = torch.cat([distilled, play_divergence])
                distill = distilled.mean() if distilled.numel() else hidden.new_zeros(())
                distill = distill * (distilled.numel() / max(counts["distilled"], 1))
                term = args.distill_coef * distill
                sums["loss/distill"] += distill.item()
            if args.distill_diagnostics and len(actions) and isinstance(batch.teacher, TeacherScores):
                diagnostics = distillation_diagnostics(
                    hidden.detach(), weight.detach(), batch.teacher.hidden[actions], teacher_head[0],
                    student_bias=None if bias is None else bias.detach(), teacher_bias=teacher_head[1],
                    chunk_size=args.logit_chunk_size,
                )  # fmt: skip  (each (n,))
                self._diagnostics.append((diagnostics, batch.rewarded[actions]))
        return term

    def _batch_loss(self, model: nn.Module, batch: ScoredBatch) -> torch.Tensor:
        """The loss of a whole scored batch, logged: the sum of its rows' losses (every row forwarded, no backward)."""
        loss = sum(self._student_loss(model, piece) for piece in self._loss_pieces(batch))
        self._log_loss_sums()
        return loss

    def _log_loss_sums(self) -> dict[int, list[float]]:
        """Log the batch's loss terms, added up over its rows, its distillation diagnostics over all its rows, and its
        teacher-play loss by turn (`distill/teacher_play_turn_<k>`), which it returns as `{turn: [sum, tokens]}`."""
        metrics = self._metrics["train"]
        logged = {**self._loss_sums, **(diagnostics_by_reward(self._diagnostics) if self._diagnostics else {})}
        by_turn = dict(self._play_by_turn)
        logged.update({f"distill/teacher_play_turn_{turn}": total / tokens for turn, (total, tokens) in by_turn.items()})
        for name, value in logged.items():
            metrics[name].append(value)
        self._loss_sums, self._diagnostics = defaultdict(float), []
        self._play_by_turn = defaultdict(lambda: [0.0, 0])
        return by_turn

    def _log_rollout(self, rollout: Rollout, batch: ScoredBatch | SkippedBatch) -> None:
        """Record the statistics of one rollout (and of its packed batch) for the next `log`. Collective."""
        packed = batch.packed if isinstance(batch, ScoredBatch) else None
        for name, value in rollout_metrics(rollout, packed, self.accelerator).items():
            self._record_metric(name, value)

    def _record_metric(self, name: str, value: float) -> None:
        """Add a training metric's value to those the next `log` averages."""
        self._metrics["train"][name].append(value)

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
        dataset = as_dataset(dataset, "eval_dataset")
        if eval_dataset is not None:  # the trainer's own was checked at construction
            validate_records(self.env_factory, dataset, "eval_dataset")
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        records = [dataset[i] for i in range(rank, len(dataset), world)]
        # During training a SIGTERM ends the evaluation at its next turn, so that the checkpoint is saved within the
        # grace period. With one process only: the processes of a run can be at different turns, so they finish it.
        preemption = self._preemption if self._preemption.watching else None
        should_stop = (lambda: preemption.requested) if preemption and self.accelerator.num_processes == 1 else None
        self.model.eval()
        try:
            try:  # on every process, even without records (collectives)
                episodes, _ = self._play(records, greedy=True, should_stop=should_stop)
            except RolloutStopped:
                episodes = None
            if preemption is not None and preemption.stop_voted():  # collective
                raise EvaluationStopped(f"SIGTERM during the evaluation at step {self.state.global_step}")
            metrics = evaluation_metrics(episodes, self.accelerator, metric_key_prefix)
            self.log(metrics)  # in eval mode: logged as `eval_*`
            self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        finally:
            self.model.train()
        return metrics

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, model, trial, *args, **kwargs):
        """
        `transformers.Trainer`'s logging, evaluation and checkpoint after a step, where an evaluation stopped by a
        SIGTERM is dropped and the step's checkpoint saved at once (transformers would save only after the evaluation).
        """
        try:
            super()._maybe_log_save_evaluate(tr_loss, grad_norm, model, trial, *args, **kwargs)
        except EvaluationStopped as stop:
            logger.warning(f"{stop}: the evaluation is dropped and the checkpoint of the step saved.")
            self._preemption.stop_at(self.state, self.control)
            self._save_checkpoint(model, trial)
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)

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
        card = build_model_card(
            model_name=model_name or Path(target).name, model_path=self.hub_model_id or str(target),
            student_name=self._student_name, teacher_name=self._teacher_name, args=self.args, env=self.env_factory(),
            trainer_name=self._name, paper=self._paper, tags=sorted(tags | set(self._tag_names)),
            dataset_name=dataset_name, global_step=self.state.global_step,
        )  # fmt: skip
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
        except hub_network_errors() as err:
            self.save_model()  # the Hub is reached before anything is saved: keep the work
            raise hub_unreachable_error(err, self.args.output_dir, self.args.hub_model_id) from err

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
        path = Path(resume_from_checkpoint, WARMUP_STATE_FILE)
        if path.exists():
            state = json.loads(path.read_text())
            self._warmup_released = state["released"]
            self._release_losses = [{int(turn): cell for turn, cell in by_turn.items()} for by_turn in state["losses"]]

    def _save_checkpoint(self, model, trial):
        if self.args.distill_warmup_release_loss > 0 and self.args.should_save:  # before trainer_state.json, last
            folder = Path(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            folder.mkdir(parents=True, exist_ok=True)
            state = {"released": self._warmup_released, "losses": self._release_losses}
            (folder / WARMUP_STATE_FILE).write_text(json.dumps(state))
        if self.args.hub_model_id is None:
            model_name = Path(self.args.output_dir).name
        else:
            model_name = self.args.hub_model_id.split("/")[-1]
        self.create_model_card(model_name=model_name)
        super()._save_checkpoint(model, trial)


def _sum_by_turn(parts: Iterable[dict[int, list[float]]]) -> dict[int, list[float]]:
    """Losses by turn (`{turn: [sum, tokens]}`, of processes or rollouts) added up into one."""
    total = defaultdict(lambda: [0.0, 0])
    for part in parts:
        for turn, (loss, tokens) in part.items():
            total[turn][0] += loss
            total[turn][1] += tokens
    return dict(total)


def _is_peft(model) -> bool:
    return is_peft_available() and isinstance(model, PeftModel)
