"""Tiny random causal LMs for the library's tests, built from a transformers config (no checkpoint, no network), and
the texts their tokenizer is trained on.

Importable by the test modules and by the scripts the tests start (`tests/distributed`, `tests/interruption_run.py`).
"""

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from memopd_trl.attention import register_varlen_attention


# A small, fixed, HotpotQA-flavoured corpus: enough to train a few hundred merges.
TOKENIZER_TEXTS = [
    "Paris is the capital and most populous city of France.",
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France.",
    "Marie Curie was a Polish and naturalised-French physicist and chemist who conducted research on radioactivity.",
    "Which city is the capital of the country where the Eiffel Tower stands?",
    "Were Marie Curie and Pierre Curie both born in France?",
    "The Danube is the second-longest river in Europe, after the Volga.",
    "Ludwig van Beethoven was a German composer and pianist born in Bonn in 1770.",
    "Who was born first, Ludwig van Beethoven or Wolfgang Amadeus Mozart?",
    "Mozart was born in Salzburg in 1756 and composed more than 800 works.",
    "The Great Wall of China is a series of fortifications built across northern China.",
    "Is the Danube longer than the Rhine?",
    "The Rhine flows from the Swiss Alps to the North Sea through Germany and the Netherlands.",
    "no answer yes the a an of in on to from by with and or",
] * 4


def tiny_causal_lm(
    vocab_size: int,
    architecture: str = "qwen2",
    seed: int = 0,
    attn_implementation: str = "sdpa",
    dtype: torch.dtype = torch.float32,
    **config,
) -> PreTrainedModel:
    """
    A randomly initialised `architecture` model (`"qwen2"` or `"llama"`) in eval mode: hidden 64, 2 layers, 4 query
    and 2 key/value heads unless `config` says otherwise (any field of the architecture's config, e.g.
    `hidden_size=32`, `eos_token_id=...`). The same seed gives the same weights, whatever the global RNG holds.
    The padding-free attention (`memopd_sdpa_varlen`) is registered first, so it may be asked for.
    """
    register_varlen_attention()
    hidden_size = config.pop("hidden_size", 64)
    settings = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    settings |= dict(intermediate_size=4 * hidden_size, tie_word_embeddings=False, pad_token_id=None, bos_token_id=None)
    settings |= dict(eos_token_id=None) | config
    model_config = AutoConfig.for_model(architecture, vocab_size=vocab_size, hidden_size=hidden_size, **settings)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(model_config, attn_implementation=attn_implementation, dtype=dtype)
    return model.eval()
