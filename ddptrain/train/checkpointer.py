"""The checkpointer: the training loop's component that saves the run on its schedule and restores
it, through the engine, and writes the final weights at the end.

The run directory itself (lock, train.log, config.yaml, which checkpoint a launch continues from,
moving earlier runs aside) is ddptrain/runs/rundir.py; the checkpoint format (markers, hashes, RNG
per rank, purging) is ddptrain/runs/store.py; final/ is ddptrain/runs/weights.py. This component
decides when they run (checkpoint.every steps, the last step, a preemption) and keeps every rank in
step with rank 0.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from ddptrain.config.schema import TrainConfig
from ddptrain.distributed import DistInfo, all_ranks, is_rank_zero, raise_on_every_rank
from ddptrain.fsutil import describe_write_error, sha256_file
from ddptrain.runs import store as ckpt
from ddptrain.runs.resume import SCHEDULE_KEYS, check_base_weights, reset_learning_rate
from ddptrain.runs.rundir import RunDir
from ddptrain.runs.weights import BEST, FINAL, save_final, verify_final
from ddptrain.train.builder import Built, decay_steps
from ddptrain.train.components import StepEnd
from ddptrain.train.faults import FaultInjector

log = logging.getLogger(__name__)


class Checkpointer:
    """Saves every checkpoint.every steps and at the last step, or when told to (a preemption);
    final weights at the end of the fit. A component of the loop (train/components.py)."""

    def __init__(self, cfg: TrainConfig, run_dir: RunDir, dist_info: DistInfo, built: Built,
                 trainer_state: Callable[[], dict], faults: FaultInjector | None = None):
        self.cfg = cfg
        self.run_dir = run_dir
        self.dist = dist_info
        self.built = built
        self.trainer_state = trainer_state  # what a checkpoint holds besides weights and optimizer state
        self.every = cfg.checkpoint.every
        self.last_step = cfg.trainer.max_steps
        self.faults = faults
        self.async_save = cfg.checkpoint.async_save
        self._pending: ckpt.PendingCheckpoint | None = None
        self._held: dict[int, Path] = {}  # step -> the checkpoint of this run: the one resumed from, each one saved
        self._stepped = False  # whether this launch trained a step

    # -- resume --------------------------------------------------------------------------------

    def restore(self, state: dict) -> None:
        """Load the checkpoint `RunDir.saved_state` found into the engine and this rank's RNG; check
        the data cursor against the step (the global-batch plan's count) and the base weights a LoRA
        adapter trains over against the ones the model was built on."""
        path, engine = state["path"], self.built.engine
        check_base_weights(state.get("model_spec", {}), self.built.spec, path)
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
        if any(key in SCHEDULE_KEYS for key, _, _ in self.run_dir.config_changes):
            reset_learning_rate(engine.lr_scheduler, self.cfg.optim.lr)
        step, cursor = state["step"], state["data"]
        if cursor["samples_seen"] != self.built.batches.plan.samples_seen(step):
            raise ckpt.CheckpointError(f"{path}: data cursor {cursor['samples_seen']} does not match step {step} "
                                       f"x batch.global_size {self.cfg.batch.global_size}; the global batch size "
                                       "must not change on resume")
        self.built.batches.load_state_dict(cursor, step, self.cfg.data.order)  # its order, a mixture's positions
        ckpt.load_rng_for_rank(path, self.dist.rank, self.dist.world_size, state["world_size"])
        self._check_horizon(state)
        self._held[step] = Path(path)
        self.run_dir.move_newer_aside(step)
        log.info("resumed from %s at step %d (%d samples seen)", path, step, cursor["samples_seen"])

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

    # -- checkpoints: a component of the loop ----------------------------------------------------

    def saves(self, step: int) -> bool:
        """Whether `step` is a checkpoint step: every checkpoint.every steps, and the last."""
        return step == self.last_step or bool(self.every and step % self.every == 0)

    def reads(self, end: StepEnd) -> bool:
        return self.saves(end.step)  # a checkpoint holds the counters the step's numbers update

    def on_step_end(self, end: StepEnd) -> None:
        """The step's checkpoint, on its schedule (`end.saved`), then a background save committed
        once every rank has written it."""
        self._stepped = True
        if self.saves(end.step):
            end.saved = self.save(end.step, last=end.last)
        self.poll(end.step)

    def on_fit_end(self, step: int) -> None:
        """The final weights; on a launch that had nothing left to train, says so."""
        self.save_final(step)
        if not self._stepped and step >= self.last_step:  # an early-stopped run: the trainer said why at start-up
            log.info("nothing to do: this run already finished at step %d (trainer.max_steps=%d); its weights are in "
                     "%s; raise trainer.max_steps to train on", step, self.last_step, self.run_dir.final)

    def save(self, step: int, last: bool = False) -> Path:
        """Collective. Non-finite weights are refused by Engine.save (the last good checkpoint stays);
        an error on any rank (non-finite weights, a full disk) fails every rank at once. With
        checkpoint.async_save the weights and optimizer state are written in the background and the
        checkpoint is committed by a later `poll` or `wait` (an earlier one still being written is
        committed first), except on the `last` step, whose checkpoint is waited for anyway. A step
        this run already holds (a preemption right after its checkpoint) is not written again; any
        other checkpoint of that step in run.dir (one put there by hand: a resume moved the later
        ones aside) is moved aside and replaced, never taken for this run's."""
        self.wait()
        held = self._held.get(step)
        if held is not None and _is_same(held, self.run_dir.checkpoints / ckpt.step_name(step)):
            return held
        state, error = None, None
        if is_rank_zero():
            try:
                state = self.trainer_state()
            except Exception as caught:  # noqa: BLE001 - the other ranks must not wait for rank 0
                error = caught
        raise_on_every_rank(error)
        failpoint = self.faults.in_checkpoint(step) if self.faults is not None else None
        engine = self.built.engine
        if self.async_save and not last:
            self._pending = ckpt.start_checkpoint(self.run_dir.path, step, state, failpoint=failpoint,
                                                  save_state_async=lambda d: engine.save(d, background=True))
            return self._pending.final
        path = ckpt.write_checkpoint(self.run_dir.path, step, state, save_state=lambda d: engine.save(d),
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
        ckpt.purge(self.run_dir.path, self.cfg.checkpoint.keep, protect=path)
        log.info("checkpoint of step %d saved in %s", step, path)

    # -- final weights -------------------------------------------------------------------------

    def final_is_current(self, step: int) -> bool:
        """Collective: whether final/ holds this run's weights of this step: it verifies and names
        (by the sha256 of its COMPLETE.json) this run's checkpoint of the step, the one resumed from
        or saved. Rank 0 checks. A final/ of another trajectory at this step (a run resumed from an
        older checkpoint), or one written before final/ named its checkpoint, is rewritten; one that
        does not verify is said and rebuilt from this step's state."""
        decided = [False]
        if is_rank_zero() and self.run_dir.final_step() == step:  # another step's: rewritten without hashing it
            try:
                meta = verify_final(self.run_dir.final)
                checkpoint = self._checkpoint_sha256(step)
                decided[0] = checkpoint is not None and meta.get("checkpoint_sha256") == checkpoint
            except ckpt.CheckpointError as error:
                log.warning("%s: final/ is rebuilt from the state of step %d", error, step)
        if dist.is_initialized():
            dist.broadcast_object_list(decided, src=0)
        return decided[0]

    def save_final(self, step: int) -> Path:
        """Collective: gathers the full weights (every strategy) and rank 0 writes run.dir/final/."""
        self.wait()
        if self.final_is_current(step):  # a relaunch with nothing left to do, after this run's final/
            return self.run_dir.final
        return self.write_weights(step, FINAL)

    def save_best(self, step: int) -> Path:
        """Collective: this step's full weights into run.dir/best/ (checkpoint.keep_best)."""
        self.wait()
        return self.write_weights(step, BEST)

    def write_weights(self, step: int, name: str) -> Path:
        """Collective: gathers the full weights (every strategy); rank 0 writes run.dir/`name`/ (final/'s format)."""
        path = self.run_dir.path / name
        built, cfg = self.built, self.cfg
        state = built.engine.model_state_dict(trainable_only=not built.adapter.saves_frozen_weights(built.spec))  # LoRA
        error = None
        if is_rank_zero():
            try:
                _check_finite(state, step, f"{name} weights are not written and the previous ones are kept")
                files = built.adapter.tokenizer_files(OmegaConf.to_container(cfg.model, resolve=True),
                                                      cfg.data.tokenizer)
                path = save_final(self.run_dir.path, built.model, state, built.spec, step, files,
                                  checkpoint_sha256=self._checkpoint_sha256(step),
                                  data=OmegaConf.to_container(cfg.data, resolve=True), name=name)
                if name == FINAL:
                    log.info("final weights of step %d saved in %s (ddptrain.load_model(%r) reads them)",
                             step, path, str(self.run_dir.path))
            except FloatingPointError as caught:
                error = caught
            except OSError as caught:
                error = ckpt.CheckpointError(f"{name} weights of step {step} could not be written: "
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


def _check_finite(weights: dict[str, torch.Tensor], step: int, consequence: str) -> None:
    bad = [name for name, value in weights.items() if value.is_floating_point() and not torch.isfinite(value).all()]
    if bad:
        raise FloatingPointError(f"step {step}: weights {bad[:3]} are not finite; {consequence}")


__all__ = ["Checkpointer"]
