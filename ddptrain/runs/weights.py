"""The trained model out: `<run.dir>/final/` and `ddptrain.load_model(run_dir)`.

`final/` holds the full (gathered) weights of the last finished or preempted step:

    final/
        model.safetensors      the weights (tied aliases stored once)
        ddptrain_model.json    ModelSpec: what rebuilds the module, and the step
        tokenizer.json ...     data.tokenizer and the companions transformers reads with it (model=hf:
                               model.path's tokenizer files); data.chat_template as chat_template.jinja
        generation_config.json eos_token_id: the tokens the run taught the model to end with (data=sft's
                               EOS and end-of-turn token, data=tokens' data.eod_token; none for text)
        config.json ...        model=hf: the directory is exactly a transformers save_pretrained one

`best/` (checkpoint.keep_best) has the same format and holds the weights of the best evaluated step;
`load_model(run_dir, which="best")`, the export and serving read it by the same name.

It is written under a temporary name and renamed into place, so a reader sees the old or the new
weights, never a mix. ddptrain_model.json is its marker: it holds a sha256 of every other file,
which `verify_final` checks (a rerun of the training command rebuilds a final/ that does not
verify; load_model, export and serving name the bad file).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ddptrain.models.adapters import (GENERATION_CONFIG, WEIGHTS_FILE, adapter_of, generation_eos, load_weights,
                                      merge_eos)
from ddptrain.models.spec import ModelSpec
from ddptrain.fsutil import replace_dir, sha256_file
from ddptrain.runs import store as ckpt
from ddptrain.runs.layout import BEST, FINAL

log = logging.getLogger(__name__)

WHICH = (FINAL, BEST)
"""The weights a run directory names: final/ (else the newest checkpoint), or best/."""
SPEC_FILE = "ddptrain_model.json"
CHAT_TEMPLATE = "chat_template.jinja"
# WEIGHTS_FILE, model.safetensors, is imported from the adapters: they write and read it.


def final_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / FINAL


def save_final(run_dir: str | Path, module: nn.Module, state_dict: dict[str, torch.Tensor], spec: ModelSpec,
               step: int, tokenizer_files: Mapping[str, Path], checkpoint_sha256: str | None = None,
               data: Mapping | None = None, name: str = FINAL) -> Path:
    """Write `final/` (rank 0). `module` is the unwrapped model (for model=hf its save_pretrained);
    `tokenizer_files`: name in final/ -> source (ModelAdapter.tokenizer_files). `data`, the run's
    data section, says the chat template and the tokens that end what the model writes; None: the
    one in RUN_DIR/config.yaml, when there is one. `checkpoint_sha256`, the sha256 of the
    COMPLETE.json of the checkpoint these weights are, tells a later launch at this step whether
    final/ is its run's (Checkpointer.final_is_current). `name`: best/ is written the same way."""
    final = Path(run_dir) / name
    tmp = final.with_name(f".tmp-{name}")
    if tmp.exists():
        shutil.rmtree(tmp)  # left by a run killed while writing
    tmp.mkdir(parents=True)
    adapter_of(spec).save_final(module, state_dict, tmp, spec)
    save_tokenizer_files(tmp, tokenizer_files, _run_data(Path(run_dir)) if data is None else data)
    digests = {str(path.relative_to(tmp)): sha256_file(path) for path in sorted(tmp.rglob("*")) if path.is_file()}
    source = {"checkpoint_sha256": checkpoint_sha256} if checkpoint_sha256 is not None else {}
    (tmp / SPEC_FILE).write_text(json.dumps({**spec.to_dict(), "step": step, **source, "sha256": digests}, indent=1))
    for path in tmp.rglob("*"):
        if path.is_file():
            with open(path, "rb+") as handle:
                os.fsync(handle.fileno())
    old = final.with_name(f".old-{name}")
    replace_dir(tmp, final, aside=old)  # one atomic exchange where the OS can
    shutil.rmtree(old, ignore_errors=True)
    return final


def _run_data(run_dir: Path) -> dict:
    """The `data` section of RUN_DIR/config.yaml, the resolved config the run was launched with ({}
    without one: save_final called outside a run)."""
    config = run_dir / "config.yaml"
    if not config.is_file():
        return {}
    from omegaconf import OmegaConf

    data = OmegaConf.select(OmegaConf.load(config), "data", default=None)
    return OmegaConf.to_container(data, resolve=True) if data is not None else {}


