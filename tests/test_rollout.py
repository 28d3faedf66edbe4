import copy
import logging
import sys
import types
from itertools import pairwise

import pytest
import torch
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel, LogitsProcessor, LogitsProcessorList

from memopd_trl.envs.base import MemoryAgentEnv
from memopd_trl.metrics import exact_match, qa_f1
from memopd_trl.rollout import GeneratedAction, RolloutEngine, _StopOnText, find_stop
from memopd_trl.vllm_backend import VLLMBackend
from offline_lab import build_tokenizer, make_synthetic_world
from tiny_models import tiny_causal_lm


CORPUS = {
    "paris": "Paris is the capital and most populous city of France.",
    "mozart": "Mozart was born in Salzburg in 1756 and composed more than 800 works.",
    "beethoven": "Ludwig van Beethoven was a German composer and pianist born in Bonn in 1770.",
}

RECORDS = [
    {"_id": "q0", "question": "Who was born first, Beethoven or Mozart?", "answer": "Mozart"},
    {"_id": "q1", "question": "Which city is the capital of France?", "answer": "Paris"},
    {
        "_id": "q2",
        "question": "Where was the composer of more than 800 works born, and in which year?",
        "answer": "1756",
    },
]


class DictEnv(MemoryAgentEnv):
    """A memory-agent environment whose retriever is a dictionary lookup, scored with HotpotQA's F1."""

    def __init__(self, corpus=None, fail_on=None, **kwargs):
        super().__init__(**kwargs)
        self.corpus = CORPUS if corpus is None else corpus
        self.fail_on = fail_on
        self.received: list[str] = []

    def task_text(self, record):
        return record["question"]

    def search(self, query):
        return self.corpus.get(query.lower(), "No results.")

    def score(self, answer):
        gold = self._record["answer"]
        return {"f1": qa_f1(answer, gold), "em": exact_match(answer, gold)}

    def step(self, action_text):
        self.received.append(action_text)
        if self.fail_on is not None and self._record["_id"] == self.fail_on:
            raise RuntimeError("retriever backend is down")
        return super().step(action_text)


def factory(**kwargs):
    envs = []

    def make():
        env = DictEnv(**kwargs)
        envs.append(env)
        return env

    make.envs = envs
    return make


class ForceText(LogitsProcessor):
    """Makes row `i` of every batch write `scripts[i % len(scripts)]`, whatever the model prefers (runs after the
    log-prob recorder, so the recorded log-probs stay the model's own)."""

    def __init__(self, *scripts):
        self.scripts = [list(script) for script in scripts]
        self.steps = 0

    def __call__(self, input_ids, scores):
        self.steps += 1
        forced = torch.full_like(scores, float("-inf"))
        for row, ids in enumerate(input_ids.tolist()):
            script = self.scripts[row % len(self.scripts)]
            written = max(j for j in range(len(script) + 1) if j == 0 or ids[-j:] == script[:j])
            forced[row, script[min(written, len(script) - 1)]] = 0.0
        return forced


def forced_engine(model, tokenizer, action, env_factory, other_actions=(), **kwargs):
    scripts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in (action, *other_actions)]
    generation_kwargs = {"logits_processor": LogitsProcessorList([ForceText(*scripts)])}
    return RolloutEngine(model, tokenizer, env_factory, generation_kwargs=generation_kwargs, **kwargs)


def rescored_logprobs(model, invocation, temperature):
    ids = torch.tensor([invocation.input_ids + invocation.output_ids])  # (1, seq_len)
    with torch.no_grad():
        logits = model(ids).logits[0, len(invocation.input_ids) - 1 : -1]  # (num_output_tokens, vocab_size)
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logprobs.gather(-1, torch.tensor(invocation.output_ids)[:, None]).squeeze(-1)


# ----- provenance and batching (real generation) --------------------------------------------------------------------
def build_model(make_tiny_model, tokenizer, architecture, seed):
    if architecture != "gpt2":
        return make_tiny_model(architecture=architecture, seed=seed)
    # Absolute position embeddings: unlike RoPE (which only sees position differences, so a constant shift from left
    # padding cancels out), any position-id error under left padding changes these logits.
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_embd=32,
        n_layer=1,
        n_head=2,
        n_positions=1024,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config).eval()


