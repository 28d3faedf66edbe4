import random
import statistics

import pytest

from memopd_trl.envs.base import ActionFormat, parse_action
from memopd_trl.envs.hotpot import HotpotQAEnv
from memopd_trl.envs.multi import make_multi_objective_tasks, multi_objective_max_turns
from memopd_trl.envs.retrieval import BM25Retriever
from offline_lab.expert import (
    MEMORY_MODES,
    NO_FACTS_MEMORY,
    SyntheticExpert,
    expert_trajectories,
    make_mistake,
    play_episode,
)
from offline_lab.world import make_synthetic_world, parse_question


@pytest.fixture(scope="module")
def world():
    return make_synthetic_world(500, seed=5)


@pytest.fixture(scope="module")
def retriever(world):
    return BM25Retriever(world.corpus)


class ForgetfulRetriever:
    """Wraps a retriever and returns nothing for the first `misses` searches of each query."""

    def __init__(self, retriever, misses):
        self.retriever, self.misses, self.seen = retriever, misses, {}

    def search(self, query, top_k=3):
        name = " ".join(query.split()[:2])
        self.seen[name] = self.seen.get(name, 0) + 1
        return [] if self.seen[name] <= self.misses else self.retriever.search(query, top_k)


def first_of(world, template):
    return next(r for r in world.records if parse_question(r["question"])[0] == template)


def test_expert_reaches_f1_095_on_500_questions_with_the_compact_policy(world, retriever):
    episodes = expert_trajectories(world, HotpotQAEnv.factory(retriever=retriever, memory_policy="compact"))
    assert len(episodes) == 500
    mean_f1 = statistics.mean(e.f1 for e in episodes)
    assert mean_f1 >= 0.95, mean_f1
    assert all(e.info["num_malformed"] == 0 for e in episodes)
    assert statistics.mean(len(e.steps) for e in episodes) <= 3.2


def test_gold_passage_of_expert_queries_is_in_the_top_5(world, retriever):
    episodes = expert_trajectories(world, HotpotQAEnv.factory(retriever=retriever), limit=200)
    queries = [q for e in episodes for q in e.queries]
    titles = {p["title"] for p in world.corpus}
    assert all(q in titles for q in queries)  # the expert searches entity names, each the title of its passage
    hits = retriever.search_batch(queries, top_k=5)
    recall = sum(q in {h["title"] for h in found} for q, found in zip(queries, hits, strict=True)) / len(queries)
    assert recall >= 0.95


def test_bridge_episode_searches_the_entity_then_the_bridge_entity_then_answers(world, retriever):
    record = first_of(world, "director_birthplace")
    episode = play_episode(HotpotQAEnv(retriever), record, SyntheticExpert())
    head, bridge = (title for title, _ in record["supporting_facts"])
    actions = [parse_action(action, ActionFormat()) for _, action in episode.steps]
    assert [(a.kind, a.argument) for a in actions] == [
        ("search", head),
        ("search", bridge),
        ("answer", record["answer"]),
    ]
    assert actions[0].memory == NO_FACTS_MEMORY
    assert bridge in actions[1].memory and head in actions[1].memory  # the fact naming the bridge is kept
    assert record["answer"] in actions[2].memory
    assert episode.f1 == 1.0 and episode.reward == 1.0


@pytest.mark.parametrize("template", ["founded_first", "released_later", "same_birthplace"])
def test_comparison_episode_searches_both_entities_then_compares(world, retriever, template):
    record = first_of(world, template)
    episode = play_episode(HotpotQAEnv(retriever), record, SyntheticExpert())
    a, b = (title for title, _ in record["supporting_facts"])
    assert episode.queries == [a, b]
    last = parse_action(episode.steps[-1][1], ActionFormat())
    assert last.kind == "answer" and last.argument == record["answer"]
    assert a in last.memory and b in last.memory


def test_expert_only_reads_the_messages_it_is_given(world, retriever):
    record = first_of(world, "founder_birthplace")
    episode = play_episode(HotpotQAEnv(retriever), record, SyntheticExpert())
    fresh = SyntheticExpert()
    for messages, action in episode.steps:
        assert fresh(messages) == action  # stateless: the same messages give the same action


