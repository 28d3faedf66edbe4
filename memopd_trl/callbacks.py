"""
The trainer's callbacks: skipping an optimizer update on every process at once, the value head's gradients, and
preemption (a checkpoint and a clean exit on SIGTERM, and resuming from the last *complete* checkpoint).
"""

import json
import signal
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_callback import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, sort_checkpoints
from transformers.utils import logging


logger = logging.get_logger(__name__)


class UpdateSkipper(TrainerCallback):
    """
    The one place where an optimizer update is skipped: a process asks (`request`) when its batch has nothing to
    learn from or its loss is not finite; right before the optimizer step every process votes, and if any asked, all
    drop their gradients, so the step leaves the weights and the optimizer state untouched.

    The vote must be collective. Under DDP every process all-reduces its gradients and steps the same optimizer on
    the result: a process that skipped on its own would hold other weights than the rest from then on (and one that
    left the collective calls early would leave the others waiting forever).

    Args:
        accelerator (`Accelerator`): the trainer's, for the vote.
        record (`Callable[[str, float], None]`): logs a training metric (`skipped_updates`, the count so far).
    """

    def __init__(self, accelerator, record: Callable[[str, float], None]):
        self.accelerator = accelerator
        self.record = record
        self.num_skipped = 0
        self.num_votes = 0  # optimizer steps voted on (taken or skipped)
        self.last_reason: str | None = None  # of this process's last request
        self._requested = False  # by this process, since the last optimizer step
        self._run_start = (0, 0)  # (votes, skipped) when the current `train()` call started

    def start_run(self) -> None:
        """Mark the start of a `train()` call, whose updates `check_run_updated` then counts."""
        self._run_start = (self.num_votes, self.num_skipped)

    def check_run_updated(self) -> None:
        """
        A `RuntimeError` when every optimizer update since `start_run` was skipped (every batch had nothing to learn
        from, or a non-finite loss): such a run changed nothing and must not look like a success.
        """
        votes, skipped = self.num_votes - self._run_start[0], self.num_skipped - self._run_start[1]
        if votes > 0 and skipped == votes:
            raise RuntimeError(
                f"Every optimizer update of this run was skipped ({skipped} of {votes}): the weights did not change. "
                f"The last reason: {self.last_reason}. Look for failed episodes (`failed_episodes`, "
                "`rollout/failed_episodes` in the logs, warnings of the `memopd_trl.rollout` logger) or non-finite "
                "scores."
            )

    def request(self, reason: str) -> None:
        """Ask for the current update to be skipped (on this process; the vote makes it collective)."""
        self._requested = True
        self.last_reason = reason
        warnings.warn(
            f"{reason}: this update is skipped ({self.num_skipped + 1} skipped so far, counting this one).",
            stacklevel=3,
        )

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        requested = torch.tensor(float(self._requested), device=self.accelerator.device)
        self._requested = False
        self.num_votes += 1
        if self.accelerator.reduce(requested, reduction="sum").item() > 0:
            # torch optimizers step only parameters that have a gradient: with none, nothing moves, not even the
            # Adam moments (the value head is in the optimizer, so this covers it too).
            optimizer.zero_grad(set_to_none=True)
            self.num_skipped += 1
        self.record("skipped_updates", float(self.num_skipped))


class ValueHeadGradients(TrainerCallback):
    """
    The value head's gradients (`advantage_estimator="gae"`). The head lives beside the model, not in it, so neither
    the model's gradient reduction across processes (DDP, FSDP2, ZeRO-3) nor transformers' `model.zero_grad()`
    reaches it. Before each optimizer step its gradients are averaged over the processes (as the model's are), so that
    every process takes the same step and the heads stay equal; after it they are dropped, or they would add up over
    the steps of a run. Register it before `UpdateSkipper`, whose vote may then drop the averaged gradients.
    """

    def __init__(self, value_head: torch.nn.Module, accelerator):
        self.value_head = value_head
        self.accelerator = accelerator

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.accelerator.num_processes == 1:
            return
        for param in self.value_head.parameters():  # collective: every process reduces, with or without a gradient
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            param.grad = self.accelerator.reduce(grad, reduction="mean")

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.value_head.zero_grad(set_to_none=True)


class EvaluationStopped(Exception):
    """Raised by `MemOPDTrainer.evaluate` during training when a SIGTERM asks for a stop: the evaluation is dropped."""


