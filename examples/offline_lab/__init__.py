"""The offline lab: everything the main job's offline default and the tests run on, without a network, on a CPU.

Built on the library (`memopd_trl`), never imported by it:

- `world`: a seeded synthetic world of questions in HotpotQA's format ([`make_synthetic_world`]);
- `expert`: a scripted expert for it, and forgetful variants ([`SyntheticExpert`], [`expert_trajectories`]);
- `tokenizer` and `modeling`: a small BPE tokenizer trained locally and tiny random models ([`build_tokenizer`],
  [`build_tiny_model`]);
- `imitation`: imitation learning on expert turns, on the library's packed rows ([`imitation_train`]);
- `setup`: the offline world and its cached tiny teacher and student start ([`OfflineConfig`],
  [`make_offline_world`], [`prepare_offline_models`]);
- `diagnostics`: the teacher takeover measure and expert labels of student-visited states ([`teacher_takeover`],
  [`expert_labels`]);
- `report`: the comparison's summary, table, `results.json` and plots ([`write_report`]);
- `compare`: the main job's arguments, checks and arms x seeds loop, each arm resumable ([`ComparisonArguments`],
  [`run_arms`]).

>>> import offline_lab as offline
>>> config = offline.OfflineConfig(num_train_questions=40, num_eval_questions=8, vocab_size=400)
>>> world = offline.make_offline_world(config, max_turns=3)
"""

from .compare import (
    ARMS,
    OFFLINE_DEFAULTS,
    ComparisonArguments,
    arm_config,
    check_arguments,
    run_arms,
    set_cpu_threads,
)
from .diagnostics import expert_labels, takeover_rollout, teacher_takeover
from .expert import MEMORY_MODES, SyntheticExpert, expert_trajectories, play_episode, reading_steps
from .imitation import copy_task_invocations, expert_invocations, imitation_train
from .modeling import build_tiny_model
from .report import eval_curve, format_table, misalignment_curve, summarize, write_report
from .setup import (
    RECIPE_VERSION,
    VARLEN_ATTENTION,
    OfflineConfig,
    OfflineWorld,
    build_offline_tokenizer,
    cached_start_scores,
    check_student_start,
    check_teacher_gain,
    eval_settings,
    greedy_scores,
    load_offline_model,
    load_offline_tokenizer,
    make_offline_world,
    offline_recipes,
    prepare_offline_models,
    train_tiny_agent,
    validation_tasks,
)
from .tokenizer import build_tokenizer
from .world import NAME_SYLLABLES, SyntheticWorld, make_synthetic_world


# The report's plots (`plot_curves`, `plot_misalignment`) are in `offline_lab.report`.
__all__ = [
    "ARMS", "OFFLINE_DEFAULTS", "ComparisonArguments", "arm_config", "check_arguments", "run_arms", "set_cpu_threads",
    "MEMORY_MODES", "NAME_SYLLABLES", "RECIPE_VERSION", "VARLEN_ATTENTION", "OfflineConfig", "OfflineWorld",
    "SyntheticExpert", "SyntheticWorld", "build_offline_tokenizer", "build_tiny_model", "build_tokenizer",
    "cached_start_scores", "check_student_start", "check_teacher_gain", "copy_task_invocations", "eval_curve",
    "eval_settings", "expert_invocations", "expert_labels", "expert_trajectories", "format_table", "greedy_scores",
    "imitation_train", "load_offline_model", "load_offline_tokenizer", "make_offline_world", "make_synthetic_world",
    "misalignment_curve", "offline_recipes", "play_episode", "prepare_offline_models", "reading_steps", "summarize",
    "takeover_rollout", "teacher_takeover", "train_tiny_agent", "validation_tasks", "write_report",
]  # fmt: skip