def test_expert_works_with_the_full_history_policy_and_the_mem1_format(world, retriever):
    for kwargs in ({"memory_policy": "full_history"}, {"action_format": "mem1"}):
        episodes = expert_trajectories(world, HotpotQAEnv.factory(retriever=retriever, **kwargs), limit=30)
        assert statistics.mean(e.f1 for e in episodes) == 1.0
    mem1_episode = expert_trajectories(world, HotpotQAEnv.factory(retriever=retriever, action_format="mem1"), limit=1)
    assert mem1_episode[0].steps[0][1].startswith("<think>")


def test_a_missed_search_is_retried_then_the_expert_guesses(world, retriever):
    record = first_of(world, "director_birthplace")
    head = record["supporting_facts"][0][0]
    once = play_episode(HotpotQAEnv(ForgetfulRetriever(retriever, misses=1)), record, SyntheticExpert())
    assert once.queries[:2] == [head, f"{head} film"] and once.f1 == 1.0
    never = play_episode(HotpotQAEnv(ForgetfulRetriever(retriever, misses=99)), record, SyntheticExpert(retries=2))
    assert never.queries == [head, f"{head} film", f"{head} directed"]
    assert parse_action(never.steps[-1][1], ActionFormat()).argument == "unknown" and never.f1 == 0.0


def test_expert_f1_reflects_retrieval_quality(world, retriever):
    make = HotpotQAEnv.factory(retriever=ForgetfulRetriever(retriever, misses=99))
    episodes = expert_trajectories(world, make, limit=40)
    assert statistics.mean(e.f1 for e in episodes) < 0.5  # only lucky comparison guesses score


def test_sft_examples_pair_each_context_with_the_action(world, retriever):
    episode = expert_trajectories(world, HotpotQAEnv.factory(retriever=retriever), limit=1)[0]
    examples = episode.sft_examples()
    assert len(examples) == len(episode.steps)
    for example, (messages, action) in zip(examples, episode.steps, strict=True):
        assert example["prompt"] == messages and example["prompt"] is not messages
        assert example["completion"] == [{"role": "assistant", "content": action}]
    assert examples[0]["prompt"][-1]["role"] == "user" and examples[1]["prompt"][-1]["content"].startswith(
        "<information>"
    )


def test_min_f1_keeps_only_good_episodes(world, retriever):
    make = HotpotQAEnv.factory(retriever=ForgetfulRetriever(retriever, misses=99))
    episodes = expert_trajectories(world.records[:20], make, min_f1=1.0)
    assert all(e.f1 == 1.0 for e in episodes) and len(episodes) < 20


def test_expert_rejects_tasks_outside_the_synthetic_world():
    with pytest.raises(ValueError, match="only plays synthetic-world questions"):
        SyntheticExpert()([{"role": "user", "content": "Question: Who wrote Hamlet?"}])
    with pytest.raises(ValueError, match="retries"):
        SyntheticExpert(retries=5)


def test_mistakes_keep_the_expert_label_and_reach_states_clean_play_never_visits(world, retriever):
    factory = HotpotQAEnv.factory(retriever=retriever, top_k=1, max_turns=5)
    records = world.records[:120]
    clean = expert_trajectories(records, factory)
    noisy = expert_trajectories(records, factory, mistake_prob=0.4, seed=3)

    def missed_search_states(episodes):
        return sum("No results found" in messages[-1]["content"] for e in episodes for messages, _ in e.steps)

    assert missed_search_states(clean) == 0
    assert missed_search_states(noisy) > 10
    assert sum(len(e.steps) for e in noisy) > sum(len(e.steps) for e in clean)  # recoveries cost turns
    expert = SyntheticExpert()
    for episode in noisy:
        for messages, action in episode.steps:  # every recorded action is the expert's own, in the state reached
            assert action == expert(messages)
    # Same seed, same mistakes.
    again = expert_trajectories(records, factory, mistake_prob=0.4, seed=3)
    assert [e.queries for e in again] == [e.queries for e in noisy]