@pytest.mark.parametrize(
    ("architecture", "temperature", "top_k"),
    [("qwen2", 0.7, 0), ("llama", 1.3, 20), ("gpt2", 0.7, 0)],
    ids=["qwen2-t0.7", "llama-topk", "gpt2-absolute-positions"],
)
def test_recorded_logprobs_match_a_fresh_forward_on_the_unpadded_invocation(
    make_tiny_model, tiny_tokenizer, architecture, temperature, top_k
):
    model = build_model(make_tiny_model, tiny_tokenizer, architecture, seed=3)
    engine = RolloutEngine(
        model, tiny_tokenizer, factory(max_turns=3), max_new_tokens=12, temperature=temperature, top_k=top_k
    )
    torch.manual_seed(0)
    episodes, stats = engine.rollout(RECORDS, num_generations=2)

    invocations = [inv for episode in episodes for inv in episode.invocations]
    assert stats["num_turns"] == len(invocations) >= len(episodes)
    first_turn_lengths = {len(inv.input_ids) for inv in invocations if inv.turn == 0}
    assert len(first_turn_lengths) > 1, "contexts of one batch must differ in length so that left padding happens"
    assert all(tiny_tokenizer.pad_token_id not in inv.input_ids for inv in invocations)
    for inv in invocations:
        assert len(inv.logprobs) == len(inv.output_ids) > 0
        expected = rescored_logprobs(model, inv, temperature)
        torch.testing.assert_close(torch.tensor(inv.logprobs), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("architecture", ["qwen2", "llama", "gpt2"])
def test_shared_prompt_prefill_samples_what_one_prefill_per_episode_samples(
    make_tiny_model, tiny_tokenizer, architecture, monkeypatch
):
    # The `num_generations` episodes of a question start from the same context: encoded once, its KV cache handed to
    # every episode. Same seed, same sampled tokens, same recorded log-probs as encoding it once per episode (GPT-2's
    # absolute positions catch a position error in the shared cache).
    model = build_model(make_tiny_model, tiny_tokenizer, architecture, seed=3)

    def play(share: bool):
        engine = RolloutEngine(model, tiny_tokenizer, factory(max_turns=3), max_new_tokens=12, temperature=0.7,
                               share_prefix=share)  # fmt: skip
        torch.manual_seed(0)
        return engine.rollout(RECORDS, num_generations=3)

    (shared, shared_stats), (alone, alone_stats) = play(True), play(False)
    first_contexts = [episode.invocations[0].input_ids for episode in shared[::3]]
    assert shared_stats["num_shared_prefill_tokens"] == sum(2 * (len(ids) - 1) for ids in first_contexts)
    assert alone_stats["num_shared_prefill_tokens"] == 0
    pairs = [(a, b) for x, y in zip(shared, alone, strict=True) for a, b in zip(x.invocations, y.invocations, strict=True)]  # fmt: skip
    assert len(pairs) == sum(e.num_turns for e in alone) == sum(e.num_turns for e in shared)
    for a, b in pairs:
        assert (a.input_ids, a.output_ids) == (b.input_ids, b.output_ids)
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)

    # A cache handed to the wrong episodes (each row its neighbour's twin) is caught by the comparison above.
    original = DynamicCache.batch_select_indices
    monkeypatch.setattr(DynamicCache, "batch_select_indices", lambda self, idx: original(self, idx.roll(1)))
    (wrong, _), first = play(True), [inv for episode in alone for inv in episode.invocations if inv.turn == 0]
    wrong_first = [inv for episode in wrong for inv in episode.invocations if inv.turn == 0]
    assert any(
        a.output_ids != b.output_ids or max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) > 1e-3
        for a, b in zip(wrong_first, first, strict=True)
    )


def test_shared_prompt_prefill_turns_itself_off_for_a_forward_that_cannot_take_it(make_tiny_model, tiny_tokenizer):
    base = make_tiny_model(seed=3)

    class NoLogitsToKeep(type(base)):  # a model whose forward takes no `logits_to_keep`, as some custom models
        def forward(self, *args, **kwargs):
            if "logits_to_keep" in kwargs:
                raise TypeError("forward() got an unexpected keyword argument 'logits_to_keep'")
            return super().forward(*args, **kwargs)

    model = NoLogitsToKeep(base.config).eval()
    model.load_state_dict(base.state_dict())
    engine = RolloutEngine(model, tiny_tokenizer, factory(max_turns=2), max_new_tokens=8, temperature=0.7)
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match=r"share_prefix \(shared prompt prefill\) is turned off"):
        episodes, stats = engine.rollout(RECORDS[:2], num_generations=2)
    assert not engine.share_prefix and stats["num_shared_prefill_tokens"] == 0
    alone = RolloutEngine(base, tiny_tokenizer, factory(max_turns=2), max_new_tokens=8, temperature=0.7,
                          share_prefix=False)  # fmt: skip
    torch.manual_seed(0)
    expected, _ = alone.rollout(RECORDS[:2], num_generations=2)
    assert [[i.output_ids for i in e.invocations] for e in episodes] == [
        [i.output_ids for i in e.invocations] for e in expected
    ]


