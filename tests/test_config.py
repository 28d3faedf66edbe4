"""MemOPDConfig's command line: the help of the fields it redefines says what they do here."""

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
    defaults = {"--sampled_kl_coef": 0.0, "--audit_steps": 10, "--distill_diagnostics": True}
    for flag, default in defaults.items():
        action = parser._option_string_actions[flag]
        assert action.default == default and action.help, flag
