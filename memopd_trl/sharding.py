"""
Sharded training (FSDP2, DeepSpeed ZeRO-3): what the trainer does where weights are split across processes.

- **The strategy asked for is the strategy run** ([`check_strategy`]). accelerate gives FSDP only to accelerator
  processes: on CPU processes (gloo) it quietly prepares DDP instead. The trainer turns FSDP on there itself, so that
  a CPU run shards as asked, and it stops with an error wherever the strategy asked for cannot run.
- **Frozen models are sharded like the student** ([`prepare_frozen_model`]): the teacher and the reference go
  through TRL's `prepare_fsdp` / `prepare_deepspeed`, as TRL's GKD prepares its teacher; under FSDP2 each decoder
  layer is its own unit, so a forward gathers one layer at a time, never the whole model.
- **Generation gathers the student once per rollout** ([`gathered_for_generation`]). Every forward of a sharded model
  is collective, but processes sample different numbers of tokens, so decoding on shards would leave some processes
  waiting forever. The weights are gathered for the rollout and freed after it (TRL's `unwrap_model_for_generation`
  does the same for ZeRO-3).
- **The LM heads the chunked losses read** are gathered by [`~memopd_trl.scoring.gathered_lm_head`].
- **Every forward of a sharded model happens on every process** ([`all_processes_agree`]): where a process would
  skip one (a batch without model calls, an audit with nothing to audit), every process skips it.
"""

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedType
from torch import nn
from trl.models.utils import prepare_deepspeed, prepare_fsdp

from .packing import split_rows


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() in ("1", "true", "yes")


def requested_strategy(args) -> str | None:
    """
    The sharding strategy this run was asked for, from the training arguments and from `accelerate launch`'s
    environment: `"fsdp"`, `"deepspeed"`, or `None` (data parallel, or one process).
    """
    if getattr(args, "deepspeed", None) or _env_flag("ACCELERATE_USE_DEEPSPEED"):
        return "deepspeed"
    if getattr(args, "fsdp", None) or getattr(args, "fsdp_plugin_args", None) or _env_flag("ACCELERATE_USE_FSDP"):
        return "fsdp"
    return None


def check_strategy(accelerator: Accelerator, args) -> None:
    """
    Make the accelerator run the strategy the run asked for, or stop.

    - FSDP on CPU processes: accelerate prepares FSDP only on accelerators and otherwise falls back to DDP without a
      word; here FSDP2 is turned on for the gloo processes (torch's `fully_shard` runs there).
    - FSDP version 1 is refused (the chunked losses gather FSDP2's sharded heads; FSDP1 flattens them).
    - A strategy that accelerate did not set up (e.g. DeepSpeed asked for, DDP prepared) is an error.

    Args:
        accelerator (`Accelerator`):
            The trainer's accelerator, just created.
        args (`TrainingArguments`):
            The trainer's arguments.
    """
    requested = requested_strategy(args)
    state = accelerator.state
    if requested == "fsdp" and state.distributed_type == DistributedType.MULTI_CPU:
        from accelerate.utils import FullyShardedDataParallelPlugin

        plugin = FullyShardedDataParallelPlugin(**(args.fsdp_plugin_args or {}))
        if state.mixed_precision != "no":
            plugin.set_mixed_precision(state.mixed_precision)
        state.fsdp_plugin = plugin
        # Both singletons: every later `AcceleratorState()` copies the process state's fields over its own.
        PartialState().distributed_type = DistributedType.FSDP
        state.distributed_type = DistributedType.FSDP
        os.environ["ACCELERATE_USE_FSDP"] = "true"
    elif requested is not None and state.distributed_type == DistributedType.NO:
        raise ValueError(
            f"This run asked for {requested.upper()} but runs as a single process that shards nothing. Start it with "
            "`accelerate launch --num_processes N` (N >= 2), or drop the sharding config for a single-process run."
        )
    expected = {"fsdp": DistributedType.FSDP, "deepspeed": DistributedType.DEEPSPEED}.get(requested)
    if expected is not None and state.distributed_type != expected:
        raise ValueError(
            f"This run asked for {requested.upper()}, but accelerate prepared {state.distributed_type.value} "
            f"({state.num_processes} processes on {state.device.type}); refusing to train under another strategy "
            "than the one asked for. Check the accelerate config (`distributed_type`) and the launch command."
        )
    if state.distributed_type == DistributedType.FSDP and state.fsdp_plugin.fsdp_version != 2:
        raise ValueError(
            "MemOPDTrainer supports FSDP version 2 only (`fsdp_version: 2` in the accelerate config, or "
            "`fsdp_config={'fsdp_version': 2}`): the chunked losses gather FSDP2's sharded LM heads, which FSDP "
            "version 1 flattens into one buffer."
        )


def is_fsdp2(accelerator: Accelerator) -> bool:
    return accelerator.state.distributed_type == DistributedType.FSDP and accelerator.state.fsdp_plugin.fsdp_version == 2


def is_sharded(accelerator: Accelerator) -> bool:
    """Whether the weights are split across processes, so that every forward is collective (FSDP, ZeRO-3)."""
    if accelerator.state.distributed_type == DistributedType.FSDP:
        return True
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return plugin is not None and plugin.zero_stage == 3


def all_processes_agree(accelerator: Accelerator, flag: bool) -> bool:
    """`flag` and-ed over the processes (collective). Used where a process would skip a collective forward."""
    if accelerator.num_processes == 1:
        return flag
    value = torch.tensor([float(flag)], device=accelerator.device)
    return bool(accelerator.reduce(value, reduction="sum").item() == accelerator.num_processes)


