"""offline_lab.diagnostics: the teacher takeover measure and expert labels of student-visited states."""

import pytest
import torch

from memopd_trl.envs.hotpot import HotpotQAEnv
from memopd_trl.envs.multi import multi_objective_max_turns
from memopd_trl.packing import PackedInvocationCollator
from memopd_trl.rollout import RolloutEngine
from memopd_trl.scoring import action_logprobs
from offline_lab import (
    OfflineConfig,
    SyntheticExpert,
    build_tiny_model,
    build_tokenizer,
    load_offline_model,
    load_offline_tokenizer,
    make_offline_world,
    prepare_offline_models,
)
from offline_lab.diagnostics import _scores, expert_labels, takeover_rollout, teacher_takeover


# Tiny real models of a two-question world: a teacher imitating the full expert, a start imitating a forgetful one.
# Their episodes go on after a malformed action, so they last several turns.
CONFIG = dict(
    num_train_questions=24, num_eval_questions=8, vocab_size=400, teacher_hidden_size=32, teacher_layers=1,
    student_hidden_size=32, student_layers=1, copy_warmup_sequences=32, teacher_epochs=0.5,
    student_warmup_questions=8, student_epochs=0.5, imitation_tokens_per_batch=1024, num_sub_questions=2,
    pretrain_questions=12, student_expert_memory="latest", max_malformed=3,
)  # fmt: skip
GENERATION = dict(max_new_tokens=12, max_prompt_length=512)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    config = OfflineConfig(**CONFIG)
    world = make_offline_world(config, max_turns=multi_objective_max_turns(2, retries=1))
    out = tmp_path_factory.mktemp("diagnostics")
    prepare_offline_models(config, world, out, **GENERATION)
    tokenizer = load_offline_tokenizer(out / "teacher")
    built = {
        role: RolloutEngine(load_offline_model(out / role), tokenizer, world.env_factory, **GENERATION)
        for role in ("student_init", "teacher")
    }
    return world, built["student_init"], built["teacher"]


def _ids(episodes):
    return [[(inv.input_ids, inv.output_ids) for inv in episode.invocations] for episode in episodes]


def test_takeover_at_zero_is_the_teacher_and_past_every_episode_the_student(engines):
    world, student, teacher = engines
    records = world.evaluation + world.eval_questions  # tasks and single questions
    alone = {name: engine.rollout(records, greedy=True)[0] for name, engine in
             (("student", student), ("teacher", teacher))}  # fmt: skip
    assert _ids(alone["student"]) != _ids(alone["teacher"]), "the two models must act differently"
    max_turns = world.env_factory().max_turns
    by_turn, played = teacher_takeover(student, teacher, records, return_episodes=True)
    assert list(by_turn) == list(range(max_turns))
    assert _ids(played[0]) == _ids(alone["teacher"]) and by_turn[0]["taken_over"] == 1.0
    assert {key: by_turn[0][key] for key in ("f1", "em", "mean_turns")} == _scores(alone["teacher"])
    assert _ids(played[max_turns - 1]) == _ids(alone["student"])
    assert {key: by_turn[max_turns - 1][key] for key in ("f1", "em", "mean_turns")} == _scores(alone["student"])
    # Past the student's longest episode the result is its own; just before it, the teacher still plays some turns.
    longest = max(episode.num_turns for episode in alone["student"])
    assert longest < max_turns, "a tiny start ends its episodes early (malformed actions or an answer)"
    assert by_turn[longest - 1]["taken_over"] > 0 and by_turn[longest]["taken_over"] == 0
    for k in range(1, longest):  # the first k turns are the student's own, the rest the teacher's
        for episode, own in zip(played[k], alone["student"], strict=True):
            assert _ids([episode])[0][:k] == _ids([own])[0][:k] and episode.info["takeover_turn"] == k
    fractions = [by_turn[k]["taken_over"] for k in range(max_turns)]
    assert fractions == sorted(fractions, reverse=True)


def test_takeover_turns_are_checked(engines):
    world, student, teacher = engines
    with pytest.raises(ValueError, match="`turns` must hold ints >= 0"):
        teacher_takeover(student, teacher, world.evaluation, turns=[-1])