def test_batched_greedy_rollout_equals_one_record_at_a_time(tiny_model, tiny_tokenizer):
    engine = RolloutEngine(tiny_model, tiny_tokenizer, factory(max_turns=3), max_new_tokens=10)
    batched, _ = engine.rollout(RECORDS, greedy=True)
    single = [engine.rollout([record], greedy=True, group_offset=i)[0][0] for i, record in enumerate(RECORDS)]
    for one, other in zip(batched, single, strict=True):
        assert one.group_id == other.group_id and one.record_id == other.record_id
        assert one.answer == other.answer and one.info["end_reason"] == other.info["end_reason"]
        assert [inv.input_ids for inv in one.invocations] == [inv.input_ids for inv in other.invocations]
        assert [inv.output_ids for inv in one.invocations] == [inv.output_ids for inv in other.invocations]


def test_sampling_ignores_the_models_own_generation_config(make_tiny_model, tiny_tokenizer):
    model = make_tiny_model(seed=5)
    model.generation_config.top_k = 1  # would make sampling greedy if it leaked into the rollout
    model.generation_config.repetition_penalty = 10.0
    engine = RolloutEngine(model, tiny_tokenizer, factory(max_turns=1), max_new_tokens=8, temperature=1.0)
    torch.manual_seed(0)
    episodes, _ = engine.rollout(RECORDS[:1], num_generations=4)
    outputs = {tuple(episode.invocations[0].output_ids) for episode in episodes}
    assert len(outputs) > 1


def test_generation_settings_that_would_change_the_logits_are_reported(make_tiny_model, tiny_tokenizer):
    model = make_tiny_model()
    model.generation_config.suppress_tokens = [5]
    with pytest.warns(UserWarning, match="suppress_tokens"):
        RolloutEngine(model, tiny_tokenizer, factory())


# ----- how episodes end ---------------------------------------------------------------------------------------------
def test_random_model_ends_on_the_malformed_limit(tiny_model, tiny_tokenizer):
    engine = RolloutEngine(tiny_model, tiny_tokenizer, factory(max_turns=5, max_malformed=2), max_new_tokens=8)
    torch.manual_seed(0)
    episodes, stats = engine.rollout(RECORDS, num_generations=2)
    for episode in episodes:
        assert episode.info["end_reason"] == "malformed"
        assert episode.num_turns == episode.num_malformed == 2
        assert episode.reward == 0.0 and episode.answer is None and not episode.failed
    assert stats["num_failed_episodes"] == 0 and stats["num_turns"] == 2 * len(episodes)


def test_forced_answer_ends_the_episode_with_its_reward(tiny_model, tiny_tokenizer):
    action = "<memory>Mozart 1756, Beethoven 1770</memory><answer>Mozart</answer>"
    env_factory = factory(max_turns=4)
    engine = forced_engine(tiny_model, tiny_tokenizer, action, env_factory, max_new_tokens=40)
    episodes, stats = engine.rollout(RECORDS[:1], num_generations=2)
    for episode in episodes:
        assert episode.info["end_reason"] == "answer"
        assert (episode.answer, episode.reward, episode.f1, episode.em) == ("Mozart", 1.0, 1.0, 1.0)
        (inv,) = episode.invocations
        assert inv.output_ids == tiny_tokenizer(action, add_special_tokens=False)["input_ids"]
        assert not inv.truncated and inv.observation_ids is None
    assert all(env.received == [action] for env in env_factory.envs)
    assert stats["mean_reward"] == 1.0


def test_output_is_cut_right_after_the_stop_string(tiny_model, tiny_tokenizer):
    # Row 0 stops early and is padded while row 1 writes a longer action; the forced scripts go on after the closing
    # tag. Each recorded output must end exactly at its own stop: no text after it, no padding.
    short, long = "<memory>m</memory><search>paris</search>", "<memory>a much longer memory</memory><answer>x</answer>"
    env_factory = factory(max_turns=1)
    engine = forced_engine(
        tiny_model, tiny_tokenizer, short + " more", env_factory, other_actions=[long + " more"], max_new_tokens=40
    )
    episodes, _ = engine.rollout(RECORDS[1:2], num_generations=2)
    for episode, action in zip(episodes, (short, long), strict=True):
        (inv,) = episode.invocations
        assert inv.output_ids == tiny_tokenizer(action, add_special_tokens=False)["input_ids"]
        assert len(inv.logprobs) == len(inv.output_ids) and not inv.truncated
    assert [env.received for env in env_factory.envs] == [[short], [long]]
    # Generation itself stopped as soon as the last row closed its action, not at `max_new_tokens`.
    (force,) = engine.generation_kwargs["logits_processor"]
    assert force.steps == len(tiny_tokenizer(long, add_special_tokens=False)["input_ids"])


