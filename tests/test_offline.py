"""memopd_trl.offline: the synthetic world, its tokenizer, and the cached tiny teacher and student start."""

import dataclasses
import json
import shutil

import pytest
import torch
from tokenizers import Tokenizer

from memopd_trl import MemOPDConfig, MemOPDTrainer
from memopd_trl.envs.synthetic import NAME_SYLLABLES
from memopd_trl.offline import (
    OfflineConfig,
    cached_start_scores,
    greedy_scores,
    load_offline_model,
    load_offline_tokenizer,
    make_offline_world,
    offline_recipes,
    prepare_offline_models,
)


TINY = dict(
    num_train_questions=24, num_eval_questions=4, vocab_size=400, teacher_hidden_size=32, teacher_layers=1,
    student_hidden_size=32, student_layers=1, copy_warmup_sequences=32, teacher_epochs=0.5,
    student_warmup_questions=8, student_epochs=0.5, imitation_tokens_per_batch=1024,
)  # fmt: skip
GENERATION = dict(max_new_tokens=12, max_prompt_length=512)


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
