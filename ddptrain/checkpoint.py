"""Atomic checkpoints: write under a temporary name, fsync, rename, marker last; find the latest
complete one; verify checksums on load and fall back to the previous one when a file is bad.

Layout of one checkpoint (a directory under `<run.dir>/checkpoints/`):

    step_00000100/
        trainer.pt        model, optimizer, scheduler, engine counters, step, cursor, logger id,
                          resolved config (rank 0 writes: DDP weights are the same on every rank)
        rng_rank{r}.pt    python, numpy, torch CPU and CUDA RNG states of rank r
        strategy/         a strategy's own sharded files (DeepSpeed ZeRO), when it has them
        COMPLETE.json     written last: the step and a sha256 of every file above

A directory becomes visible under its final name only after every rank has written and the
marker is on disk, so `auto` can never pick a checkpoint that a killed run left half-written.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from ddptrain.distributed import barrier, get_rank, get_world_size, is_rank_zero

log = logging.getLogger(__name__)

MARKER = "COMPLETE.json"
_NAME = re.compile(r"^step_(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupted; the message names the file."""


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_name(step: int) -> str:
    return f"step_{step:08d}"


# -- RNG --------------------------------------------------------------------------------------


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def load_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# -- writing ----------------------------------------------------------------------------------


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save_torch(obj, path: Path) -> None:
    torch.save(obj, path)
    _fsync_file(path)


def write_checkpoint(run_dir: str | Path, step: int, trainer_state: dict | None, strategy=None,
                     failpoint=None) -> Path:
    """Collective: every rank calls it. Returns the final directory.

    `trainer_state` is written by rank 0 (None elsewhere is fine). A strategy with
    `save_checkpoint(dir)` (DeepSpeed) writes its own shards under `strategy/` on every rank.
    `failpoint` (tests) is called between the payload and the marker.
    """
    root = checkpoint_dir(run_dir)
    final = root / step_name(step)
    tmp = root / f".tmp-{step_name(step)}"
    if is_rank_zero():
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)  # left by a run killed while writing
        tmp.mkdir()
    barrier()
    if is_rank_zero() and trainer_state is not None:
        save_torch(trainer_state, tmp / "trainer.pt")
    save_torch(rng_state(), tmp / f"rng_rank{get_rank()}.pt")
    if strategy is not None and hasattr(strategy, "save_checkpoint"):
        strategy.save_checkpoint(tmp / "strategy")
    if failpoint is not None:
        failpoint()
    barrier()
    if is_rank_zero():
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        for path in files:
            if "strategy" in path.relative_to(tmp).parts:
                _fsync_file(path)
        sums = {str(p.relative_to(tmp)): _sha256(p) for p in files}
        marker = tmp / MARKER
        marker.write_text(json.dumps({"step": step, "world_size": get_world_size(), "sha256": sums}, indent=1))
        _fsync_file(marker)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
    barrier()
    return final


def purge(run_dir: str | Path, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints (rank 0). Never fails training."""
    if not is_rank_zero() or keep <= 0:
        return
    complete = [path for _, path in list_checkpoints(run_dir) if (path / MARKER).is_file()]
    for path in complete[:-keep] if len(complete) > keep else []:
        try:
            shutil.rmtree(path)
        except OSError as error:  # a failed purge only costs disk space
            log.warning("could not delete old checkpoint %s: %s", path, error)


# -- finding and reading ----------------------------------------------------------------------


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, dir) of every checkpoint directory with a final name, oldest first."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()]
    return sorted(found)


def verify(path: Path) -> dict:
    """The marker of a complete checkpoint whose files all match their checksums, else raise."""
    marker = path / MARKER
    if not marker.is_file():
        raise CheckpointError(f"{path} has no {MARKER}: it was never completed")
    try:
        meta = json.loads(marker.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{marker} is unreadable: {error}") from error
    for name, expected in meta["sha256"].items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file} is missing")
        if _sha256(file) != expected:
            raise CheckpointError(f"{file} is corrupted: its sha256 does not match {MARKER}")
    return meta


def find_latest(run_dir: str | Path) -> Path | None:
    """The newest checkpoint that verifies; bad ones are reported by name and skipped."""
    for step, path in reversed(list_checkpoints(run_dir)):
        try:
            verify(path)
            return path
        except CheckpointError as error:
            log.warning("skipping checkpoint of step %d: %s", step, error)
    return None


def resolve_resume(run_dir: str | Path, resume: str) -> Path | None:
    """`auto` (latest complete in the run dir, else None), `none`, or an explicit path."""
    if resume == "none":
        return None
    if resume == "auto":
        return find_latest(run_dir)
    path = Path(resume)
    verify(path)
    return path


def load_trainer_state(path: Path) -> dict:
    file = path / "trainer.pt"
    try:
        return torch.load(file, map_location="cpu", weights_only=False)
    except Exception as error:  # torch raises many kinds on a damaged zip
        raise CheckpointError(f"{file} could not be loaded: {error}") from error


def load_rng_for_rank(path: Path, rank: int, world_size: int, saved_world_size: int) -> None:
    """Restore this rank's RNG; with a different world size there is no exact counterpart."""
    file = path / f"rng_rank{rank}.pt"
    if saved_world_size != world_size or not file.is_file():
        if rank == 0:
            log.warning("resuming on %d ranks from a checkpoint of %d ranks: RNG states are not restored "
                        "(the data order is global and unaffected)", world_size, saved_world_size)
        return
    load_rng_state(torch.load(file, map_location="cpu", weights_only=False))
