"""Fixtures of the offline lab's own tests: a small synthetic world, a tokenizer trained on it, tiny models.

Session-scoped objects are shared by every test: never train or modify them in place. Build a private model with
`make_tiny_model` when a test changes weights.
"""

from collections.abc import Callable

import pytest

from offline_lab import build_tiny_model, build_tokenizer, make_synthetic_world


@pytest.fixture(scope="session")
def hotpot():
    """The main job, `examples/hotpot.py`, as a module (`examples/` is on pytest's `pythonpath`)."""
    import hotpot

    return hotpot


@pytest.fixture(scope="session")
def world():
    """A small synthetic HotpotQA-format world (8 questions, seed 0)."""
    return make_synthetic_world(8, seed=0)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """The lab's byte-level BPE tokenizer (at most 512 tokens), trained on a 40-question world's texts."""
    return build_tokenizer(make_synthetic_world(40, seed=0).texts(), vocab_size=512)


@pytest.fixture(scope="session")
def make_tiny_model(tiny_tokenizer) -> Callable:
    """A function building a fresh tiny model sized to `tiny_tokenizer` (hidden 32, 1 layer); keyword arguments go to
    `build_tiny_model` (e.g. `seed=1`)."""

    def make(**kwargs):
        sizes = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
        ids = dict(pad_token_id=tiny_tokenizer.pad_token_id, eos_token_id=tiny_tokenizer.eos_token_id)
        return build_tiny_model(len(tiny_tokenizer), **(sizes | ids | kwargs))

    return make


@pytest.fixture(scope="session")
def tiny_model(make_tiny_model):
    """A shared tiny random model. Read-only: do not train it."""
    return make_tiny_model()
