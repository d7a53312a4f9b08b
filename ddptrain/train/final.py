"""The trained model out: `<run.dir>/final/` and `ddptrain.load_model(run_dir)`.

`final/` holds the full (gathered) weights of the last finished or preempted step:

    final/
        model.safetensors      the weights (tied aliases stored once)
        ddptrain_model.json    ModelSpec: what rebuilds the module, and the step
        tokenizer.json ...     the tokenizer the run used, when it was a tokenizer.json
        config.json ...        model=hf: the directory is exactly a transformers save_pretrained one

It is written under a temporary name and renamed into place, so a reader sees the old or the new
weights, never a mix.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch
from torch import nn

from ddptrain.models.build import ModelSpec, rebuild_model
from ddptrain.strategies import strategy_class

log = logging.getLogger(__name__)

FINAL = "final"
SPEC_FILE = "ddptrain_model.json"
WEIGHTS_FILE = "model.safetensors"


def final_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / FINAL


def save_final(run_dir: str | Path, module: nn.Module, state_dict: dict[str, torch.Tensor], spec: ModelSpec,
               step: int, tokenizer_files: list[Path]) -> Path:
    """Write `final/` (rank 0). `module` is the unwrapped model (for model=hf its save_pretrained)."""
    from safetensors.torch import save_file

    final = final_dir(run_dir)
    tmp = final.with_name(f".tmp-{FINAL}")
    if tmp.exists():
        shutil.rmtree(tmp)  # left by a run killed while writing
    tmp.mkdir(parents=True)
    if spec.kind == "hf":
        from ddptrain.models import hf

        hf.save_pretrained(module, state_dict, tmp)
    else:
        stored = {name: tensor.contiguous() for name, tensor in state_dict.items() if name not in spec.tied}
        save_file(stored, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    for file in tokenizer_files:
        shutil.copy2(file, tmp / file.name)
    (tmp / SPEC_FILE).write_text(json.dumps({**spec.to_dict(), "step": step}, indent=1))
    for path in tmp.iterdir():
        with open(path, "rb+") as handle:
            os.fsync(handle.fileno())
    old = final.with_name(f".old-{FINAL}")
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def weights_dir(run_dir: str | Path) -> Path:
    """`final/` when it is there, else the newest complete checkpoint; a clear error if neither."""
    from ddptrain.train import checkpoint as ckpt

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no such run directory")
    final = final_dir(run_dir)
    if (final / SPEC_FILE).is_file():
        return final
    latest = ckpt.find_latest(run_dir)
    if latest is None:
        raise FileNotFoundError(f"{run_dir} holds no trained weights: no {FINAL}/ and no complete checkpoint "
                                "(was the run started with this run.dir?)")
    return latest


def load_model(run_dir: str | Path) -> nn.Module:
    """The trained model of a run: eval mode, on CPU, with the weights of `final/` (or of the newest
    complete checkpoint while the run has no final weights yet)."""
    directory = weights_dir(run_dir)
    if directory.name == FINAL:
        spec = ModelSpec.from_dict(json.loads((directory / SPEC_FILE).read_text()))
        if spec.kind == "hf":
            from ddptrain.models import hf

            model = hf.load_pretrained_dir(directory)
        else:
            from safetensors.torch import load_file

            model = rebuild_model(spec)
            state = load_file(str(directory / WEIGHTS_FILE))
            _load_state(model, state, spec, directory)
    else:
        model = _load_from_checkpoint(directory)
    return model.eval()


def _load_state(model: nn.Module, state: dict[str, torch.Tensor], spec: ModelSpec, source: Path) -> None:
    dtype = next(iter(state.values())).dtype if state else torch.float32
    model.to(dtype=dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [name for name in missing if name not in spec.tied]
    if missing or unexpected:
        raise RuntimeError(f"{source}: the weights do not fit {spec.class_name} (missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]})")


def _load_from_checkpoint(path: Path) -> nn.Module:
    from ddptrain.train import checkpoint as ckpt

    state = ckpt.load_trainer_state(path)
    if "model_spec" not in state:
        raise RuntimeError(f"{path} was written by an older ddptrain without a model spec; it cannot be loaded "
                           "as a model (resume training to write final/)")
    spec = ModelSpec.from_dict(state["model_spec"])
    weights = strategy_class(state["config"]["strategy"]["name"]).read_full_weights(path / "strategy")
    model = rebuild_model(spec)
    _load_state(model, weights, spec, path)
    return model
