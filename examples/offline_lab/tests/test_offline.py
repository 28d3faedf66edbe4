"""offline_lab.setup: the offline world, its tokenizer, and the cached tiny teacher and student start."""

import copy
import dataclasses
import json
import shutil
import warnings

import pytest
import torch
from tokenizers import Tokenizer

from memopd_trl import MemOPDConfig, MemOPDTrainer
from memopd_trl.envs.base import parse_action
from memopd_trl.envs.multi import multi_objective_max_turns
from offline_lab import (
    NAME_SYLLABLES,
    RECIPE_VERSION,
    OfflineConfig,
    cached_start_scores,
    check_student_start,
    expert_trajectories,
    greedy_scores,
    load_offline_model,
    load_offline_tokenizer,
    make_offline_world,
    prepare_offline_models,
    reading_steps,
)
from offline_lab.setup import ENVIRONMENT_PACKAGES, offline_recipes


TINY = dict(
    num_train_questions=24, num_eval_questions=4, vocab_size=400, teacher_hidden_size=32, teacher_layers=1,
    student_hidden_size=32, student_layers=1, copy_warmup_sequences=32, teacher_epochs=0.5,
    student_warmup_questions=8, student_epochs=0.5, imitation_tokens_per_batch=1024,
)  # fmt: skip
GENERATION = dict(max_new_tokens=12, max_prompt_length=512)
# A memory-needing world: two sub-questions per task, a shared pretraining, a forgetful student expert.
MULTI = dict(TINY, num_sub_questions=2, pretrain_questions=12, student_expert_memory="latest")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The tiny teacher and student start, built once (read only: copy the directory to change it)."""
    config = OfflineConfig(**TINY)
    world = make_offline_world(config, max_turns=3)
    out = tmp_path_factory.mktemp("offline")
    setup = prepare_offline_models(config, world, out, **GENERATION)
    return config, world, out, setup


def test_config_rejects_bad_values_naming_the_field():
    with pytest.raises(ValueError, match="`vocab_size` must be >= 1"):
        OfflineConfig(vocab_size=0)
    with pytest.raises(ValueError, match="`expert_mistake_prob` must be in"):
        OfflineConfig(expert_mistake_prob=1.5)
    with pytest.raises(ValueError, match="`teacher_epochs` must be > 0"):
        OfflineConfig(teacher_epochs=0)
    with pytest.raises(ValueError, match="`num_sub_questions` must be >= 1"):
        OfflineConfig(num_sub_questions=0)
    with pytest.raises(ValueError, match="`student_expert_memory` must be one of"):
        OfflineConfig(student_expert_memory="some")
    with pytest.raises(ValueError, match="`pretrain_questions` must be >= 0"):
        OfflineConfig(pretrain_questions=-1)
    with pytest.raises(ValueError, match="`pretrain_questions` \\(7000\\) exceeds `num_train_questions`"):
        OfflineConfig(pretrain_questions=7000).check_world_sizes()  # checked when the world is built
    with pytest.raises(ValueError, match="`pretrain_epochs` must be > 0"):
        OfflineConfig(pretrain_epochs=0)


def test_settings_are_the_config_fields_only_even_on_a_subclass():
    @dataclasses.dataclass
    class Extended(OfflineConfig):
        seeds: list[int] = dataclasses.field(default_factory=lambda: [0, 1])

    settings = Extended(vocab_size=500).settings()
    assert settings == dataclasses.asdict(OfflineConfig(vocab_size=500))
    assert "seeds" not in settings


def test_world_is_seeded_and_split_with_the_environment_settings():
    config = OfflineConfig(**TINY)
    world = make_offline_world(config, max_turns=3, memory_policy="compact")
    again = make_offline_world(config, max_turns=3, memory_policy="compact")
    assert len(world.train) == 24 and len(world.evaluation) == 4
    assert world.train + world.evaluation == world.world.records == again.world.records
    assert world.env_settings() == {
        "top_k": 1, "max_malformed": 1, "system_prompt": "Act.", "max_turns": 3, "memory_policy": "compact",
    }  # fmt: skip
    env = world.env_factory()
    assert env.max_turns == 3 and env.system_prompt == "Act."
    other = make_offline_world(dataclasses.replace(config, world_seed=1), max_turns=3)
    assert other.world.records != world.world.records


def test_models_are_built_with_their_recipe_and_load_back_identically(built):
    config, world, out, setup = built
    recipes = offline_recipes(config, world)
    for role in ("teacher", "student_init"):
        info = json.loads((out / role / "memopd_setup.json").read_text())
        assert info == setup[role] and info["recipe"] == recipes[role]
        assert 0.0 <= info["f1"] <= 1.0 and info["expert_turns"] > 0 and info["final_action_nll"] > 0
        # The versions it was built with: a set-up rebuilt under others can differ.
        assert info["environment"]["torch"] == torch.__version__ and info["environment"]["bm25s"] != "absent"
        assert set(info["environment"]) == {"python", *ENVIRONMENT_PACKAGES}
    assert setup["student_init"]["expert_turns"] < setup["teacher"]["expert_turns"], "the student sees fewer questions"
    tokenizer = load_offline_tokenizer(out / "teacher")
    # The ids are those of the saved tokenizer.json (numbers not split into digits, as a Qwen2Tokenizer would).
    text = world.world.corpus[0]["text"] + " founded in 1954"
    saved = Tokenizer.from_file(str(out / "teacher" / "tokenizer.json"))
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == saved.encode(text, add_special_tokens=False).ids
    assert load_offline_tokenizer(out / "student_init").get_vocab() == tokenizer.get_vocab()
    # The capitalized name syllables are tokens of their own (names then tokenize the same after a space or a tag).
    assert all(s.capitalize() in tokenizer.get_vocab() for s in NAME_SYLLABLES)
    teacher = load_offline_model(out / "teacher")
    assert teacher.config._attn_implementation == "memopd_sdpa_varlen" and teacher.dtype == torch.float32
    assert teacher.config.hidden_size == 32


def test_rerun_reuses_the_cache_and_a_changed_recipe_rebuilds_what_depends_on_it(built, tmp_path):
    config, world, out, _ = built
    shutil.copytree(out, tmp_path / "cache")
    cache = tmp_path / "cache"
    stamp = {role: (cache / role / "model.safetensors").stat().st_mtime_ns for role in ("teacher", "student_init")}
    prepare_offline_models(config, world, cache, **GENERATION)
    assert stamp == {role: (cache / role / "model.safetensors").stat().st_mtime_ns for role in stamp}
    prepare_offline_models(dataclasses.replace(config, student_epochs=0.25), world, cache, **GENERATION)
    assert (cache / "teacher" / "model.safetensors").stat().st_mtime_ns == stamp["teacher"]
    assert (cache / "student_init" / "model.safetensors").stat().st_mtime_ns != stamp["student_init"]
    new_student = (cache / "student_init" / "model.safetensors").stat().st_mtime_ns
    # A new teacher means a new tokenizer, so the student is rebuilt with it.
    prepare_offline_models(dataclasses.replace(config, teacher_epochs=0.25), world, cache, **GENERATION)
    assert (cache / "teacher" / "model.safetensors").stat().st_mtime_ns != stamp["teacher"]
    assert (cache / "student_init" / "model.safetensors").stat().st_mtime_ns != new_student


def test_same_recipe_same_weights(built, tmp_path):
    config, world, out, _ = built
    prepare_offline_models(config, world, tmp_path, **GENERATION)
    for role in ("teacher", "student_init"):
        first, second = load_offline_model(out / role), load_offline_model(tmp_path / role)
        for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items(), strict=True):
            assert torch.equal(a, b), (role, name)


def test_expert_actions_longer_than_generation_are_warned_about(tmp_path):
    # The expert's actions run to ~30 tokens here: 12 new tokens cut every one of them, 128 none.
    config = OfflineConfig(**TINY)
    world = make_offline_world(config, max_turns=3)
    with pytest.warns(UserWarning, match=r"expert actions reach \d+ tokens but max_new_tokens is 12"):
        prepare_offline_models(config, world, tmp_path / "short", **GENERATION)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*max_new_tokens is")
        prepare_offline_models(config, world, tmp_path / "long", max_new_tokens=128, max_prompt_length=512)


def test_too_many_warmup_questions_is_a_clear_error(tmp_path):
    config = OfflineConfig(**{**TINY, "student_warmup_questions": 25})
    with pytest.raises(ValueError, match="`student_warmup_questions` \\(25\\) exceeds the world's 24"):
        prepare_offline_models(config, make_offline_world(config, max_turns=3), tmp_path)


def test_greedy_scores_match_the_trainers_evaluation(built, tmp_path):
    config, world, out, setup = built
    tokenizer = load_offline_tokenizer(out / "teacher")
    model = load_offline_model(out / "teacher")
    scores = greedy_scores(model, tokenizer, world.env_factory, world.evaluation, **GENERATION)
    assert scores == {key: setup["teacher"][key] for key in ("f1", "em")}
    trainer = MemOPDTrainer(
        model=model, args=MemOPDConfig(output_dir=str(tmp_path), use_cpu=True, distill_coef=0.0, report_to="none",
                                       attn_implementation="memopd_sdpa_varlen", **GENERATION),
        train_dataset=world.train, eval_dataset=world.evaluation, env_factory=world.env_factory,
        processing_class=tokenizer,
    )  # fmt: skip
    metrics = trainer.evaluate()
    assert (metrics["eval_f1"], metrics["eval_em"]) == (scores["f1"], scores["em"])


def test_cached_start_scores_hold_only_under_the_same_settings(built):
    config, world, _, setup = built
    assert cached_start_scores(setup, world, **GENERATION) == {k: setup["student_init"][k] for k in ("f1", "em")}
    assert cached_start_scores(setup, world, max_new_tokens=10, max_prompt_length=512) is None
    assert cached_start_scores(setup, make_offline_world(config, max_turns=2), **GENERATION) is None


def test_the_recipe_holds_the_version_and_every_setting_of_its_model():
    config = OfflineConfig(**TINY)
    world = make_offline_world(config, max_turns=3)
    recipes = offline_recipes(config, world)
    shared = {name for name in config.settings() if not name.startswith(("teacher_", "student_"))}
    shared.discard("base_model")  # in the recipe only when set, so that caches made without it stay valid
    own = {"hidden_size", "layers", "epochs", "learning_rate"}
    expected = {"recipe_version"} | shared | set(world.env_settings()) | own
    assert set(recipes["teacher"]) == expected | {"select_tasks", "select_epochs"}
    assert set(recipes["student_init"]) == expected | {"warmup_questions", "expert_memory"}
    assert recipes["teacher"]["recipe_version"] == recipes["student_init"]["recipe_version"] == RECIPE_VERSION
    changed = offline_recipes(OfflineConfig(**MULTI), make_offline_world(OfflineConfig(**MULTI), max_turns=3))
    assert changed["teacher"]["num_sub_questions"] == 2 and changed["student_init"]["expert_memory"] == "latest"
    assert "expert_memory" not in changed["teacher"]


def test_a_cache_of_another_version_or_settings_is_rebuilt_with_a_one_line_notice(built, tmp_path, capsys):
    config, world, out, _ = built
    shutil.copytree(out, tmp_path / "cache")
    cache = tmp_path / "cache"
    info = json.loads((cache / "teacher" / "memopd_setup.json").read_text())
    del info["recipe"]["recipe_version"]  # as written before versions were recorded
    (cache / "teacher" / "memopd_setup.json").write_text(json.dumps(info))
    capsys.readouterr()
    prepare_offline_models(config, world, cache, **GENERATION)
    log = capsys.readouterr().out.splitlines()
    assert (
        f"[setup] teacher in {cache / 'teacher'}: rebuilding: cached by set-up recipe version 1, this is version "
        f"{RECIPE_VERSION}" in log
    )
    assert (
        f"[setup] student_init in {cache / 'student_init'}: rebuilding: the teacher, whose tokenizer it shares, "
        "is rebuilt" in log
    )
    rebuilt = json.loads((cache / "teacher" / "memopd_setup.json").read_text())
    assert rebuilt["recipe"] == offline_recipes(config, world)["teacher"]
    changed = dataclasses.replace(config, vocab_size=390, student_epochs=0.25)
    prepare_offline_models(changed, world, cache, **GENERATION)
    log = capsys.readouterr().out.splitlines()
    assert f"[setup] teacher in {cache / 'teacher'}: rebuilding: cached with other settings (vocab_size)" in log
    assert f"[setup] student_init in {cache / 'student_init'}: rebuilding: cached with other settings (epochs, " \
        "vocab_size)" in log  # fmt: skip


def test_multi_objective_world_keeps_held_out_questions_out_of_training():
    config = OfflineConfig(**MULTI)
    world = make_offline_world(config, max_turns=multi_objective_max_turns(2, retries=1))
    single = make_offline_world(OfflineConfig(**TINY), max_turns=3)
    assert world.multi_objective and not single.multi_objective
    assert world.train_questions == single.train and world.eval_questions == single.evaluation
    assert len(world.train) == 12 and len(world.evaluation) == 2
    train_ids = {record["_id"] for record in single.train}
    assert all(len(task["sub_ids"]) == 2 and set(task["sub_ids"]) <= train_ids for task in world.train)
    eval_ids = {record["_id"] for record in single.evaluation}
    assert all(set(task["sub_ids"]) <= eval_ids for task in world.evaluation)
    assert world.train[0]["question"].startswith("Question 1: ")


@pytest.fixture(scope="module")
def built_multi(tmp_path_factory):
    config = OfflineConfig(**MULTI)
    world = make_offline_world(config, max_turns=multi_objective_max_turns(2, retries=1))
    out = tmp_path_factory.mktemp("offline_multi")
    return config, world, out, prepare_offline_models(config, world, out, **GENERATION)


def test_multi_objective_setup_reports_capability_and_policy(built_multi):
    config, world, out, setup = built_multi
    tokenizer = load_offline_tokenizer(out / "teacher")
    for role in ("teacher", "student_init"):
        info = setup[role]
        assert info["recipe"] == offline_recipes(config, world)[role]
        model = load_offline_model(out / role)
        single = greedy_scores(model, tokenizer, world.env_factory, world.eval_questions, **GENERATION)
        tasks = greedy_scores(model, tokenizer, world.env_factory, world.evaluation, **GENERATION)
        assert (info["single_f1"], info["single_em"]) == (single["f1"], single["em"])
        assert (info["f1"], info["em"]) == (tasks["f1"], tasks["em"])
        assert info["eval_settings"]["questions"] == [task["_id"] for task in world.evaluation]
        assert info["pretrain_turns"] > 0
    # The teacher imitates the full expert on every training task, the student start the forgetful expert on its
    # warm-up tasks only.
    assert setup["student_init"]["expert_turns"] < setup["teacher"]["expert_turns"]


# Lookup tasks, one pretraining shared by both models, single questions replayed in the task phase.
SHARED = dict(
    TINY, num_sub_questions=2, lookup_fraction=1.0, pretrain_questions=12, replay_questions=4,
    share_pretraining=True, student_expert_memory="none",
)  # fmt: skip


def test_shared_pretraining_and_replay_are_in_the_recipe_and_the_setup(tmp_path, capsys):
    config = OfflineConfig(**SHARED)
    world = make_offline_world(config, max_turns=multi_objective_max_turns(2, searches_per_question=1))
    assert all(record["type"] == "lookup" for record in world.train_questions)
    setup = prepare_offline_models(config, world, tmp_path, **GENERATION)
    assert capsys.readouterr().out.count("shared copy warm-up and pretraining") == 1  # once for both models
    for role in ("teacher", "student_init"):
        assert setup[role]["shared_pretraining"] and setup[role]["replay_turns"] >= 8  # 4 questions x 2 turns
        assert setup[role]["recipe"]["share_pretraining"] and setup[role]["recipe"]["lookup_fraction"] == 1.0
        assert setup[role]["parameters"] == setup["teacher"]["parameters"]
    with pytest.raises(ValueError, match="give the student the teacher's sizes"):
        OfflineConfig(**{**SHARED, "student_hidden_size": 16})
    with pytest.raises(ValueError, match="replay_questions"):
        OfflineConfig(**{**SHARED, "replay_questions": 13})


def test_a_changed_student_recipe_reuses_the_cached_shared_pretraining_and_trains_the_same_start(tmp_path, capsys):
    world = make_offline_world(OfflineConfig(**SHARED), max_turns=multi_objective_max_turns(2, searches_per_question=1))
    prepare_offline_models(OfflineConfig(**SHARED), world, tmp_path / "cached", **GENERATION)
    changed = OfflineConfig(**{**SHARED, "student_epochs": 0.25})
    capsys.readouterr()
    prepare_offline_models(changed, world, tmp_path / "cached", **GENERATION)
    log = capsys.readouterr().out
    assert f"[setup] teacher in {tmp_path / 'cached' / 'teacher'}: reusing the cached model" in log
    assert "reusing the cached shared copy warm-up and pretraining" in log
    prepare_offline_models(changed, world, tmp_path / "fresh", **GENERATION)
    assert "reusing" not in capsys.readouterr().out
    cached, fresh = (load_offline_model(tmp_path / d / "student_init").state_dict() for d in ("cached", "fresh"))
    assert cached.keys() == fresh.keys() and all(torch.equal(cached[k], fresh[k]) for k in cached)


def test_a_student_from_the_teacher_starts_from_its_weights_and_rebuilds_with_it(tmp_path, monkeypatch):
    import offline_lab.setup as offline

    starts = {}
    train = offline.train_tiny_agent

    def recording(role, *args, base_model=None, **kwargs):
        starts[role] = None if base_model is None else copy.deepcopy(base_model.state_dict())
        return train(role, *args, base_model=base_model, **kwargs)

    monkeypatch.setattr(offline, "train_tiny_agent", recording)
    world = make_offline_world(OfflineConfig(**SHARED), max_turns=multi_objective_max_turns(2, searches_per_question=1))
    for name, from_teacher in (("shared", False), ("from_teacher", True)):
        config = OfflineConfig(**{**SHARED, "student_from_teacher": from_teacher})
        setup = prepare_offline_models(config, world, tmp_path / name, **GENERATION)
        teacher = load_offline_model(tmp_path / name / "teacher").state_dict()
        same = all(torch.equal(starts["student_init"][k], v) for k, v in teacher.items())
        assert same == from_teacher, "the student's imitation starts from the trained teacher exactly when asked"
        assert ("from_teacher" in setup["student_init"]["recipe"]) == from_teacher
    assert setup["student_init"]["from_teacher"] and setup["student_init"]["recipe"]["from_teacher"] == setup[
        "teacher"]["recipe"]  # fmt: skip
    with pytest.raises(ValueError, match="`student_from_teacher` starts the student from a copy of the teacher"):
        OfflineConfig(**{**SHARED, "share_pretraining": False, "student_from_teacher": True, "student_hidden_size": 16})


def test_a_start_below_its_range_that_never_had_the_policy_is_told_to_learn_its_expert_longer():
    setup = {"student_init": {"f1": 0.098, "single_f1": 0.795}, "teacher": {"f1": 0.905}}
    hint = "--student_epochs 3 instead of 1"
    refused = {
        from_teacher: check_student_start(setup, OfflineConfig(**{**SHARED, "student_from_teacher": from_teacher}))
        for from_teacher in (False, True)
    }
    assert "outside its intended range [0.3, 0.7]" in refused[True] and hint not in refused[True]
    assert refused[False].startswith(refused[True]) and hint in refused[False]
    above = {"student_init": {"f1": 0.95}, "teacher": {"f1": 0.98}}  # a start too good has learned its expert
    assert hint not in check_student_start(above, OfflineConfig(**{**SHARED, "student_from_teacher": False}))
    assert check_student_start({**setup, "student_init": {"f1": 0.5}}, OfflineConfig(**SHARED)) is None


def test_reading_states_show_every_passage_of_a_task_at_once_with_the_full_experts_answers():
    world = make_offline_world(OfflineConfig(**SHARED), max_turns=multi_objective_max_turns(2, searches_per_question=1))
    episodes = expert_trajectories(world.train[:6], world.env_factory)
    fmt = world.env_factory().action_format
    steps = reading_steps(episodes, fmt)
    assert len(steps) == 6, "every clean two-search episode gives one state"
    for (messages, action), episode in zip(steps, episodes, strict=True):
        assert messages[:-1] == episode.steps[1][0][:-1], "the task and the first search, nothing carried"
        passages = [m[-1]["content"].split("] ", 1)[1].removesuffix(f"</{fmt.information_tag}>")
                    for m, _ in episode.steps[1:]]  # fmt: skip
        assert messages[-1]["content"] == (
            f"<{fmt.information_tag}>[1] {passages[0]}\n[2] {passages[1]}</{fmt.information_tag}>")
        assert action == episode.steps[-1][1] and parse_action(action, fmt).argument.count(";") == 1
    retried = dataclasses.replace(episodes[0], queries=[episodes[0].queries[0]] * 2)  # one entity searched twice
    single = dataclasses.replace(episodes[1], steps=episodes[1].steps[-2:], queries=episodes[1].queries[-1:])
    assert reading_steps([retried, single], fmt) == []
    with pytest.raises(ValueError, match="`student_reading` shows every passage of a task at once"):
        OfflineConfig(**{**SHARED, "num_sub_questions": 1, "pretrain_questions": 0, "replay_questions": 0,
                         "student_reading": True})  # fmt: skip


def test_a_student_start_with_reading_states_imitates_them_beside_its_expert(tmp_path, monkeypatch):
    import offline_lab.setup as offline

    imitated = {}
    train = offline.train_tiny_agent

    def recording(role, hidden, layers, invocations, *args, **kwargs):
        imitated[role] = len(invocations)
        return train(role, hidden, layers, invocations, *args, **kwargs)

    monkeypatch.setattr(offline, "train_tiny_agent", recording)
    world = make_offline_world(OfflineConfig(**SHARED), max_turns=multi_objective_max_turns(2, searches_per_question=1))
    counts = {}
    for reading in (False, True):
        imitated.clear()
        config = OfflineConfig(**{**SHARED, "student_reading": reading})
        setup = prepare_offline_models(config, world, tmp_path / "models", **GENERATION)
        counts[reading] = imitated.pop("student_init")
        assert ("reading" in setup["student_init"]["recipe"]) == reading, "a cache without the option stays valid"
    assert setup["student_init"]["reading_states"] == SHARED["student_warmup_questions"]
    assert counts[True] - counts[False] == SHARED["student_warmup_questions"]
    assert "teacher" not in imitated, "only the student start is rebuilt"


def test_imitation_keeps_the_weights_of_its_best_scored_checkpoint(make_tiny_model, tiny_tokenizer):
    from memopd_trl.records import Invocation
    from offline_lab import imitation_train

    generator = torch.Generator().manual_seed(0)
    data = [
        Invocation(torch.randint(1, 400, (20,), generator=generator).tolist(), torch.randint(1, 400, (5,),
                   generator=generator).tolist())
        for _ in range(64)
    ]  # fmt: skip
    model = make_tiny_model(seed=3)
    scores, snapshots = iter([0.2, 0.9, 0.4, 0.1]), []

    def evaluate(m):
        snapshots.append({k: v.clone() for k, v in m.state_dict().items()})
        return next(scores)

    losses = imitation_train(model, data, epochs=2, learning_rate=1e-2, tokens_per_batch=400, progress=False,
                             evaluate=evaluate, eval_epochs=0.5)  # fmt: skip
    assert len(snapshots) == 4 and len(losses) > 4  # at 0.5, 1 and 1.5 epochs, and after the last step
    best = snapshots[1]
    assert all(torch.equal(v, best[k]) for k, v in model.state_dict().items())
    assert not all(torch.equal(v, snapshots[-1][k]) for k, v in best.items())
    with pytest.raises(ValueError, match="eval_epochs"):
        imitation_train(model, data, evaluate=evaluate, eval_epochs=-1)


def test_a_teacher_chosen_on_set_aside_training_tasks_does_not_imitate_them(tmp_path, capsys):
    config = OfflineConfig(**{**TINY, "teacher_select_tasks": 4, "teacher_select_epochs": 0.25})
    world = make_offline_world(config, max_turns=3)
    setup = prepare_offline_models(config, world, tmp_path, **GENERATION)
    log = capsys.readouterr()
    assert setup["teacher"]["select_tasks"] == 4 and setup["teacher"]["recipe"]["select_tasks"] == 4
    assert (log.out + log.err).count("teacher imitation] step") >= 2  # part-way, then after the last step
    plain = prepare_offline_models(OfflineConfig(**TINY), world, tmp_path / "plain", **GENERATION)
    assert setup["teacher"]["expert_turns"] < plain["teacher"]["expert_turns"]  # the 4 tasks' turns are left out
    assert offline_recipes(OfflineConfig(**TINY), world)["teacher"]["select_tasks"] == 0
    with pytest.raises(ValueError, match="teacher_select_tasks"):
        OfflineConfig(**{**TINY, "teacher_select_tasks": -1})


def test_a_teacher_for_both_layouts_imitates_the_expert_under_the_full_history_too(built, tmp_path):
    config, world, out, setup = built
    both = dataclasses.replace(config, teacher_full_history=True)
    recipes = offline_recipes(both, world)
    assert recipes["teacher"]["full_history"] is True and "full_history" not in offline_recipes(config, world)["teacher"]
    shutil.copytree(out, tmp_path / "cache")
    rebuilt = prepare_offline_models(both, world, tmp_path / "cache", **GENERATION)
    # Every imitated task twice: once in the compact layout, once as one growing history.
    assert rebuilt["teacher"]["expert_turns"] == 2 * setup["teacher"]["expert_turns"]
    assert 0.0 <= rebuilt["teacher"]["full_history_f1"] <= 1.0 and "full_history_f1" not in setup["teacher"]
    # History-native: in the history layout it also imitates a reader of the whole history on the forgetful expert's
    # histories, one more history per imitated task.
    native = dataclasses.replace(both, teacher_history_native=True)
    assert offline_recipes(native, world)["teacher"]["history_native"] is True
    assert "history_native" not in recipes["teacher"]
    native_setup = prepare_offline_models(native, world, tmp_path / "cache", **GENERATION)
    assert native_setup["teacher"]["expert_turns"] > rebuilt["teacher"]["expert_turns"]
    assert native_setup["student_init"]["recipe"] == rebuilt["student_init"]["recipe"]  # the start is not retrained
    with pytest.raises(ValueError, match="`teacher_history_native` .* set `teacher_full_history` too"):
        dataclasses.replace(config, teacher_history_native=True)
    notes = dataclasses.replace(native, teacher_history_memory="searches")
    assert offline_recipes(notes, world)["teacher"]["history_memory"] == "searches"
    assert "history_memory" not in offline_recipes(native, world)["teacher"]
    with pytest.raises(ValueError, match="`teacher_history_memory` .* set `teacher_history_native` too"):
        dataclasses.replace(both, teacher_history_memory="searches")
    with pytest.raises(ValueError, match="`teacher_history_memory` must be one of"):
        dataclasses.replace(native, teacher_history_memory="half")


def test_a_base_model_starts_both_models_with_its_own_tokenizer_and_no_warm_up(built, tmp_path, monkeypatch):
    import offline_lab.setup as offline

    config, world, out, _ = built
    base = out / "teacher"  # stands in for a pretrained checkpoint: weights, tokenizer and chat template
    starts = {}
    train = offline.train_tiny_agent

    def recording(role, *args, base_model=None, **kwargs):
        starts[role] = (copy.deepcopy(base_model.state_dict()), args[3])  # the start's weights and the copy data
        return train(role, *args, base_model=base_model, **kwargs)

    monkeypatch.setattr(offline, "train_tiny_agent", recording)
    pretrained = dataclasses.replace(config, base_model=str(base), vocab_size=999)  # a size the base does not have
    setup = prepare_offline_models(pretrained, world, tmp_path, **GENERATION)
    weights = load_offline_model(base).state_dict()
    for role in ("teacher", "student_init"):
        start, copy_data = starts[role]
        assert all(torch.equal(start[k], v) for k, v in weights.items()), f"the {role} starts from the base's weights"
        assert copy_data == [], "a pretrained model gets no copy warm-up"
        assert setup[role]["base_model"] == str(base) and setup[role]["recipe"]["base_model"] == str(base)
        saved = load_offline_tokenizer(tmp_path / role)
        assert saved.get_vocab() == load_offline_tokenizer(base).get_vocab() and len(saved) != 999
        assert saved.chat_template == load_offline_tokenizer(base).chat_template
    # Caches made without a base model stay valid: the key is only in the recipe when it is set.
    assert "base_model" not in offline_recipes(config, world)["teacher"]
    with pytest.raises(ValueError, match="share_pretraining"):
        OfflineConfig(**{**TINY, "base_model": str(base), "share_pretraining": True})


def test_the_ppo_arm_turns_off_every_distillation_setting_a_run_was_given(tmp_path):
    from offline_lab.compare import arm_config

    warm_up = dict(teacher_generations=1, distill_divergence_threshold=0.1, distill_warmup_steps=5,
                   distill_warmup_kl_coef=1.0, distill_warmup_anchor_coef=1.0, distill_warmup_release_loss=0.2)  # fmt: skip
    config = MemOPDConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=2,
                          num_generations=2, **warm_up)  # fmt: skip
    ppo = arm_config(config, "ppo", seed=0)  # a setting left on without its warm-up is refused by the config
    assert ppo.distill_coef == 0 and all(not getattr(ppo, name) for name in warm_up)
    assert arm_config(config, "memopd", seed=0).distill_warmup_anchor_coef == 1.0