def test_forced_searches_end_on_max_turns(tiny_model, tiny_tokenizer):
    engine = forced_engine(
        tiny_model, tiny_tokenizer, "<memory>m</memory><search>paris</search>", factory(max_turns=3), max_new_tokens=20
    )
    episodes, _ = engine.rollout(RECORDS[:2])
    for episode in episodes:
        assert episode.info["end_reason"] == "max_turns"
        assert episode.num_turns == 3 and episode.reward == 0.0 and episode.answer is None
        assert [inv.turn for inv in episode.invocations] == [0, 1, 2]
        assert all(inv.observation_ids for inv in episode.invocations[:-1])
        assert episode.invocations[-1].observation_ids is None


def test_hitting_max_new_tokens_marks_the_invocation_truncated(tiny_model, tiny_tokenizer):
    action = "<memory>a long memory that does not fit</memory><search>paris</search>"
    engine = forced_engine(tiny_model, tiny_tokenizer, action, factory(max_turns=1), max_new_tokens=5)
    (episode,), stats = engine.rollout(RECORDS[:1])
    (inv,) = episode.invocations
    assert inv.truncated and len(inv.output_ids) == 5
    assert stats["num_truncated_outputs"] == 1


def test_an_empty_generation_reaches_the_env_as_an_empty_malformed_action(tiny_model, tiny_tokenizer):
    env_factory = factory(max_turns=2, max_malformed=1)
    engine = forced_engine(tiny_model, tiny_tokenizer, "<|endoftext|>", env_factory, max_new_tokens=5)
    (episode,), _ = engine.rollout(RECORDS[:1])
    assert env_factory.envs[0].received == [""]
    assert episode.invocations[0].output_ids == [tiny_tokenizer.eos_token_id]
    assert episode.info["end_reason"] == "malformed" and not episode.invocations[0].truncated


# ----- memory policies and the persistent history -------------------------------------------------------------------
def test_compact_contexts_stay_bounded_while_persistent_contexts_grow(tiny_model, tiny_tokenizer):
    action = "<memory>Paris is the capital</memory><search>paris</search>"
    lengths = {}
    for policy in ("compact", "full_history"):
        engine = forced_engine(
            tiny_model, tiny_tokenizer, action, factory(max_turns=5, memory_policy=policy), max_new_tokens=30
        )
        (episode,), _ = engine.rollout(RECORDS[1:2])
        lengths[policy] = [len(inv.input_ids) for inv in episode.invocations]
    assert len(set(lengths["compact"][1:])) == 1 and max(lengths["compact"]) < 2 * lengths["compact"][0]
    assert all(a < b for a, b in pairwise(lengths["full_history"]))


def test_observation_ids_rebuild_the_persistent_history_exactly(tiny_model, tiny_tokenizer):
    # With a canonical action (the env keeps the text the model wrote), each context is the previous context, the
    # sampled action and its observation ids, token for token.
    action = "<memory>Mozart 1756</memory><search>mozart</search>"
    engine = forced_engine(
        tiny_model, tiny_tokenizer, action, factory(max_turns=4, memory_policy="full_history"), max_new_tokens=30
    )
    episodes, _ = engine.rollout(RECORDS[:2])
    for episode in episodes:
        invs = episode.invocations
        assert len(invs) == 4
        for before, after in pairwise(invs):
            assert before.input_ids + before.output_ids + before.observation_ids == after.input_ids
        text = tiny_tokenizer.decode(invs[0].observation_ids)
        assert text.startswith("<|im_end|>\n<|im_start|>user\n<information>")
        assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_persistent_contexts_extend_the_previous_context_even_for_garbage_actions(tiny_model, tiny_tokenizer):
    engine = RolloutEngine(
        tiny_model,
        tiny_tokenizer,
        factory(max_turns=3, max_malformed=3, memory_policy="full_history"),
        max_new_tokens=8,
    )
    torch.manual_seed(1)
    episodes, _ = engine.rollout(RECORDS, num_generations=2)
    for episode in episodes:
        for before, after in pairwise(episode.invocations):
            assert after.input_ids[: len(before.input_ids)] == before.input_ids


# ----- overlong contexts and failing environments --------------------------------------------------------------------
def test_overlong_context_is_shrunk_by_the_env_and_counted(tiny_model, tiny_tokenizer):
    corpus = {"paris": "Paris is the capital and most populous city of France. " * 30}
    action = "<memory>Paris</memory><search>paris</search>"
    engine = forced_engine(
        tiny_model,
        tiny_tokenizer,
        action,
        factory(corpus=corpus, max_turns=2, max_observation_chars=4096),
        max_new_tokens=20,
        max_prompt_length=300,
    )
    (episode,), stats = engine.rollout(RECORDS[1:2])
    first, second = episode.invocations
    assert len(first.input_ids) <= 300 and 200 < len(second.input_ids) <= 300
    assert second.output_ids == first.output_ids  # the action itself is never cut
    assert stats["num_context_truncations"] == episode.info["context_truncations"] == 1
    assert not episode.failed and episode.info["end_reason"] == "max_turns"


