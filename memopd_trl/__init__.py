"""memopd-trl: Memory-Aligned On-Policy Distillation (MemOPD) for long-horizon LLM memory agents."""

import importlib
from typing import TYPE_CHECKING


__version__ = "0.1.0.dev0"

# Public name -> module that defines it. Imported lazily so that `import memopd_trl` stays cheap and a user who only
# needs the metrics or the environments does not pay for torch/transformers start-up. The offline lab (synthetic
# world, tiny models, imitation, report) is example code beside the library (`examples/offline_lab/`), not part of
# this API.
_EXPORTS = {
    "Episode": "memopd_trl.records",
    "Invocation": "memopd_trl.records",
    "exact_match": "memopd_trl.metrics",
    "qa_f1": "memopd_trl.metrics",
    "ActionFormat": "memopd_trl.envs.base",
    "MemoryAgentEnv": "memopd_trl.envs.base",
    "StepResult": "memopd_trl.envs.base",
    "HotpotQAEnv": "memopd_trl.envs.hotpot",
    "BM25Retriever": "memopd_trl.envs.retrieval",
    "load_hotpotqa": "memopd_trl.envs.data",
    "PackedInvocationCollator": "memopd_trl.packing",
    "PaddedInvocationCollator": "memopd_trl.packing",
    "RolloutEngine": "memopd_trl.rollout",
    "generalized_jsd_loss": "memopd_trl.losses",
    "chunked_generalized_jsd": "memopd_trl.losses",
    "ppo_clip_loss": "memopd_trl.losses",
    "MemOPDConfig": "memopd_trl.config",
    "MemOPDTrainer": "memopd_trl.trainer",
    "multi_answer_f1": "memopd_trl.metrics",
    "multi_answer_em": "memopd_trl.metrics",
    "make_multi_objective_tasks": "memopd_trl.envs.multi",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'memopd_trl' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)


if TYPE_CHECKING:
    from .config import MemOPDConfig
    from .envs.base import ActionFormat, MemoryAgentEnv, StepResult
    from .envs.data import load_hotpotqa
    from .envs.hotpot import HotpotQAEnv
    from .envs.multi import make_multi_objective_tasks
    from .envs.retrieval import BM25Retriever
    from .losses import chunked_generalized_jsd, generalized_jsd_loss, ppo_clip_loss
    from .metrics import exact_match, multi_answer_em, multi_answer_f1, qa_f1
    from .packing import PackedInvocationCollator, PaddedInvocationCollator
    from .records import Episode, Invocation
    from .rollout import RolloutEngine
    from .trainer import MemOPDTrainer