class SaveOnSigterm(TrainerCallback):
    """
    After a SIGTERM (`requested`, set by the signal handler of `sigterm_requests`), the next step end saves a
    checkpoint and stops training, without the evaluation that step may have planned; `MemOPDTrainer.train` then
    exits with status 0. An evaluation the signal interrupts is dropped and the checkpoint of its step saved
    (`MemOPDTrainer.evaluate`). With several processes they vote (`stop_voted`; any one signalled stops them all at the
    same step), since saving is collective.
    """

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.watching = False  # inside `sigterm_requests`: only then does a signal ask for a stop
        self.reset()

    def reset(self) -> None:
        self.requested = False
        self.saved_step: int | None = None

    def exit_if_saved(self, output_dir: str) -> None:
        """After `train()`: exit with status 0 (`SystemExit(0)`) if a SIGTERM stopped it with a checkpoint."""
        if self.saved_step is None:
            return
        logger.warning(
            f"SIGTERM: stopped after step {self.saved_step} and saved checkpoint-{self.saved_step} in {output_dir}; "
            "exiting with status 0. Resume with `trainer.train(resume_from_checkpoint=True)`."
        )
        raise SystemExit(0)

    def stop_voted(self) -> bool:
        """Whether any process was asked to stop. Collective: every process calls it at the same point."""
        requested = self.requested
        accelerator = self.accelerator
        if accelerator.num_processes > 1:
            vote = torch.tensor(float(requested), device=accelerator.device)
            requested = accelerator.reduce(vote, reduction="sum").item() > 0
        return requested

    def stop_at(self, state, control) -> None:
        """Save the checkpoint of this step and stop training."""
        control.should_save = True
        control.should_training_stop = True
        self.saved_step = state.global_step

    def on_step_end(self, args, state, control, **kwargs):
        if self.stop_voted():
            self.stop_at(state, control)
            control.should_evaluate = False  # an evaluation would hold the checkpoint back for minutes


@contextmanager
def sigterm_requests(callback: SaveOnSigterm) -> Iterator[None]:
    """While training, SIGTERM asks `callback` for a checkpoint and a stop instead of killing the process."""
    if threading.current_thread() is not threading.main_thread():  # handlers can only be set from the main thread
        yield
        return

    def request(signum, frame):
        callback.requested = True
        logger.warning("SIGTERM received: finishing this step or this evaluation's turn, then saving a checkpoint.")

    previous = signal.signal(signal.SIGTERM, request)
    callback.watching = True
    try:
        yield
    finally:
        callback.watching = False
        signal.signal(signal.SIGTERM, previous)


def _is_complete(checkpoint: Path) -> bool:
    """Whether `checkpoint`'s `trainer_state.json`, the last file transformers writes into a checkpoint, parses."""
    try:
        json.loads((checkpoint / TRAINER_STATE_NAME).read_text())
    except (OSError, ValueError):
        return False
    return True


def last_complete_checkpoint(output_dir: str) -> str | bool | None:
    """
    The newest `checkpoint-N` of `output_dir` (transformers' `sort_checkpoints` orders them) that is complete: its
    `trainer_state.json`, the last file transformers writes into a checkpoint, is there and parses. Newer incomplete
    ones are warned about. Returns `True` when there is no checkpoint at all (transformers then raises its own error),
    `None` when all are incomplete (start afresh).
    """
    checkpoints = [Path(path) for path in reversed(sort_checkpoints(output_dir, PREFIX_CHECKPOINT_DIR))]
    if not checkpoints:
        return True
    skipped = []
    for checkpoint in checkpoints:
        if not _is_complete(checkpoint):
            skipped.append(checkpoint.name)
            continue
        if skipped:
            warnings.warn(
                f"Skipping incomplete checkpoint(s) {skipped} in {output_dir} (no readable {TRAINER_STATE_NAME}: the "
                f"run was killed while writing them); resuming from {checkpoint.name}.",
                UserWarning,
                stacklevel=3,
            )
        return str(checkpoint)
    warnings.warn(
        f"Every checkpoint in {output_dir} ({skipped}) is incomplete (no readable {TRAINER_STATE_NAME}: the run was "
        "killed while writing it); training starts from the beginning.",
        UserWarning,
        stacklevel=3,
    )
    return None