def test_impossible_context_fails_the_episode_without_raising(tiny_model, tiny_tokenizer):
    records = [{"_id": "huge", "question": "Why? " * 400, "answer": "x"}, RECORDS[0]]
    engine = RolloutEngine(tiny_model, tiny_tokenizer, factory(max_turns=2), max_new_tokens=6, max_prompt_length=300)
    episodes, stats = engine.rollout(records)
    huge, normal = episodes
    assert huge.failed and huge.reward == 0.0 and huge.invocations == []
    assert huge.info["end_reason"] == "prompt_too_long" and "max_prompt_length" in huge.info["error"]
    assert not normal.failed and normal.invocations
    assert stats["num_failed_episodes"] == stats["num_prompt_too_long"] == 1


def test_env_that_raises_fails_only_its_episode_and_is_logged(tiny_model, tiny_tokenizer, caplog):
    engine = RolloutEngine(tiny_model, tiny_tokenizer, factory(max_turns=2, fail_on="q1"), max_new_tokens=6)
    with caplog.at_level(logging.WARNING, logger="memopd_trl.rollout"):
        episodes, stats = engine.rollout(RECORDS, num_generations=2)
    failed = [episode for episode in episodes if episode.failed]
    assert [episode.record_id for episode in failed] == ["q1", "q1"]
    assert all(e.info["end_reason"] == "env_error" and e.reward == 0.0 and len(e.invocations) == 1 for e in failed)
    assert all(not e.failed and e.num_turns == 2 for e in episodes if e.record_id != "q1")
    assert stats["num_env_errors"] == stats["num_failed_episodes"] == 2
    assert "'q1'" in caplog.text and "retriever backend is down" in caplog.text


# ----- bookkeeping, backends, stop strings ---------------------------------------------------------------------------
class ScriptedEngine(RolloutEngine):
    """A stub backend behind `_generate`: answers every context with the same tokenized action."""

    def __init__(self, *args, action, **kwargs):
        super().__init__(*args, **kwargs)
        self.action_ids = self.tokenizer(action, add_special_tokens=False)["input_ids"]
        self.batch_sizes = []

    def _generate(self, batch_prompt_ids, stop_strings, greedy=False):
        self.batch_sizes.append(len(batch_prompt_ids))
        return [GeneratedAction(self.action_ids, [-1.0] * len(self.action_ids), False) for _ in batch_prompt_ids]


def test_episode_ids_groups_and_stats_are_consistent(tiny_model, tiny_tokenizer):
    engine = ScriptedEngine(
        tiny_model, tiny_tokenizer, factory(max_turns=2), action="<memory>m</memory><search>paris</search>"
    )
    episodes, stats = engine.rollout(RECORDS, num_generations=3, group_offset=10)
    assert [e.episode_id for e in episodes] == list(range(9))
    assert [e.group_id for e in episodes] == [10] * 3 + [11] * 3 + [12] * 3
    assert [e.record_id for e in episodes] == ["q0"] * 3 + ["q1"] * 3 + ["q2"] * 3
    assert all(
        inv.episode_id == e.episode_id and inv.group_id == e.group_id for e in episodes for inv in e.invocations
    )
    assert engine.batch_sizes == [9, 9]  # all live episodes in one call per turn
    invocations = [inv for e in episodes for inv in e.invocations]
    assert stats["num_episodes"] == 9 and stats["num_turns"] == len(invocations) == 18
    assert stats["num_prompt_tokens"] == sum(len(inv.input_ids) for inv in invocations)
    assert stats["num_generated_tokens"] == sum(len(inv.output_ids) for inv in invocations)
    assert stats["wall_time_s"] > 0


def test_finished_episodes_leave_the_batch(tiny_model, tiny_tokenizer):
    engine = ScriptedEngine(
        tiny_model, tiny_tokenizer, factory(max_turns=3), action="<memory>m</memory><search>paris</search>"
    )
    records = [RECORDS[0], {"_id": "huge", "question": "Why? " * 400, "answer": "x"}]
    engine.max_prompt_length = 300
    episodes, _ = engine.rollout(records, num_generations=2)
    assert engine.batch_sizes == [2, 2, 2]
    assert [e.failed for e in episodes] == [False, False, True, True]


