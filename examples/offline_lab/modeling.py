"""Tiny causal language models built from a config, for tests, benchmarks and the offline default run."""

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from memopd_trl.attention import register_varlen_attention


_ARCHITECTURES = ("qwen2", "llama")


def build_tiny_model(
    vocab_size: int,
    architecture: str = "qwen2",
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 4096,
    attn_implementation: str = "sdpa",
    pad_token_id: int | None = None,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> PreTrainedModel:
    """
    Build a randomly initialised decoder-only model (Qwen2 or Llama architecture) from a config, offline.

    The padding-free `"memopd_sdpa_varlen"` attention is registered first
    ([`~memopd_trl.attention.register_varlen_attention`]), so the model may be built with it or switched to it later.

    Args:
        vocab_size (`int`):
            Size of the vocabulary (must cover every token id of the tokenizer used with it).
        architecture (`str`, *optional*, defaults to `"qwen2"`):
            `"qwen2"` or `"llama"`.
        hidden_size (`int`, *optional*, defaults to `64`):
            Width of the residual stream.
        num_hidden_layers (`int`, *optional*, defaults to `2`):
            Number of transformer blocks.
        num_attention_heads (`int`, *optional*, defaults to `4`):
            Number of query heads.
        num_key_value_heads (`int`, *optional*, defaults to `2`):
            Number of key/value heads (grouped-query attention when smaller than `num_attention_heads`).
        intermediate_size (`int`, *optional*):
            MLP width; defaults to `4 * hidden_size`.
        max_position_embeddings (`int`, *optional*, defaults to `4096`):
            Longest sequence the model accepts.
        attn_implementation (`str`, *optional*, defaults to `"sdpa"`):
            `"eager"`, `"sdpa"`, `"flex_attention"`, `"flash_attention_2"` or `"memopd_sdpa_varlen"`.
        pad_token_id, bos_token_id, eos_token_id (`int`, *optional*):
            Special token ids written into the model config.
        seed (`int`, *optional*, defaults to `0`):
            Seed of the weight initialisation: same seed, same weights.
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`):
            Parameter dtype.

    Returns:
        `PreTrainedModel`: a causal LM in eval mode on CPU.

    Example:

    ```python
    >>> from offline_lab import build_tiny_model
    >>> model = build_tiny_model(vocab_size=512, architecture="llama")
    >>> model.config.model_type
    'llama'
    ```
    """
    register_varlen_attention()
    if architecture not in _ARCHITECTURES:
        raise ValueError(f"`architecture` must be one of {_ARCHITECTURES}, got {architecture!r}.")
    if hidden_size % num_attention_heads:
        raise ValueError(
            f"`hidden_size` ({hidden_size}) must be divisible by `num_attention_heads` ({num_attention_heads})."
        )
    config = AutoConfig.for_model(
        architecture,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size or 4 * hidden_size,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=dtype)
    return model.eval()
