"""MemOPDConfig's command line: the help of the fields it redefines says what they do here."""

import re

from transformers import HfArgumentParser

from memopd_trl import MemOPDConfig


_TRAINING_ARGUMENTS_OVERRIDES = (
    "learning_rate", "logging_steps", "gradient_checkpointing", "remove_unused_columns", "per_device_train_batch_size",
    "bf16",
)  # fmt: skip


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



def test_every_field_is_documented_once_in_field_order_under_a_heading():
    own = [name for name in MemOPDConfig.__annotations__ if name not in _TRAINING_ARGUMENTS_OVERRIDES]
    doc = MemOPDConfig.__doc__.split("Parameters:")[1].split("> [!NOTE]")[0]
    documented = re.findall(r"^        (\w+) \(", doc, flags=re.MULTILINE)
    assert documented == own, "the docstring lists the fields in the class's order, each once"
    headings = re.findall(r"^        > Parameters that control .+$", doc, flags=re.MULTILINE)
    assert doc.lstrip().startswith("> Parameters that control") and len(headings) >= 2
    for name in _TRAINING_ARGUMENTS_OVERRIDES:  # TRL lists the defaults it overrides in a note
        assert f"> - `{name}`:" in MemOPDConfig.__doc__, name