def test_the_public_steps_are_those_the_rollout_takes(tiny_model, tiny_tokenizer):
    # `generate` is called once per turn with every live context, all at that turn; `prompt_ids` renders exactly the
    # recorded contexts; `action_text` is what the environment receives.
    class CountingEngine(ScriptedEngine):
        def generate(self, batch_prompt_ids, stop_strings, greedy=False):
            self.calls.append(list(batch_prompt_ids))
            return super().generate(batch_prompt_ids, stop_strings, greedy)

    action = "<memory>m</memory><search>paris</search> and more"
    env_factory = factory(max_turns=2)
    engine = CountingEngine(tiny_model, tiny_tokenizer, env_factory, action=action)
    engine.calls = []
    episodes, _ = engine.rollout(RECORDS, num_generations=2)
    assert [len(call) for call in engine.calls] == [6, 6]
    for turn, call in enumerate(engine.calls):
        assert call == [episode.invocations[turn].input_ids for episode in episodes]
    first_env = env_factory.envs[0]
    assert engine.prompt_ids(first_env.reset(RECORDS[0])) == episodes[0].invocations[0].input_ids
    assert first_env.received[0] == engine.action_text(episodes[0].invocations[0].output_ids, first_env.stop_strings)
    assert engine.action_text(episodes[0].invocations[0].output_ids, ["</search>"]).endswith("</search>")


def test_progress_bar_only_when_asked(tiny_model, tiny_tokenizer, capsys):
    engine = ScriptedEngine(tiny_model, tiny_tokenizer, factory(max_turns=2), action="<answer>Mozart</answer>")
    engine.rollout(RECORDS[:1])
    assert "rollout turns" not in capsys.readouterr().err
    engine.rollout(RECORDS[:1], progress=True)
    assert "rollout turns" in capsys.readouterr().err


def test_find_stop_handles_stop_strings_split_across_and_inside_tokens(tiny_tokenizer):
    pieces = [tiny_tokenizer.convert_tokens_to_ids(t) for t in ["<", "/", "search", ">"]]
    assert tiny_tokenizer.unk_token_id not in pieces
    ids = tiny_tokenizer("abc", add_special_tokens=False)["input_ids"] + pieces + [pieces[0]]
    assert find_stop(tiny_tokenizer, ids, ["</search>"]) == len(ids) - 1
    tag = tiny_tokenizer("x</answer>y z", add_special_tokens=False)["input_ids"]
    k = find_stop(tiny_tokenizer, tag, ["</search>", "</answer>"])
    assert tiny_tokenizer.decode(tag[:k]) == "x</answer>"
    assert find_stop(tiny_tokenizer, tag, ["</memory>"]) is None


def stop_cases(tokenizer) -> list[tuple[list[int], list[int], tuple[str, ...]]]:
    """
    (prompt, generated ids, stop strings) of three rows whose stop strings differ, each going on after its stop: a tag
    split over four tokens whose last character is inside `>..`; a multi-byte character whose bytes are three
    tokens; and `</answer>` after a prompt that ends in `</answer` (not a stop: the prompt is not generated text)
    and a `</search>` that is not this row's stop string.
    """

    def tokens(*names):
        ids = [tokenizer.convert_tokens_to_ids(name) for name in names]
        assert tokenizer.unk_token_id not in ids
        return ids

    def encode(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    question = encode("Which city is the capital?")
    return [
        (question, encode("q") + tokens("<", "/", "search", ">..", "a", "b"), ("</search>",)),
        (question, encode("a → b c d"), ("→",)),
        (question[3:] + tokens("<", "/", "answer"), encode("> y</search> </answer> z"), ("</answer>",)),
    ]


def first_text_stop(tokenizer, ids: list[int], stop_strings: tuple[str, ...]) -> int:
    """The number of tokens after which the decoded text first holds a stop string, by a plain scan."""
    return next(k for k in range(1, len(ids) + 1) if any(s in tokenizer.decode(ids[:k]) for s in stop_strings))


def test_stop_criterion_ends_each_row_at_the_token_that_completes_its_own_stop_string(tiny_tokenizer):
    cases = stop_cases(tiny_tokenizer)
    expected = [first_text_stop(tiny_tokenizer, ids, stops) for _, ids, stops in cases]
    assert all(len(ids) > k for (_, ids, _), k in zip(cases, expected, strict=True))  # text goes on after each stop
    assert not tiny_tokenizer.decode(cases[0][1][: expected[0]]).endswith("</search>")  # ends inside `>..`
    assert tiny_tokenizer.decode(cases[1][1][expected[1] - 1 : expected[1]]) == "\ufffd"  # `→`'s last byte alone
    width, steps = len(cases[0][0]), max(len(ids) for _, ids, _ in cases)
    padding = tiny_tokenizer("z", add_special_tokens=False)["input_ids"] * steps
    rows = torch.tensor([prompt + (ids + padding)[:steps] for prompt, ids, _ in cases])  # (3, width + steps)
    criterion = _StopOnText(tiny_tokenizer, [stops for _, _, stops in cases], prompt_width=width)
    stopped_at = [None] * len(cases)
    for step in range(1, steps + 1):
        for row, done in enumerate(criterion(rows[:, : width + step], None).tolist()):
            if done and stopped_at[row] is None:
                stopped_at[row] = step
    # One token early, the row would be cut before its stop string; one late, it would sample a token for nothing.
    assert stopped_at == expected


def test_generation_ends_at_the_step_the_last_row_completes_its_stop_string(tiny_model, tiny_tokenizer):
    cases = stop_cases(tiny_tokenizer)
    force = ForceText(*[ids for _, ids, _ in cases])
    engine = RolloutEngine(
        tiny_model,
        tiny_tokenizer,
        factory(),
        max_new_tokens=20,
        generation_kwargs={"logits_processor": LogitsProcessorList([force])},
    )
    actions = engine.generate([cases[0][0]] * len(cases), [stops for _, _, stops in cases], greedy=True)
    expected = [first_text_stop(tiny_tokenizer, ids, stops) for _, ids, stops in cases]
    assert [a.output_ids for a in actions] == [ids[:k] for (_, ids, _), k in zip(cases, expected, strict=True)]
    assert not any(a.truncated for a in actions)
    assert force.steps == max(expected)  # not `max_new_tokens`, not one step more


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": 0.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"backend": "tgi"}, "backend"),
        ({"context_shrink": 1.0}, "context_shrink"),
    ],
)
def test_invalid_settings_are_rejected_by_name(tiny_model, tiny_tokenizer, kwargs, match):
    with pytest.raises(ValueError, match=match):
        RolloutEngine(tiny_model, tiny_tokenizer, factory(), **kwargs)


