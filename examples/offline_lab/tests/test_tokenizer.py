import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from memopd_trl.envs.base import ActionFormat
from offline_lab import build_tokenizer


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_action_tags_of_both_presets_are_single_tokens_that_survive_skip_special_tokens(tiny_tokenizer):
    tags = ActionFormat.preset("memopd").special_tokens + ActionFormat.preset("mem1").special_tokens
    assert "<think>" in tags and "</information>" in tags
    for tag in tags:
        ids = _ids(tiny_tokenizer, tag)
        assert len(ids) == 1, tag
        assert tiny_tokenizer.decode(ids, skip_special_tokens=True) == tag
    action = "hmm <think>Paris is in France</think><search>capital of France</search>"
    ids = _ids(tiny_tokenizer, action)
    assert tiny_tokenizer.decode(ids, skip_special_tokens=True) == action
    assert tiny_tokenizer.convert_tokens_to_ids("</search>") in ids


def test_chat_tokens_are_special_and_eos_pads(tiny_tokenizer):
    assert tiny_tokenizer.eos_token == "<|endoftext|>"
    assert tiny_tokenizer.pad_token_id == tiny_tokenizer.eos_token_id
    for token in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        ids = _ids(tiny_tokenizer, token)
        assert len(ids) == 1
        assert tiny_tokenizer.decode(ids, skip_special_tokens=True) == ""


def test_chat_template_renders_env_messages_exactly(tiny_tokenizer):
    messages = [
        {"role": "system", "content": "You are a research agent."},
        {"role": "user", "content": "Who was born first?"},
        {"role": "assistant", "content": "<memory>none</memory><search>Mozart</search>"},
        {"role": "user", "content": "<information>Mozart was born in 1756.</information>"},
    ]
    expected = (
        "<|im_start|>system\nYou are a research agent.<|im_end|>\n"
        "<|im_start|>user\nWho was born first?<|im_end|>\n"
        "<|im_start|>assistant\n<memory>none</memory><search>Mozart</search><|im_end|>\n"
        "<|im_start|>user\n<information>Mozart was born in 1756.</information><|im_end|>\n"
    )
    assert tiny_tokenizer.apply_chat_template(messages, tokenize=False) == expected
    with_prompt = tiny_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert with_prompt == expected + "<|im_start|>assistant\n"


def test_save_and_reload_gives_identical_encodings_and_template(tiny_tokenizer, tmp_path):
    tiny_tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    texts = [
        "Paris is the capital of France.",
        "<memory>Beethoven 1770</memory><answer>Mozart</answer><|im_end|>",
        "Ünïcödé 日本語 🙂 tabs\tand\nnewlines",
    ]
    for text in texts:
        assert _ids(reloaded, text) == _ids(tiny_tokenizer, text)
        assert reloaded.decode(_ids(reloaded, text)) == tiny_tokenizer.decode(_ids(tiny_tokenizer, text))
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    assert reloaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        tiny_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )
    assert len(reloaded) == len(tiny_tokenizer)
    assert reloaded.eos_token_id == tiny_tokenizer.eos_token_id
    assert reloaded.pad_token_id == tiny_tokenizer.pad_token_id


def test_same_texts_give_the_same_vocabulary_and_merges():
    texts = ["the quick brown fox jumps over the lazy dog"] * 3 + ["a fox is quick; the dog is lazy"] * 3
    first = build_tokenizer(texts, vocab_size=320)
    second = build_tokenizer(list(texts), vocab_size=320)
    assert first.get_vocab() == second.get_vocab()
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()
    other = build_tokenizer(["completely different words here"] * 6, vocab_size=320)
    assert other.get_vocab() != first.get_vocab()


def test_vocabulary_stays_within_the_requested_size(tiny_tokenizer):
    assert len(tiny_tokenizer) <= 512
    # Training actually merged something: common words encode shorter than their bytes.
    assert len(_ids(tiny_tokenizer, " directed")) < len(" directed")


@pytest.mark.parametrize(
    "text", ["", "\x00", "naïve café", "東京都", "emoji 🙂👍🏽", "<memo ry>", "  leading and trailing  ", "\r\n\t"]
)
def test_unusual_text_round_trips(tiny_tokenizer, text):
    assert tiny_tokenizer.decode(_ids(tiny_tokenizer, text)) == text


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=40))
def test_arbitrary_unicode_round_trips(tiny_tokenizer, text):
    assert tiny_tokenizer.decode(_ids(tiny_tokenizer, text)) == text


def test_too_small_vocabulary_is_rejected_with_the_minimum():
    with pytest.raises(ValueError, match="at least"):
        build_tokenizer(["some text"], vocab_size=100)


def test_non_string_texts_are_rejected_with_their_index():
    with pytest.raises(TypeError, match="item 1"):
        build_tokenizer(["fine", 3], vocab_size=320)