def test_expert_labels_are_the_experts_actions_in_the_students_exact_contexts(engines):
    world, student, _ = engines
    records = world.train[:6]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        episodes, _ = student.rollout(records, num_generations=2)  # sampled: the states a training rollout visits
    expert = SyntheticExpert(world.env_factory().action_format)
    labels = expert_labels(student, episodes, records, expert)
    invocations = [invocation for episode in episodes for invocation in episode.invocations]
    assert len(labels) == len(invocations), "no context was shortened, so every visited state is labelled"
    tokenizer = student.tokenizer
    played = []
    for (messages, action), invocation in zip(labels, invocations, strict=True):
        # Rendered as imitation renders it (`expert_invocations`): the very context the student acted in.
        rendered = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert list(rendered) == invocation.input_ids
        assert action == expert(messages)
        played.append(tokenizer.decode(invocation.output_ids, skip_special_tokens=True))
    assert any(action != text for (_, action), text in zip(labels, played, strict=True)), "the start is no expert"
    assert any(invocation.turn > 0 for invocation in invocations), "later turns follow the student's own actions"


def test_expert_labels_need_the_episodes_records(engines):
    world, student, _ = engines
    episodes, _ = student.rollout(world.train[:1], greedy=True)
    with pytest.raises(ValueError, match="No record with `_id`"):
        expert_labels(student, episodes, world.train[1:2], SyntheticExpert())


# ----- takeover: a second model finishes the episodes ----------------------------------------------------------------
def factory(world, **kwargs):
    return HotpotQAEnv.factory(corpus=world.corpus, top_k=1, system_prompt="Act.", **kwargs)


def rescored_logprobs(model, invocation, temperature):
    """The log-prob `model` gives each token `invocation` generated, in the invocation's own context."""
    with torch.no_grad():
        return action_logprobs(model, PackedInvocationCollator()([invocation]), temperature=temperature)


def test_takeover_plays_the_first_model_before_the_turn_and_the_second_from_it(make_tiny_model, tiny_tokenizer, world):
    records = world.records[:3]
    first, second = (
        RolloutEngine(make_tiny_model(seed=seed), tiny_tokenizer, factory(world, max_turns=3, max_malformed=3),
                      max_new_tokens=8, temperature=0.7)
        for seed in (1, 2)
    )  # fmt: skip
    own_first, _ = first.rollout(records, greedy=True)
    own_second, _ = second.rollout(records, greedy=True)
    assert _ids(own_first) != _ids(own_second), "the two models must act differently for the test to mean anything"
    at_start, _ = takeover_rollout(first, second, records, takeover_turn=0)
    assert _ids(at_start) == _ids(own_second)
    never, _ = takeover_rollout(first, second, records, takeover_turn=3)
    assert _ids(never) == _ids(own_first)

    middle, _ = takeover_rollout(first, second, records, takeover_turn=1)
    for episode, alone in zip(middle, own_first, strict=True):
        assert episode.info["takeover_turn"] == 1 and episode.num_turns == 3
        assert _ids([episode])[0][0] == _ids([alone])[0][0], "turn 0 is the first model's"
        for invocation in episode.invocations[1:]:  # generated, and so recorded, by the second model
            expected = rescored_logprobs(second.model, invocation, temperature=0.7)
            torch.testing.assert_close(torch.tensor(invocation.logprobs), expected, atol=1e-4, rtol=0)
            assert not torch.allclose(rescored_logprobs(first.model, invocation, 0.7), expected, atol=1e-3)
    again, _ = first.rollout(records, greedy=True)
    assert _ids(again) == _ids(own_first), "the first engine plays alone again after a takeover"


def test_takeover_arguments_are_checked(tiny_model, tiny_tokenizer, world):
    records = world.records[:2]
    engine = RolloutEngine(tiny_model, tiny_tokenizer, factory(world, max_turns=2))
    with pytest.raises(TypeError, match="`takeover` must be a RolloutEngine"):
        takeover_rollout(engine, tiny_model, records, takeover_turn=1)
    with pytest.raises(ValueError, match="`takeover_turn` must be an int >= 0"):
        takeover_rollout(engine, engine, records, takeover_turn=-1)
    other_tokenizer = build_tokenizer(world.texts(), vocab_size=300)
    other = RolloutEngine(build_tiny_model(len(other_tokenizer), hidden_size=32, num_hidden_layers=1),
                          other_tokenizer, factory(world, max_turns=2))  # fmt: skip
    with pytest.raises(ValueError, match="`takeover` has another tokenizer"):
        takeover_rollout(engine, other, records, takeover_turn=0)
