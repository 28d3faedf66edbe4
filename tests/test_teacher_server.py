"""
A teacher on its own server (`MemOPDConfig.teacher_model_server_url`), against tests/teacher_server.py: vLLM's
endpoints answered by a real tiny model's forward on 127.0.0.1. Scores and updates equal the local teacher restricted
to the same top-k; the checks at start, the retries and the response checks. tests/test_vllm_server.py repeats the
equalities against vLLM's own server.
"""

import socket

import pytest
import torch
from teacher_server import serve_teacher
from test_trainer import changed, losses_logged, make_config, params_of
from transformers import TrainerCallback

from memopd_trl import MemOPDConfig, MemOPDTrainer, RolloutEngine
from memopd_trl.callbacks import last_complete_checkpoint
from memopd_trl.packing import rebuilt_sequences
from memopd_trl.teacher import LocalTeacher, PlayingTeacher, ServerTeacher, Teacher, TeacherServerError
from offline_lab import build_tokenizer


K = 8
# Other texts: a tokenizer with other merges, whose ids for the same string differ from the tiny tokenizer's.
OTHER_TEXTS = ["Zebras quietly jump over lazy foxes near the riverbank in autumn.", "xylophone quartz jukebox"] * 8


@pytest.fixture(scope="module")
def teacher_model(make_tiny_model):
    return make_tiny_model(seed=1, hidden_size=48)


@pytest.fixture(scope="module")
def invocations(make_tiny_model, tiny_tokenizer, env_factory, world):
    engine = RolloutEngine(make_tiny_model(seed=0), tiny_tokenizer, env_factory, max_new_tokens=10, temperature=1.0)
    torch.manual_seed(0)
    episodes, _ = engine.rollout(world.records[:2], num_generations=2)
    invocations = [inv for ep in episodes for inv in ep.invocations]
    assert len({inv.turn for inv in invocations}) > 1, "the test needs episodes of several turns"
    return invocations


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_topk(teacher_model, tiny_tokenizer, invocations, history, k):
    from accelerate import Accelerator

    from memopd_trl.packing import PackedInvocationCollator

    pad = tiny_tokenizer.pad_token_id
    collator = PackedInvocationCollator(max_model_length=4096, history=history, pad_token_id=pad)
    teacher = LocalTeacher(
        teacher_model, Accelerator(cpu=True), {history: collator}, pad,
        len(tiny_tokenizer), 1.0, 1024, top_k=k,
    )  # fmt: skip
    action_ids = torch.tensor([t for inv in invocations for t in inv.output_ids])
    return teacher.score(invocations, history, action_ids=action_ids)


@pytest.mark.parametrize("history", ["aligned", "persistent"])
def test_server_scores_equal_the_local_teacher_top_k(teacher_model, tiny_tokenizer, invocations, history):
    with serve_teacher(teacher_model, tiny_tokenizer) as (server, url):
        client = ServerTeacher(url, tiny_tokenizer, K)
        server.received.clear()
        served = client.score(invocations, history)
        # What was sent: every invocation as its own context + action, or each episode's flattened history.
        assert server.received == [ids for ids, _ in rebuilt_sequences(invocations, history)]
        episodes = {inv.episode_id for inv in invocations}
        assert len(server.received) == (len(invocations) if history == "aligned" else len(episodes))
    local = local_topk(teacher_model, tiny_tokenizer, invocations, history, K)
    num_actions = sum(len(inv.output_ids) for inv in invocations)
    assert served.logprobs.shape == (num_actions, K)
    torch.testing.assert_close(served.logprobs, local.logprobs, atol=1e-5, rtol=0)
    assert torch.equal(served.token_ids, local.token_ids)
    torch.testing.assert_close(served.sampled_logprobs, local.sampled_logprobs, atol=1e-5, rtol=0)


def test_persistent_scores_differ_from_aligned_after_turn_0(teacher_model, tiny_tokenizer, invocations):
    """The server is really sent another state at later turns (the control's point), and the same at turn 0."""
    with serve_teacher(teacher_model, tiny_tokenizer) as (_, url):
        client = ServerTeacher(url, tiny_tokenizer, K)
        aligned, persistent = client.score(invocations, "aligned"), client.score(invocations, "persistent")
    turns = torch.tensor([inv.turn for inv in invocations for _ in inv.output_ids])
    gap = (aligned.sampled_logprobs - persistent.sampled_logprobs).abs()
    assert gap[turns == 0].max() < 1e-5
    assert gap[turns > 0].max() > 1e-3


