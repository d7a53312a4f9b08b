"""The run directory's component: its lock, its config and log files, resume, checkpoints on their
schedule, and the final weights.

The checkpoint format (markers, hashes, RNG per rank, purging) is ddptrain/runs/store.py;
what may change on resume is ddptrain/runs/resume.py; final/ is ddptrain/runs/weights.py. This
class decides when they run and keeps every rank in step with rank 0.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch import nn

from ddptrain.config.schema import TrainConfig
from ddptrain.distributed import DistInfo, Rank0Filter, all_ranks, barrier, is_rank_zero, raise_on_every_rank
from ddptrain.engine.engine import Engine
from ddptrain.fsutil import describe_write_error, sha256_file
from ddptrain.models.adapters import ModelAdapter
from ddptrain.models.spec import ModelSpec
from ddptrain.runs import store as ckpt
from ddptrain.train.builder import decay_steps
from ddptrain.train.faults import FaultInjector
from ddptrain.runs.weights import SPEC_FILE, final_dir, save_final, verify_final
from ddptrain.runs.resume import (SCHEDULE_KEYS, check_base_weights, check_config, defaults_of, log_applied,
                                   model_defaults, reset_learning_rate)
from ddptrain.runs.lock import (RunDirError, RunDirLock, RunDirLocked, move_abandoned_aside,
                                   move_previous_run_aside)

log = logging.getLogger(__name__)

class Checkpointer:
    def __init__(self, cfg, dist_info: DistInfo, faults: FaultInjector | None = None):
        self.cfg = cfg
        self.dist = dist_info
        self.run_dir = Path(cfg.run.dir)
        self.every = cfg.checkpoint.every
        self.last_step = cfg.trainer.max_steps
        self.faults = faults
        self.async_save = cfg.checkpoint.async_save
        self._pending: ckpt.PendingCheckpoint | None = None
        self.config_changes: list = []
        self._held: dict[int, Path] = {}  # step -> the checkpoint of this run: the one resumed from, each one saved
        self._lock: RunDirLock | None = None
        self._file_log: logging.Handler | None = None

    # -- the run directory ---------------------------------------------------------------------

    def lock(self) -> None:
        """Rank 0 takes the run dir's lock; a live holder, or a run.dir that cannot be created or
        written, fails every rank at start-up, by name. An explicit checkpoint.resume path that does
        not exist is refused first, so that nothing is created."""
        ckpt.check_resume_path(self.cfg.checkpoint.resume, self.run_dir)  # every rank alike, no collective
        error = None
        if is_rank_zero():
            try:
                self._lock = RunDirLock(self.run_dir).acquire()
            except RunDirLocked as caught:
                error = caught
            except OSError as caught:
                error = RunDirError(f"run.dir={self.run_dir} cannot be used: {describe_write_error(caught, self.run_dir)}"
                                    " (it must be a writable directory, or a path where one can be created)")
        raise_on_every_rank(error, RunDirError)

    def write_run_files(self) -> None:
        """train.log (the console log), on rank 0."""
        if is_rank_zero():
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._file_log = logging.FileHandler(self.run_dir / "train.log")
            self._file_log.addFilter(Rank0Filter())
            self._file_log.setFormatter(logging.Formatter("[%(asctime)s %(levelname)s] %(message)s", "%H:%M:%S"))
            logging.getLogger("ddptrain").addHandler(self._file_log)
        barrier()

    def write_config(self) -> None:
        """config.yaml (the resolved config), on rank 0: only once the launch is accepted (resumed
        or started afresh), so a refused launch leaves the run's config as it was."""
        if is_rank_zero():
            (self.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(self.cfg, resolve=True))

    def close(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        if self._file_log is not None:
            logging.getLogger("ddptrain").removeHandler(self._file_log)
            self._file_log.close()
            self._file_log = None

    # -- resume --------------------------------------------------------------------------------

    def saved_state(self) -> dict:
        """The trainer state of the checkpoint to resume from ({} for a fresh start), its config
        checked against ours and its changes said (unless nothing is left to do). A fresh start, or
        a resume from a checkpoint outside run.dir/checkpoints (another run's), moves an earlier
        run in the run dir aside first: one run dir never mixes two runs."""
        path = ckpt.agree_on_checkpoint(self.run_dir, self.cfg.checkpoint.resume)
        if path is None:
            self._move_previous_aside("checkpoint.resume=none" if self.cfg.checkpoint.resume == "none"
                                      else "no complete checkpoint could be resumed")
            return {}
        state = ckpt.load_trainer_state(path)
        state["path"] = path
        current = OmegaConf.to_container(self.cfg, resolve=True)
        defaults = {**defaults_of(TrainConfig), **model_defaults(current.get("model", {}))}
        self.config_changes = check_config(state.get("config", {}), current, defaults,
                                           fingerprinted=state.get("fingerprint") is not None)
        if state["step"] < self.last_step:  # else nothing is trained with them: not "applied"
            log_applied(self.config_changes)
        self._held[state["step"]] = Path(path)
        if not _is_inside(path, ckpt.checkpoint_dir(self.run_dir)):
            self._move_previous_aside(f"checkpoint.resume={path} is not one of its checkpoints")
        return state

    def _move_previous_aside(self, why: str) -> None:
        """Collective: rank 0 moves an earlier run in run.dir to previous/ while the other ranks
        wait; a move that fails (rolled back: rundir.move_previous_run_aside) fails every rank."""
        error = None
        if is_rank_zero():
            try:
                move_previous_run_aside(self.run_dir, why)
            except RunDirError as caught:
                error = caught
            except OSError as caught:  # before any move: listing run.dir
                error = RunDirError(f"run.dir={self.run_dir}: its earlier run could not be moved aside: "
                                    f"{describe_write_error(caught, self.run_dir)}")
        raise_on_every_rank(error, RunDirError)  # the barrier: no rank starts beside the earlier run

    def restore(self, state: dict, engine: Engine, samples_seen: Callable[[int], int], spec: ModelSpec) -> None:
        """Load the checkpoint `saved_state` found into `engine` and this rank's RNG; check the data
        cursor against the step (`samples_seen(step)`: the global-batch plan's count) and the base
        weights a LoRA adapter trains over against the ones `spec` was built on."""
        path = state["path"]
        check_base_weights(state.get("model_spec", {}), spec, path)
        saved_strategy = state.get("config", {}).get("strategy", {}).get("name")
        if ckpt.is_legacy(path) and saved_strategy != self.cfg.strategy.name:
            raise ckpt.CheckpointError(f"{path} was written by strategy={saved_strategy} before checkpoints were "
                                       f"strategy-neutral, in that strategy's own files; resume it once with "
                                       f"strategy={saved_strategy} (its next checkpoint resumes on any strategy), "
                                       f"then switch to strategy={self.cfg.strategy.name}")
        try:
            engine.load(ckpt.state_dir(path))
        except (ValueError, FileNotFoundError) as error:  # a checkpoint this world or strategy cannot read
            raise ckpt.CheckpointError(f"{path}: {error}") from error
        engine.load_progress_state_dict(state["engine"])
        if any(key in SCHEDULE_KEYS for key, _, _ in self.config_changes):
            reset_learning_rate(engine.lr_scheduler, self.cfg.optim.lr)
        step, cursor = state["step"], state["data"]
        if cursor["samples_seen"] != samples_seen(step):
            raise ckpt.CheckpointError(f"{path}: data cursor {cursor['samples_seen']} does not match step {step} "
                                       f"x batch.global_size {self.cfg.batch.global_size}; the global batch size "
                                       "must not change on resume")
        ckpt.load_rng_for_rank(path, self.dist.rank, self.dist.world_size, state["world_size"])
        self._check_horizon(state)
        self._move_newer_aside(step)
        log.info("resumed from %s at step %d (%d samples seen)", path, step, cursor["samples_seen"])

    def _move_newer_aside(self, step: int) -> None:
        """Collective, once the resume from `step` is accepted: run.dir's checkpoints and final/ of
        later steps are not this run's future. They are an abandoned trajectory's (a rollback:
        checkpoint.resume=PATH to an older checkpoint, say with another learning rate) or ones that
        did not verify (`auto` skipped them); left in place, a later `auto` would resume the newest
        of them and silently continue the abandoned trajectory. Rank 0 moves them to previous/<time>/
        while the other ranks wait (rundir.move_abandoned_aside: nothing is deleted)."""
        error = None
        if is_rank_zero():
            newer = [(saved, path) for saved, path in ckpt.list_checkpoints(self.run_dir) if saved > step]
            final_step = _final_step(self.run_dir)
            final = [final_dir(self.run_dir)] if final_step is not None and final_step > step else []
            try:
                if newer or final:
                    target = move_abandoned_aside(self.run_dir, [path for _, path in newer] + final)
                    log.warning("run.dir's checkpoints of steps (%s)%s come after step %d, the one this run "
                                "continues from (an abandoned trajectory's, or ones that did not verify): moved to "
                                "%s (nothing was deleted); checkpoint.resume=auto never resumes them",
                                ", ".join(str(saved) for saved, _ in newer) or "none",
                                f" and final/ of step {final_step}" if final else "", step, target)
            except RunDirError as caught:  # nothing moved, or each piece named (rundir._move_together)
                error = caught
            except OSError as caught:  # listing them
                error = RunDirError(f"the checkpoints after step {step} could not be moved aside: "
                                    f"{describe_write_error(caught, self.run_dir)}")
        raise_on_every_rank(error, RunDirError)  # the barrier: no rank trains before they are gone

    def _check_horizon(self, state: dict) -> None:
        """Resuming with another trainer.max_steps stretches the LR schedule unless optim.decay_steps fixes it."""
        saved = state.get("config", {})
        before = saved.get("optim", {}).get("decay_steps") or saved.get("trainer", {}).get("max_steps")
        now = decay_steps(self.cfg)
        if before is not None and before != now:
            log.warning("the LR schedule now runs over %d steps instead of %d (trainer.max_steps changed on resume); "
                        "set optim.decay_steps to keep one schedule across runs of different lengths", now, before)
        if state["step"] > self.cfg.trainer.max_steps:
            raise ckpt.CheckpointError(f"the checkpoint is at step {state['step']}, past trainer.max_steps="
                                       f"{self.cfg.trainer.max_steps}; raise trainer.max_steps, or start anew with "
                                       "checkpoint.resume=none or another run.dir")

    # -- checkpoints ---------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        return step == self.last_step or bool(self.every and step % self.every == 0)

    def save(self, step: int, engine: Engine, trainer_state: Callable[[], dict]) -> Path:
        """Collective. Non-finite weights are refused by Engine.save (the last good checkpoint stays);
        an error on any rank (non-finite weights, a full disk) fails every rank at once. With
        checkpoint.async_save the weights and optimizer state are written in the background and the
        checkpoint is committed by a later `poll` or `wait` (an earlier one still being written is
        committed first). A step this run already holds (a preemption right after its checkpoint)
        is not written again; any other checkpoint of that step in run.dir (one put there by hand: a
        resume moved the later ones aside) is moved aside and replaced, never taken for this run's."""
        self.wait()
        held = self._held.get(step)
        if held is not None and _is_same(held, ckpt.checkpoint_dir(self.run_dir) / ckpt.step_name(step)):
            return held
        state, error = None, None
        if is_rank_zero():
            try:
                state = trainer_state()
            except Exception as caught:  # noqa: BLE001 - the other ranks must not wait for rank 0
                error = caught
        raise_on_every_rank(error)
        failpoint = self.faults.in_checkpoint(step) if self.faults is not None else None
        if self.async_save and step != self.last_step:  # the last step's is waited for anyway: no gain
            self._pending = ckpt.start_checkpoint(self.run_dir, step, state, failpoint=failpoint,
                                                  save_state_async=lambda d: engine.save(d, background=True))
            return self._pending.final
        path = ckpt.write_checkpoint(self.run_dir, step, state, save_state=lambda d: engine.save(d),
                                     failpoint=failpoint)
        self._saved(step, path)
        return path

    def poll(self, step: int) -> None:
        """Collective, on every step: commit a background save once every rank's part is written
        (a one-number all-reduce while one is pending; nothing otherwise)."""
        if self._pending is not None and all_ranks(self._pending.done(), self.dist.device):
            self.wait()

    def wait(self) -> None:
        """Collective: commit the background save under way, if any (waiting for its writes)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._saved(pending.step, pending.commit())

    def _saved(self, step: int, path: Path) -> None:
        self._held[step] = path
        ckpt.purge(self.run_dir, self.cfg.checkpoint.keep, protect=path)
        log.info("checkpoint of step %d saved in %s", step, path)

    # -- final weights -------------------------------------------------------------------------

    def final_is_current(self, step: int) -> bool:
        """Collective: whether final/ holds this run's weights of this step: it verifies and names
        (by the sha256 of its COMPLETE.json) this run's checkpoint of the step, the one resumed from
        or saved. Rank 0 checks. A final/ of another trajectory at this step (a run resumed from an
        older checkpoint), or one written before final/ named its checkpoint, is rewritten; one that
        does not verify is said and rebuilt from this step's state."""
        decided = [False]
        if is_rank_zero() and _final_step(self.run_dir) == step:  # another step's: rewritten without hashing it
            try:
                meta = verify_final(final_dir(self.run_dir))
                checkpoint = self._checkpoint_sha256(step)
                decided[0] = checkpoint is not None and meta.get("checkpoint_sha256") == checkpoint
            except ckpt.CheckpointError as error:
                log.warning("%s: final/ is rebuilt from the state of step %d", error, step)
        if dist.is_initialized():
            dist.broadcast_object_list(decided, src=0)
        return decided[0]

    def save_final(self, step: int, engine: Engine, model: nn.Module, spec: ModelSpec, adapter: ModelAdapter) -> Path:
        """Collective: gathers the full weights (every strategy) and rank 0 writes run.dir/final/."""
        self.wait()
        path = final_dir(self.run_dir)
        if self.final_is_current(step):  # a relaunch with nothing left to do, after this run's final/
            return path
        state = engine.model_state_dict(trainable_only=not adapter.saves_frozen_weights(spec))  # LoRA: the adapter
        error = None
        if is_rank_zero():
            try:
                _check_finite(state, step, "final weights are not written and the previous ones are kept")
                files = adapter.tokenizer_files(OmegaConf.to_container(self.cfg.model, resolve=True),
                                                self.cfg.data.tokenizer)
                path = save_final(self.run_dir, model, state, spec, step, files,
                                  checkpoint_sha256=self._checkpoint_sha256(step),
                                  data=OmegaConf.to_container(self.cfg.data, resolve=True))
                log.info("final weights of step %d saved in %s (ddptrain.load_model(%r) reads them)",
                         step, path, str(self.run_dir))
            except FloatingPointError as caught:
                error = caught
            except OSError as caught:
                error = ckpt.CheckpointError(f"final weights of step {step} could not be written: "
                                             f"{describe_write_error(caught, path)}")
        raise_on_every_rank(error, ckpt.CheckpointError)
        return path

    def _checkpoint_sha256(self, step: int) -> str | None:
        """The sha256 of the COMPLETE.json of this run's checkpoint of `step` (None: it holds none)."""
        held = self._held.get(step)
        try:
            return sha256_file(held / ckpt.MARKER) if held is not None else None
        except OSError:
            return None


def _is_same(a: Path, b: Path) -> bool:
    return Path(a).resolve() == Path(b).resolve()


def _is_inside(path: Path, directory: Path) -> bool:
    return Path(path).resolve().is_relative_to(Path(directory).resolve())


def _final_step(run_dir: Path) -> int | None:
    try:
        return json.loads((final_dir(run_dir) / SPEC_FILE).read_text()).get("step")
    except (OSError, ValueError, AttributeError):
        return None


def _check_finite(weights: dict[str, torch.Tensor], step: int, consequence: str) -> None:
    bad = [name for name, value in weights.items() if value.is_floating_point() and not torch.isfinite(value).all()]
    if bad:
        raise FloatingPointError(f"step {step}: weights {bad[:3]} are not finite; {consequence}")


__all__ = ["Checkpointer"]
