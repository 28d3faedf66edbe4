"""The model card `MemOPDTrainer.save_model()` / `push_to_hub()` write beside the weights.

The card says what the agent was trained from and how: the student's base model, the teacher, the distillation and
PPO settings, the environment's action format and memory policy, and a snippet that plays one `HotpotQAEnv` episode
with the saved agent (not a plain chat example: the agent only makes sense inside its environment's loop).
"""

import importlib
import os
from importlib.metadata import version
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, ModelCardData

from .envs.base import ACTION_FORMAT_PRESETS, ActionFormat


# The paper the trainer implements (`MemOPDTrainer._paper`): its card cites it.
PAPER = {
    "title": "Memory-Aligned On-Policy Distillation for Long-Horizon LLM Memory Agents",
    "id": "2608.07068",
    "citation": """\
@article{memopd2026,
    title        = {{Memory-Aligned On-Policy Distillation for Long-Horizon LLM Memory Agents}},
    year         = 2026,
    eprint       = {arXiv:2608.07068}
}""",
}


# The training settings the card records, in this order (each a `MemOPDConfig` field).
CARD_SETTINGS = (
    "distill_coef",
    "beta",
    "distill_temperature",
    "teacher_scoring",
    "distill_divergence_threshold",
    "distill_divergence_scope",
    "teacher_generations",
    "ppo_coef",
    "kl_coef",
    "advantage_estimator",
    "num_generations",
    "temperature",
    "max_new_tokens",
    "max_prompt_length",
    "learning_rate",
)

_TEMPLATE = """\
---
{{ card_data }}
---

# Model Card for {{ model_name }}

A memory agent trained from {{ base_model_text }} with {{ trainer_name }}{% if paper_id %}, the method of \
[{{ paper_title }}](https://huggingface.co/papers/{{ paper_id }}){% endif %}: at every turn it rewrites a compact \
memory and takes one action, and each model call sees only what the memory policy keeps. It has been trained using \
[TRL](https://github.com/huggingface/trl) and memopd-trl.

## Quick start: play one episode

The agent acts inside its environment's loop ({{ env_name }} during training). This plays one `HotpotQAEnv` \
episode over a small corpus, with the action format and memory policy it was trained with:

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

from memopd_trl import {{ imports }}

model = AutoModelForCausalLM.from_pretrained("{{ model_path }}")
tokenizer = AutoTokenizer.from_pretrained("{{ model_path }}")
corpus = [
    {"title": "Rome", "text": "Rome is the capital of Italy."},
    {"title": "Colosseum", "text": "The Colosseum is an amphitheatre in the centre of Rome."},
]
make_env = HotpotQAEnv.factory(
    corpus=corpus, action_format={{ action_format }}, memory_policy="{{ memory_policy }}", max_turns={{ max_turns }}
)
engine = RolloutEngine(model, tokenizer, make_env, max_new_tokens={{ max_new_tokens }}, \
max_prompt_length={{ max_prompt_length }})
record = {"_id": "q1", "question": "In which country is the Colosseum?", "answer": "Italy"}
(episode,), _ = engine.rollout([record], greedy=True)
print(episode.answer, episode.reward, episode.num_turns)
```

## Training procedure

This model was trained with {{ trainer_name }}: PPO on the final reward, plus a teacher that scores every sampled \
action over the full vocabulary in the state the student sampled it in.

| | |
| --- | --- |
| student (base model) | {{ base_model_text }} |
| teacher | {{ teacher_text }} |
{% for name, value in settings %}| `{{ name }}` | `{{ value }}` |
{% endfor %}| environment | `{{ env_name }}` |
| action format | {{ action_format_text }} |
| memory policy | `{{ memory_policy }}` |
| `max_turns` | `{{ max_turns }}` |
| steps trained | {{ global_step }} |

### Framework versions

- memopd-trl: {{ memopd_version }}
- TRL: {{ trl_version }}
- Transformers: {{ transformers_version }}
- Pytorch: {{ pytorch_version }}

## Citations

{% if trainer_citation %}Cite {{ trainer_name }} as:

```bibtex
{{ trainer_citation }}
```

{% endif %}Cite TRL as:

```bibtex
{% raw %}@software{vonwerra2020trl,
  title   = {{TRL: Transformers Reinforcement Learning}},
  author  = {von Werra, Leandro and Belkada, Younes and Tunstall, Lewis and Beeching, Edward and Thrush, Tristan and \
Lambert, Nathan and Huang, Shengyi and Rasul, Kashif and Gallouédec, Quentin},
  license = {Apache-2.0},
  url     = {https://github.com/huggingface/trl},
  year    = {2020}
}{% endraw %}
```
"""


def hub_id_or_none(name: str | None) -> str | None:
    """`name` when it can be a Hub model id (not empty, not an existing local path), else `None`."""
    if not name or os.path.exists(name):
        return None
    return name


