"""A short training run to interrupt, for tests/test_interruptions.py: the test builds it in-process (the uninterrupted
run, and the resumed ones), and starts it as a subprocess to kill or signal.

    python tests/interruption_run.py OUTPUT_DIR [--save-steps N] [--kill-in-checkpoint STEP] [--pause-after-step STEP]
        [--eval-steps N] [--signal-in-eval STEP] [--save-best]

The subprocess writes `started` into OUTPUT_DIR when training begins, `step-N` after each step and `eval-call-K` at
the K-th model call of its evaluations (`--eval-steps N`: an evaluation every N steps, none by default).
`--kill-in-checkpoint STEP` makes the process SIGKILL itself while it writes checkpoint-STEP (after the weights,
before the optimizer and the trainer state). `--pause-after-step STEP` sleeps 3 s after that step, so that a signal
sent then lands mid-run. `--signal-in-eval STEP` makes the process SIGTERM itself at the first model call of the
evaluation after step STEP. `--save-best` saves only the best checkpoint by the evaluation's F1
(`save_strategy="best"`, `metric_for_best_model="eval_f1"`), in place of `--save-steps`.
"""

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from transformers import TrainerCallback


sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))  # the offline lab

from memopd_trl import HotpotQAEnv, MemOPDConfig, MemOPDTrainer  # noqa: E402
from offline_lab import build_tokenizer, make_synthetic_world  # noqa: E402
from tiny_models import TOKENIZER_TEXTS, tiny_causal_lm  # noqa: E402


MAX_STEPS = 4


def build_trainer(
    output_dir, save_steps: int = 1, callbacks=None, eval_steps: int = 0, save_best: bool = False
) -> MemOPDTrainer:
    """The run: tiny student and teacher, the 8-question synthetic world, `MAX_STEPS` steps, a checkpoint every
    `save_steps` (0: none) or of the best evaluation (`save_best`), an evaluation on 4 of the questions every
    `eval_steps` (0: none)."""
    tokenizer = build_tokenizer(TOKENIZER_TEXTS, vocab_size=512)
    sizes = dict(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    world = make_synthetic_world(8, seed=0)
    args = MemOPDConfig(
        output_dir=str(output_dir), use_cpu=True, report_to="none", max_steps=MAX_STEPS, per_device_train_batch_size=2,
        num_generations=2, max_new_tokens=10, max_prompt_length=512, learning_rate=1e-2, logging_steps=1, seed=0,
        disable_tqdm=True, save_strategy="steps" if save_steps else "no", save_steps=save_steps or 1,
        eval_strategy="steps" if eval_steps else "no", eval_steps=eval_steps or None,
    )  # fmt: skip
    if save_best:
        args.save_strategy, args.metric_for_best_model = "best", "eval_f1"
    return MemOPDTrainer(
        model=tiny_causal_lm(seed=0, **sizes),
        teacher_model=tiny_causal_lm(seed=1, **sizes),
        args=args,
        train_dataset=world.records,
        eval_dataset=world.records[:4] if eval_steps else None,
        env_factory=HotpotQAEnv.factory(
            corpus=world.corpus, top_k=1, max_turns=2, max_malformed=2, system_prompt="Act."
        ),
        processing_class=tokenizer,
        callbacks=callbacks,
    )


class Progress(TrainerCallback):
    """Writes `started` and `step-N` marker files; optionally pauses after one step."""

    def __init__(self, folder: Path, pause_after_step: int | None):
        self.folder = folder
        self.pause_after_step = pause_after_step

    def on_train_begin(self, args, state, control, **kwargs):
        (self.folder / "started").touch()

    def on_step_end(self, args, state, control, **kwargs):
        (self.folder / f"step-{state.global_step}").touch()
        if state.global_step == self.pause_after_step:
            time.sleep(3)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("--save-steps", type=int, default=1)
    parser.add_argument("--kill-in-checkpoint", type=int, default=None)
    parser.add_argument("--pause-after-step", type=int, default=None)
    parser.add_argument("--eval-steps", type=int, default=0)
    parser.add_argument("--signal-in-eval", type=int, default=None)
    parser.add_argument("--save-best", action="store_true")
    options = parser.parse_args()
    options.output_dir.mkdir(parents=True, exist_ok=True)
    progress = Progress(options.output_dir, options.pause_after_step)
    trainer = build_trainer(
        options.output_dir, options.save_steps, [progress], eval_steps=options.eval_steps, save_best=options.save_best
    )
    generate, eval_calls = trainer.rollout_engine.generate, []

    def generate_and_mark(batch_prompt_ids, stop_strings, greedy=False):
        if greedy:  # an evaluation's model call
            eval_calls.append(trainer.state.global_step)
            (options.output_dir / f"eval-call-{len(eval_calls)}").touch()
            if trainer.state.global_step == options.signal_in_eval and eval_calls.count(options.signal_in_eval) == 1:
                os.kill(os.getpid(), signal.SIGTERM)
        return generate(batch_prompt_ids, stop_strings, greedy)

    trainer.rollout_engine.generate = generate_and_mark
    if options.kill_in_checkpoint is not None:
        save_optimizer = trainer._save_optimizer_and_scheduler

        def killed_while_saving(output_dir):
            if trainer.state.global_step == options.kill_in_checkpoint:
                os.kill(os.getpid(), signal.SIGKILL)
            save_optimizer(output_dir)

        trainer._save_optimizer_and_scheduler = killed_while_saving
    trainer.train()


if __name__ == "__main__":
    main()