def test_tokenizer_without_a_usable_chat_template_is_rejected_at_construction(tiny_model, tiny_tokenizer):
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        RolloutEngine(tiny_model, tokenizer, factory())
    # A template that rewrites assistant content cannot give the tokens that follow an action.
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] | upper }}\n{% endfor %}"
    with pytest.raises(ValueError, match="verbatim"):
        RolloutEngine(tiny_model, tokenizer, factory())


# ----- vLLM backend (pure-Python parts, with fake vLLM objects) -------------------------------------------------------
class FakeLogprob:
    def __init__(self, logprob):
        self.logprob = logprob


def fake_request_output(token_ids, logprobs, plain_floats=False):
    steps = [
        {t: (lp if plain_floats else FakeLogprob(lp)), t + 1: FakeLogprob(-9.0)}
        for t, lp in zip(token_ids, logprobs, strict=True)
    ]
    completion = types.SimpleNamespace(token_ids=tuple(token_ids), logprobs=steps, finish_reason="stop")
    return types.SimpleNamespace(outputs=[completion])


def make_vllm_backend(**overrides):
    settings = {"max_new_tokens": 32, "temperature": 0.7, "top_p": 1.0, "top_k": 0, "eos_token_ids": [0, 2]}
    settings.update(overrides)
    return VLLMBackend(types.SimpleNamespace(), **settings)


def test_vllm_sampling_params_follow_the_engine_settings():
    backend = make_vllm_backend()
    kwargs = backend.sampling_params_kwargs(("</search>", "</answer>"), greedy=False)
    assert kwargs["temperature"] == 0.7 and kwargs["top_p"] == 1.0 and kwargs["top_k"] == -1
    assert kwargs["max_tokens"] == 32 and kwargs["stop"] == ["</search>", "</answer>"]
    assert kwargs["include_stop_str_in_output"] and kwargs["stop_token_ids"] == [0, 2]
    assert kwargs["logprobs"] == 0 and kwargs["n"] == 1
    greedy = backend.sampling_params_kwargs(("</search>",), greedy=True)
    assert greedy["temperature"] == 0.0
    with pytest.warns(UserWarning, match="filtered"):
        filtered = make_vllm_backend(top_k=20)
    assert filtered.sampling_params_kwargs((), greedy=False)["top_k"] == 20


def test_vllm_prompts_are_token_ids():
    assert VLLMBackend.token_prompts([[5, 6], [7]]) == [{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7]}]


@pytest.mark.parametrize("plain_floats", [False, True])
def test_vllm_outputs_convert_to_ids_and_sampled_logprobs(plain_floats):
    ids, logprobs = VLLMBackend.convert_output(fake_request_output([11, 12, 13], [-0.5, -1.5, -2.5], plain_floats))
    assert ids == [11, 12, 13] and logprobs == [-0.5, -1.5, -2.5]


def test_vllm_output_without_logprobs_is_a_clear_error():
    output = fake_request_output([11], [-0.5])
    output.outputs[0].logprobs = None
    with pytest.raises(ValueError, match="logprobs=0"):
        VLLMBackend.convert_output(output)


def test_vllm_engine_that_returns_raw_logprobs_warns():
    llm = types.SimpleNamespace(
        llm_engine=types.SimpleNamespace(model_config=types.SimpleNamespace(logprobs_mode="raw_logprobs"))
    )
    with pytest.warns(UserWarning, match="processed_logprobs"):
        VLLMBackend(llm, max_new_tokens=8, temperature=1.0, top_p=1.0, top_k=0, eos_token_ids=[0])