def run_two_steps(tmp_path, world, env_factory, make_tiny_model, tokenizer, teacher_model=None, **settings):
    student = make_tiny_model(seed=0)
    before = params_of(student)
    student.initial = before
    args = make_config(tmp_path, max_steps=2, loss_top_k=K, beta=0.5, misalignment_audit_steps=1, **settings)
    trainer = MemOPDTrainer(
        model=student, teacher_model=teacher_model, args=args, train_dataset=world.records, env_factory=env_factory,
        processing_class=tokenizer,
    )  # fmt: skip
    trainer.train()
    assert changed(before, student)
    return student, trainer


@pytest.mark.parametrize("teacher_scoring", ["aligned", "persistent"])
def test_two_steps_with_the_server_teacher_equal_the_local_teacher_top_k(
    tmp_path, world, env_factory, make_tiny_model, tiny_tokenizer, teacher_model, teacher_scoring
):
    local, local_trainer = run_two_steps(
        tmp_path / "local", world, env_factory, make_tiny_model, tiny_tokenizer, teacher_model,
        teacher_scoring=teacher_scoring,
    )  # fmt: skip
    with serve_teacher(teacher_model, tiny_tokenizer) as (server, url):
        served, served_trainer = run_two_steps(
            tmp_path / "served", world, env_factory, make_tiny_model, tiny_tokenizer,
            teacher_model_server_url=url, teacher_scoring=teacher_scoring,
        )  # fmt: skip
        assert served_trainer.teacher_model is None, "a served teacher is never loaded here"
        assert len(server.received) > 1
    # The same update: Adam's normalization turns float rounding in near-zero gradients into parameter differences
    # of about 1e-6 at this learning rate, against an update of about 1e-2.
    update = max((p.detach() - local.initial[n]).abs().max().item() for n, p in local.named_parameters())
    served_params = dict(served.named_parameters())
    gap = max((served_params[n].detach() - p.detach()).abs().max().item() for n, p in local.named_parameters())
    assert update > 1e-3 and gap < 1e-3 * update, (gap, update)
    distill = losses_logged(served_trainer, "loss/distill")
    assert distill[0] > 0
    torch.testing.assert_close(torch.tensor(distill), torch.tensor(losses_logged(local_trainer, "loss/distill")))
    if teacher_scoring == "aligned":  # the audit on sampled tokens, the same for both teachers
        gap = losses_logged(served_trainer, "misalignment/sampled_logprob_gap_turn_0")
        assert gap and gap[0] < 1e-5
        assert losses_logged(served_trainer, "misalignment/sampled_logprob_gap_turn_1")[0] > 1e-3
        torch.testing.assert_close(
            torch.tensor(losses_logged(served_trainer, "misalignment/sampled_logprob_gap_turn_1")),
            torch.tensor(losses_logged(local_trainer, "misalignment/sampled_logprob_gap_turn_1")),
            atol=1e-5, rtol=0,
        )  # fmt: skip


# -- checks at start ---------------------------------------------------------------------------------------------------


def test_each_teacher_says_what_it_can_do(tmp_path, world, env_factory, make_tiny_model, tiny_tokenizer, teacher_model):
    """One `Teacher` protocol: every teacher scores; only one whose weights are here, with an engine, plays."""
    with serve_teacher(teacher_model, tiny_tokenizer) as (_, url):
        served = ServerTeacher(url, tiny_tokenizer, K)
    assert isinstance(served, Teacher) and not served.can_play
    assert not isinstance(served, PlayingTeacher) and not hasattr(served, "play")
    for generations in (0, 1):
        trainer = MemOPDTrainer(
            model=make_tiny_model(seed=0), teacher_model=make_tiny_model(seed=1),
            args=make_config(tmp_path, teacher_generations=generations), train_dataset=world.records,
            env_factory=env_factory, processing_class=tiny_tokenizer,
        )  # fmt: skip
        assert isinstance(trainer.teacher, LocalTeacher) and isinstance(trainer.teacher, PlayingTeacher)
        assert trainer.teacher.can_play == (generations > 0)
        if generations:  # its own engine, on its own weights: the student's engine is another
            assert trainer.teacher.engine is not trainer.rollout_engine
            assert trainer.teacher.engine.model is trainer.teacher.unwrapped


def test_a_teacher_that_cannot_play_is_refused_when_asked_to(tmp_path, teacher_model, tiny_tokenizer):
    """The capability is checked where the teacher is built (the config refuses a served teacher that plays first;
    here it is set after the config's checks, as a config changed in place would be)."""
    from accelerate import Accelerator

    from memopd_trl.teacher import build_teacher

    with serve_teacher(teacher_model, tiny_tokenizer) as (_, url):
        args = make_config(tmp_path, loss_top_k=K, teacher_model_server_url=url)
        args.teacher_generations = 1
        with pytest.raises(ValueError, match=r"`teacher_generations` \(1\) .* a ServerTeacher cannot play"):
            build_teacher(args, None, Accelerator(cpu=True), tiny_tokenizer, {"pad_token_id": 0}, {})


