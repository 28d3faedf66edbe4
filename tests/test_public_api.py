"""The names DESIGN.md promises users are importable from the top level."""

import pytest


DESIGN_NAMES = [
    "MemOPDConfig", "MemOPDTrainer", "MemoryAgentEnv", "HotpotQAEnv", "Invocation", "PackedInvocationCollator",
    "generalized_jsd_loss", "ppo_clip_loss", "qa_f1", "exact_match",
]


def test_every_public_name_resolves():
    import memopd_trl

    assert set(DESIGN_NAMES) <= set(memopd_trl.__all__)
    for name in memopd_trl.__all__:
        assert getattr(memopd_trl, name) is not None, name
    with pytest.raises(AttributeError):
        memopd_trl.NotAThing  # noqa: B018
