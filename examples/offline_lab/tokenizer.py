"""A small byte-level BPE tokenizer trained locally, for the offline default run and the tests.

Hub tokenizers (Qwen, Llama) are the real-scale choice; this one exists so that everything runs without the network:
it is trained in seconds on the texts of a (synthetic or real) HotpotQA world, encodes any UTF-8 text (byte-level),
keeps the action tags of every preset as single tokens and renders chats with a ChatML-style template.
"""

import re
from collections.abc import Iterable

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from memopd_trl.envs.base import ACTION_FORMAT_PRESETS


EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END)

# ChatML: every message is `<|im_start|>{role}\n{content}<|im_end|>\n`; the generation prompt opens an assistant turn.
# No default system prompt is injected, so the rendered text holds exactly the messages given.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def action_tag_tokens() -> list[str]:
    """
    Returns:
        `list[str]`: every opening and closing tag of every action format preset (`<memory>`, `</search>`, `<think>`,
        ...), without duplicates, in a fixed order.
    """
    tags: list[str] = []
    for name in sorted(ACTION_FORMAT_PRESETS):
        for tag in ACTION_FORMAT_PRESETS[name].special_tokens:
            if tag not in tags:
                tags.append(tag)
    return tags


def _scaffold_texts() -> list[str]:
    # Text that appears in every rendered context (role names, the format instructions of each preset): training on it
    # gives it short encodings, so prompts stay short.
    texts = ["system", "user", "assistant"]
    texts += [ACTION_FORMAT_PRESETS[name].describe() for name in sorted(ACTION_FORMAT_PRESETS)]
    return texts


def build_tokenizer(
    texts: Iterable[str],
    vocab_size: int = 2048,
    min_frequency: int = 2,
    extra_tokens: Iterable[str] = (),
) -> PreTrainedTokenizerFast:
    """
    Train a byte-level BPE tokenizer on `texts`, locally, and wrap it as a transformers fast tokenizer.

    The result has `<|endoftext|>` as EOS and padding token, `<|im_start|>` / `<|im_end|>` as special tokens, a ChatML
    chat template (system / user / assistant, with `add_generation_prompt`), and the tags of every action format
    preset (`<memory>`, `</memory>`, `<search>`, ..., `<think>`, `</think>`) as single tokens. The tags are *not*
    special: `decode(..., skip_special_tokens=True)` keeps them, so an environment sees the action text as sampled.

    Training is deterministic: the same texts and arguments give the same vocabulary and merges.

    Args:
        texts (`Iterable[str]`):
            Training texts (passages, questions, answers). Any UTF-8 text encodes afterwards, whatever was seen here.
        vocab_size (`int`, *optional*, defaults to `2048`):
            Target size of the whole vocabulary, special tokens and tags included. A small corpus may give fewer
            tokens; size models with `len(tokenizer)`.
        min_frequency (`int`, *optional*, defaults to `2`):
            A pair must occur this many times to be merged.
        extra_tokens (`Iterable[str]`, *optional*, defaults to `()`):
            More strings to keep as single (non-special) tokens, e.g. the tags of a custom `ActionFormat`.

    Returns:
        `PreTrainedTokenizerFast`: the tokenizer; `len(tokenizer)` is its full vocabulary size.

    Example:

    ```python
    >>> from offline_lab import build_tokenizer
    >>> tokenizer = build_tokenizer(["Paris is the capital of France."] * 4, vocab_size=400)
    >>> tokenizer.convert_ids_to_tokens(tokenizer("<answer>Paris</answer>")["input_ids"])[0]
    '<answer>'
    ```
    """
    added = action_tag_tokens()
    added += [t for t in extra_tokens if t not in added]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    min_size = len(SPECIAL_TOKENS) + len(added) + len(alphabet)
    if vocab_size < min_size:
        raise ValueError(
            f"`vocab_size` must be at least {min_size} (256 byte symbols, {len(SPECIAL_TOKENS)} special tokens and "
            f"{len(added)} tags), got {vocab_size}."
        )
    if min_frequency < 1:
        raise ValueError(f"`min_frequency` must be >= 1, got {min_frequency}.")

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(added),
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=alphabet,
        show_progress=False,
    )
    # Texts are split at the tags and special tokens, as encoding will split them, so no merge is spent on tag pieces.
    splitter = re.compile("|".join(re.escape(t) for t in sorted([*added, *SPECIAL_TOKENS], key=len, reverse=True)))
    corpus = []
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"`texts` must hold strings; item {i} is a {type(text).__name__}.")
        corpus += [piece for piece in splitter.split(text) if piece]
    corpus += _scaffold_texts()
    backend.train_from_iterator(corpus, trainer=trainer)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,
    )
    # `normalized=False`: the tag is matched on the raw text; `special=False`: it survives `skip_special_tokens`.
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in added])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