@pytest.mark.parametrize("enabled", [False, True])
def test_vllm_engine_without_prefix_caching_warns(enabled, recwarn):
    llm = types.SimpleNamespace(
        llm_engine=types.SimpleNamespace(
            model_config=types.SimpleNamespace(logprobs_mode="processed_logprobs"),
            cache_config=types.SimpleNamespace(enable_prefix_caching=enabled),
        )
    )
    VLLMBackend(llm, max_new_tokens=8, temperature=1.0, top_p=1.0, top_k=0, eos_token_ids=[0])
    warned = [w for w in recwarn if "prefix caching" in str(w.message)]
    assert len(warned) == (0 if enabled else 1)


def test_vllm_backend_produces_the_same_invocations_through_the_engine(tiny_tokenizer, monkeypatch):
    # A fake `vllm` module: SamplingParams keeps its kwargs; the LLM answers with a fixed action plus one extra token.
    action_ids = tiny_tokenizer("<memory>m</memory><answer>Mozart</answer>", add_special_tokens=False)["input_ids"]
    calls = []

    class FakeLLM:
        def generate(self, prompts, sampling_params, use_tqdm):
            calls.append((prompts, sampling_params))
            ids = action_ids + [action_ids[0]]
            return [fake_request_output(ids, [-0.25] * len(ids)) for _ in prompts]

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(SamplingParams=lambda **kwargs: kwargs))
    engine = RolloutEngine(None, tiny_tokenizer, factory(max_turns=2), backend="vllm", vllm_llm=FakeLLM())
    episodes, _ = engine.rollout(RECORDS[:1], num_generations=2)
    prompts, params = calls[0]
    assert len(prompts) == 2 and params[0]["stop"] == ["</search>", "</answer>"]
    for episode in episodes:
        (inv,) = episode.invocations
        assert inv.input_ids == prompts[0]["prompt_token_ids"]
        assert inv.output_ids == action_ids and inv.logprobs == [-0.25] * len(action_ids)
        assert episode.answer == "Mozart" and episode.reward == 1.0


# ----- the real environments, when they are available ---------------------------------------------------------------
def test_rollout_plays_hotpotqa_env_on_the_synthetic_world():
    hotpot = pytest.importorskip("memopd_trl.envs.hotpot", reason="memopd_trl.envs.hotpot is not available yet")
    world = make_synthetic_world(num_questions=3, seed=0)
    tokenizer = build_tokenizer(world.texts(), vocab_size=600)
    model = tiny_causal_lm(len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2, seed=7)
    env_factory = hotpot.HotpotQAEnv.factory(corpus=world.corpus, max_turns=2)
    engine = RolloutEngine(model, tokenizer, env_factory, max_new_tokens=8, temperature=0.7)
    torch.manual_seed(0)
    episodes, stats = engine.rollout(world.records, num_generations=2)
    assert stats["num_episodes"] == 6 and stats["num_failed_episodes"] == 0
    assert [e.record_id for e in episodes] == [str(r["_id"]) for r in world.records for _ in range(2)]
    for episode in episodes:
        assert 1 <= episode.num_turns <= 2
        for inv in episode.invocations:
            torch.testing.assert_close(
                torch.tensor(inv.logprobs), rescored_logprobs(model, inv, 0.7), atol=1e-4, rtol=0
            )

    record = world.records[0]
    action = f"<memory>found it</memory><answer>{record['answer']}</answer>"
    (episode,), _ = forced_engine(model, tokenizer, action, env_factory, max_new_tokens=64).rollout([record])
    assert episode.info["end_reason"] == "answer" and episode.reward == 1.0 and episode.em == 1.0


def test_rollout_searches_real_hotpotqa_passages_within_the_prompt_limit(
    tiny_model, tiny_tokenizer, hotpot_sample_records
):
    hotpot = pytest.importorskip("memopd_trl.envs.hotpot", reason="memopd_trl.envs.hotpot is not available yet")
    records = hotpot_sample_records[:2]
    corpus = [{"title": title, "text": " ".join(sents)} for r in records for title, sents in r["context"]]
    env_factory = hotpot.HotpotQAEnv.factory(corpus=corpus, max_turns=2)
    query = records[0]["context"][0][0]
    engine = forced_engine(
        tiny_model,
        tiny_tokenizer,
        f"<memory>looking up {query}</memory><search>{query}</search>",
        env_factory,
        max_new_tokens=64,
        max_prompt_length=400,
    )
    episodes, stats = engine.rollout(records)
    assert stats["num_failed_episodes"] == 0 and stats["num_context_truncations"] >= 1
    for episode in episodes:
        assert episode.info["end_reason"] == "max_turns"
        first, second = episode.invocations
        assert len(second.input_ids) <= 400
        assert records[0]["context"][0][1][0][:20] in tiny_tokenizer.decode(first.observation_ids)
