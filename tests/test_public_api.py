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


def test_offline_world_and_report_modules_are_public():
    import memopd_trl
    from memopd_trl import offline, report

    assert memopd_trl.OfflineConfig is offline.OfflineConfig
    assert memopd_trl.make_offline_world is offline.make_offline_world
    assert memopd_trl.prepare_offline_models is offline.prepare_offline_models
    for module, names in (
        (offline, ["make_offline_world", "prepare_offline_models", "load_offline_model", "load_offline_tokenizer",
                   "build_offline_tokenizer", "train_tiny_agent", "greedy_scores", "cached_start_scores"]),
        (report, ["summarize", "format_table", "plot_curves", "write_report", "eval_curve"]),
    ):  # fmt: skip
        for name in names:
            assert getattr(module, name).__doc__, f"{module.__name__}.{name} has no docstring"