def describe_model_source(name: str | None) -> str:
    """How the card names a model's source: a Hub link, a local path, or a model built from a config."""
    if not name:
        return "a model built from its configuration (no pretrained checkpoint)"
    if hub_id_or_none(name) is None:
        return f"the local checkpoint `{name}`"
    return f"[{name}](https://huggingface.co/{name})"


def _action_format_code(action_format: ActionFormat) -> tuple[str, str]:
    """The `action_format=` argument that rebuilds `action_format` (a preset's name when it is one), and a text."""
    for name, preset in ACTION_FORMAT_PRESETS.items():
        if action_format == preset:
            text = f'`"{name}"`: ' + ", ".join(f"`{tag}`" for tag in action_format.special_tokens[::2])
            return f'"{name}"', text
    return repr(action_format), f"`{action_format!r}`"


def build_model_card(
    *,
    model_name: str,
    model_path: str,
    student_name: str | None,
    teacher_name: str | None,
    args: Any,
    env: Any,
    trainer_name: str,
    paper: dict[str, str],
    tags: list[str],
    dataset_name: str | None = None,
    global_step: int = 0,
) -> ModelCard:
    """
    The model card of a trained memory agent.

    Args:
        model_name (`str`): the title.
        model_path (`str`): what the snippet loads (a Hub id, or the folder of the saved weights).
        student_name (`str` or `None`): the student's base model, as an id or path (`None` / `""`: built from a
            config).
        teacher_name (`str` or `None`): the teacher, as an id or path (`None`: no teacher).
        args (`MemOPDConfig`): the training settings (`CARD_SETTINGS` of them are recorded).
        env (`MemoryAgentEnv`): one environment of the run, for its action format, memory policy and `max_turns`.
        trainer_name (`str`), paper (`dict`), tags (`list[str]`), dataset_name (`str`, *optional*): as in TRL's cards.
        global_step (`int`, *optional*, defaults to `0`): optimizer steps trained.

    Returns:
        `huggingface_hub.ModelCard`: the card (`.save(path)` writes it).
    """
    action_format, action_format_text = _action_format_code(env.action_format)
    imports = "HotpotQAEnv, RolloutEngine"
    if not action_format.startswith('"'):
        imports = "ActionFormat, " + imports
    memory_policy = getattr(env.memory_policy, "name", type(env.memory_policy).__name__)
    card_data = ModelCardData(
        base_model=hub_id_or_none(student_name),
        datasets=dataset_name,
        library_name="transformers",
        model_name=model_name,
        tags=["generated_from_trainer", *tags],
    )
    if teacher_name is None:
        teacher_text = "none (`distill_coef=0`: PPO only)"
    else:
        teacher_text = describe_model_source(teacher_name)
    return ModelCard.from_template(
        card_data,
        template_str=_TEMPLATE,
        model_name=model_name,
        model_path=model_path,
        base_model_text=describe_model_source(student_name),
        teacher_text=teacher_text,
        settings=[(name, getattr(args, name)) for name in CARD_SETTINGS],
        env_name=type(env).__name__,
        action_format=action_format,
        action_format_text=action_format_text,
        imports=imports,
        memory_policy=memory_policy,
        max_turns=env.max_turns,
        max_new_tokens=args.max_new_tokens,
        max_prompt_length=args.max_prompt_length,
        global_step=global_step,
        trainer_name=trainer_name,
        trainer_citation=paper.get("citation"),
        paper_title=paper.get("title"),
        paper_id=paper.get("id"),
        memopd_version=version("memopd-trl"),
        trl_version=version("trl"),
        transformers_version=version("transformers"),
        pytorch_version=version("torch"),
    )


def hub_network_errors() -> tuple[type[BaseException], ...]:
    """What the Hub client raises when the Hub cannot be reached: `OfflineModeIsEnabled` and socket errors are
    `ConnectionError`s; the HTTP client's transport errors (connection, timeout, proxy) are its own."""
    errors: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module in ("httpx2", "httpx", "requests"):
        try:
            library = importlib.import_module(module)
        except ImportError:
            continue
        error = getattr(library, "TransportError", None) or getattr(library, "ConnectionError", None)
        if isinstance(error, type) and issubclass(error, BaseException):
            errors.append(error)
    return tuple(errors)


def hub_unreachable_error(err: BaseException, output_dir: str, hub_model_id: str | None) -> ConnectionError:
    """The error `push_to_hub` raises when the Hub cannot be reached, after the model and its card were saved."""
    repo = hub_model_id or Path(output_dir).absolute().name
    return ConnectionError(
        f"push_to_hub could not reach the Hugging Face Hub ({type(err).__name__}: {err}). Nothing was uploaded; the "
        f"model and its card are saved in {output_dir!r}. Push them later, once online (and without "
        f"HF_HUB_OFFLINE=1), with `trainer.push_to_hub()`, or from a shell: `hf upload {repo} {output_dir}`."
    )