def test_make_mistake_changes_searches_only_and_stays_well_formed():
    fmt, rng = ActionFormat(), random.Random(0)
    answer = fmt.render_action("Kalo Venu is a 1990 film directed by Sara Pepadi.", "answer", "Pami")
    assert make_mistake(answer, fmt, rng) == answer
    search = fmt.render_action(
        "Kalo Venu is a 1990 film directed by Sara Pepadi. Sara Pepadi is a poet born in Pami.", "search", "Dorren Taval"
    )
    for _ in range(50):
        slipped = make_mistake(search, fmt, rng)
        parsed = parse_action(slipped, fmt)
        assert parsed.kind == "search" and slipped != search


def test_mistake_prob_out_of_range_is_a_clear_error(world, retriever):
    with pytest.raises(ValueError, match="mistake_prob"):
        expert_trajectories(world.records[:2], HotpotQAEnv.factory(retriever=retriever), mistake_prob=1.5)


# ----- multi-objective tasks and forgetful experts ------------------------------------------------------------------
@pytest.fixture(scope="module")
def tasks(world):
    return make_multi_objective_tasks(world.records, k=2, seed=0)


@pytest.fixture(scope="module")
def multi_factory(retriever):
    return HotpotQAEnv.factory(retriever=retriever, max_turns=multi_objective_max_turns(2, retries=1))


def test_expert_f1_on_k2_tasks_stays_close_to_its_single_question_f1(world, tasks, multi_factory):
    single = statistics.mean(e.f1 for e in expert_trajectories(world, multi_factory))
    multi = expert_trajectories(tasks, multi_factory)
    assert len(multi) == 250 and all(e.info["num_malformed"] == 0 for e in multi)
    assert statistics.mean(e.f1 for e in multi) >= single - 0.03 and single >= 0.95


def test_multi_episode_plays_the_sub_questions_in_order_and_keeps_every_fact(world, tasks, retriever):
    by_id = {r["_id"]: r for r in world.records}
    task = next(t for t in tasks if t["sub_types"] == ["bridge", "comparison"])
    episode = play_episode(HotpotQAEnv(retriever), task)
    singles = [play_episode(HotpotQAEnv(retriever), by_id[i]) for i in task["sub_ids"]]
    assert episode.queries == singles[0].queries + singles[1].queries
    memories = [parse_action(action, ActionFormat()).memory for _, action in episode.steps]
    assert memories[0] == NO_FACTS_MEMORY
    single_memories = [parse_action(s.steps[-1][1], ActionFormat()).memory for s in singles]
    assert memories[-1] == " ".join(single_memories)  # every fact, verbatim, in the order found
    for before, after in zip(memories[1:], memories[2:], strict=False):
        assert after.startswith(before)  # a fact once written stays
    last = parse_action(episode.steps[-1][1], ActionFormat())
    single_answers = [parse_action(s.steps[-1][1], ActionFormat()).argument for s in singles]
    assert last.kind == "answer" and last.argument == " ; ".join(single_answers) == task["answer"]
    assert episode.f1 == 1.0


@pytest.mark.parametrize("memory", ["latest", "none"])
def test_forgetful_expert_plays_the_same_searches_and_answer_format(tasks, multi_factory, memory):
    full = expert_trajectories(tasks[:80], multi_factory)
    forgetful = expert_trajectories(tasks[:80], multi_factory, memory=memory)
    assert [e.queries for e in forgetful] == [e.queries for e in full]
    for episode in forgetful:
        answer = parse_action(episode.steps[-1][1], ActionFormat())
        assert answer.kind == "answer" and len(answer.argument.split(" ; ")) == 2
        memories = [parse_action(action, ActionFormat()).memory for _, action in episode.steps]
        if memory == "none":
            assert set(memories) == {NO_FACTS_MEMORY}
        else:  # one fact sentence, the one just found
            assert memories[0] == NO_FACTS_MEMORY
            for (messages, _), kept in zip(episode.steps[1:], memories[1:], strict=True):
                assert kept.count(" is ") == 1 and kept in messages[-1]["content"]
    expert = SyntheticExpert(memory=memory)
    for messages, action in forgetful[0].steps:  # stateless: the same messages give the same action
        assert expert(messages) == action


