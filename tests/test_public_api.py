"""The names DESIGN.md promises users are importable from the top level; the offline lab stays out of the library."""

import ast
import shutil
from pathlib import Path

import pytest

import memopd_trl


DESIGN_NAMES = [
    "MemOPDConfig", "MemOPDTrainer", "MemoryAgentEnv", "HotpotQAEnv", "Invocation", "PackedInvocationCollator",
    "generalized_jsd_loss", "ppo_clip_loss", "qa_f1", "exact_match",
]  # fmt: skip
# Names of the offline lab that `memopd_trl` once exported: they live in `offline_lab` (`examples/offline_lab/`) only.
LAB_NAMES = [
    "make_synthetic_world", "build_tokenizer", "build_tiny_model", "SyntheticExpert", "OfflineConfig",
    "make_offline_world", "prepare_offline_models", "teacher_takeover", "expert_labels",
]  # fmt: skip
# The lab's package, and where it once lived inside the library.
LAB_MODULES = ("offline_lab", "memopd_trl.offline")
PACKAGE_DIR = Path(memopd_trl.__file__).resolve().parent
ROOT = Path(__file__).resolve().parents[1]


def test_every_public_name_resolves():
    assert set(DESIGN_NAMES) <= set(memopd_trl.__all__)
    for name in memopd_trl.__all__:
        assert getattr(memopd_trl, name) is not None, name
    with pytest.raises(AttributeError):
        memopd_trl.NotAThing  # noqa: B018


def test_no_offline_lab_name_is_exported_by_the_library():
    for name in LAB_NAMES:
        assert name not in memopd_trl.__all__ and name not in dir(memopd_trl), name
        with pytest.raises(AttributeError):
            getattr(memopd_trl, name)


def test_the_offline_lab_lives_beside_the_library_with_documented_names():
    import offline_lab

    assert Path(offline_lab.__file__).parent == ROOT / "examples" / "offline_lab"
    assert not (PACKAGE_DIR / "offline").exists()
    assert set(LAB_NAMES) <= set(offline_lab.__all__)
    for name in offline_lab.__all__:
        value = getattr(offline_lab, name)
        if callable(value):
            assert value.__doc__, f"offline_lab.{name} has no docstring"


def test_the_wheel_ships_the_library_only():
    """The packages setup.cfg's `find:` collects (what the wheel holds): `memopd_trl` and its subpackages."""
    import configparser

    from setuptools import find_packages

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    exclude = [line.strip() for line in cfg["options.packages.find"]["exclude"].splitlines() if line.strip()]
    packages = find_packages(where=str(ROOT), exclude=exclude)
    assert "memopd_trl" in packages and all(p.split(".")[0] == "memopd_trl" for p in packages), packages
    assert "matplotlib" not in cfg["options"]["install_requires"]


def lab_imports(package_dir: Path) -> list[str]:
    """
    Every place where a module of the library in `package_dir` (a copy of `memopd_trl/`) imports the offline lab
    (`offline_lab`, or its old place `memopd_trl.offline`): `import` and `from` statements, relative ones resolved,
    and module paths named as strings (the lazy `_EXPORTS` of `__init__.py`). Returns `"path:line"` entries.
    """
    found = []
    for path in sorted(package_dir.rglob("*.py")):
        relative = path.relative_to(package_dir)
        package = ("memopd_trl", *relative.parts[:-1])  # the package a relative import starts from
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
                module = ".".join(part for part in (base, node.module) if part)
                targets = [module] + [f"{module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                targets = [node.value]
            else:
                continue
            if any(target == lab or target.startswith(lab + ".") for target in targets for lab in LAB_MODULES):
                found.append(f"{relative}:{node.lineno}")
    return found


def test_no_library_module_imports_the_offline_lab():
    assert lab_imports(PACKAGE_DIR) == []


def test_the_import_check_finds_a_library_module_that_imports_the_lab(tmp_path):
    copy = shutil.copytree(PACKAGE_DIR, tmp_path / "memopd_trl", ignore=shutil.ignore_patterns("__pycache__"))
    assert lab_imports(copy) == []
    bad = {
        "rollout.py": "from .offline import make_offline_world\n",
        "envs/hotpot.py": "from .. import offline\n",
        "envs/multi.py": "import offline_lab.world\n",
        "scoring.py": "from offline_lab.setup import OfflineConfig\n",
        "__init__.py": '_EXPORTS["OfflineConfig"] = "memopd_trl.offline"\n',
    }
    for name, line in bad.items():
        with (copy / name).open("a") as f:
            f.write(line)
    found = lab_imports(copy)
    assert sorted(entry.split(":")[0] for entry in found) == sorted(str(Path(name)) for name in bad)
    for entry in found:  # each found at the line it was added on, the file's last
        name, line = entry.split(":")[:2]
        assert int(line) == len((copy / name).read_text().splitlines()), entry


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (every `import` / `from` statement, relative ones resolved, those
    under `if TYPE_CHECKING:` too), read with `ast` from a copy of `memopd_trl/` at `package_dir`."""
    modules = {
        ".".join(("memopd_trl", *path.relative_to(package_dir).with_suffix("").parts)).removesuffix(".__init__"): path
        for path in package_dir.rglob("*.py")
    }
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1]) if node.level else ""
                module = ".".join(part for part in (base, node.module) if part)
                candidates = [module] + [f"{module}.{alias.name}" for alias in node.names]
            else:
                continue
            targets |= {c for c in candidates if c in modules and c != name}
        graph[name] = targets
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles of `graph` (each one found once, from its first module in sorted order)."""
    circles = []

    def walk(start: str, node: str, path: list[str]) -> None:
        for target in sorted(graph[node]):
            if target == start:
                circles.append(path)
            elif target > start and target not in path:
                walk(start, target, [*path, target])

    for start in sorted(graph):
        walk(start, start, [start])
    return circles


def test_the_package_has_no_import_circle():
    # The package's `__init__` re-exports lazily (names in strings), so it imports none of its modules.
    assert import_circles(import_graph(PACKAGE_DIR)) == []


def test_the_circle_check_finds_a_circle(tmp_path):
    copy = shutil.copytree(PACKAGE_DIR, tmp_path / "memopd_trl", ignore=shutil.ignore_patterns("__pycache__"))
    with (copy / "callbacks.py").open("a") as f:
        f.write("\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from .trainer import MemOPDTrainer\n")
    assert ["memopd_trl.callbacks", "memopd_trl.trainer"] in import_circles(import_graph(copy))
