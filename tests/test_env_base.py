import functools

import pytest

from memopd_trl.envs.base import (
    ActionFormat,
    CompactMemoryPolicy,
    FullHistoryMemoryPolicy,
    MemoryAgentEnv,
    get_memory_policy,
    parse_action,
)
from memopd_trl.metrics import exact_match, qa_f1


RECORD = {"_id": "q1", "question": "Who wrote the book?", "answer": "Ana Lee"}
FMT = ActionFormat()


class EchoEnv(MemoryAgentEnv):
    """A minimal environment: a search for `q` answers `result about q`; the query `boom` makes the retriever fail."""

    def task_text(self, record):
        if "question" not in record:
            raise ValueError("no question")
        return record["question"]

    def search(self, query):
        if query == "boom":
            raise ConnectionError("index offline")
        if query.startswith("long"):
            return "x" * 5000
        return f"result about {query}"

    def score(self, answer):
        return {"f1": qa_f1(answer, self._record["answer"]), "em": exact_match(answer, self._record["answer"])}


def search(query, memory="m"):
    return FMT.render_action(memory, "search", query)


def answer(text, memory="m"):
    return FMT.render_action(memory, "answer", text)


def turn_contents(messages):
    return [m["content"] for m in messages[2:]]


# ----- parse_action -------------------------------------------------------------------------------------------------
def test_parse_action_reads_memory_and_one_action_ignoring_free_text():
    parsed = parse_action("let me think <memory> I know X </memory> then <search> who is X </search>", FMT)
    assert (parsed.kind, parsed.memory, parsed.argument, parsed.error) == ("search", "I know X", "who is X", None)
    parsed = parse_action("<memory>done</memory><answer>Ana Lee</answer>", FMT)
    assert (parsed.kind, parsed.argument) == ("answer", "Ana Lee")


@pytest.mark.parametrize(
    "text, error",
    [
        ("I think the answer is Ana", "no <search> or <answer> action"),
        ("<memory>m</memory>", "no <search> or <answer> action"),
        ("<memory>m</memory><search>a</search><search>b</search>", "more than one action; write exactly one"),
        ("<memory>m</memory><search>a</search><answer>b</answer>", "more than one action; write exactly one"),
        ("<memory>m</memory><search>a", "unclosed or unbalanced <search> tag"),
        ("<memory>m<search>a</search>", "unclosed or unbalanced <memory> tag"),
        ("<memory>m</memory><answer>a", "unclosed or unbalanced <answer> tag"),
        ("<memory>m</memory>a</answer>", "unclosed or unbalanced <answer> tag"),
        ("<memory>m</memory><search>   </search>", "empty <search> block"),
        ("<memory>m</memory><answer></answer>", "empty <answer> block"),
        ("<search>a</search><memory>m</memory>", "the <memory> block must come before the action"),
        ("<search>a</search>", "missing <memory> block"),
        ("<memory>a</memory><memory>b</memory><search>q</search>", "more than one <memory> block"),
    ],
)
def test_parse_action_names_what_is_malformed(text, error):
    parsed = parse_action(text, FMT)
    assert parsed.kind == "malformed"
    assert parsed.error == error


def test_parse_action_never_raises_on_non_text():
    parsed = parse_action(None, FMT)
    assert parsed.kind == "malformed" and "must be text" in parsed.error


def test_memory_is_optional_when_the_format_does_not_require_it():
    parsed = parse_action("<search>q</search>", ActionFormat(require_memory=False))
    assert (parsed.kind, parsed.memory, parsed.argument) == ("search", None, "q")


def test_mem1_preset_keeps_memory_in_think_blocks():
    mem1 = ActionFormat.preset("mem1")
    assert mem1.memory_tag == "think"
    assert mem1.stop_strings == ("</search>", "</answer>")
    assert "<think>" in mem1.special_tokens and "<memory>" not in mem1.special_tokens
    parsed = parse_action("<think>X wrote it</think><answer>X</answer>", mem1)
    assert (parsed.kind, parsed.memory) == ("answer", "X wrote it")
    assert parse_action("<memory>m</memory><answer>X</answer>", mem1).error == "missing <think> block"


def test_action_format_rejects_bad_tags_and_unknown_presets():
    with pytest.raises(ValueError, match="simple identifiers"):
        ActionFormat(memory_tag="mem ory")
    with pytest.raises(ValueError, match="distinct"):
        ActionFormat(memory_tag="search")
    with pytest.raises(ValueError, match="Unknown action format"):
        ActionFormat.preset("react")


# ----- malformed actions in an episode ------------------------------------------------------------------------------
def test_malformed_action_gets_a_format_observation_and_counts():
    env = EchoEnv(max_malformed=3)
    env.reset(RECORD)
    result = env.step("no tags at all")
    assert not result.done and result.reward == 0.0
    assert result.info["kind"] == "malformed"
    assert result.info["error"] == "no <search> or <answer> action"
    assert result.observation.startswith("Invalid action (no <search> or <answer> action).")
    assert "<memory>...</memory>" in result.observation  # states the expected format
    assert env.num_malformed == 1
    assert env.messages()[-2]["content"] == "no tags at all"  # the raw text is what the next context carries