def save_tokenizer_files(directory: Path, tokenizer_files: Mapping[str, Path], data: Mapping) -> None:
    """What tokenizes, chats and stops like the run beside its weights in `directory`: the
    `tokenizer_files` (name there -> source), data.chat_template (the template it trained on, which
    the tokenizer's own may not be) as chat_template.jinja, and the tokens it learnt to end with
    (`_stop_ids`) in generation_config.json's eos_token_id, where transformers' generation and
    ddptrain's serving stop. final/ holds them; an export of a checkpoint writes the same."""
    for name, file in dict(tokenizer_files).items():
        shutil.copy2(file, directory / name)
    if data.get("chat_template"):
        shutil.copy2(Path(data["chat_template"]).expanduser(), directory / CHAT_TEMPLATE)
    stop = _stop_ids(directory, data)
    if not stop:
        return
    file = directory / GENERATION_CONFIG
    config = json.loads(file.read_text()) if file.is_file() else {}  # model=hf: save_pretrained's
    config["eos_token_id"] = merge_eos(config.get("eos_token_id"), stop)
    file.write_text(json.dumps(config, indent=2) + "\n")


def _stop_ids(directory: Path, data: Mapping) -> list[int]:
    """The tokens the run's targets end documents with: data=sft's EOS and end-of-turn token
    (ChatTokenizer.stop_ids, of the tokenizer files in `directory`, as serving reads them), and
    data=tokens' data.eod_token, which ends and belongs to every document, so it is the last target
    of each. Text, JSONL and HF sources encode documents without special tokens and packing ignores
    the target across a document boundary: those runs never learnt a token to stop at."""
    if data.get("name") == "tokens" and data.get("eod_token") is not None:
        return [int(data["eod_token"])]
    if data.get("name") != "sft" or not (directory / "tokenizer.json").is_file():
        return []
    from ddptrain.data.chat import ChatTokenizer
    from ddptrain.data.sources import DataError

    try:
        return list(ChatTokenizer(str(directory / "tokenizer.json")).stop_ids())
    except DataError as error:
        log.warning("no end-of-turn token is recorded, so generation stops at max_tokens only: %s", error)
        return []


def checkpoint_tokenizer_files(path: Path, state: dict) -> tuple[dict[str, Path], dict]:
    """(tokenizer files, data section) of the run that wrote the checkpoint at `path`, from its
    trainer `state` (trainer.pt, as TrainedWeights read it): what save_final would have saved
    beside these weights (`save_tokenizer_files`). A CheckpointError names a file that is no longer
    where the run read it."""
    config = state.get("config", {})
    spec = ModelSpec.from_dict(state["model_spec"])
    data = dict(config.get("data") or {})
    files = adapter_of(spec).tokenizer_files(spec.config, data.get("tokenizer"))
    template = data.get("chat_template")
    sources = [*files.values(), *([Path(template).expanduser()] if template else [])]
    missing = [str(file) for file in sources if not Path(file).is_file()]
    if missing:
        raise ckpt.CheckpointError(f"{path}: the tokenizer files its run trained with are gone ({', '.join(missing)}); "
                                   "put them back, or resume the run to write final/")
    return files, data


def checkpoint_eos(path: Path, trainer_state: dict) -> int | list[int] | None:
    """The eos_token_id final/ would record for the checkpoint at `path` (`save_tokenizer_files`,
    into a scratch directory: the stop tokens are read from the files as final/ would hold them)."""
    with tempfile.TemporaryDirectory(prefix="ddptrain-stops-") as scratch:
        save_tokenizer_files(Path(scratch), *checkpoint_tokenizer_files(path, trainer_state))
        return generation_eos(Path(scratch))


def source_files(weights: TrainedWeights) -> list[Path]:
    """The files that load_model and export read for `weights`: its directory's marker, which holds
    a sha256 of every other file in it (checked by find_weights), or every file where an older
    final/ has none; a LoRA run's base files at model.path; a checkpoint's tokenizer files and chat
    template. Their contents, not their mtimes, say whether what was built from them is current."""
    directory, is_final = weights.directory, weights.is_final
    marker = directory / (SPEC_FILE if is_final else ckpt.MARKER)
    meta = json.loads(marker.read_text())
    files = [marker] if "sha256" in meta else sorted(path for path in directory.rglob("*") if path.is_file())
    spec = meta if is_final else weights.trainer_state.get("model_spec")
    if spec is None:  # a checkpoint of an older ddptrain, which load_model refuses by name
        return files
    spec = ModelSpec.from_dict(spec)
    if spec.base_weights is not None:  # LoRA: the frozen base is model.path's, read again
        base = Path(spec.config["path"]).expanduser()  # gone: loading it names the path
        files += sorted(path for path in base.iterdir() if path.is_file()) if base.is_dir() else []
    if not is_final:
        tokenizer_files, data = checkpoint_tokenizer_files(directory, weights.trainer_state)
        files += [Path(file) for file in tokenizer_files.values()]
        files += [Path(data["chat_template"]).expanduser()] if data.get("chat_template") else []
    return files


