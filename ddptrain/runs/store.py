"""Atomic checkpoints: write under a temporary name, fsync, rename, marker last; find the latest
complete one; verify checksums on load and fall back to the previous one when a file is bad.

Layout of one checkpoint (a directory under `<run.dir>/checkpoints/`):

    step_00000100/
        trainer.pt        scheduler, engine counters, step, cursor, logger id, resolved config,
                          model spec (rank 0 writes)
        rng_rank{r}.pt    python, numpy, torch CPU and CUDA RNG states of rank r
        state/            weights and optimizer state in the strategy-neutral layout (Engine.save,
                          ddptrain/strategies/state.py): a DCP directory of the full-model view
                          that every strategy loads on any world size
        COMPLETE.json     written last: the step and a sha256 of every file above

A directory becomes visible under its final name only after every rank has written and the
marker is on disk, so `auto` can never pick a checkpoint that a killed run left half-written. A
step directory already there is never taken for this save: it is moved aside, unread, first.

Older checkpoints hold the strategy's own files in `strategy/` instead of `state/`; they resume
with the strategy (and, for zero, the world size) that wrote them (fsdp's: anywhere).
"""

from __future__ import annotations

import json
import logging
import random
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException as DCPException

from ddptrain.distributed import barrier, first_failure, get_rank, get_world_size, is_rank_zero
from ddptrain.fsutil import (UnsafeFileError, describe_write_error, fsync_file, load_torch, make_dirs, rename,
                             replace_dir, save_torch, sha256_file)
from ddptrain.runs.layout import CHECKPOINTS

log = logging.getLogger(__name__)

MARKER = "COMPLETE.json"
_NAME = re.compile(r"^step_(\d{8})$")


STATE_DIR = "state"
"""A checkpoint's sub-directory that holds weights and optimizer state (Engine.save / Engine.load)."""
LEGACY_STATE_DIR = "strategy"
"""Its name in checkpoints written before the neutral layout, in the strategy's own format."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupted; the message names the file."""


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


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