def test_max_malformed_ends_the_episode_with_reward_zero():
    env = EchoEnv(max_malformed=2, format_penalty=0.1)
    env.reset(RECORD)
    assert not env.step("<search>q</search>").done
    result = env.step("<memory>m</memory><answer></answer>")
    assert result.done and result.reward == 0.0
    assert result.info["end_reason"] == "malformed" and env.end_reason == "malformed"
    assert env.num_malformed == 2
    with pytest.raises(RuntimeError, match="episode is over"):
        env.step(answer("Ana Lee"))


def test_long_malformed_text_is_cut_to_the_memory_budget():
    env = EchoEnv(max_memory_chars=64)
    env.reset(RECORD)
    env.step("z" * 500)
    kept = env.messages()[-2]["content"]
    assert len(kept) == 64 and kept.endswith(" ...")


# ----- ends, rewards, limits ----------------------------------------------------------------------------------------
def test_answer_ends_with_f1_reward_and_scores_in_info():
    env = EchoEnv()
    env.reset(RECORD)
    env.step(search("book author"))
    result = env.step(answer("Lee"))
    assert result.done and env.answer == "Lee"
    assert result.reward == pytest.approx(qa_f1("Lee", "Ana Lee"))
    assert result.info["f1"] == pytest.approx(2 / 3) and result.info["em"] == 0.0
    assert (env.f1, env.em, env.end_reason) == (pytest.approx(2 / 3), 0.0, "answer")


def test_max_turns_ends_an_unanswered_episode_with_reward_zero():
    env = EchoEnv(max_turns=3)
    env.reset(RECORD)
    results = [env.step(search(f"q{i}")) for i in range(3)]
    assert [r.done for r in results] == [False, False, True]
    assert results[-1].reward == 0.0 and results[-1].info["end_reason"] == "max_turns"
    assert results[-1].observation == "<information>result about q2</information>"


def test_format_penalty_is_subtracted_per_malformed_action_and_floored_at_zero():
    env = EchoEnv(max_malformed=3, format_penalty=0.25)
    env.reset(RECORD)
    env.step("oops")
    assert env.step(answer("Ana Lee")).reward == pytest.approx(0.75)
    env.reset(RECORD)
    env.step("oops")
    env.step("oops again")
    assert env.step(answer("Lee")).reward == pytest.approx(2 / 3 - 0.5)
    env.reset(RECORD)
    env.step("oops")
    env.step("oops again")
    assert env.step(answer("Bob")).reward == 0.0


def test_memory_cut_is_reported_in_info_and_applied_to_later_contexts():
    env = EchoEnv(max_memory_chars=32)
    env.reset(RECORD)
    short = env.step(search("q", memory="short"))
    assert short.info["memory_truncated"] is False
    result = env.step(search("q", memory="a" * 100))
    assert result.info["memory_truncated"] is True
    assert env.num_memory_cuts == 1
    assert len(env.memory) == 32 and env.memory.endswith(" ...")
    assert env.messages()[-2]["content"] == FMT.render_action(env.memory, "search", "q")
    no_memory = EchoEnv(action_format=ActionFormat(require_memory=False))
    no_memory.reset(RECORD)
    assert no_memory.step("<search>q</search>").info["memory_truncated"] is False


def test_long_observations_are_cut_and_reported():
    env = EchoEnv(max_observation_chars=100)
    env.reset(RECORD)
    result = env.step(search("long one"))
    assert result.info["observation_truncated"] is True
    assert result.observation == "<information>" + "x" * 96 + " ..." + "</information>"


def test_retriever_exception_gives_an_error_observation_and_a_counter():
    env = EchoEnv()
    env.reset(RECORD)
    result = env.step(search("boom"))
    assert not result.done
    assert result.observation == "<information>Search failed; try another query.</information>"
    assert result.info["retriever_error"] == "ConnectionError: index offline"
    assert env.num_retriever_errors == 1
    assert env.step(search("fine")).observation == "<information>result about fine</information>"


def test_step_and_messages_need_a_reset_first():
    env = EchoEnv()
    with pytest.raises(RuntimeError, match="reset"):
        env.step(search("q"))
    with pytest.raises(RuntimeError, match="reset"):
        env.messages()


def test_reset_starts_a_clean_episode_and_a_rejected_record_changes_nothing():
    env = EchoEnv()
    env.reset(RECORD)
    env.step("bad")
    env.step(search("q"))
    with pytest.raises(ValueError, match="no question"):
        env.reset({"_id": "broken"})
    assert env.num_turns == 2 and env.task == RECORD["question"]  # the running episode is intact
    assert env.step(answer("Ana Lee")).reward == 1.0  # ... and still scored against its own record
    messages = env.reset({"_id": "q2", "question": "Another?", "answer": "x"})
    assert env.num_turns == 0 and env.num_malformed == 0 and not env.done
    assert [m["role"] for m in messages] == ["system", "user"] and messages[1]["content"] == "Another?"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_turns": 0}, "max_turns"),
        ({"max_malformed": 0}, "max_malformed"),
        ({"max_memory_chars": 8}, "max_memory_chars"),
        ({"max_observation_chars": 0}, "max_observation_chars"),
        ({"format_penalty": -1.0}, "format_penalty"),
        ({"memory_policy": "infinite"}, "Unknown memory policy"),
        ({"action_format": "react"}, "Unknown action format"),
    ],
)
def test_constructor_rejects_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EchoEnv(**kwargs)