def test_forgetful_experts_score_the_last_sub_question_only(tasks, multi_factory):
    f1 = {m: [e.info["sub_f1"] for e in expert_trajectories(tasks, multi_factory, memory=m)] for m in MEMORY_MODES}
    assert statistics.mean(s[0] for s in f1["full"]) >= 0.95
    for memory in ("latest", "none"):
        assert statistics.mean(s[0] for s in f1[memory]) < 0.35  # guesses: only comparisons score, by chance
    assert statistics.mean(s[1] for s in f1["latest"]) >= 0.95  # both facts of the last one are still in view
    assert statistics.mean(s[1] for s in f1["none"]) >= 0.7  # a comparison's first fact is already forgotten


def test_memory_mode_is_checked_and_passed_through(world, retriever):
    with pytest.raises(ValueError, match="`memory` must be one of"):
        SyntheticExpert(memory="half")
    with pytest.raises(ValueError, match="memory mode is 'full'"):
        expert_trajectories(
            world.records[:2], HotpotQAEnv.factory(retriever=retriever), SyntheticExpert(), memory="none"
        )
    episode = play_episode(HotpotQAEnv(retriever, action_format="mem1"), world.records[0], memory="none")
    assert all(action.startswith(f"<think>{NO_FACTS_MEMORY}</think>") for _, action in episode.steps)


def test_a_history_reader_labels_a_forgetful_history_with_the_facts_its_memory_lost(tasks, retriever):
    history = HotpotQAEnv.factory(retriever=retriever, memory_policy="full_history",
                                  max_turns=multi_objective_max_turns(2, retries=1))  # fmt: skip
    forgetful = SyntheticExpert(memory="searches")
    played = expert_trajectories(tasks[:60], history, memory="searches")
    labeled = {reads: expert_trajectories(tasks[:60], history, SyntheticExpert(reads=reads), behavior=forgetful)
               for reads in ("history", "latest")}  # fmt: skip
    own = expert_trajectories(tasks[:60], history)  # the full-memory expert playing its own episodes
    for episodes in labeled.values():  # the forgetful expert played: its states, its queries, its scores
        assert [e.queries for e in episodes] == [e.queries for e in played]
        assert [e.f1 for e in episodes] == [e.f1 for e in played]
    answers = {reads: [parse_action(e.steps[-1][1], ActionFormat()).argument for e in episodes]
               for reads, episodes in labeled.items()}  # fmt: skip
    truth = [task["answer"] for task in tasks[:60]]
    # The history still shows the first passage that the forgetful memory lost: only the reader of all of it answers.
    assert statistics.mean(a == t for a, t in zip(answers["history"], truth, strict=True)) >= 0.95
    assert statistics.mean(a == t for a, t in zip(answers["latest"], truth, strict=True)) < 0.35
    assert statistics.mean(e.f1 for e in played) < 0.7
    # and it wants every fact found so far written, as the full-memory expert writes in its own episodes
    for episode, mine in zip(labeled["history"], own, strict=True):
        memories = [parse_action(action, ActionFormat()).memory for _, action in episode.steps]
        assert memories == [parse_action(action, ActionFormat()).memory for _, action in mine.steps]
    # A forgetful reader keeps only its notes, and still answers every sub-question from the history.
    reader = expert_trajectories(tasks[:60], history, SyntheticExpert(memory="searches", reads="history"))
    assert statistics.mean(e.f1 for e in reader) >= 0.95
    assert [[a for _, a in e.steps[:-1]] for e in reader] == [[a for _, a in e.steps[:-1]] for e in played]


def test_in_compact_contexts_the_history_reader_writes_what_the_memory_expert_writes(world, retriever):
    # Mistakes make a memory lose its last fact; the compact context no longer shows it either.
    episodes = expert_trajectories(world, HotpotQAEnv.factory(retriever=retriever), limit=80, mistake_prob=0.5)
    reader = SyntheticExpert(reads="history")
    assert all(reader(messages) == action for episode in episodes for messages, action in episode.steps)
    with pytest.raises(ValueError, match="`reads` must be one of"):
        SyntheticExpert(reads="all")
