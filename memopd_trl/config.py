"""`MemOPDConfig`: the TRL-style configuration of `MemOPDTrainer`."""

from dataclasses import dataclass, field
from typing import Any

import torch
from trl.trainer.base_config import _BaseConfig


_ATTN_IMPLEMENTATIONS = (
    "eager",
    "sdpa",
    "flex_attention",
    "flash_attention_2",
    "flash_attention_3",
    "memopd_sdpa_varlen",  # padding-free packed attention (memopd_trl.attention; MemOPDTrainer registers it)
)


@dataclass
class MemOPDConfig(_BaseConfig):
    r"""
    Configuration class for the [`MemOPDTrainer`].

    Extends [`~transformers.TrainingArguments`] (through TRL's base config) with the parameters of Memory-Aligned
    On-Policy Distillation: multi-turn rollouts of a memory agent, a teacher that scores every sampled action in the
    state the student sampled it in, and a loss mixing generalized JSD distillation with PPO on the final reward.
    Every field can be set from the command line with [`~transformers.HfArgumentParser`] / [`~trl.TrlParser`].

    The environment's own settings (memory policy, action format, turn limit) are not part of the config: the env
    factory takes them, e.g. `HotpotQAEnv.factory(max_turns=4, memory_policy="compact", action_format="memopd")`.

    Parameters:
        > Parameters that control the model

        model_init_kwargs (`dict[str, Any]` or `str`, *optional*):
            Keyword arguments for `AutoModelForCausalLM.from_pretrained` when the trainer's `model` is a string.
        attn_implementation (`str`, *optional*, defaults to `"sdpa"`):
            Attention implementation of the student when loaded from a string: `"eager"`, `"sdpa"`,
            `"flex_attention"`, `"flash_attention_2"`, `"flash_attention_3"` or `"memopd_sdpa_varlen"` (padding-free
            packed attention with plain torch sdpa, the fastest choice on CPU).
        trust_remote_code (`bool`, *optional*, defaults to `False`):
            Whether to run model or tokenizer code shipped with a checkpoint. Off unless you trust the source.
        disable_dropout (`bool`, *optional*, defaults to `True`):
            Whether to disable dropout in the student and the teacher.

        > Parameters that control the teacher

        teacher_model_name_or_path (`str`, *optional*):
            Teacher model id or path, used when the trainer is given no `teacher_model`.
        teacher_model_init_kwargs (`dict[str, Any]` or `str`, *optional*):
            Keyword arguments for `AutoModelForCausalLM.from_pretrained` when the teacher is a string.
        teacher_attn_implementation (`str`, *optional*):
            Attention implementation of the teacher; defaults to `attn_implementation`.
        teacher_model_server_url (`str`, *optional*):
            Base URL of a vLLM OpenAI-compatible server hosting the teacher (e.g. `"http://127.0.0.1:8000"`, served
            with `vllm serve TEACHER --max-logprobs K`), as in TRL's server distillation. The teacher is then never
            loaded in a training process: every recorded invocation is sent as its own token ids and the server
            returns its top-`loss_top_k` log-probs at each action token. Takes the place of
            `teacher_model_name_or_path`, which is then not loaded. Needs `loss_top_k` >= 1, `teacher_generations=0`
            and `distill_temperature=1.0`, and `temperature=1.0` with `sampled_kl_coef` or
            `distill_divergence_threshold` (the server scores at temperature 1).
        teacher_server_timeout (`float`, *optional*, defaults to `300.0`):
            Seconds one request to the teacher server may take.
        teacher_server_max_retries (`int`, *optional*, defaults to `3`):
            Retries of a failed request to the teacher server (connection error, timeout, 5xx), with exponential
            backoff from 1 s; then the step fails with an error naming the URL and the attempts.

        > Parameters that control the rollouts

        max_new_tokens (`int`, *optional*, defaults to `128`):
            Maximum number of tokens sampled per model call.
        max_prompt_length (`int`, *optional*, defaults to `2048`):
            Maximum number of context tokens of a model call; longer contexts are shrunk by the environment
            (memory/observation), never by cutting a sampled action.
        num_generations (`int`, *optional*, defaults to `4`):
            Episodes played per question (a group, for group-normalized advantages). At least 2 with
            `advantage_estimator="group"` and `ppo_coef > 0`.
        temperature (`float`, *optional*, defaults to `1.0`):
            Sampling temperature of the rollouts; also the temperature of the PPO log-probs.
        top_p (`float`, *optional*, defaults to `1.0`):
            Nucleus sampling threshold of the rollouts.
        top_k (`int`, *optional*, defaults to `0`):
            Top-k sampling of the rollouts (0 disables it).

        > Parameters that control generation acceleration powered by vLLM

        use_vllm (`bool`, *optional*, defaults to `False`):
            Whether to generate the rollouts (training and evaluation) with vLLM instead of transformers' `generate`.
            Each process builds its own vLLM engine on its GPU, colocated with training (TRL's `VLLMGeneration`), and
            pushes the student's current weights into it before every rollout that follows an optimizer step. Needs
            a CUDA GPU and `pip install memopd-trl[vllm]`; the trainer checks both when it is built. Recorded
            log-probs follow the trainer's convention only with `top_k=0` and `top_p=1.0` (a warning says so
            otherwise).
        vllm_gpu_memory_utilization (`float`, *optional*, defaults to `0.3`):
            Fraction of each GPU's memory the vLLM engine may take, for its copy of the student's weights and its KV
            cache. Only used with `use_vllm=True`. The engine shares the GPU with training, which keeps the student
            with its gradients and optimizer state, the activations of the packed forwards and a full copy of the
            teacher there, so the default leaves most of the memory to them (TRL's `GRPOConfig` uses the same
            value). Raise it when the teacher is small or sleep mode is on.
        vllm_max_model_length (`int`, *optional*):
            Longest sequence (context plus action) the vLLM engine accepts; it sizes the KV cache of one sequence.
            Must be at least `max_prompt_length + max_new_tokens`, the longest model call, which is the default.
        vllm_enable_sleep_mode (`bool`, *optional*, defaults to `False`):
            Whether the vLLM engine releases its GPU memory (weights and KV cache) between rollouts, for teacher
            scoring and the optimizer step. Lowers peak memory, but the weights are pushed again before every
            rollout, evaluation included.

        > Parameters that control the distillation loss

        distill_coef (`float`, *optional*, defaults to `1.0`):
            Weight of the distillation loss. 0 gives the PPO-only baseline.
        beta (`float`, *optional*, defaults to `0.5`):
            Generalized JSD interpolation: 0 is forward KL(teacher || student), 1 is reverse KL(student || teacher).
        distill_temperature (`float`, *optional*, defaults to `1.0`):
            Temperature of both distributions in the distillation loss.
        loss_top_k (`int`, *optional*, defaults to `0`):
            Number of the teacher's most likely tokens the distillation loss is taken on, with one tail bucket for
            the rest of the mass (`loss_add_tail`), as in TRL's server distillation. 0 = the full vocabulary (a local
            teacher only). A teacher server returns this many log-probs per position.
        loss_add_tail (`bool`, *optional*, defaults to `True`):
            With `loss_top_k`, whether both distributions get a tail bucket holding their mass off the teacher's
            top-k (otherwise both are renormalized over it).
        teacher_scoring (`str`, *optional*, defaults to `"aligned"`):
            `"aligned"`: the teacher scores each action in the exact context the student sampled it in (MemOPD).
            `"persistent"`: the teacher scores each action under the episode flattened into one growing history
            (the matched control).
        distill_divergence_threshold (`float`, *optional*, defaults to `0.0`):
            Distill each action only up to its first sampled token whose teacher probability (at the sampling
            `temperature`) is below this value, that token included (`memopd_trl.losses.until_first_divergence`):
            after a token the teacher would not have written, its distributions continue a prefix it never saw. The
            PPO term still covers every token. 0 distills every token; it needs `distill_coef > 0`.
        distill_divergence_scope (`str`, *optional*, defaults to `"action"`):
            Where `distill_divergence_threshold` stops distilling. `"action"`: each action up to its own first unlikely
            token. `"episode"`: each episode up to its first unlikely token, every later action included: from there
            on the student's memory holds what the teacher would not have written, and the teacher scores states it
            never visited. `"none"`: every token of the student's episodes, the threshold then only finding the branch
            points `distill_warmup_steps` leaves out of the teacher's episodes: a student that must still learn
            to act in its own states after the warm-up gets the teacher's targets there, where the episode's
            first divergence would stop them (docs/results.md, "After the release"). Needs a warm-up.
        teacher_generations (`int`, *optional*, defaults to `0`):
            Episodes per question the teacher plays (sampled at `temperature`, beside the student's
            `num_generations`), on which the student is distilled as well, every action token in the exact state the
            teacher played it in. There every prefix and every memory is one the teacher wrote itself, so its
            distributions are its own policy's; on the student's episodes they hold only up to the first divergence
            (see `distill_divergence_scope`). These episodes add to the distillation loss only, never to PPO. Like
            sequence-level distillation on teacher outputs in TRL's `GKDTrainer` (`seq_kd`, `lmbda`). 0 = off; it
            needs `distill_coef > 0`.
        distill_warmup_steps (`int`, *optional*, defaults to `0`):
            Optimizer steps at the start of training during which the distillation covers only the teacher's own
            episodes (`teacher_generations`), not the student's (PPO still covers the student's), and leaves out each
            teacher episode's branch point: its first token the student gives a probability below
            `distill_divergence_threshold`. The student first learns to act in the states the teacher's choices lead
            to, and only then, on its own episodes, to make those choices. On-policy distillation flips the first
            divergent token at once, and so moves the student into states it cannot yet act in (docs/results.md,
            "Why MemOPD first breaks its student"). 0 = off; it needs `teacher_generations > 0` and
            `distill_divergence_threshold > 0`.
        distill_warmup_kl_coef (`float`, *optional*, defaults to `0.0`):
            Weight of a KL penalty to the student's start (the frozen reference of `kl_coef`) on the student's own
            episodes during `distill_warmup_steps`, in place of `kl_coef`. Imitating the teacher's continuations also
            raises the student's probability of taking the teacher's branch, by generalization, before it can act
            after it; this holds the student's own choices until the warm-up ends. 0 = off; it needs
            `distill_warmup_steps > 0`.
        distill_warmup_anchor_coef (`float`, *optional*, defaults to `0.0`):
            Weight of the forward KL from the student's start (the frozen reference of `kl_coef`) to the student, over
            the full vocabulary, on the student's own episodes during `distill_warmup_steps`: the start is the teacher
            of the student's own episodes while the teacher's episodes teach it the continuations. Its gradient grows
            with how far each distribution moved, where the sampled-token KL of `distill_warmup_kl_coef` vanishes on
            the near-certain tokens of a start that samples almost deterministically; so it holds the student at
            learning rates where that KL does not (docs/results.md, "Holding the start that never had the policy"). 0 = off;
            it needs `distill_warmup_steps > 0`.
        distill_warmup_release_loss (`float`, *optional*, defaults to `0.0`):
            When > 0, the warm-up ends once the student can act in the teacher's states at every turn: at the first
            rollout after the distillation loss on the teacher's episodes (nats per distilled token), measured on each
            rollout's first update, before the student has trained on it, over the last 3 rollouts, has fallen to
            this value in its worst turn; `distill_warmup_steps` then bounds the warm-up. A release before then flips
            the student's choices into states it cannot yet act in: on the offline world the mean over turns hides
            the answer turn, which the student learns last (docs/results.md, "What the release falls into"). 0 = the
            warm-up lasts `distill_warmup_steps`; without a warm-up (`distill_warmup_steps=0`) it does nothing.

        > Parameters that control the training

        ppo_coef (`float`, *optional*, defaults to `1.0`):
            Weight of the PPO loss. 0 gives pure on-policy distillation.
        sampled_kl_coef (`float`, *optional*, defaults to `0.0`):
            Weight of the sampled-token reverse-KL advantage: `sampled_kl_coef * (log q(a) - log p(a))` is added to
            each action token's PPO advantage, with `q` the teacher and `p` the rollout policy at the sampled token
            `a`, both at the sampling `temperature`. 0 disables it; it needs a teacher and `ppo_coef > 0`, and can be
            used beside the full-vocabulary distillation loss or instead of it (`distill_coef=0`).
        kl_coef (`float`, *optional*, defaults to `0.0`):
            Weight of a KL penalty to the student's initial weights (a frozen reference copy); 0 disables it.
        epsilon (`float`, *optional*, defaults to `0.2`):
            Lower clipping range of the PPO importance ratio.
        epsilon_high (`float`, *optional*):
            Upper clipping range; defaults to `epsilon`.
        loss_aggregation (`str`, *optional*, defaults to `"token_mean"`):
            How PPO's per-token losses are averaged: `"token_mean"` or `"sequence_mean"` (per invocation, then over
            invocations).
        importance_sampling_correction (`bool`, *optional*):
            Correct PPO for the gap between the engine that sampled the rollout and the trained policy, as TRL's GRPO
            does with vLLM (`vllm_importance_sampling_correction`; here for either engine): the student scores the
            rollout's tokens once (no grad), those log-probs are PPO's old log-probs (so the first update's ratio is
            exactly 1), and each token's PPO loss is weighted by `p_student / p_engine`, truncated or masked as
            `importance_sampling_mode` says. `None` (default): on with `use_vllm`, off with transformers' `generate`
            (whose log-probs are the trained model's own; the extra forward would only absorb float noise).
        importance_sampling_mode (`str`, *optional*, defaults to `"sequence_mask"`):
            `"token_truncate"`, `"token_mask"`, `"sequence_truncate"` or `"sequence_mask"` (TRL's modes and default; a
            sequence is one invocation). See `memopd_trl.losses.importance_sampling_weights`.
        importance_sampling_clip_min (`float`, *optional*):
            Lower bound of the weights (TRL's `vllm_importance_sampling_clip_min`); `None` leaves it open.
        importance_sampling_clip_max (`float`, *optional*, defaults to `3.0`):
            Upper bound of the weights (TRL's `vllm_importance_sampling_clip_max`); `None` leaves it open.
        advantage_estimator (`str`, *optional*, defaults to `"group"`):
            `"group"`: final reward normalized within each question's `num_generations` episodes, broadcast to every
            action token (no critic). `"gae"`: generalized advantage estimation with a value head.
        scale_rewards (`str`, *optional*, defaults to `"group"`):
            What group-normalized advantages are divided by (TRL's `scale_rewards`): `"group"`, the group's standard
            deviation; `"batch"`, the standard deviation of the process's rollout batch; `"none"`, nothing (Dr. GRPO).
            `True` and `False` mean `"group"` and `"none"`.
        gamma (`float`, *optional*, defaults to `1.0`):
            Discount factor of GAE.
        lam (`float`, *optional*, defaults to `1.0`):
            GAE lambda.
        vf_coef (`float`, *optional*, defaults to `0.1`):
            Weight of the value loss when `advantage_estimator="gae"`.
        cliprange_value (`float`, *optional*, defaults to `0.2`):
            Clipping range of the value predictions around the rollout's values in the value loss (TRL's PPO name).
        num_iterations (`int`, *optional*, defaults to `1`):
            Optimizer updates made on one rollout batch before sampling a new one (GRPO's `num_iterations`, PPO's
            epochs); old log-probs stay those of the rollout.

        > Parameters that control packing and scoring

        max_tokens_per_row (`int` or `None`, *optional*, defaults to `4096`):
            Token budget of one packed row; whole invocations (and whole shared-prefix trees, unless a tree outgrows
            a row) are packed into rows, never split. The trainer forwards and back-propagates each row on its own and
            the rows' gradients add up to the whole batch's, so this bounds the tokens of one forward, and with them
            activation memory, whatever the batch size. `None`: a process's whole batch in one row (one forward). On
            CPU, rows of a few thousand tokens are fastest (docs/benchmarks.md); on a GPU with padding-free attention
            larger rows (e.g. 16384) keep it busier, at more activation memory. With `sdpa`/`eager` a row also pays a
            dense `width x width` mask.
        share_prefix (`bool`, *optional*, defaults to `True`):
            Shared-prefix packing: invocations that begin with the same tokens (every turn of every episode of one
            question shares the system prompt and the task) are laid out as a tree, the prefix scored once, exactly.
            Used when every model that scores the batch runs `"memopd_sdpa_varlen"`, `"sdpa"` or `"eager"`
            attention; with others the trainer packs whole invocations. Set `False` to always pack whole invocations.
        logit_chunk_size (`int`, *optional*, defaults to `1024`):
            Action tokens per chunk when applying the LM heads, which bounds peak memory by chunk x vocabulary.

        > Parameters that control the logging and diagnostics

        distill_diagnostics (`bool`, *optional*, defaults to `True`):
            Whether to log, at every update where the teacher scores, `distill/teacher_confidence`,
            `distill/agreement`, `distill/forward_kl`, `distill/reverse_kl` and `distill/student_entropy` (each also
            over the tokens of rewarded and of unrewarded episodes), from one extra chunked pass over both LM heads
            at the action tokens without gradients.
        misalignment_audit_steps (`int`, *optional*, defaults to `10`):
            With `teacher_scoring="aligned"`, every `misalignment_audit_steps` steps the teacher also scores the same
            actions under the flattened persistent history, and `misalignment/kl_turn_{k}` logs its KL(aligned ||
            persistent) by turn. Costs one extra teacher forward on the persistent rows on those steps. 0 disables it.

    > [!NOTE]
    > These parameters have default values different from [`~transformers.TrainingArguments`] or TRL's base config:
    > - `learning_rate`: Defaults to `1e-6` instead of `5e-5`.
    > - `logging_steps`: Defaults to `1` instead of `500`.
    > - `per_device_train_batch_size`: Defaults to `2` instead of `8`: questions per device per rollout, each played
    >   `num_generations` times.
    > - `remove_unused_columns`: Defaults to `False` instead of `True`: the trainer reads whole HotpotQA-format
    >   records, not model inputs.
    > - `bf16`: Left unset (`None`; `null` in a TrlParser config file), it is on only where a CUDA GPU is available
    >   and neither `use_cpu` nor `fp16` is set (TRL's base config turns it on whenever `fp16` is not set), so
    >   `MemOPDConfig()` works as it is on a CPU-only machine.
    > - `gradient_checkpointing`: Left unset (`None`, off) as in [`~transformers.TrainingArguments`], instead of
    >   TRL's `True`; it is a deprecated alias of `activation_checkpointing`.
    """

    _VALID_DICT_FIELDS = _BaseConfig._VALID_DICT_FIELDS + ["model_init_kwargs", "teacher_model_init_kwargs"]

    # Parameters whose default values are overridden from TrainingArguments
    learning_rate: float = field(default=1e-6, metadata={"help": "The initial learning rate for AdamW."})
    logging_steps: float = field(
        default=1,
        metadata={
            "help": "Log every X updates steps. Should be an integer or a float in range `[0,1)`. If smaller than 1, "
            "will be interpreted as ratio of total training steps."
        },
    )
    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={"help": "Deprecated alias of `activation_checkpointing` (off by default for this trainer)."},
    )
    remove_unused_columns: bool = field(
        default=False,
        metadata={"help": "Kept False: the trainer reads whole HotpotQA-format records, not model inputs."},
    )
    per_device_train_batch_size: int = field(
        default=2, metadata={"help": "Questions per device per rollout; each is played `num_generations` times."}
    )
    bf16: bool | None = field(
        default=None,
        metadata={
            "help": "Whether to train in bf16 mixed precision. Left unset (`null` in a TrlParser --config file) it is on only "
            "where a CUDA GPU is available and neither `use_cpu` nor `fp16` is set."
        },
    )

    # Parameters that control the model
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={"help": "Keyword arguments for `AutoModelForCausalLM.from_pretrained` when `model` is a string."},
    )
    attn_implementation: str = field(
        default="sdpa",
        metadata={
            "help": "Attention implementation of the student when loaded from a string.",
            "choices": list(_ATTN_IMPLEMENTATIONS),
        },
    )
    trust_remote_code: bool = field(
        default=False,
        metadata={"help": "Whether to run model or tokenizer code shipped with a checkpoint. Off unless trusted."},
    )
    disable_dropout: bool = field(
        default=True, metadata={"help": "Whether to disable dropout in the student and the teacher."}
    )

    # Parameters that control the teacher
    teacher_model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Teacher model id or path, used when the trainer is given no `teacher_model`."},
    )
    teacher_model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={"help": "Keyword arguments for `AutoModelForCausalLM.from_pretrained` when the teacher is a string."},
    )
    teacher_attn_implementation: str | None = field(
        default=None,
        metadata={"help": "Attention implementation of the teacher; defaults to `attn_implementation`."},
    )
    teacher_model_server_url: str | None = field(
        default=None,
        metadata={
            "help": 'Base URL of a vLLM server hosting the teacher (e.g. "http://127.0.0.1:8000"); the teacher is then '
            "never loaded in a training process. Needs `loss_top_k` >= 1, `teacher_generations=0`, "
            "`distill_temperature=1.0`, and `temperature=1.0` with `sampled_kl_coef` or "
            "`distill_divergence_threshold`."
        },
    )
    teacher_server_timeout: float = field(
        default=300.0, metadata={"help": "Seconds one request to the teacher server may take."}
    )
    teacher_server_max_retries: int = field(
        default=3,
        metadata={"help": "Retries of a failed teacher-server request (exponential backoff from 1 s) before failing."},
    )

    # Parameters that control the rollouts
    max_new_tokens: int = field(default=128, metadata={"help": "Maximum number of tokens sampled per model call."})
    max_prompt_length: int = field(
        default=2048,
        metadata={"help": "Maximum context tokens of a model call; longer contexts are shrunk by the environment."},
    )
    num_generations: int = field(
        default=4,
        metadata={
            "help": "Episodes per question (a group, for group-normalized advantages); at least 2 with "
            "`advantage_estimator=group` and `ppo_coef` > 0."
        },
    )
    temperature: float = field(
        default=1.0, metadata={"help": "Sampling temperature of the rollouts; also that of the PPO log-probs."}
    )
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling threshold of the rollouts."})
    top_k: int = field(default=0, metadata={"help": "Top-k sampling of the rollouts (0 disables it)."})

    # Parameters that control generation acceleration powered by vLLM
    use_vllm: bool = field(
        default=False,
        metadata={
            "help": "Generate the rollouts with a vLLM engine colocated on each GPU, kept in sync with the student's "
            "weights. Needs a CUDA GPU and `pip install memopd-trl[vllm]`."
        },
    )
    vllm_gpu_memory_utilization: float = field(
        default=0.3,
        metadata={
            "help": "Fraction of each GPU's memory the vLLM engine may take (weights and KV cache). It shares the GPU "
            "with the student, its optimizer state and a full teacher, so the default leaves most memory to them."
        },
    )
    vllm_max_model_length: int | None = field(
        default=None,
        metadata={
            "help": "Longest sequence the vLLM engine accepts; at least `max_prompt_length + max_new_tokens`, the "
            "default."
        },
    )
    vllm_enable_sleep_mode: bool = field(
        default=False,
        metadata={
            "help": "Release the vLLM engine's GPU memory between rollouts; the weights are then pushed again before "
            "every rollout."
        },
    )

    # Parameters that control the distillation loss
    distill_coef: float = field(
        default=1.0, metadata={"help": "Weight of the distillation loss (0 gives the PPO-only baseline)."}
    )
    beta: float = field(
        default=0.5,
        metadata={"help": "Generalized JSD interpolation: 0 = KL(teacher||student), 1 = KL(student||teacher)."},
    )
    distill_temperature: float = field(
        default=1.0, metadata={"help": "Temperature of both distributions in the distillation loss."}
    )
    loss_top_k: int = field(
        default=0,
        metadata={
            "help": "Distill on the teacher's top-k tokens plus a tail bucket (TRL's server distillation); 0 = the "
            "full vocabulary (local teacher only). A teacher server returns this many log-probs per position."
        },
    )
    loss_add_tail: bool = field(
        default=True,
        metadata={"help": "With `loss_top_k`: a tail bucket for the mass off the teacher's top-k (else renormalize)."},
    )
    teacher_scoring: str = field(
        default="aligned",
        metadata={
            "help": "`aligned`: teacher scores each action in the student's exact context (MemOPD). `persistent`: "
            "under the episode flattened into one growing history (the matched control).",
            "choices": ["aligned", "persistent"],
        },
    )
    distill_divergence_threshold: float = field(
        default=0.0,
        metadata={
            "help": "Distill each action only up to its first sampled token whose teacher probability (at the sampling "
            "temperature) is below this value, that token included: after it the teacher continues a prefix it never "
            "saw. 0 = every token. Needs `distill_coef` > 0."
        },
    )
    distill_divergence_scope: str = field(
        default="action",
        metadata={
            "help": "Where `distill_divergence_threshold` stops: `action` (each action up to its own first unlikely "
            "token), `episode` (each episode up to its first unlikely token: later states are ones the teacher never "
            "saw), or `none` (every token of the student's episodes; the threshold only finds the warm-up's branch "
            "points).",
            "choices": ["action", "episode", "none"],
        },
    )
    teacher_generations: int = field(
        default=0,
        metadata={
            "help": "Episodes per question the teacher plays beside the student's, distilled on in the teacher's own "
            "states (distillation only, no PPO); 0 = off. Needs `distill_coef` > 0."
        },
    )

    distill_warmup_steps: int = field(
        default=0,
        metadata={
            "help": "Optimizer steps at the start during which the student is distilled on the teacher's own episodes "
            "only (`teacher_generations`), each without its branch point (its first token the student gives less "
            "than `distill_divergence_threshold`), and not on its own; 0 = off."
        },
    )
    distill_warmup_kl_coef: float = field(
        default=0.0,
        metadata={
            "help": "Weight of the KL to the student's start on its own episodes during `distill_warmup_steps` (in "
            "place of `kl_coef`), which holds its own choices while it learns the teacher's; 0 = off."
        },
    )
    distill_warmup_anchor_coef: float = field(
        default=0.0,
        metadata={
            "help": "Weight of the full-vocabulary forward KL from the student's start to the student on its own "
            "episodes during `distill_warmup_steps`: the start teaches the student's own episodes while the teacher's "
            "teach it the continuations; 0 = off."
        },
    )
    distill_warmup_release_loss: float = field(
        default=0.0,
        metadata={
            "help": "When > 0, the warm-up ends at the first rollout after the loss on the teacher's episodes "
            "(measured before training on each rollout, over the last 3) has fallen to this value in its worst turn, "
            "within `distill_warmup_steps`; 0 = the warm-up lasts `distill_warmup_steps`."
        },
    )

    # Parameters that control the training
    ppo_coef: float = field(default=1.0, metadata={"help": "Weight of the PPO loss (0 gives pure distillation)."})
    sampled_kl_coef: float = field(
        default=0.0,
        metadata={
            "help": "Weight of the sampled-token reverse-KL advantage `log q(a) - log p(a)` (teacher q, rollout "
            "policy p, sampled token a, at the sampling temperature) added to each token's PPO advantage; 0 = off. "
            "Needs a teacher and `ppo_coef` > 0."
        },
    )
    kl_coef: float = field(
        default=0.0, metadata={"help": "Weight of a KL penalty to a frozen copy of the initial student (0 = off)."}
    )
    epsilon: float = field(default=0.2, metadata={"help": "Lower clipping range of the PPO importance ratio."})
    epsilon_high: float | None = field(
        default=None, metadata={"help": "Upper clipping range of the PPO ratio; defaults to `epsilon`."}
    )
    loss_aggregation: str = field(
        default="token_mean",
        metadata={"help": "Averaging of PPO's per-token losses.", "choices": ["token_mean", "sequence_mean"]},
    )
    importance_sampling_correction: bool | None = field(
        default=None,
        metadata={
            "help": "Weight PPO's per-token losses by p_student / p_engine at the rollout (truncated or masked), with "
            "the student's own log-probs as the old ones; None: on with `use_vllm`, off otherwise."
        },
    )
    importance_sampling_mode: str = field(
        default="sequence_mask",
        metadata={
            "help": "How the importance weights are bounded: per token or per invocation, truncated or masked.",
            "choices": ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"],
        },
    )
    importance_sampling_clip_min: float | None = field(
        default=None, metadata={"help": "Lower bound of the importance weights (None: open)."}
    )
    importance_sampling_clip_max: float | None = field(
        default=3.0, metadata={"help": "Upper bound of the importance weights (None: open)."}
    )
    advantage_estimator: str = field(
        default="group",
        metadata={
            "help": "`group`: group-normalized final reward (no critic). `gae`: GAE with a value head.",
            "choices": ["group", "gae"],
        },
    )
    scale_rewards: str = field(
        default="group",
        metadata={
            "help": "What group-normalized advantages are divided by: `group` (the group's std), `batch` (the rollout "
            "batch's std) or `none`; true/false mean group/none.",
        },
    )
    gamma: float = field(default=1.0, metadata={"help": "Discount factor of GAE."})
    lam: float = field(default=1.0, metadata={"help": "GAE lambda."})
    vf_coef: float = field(default=0.1, metadata={"help": "Weight of the value loss with `advantage_estimator=gae`."})
    cliprange_value: float = field(
        default=0.2,
        metadata={"help": "Clipping range of the value predictions around the rollout's values in the value loss."},
    )
    num_iterations: int = field(
        default=1,
        metadata={"help": "Optimizer updates made on one rollout batch before sampling a new one (GRPO's name)."},
    )

    # Parameters that control packing and scoring
    max_tokens_per_row: int | None = field(
        default=4096,
        metadata={
            "help": "Token budget of one packed row (whole invocations, never split). Each row is forwarded and "
            "back-propagated on its own, so this bounds the tokens (and activation memory) of one forward. None: a "
            "process's whole batch in one row."
        },
    )
    share_prefix: bool = field(
        default=True,
        metadata={
            "help": "Shared-prefix packing: invocations that begin with the same tokens are laid out as a tree, the "
            "prefix scored once, exactly. Used when every scoring model runs `memopd_sdpa_varlen`, `sdpa` or `eager` "
            "attention; with others whole invocations are packed. `False` always packs whole invocations."
        },
    )
    logit_chunk_size: int = field(
        default=1024, metadata={"help": "Action tokens per chunk when applying LM heads (bounds peak memory)."}
    )

    # Parameters that control the logging and diagnostics
    distill_diagnostics: bool = field(
        default=True,
        metadata={
            "help": "Log teacher confidence, argmax agreement, forward/reverse KL and student entropy at the action "
            "tokens (`distill/*`, also split by rewarded/unrewarded episodes) at every update where the teacher scores."
        },
    )
    misalignment_audit_steps: int = field(
        default=10,
        metadata={
            "help": "With aligned teacher scoring, every this many steps the teacher also scores the actions under the "
            "persistent history and `misalignment/kl_turn_{k}` logs the KL between the two (one extra teacher forward "
            "then). 0 = off."
        },
    )

    def __post_init__(self):
        if self.bf16 is None:
            # TRL's base turns bf16 on by default, which fails on a CPU-only machine; only do so where it is safe.
            self.bf16 = not self.fp16 and torch.cuda.is_available() and not self.use_cpu
        super().__post_init__()
        self._check()

    def _check_teacher_server(self):
        """What a teacher on a server can and cannot give, refused here before any model is loaded."""
        url = self.teacher_model_server_url
        if not url.strip():
            raise ValueError("`teacher_model_server_url` is empty: give the teacher server's base URL, or None.")
        if self.loss_top_k < 1:
            raise ValueError(
                f"A teacher server ({url}) gives its top-k log-probs only: set `loss_top_k` >= 1 (the log-probs per "
                "position, at most the server's `--max-logprobs`)."
            )
        if self.teacher_generations > 0:
            raise ValueError(
                f"`teacher_generations` ({self.teacher_generations}) needs the teacher's weights in the training "
                f"process to play its own episodes; the teacher at {url} is served. Set `teacher_generations=0`."
            )
        # vLLM computes prompt log-probs from the raw logits: no sampling temperature applies to them.
        if self.distill_temperature != 1.0:
            raise ValueError(
                f"A teacher server ({url}) scores at temperature 1 (vLLM applies no temperature to prompt "
                f"log-probs): `distill_temperature` must be 1.0, got {self.distill_temperature}."
            )
        if self.temperature != 1.0 and (self.sampled_kl_coef > 0 or self.distill_divergence_threshold > 0):
            raise ValueError(
                f"`sampled_kl_coef` and `distill_divergence_threshold` compare the teacher's log-prob of each sampled "
                f"token at the sampling temperature ({self.temperature}), but a teacher server ({url}) scores at "
                "temperature 1: sample at `temperature=1.0`, or turn both off."
            )

    def _check(self):
        def bad(name: str, allowed: str):
            raise ValueError(f"`{name}` must be {allowed}, got {getattr(self, name)!r}.")

        for name in (
            "distill_coef", "ppo_coef", "kl_coef", "vf_coef", "epsilon", "cliprange_value", "sampled_kl_coef",
            "misalignment_audit_steps",
        ):  # fmt: skip
            if getattr(self, name) < 0:
                bad(name, ">= 0")
        if self.distill_coef == 0 and self.ppo_coef == 0:
            raise ValueError("`distill_coef` and `ppo_coef` are both 0: there is nothing to train.")
        if self.sampled_kl_coef > 0 and self.ppo_coef == 0:
            raise ValueError(
                f"`sampled_kl_coef` ({self.sampled_kl_coef}) adds to the PPO advantages, but `ppo_coef` is 0, so they "
                "are never used: set `ppo_coef` > 0, or `sampled_kl_coef=0` (and `distill_coef` > 0 for pure "
                "distillation)."
            )
        if not 0.0 <= self.distill_divergence_threshold < 1.0:
            bad("distill_divergence_threshold", "in [0, 1) (a probability; 0 turns it off)")
        if self.teacher_generations < 0:
            bad("teacher_generations", ">= 0")
        if self.teacher_generations > 0 and self.distill_coef == 0:
            raise ValueError(
                f"`teacher_generations` ({self.teacher_generations}) adds episodes to the distillation loss, but "
                "`distill_coef` is 0: set `distill_coef` > 0, or `teacher_generations=0`."
            )
        if self.distill_warmup_steps < 0:
            bad("distill_warmup_steps", ">= 0")
        if self.distill_warmup_steps > 0 and self.teacher_generations == 0:
            raise ValueError(
                f"`distill_warmup_steps` ({self.distill_warmup_steps}) distills on the teacher's own episodes only, "
                "but `teacher_generations` is 0: set `teacher_generations` > 0, or `distill_warmup_steps=0`."
            )
        if self.distill_warmup_release_loss < 0:  # it only ends a warm-up early: without one it does nothing
            bad("distill_warmup_release_loss", ">= 0")
        for name in ("distill_warmup_kl_coef", "distill_warmup_anchor_coef"):
            value = getattr(self, name)
            if value < 0:
                bad(name, ">= 0")
            if value > 0 and self.distill_warmup_steps == 0:
                raise ValueError(
                    f"`{name}` ({value}) holds the student to its start during the distillation warm-up, but "
                    f"`distill_warmup_steps` is 0: set `distill_warmup_steps` > 0, or `{name}=0`."
                )
        if self.distill_warmup_steps > 0 and self.distill_divergence_threshold == 0:
            raise ValueError(
                f"`distill_warmup_steps` ({self.distill_warmup_steps}) leaves out the teacher's branch points, the "
                "tokens the student gives less than `distill_divergence_threshold`, which is 0: set it > 0 (e.g. 0.1)."
            )
        if self.distill_divergence_scope not in ("action", "episode", "none"):
            bad("distill_divergence_scope", '"action", "episode" or "none"')
        if self.distill_divergence_scope == "none" and self.distill_warmup_steps == 0:
            raise ValueError(
                '`distill_divergence_scope="none"` leaves the threshold only the branch points of the warm-up, but '
                "`distill_warmup_steps` is 0: set `distill_divergence_threshold=0` to distill every token instead."
            )
        if self.distill_divergence_threshold > 0 and self.distill_coef == 0:
            raise ValueError(
                f"`distill_divergence_threshold` ({self.distill_divergence_threshold}) selects the tokens of the "
                "distillation loss, but `distill_coef` is 0: set `distill_coef` > 0, or `distill_divergence_threshold=0`."
            )
        if not 0.0 <= self.beta <= 1.0:
            bad("beta", "in [0, 1]")
        if self.loss_top_k < 0:
            bad("loss_top_k", ">= 0 (0 = the full vocabulary)")
        # TRL's bool values of `scale_rewards`, and their strings from a command line
        aliases = {True: "group", False: "none", "true": "group", "false": "none", "True": "group", "False": "none"}
        self.scale_rewards = aliases.get(self.scale_rewards, self.scale_rewards)
        if self.scale_rewards not in ("group", "batch", "none"):
            bad("scale_rewards", '"group", "batch" or "none"')
        if self.teacher_server_max_retries < 0 or self.teacher_server_timeout <= 0:
            raise ValueError(
                "`teacher_server_max_retries` must be >= 0 and `teacher_server_timeout` > 0, got "
                f"{self.teacher_server_max_retries} and {self.teacher_server_timeout}."
            )
        if self.teacher_model_server_url is not None:
            self._check_teacher_server()
        if self.epsilon_high is not None and self.epsilon_high < 0:
            bad("epsilon_high", ">= 0 or None")
        for name in ("distill_temperature", "temperature"):
            if getattr(self, name) <= 0:
                bad(name, "> 0")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "in (0, 1]")
        if self.top_k < 0:
            bad("top_k", ">= 0")
        if not 0.0 < self.vllm_gpu_memory_utilization <= 1.0:
            bad("vllm_gpu_memory_utilization", "in (0, 1]")
        for name in (
            "max_new_tokens",
            "max_prompt_length",
            "num_generations",
            "num_iterations",
            "logit_chunk_size",
        ):
            if getattr(self, name) < 1:
                bad(name, ">= 1")
        if self.max_tokens_per_row is not None and self.max_tokens_per_row < 1:
            bad("max_tokens_per_row", "None or >= 1")
        longest_call = self.max_prompt_length + self.max_new_tokens
        if self.vllm_max_model_length is not None and self.vllm_max_model_length < longest_call:
            bad(
                "vllm_max_model_length",
                f"None or >= max_prompt_length + max_new_tokens = {longest_call} (the longest model call)",
            )
        if not 0.0 <= self.gamma <= 1.0:
            bad("gamma", "in [0, 1]")
        if not 0.0 <= self.lam <= 1.0:
            bad("lam", "in [0, 1]")
        for name in ("importance_sampling_clip_min", "importance_sampling_clip_max"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                bad(name, "None or > 0")
        clip_min, clip_max = self.importance_sampling_clip_min, self.importance_sampling_clip_max
        if clip_min is not None and clip_max is not None and clip_min > clip_max:
            bad("importance_sampling_clip_min", f"<= importance_sampling_clip_max ({clip_max})")
        choices = {
            "importance_sampling_mode": ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"),
            "teacher_scoring": ("aligned", "persistent"),
            "loss_aggregation": ("token_mean", "sequence_mean"),
            "advantage_estimator": ("group", "gae"),
            "attn_implementation": _ATTN_IMPLEMENTATIONS,
        }
        if self.teacher_attn_implementation is not None:
            choices["teacher_attn_implementation"] = _ATTN_IMPLEMENTATIONS
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                bad(name, f"one of {list(allowed)}")
        if self.advantage_estimator == "group" and self.ppo_coef > 0 and self.num_generations < 2:
            raise ValueError(
                "`advantage_estimator='group'` normalizes rewards within a question's episodes, so it needs "
                f"`num_generations` >= 2 (got {self.num_generations}); raise it or use `advantage_estimator='gae'`."
            )