def _shares(files: list[Path], world_size: int) -> list[list[Path]]:
    """Files split over ranks with nearly equal bytes (largest first, to the lightest rank)."""
    shares: list[list[Path]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    sizes = {path: (path.stat().st_size if path.is_file() else 0) for path in files}
    for path in sorted(files, key=lambda p: (-sizes[p], str(p))):
        rank = loads.index(min(loads))
        shares[rank].append(path)
        loads[rank] += sizes[path]
    return shares


def write_checkpoint(run_dir: str | Path, step: int, trainer_state: dict | None, save_state=None,
                     failpoint=None) -> Path:
    """Collective: every rank calls it. Returns the final directory.

    `trainer_state` is written by rank 0 (None elsewhere is fine). `save_state(dir)` (Engine.save:
    weights and optimizer state, each rank its part) is called on every rank with `state/`.
    Every rank then fsyncs and hashes its share of the files (balanced by size, so no rank reads
    everything); rank 0 gathers the digests and writes the marker. An error on any rank (a full
    disk) fails every rank at once, names the path and the cause, removes the temporary directory
    and keeps the previous checkpoint. `failpoint` (tests) is called between the payload and the marker.
    A checkpoint of this step already there is replaced (`_open`): the caller decides whether the
    step needs saving (Checkpointer.save does not write again what it wrote or resumed from).
    """
    final, tmp = _open(run_dir, step)
    error: BaseException | None = None
    try:
        _write_small_files(tmp, trainer_state)
        if save_state is not None:
            save_state(tmp / STATE_DIR)
        if failpoint is not None:
            failpoint()
    except (Exception, DCPException) as caught:  # noqa: BLE001 - any write error must reach every rank
        error = _write_error(step, caught, tmp)
    _fail_together(error, tmp)
    digests: dict[str, str] = {}
    try:
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        digests = _digests(tmp, _shares(files, get_world_size())[get_rank()])
    except OSError as caught:
        error = CheckpointError(f"checkpoint of step {step}: {describe_write_error(caught, tmp)}")
    _fail_together(error, tmp)
    _commit(step, tmp, final, digests)
    return final


class PendingCheckpoint:
    """A checkpoint whose weights and optimizer state are still being written in the background
    (checkpoint.async_save): DCP's writer thread, then this rank's digests of what it wrote. Nothing
    is visible under the final name until `commit`, so a kill before it leaves the previous
    checkpoint the newest complete one."""

    def __init__(self, step: int, tmp: Path, final: Path, digests: dict[str, str], writing):
        self.step, self.tmp, self.final = step, tmp, final
        self._digests = digests  # of the files written before the background part (trainer.pt, RNG)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddptrain-checkpoint")
        self._hashed = self._pool.submit(self._finish, writing)

    def _finish(self, writing) -> dict[str, str]:
        """In the background: wait for DCP's writes (fsynced by its writer), then hash this rank's
        files of them (`__<rank>_*.distcp`, and rank 0's `.metadata`)."""
        writing.result()
        state = self.tmp / STATE_DIR
        mine = sorted(state.glob(f"__{get_rank()}_*"))
        if is_rank_zero():
            mine += [path for path in state.iterdir() if path.is_file() and not path.name.startswith("__")]
        return _digests(self.tmp, mine)

    def done(self) -> bool:
        """Whether this rank's part is written and hashed (local: no collective)."""
        return self._hashed.done()

    def commit(self) -> Path:
        """Collective: wait for every rank's part, then the marker and the rename (or, when a rank's
        write failed, a CheckpointError on every rank and the temporary directory removed)."""
        error, digests = None, {}
        try:
            digests = {**self._digests, **self._hashed.result()}
        except (Exception, DCPException) as caught:  # noqa: BLE001 - any write error must reach every rank
            error = _write_error(self.step, caught, self.tmp)
        finally:
            self._pool.shutdown(wait=True)  # its one task is done (result() returned or raised): joins the thread
        _fail_together(error, self.tmp)
        _commit(self.step, self.tmp, self.final, digests)
        return self.final


def start_checkpoint(run_dir: str | Path, step: int, trainer_state: dict | None, save_state_async,
                     failpoint=None) -> PendingCheckpoint:
    """Collective: `write_checkpoint` with the weights and optimizer state written in the
    background. `save_state_async(dir)` returns a future of the write once what it needs is copied
    off the device (Engine.save(dir, background=True)). Returns the PendingCheckpoint to commit."""
    final, tmp = _open(run_dir, step)
    error, pending = None, None
    try:
        _write_small_files(tmp, trainer_state)
        small = [tmp / f"rng_rank{get_rank()}.pt"] + ([tmp / "trainer.pt"] if is_rank_zero() and trainer_state is not None
                                                     else [])
        writing = save_state_async(tmp / STATE_DIR)
        pending = PendingCheckpoint(step, tmp, final, _digests(tmp, small), writing)
        if failpoint is not None:
            failpoint()
    except (Exception, DCPException) as caught:  # noqa: BLE001 - any write error must reach every rank
        error = _write_error(step, caught, tmp)
    _fail_together(error, tmp)
    return pending


def _open(run_dir: str | Path, step: int) -> tuple[Path, Path]:
    """Collective: (the final directory, a fresh temporary one to write into). A step directory
    already there is not this run's (the caller does not save a step it holds, and a resume moved
    every later one aside: RunDir.move_newer_aside): one put there by hand, or a save that
    never finished. It is moved aside now, unread, so it never counts as saved, never blocks the
    rename and is never resumed should this save fail: to `.replaced-<name>` with a COMPLETE.json,
    `.bad-<name>` without. Hashing it first (a collective read of every file) would decide nothing:
    it goes either way. Rank 0 acts and tells the others."""
    root = checkpoint_dir(run_dir)
    final = root / step_name(step)
    tmp = root / f".tmp-{step_name(step)}"
    error = None
    if is_rank_zero():
        try:
            make_dirs(root)
            if final.exists():
                finished = (final / MARKER).is_file()
                aside = _move_aside(final, _replaced_name(final) if finished else _bad_name(final))
                log.warning("the checkpoint of step %d in %s is not this run's (%s): moved to %s unread, and written "
                            "again", step, final, "this run neither wrote it nor resumed from it" if finished
                            else f"no {MARKER}: a save that never finished", aside.name)
            if tmp.exists():
                shutil.rmtree(tmp)  # left by a run killed while writing
            tmp.mkdir()
        except OSError as caught:
            error = CheckpointError(f"step {step}: cannot create {tmp}: {describe_write_error(caught, root)}")
    failure = first_failure(error)
    if failure is not None:
        raise error if error is not None else CheckpointError(failure[1].removeprefix("CheckpointError: "))
    return final, tmp


def _move_aside(path: Path, aside: Path) -> Path:
    """Rename a step directory to `aside` (a hidden name: no resume nor purge sees it; an earlier one
    there is replaced)."""
    if aside.exists():
        shutil.rmtree(aside)
    rename(path, aside)
    return aside


def _replaced_name(path: Path) -> Path:
    """Where a finished step directory that is not this run's goes (`_open`)."""
    return path.with_name(f".replaced-{path.name}")


def _bad_name(path: Path) -> Path:
    """Where a step directory without a marker (a save that never finished) goes (`_open`)."""
    return path.with_name(f".bad-{path.name}")


def _write_small_files(tmp: Path, trainer_state: dict | None) -> None:
    if is_rank_zero() and trainer_state is not None:
        save_torch(trainer_state, tmp / "trainer.pt")
    save_torch(rng_state(), tmp / f"rng_rank{get_rank()}.pt")


def _write_error(step: int, caught: BaseException, tmp: Path) -> CheckpointError:
    """DCP's CheckpointException is a BaseException holding each rank's failure: the first OSError
    among them (a full disk) is the one to name."""
    caught = _root_cause(caught)
    return CheckpointError(f"checkpoint of step {step} could not be written: {describe_write_error(caught, tmp)}; "
                           "the previous checkpoint is kept")


def _root_cause(error: BaseException) -> BaseException:
    """The first OSError inside DCP's (possibly nested) CheckpointException, else its first line as a
    RuntimeError (its text carries every rank's traceback)."""
    pending = [error]
    while pending:
        current = pending.pop(0)
        if isinstance(current, OSError):
            return current
        if isinstance(current, DCPException):
            pending += [failure[0] if isinstance(failure, tuple) else failure for failure in current.failures.values()]
        elif current.__cause__ is not None or current.__context__ is not None:
            pending.append(current.__cause__ or current.__context__)
    return RuntimeError(str(error).splitlines()[0]) if isinstance(error, DCPException) else error


def _digests(tmp: Path, files: list[Path]) -> dict[str, str]:
    """fsync and sha256 of `files`, by their path under `tmp`."""
    digests = {}
    for path in files:
        fsync_file(path)
        digests[str(path.relative_to(tmp))] = sha256_file(path)
    return digests


def _commit(step: int, tmp: Path, final: Path, digests: dict[str, str]) -> None:
    """Collective: rank 0 gathers every rank's digests, writes the marker and renames `tmp` to
    `final` (fsutil.replace_dir: `_open` moved any directory of that name aside; one that appeared
    since would be swapped out to `.replaced-<name>` in the same rename, never mixed with it)."""
    gathered = _gather(digests)
    if is_rank_zero():
        sums = {name: digest for part in gathered for name, digest in sorted(part.items())}
        marker = tmp / MARKER
        marker.write_text(json.dumps({"step": step, "world_size": get_world_size(), "sha256": dict(sorted(sums.items()))},
                                     indent=1))
        fsync_file(marker)
        replace_dir(tmp, final, aside=_replaced_name(final))
    barrier()


def _gather(obj) -> list:
    if not dist.is_initialized():
        return [obj]
    gathered: list = [None] * get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def _fail_together(error: BaseException | None, tmp: Path) -> None:
    """Collective: if any rank failed, every rank raises a CheckpointError and rank 0 removes `tmp`."""
    failure = first_failure(error)
    if failure is None:
        return
    if is_rank_zero():
        shutil.rmtree(tmp, ignore_errors=True)
    if error is not None:
        raise error
    rank, message = failure
    raise CheckpointError(f"rank {rank}: {message.removeprefix('CheckpointError: ')}")


def purge(run_dir: str | Path, keep: int, protect: Path) -> None:
    """Delete complete checkpoints older than `protect` (the one just written, which verifies) but
    the newest `keep` counted from it (rank 0). A resume moves every checkpoint newer than the one it
    resumed from aside (RunDir.move_newer_aside), so `protect` is the newest; one newer all the
    same is neither counted nor deleted: the newest checkpoint that verifies is never removed. Never
    fails training."""
    if not is_rank_zero() or keep <= 0:
        return
    protect_step = int(_NAME.match(Path(protect).name).group(1))
    older = [path for step, path in list_checkpoints(run_dir) if step < protect_step and (path / MARKER).is_file()]
    for path in older[:len(older) - (keep - 1)] if len(older) > keep - 1 else []:
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


def verify(path: Path, rank: int = 0, world_size: int = 1) -> dict:
    """The marker of a complete checkpoint whose files match their checksums, else raise.

    With `world_size` > 1, only this rank's share of the files is hashed (the shares of
    `write_checkpoint`): every rank calls it and the caller gathers the verdicts."""
    marker = path / MARKER
    if not marker.is_file():
        raise CheckpointError(f"{path} has no {MARKER}: it was never completed")
    try:
        meta = json.loads(marker.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{marker} is unreadable: {error}") from error
    files = [path / name for name in meta["sha256"]]
    mine = _shares(files, world_size)[rank] if world_size > 1 else files
    for file in mine:
        expected = meta["sha256"][str(file.relative_to(path))]
        if not file.is_file():
            raise CheckpointError(f"{file} is missing")
        if sha256_file(file) != expected:
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


def agree_on_checkpoint(run_dir: str | Path, resume: str) -> Path | None:
    """Collective: the checkpoint every rank resumes from (None: start fresh).

    Rank 0 lists the candidates (`auto`: newest first; a path: that one); every rank verifies its
    share of a candidate's files, so no rank reads them all; a candidate that fails on any rank is
    named and skipped (`auto`) or fails every rank (an explicit path). Any error, not only a bad
    checksum, reaches every rank at once."""
    listed: list = [None, None]  # (candidates, error)
    if is_rank_zero():
        try:
            listed[0] = _candidates(run_dir, resume)
        except Exception as error:  # noqa: BLE001 - every rank must hear of it
            listed[1] = str(error)
    if dist.is_initialized():
        dist.broadcast_object_list(listed, src=0)
    if listed[1] is not None:
        raise CheckpointError(f"checkpoint.resume={resume}: {listed[1]}")
    for candidate in map(Path, listed[0]):
        error = None
        try:
            verify(candidate, get_rank(), get_world_size())
        except Exception as caught:  # noqa: BLE001
            error = caught
        failure = first_failure(error)
        if failure is None:
            return candidate
        message = failure[1].removeprefix("CheckpointError: ")
        if resume != "auto":
            raise CheckpointError(f"checkpoint.resume={resume}: {message}")
        if is_rank_zero():
            log.warning("skipping checkpoint %s: %s", candidate.name, message)
    return None


def _candidates(run_dir: str | Path, resume: str) -> list[str]:
    if resume == "none":
        return []
    if resume == "auto":
        return [str(path) for _, path in reversed(list_checkpoints(run_dir))]
    check_resume_path(resume, run_dir)
    return [str(Path(resume).expanduser())]


def check_resume_path(resume: str, run_dir: str | Path) -> None:
    """A CheckpointError when checkpoint.resume names a path that does not exist."""
    path = Path(resume).expanduser()
    if resume not in ("auto", "none") and not path.exists():
        raise CheckpointError(f"{path} does not exist (checkpoint.resume takes auto, none "
                              f"or a checkpoint directory such as {checkpoint_dir(run_dir) / step_name(100)})")


def state_dir(path: Path) -> Path:
    """The directory of a checkpoint that holds weights and optimizer state (`state/`, or `strategy/`
    in a checkpoint from before the neutral layout)."""
    legacy = Path(path) / LEGACY_STATE_DIR
    return legacy if legacy.is_dir() and not (Path(path) / STATE_DIR).is_dir() else Path(path) / STATE_DIR


def is_legacy(path: Path) -> bool:
    """Whether the checkpoint at `path` keeps its state in its strategy's own, pre-neutral files."""
    from ddptrain.strategies import state as neutral

    return not neutral.is_neutral(state_dir(path))


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The full weights of the checkpoint at `path`, in one process without a process group, whatever
    strategy and world size wrote it."""
    from ddptrain.strategies import state as neutral, strategy_class

    directory = state_dir(path)
    if neutral.is_neutral(directory):
        return neutral.read_full(directory, "model", collective=False)["model"]
    name = load_trainer_state(path)["config"]["strategy"]["name"]
    return strategy_class(name).read_legacy_weights(directory)


def load_trainer_state(path: Path) -> dict:
    file = path / "trainer.pt"
    try:
        return load_torch(file)
    except UnsafeFileError as error:
        raise CheckpointError(str(error)) from error
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
    try:
        load_rng_state(load_torch(file))
    except UnsafeFileError as error:
        raise CheckpointError(str(error)) from error
