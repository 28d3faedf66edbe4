"""The set-up of the offline lab: a synthetic HotpotQA-format world, its tokenizer, a tiny teacher and student start.

Everything here runs without a network on a CPU. [`make_offline_world`] makes a seeded synthetic world
([`make_synthetic_world`]) split into training and held-out questions, with a BM25-backed [`HotpotQAEnv`] over its
passages. [`prepare_offline_models`] then builds, or reuses from a cache, the two models the comparison starts from:

1. a tokenizer trained on the world's texts and the expert's rendered turns;
2. a teacher trained from scratch by imitation of the scripted expert's compact-memory trajectories, after a copy
   warm-up ([`copy_task_invocations`]). Some of the expert's search turns are played with a mistake while the trace
   keeps the expert's own next action, so the teacher has also seen how to recover from states a weak student reaches;
3. a smaller student warm-started briefly the same way, so that it knows the action format.

With `OfflineConfig.base_model` both models are instead fine-tuned from one pretrained checkpoint, with its own
tokenizer and chat template (`examples/smollm2.yaml`).

Each model is saved with its recipe ([`OfflineConfig`], the environment's settings and [`RECIPE_VERSION`]) in
`memopd_setup.json`; a later call with the same recipe reuses it, and a changed recipe (other settings, or a cache made
by another version of this set-up) rebuilds what depends on it, with a one-line notice saying why (the student shares
the teacher's tokenizer, so a new teacher means a new student).

>>> from offline_lab import OfflineConfig, load_offline_model, make_offline_world, prepare_offline_models
>>> config = OfflineConfig(
...     num_train_questions=40, num_eval_questions=8, vocab_size=400, teacher_hidden_size=32, student_hidden_size=32,
...     copy_warmup_sequences=64, student_warmup_questions=16,
... )
>>> world = make_offline_world(config, max_turns=3)
>>> setup = prepare_offline_models(config, world, "outputs/offline")  # {"teacher": {...}, "student_init": {...}}
>>> student = load_offline_model("outputs/offline/student_init")
"""

import copy
import importlib.metadata
import json
import os
import platform
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from accelerate import PartialState
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from memopd_trl.attention import VARLEN_SDPA, register_varlen_attention
from memopd_trl.envs.hotpot import HotpotQAEnv
from memopd_trl.envs.multi import make_multi_objective_tasks
from memopd_trl.rollout import RolloutEngine

from .expert import MEMORY_MODES, SyntheticExpert, expert_trajectories, reading_steps
from .imitation import copy_task_invocations, expert_invocations, imitation_train
from .modeling import build_tiny_model
from .tokenizer import build_tokenizer
from .world import NAME_SYLLABLES, SyntheticWorld, make_synthetic_world


VARLEN_ATTENTION = VARLEN_SDPA  # the attention the tiny models are trained and loaded with
SETUP_FILE = "memopd_setup.json"
# Version of the set-up's recipe: raised whenever the set-up computes something else from the same settings, so that
# models cached by an older version are rebuilt. Caches made before versions were recorded count as version 1.
RECIPE_VERSION = 2
ROLES = ("teacher", "student_init")
SHARED_PRETRAINING_DIR = "shared_pretraining"  # the base both models fork from, with `share_pretraining`