def prepare_frozen_model(model: nn.Module, accelerator: Accelerator) -> nn.Module:
    """
    Freeze a model (teacher, reference: no parameter requires a gradient) and place it for scoring, sharded as the
    student is.

    - FSDP2: each decoder layer (the classes of `model._no_split_modules`, as accelerate wraps the student) is sharded
      on its own, then the whole model through TRL's `prepare_fsdp`, so a forward gathers one layer at a time.
    - DeepSpeed ZeRO-3: TRL's `prepare_deepspeed` (an inference engine that gathers layer by layer).
    - Otherwise (DDP, ZeRO-1/2, one process): `accelerator.prepare_model(model, evaluation_mode=True)`, a full copy.

    Returns:
        `nn.Module`: the model to call (in evaluation mode).
    """
    model = model.eval().requires_grad_(False)
    state = accelerator.state
    if state.distributed_type == DistributedType.FSDP:
        from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        plugin = state.fsdp_plugin
        model = model.to(accelerator.device)
        plugin.set_auto_wrap_policy(model)
        policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
        layers = [module for module in model.modules() if policy is not None and policy(module)]
        for layer in layers:
            fully_shard(layer, reshard_after_forward=True, mp_policy=plugin.mixed_precision_policy or MixedPrecisionPolicy())
        model = prepare_fsdp(model, accelerator)
        # FSDP keeps a root's own weights (here the final norm and the LM head) after forward, for the backward a
        # frozen model never runs; freed instead, and gathered for the loss when it reads the head.
        model.set_reshard_after_forward(True, recurse=False)
        return model
    if state.distributed_type == DistributedType.DEEPSPEED and state.deepspeed_plugin.zero_stage == 3:
        return prepare_deepspeed(model, accelerator)
    return accelerator.prepare_model(model, evaluation_mode=True)


@contextmanager
def gathered_for_generation(model: nn.Module) -> Iterator[nn.Module]:
    """
    Gather an FSDP2 model's weights for the duration of a rollout, then shard them again (a null context for a model
    that is not FSDP2-sharded).

    Inside, every sharded unit holds its full weights and keeps them across forwards, so decoding runs no collective
    and processes may sample different numbers of tokens. The gathering itself is collective: every process enters
    the context at the same point. Memory: the whole model per process while the rollout runs.
    """
    from torch.distributed.fsdp import FSDPModule

    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    if not units:
        yield model
        return
    # Each unit's own setting, to restore (torch has no public getter): by FSDP's rule a root keeps its weights after
    # forward unless told otherwise (applied at its first forward, which may not have run yet).
    kept = [_reshards_after_forward(unit, is_root=unit is model) for unit in units]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield model
    finally:
        for unit, reshard in zip(units, kept, strict=True):
            unit.set_reshard_after_forward(reshard, recurse=False)
            unit.reshard()


def _reshards_after_forward(unit: nn.Module, is_root: bool) -> bool:
    state = unit._get_fsdp_state()
    if is_root and state._auto_reshard_after_forward:
        return False
    return any(group.post_forward_mesh_info is not None for group in state._fsdp_param_groups)


@contextmanager
def deferred_gradient_sync(accelerator: Accelerator, model: nn.Module) -> Iterator[None]:
    """
    No gradient reduction across processes for the backward passes inside (every packed row of a batch but its last:
    the reduction waits for the last row, as it would for the last micro-batch of a gradient accumulation).
    """
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


def rows_for_every_process(accelerator: Accelerator, num_rows: int) -> int | None:
    """
    How many rows this process forwards for a batch of `num_rows`: with sharded weights every forward is collective,
    so every process runs as many as the process with the most (the others run rows of one padding token and no
    action); otherwise `None` (its own). Collective when sharded.
    """
    if not is_sharded(accelerator) or accelerator.num_processes == 1:
        return None
    count = torch.tensor([num_rows], device=accelerator.device)
    return int(accelerator.gather(count).max())


def forward_rows(batch: dict, accelerator: Accelerator, pad_token_id: int) -> list[dict]:
    """
    The rows of a packed batch, each to be forwarded on its own (`packing.split_rows`): a forward holds at most one
    row's tokens (`max_tokens_per_row`), so activations stay bounded however large the batch. With sharded weights
    every process runs as many rows as the process with the most (`rows_for_every_process`). Collective then.
    """
    num_rows = rows_for_every_process(accelerator, batch["input_ids"].shape[0])
    return split_rows(batch, num_rows, pad_token_id)


def idle_loss(model: nn.Module, accelerator: Accelerator, pad_token_id: int) -> torch.Tensor:
    """
    A zero loss for an update that is skipped. This process still runs a backward pass, because the others'
    gradients are reduced with its own (their batches may be fine). Under DDP a sum over every trained parameter gives
    each a (zero) gradient, so the reducer joins the same all-reduce as the other processes. With sharded weights the
    parameters are shards outside a forward, so a one-token forward gives the zero gradients and runs the same
    collectives as the others' forward and backward (every process skips there together).
    """
    if not is_sharded(accelerator):
        return sum(p.sum() for p in model.parameters() if p.requires_grad) * 0.0
    token = torch.full((1, 1), pad_token_id, dtype=torch.long, device=accelerator.device)
    return model(input_ids=token, use_cache=False).logits.sum() * 0.0