# ----- memory policies ----------------------------------------------------------------------------------------------
def play(env, num_turns):
    env.reset(RECORD)
    for i in range(num_turns):
        env.step(search(f"query {i}", memory=f"memory after turn {i}"))


def test_compact_context_holds_task_latest_memory_and_latest_observation_only():
    env = EchoEnv(memory_policy="compact", max_turns=20)
    env.reset(RECORD)
    sizes = []
    for i in range(8):
        env.step(search(f"query {i}", memory=f"memory after turn {i}"))
        messages = env.messages()
        sizes.append(sum(len(m["content"]) for m in messages))
        assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
        assert messages[1]["content"] == RECORD["question"]
        assert messages[2]["content"] == search(f"query {i}", memory=f"memory after turn {i}")
        assert messages[3]["content"] == f"<information>result about query {i}</information>"
    assert max(sizes) - min(sizes) <= 2  # bounded: only the turn number's digits vary


def test_full_history_context_grows_and_contains_every_turn():
    env = EchoEnv(memory_policy="full_history", max_turns=20)
    play(env, 6)
    messages = env.messages()
    assert len(messages) == 2 + 2 * 6
    contents = turn_contents(messages)
    for i in range(6):
        assert search(f"query {i}", memory=f"memory after turn {i}") in contents
        assert f"<information>result about query {i}</information>" in contents
    shorter = EchoEnv(memory_policy="full_history", max_turns=20)
    play(shorter, 3)
    assert sum(map(len, contents)) > sum(map(len, turn_contents(shorter.messages())))


def test_memory_policies_resolve_by_name_or_instance():
    assert isinstance(get_memory_policy("compact"), CompactMemoryPolicy)
    policy = FullHistoryMemoryPolicy()
    assert get_memory_policy(policy) is policy


def test_char_budget_shrinks_full_history_observations_but_never_the_task_or_actions():
    env = EchoEnv(memory_policy="full_history", max_turns=20, max_observation_chars=4000)
    env.reset(RECORD)
    for i in range(4):
        env.step(search(f"long {i}", memory=f"memory {i}"))
    full = turn_contents(env.messages())
    small = env.messages(char_budget=1000)
    assert small[1]["content"] == RECORD["question"]
    assert sum(map(len, turn_contents(small))) <= 1000 < sum(map(len, full))
    for i in range(4):
        assert search(f"long {i}", memory=f"memory {i}") in turn_contents(small)
    assert all(c.endswith(" ...") for c in turn_contents(small)[1::2])


def test_char_budget_cuts_memory_when_actions_alone_exceed_it():
    env = EchoEnv(memory_policy="compact", max_memory_chars=None)
    env.reset(RECORD)
    env.step(search("q", memory="m" * 800))
    assistant = env.messages(char_budget=200)[2]["content"]
    assert len(assistant) < 800
    assert parse_action(assistant, FMT).argument == "q"  # still a valid action with the same query


def test_char_budget_with_compact_policy_spends_the_budget_on_the_carried_turn_only():
    env = EchoEnv(memory_policy="compact", max_turns=20, max_observation_chars=4000)
    env.reset(RECORD)
    for i in range(6):
        env.step(search(f"long {i}"))
    last = env.messages()[-1]["content"]
    assert env.messages(char_budget=len(last) + 100)[-1]["content"] == last  # fits: nothing to cut
    cut = env.messages(char_budget=1000)[-1]["content"]
    assert 900 < len(cut) <= 1000


def test_messages_without_budget_are_not_shrunk():
    env = EchoEnv(memory_policy="full_history")
    play(env, 2)
    assert env.messages(char_budget=None) == env.messages()


# ----- factory ------------------------------------------------------------------------------------------------------
def test_factory_makes_fresh_environments_with_the_same_settings():
    make = EchoEnv.factory(max_turns=4, memory_policy="full_history")
    first, second = make(), make()
    assert first is not second and isinstance(first, EchoEnv)
    assert make.env_class is EchoEnv and make.kwargs == {"max_turns": 4, "memory_policy": "full_history"}
    # A plain `functools.partial`, so a trainer can rebuild it with other settings.
    assert isinstance(make, functools.partial) and make.func is EchoEnv and make.keywords == make.kwargs
    assert first.max_turns == 4 and first.memory_policy.name == "full_history"


def test_the_old_memory_policy_name_persistent_still_works_with_a_warning():
    with pytest.warns(FutureWarning, match='memory_policy="persistent" is deprecated.*"full_history"'):
        env = EchoEnv(memory_policy="persistent")
    assert env.memory_policy.name == "full_history"