def verify_final(directory: Path) -> dict:
    """The marker (ddptrain_model.json) of a final/ whose files match their checksums, else a
    CheckpointError naming the file. A final/ written before the checksums verifies its marker alone."""
    marker = directory / SPEC_FILE
    try:
        meta = json.loads(marker.read_text())
        meta["step"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ckpt.CheckpointError(f"{marker} is unreadable: {error!r}") from error
    for name, expected in meta.get("sha256", {}).items():
        file = directory / name
        if not file.is_file():
            raise ckpt.CheckpointError(f"{file} is missing")
        if sha256_file(file) != expected:
            raise ckpt.CheckpointError(f"{file} is corrupted: its sha256 does not match {SPEC_FILE}")
    return meta


def weights_dir(run_dir: str | Path, which: str = FINAL) -> Path:
    """`final/` when it is there, else the newest complete checkpoint; a clear error if neither,
    or if final/ does not verify (naming the file, and how to rebuild it). which="best": best/."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no such run directory")
    if which not in WHICH:
        raise ValueError(f"which={which!r} is not one of {', '.join(WHICH)}")
    if which == BEST:
        return _best_dir(run_dir)
    final = final_dir(run_dir)
    if (final / SPEC_FILE).is_file():
        try:
            verify_final(final)
        except ckpt.CheckpointError as error:
            raise ckpt.CheckpointError(f"{error}; rerun the training command of {run_dir} to rebuild {FINAL}/ from "
                                       "its newest checkpoint") from error
        return final
    latest = ckpt.find_latest(run_dir)
    if latest is None:
        raise FileNotFoundError(f"{run_dir} holds no trained weights: no {FINAL}/ and no complete checkpoint "
                                "(was the run started with this run.dir?)")
    return latest


def _best_dir(run_dir: Path) -> Path:
    best = run_dir / BEST
    if not (best / SPEC_FILE).is_file():
        raise FileNotFoundError(f"{run_dir} holds no {BEST}/ weights: train with checkpoint.keep_best=METRIC "
                                "(val_loss, eval/<task>/acc, ...) and at least one evaluation")
    verify_final(best)
    return best


@dataclass(frozen=True)
class TrainedWeights:
    """A run's trained weights as `find_weights` found them: the directory, verified once, and a
    checkpoint's trainer state, read once. load_model, the export and the servable directory's
    stamp take this one value, so one start-up neither hashes the weights nor reads trainer.pt
    again, and all of them describe the same checkpoint even while a run writes a newer one."""

    directory: Path
    """final/, or the newest complete checkpoint (`weights_dir`)."""
    trainer_state: dict | None
    """A checkpoint's trainer.pt (config, model spec); None for final/, whose marker says it all."""

    @property
    def is_final(self) -> bool:
        """final/ or best/ (final/'s format), not a checkpoint."""
        return self.trainer_state is None


def find_weights(run_dir: str | Path, which: str = FINAL) -> TrainedWeights:
    """The run's weights (`weights_dir`: final/, else the newest complete checkpoint; or best/), with a
    checkpoint's trainer state; a CheckpointError names a trainer.pt that cannot be read."""
    directory = weights_dir(run_dir, which)
    return TrainedWeights(directory, None if directory.name in WHICH else ckpt.load_trainer_state(directory))


def load_model(run_dir: str | Path, which: str = FINAL) -> nn.Module:
    """The trained model of a run: eval mode, on CPU, with the weights of `final/` (or of the newest
    complete checkpoint while the run has no final weights yet); which="best": of `best/`."""
    return load_trained(find_weights(run_dir, which))


def load_trained(weights: TrainedWeights) -> nn.Module:
    """The module of `weights` (what load_model returns for their run)."""
    if weights.is_final:
        spec = ModelSpec.from_dict(json.loads((weights.directory / SPEC_FILE).read_text()))
        model = adapter_of(spec).load_final(weights.directory, spec)
    else:
        model = _load_from_checkpoint(weights.directory, weights.trainer_state)
    return model.eval()


def _load_from_checkpoint(path: Path, state: dict) -> nn.Module:
    if "model_spec" not in state:
        raise ckpt.CheckpointError(f"{path} was written by an older ddptrain without a model spec; it cannot be "
                                   "loaded as a model (resume training to write final/)")
    spec = ModelSpec.from_dict(state["model_spec"])
    weights = ckpt.read_weights(path)
    adapter = adapter_of(spec)
    model = adapter.rebuild(spec)
    load_weights(model, weights, spec, path)
    try:  # the tokens final/ would stop at, for generation and the export
        eos = checkpoint_eos(path, state)
    except ckpt.CheckpointError as error:  # the run's tokenizer moved: the weights still load
        log.warning("%s; its generation stops at no end-of-turn token", error)
        eos = None
    if eos is not None:
        adapter.stop_at(model, eos)
    return model
