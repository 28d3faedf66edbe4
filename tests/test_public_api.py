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
# Names of the offline lab that `memopd_trl` once exported: they live in `memopd_trl.offline` only.
LAB_NAMES = [
    "make_synthetic_world", "build_tokenizer", "build_tiny_model", "SyntheticExpert", "OfflineConfig",
    "make_offline_world", "prepare_offline_models", "teacher_takeover", "expert_labels",
]  # fmt: skip
LAB = "memopd_trl.offline"
PACKAGE_DIR = Path(memopd_trl.__file__).resolve().parent


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


def test_the_offline_lab_is_a_subpackage_with_documented_names():
    from memopd_trl import offline

    assert Path(offline.__file__).parent == PACKAGE_DIR / "offline"
    assert set(LAB_NAMES) <= set(offline.__all__)
    for name in offline.__all__:
        value = getattr(offline, name)
        if callable(value):
            assert value.__doc__, f"memopd_trl.offline.{name} has no docstring"


def lab_imports(package_dir: Path) -> list[str]:
    """
    Every place where a module of the library in `package_dir` (a copy of `memopd_trl/`), outside its `offline/`
    subpackage, imports the offline lab: `import` and `from` statements, relative ones resolved, and module paths
    named as strings (the lazy `_EXPORTS` of `__init__.py`). Returns `"path:line"` entries.
    """
    found = []
    for path in sorted(package_dir.rglob("*.py")):
        relative = path.relative_to(package_dir)
        if relative.parts[0] == "offline":
            continue
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
            if any(target == LAB or target.startswith(LAB + ".") for target in targets):
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
        "envs/multi.py": "import memopd_trl.offline.world\n",
        "scoring.py": "from memopd_trl.offline.setup import OfflineConfig\n",
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
    # Imports of the lab from inside the lab are its own business.
    (copy / "offline" / "extra.py").write_text("from .setup import OfflineConfig\nfrom memopd_trl import offline\n")
    assert len(lab_imports(copy)) == len(bad)
