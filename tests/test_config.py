"""MemOPDConfig's command line: the help of the fields it redefines says what they do here."""

import dataclasses
import warnings

import pytest
from transformers import HfArgumentParser

from memopd_trl import MemOPDConfig


def test_bf16_help_says_it_is_on_only_with_a_cuda_gpu():
    parser = HfArgumentParser(MemOPDConfig)
    action = parser._option_string_actions["--bf16"]
    assert action.default is None
    assert "on only where a CUDA GPU is available" in action.help and "use_cpu" in action.help
    assert "defaults to `True` if `fp16` is not set" not in action.help, "TRL's text (bf16 on by default) is not so here"
    assert MemOPDConfig(output_dir="out", use_cpu=True).bf16 is False


def test_new_fields_have_help_matching_their_defaults():
    parser = HfArgumentParser(MemOPDConfig)
    defaults = {"--sampled_kl_coef": 0.0, "--misalignment_audit_steps": 10, "--distill_diagnostics": True}
    for flag, default in defaults.items():
        action = parser._option_string_actions[flag]
        assert action.default == default and action.help, flag


@pytest.mark.parametrize(
    "old, new, value",
    [
        ("distill_until_divergence", "distill_divergence_threshold", 0.2),
        ("audit_steps", "misalignment_audit_steps", 3),
    ],
)
def test_a_renamed_field_still_works_for_one_release_with_a_warning(old, new, value):
    with pytest.warns(FutureWarning, match=f"`MemOPDConfig.{old}` is deprecated.*use `{new}`"):
        config = MemOPDConfig(output_dir="out", use_cpu=True, **{old: value})
    assert getattr(config, new) == value and getattr(config, old) is None
    # The old name is cleared once moved: `replace` with the new name must not bring the old value back.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        replaced = dataclasses.replace(config, **{new: 0})
    assert getattr(replaced, new) == 0
    # From the command line too.
    (parsed,) = HfArgumentParser(MemOPDConfig).parse_args_into_dataclasses(
        ["--output_dir", "out", "--use_cpu", "true", f"--{old}", str(value)]
    )
    assert getattr(parsed, new) == value


def test_environment_settings_in_the_config_are_deprecated():
    with pytest.warns(FutureWarning, match=r"\['max_turns'\] are environment settings"):
        MemOPDConfig(output_dir="out", use_cpu=True, max_turns=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MemOPDConfig(output_dir="out", use_cpu=True)  # nothing deprecated set: no warning