@dataclass
class OfflineConfig:
    r"""
    Settings of the offline world and of its tiny teacher and student start: together with the environment's
    settings, the recipe a cached model is checked against.

    Parameters that control the world:
        num_train_questions (`int`, *optional*, defaults to `6000`):
            Training questions: the teacher imitates the expert on all of them, the arms train on them.
        num_eval_questions (`int`, *optional*, defaults to `200`):
            Held-out questions, evaluated greedily.
        world_seed (`int`, *optional*, defaults to `0`):
            Seed of the world, the expert's mistakes and the copy warm-up strings.
        comparison_fraction (`float`, *optional*, defaults to `0.0`):
            Fraction of comparison questions (the rest are bridge questions).
        retrieval_top_k (`int`, *optional*, defaults to `1`):
            Passages returned per search.
        max_malformed (`int`, *optional*, defaults to `1`):
            Malformed actions that end an episode with reward 0 (a tiny model's turn after a format error is noise
            that no model was trained on).
        system_prompt (`str`, *optional*, defaults to `"Act."`):
            System prompt of the environment; a one-line prompt keeps the tiny models' contexts short.
        num_sub_questions (`int`, *optional*, defaults to `1`):
            Sub-questions per task. 1 asks single questions; k >= 2 joins k questions into one multi-objective task
            (`make_multi_objective_tasks`), training tasks from training questions and held-out tasks from held-out
            questions only, so that facts found early must be carried in memory. Such a task needs
            `multi_objective_max_turns(k, retries=1)` turns (the expert retries a search that missed once).
        lookup_fraction (`float`, *optional*, defaults to `0.0`):
            Fraction of single-hop lookups (`"Who directed A?"`: one passage answers them) among the world's
            questions (`make_synthetic_world`); 1.0 makes every sub-question of a multi-objective task a lookup, whose
            episode needs `multi_objective_max_turns(k, searches_per_question=1)` turns.
        short_names (`bool`, *optional*, defaults to `False`):
            Names of two-syllable words with no syllable repeated within a name (`make_synthetic_world`), instead of
            two- and three-syllable words.

    Parameters that control the models:
        vocab_size (`int`, *optional*, defaults to `768`):
            Vocabulary size of the tokenizer trained on the world.
        teacher_hidden_size (`int`, *optional*, defaults to `128`):
            Hidden size of the teacher.
        teacher_layers (`int`, *optional*, defaults to `2`):
            Layers of the teacher.
        student_hidden_size (`int`, *optional*, defaults to `64`):
            Hidden size of the student.
        student_layers (`int`, *optional*, defaults to `2`):
            Layers of the student.
        base_model (`str`, *optional*):
            A pretrained causal LM (a checkpoint directory or a Hub id) that the teacher and the student start are
            both fine-tuned from, in float32, with its own tokenizer and chat template, instead of tiny models trained
            from scratch with a tokenizer trained on the world. The sizes, the copy warm-up and the shared
            pretraining then do not apply (that is what the checkpoint brings); `context_weight` still does.

    Parameters that control the imitation:
        pretrain_questions (`int`, *optional*, defaults to `0`):
            Single questions (the world's skills: reading, copying, the action format) whose full-expert turns both
            models imitate after the copy warm-up and before imitating their own expert on the tasks; 0 skips it.
        pretrain_epochs (`float`, *optional*, defaults to `1.0`):
            Epochs of that shared pretraining (each model at its own learning rate).
        share_pretraining (`bool`, *optional*, defaults to `False`):
            Run the copy warm-up and the pretraining once, in the teacher's architecture (at the teacher's learning
            rate), and start both models' imitation from copies of that one model: the two then differ only by the
            expert they imitate on the tasks. The student sizes must equal the teacher's.
        replay_questions (`int`, *optional*, defaults to `0`):
            Pretraining questions whose full-expert turns are mixed into each model's task imitation (replay), so
            that the single-question skill survives the task phase; at most `pretrain_questions`.
        student_expert_memory (`str`, *optional*, defaults to `"full"`):
            Memory of the expert the student start imitates: `"full"` (the teacher's expert), or a forgetful one,
            `"latest"` (only the latest fact), `"none"` (nothing) or `"searches"` (a note of each search, no fact),
            which plays the same searches and answer format.
            A forgetful expert gives a student start that has the capabilities and lacks the memory policy; its traces
            are played without mistakes (after a slip a forgetful expert loses its place and gives up).
        student_from_teacher (`bool`, *optional*, defaults to `False`):
            The student start is a copy of the trained teacher that then imitates the `student_expert_memory` expert
            on `student_warmup_questions` tasks: a start that was taught every skill of the memory policy and then a
            forgetful habit over it (the student sizes must equal the teacher's).
        student_reading (`bool`, *optional*, defaults to `False`):
            The student start also imitates one reading state per task it imitates ([`reading_steps`]): the task and
            its first search, then every passage of the task in one observation, labelled with the full expert's
            answer action. It can then answer several questions from what is in front of it, without having carried
            anything: the capability, not the memory policy (docs/results.md, "A start given the reading"). Needs
            multi-objective tasks (`num_sub_questions >= 2`).
        copy_warmup_sequences (`int`, *optional*, defaults to `16000`):
            Random strings to repeat before imitation (the copy warm-up of both models); 0 turns it off.
        copy_learning_rate (`float`, *optional*, defaults to `5e-3`):
            Peak learning rate of the copy warm-up.
        expert_mistake_prob (`float`, *optional*, defaults to `0.2`):
            Probability that a search turn of the expert's traces is played with a mistake (garbled query, repeated
            search, forgotten fact) while the trace keeps the expert's own action.
        teacher_epochs (`float`, *optional*, defaults to `2.0`):
            Epochs of teacher imitation.
        teacher_select_tasks (`int`, *optional*, defaults to `0`):
            Training tasks set aside from the teacher's imitation data (the last ones of the training split, never
            held-out ones) on which its greedy F1 is measured every `teacher_select_epochs`; the teacher keeps the
            weights of its best score (why: docs/design.md, "The offline lab"). 0 keeps the last weights.
        teacher_select_epochs (`float`, *optional*, defaults to `0.5`):
            Epochs of teacher imitation between two of those measurements.
        teacher_full_history (`bool`, *optional*, defaults to `False`):
            Whether the teacher also imitates the same full-memory expert rendered as one growing history (memory
            policy `full_history`), on the same tasks, so that it plays well in both layouts: the fair teacher for
            the persistent-history control. Its held-out F1 in that layout is reported as `full_history_f1`.
        teacher_history_native (`bool`, *optional*, defaults to `False`):
            With `teacher_full_history`: the teacher's history-layout demonstrations come from an expert that reads
            everything its history shows (`SyntheticExpert(reads="history")`), on the expert's own play and on the
            histories of the student's forgetful expert (`student_expert_memory`). There the history holds passages
            the memory lost: it learns to write those facts back and to answer from them. In the compact layout it
            imitates the memory expert, as without this option. A teacher native to the history layout: the
            persistent-history control under which the mechanism that control stands for can appear.
        teacher_history_memory (`str`, *optional*, defaults to `"full"`):
            With `teacher_history_native`: what that history-reading expert keeps in memory. `"full"`, every fact
            found (a lost one written back); a forgetful mode (`"searches"`, `"latest"`, `"none"`), only what that
            mode keeps: it still answers from every passage its history shows, so under the growing history it has no
            reason to write a fact into memory.
        teacher_learning_rate (`float`, *optional*, defaults to `3e-3`):
            Peak learning rate of teacher imitation.
        student_warmup_questions (`int`, *optional*, defaults to `1500`):
            Questions whose expert turns warm-start the student.
        student_start_f1_range (`list[float]`, *optional*, defaults to `[0.3, 0.7]`):
            The held-out task F1 the student start is meant to have (about 0.5 with two-part tasks: the second answer
            found, the first forgotten). A start outside it is refused before any arm trains
            ([`check_student_start`]); widen it to train such a start anyway. Not part of the recipe.
        teacher_min_f1_gain (`float`, *optional*, defaults to `0.2`):
            How far the teacher's held-out task F1 must be above the student start's. A teacher below is refused
            before any arm trains ([`check_teacher_gain`]): it has too little to distill, and its episodes lead the
            student into states where the teacher itself fails (docs/results.md, "A teacher no better than its
            start"). 0 turns the check off. Not part of the recipe.
        student_epochs (`float`, *optional*, defaults to `1.0`):
            Epochs of the student warm-start.
        student_learning_rate (`float`, *optional*, defaults to `3e-3`):
            Peak learning rate of the student warm-start.
        imitation_tokens_per_batch (`int`, *optional*, defaults to `2048`):
            Real tokens per optimizer step of imitation and copy warm-up.
        context_weight (`float`, *optional*, defaults to `0.5`):
            Weight of the context tokens' next-token loss in imitation (0 = actions only).
    """

    # World
    num_train_questions: int = field(
        default=6000,
        metadata={
            "help": "Training questions: the teacher imitates the expert on all of them, the arms train on them."
        },
    )
    num_eval_questions: int = field(default=200, metadata={"help": "Held-out questions, evaluated greedily."})
    world_seed: int = field(
        default=0, metadata={"help": "Seed of the world, the expert's mistakes and the copy warm-up strings."}
    )
    comparison_fraction: float = field(
        default=0.0, metadata={"help": "Fraction of comparison questions (the rest are bridge questions)."}
    )
    retrieval_top_k: int = field(default=1, metadata={"help": "Passages returned per search."})
    max_malformed: int = field(
        default=1,
        metadata={"help": "Malformed actions that end an episode with reward 0 (a tiny model's turn after a format "
                  "error is noise that no model was trained on)."},
    )  # fmt: skip
    system_prompt: str | None = field(
        default="Act.",
        metadata={
            "help": "System prompt of the environment; a one-line prompt keeps the tiny models' contexts short."
        },
    )
    num_sub_questions: int = field(
        default=1,
        metadata={"help": "Sub-questions per task. 1 asks single questions; k >= 2 joins k questions into one "
                  "multi-objective task (training tasks from training questions, held-out tasks from held-out "
                  "questions), so that facts found early must be carried in memory; such a task needs "
                  "multi_objective_max_turns(k, retries=1) turns."},
    )  # fmt: skip

    lookup_fraction: float = field(
        default=0.0,
        metadata={"help": "Fraction of single-hop lookups (`Who directed A?`, one passage answers them) among the "
                  "world's questions; 1.0 makes every sub-question of a multi-objective task a lookup."},
    )  # fmt: skip
    short_names: bool = field(
        default=False,
        metadata={"help": "Names of two-syllable words with no syllable repeated within a name "
                  "(`make_synthetic_world`), instead of two- and three-syllable words."},
    )  # fmt: skip

    # Models
    vocab_size: int = field(default=768, metadata={"help": "Vocabulary size of the tokenizer trained on the world."})
    teacher_hidden_size: int = field(default=128, metadata={"help": "Hidden size of the teacher."})
    teacher_layers: int = field(default=2, metadata={"help": "Layers of the teacher."})
    student_hidden_size: int = field(default=64, metadata={"help": "Hidden size of the student."})
    student_layers: int = field(default=2, metadata={"help": "Layers of the student."})
    base_model: str | None = field(
        default=None,
        metadata={"help": "A pretrained causal LM (checkpoint directory or Hub id) that the teacher and the student "
                  "start are fine-tuned from, with its own tokenizer and chat template, instead of tiny models from "
                  "scratch (the sizes, copy warm-up and shared pretraining then do not apply)."},
    )  # fmt: skip

    # Imitation
    pretrain_questions: int = field(
        default=0,
        metadata={"help": "Single questions whose full-expert turns both models imitate after the copy warm-up and "
                  "before imitating their own expert on the tasks (the shared skills); 0 skips it."},
    )  # fmt: skip
    pretrain_epochs: float = field(
        default=1.0, metadata={"help": "Epochs of the shared pretraining (each model at its own learning rate)."}
    )
    share_pretraining: bool = field(
        default=False,
        metadata={"help": "Run the copy warm-up and the pretraining once, in the teacher's architecture, and start "
                  "both models' imitation from that one model (the student sizes must equal the teacher's)."},
    )  # fmt: skip
    replay_questions: int = field(
        default=0,
        metadata={"help": "Pretraining questions whose full-expert turns are mixed into each model's task imitation, "
                  "so the single-question skill survives it; 0 turns it off."},
    )  # fmt: skip
    student_expert_memory: str = field(
        default="full",
        metadata={"help": "Memory of the expert the student start imitates: `full` (the teacher's), or a forgetful "
                  "`latest` (only the latest fact) or `none` (nothing), with the same searches and answer format."},
    )  # fmt: skip
    student_from_teacher: bool = field(
        default=False,
        metadata={"help": "Start the student from a copy of the trained teacher, then imitate the forgetful expert: "
                  "the skills of the memory policy with a forgetful habit over them."},
    )  # fmt: skip
    student_reading: bool = field(
        default=False,
        metadata={"help": "The student start also imitates one reading state per task: every passage of the task in "
                  "one observation, labelled with both answers (the capability, not the memory policy)."},
    )  # fmt: skip
    copy_warmup_sequences: int = field(
        default=16000,
        metadata={
            "help": "Random strings to repeat before imitation (the copy warm-up of both models); 0 turns it off."
        },
    )
    copy_learning_rate: float = field(default=5e-3, metadata={"help": "Peak learning rate of the copy warm-up."})
    expert_mistake_prob: float = field(
        default=0.2,
        metadata={"help": "Probability that a search turn of the expert's traces is played with a mistake (garbled "
                  "query, repeated search, forgotten fact) while the trace keeps the expert's own action."},
    )  # fmt: skip
    teacher_epochs: float = field(default=2.0, metadata={"help": "Epochs of teacher imitation."})
    teacher_select_tasks: int = field(
        default=0,
        metadata={"help": "Training tasks set aside from the teacher's data on which its greedy F1 picks the best "
                  "of its checkpoints (every `teacher_select_epochs`); 0 keeps the last weights."},
    )  # fmt: skip
    teacher_select_epochs: float = field(
        default=0.5, metadata={"help": "Epochs of teacher imitation between two checkpoint measurements."}
    )
    teacher_full_history: bool = field(
        default=False,
        metadata={
            "help": "The teacher also imitates the expert rendered as one growing history, so that it plays well in "
            "both layouts (the fair persistent-history control)."
        },
    )
    teacher_history_native: bool = field(
        default=False,
        metadata={
            "help": "With teacher_full_history: the history-layout demonstrations come from an expert that reads the "
            "whole history, on its own play and on the forgetful student expert's histories (a history-native "
            "teacher)."
        },
    )
    teacher_history_memory: str = field(
        default="full",
        metadata={
            "help": "With teacher_history_native: what the history-reading expert keeps in memory, 'full' (every "
            "fact) or a forgetful mode ('searches', 'latest', 'none'; it answers from the history).",
            "choices": list(MEMORY_MODES),
        },
    )
    teacher_learning_rate: float = field(default=3e-3, metadata={"help": "Peak learning rate of teacher imitation."})
    student_warmup_questions: int = field(
        default=1500, metadata={"help": "Questions whose expert turns warm-start the student."}
    )
    student_start_f1_range: list[float] = field(
        default_factory=lambda: [0.3, 0.7],
        metadata={
            "help": "Held-out task F1 the student start must have (low high); a start outside is refused before any "
            "arm trains. Widen it to train such a start anyway."
        },
    )
    teacher_min_f1_gain: float = field(
        default=0.2,
        metadata={
            "help": "How far the teacher's held-out task F1 must be above the student start's; a teacher below is "
            "refused before any arm trains (0 turns the check off)."
        },
    )
    student_epochs: float = field(default=1.0, metadata={"help": "Epochs of the student warm-start."})
    student_learning_rate: float = field(
        default=3e-3, metadata={"help": "Peak learning rate of the student warm-start."}
    )
    imitation_tokens_per_batch: int = field(
        default=2048, metadata={"help": "Real tokens per optimizer step of imitation and copy warm-up."}
    )
    context_weight: float = field(
        default=0.5,
        metadata={"help": "Weight of the context tokens' next-token loss in imitation (0 = actions only)."},
    )

    def check_world_sizes(self) -> None:
        """
        The checks of the world's sizes against each other, made when the offline world is built (a run on real data
        takes `num_train_questions` / `num_eval_questions` as limits on its dataset, where these do not apply).
        """
        if self.num_sub_questions > min(self.num_train_questions, self.num_eval_questions):
            raise ValueError(
                f"`num_sub_questions` ({self.num_sub_questions}) exceeds `num_train_questions` or "
                f"`num_eval_questions` ({self.num_train_questions}, {self.num_eval_questions}): no task can be made."
            )
        if self.pretrain_questions > self.num_train_questions:
            raise ValueError(
                f"`pretrain_questions` ({self.pretrain_questions}) exceeds `num_train_questions` "
                f"({self.num_train_questions}): pretraining uses training questions only."
            )

    def __post_init__(self):
        for name in ("num_train_questions", "num_eval_questions", "retrieval_top_k", "max_malformed", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)}.")
        if self.teacher_select_tasks < 0:
            raise ValueError(f"`teacher_select_tasks` must be >= 0, got {self.teacher_select_tasks}.")
        for name in ("teacher_epochs", "student_epochs", "teacher_learning_rate", "student_learning_rate",
                     "teacher_select_epochs"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ValueError(f"`{name}` must be > 0, got {getattr(self, name)}.")
        if self.teacher_history_native and not self.teacher_full_history:
            raise ValueError(
                "`teacher_history_native` sets how the teacher imitates the history layout, which it only does with "
                "`teacher_full_history`: set `teacher_full_history` too."
            )
        if self.teacher_history_memory not in MEMORY_MODES:
            raise ValueError(
                f"`teacher_history_memory` must be one of {MEMORY_MODES}, got {self.teacher_history_memory!r}."
            )
        if self.teacher_history_memory != "full" and not self.teacher_history_native:
            raise ValueError(
                "`teacher_history_memory` is the memory of the history-native teacher's expert: set "
                "`teacher_history_native` too."
            )
        if not 0.0 <= self.expert_mistake_prob <= 1.0:
            raise ValueError(f"`expert_mistake_prob` must be in [0, 1], got {self.expert_mistake_prob}.")
        if self.num_sub_questions < 1:
            raise ValueError(f"`num_sub_questions` must be >= 1 (1 = single questions), got {self.num_sub_questions}.")
        if self.pretrain_questions < 0:
            raise ValueError(f"`pretrain_questions` must be >= 0 (0 turns it off), got {self.pretrain_questions}.")
        if self.pretrain_epochs <= 0:
            raise ValueError(f"`pretrain_epochs` must be > 0, got {self.pretrain_epochs}.")
        if not 0.0 <= self.lookup_fraction <= 1.0:
            raise ValueError(f"`lookup_fraction` must be in [0, 1], got {self.lookup_fraction}.")
        if not 0 <= self.replay_questions <= self.pretrain_questions:
            raise ValueError(
                f"`replay_questions` ({self.replay_questions}) must be in [0, pretrain_questions "
                f"({self.pretrain_questions})]: the replayed turns are pretraining turns."
            )
        for name, what in (
            ("share_pretraining", "starts both models from one pretrained model"),
            ("student_from_teacher", "starts the student from a copy of the teacher"),
        ):
            if getattr(self, name) and self.base_model is None and (self.student_hidden_size, self.student_layers) != (
                self.teacher_hidden_size, self.teacher_layers
            ):
                raise ValueError(
                    f"`{name}` {what}: give the student the teacher's sizes (student {self.student_hidden_size} x "
                    f"{self.student_layers} layers, teacher {self.teacher_hidden_size} x {self.teacher_layers})."
                )
        if self.base_model is not None and self.share_pretraining:
            raise ValueError(
                "`share_pretraining` trains the tiny models' shared warm-up and pretraining; with `base_model` both "
                "models already start from the same pretrained checkpoint: turn it off."
            )
        if self.student_reading and self.num_sub_questions < 2:
            raise ValueError(
                "`student_reading` shows every passage of a task at once: it needs multi-objective tasks "
                f"(`num_sub_questions >= 2`), got {self.num_sub_questions}."
            )
        if self.student_expert_memory not in MEMORY_MODES:
            raise ValueError(
                f"`student_expert_memory` must be one of {MEMORY_MODES}, got {self.student_expert_memory!r}."
            )
        if self.student_warmup_questions < 1 or self.copy_warmup_sequences < 0:
            raise ValueError(
                "`student_warmup_questions` must be >= 1 and `copy_warmup_sequences` >= 0, got "
                f"{self.student_warmup_questions} and {self.copy_warmup_sequences}."
            )

    def settings(self) -> dict[str, Any]:
        """
        Returns:
            `dict[str, Any]`: the fields of `OfflineConfig` only (a subclass that adds fields keeps them out).
        """
        return {f.name: getattr(self, f.name) for f in fields(OfflineConfig)}


@dataclass
class OfflineWorld:
    """
    The synthetic world split into training and held-out questions, and the environment of its episodes.

    Args:
        world (`SyntheticWorld`): the world (its records and passages).
        train (`list[dict]`): the training tasks: the first `num_train_questions` records, or with
            `num_sub_questions=k >= 2` the multi-objective tasks made of them.
        evaluation (`list[dict]`): the held-out tasks: the records that follow them, or the tasks made of those.
        env_factory (`Callable[[], HotpotQAEnv]`): makes one environment per episode, over the world's passages.
        train_questions (`list[dict]`, *optional*): the single training questions (`train` when `k = 1`).
        eval_questions (`list[dict]`, *optional*): the single held-out questions (`evaluation` when `k = 1`); their
            greedy F1 measures a model's capability apart from its memory policy.
    """

    world: SyntheticWorld
    train: list[dict[str, Any]]
    evaluation: list[dict[str, Any]]
    env_factory: Callable[[], HotpotQAEnv]
    train_questions: list[dict[str, Any]] | None = None
    eval_questions: list[dict[str, Any]] | None = None

    def __post_init__(self):
        if self.train_questions is None:
            self.train_questions = self.train
        if self.eval_questions is None:
            self.eval_questions = self.evaluation

    @property
    def multi_objective(self) -> bool:
        """Whether the tasks are multi-objective (made of several single questions)."""
        return self.train is not self.train_questions

    def env_settings(self) -> dict[str, Any]:
        """
        Returns:
            `dict[str, Any]`: the environment's settings (turn limit, memory policy, ...) without its retriever.
        """
        return {key: value for key, value in self.env_factory.kwargs.items() if key != "retriever"}


def make_offline_world(config: OfflineConfig, **env_kwargs) -> OfflineWorld:
    """
    Make the seeded synthetic world of `config` and an environment over its passages.

    With `config.num_sub_questions = k >= 2` the tasks are multi-objective: `make_multi_objective_tasks` joins the
    training questions into `num_train_questions // k` training tasks and, separately, the held-out questions into
    `num_eval_questions // k` held-out tasks (seeded with `world_seed`), so no held-out task shares a question with
    training. Give such an environment `max_turns >= multi_objective_max_turns(k, retries=1)`.

    Args:
        config (`OfflineConfig`): the world's size, seed and environment settings.
        **env_kwargs: further [`MemoryAgentEnv`] arguments (`max_turns`, `memory_policy`, `action_format`, ...).

    Returns:
        `OfflineWorld`: the world, its training and held-out records and its environment factory.
    """
    config.check_world_sizes()
    num_train = config.num_train_questions
    world = make_synthetic_world(
        num_train + config.num_eval_questions,
        seed=config.world_seed,
        comparison_fraction=config.comparison_fraction,
        filler_prob=0.0,
        lookup_fraction=config.lookup_fraction,
        short_names=config.short_names,
    )
    env_factory = HotpotQAEnv.factory(
        corpus=world.corpus,
        top_k=config.retrieval_top_k,
        max_malformed=config.max_malformed,
        system_prompt=config.system_prompt,
        **env_kwargs,
    )
    train, evaluation = world.records[:num_train], world.records[num_train:]
    k = config.num_sub_questions
    if k == 1:
        return OfflineWorld(world, train, evaluation, env_factory)
    train_tasks = make_multi_objective_tasks(train, k=k, seed=config.world_seed)
    eval_tasks = make_multi_objective_tasks(evaluation, k=k, seed=config.world_seed)
    return OfflineWorld(world, train_tasks, eval_tasks, env_factory, train_questions=train, eval_questions=evaluation)


def validation_tasks(world: OfflineWorld, config: OfflineConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """
    The training tasks split in two: those to train on, and the validation tasks, on which settings are chosen (the
    held-out tasks are read for final tables only).

    The validation tasks are the last `teacher_select_tasks` training tasks: the teacher does not imitate them (they
    choose its checkpoint), the student start does not (it imitates the first `student_warmup_questions`), and they
    are not trained on here. Their single questions are in the shared single-lookup pretraining, as every training
    question is and no held-out one.

    Returns:
        `tuple[list[dict], list[dict]]`: the tasks to train on, and the validation tasks.
    """
    count = config.teacher_select_tasks
    if count < 1:
        raise ValueError("validation tasks are the teacher's selection tasks: give `teacher_select_tasks` >= 1.")
    if len(world.train) - count < config.student_warmup_questions:
        raise ValueError(
            f"the {count} validation tasks overlap the student start's {config.student_warmup_questions} imitated "
            f"tasks (of {len(world.train)} training tasks)."
        )
    return world.train[:-count], world.train[-count:]


def build_offline_tokenizer(
    world: SyntheticWorld, expert_steps: list[tuple[list[dict[str, str]], str]], vocab_size: int
) -> PreTrainedTokenizerFast:
    """
    A BPE tokenizer trained on the world's texts and the rendered expert turns (task wording, tags, memories).

    The capitalized syllables that invented names start with are kept as single tokens: a name then tokenizes the
    same after a space (in a question or passage) and right after a tag (in a query, memory or answer), so a tiny
    model can copy it token by token. Pretrained LLMs learned the mapping between such variants long ago; a model
    trained for minutes would spend most of its budget on it.

    Args:
        world (`SyntheticWorld`): the world whose texts the tokenizer is trained on.
        expert_steps (`list[tuple[list[dict], str]]`): `(messages, action)` turns; the first 1000 are added.
        vocab_size (`int`): vocabulary size.

    Returns:
        `PreTrainedTokenizerFast`: the tokenizer, with a chat template.
    """
    texts = world.texts()
    for messages, action in expert_steps[:1000]:
        texts += [message["content"] for message in messages] + [action]
    return build_tokenizer(texts, vocab_size=vocab_size, extra_tokens=[s.capitalize() for s in NAME_SYLLABLES])


def train_tiny_agent(
    role: str,
    hidden_size: int,
    num_layers: int,
    invocations: list,
    copy_data: list,
    epochs: float,
    learning_rate: float,
    tokenizer: PreTrainedTokenizerFast,
    config: OfflineConfig,
    seed: int,
    pretrain_data: list | None = None,
    base_model: PreTrainedModel | None = None,
    evaluate: Callable[[PreTrainedModel], float] | None = None,
    eval_epochs: float = 0.0,
) -> tuple[PreTrainedModel, list[float]]:
    """
    A tiny model from scratch: the copy warm-up on `copy_data` (if any), the shared pretraining on `pretrain_data`
    (if any), then imitation of `invocations`.

    Args:
        role (`str`): label of the progress bars (`"teacher"`, `"student_init"`).
        hidden_size (`int`): hidden size of the model.
        num_layers (`int`): number of layers.
        invocations (`list[Invocation]`): the expert's turns ([`expert_invocations`]).
        copy_data (`list[Invocation]`): the copy warm-up's strings ([`copy_task_invocations`]); empty skips it.
        epochs (`float`): epochs of imitation.
        learning_rate (`float`): peak learning rate of imitation.
        tokenizer (`PreTrainedTokenizerFast`): the world's tokenizer.
        config (`OfflineConfig`): the copy learning rate, batch size and context weight.
        seed (`int`): seed of the initial weights and the data order.
        pretrain_data (`list[Invocation]`, *optional*): the full expert's single-question turns, imitated for
            `config.pretrain_epochs` epochs at `learning_rate` before `invocations`; empty or `None` skips it.
        base_model (`PreTrainedModel`, *optional*): start from a copy of this model (already warmed up and
            pretrained, `share_pretraining`) instead of a new one: `copy_data`, `pretrain_data` and the sizes are
            then not used.
        evaluate (`Callable[[PreTrainedModel], float]`, *optional*), eval_epochs (`float`, *optional*): score the
            imitation's checkpoints and keep the best (see [`~offline_lab.imitation.imitation_train`]).

    Returns:
        `tuple[PreTrainedModel, list[float]]`: the model (in eval mode) and the action NLL of every imitation step.
    """
    common = dict(tokens_per_batch=config.imitation_tokens_per_batch, pad_token_id=tokenizer.pad_token_id, seed=seed)
    if base_model is not None:
        model, copy_data, pretrain_data = copy.deepcopy(base_model), [], []
    else:
        model = build_tiny_model(
            len(tokenizer), hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=2,
            num_key_value_heads=2, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
            attn_implementation=VARLEN_ATTENTION, seed=seed,
        )  # fmt: skip
    if copy_data:
        imitation_train(
            model, copy_data, learning_rate=config.copy_learning_rate, description=f"{role} copy warm-up", **common
        )
    if pretrain_data:
        imitation_train(
            model, pretrain_data, epochs=config.pretrain_epochs, learning_rate=learning_rate,
            context_weight=config.context_weight, description=f"{role} pretraining", **common,
        )  # fmt: skip
    losses = []
    if invocations:
        losses = imitation_train(
            model, invocations, epochs=epochs, learning_rate=learning_rate, context_weight=config.context_weight,
            description=f"{role} imitation", evaluate=evaluate, eval_epochs=eval_epochs, **common,
        )  # fmt: skip
    return model, losses


def greedy_scores(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    env_factory: Callable[[], HotpotQAEnv],
    records: list[dict[str, Any]],
    max_new_tokens: int,
    max_prompt_length: int,
) -> dict[str, float]:
    """
    Greedy F1 / EM of `model` on `records`, one episode each, in this process only.

    The same episodes as `MemOPDTrainer.evaluate` plays, without a trainer: the set-up runs on the main process alone
    while the others wait, so it cannot use the trainer's cross-process reduction.

    Returns:
        `dict[str, float]`: the mean `f1` and `em`.
    """
    engine = RolloutEngine(
        model, tokenizer, env_factory, max_new_tokens=max_new_tokens, max_prompt_length=max_prompt_length
    )
    episodes, _ = engine.rollout(records, num_generations=1, greedy=True)
    count = max(1, len(episodes))
    return {"f1": sum(e.f1 for e in episodes) / count, "em": sum(e.em for e in episodes) / count}


def offline_recipes(config: OfflineConfig, world: OfflineWorld) -> dict[str, dict[str, Any]]:
    """
    Everything the cached teacher and student start depend on; a cache made with another recipe is rebuilt.

    Returns:
        `dict[str, dict]`: per role (`"teacher"`, `"student_init"`), the set-up's `recipe_version`
        ([`RECIPE_VERSION`]), the world's and the environment's settings and that model's own (`hidden_size`,
        `layers`, `epochs`, `learning_rate`; the teacher's `select_tasks` and `select_epochs`; the student's
        `warmup_questions`, `expert_memory` and, with `student_from_teacher`, the teacher's recipe as
        `from_teacher`).
    """
    settings = config.settings()
    shared = {"recipe_version": RECIPE_VERSION}
    shared.update({key: value for key, value in settings.items() if not key.startswith(("teacher_", "student_"))})
    shared.update(world.env_settings())
    recipes = {}
    for role, prefix in (("teacher", "teacher_"), ("student_init", "student_")):
        recipe = dict(shared)
        for name in ("hidden_size", "layers", "epochs", "learning_rate"):
            recipe[name] = getattr(config, prefix + name)
        recipes[role] = recipe
    recipes["teacher"]["select_tasks"] = config.teacher_select_tasks
    recipes["teacher"]["select_epochs"] = config.teacher_select_epochs
    if config.teacher_full_history:  # only when on: caches made without the option stay valid
        recipes["teacher"]["full_history"] = True
    if config.teacher_history_native:
        recipes["teacher"]["history_native"] = True
    if config.teacher_history_memory != "full":
        recipes["teacher"]["history_memory"] = config.teacher_history_memory
    if config.base_model is None:  # likewise
        for recipe in recipes.values():
            del recipe["base_model"]
    recipes["student_init"]["warmup_questions"] = config.student_warmup_questions
    recipes["student_init"]["expert_memory"] = config.student_expert_memory
    if config.student_from_teacher:
        recipes["student_init"]["from_teacher"] = dict(recipes["teacher"])
    if config.student_reading:  # only when on: caches made without the option stay valid
        recipes["student_init"]["reading"] = True
    return recipes


def eval_settings(world: OfflineWorld, max_new_tokens: int, max_prompt_length: int) -> dict[str, Any]:
    """
    What a greedy held-out score depends on besides the model: a cached score holds when these are the same.

    Returns:
        `dict[str, Any]`: the held-out question ids, the environment's settings and the generation lengths.
    """
    return {
        "questions": [record["_id"] for record in world.evaluation],
        **world.env_settings(),
        "max_new_tokens": max_new_tokens,
        "max_prompt_length": max_prompt_length,
    }


def cached_start_scores(
    setup: dict[str, dict[str, Any]], world: OfflineWorld, max_new_tokens: int, max_prompt_length: int
) -> dict[str, float] | None:
    """
    The student start's held-out score from the set-up, if it was measured under these settings.

    Args:
        setup (`dict[str, dict]`): what [`prepare_offline_models`] returned.
        world (`OfflineWorld`): the world the score should be on.
        max_new_tokens (`int`): tokens per model call of the held-out episodes.
        max_prompt_length (`int`): context tokens per model call.

    Returns:
        `dict[str, float]` or `None`: the start's `f1` and `em`, or `None` when the cached score was measured on
        other questions or under other settings (then measure it again).
    """
    student = setup["student_init"]
    if student.get("eval_settings") != eval_settings(world, max_new_tokens, max_prompt_length):
        return None
    return {"f1": student["f1"], "em": student["em"]}


def prepare_offline_models(
    config: OfflineConfig,
    world: OfflineWorld,
    output_dir: str | os.PathLike,
    max_new_tokens: int = 64,
    max_prompt_length: int = 512,
) -> dict[str, dict[str, Any]]:
    """
    Build, or reuse, the teacher in `output_dir/teacher` and the student start in `output_dir/student_init`.

    Only the main process trains; the others wait, then every process reads the cache. Each model is scored greedily
    on the held-out questions with `max_new_tokens` / `max_prompt_length`, the trainer's generation settings.

    Both models get the copy warm-up and, with `pretrain_questions > 0`, the same pretraining on the full expert's
    single-question turns (the capability). Then the teacher imitates the full expert on the training tasks and the
    student start the expert of `student_expert_memory` on the first `student_warmup_questions` of them (the
    policy). With multi-objective tasks (`num_sub_questions >= 2`) each model is also scored on the single held-out
    questions (`single_f1` / `single_em`, its capability), beside `f1` / `em` on the held-out tasks (its policy).
    A model whose cached recipe differs from [`offline_recipes`] (other settings, or another [`RECIPE_VERSION`]) is
    rebuilt, and one line says why.

    Args:
        config (`OfflineConfig`): the recipe of both models.
        world (`OfflineWorld`): the world [`make_offline_world`] made from `config`.
        output_dir (`str` or `os.PathLike`): where the models are cached.
        max_new_tokens (`int`, *optional*, defaults to `64`): tokens per model call of the held-out episodes.
        max_prompt_length (`int`, *optional*, defaults to `512`): context tokens per model call.

    Returns:
        `dict[str, dict]`: per role (`"teacher"`, `"student_init"`), the content of its `memopd_setup.json`: held-out
        `f1` / `em`, `train_seconds`, `parameters`, `expert_turns`, `final_action_nll`, `recipe`, `eval_settings`,
        `environment` (the versions of the packages the build ran with: a set-up rebuilt under other versions can
        differ, docs/results.md, "World seed 0 rebuilt on 2026-12-07");
        with multi-objective tasks also `single_f1` / `single_em` and `pretrain_turns`; with `replay_questions`
        `replay_turns`, and with `share_pretraining` `shared_pretraining: true`.
    """
    if config.student_warmup_questions > len(world.train):
        raise ValueError(
            f"`student_warmup_questions` ({config.student_warmup_questions}) exceeds the world's {len(world.train)} "
            f"training {'tasks' if world.multi_objective else 'questions'}: lower it or raise `num_train_questions`."
        )
    state = PartialState()
    recipes = offline_recipes(config, world)
    paths = {role: Path(output_dir) / role for role in ROLES}
    with state.main_process_first():
        if state.is_main_process:
            stale = {}  # role -> why it is (re)built
            for role in ROLES:
                reason = _stale_reason(_cached_recipe(paths[role]), recipes[role])
                if reason is not None:
                    stale[role] = reason
            if "teacher" in stale and "student_init" not in stale:
                stale["student_init"] = "rebuilding: the teacher, whose tokenizer it shares, is rebuilt"
            for role in ROLES:
                _log(f"[setup] {role} in {paths[role]}: {stale.get(role, 'reusing the cached model')}")
            if stale:
                generation = {"max_new_tokens": max_new_tokens, "max_prompt_length": max_prompt_length}
                _build_models(config, world, paths, stale, recipes, generation)
    return {role: json.loads((paths[role] / SETUP_FILE).read_text()) for role in ROLES}


def check_student_start(setup: dict[str, dict[str, Any]], config: OfflineConfig) -> str | None:
    """
    Why the set-up's student start must not be trained (its held-out task F1 outside
    `config.student_start_f1_range`), or `None` when it is in range. A start that also lost the answer it should
    keep (F1 near 0), or that already carries its memory (near 1), leaves the arms nothing to show.
    """
    low, high = config.student_start_f1_range
    start, teacher = setup["student_init"], setup["teacher"]
    if low <= start["f1"] <= high:
        return None
    single = f", single-question F1 {start['single_f1']:.3f}" if "single_f1" in start else ""
    longer = ""
    if start["f1"] < low and not config.student_from_teacher:
        longer = (
            " A start that never had the policy may not have learned its expert yet: on world seed 0, --student_epochs "
            "3 instead of 1 took it from 0.098 to 0.390 (docs/results.md, \"The start that never had the policy, "
            "under the release\")."
        )
    return (
        f"The student start's held-out task F1 is {start['f1']:.3f}{single}, outside its intended range "
        f"[{low}, {high}] (the teacher's: {teacher['f1']:.3f}). The arms would not train the start this recipe means "
        "(the second answer found, the first forgotten). Change the world seed or the start's recipe (its cache is "
        f"then rebuilt), or pass --student_start_f1_range 0 1 to train it anyway.{longer}"
    )


def check_teacher_gain(setup: dict[str, dict[str, Any]], config: OfflineConfig) -> str | None:
    """
    Why the set-up's teacher must not be distilled (its held-out task F1 less than `config.teacher_min_f1_gain` above
    the student start's), or `None` when it is far enough above. Such a teacher acts as the start does, or fails where
    the start's habit succeeds, so the arms would measure nothing the recipe means.
    """
    teacher, start = setup["teacher"]["f1"], setup["student_init"]["f1"]
    if teacher - start >= config.teacher_min_f1_gain:
        return None
    return (
        f"The teacher's held-out task F1 is {teacher:.3f}, less than {config.teacher_min_f1_gain} above the student "
        f"start's ({start:.3f}): it has little to distill, and MemOPD would train the start towards a teacher that is "
        "not better. Change the world seed or the teacher's recipe (its cache is then rebuilt), or pass "
        "--teacher_min_f1_gain 0 to train anyway."
    )


def load_offline_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerFast:
    """
    The tokenizer saved beside a set-up model (the world's own, or the `base_model` checkpoint's).

    Not through `AutoTokenizer`: next to a Qwen2 `config.json` it would build a `Qwen2Tokenizer`, whose pre-tokenizer
    splits numbers into digits, silently changing the token ids the models were trained on.
    """
    return PreTrainedTokenizerFast.from_pretrained(path)


def load_offline_model(path: str | os.PathLike) -> PreTrainedModel:
    """A cached set-up model (or the `base_model` checkpoint), in float32 with the packed-row attention it is trained
    with (registered here)."""
    register_varlen_attention()
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation=VARLEN_ATTENTION, dtype=torch.float32)


def _build_models(config, world, paths, roles, recipes, generation) -> None:
    """
    Train the models of `roles` and cache them, the teacher first. The tokenizer both share is trained when the
    teacher is rebuilt.
    """
    start = time.perf_counter()
    expert = dict(env_factory=world.env_factory, mistake_prob=config.expert_mistake_prob, seed=config.world_seed)
    num_expert = len(world.train) if "teacher" in roles else config.student_warmup_questions
    trajectories = expert_trajectories(world.train[:num_expert], **expert)
    # The teacher's checkpoint is chosen on the last training tasks, which it then does not imitate.
    if config.teacher_select_tasks >= len(world.train):
        raise ValueError(
            f"`teacher_select_tasks` ({config.teacher_select_tasks}) must be fewer than the {len(world.train)} "
            "training tasks, which the teacher also imitates."
        )
    select = world.train[len(world.train) - config.teacher_select_tasks :] if config.teacher_select_tasks else []
    imitated = trajectories[: len(trajectories) - len(select)] if "teacher" in roles else trajectories
    policy_steps = {"teacher": [step for trajectory in imitated for step in trajectory.steps]}
    full_history_factory = _full_history_factory(world.env_factory)
    if "teacher" in roles and config.teacher_full_history:
        # The same expert on the same tasks, each turn rendered under the whole history so far.
        action_format = full_history_factory().action_format
        history_expert = None
        if config.teacher_history_native:
            history_expert = SyntheticExpert(action_format, memory=config.teacher_history_memory, reads="history")
        settings = _expert_settings(expert)
        if config.teacher_history_memory != "full":  # a forgetful expert gives up after a slip: no mistakes
            settings["mistake_prob"] = 0.0
        replayed = expert_trajectories(
            world.train[: len(imitated)], full_history_factory, expert=history_expert, **settings
        )
        if config.teacher_history_native:  # the forgetful expert's histories, each state labeled by the reader
            forgetful = SyntheticExpert(action_format, memory=config.student_expert_memory)
            replayed += expert_trajectories(
                world.train[: len(imitated)], full_history_factory, expert=history_expert, behavior=forgetful
            )
        policy_steps["teacher"] += [step for trajectory in replayed for step in trajectory.steps]
    student_trajectories = trajectories[: config.student_warmup_questions]
    if config.student_expert_memory != "full":
        # Played without mistakes: after a slip a forgetful expert has lost its place and gives up (it answers what
        # it has), so its labels there would teach the start to give up, not to forget.
        student_trajectories = expert_trajectories(
            world.train[: config.student_warmup_questions], world.env_factory, memory=config.student_expert_memory
        )
    policy_steps["student_init"] = [step for trajectory in student_trajectories for step in trajectory.steps]
    reading = []
    if config.student_reading and "student_init" in roles:  # the full expert's clean play of its tasks, read at once
        clean = expert_trajectories(world.train[: config.student_warmup_questions], world.env_factory)
        reading = reading_steps(clean, world.env_factory().action_format)
    pretrain_steps = []
    if config.pretrain_questions > 0:
        pretrain = expert_trajectories(world.train_questions[: config.pretrain_questions], **expert)
        pretrain_steps = [step for trajectory in pretrain for step in trajectory.steps]
    if config.base_model is not None:  # the checkpoint's own tokenizer and chat template
        tokenizer = load_offline_tokenizer(config.base_model)
    elif "teacher" in roles:
        # Multi-objective tasks: the single questions' turns too, so the tokenizer knows both kinds of task.
        texts = pretrain_steps[:500] + policy_steps["teacher"] if world.multi_objective else policy_steps["teacher"]
        tokenizer = build_offline_tokenizer(world.world, texts, config.vocab_size)
    else:
        tokenizer = load_offline_tokenizer(paths["teacher"])
    copy_data = []
    if config.copy_warmup_sequences > 0 and config.base_model is None:
        special = set(tokenizer.all_special_ids)
        ordinary_ids = [i for i in range(len(tokenizer)) if i not in special]
        copy_data = copy_task_invocations(
            config.copy_warmup_sequences, ordinary_ids, tokenizer.eos_token_id, seed=config.world_seed
        )
    pretrain_data = expert_invocations(pretrain_steps, tokenizer) if pretrain_steps else []
    expert_f1 = sum(t.f1 for t in trajectories) / len(trajectories)
    forgetful = ""
    if config.student_expert_memory != "full":
        forgetful_f1 = sum(t.f1 for t in student_trajectories) / len(student_trajectories)
        forgetful = f", the student's {config.student_expert_memory!r}-memory expert {forgetful_f1:.3f}"
    _log(
        f"[setup] world: {len(world.train)} training / {len(world.evaluation)} held-out "
        f"{'tasks' if world.multi_objective else 'questions'}, {len(world.world.corpus)} passages; expert F1 "
        f"{expert_f1:.3f} on {len(trajectories)} of them{forgetful}; {len(pretrain_steps)} shared pretraining turns; "
        f"tokenizer of {len(tokenizer)} tokens ({time.perf_counter() - start:.1f} s)"
    )
    replay_steps = []
    if config.replay_questions > 0:
        replay_steps = [step for trajectory in pretrain[: config.replay_questions] for step in trajectory.steps]
    base_model = None
    if config.base_model is not None:
        base_model = load_offline_model(config.base_model)
        _log(f"[setup] both models are fine-tuned from {config.base_model}")
    elif config.share_pretraining and ("teacher" in roles or not config.student_from_teacher):
        # Cached beside the two models: rebuilding only the student start (a changed student recipe) reuses it.
        shared_path = paths["teacher"].parent / SHARED_PRETRAINING_DIR
        recipe = _shared_pretraining_recipe(recipes)
        if "teacher" not in roles and _cached_recipe(shared_path) == recipe:  # same tokenizer, same data
            base_model = load_offline_model(shared_path)
            _log(f"[setup] reusing the cached shared copy warm-up and pretraining in {shared_path}")
        else:
            start = time.perf_counter()
            base_model, _ = train_tiny_agent(
                "shared", recipe["hidden_size"], recipe["layers"], [], copy_data, recipe["epochs"],
                recipe["learning_rate"], tokenizer, config, seed=1, pretrain_data=pretrain_data,
            )  # fmt: skip
            seconds = time.perf_counter() - start
            base_model.save_pretrained(shared_path)
            (shared_path / SETUP_FILE).write_text(json.dumps({"recipe": recipe, "train_seconds": round(seconds, 1)}))
            _log(f"[setup] shared copy warm-up and pretraining ({seconds:.0f} s)")
    models = {}
    for role in [role for role in ROLES if role in roles]:
        recipe = recipes[role]
        steps = policy_steps[role] + replay_steps
        info = {}
        if role == "student_init" and reading:
            steps = reading + steps
            info["reading_states"] = len(reading)
        start_from = base_model
        if role == "student_init" and config.student_from_teacher:
            start_from = models["teacher"] if "teacher" in models else load_offline_model(paths["teacher"])
            info["from_teacher"] = True
        invocations = expert_invocations(steps, tokenizer)
        _warn_if_actions_outgrow_generation(role, invocations + pretrain_data, generation["max_new_tokens"])
        start = time.perf_counter()
        selection = {}
        if role == "teacher" and select:
            selection = dict(
                evaluate=lambda m: greedy_scores(m, tokenizer, world.env_factory, select, **generation)["f1"],
                eval_epochs=config.teacher_select_epochs,
            )
            info["select_tasks"] = len(select)
        model, losses = train_tiny_agent(
            role, recipe["hidden_size"], recipe["layers"], invocations, copy_data,
            recipe["epochs"], recipe["learning_rate"], tokenizer, config, seed=1 if role == "teacher" else 2,
            pretrain_data=pretrain_data, base_model=start_from, **selection,
        )  # fmt: skip
        seconds = time.perf_counter() - start
        models[role] = model
        scores = greedy_scores(model, tokenizer, world.env_factory, world.evaluation, **generation)
        if role == "teacher" and config.teacher_full_history:  # the same tasks, played under the growing history
            full = greedy_scores(model, tokenizer, full_history_factory, world.evaluation, **generation)
            info.update(full_history_f1=full["f1"], full_history_em=full["em"])
        if world.multi_objective:
            single = greedy_scores(model, tokenizer, world.env_factory, world.eval_questions, **generation)
            info.update(single_f1=single["f1"], single_em=single["em"])
        if pretrain_steps:
            info["pretrain_turns"] = len(pretrain_steps)
        if replay_steps:
            info["replay_turns"] = len(replay_steps)
        if config.base_model is not None:
            info["base_model"] = config.base_model
        elif base_model is not None:
            info["shared_pretraining"] = True
        paths[role].mkdir(parents=True, exist_ok=True)
        model.save_pretrained(paths[role])
        tokenizer.save_pretrained(paths[role])
        tail = losses[-max(1, len(losses) // 20) :]
        info = {
            **scores,
            **info,
            "train_seconds": round(seconds, 1),
            "parameters": sum(p.numel() for p in model.parameters()),
            "expert_turns": len(steps),
            "final_action_nll": sum(tail) / len(tail),
            "recipe": recipe,
            "eval_settings": eval_settings(world, **generation),
            "environment": package_versions(),
        }
        (paths[role] / SETUP_FILE).write_text(json.dumps(info, indent=2))
        single = f", single questions F1 {info['single_f1']:.3f}" if "single_f1" in info else ""
        if "full_history_f1" in info:
            single += f", with the full history F1 {info['full_history_f1']:.3f}"
        sizes = "" if config.base_model else f"hidden {recipe['hidden_size']}, {recipe['layers']} layers "
        _log(
            f"[setup] {role}: {sizes}({info['parameters'] / 1e6:.2f}M parameters), {len(steps)} expert turns, "
            f"action NLL {info['final_action_nll']:.3f}, held-out F1 {scores['f1']:.3f} EM {scores['em']:.3f}{single} "
            f"({seconds:.0f} s)"
        )


# The packages a set-up's numbers depend on (training, tokenizing, retrieval), recorded beside each model it builds.
ENVIRONMENT_PACKAGES = ("torch", "transformers", "tokenizers", "accelerate", "trl", "numpy", "bm25s")


def package_versions() -> dict[str, str]:
    """The installed version of each of `ENVIRONMENT_PACKAGES` (`"absent"` when not installed) and of Python."""
    versions = {"python": platform.python_version()}
    for name in ENVIRONMENT_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions


def _full_history_factory(env_factory):
    """`env_factory` with the memory policy `full_history`: every turn so far in each context (same retriever)."""
    return type(env_factory)(env_factory.env_class, **{**env_factory.kwargs, "memory_policy": "full_history"})


def _expert_settings(expert: dict[str, Any]) -> dict[str, Any]:
    """The expert's play settings without its environment factory."""
    return {key: value for key, value in expert.items() if key != "env_factory"}


def _shared_pretraining_recipe(recipes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What the shared copy warm-up and pretraining depend on: the teacher's recipe without its own imitation data."""
    own_data = ("select_tasks", "select_epochs", "full_history", "history_native", "history_memory")
    return {key: value for key, value in recipes["teacher"].items() if key not in own_data}


def _warn_if_actions_outgrow_generation(role: str, invocations: list, max_new_tokens: int) -> None:
    """Warn when expert actions the model imitates are longer than generation allows: greedy scores would be 0 there."""
    longest = max((len(inv.output_ids) for inv in invocations), default=0)
    if longest > max_new_tokens:
        cut = sum(len(inv.output_ids) > max_new_tokens for inv in invocations) / len(invocations)
        warnings.warn(
            f"The {role}'s expert actions reach {longest} tokens but max_new_tokens is {max_new_tokens}: "
            f"{cut:.1%} of its imitated actions cannot be generated whole (they end malformed, with reward 0). "
            "Raise max_new_tokens (multi-objective tasks carry several facts in memory).",
            stacklevel=3,
        )


def _cached_recipe(path: Path) -> dict[str, Any] | None:
    info = path / SETUP_FILE
    return json.loads(info.read_text()).get("recipe") if info.exists() else None


def _stale_reason(cached: dict[str, Any] | None, recipe: dict[str, Any]) -> str | None:
    """Why a model cached with recipe `cached` must be (re)built for `recipe`, in a few words; `None` if it holds."""
    if cached is None:
        return "building (nothing cached)"
    if cached == recipe:
        return None
    version = cached.get("recipe_version", 1)
    if version != recipe["recipe_version"]:
        return f"rebuilding: cached by set-up recipe version {version}, this is version {recipe['recipe_version']}"
    changed = sorted(key for key in cached.keys() | recipe.keys() if cached.get(key) != recipe.get(key))
    return f"rebuilding: cached with other settings ({', '.join(changed)})"


def _log(message: str) -> None:
    if PartialState().is_main_process:
        print(message, flush=True)
