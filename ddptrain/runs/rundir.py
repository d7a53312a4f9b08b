"""A run directory: its layout, its lock, its log file and config.yaml, the checkpoint a launch
continues from, and moving an earlier run (or an abandoned trajectory) aside.

    <run.dir>/.lock  config.yaml  train.log  metrics.jsonl  checkpoints/step_N/  final/  previous/<time>/

(every entry a run writes, and what each holds: ddptrain/runs/layout.py, the one list).

A run dir is empty or new when a first run starts there: one with other files (a user's
config.yaml) is refused by name, never written into. One run per run dir: a fresh start, or a
resume from another run's checkpoint, moves what an earlier run left to previous/<time>/ (nothing
is deleted), and a resume moves the checkpoints and final/ of later steps there too, so
`checkpoint.resume=auto` never continues an abandoned trajectory. Every method that decides is
collective: rank 0 acts, every rank fails alike.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
from pathlib import Path

from omegaconf import OmegaConf

from ddptrain.config.schema import TrainConfig
from ddptrain.distributed import Rank0Filter, barrier, is_rank_zero, raise_on_every_rank
from ddptrain.fsutil import describe_write_error, fsync_dir, fsync_file, make_dirs, move
from ddptrain.runs import store
from ddptrain.runs.layout import CONFIG_FILE, EARLIER_RUN, LOG_FILE, METRICS_FILE, PREVIOUS, RUN_ENTRIES, RUN_MARKERS
from ddptrain.runs.lock import RunDirError, RunDirLock, RunDirLocked
from ddptrain.runs.resume import check_config, defaults_of, log_applied, model_defaults
from ddptrain.runs.weights import BEST, SPEC_FILE, final_dir

log = logging.getLogger(__name__)


class RunDir:
    """The run directory `cfg.run.dir` of one launch, the same on every rank; rank 0 writes it."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.path = Path(cfg.run.dir)
        self.config_changes: list = []  # (key, saved, now) of the checkpoint resumed from, after saved_state
        self._lock: RunDirLock | None = None
        self._file_log: logging.Handler | None = None

    @property
    def checkpoints(self) -> Path:
        return store.checkpoint_dir(self.path)

    @property
    def final(self) -> Path:
        return final_dir(self.path)

    @property
    def config_file(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def log_file(self) -> Path:
        return self.path / LOG_FILE

    @property
    def metrics_file(self) -> Path:
        return self.path / METRICS_FILE

    def final_step(self) -> int | None:
        """The step of the weights in final/ (None: none, or unreadable)."""
        try:
            return json.loads((self.final / SPEC_FILE).read_text()).get("step")
        except (OSError, ValueError, AttributeError):
            return None

    # -- the lock and the run files ------------------------------------------------------------

    def lock(self) -> None:
        """Rank 0 takes the run dir's lock; a directory with files that are not a run's
        (`refuse_others_files`), a live holder, or a run.dir that cannot be created or written, fails
        every rank at start-up, by name. An explicit checkpoint.resume path that does not exist is
        refused first, so that nothing is created."""
        store.check_resume_path(self.cfg.checkpoint.resume, self.path)  # every rank alike, no collective
        error = None
        if is_rank_zero():
            try:
                refuse_others_files(self.path)
                self._lock = RunDirLock(self.path).acquire()
            except RunDirLocked as caught:
                error = caught
            except OSError as caught:
                error = RunDirError(f"run.dir={self.path} cannot be used: {describe_write_error(caught, self.path)}"
                                    " (it must be a writable directory, or a path where one can be created)")
        raise_on_every_rank(error, RunDirError)

    def write_run_files(self) -> None:
        """train.log (the console log), on rank 0."""
        if is_rank_zero():
            self.path.mkdir(parents=True, exist_ok=True)
            self._file_log = logging.FileHandler(self.log_file)
            self._file_log.addFilter(Rank0Filter())
            self._file_log.setFormatter(logging.Formatter("[%(asctime)s %(levelname)s] %(message)s", "%H:%M:%S"))
            logging.getLogger("ddptrain").addHandler(self._file_log)
        barrier()

    def write_config(self) -> None:
        """config.yaml (the resolved config), on rank 0: only once the launch is accepted (resumed
        or started afresh), so a refused launch leaves the run's config as it was."""
        if is_rank_zero():
            self.config_file.write_text(OmegaConf.to_yaml(self.cfg, resolve=True))

    def close(self) -> None:
        """Releases the lock and closes train.log."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        if self._file_log is not None:
            logging.getLogger("ddptrain").removeHandler(self._file_log)
            self._file_log.close()
            self._file_log = None

    # -- which checkpoint this launch continues from ----------------------------------------------

    def saved_state(self) -> dict:
        """The trainer state of the checkpoint to resume from ({} for a fresh start; its directory
        under "path"), its config checked against ours and its changes said (unless nothing is left
        to do) and kept in `config_changes`. A fresh start, or a resume from a checkpoint outside
        run.dir/checkpoints (another run's), moves an earlier run in the run dir aside first: one
        run dir never mixes two runs."""
        resume = self.cfg.checkpoint.resume
        path = store.agree_on_checkpoint(self.path, resume)
        if path is None:
            self._move_previous_aside("checkpoint.resume=none" if resume == "none"
                                      else "no complete checkpoint could be resumed")
            return {}
        state = store.load_trainer_state(path)
        state["path"] = path
        current = OmegaConf.to_container(self.cfg, resolve=True)
        defaults = {**defaults_of(TrainConfig), **model_defaults(current.get("model", {}))}
        self.config_changes = check_config(state.get("config", {}), current, defaults,
                                           fingerprinted=state.get("fingerprint") is not None)
        if state["step"] < self.cfg.trainer.max_steps:  # else nothing is trained with them: not "applied"
            log_applied(self.config_changes)
        if not _is_inside(path, self.checkpoints):
            self._move_previous_aside(f"checkpoint.resume={path} is not one of its checkpoints")
        return state

    def _move_previous_aside(self, why: str) -> None:
        """Collective: rank 0 moves an earlier run in run.dir to previous/ while the other ranks
        wait; a move that fails (rolled back: move_previous_run_aside) fails every rank."""
        error = None
        if is_rank_zero():
            try:
                move_previous_run_aside(self.path, why)
            except RunDirError as caught:
                error = caught
            except OSError as caught:  # before any move: listing run.dir
                error = RunDirError(f"run.dir={self.path}: its earlier run could not be moved aside: "
                                    f"{describe_write_error(caught, self.path)}")
        raise_on_every_rank(error, RunDirError)  # the barrier: no rank starts beside the earlier run

    def move_newer_aside(self, step: int) -> None:
        """Collective, once the resume from `step` is accepted: run.dir's checkpoints and final/ of
        later steps are not this run's future. They are an abandoned trajectory's (a rollback:
        checkpoint.resume=PATH to an older checkpoint, say with another learning rate) or ones that
        did not verify (`auto` skipped them); left in place, a later `auto` would resume the newest
        of them and silently continue the abandoned trajectory. Rank 0 moves them to previous/<time>/
        while the other ranks wait (move_abandoned_aside: nothing is deleted)."""
        error = None
        if is_rank_zero():
            newer = [(saved, path) for saved, path in store.list_checkpoints(self.path) if saved > step]
            final_step = self.final_step()
            final = [self.final] if final_step is not None and final_step > step else []
            best = self.path / BEST  # the best of steps this run will evaluate again
            if (best / SPEC_FILE).is_file() and json.loads((best / SPEC_FILE).read_text()).get("step", 0) > step:
                final.append(best)
            try:
                if newer or final:
                    target = move_abandoned_aside(self.path, [path for _, path in newer] + final)
                    log.warning("run.dir's checkpoints of steps (%s)%s come after step %d, the one this run "
                                "continues from (an abandoned trajectory's, or ones that did not verify): moved to "
                                "%s (nothing was deleted); checkpoint.resume=auto never resumes them",
                                ", ".join(str(saved) for saved, _ in newer) or "none",
                                (f" and final/ of step {final_step}" if self.final in final else "")
                                + (" and best/" if best in final else ""), step, target)
            except RunDirError as caught:  # nothing moved, or each piece named (_move_together)
                error = caught
            except OSError as caught:  # listing them
                error = RunDirError(f"the checkpoints after step {step} could not be moved aside: "
                                    f"{describe_write_error(caught, self.path)}")
        raise_on_every_rank(error, RunDirError)  # the barrier: no rank trains before they are gone


def refuse_others_files(run_dir: Path) -> None:
    """A run writes only into a directory that is not there yet, is empty, or is a run dir (one of
    RUN_MARKERS): its config.yaml, train.log and metrics.jsonl would overwrite a user's files of those
    names, and a fresh start moves them to previous/. Anything else is a RunDirError naming the files,
    before anything is written."""
    try:
        names = sorted(os.listdir(run_dir))
    except (FileNotFoundError, NotADirectoryError):
        return  # made for the run; a file is refused by the lock with its own message
    if not names or any(name in RUN_MARKERS for name in names):
        return
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    raise RunDirError(f"run.dir={run_dir} holds files that are not a ddptrain run's ({shown}): a run writes "
                      f"{CONFIG_FILE}, {LOG_FILE}, {METRICS_FILE}, checkpoints/ and final/ into its run.dir, which "
                      f"must be empty, a new path, or an earlier run's directory. Give the run its own folder, e.g. "
                      f"run.dir={run_dir / 'run'}; nothing was written")


def managing_run(path: str | Path) -> tuple[Path, str] | None:
    """(run dir, entry name) when `path` is one of a run dir's own entries (runs.layout.RUN_ENTRIES),
    present or not, or inside one: a later launch swaps final/ and best/, purges a checkpoint step,
    rebuilds servable/ and servable-best/, moves them all to previous/, and what is written there
    goes with them. None elsewhere."""
    path = Path(path).expanduser().resolve()
    for directory in (path, *path.parents):
        if directory.name in RUN_ENTRIES and any((directory.parent / name).exists() for name in RUN_MARKERS
                                                if name != directory.name):
            return directory.parent, directory.name
    return None  # a writer's staging name (runs.layout.STAGING_PREFIXES) is its own: serve exports into one


def _is_inside(path: Path, directory: Path) -> bool:
    return Path(path).resolve().is_relative_to(Path(directory).resolve())


# -- moving aside: all or nothing ---------------------------------------------------------------


def move_previous_run_aside(run_dir: str | Path, why: str) -> Path | None:
    """A fresh start in a run dir that holds an earlier run, or a resume there from another run's
    checkpoint, moves that run to `previous/<time>/`: nothing is deleted, and the earlier run's
    checkpoints, metrics and final weights can never be mistaken for this one's. All or nothing:
    where a move fails, what was moved goes back and a RunDirError names the path and the cause."""
    run_dir = Path(run_dir)
    present = [name for name in EARLIER_RUN if (run_dir / name).exists()]
    if not any(name in present for name in ("checkpoints", "final", "metrics.jsonl")):
        return None
    target = _move_together(run_dir, [run_dir / name for name in present], f"it holds an earlier run and {why}")
    log.warning("run.dir %s held an earlier run; %s, so it was moved to %s (nothing was deleted)", run_dir, why, target)
    return target


def move_abandoned_aside(run_dir: str | Path, paths: list[Path]) -> Path:
    """Move `paths` (checkpoints and final/ of steps after the checkpoint a run resumed from) to
    `previous/<time>/` under their names in run.dir, with a copy of the run's metrics.jsonl and
    config.yaml (the resumed run cuts the one and rewrites the other): nothing is deleted, and
    `auto` can never resume them. Returns that directory. All or nothing, as `move_previous_run_aside`."""
    run_dir = Path(run_dir)
    copies = [run_dir / name for name in ("metrics.jsonl", "config.yaml") if (run_dir / name).is_file()]
    return _move_together(run_dir, [Path(path) for path in paths],
                          "it holds checkpoints after the one this run resumes from", copies=copies)


def _move_together(run_dir: Path, paths: list[Path], why: str, copies: list[Path] = ()) -> Path:
    """Move `paths` (inside `run_dir`) to a new `previous/<time>/` under their names there, and copy
    `copies` beside them; returns that directory. A failure moves back what was moved, removes
    what it made, and raises a RunDirError saying what failed and where the data is: the earlier
    run whole where it was, or (where even that fails) each piece by name. Never half deleted:
    `fsutil.move` removes an original only once its copy is complete."""
    previous = run_dir / PREVIOUS
    try:
        target = _new_previous_dir(run_dir)
    except OSError as error:
        raise RunDirError(
            f"run.dir={run_dir}: {why}, which is moved to {previous}/<time>/ before this run starts, but that "
            f"directory could not be created: {describe_write_error(error, previous)}. Nothing was moved. Make "
            f"{previous} a writable directory (or a link to one), move the earlier run away yourself, or pick "
            "another run.dir") from error
    moved: list[Path] = []
    current = None
    try:
        for current in paths:
            destination = target / current.relative_to(run_dir)
            make_dirs(destination.parent)
            move(current, destination)
            moved.append(current)
        current = None
        for path in copies:
            shutil.copy2(path, target / path.name)
            fsync_file(target / path.name)
        fsync_dir(target)
    except OSError as error:
        what = f"moving {current}" if current is not None else "copying metrics.jsonl and config.yaml"
        where = _move_back(run_dir, target, moved, current)
        raise RunDirError(
            f"run.dir={run_dir}: {why}, which is moved to {target} before this run starts, but {what} there "
            f"failed: {describe_write_error(error, target)}. {where} A mount point, or an entry this user may not "
            f"move or delete, cannot be moved: free it, move the earlier run away yourself, or pick another "
            "run.dir") from error
    return target


def _move_back(run_dir: Path, target: Path, moved: list[Path], failed: Path | None) -> str:
    """Undo `_move_together`'s moves of `moved` into `target` after moving `failed` did not succeed;
    says where the data is now."""
    kept: list[str] = []
    if failed is not None and os.path.lexists(target / failed.relative_to(run_dir)):
        # fsutil.move leaves no partial copy: this one is whole, only the original's removal failed
        kept.append(f"{target / failed.relative_to(run_dir)} is a complete copy of {failed}, of which what "
                    "could not be removed is left (delete it once checked)")
    for path in reversed(moved):
        try:
            move(target / path.relative_to(run_dir), path)
        except OSError as error:
            kept.append(f"{path} is at {target / path.relative_to(run_dir)} ({describe_write_error(error, path)} "
                        "moving it back)")
    for directory in sorted((d for d in [target, *target.rglob("*")] if d.is_dir() and not d.is_symlink()),
                            key=lambda d: len(d.parts), reverse=True):
        try:
            directory.rmdir()  # only what is empty: what we made for the moves
        except OSError:
            pass
    if not kept:
        return "Nothing was moved: the earlier data is where it was."
    return "Nothing was deleted, but not all of it is where it was: " + "; ".join(kept) + "."


def _new_previous_dir(run_dir: Path) -> Path:
    """A new, empty `previous/<time>/` in `run_dir`."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    target = run_dir / PREVIOUS / stamp
    suffix = 1
    while target.exists():
        target, suffix = run_dir / PREVIOUS / f"{stamp}-{suffix}", suffix + 1
    make_dirs(target)
    return target