def test_a_url_that_does_not_answer_is_refused_before_any_rollout(
    tmp_path, world, env_factory, make_tiny_model, tiny_tokenizer
):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(TeacherServerError, match=f"No teacher server answers at {url}"):
        MemOPDTrainer(
            model=make_tiny_model(seed=0), args=make_config(tmp_path, loss_top_k=K, teacher_model_server_url=url),
            train_dataset=world.records, env_factory=env_factory, processing_class=tiny_tokenizer,
        )  # fmt: skip


def test_a_server_with_another_tokenizer_is_refused(teacher_model, tiny_tokenizer):
    other = build_tokenizer(OTHER_TEXTS, vocab_size=512)
    with serve_teacher(teacher_model, other) as (server, url):
        with pytest.raises(TeacherServerError, match=f"at {url} .* tokenizes differently"):
            ServerTeacher(url, tiny_tokenizer, K)
        assert server.completions_requests == 0


def test_a_server_with_a_larger_vocabulary_is_refused(teacher_model, tiny_tokenizer):
    with serve_teacher(teacher_model, tiny_tokenizer, extra_tokens=3) as (_, url):
        with pytest.raises(TeacherServerError, match=f"at {url} .* another vocabulary"):
            ServerTeacher(url, tiny_tokenizer, K)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"loss_top_k": 0}, "set `loss_top_k` >= 1"),
        ({"loss_top_k": K, "teacher_generations": 1}, "needs the teacher's weights"),
        ({"loss_top_k": K, "distill_temperature": 2.0}, "scores at temperature 1"),
        ({"loss_top_k": K, "temperature": 0.7, "sampled_kl_coef": 0.1}, "scores at temperature 1"),
    ],
)
def test_what_a_server_teacher_cannot_do_is_refused_in_the_config(tmp_path, settings, message):
    with pytest.raises(ValueError, match=message):
        MemOPDConfig(output_dir=str(tmp_path), teacher_model_server_url="http://127.0.0.1:1", **settings)


# -- failures mid-run --------------------------------------------------------------------------------------------------


def test_a_failed_request_is_retried_then_succeeds(teacher_model, tiny_tokenizer, invocations):
    with serve_teacher(teacher_model, tiny_tokenizer) as (server, url):
        client = ServerTeacher(url, tiny_tokenizer, K, max_retries=2, backoff=0.01)
        expected = client.score(invocations)
        server.fail_next, before = 2, server.completions_requests
        scores = client.score(invocations)
        assert server.completions_requests - before == 3 * -(-len(invocations) // client.sequences_per_request)
    assert torch.equal(scores.logprobs, expected.logprobs)


def test_a_server_that_keeps_failing_fails_the_step_and_keeps_the_checkpoint(
    tmp_path, world, env_factory, make_tiny_model, tiny_tokenizer, teacher_model
):
    student = make_tiny_model(seed=0)
    with serve_teacher(teacher_model, tiny_tokenizer) as (server, url):
        args = make_config(
            tmp_path, max_steps=3, loss_top_k=K, teacher_model_server_url=url, teacher_server_max_retries=1,
            save_strategy="steps", save_steps=1,
        )  # fmt: skip
        trainer = MemOPDTrainer(
            model=student, args=args, train_dataset=world.records, env_factory=env_factory,
            processing_class=tiny_tokenizer,
        )  # fmt: skip

        class FailAfterFirstStep(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                server.fail_next = 10**6  # every later request

        trainer.add_callback(FailAfterFirstStep())
        with pytest.raises(TeacherServerError, match=rf"at {url} failed POST /v1/completions after 2 attempt"):
            trainer.train()
    assert trainer.state.global_step == 1
    checkpoint = last_complete_checkpoint(args.output_dir)
    assert checkpoint is not None and checkpoint.endswith("checkpoint-1")
    from safetensors.torch import load_file

    saved = load_file(f"{checkpoint}/model.safetensors")
    for name, param in student.named_parameters():  # no half-applied update after the saved step
        torch.testing.assert_close(param.detach(), saved[name], atol=0, rtol=0)


@pytest.mark.parametrize(
    "corrupt, message",
    [
        ("short", "prompt positions for"),
        ("missing", "no log-prob for the sampled token at position"),
        ("nan", "non-finite"),
    ],
)
def test_a_malformed_answer_is_detected_and_named(teacher_model, tiny_tokenizer, invocations, corrupt, message):
    with serve_teacher(teacher_model, tiny_tokenizer) as (server, url):
        client = ServerTeacher(url, tiny_tokenizer, K)
        server.corrupt = corrupt
        with pytest.raises(TeacherServerError, match=f"at {url} .*{message}"):
            client.score(invocations)
