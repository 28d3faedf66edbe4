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


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert _readme_commands()[1] in ci.splitlines()


def test_readme_links_existing_docs():
    text = (ROOT / "README.md").read_text()
    for link in re.findall(r"\]\((docs/[^)]+)\)", text):
        assert (ROOT / link).exists(), f"README links {link}, which does not exist"
