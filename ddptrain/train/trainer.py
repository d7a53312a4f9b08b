"""The loop, as a table of contents: build, then step after step, each component on its own schedule.

    run dir       lock, train.log, config.yaml, the checkpoint resumed from (runs/rundir.py)
    builder       data, model (through its adapter), optimizer, schedule, engine (train/builder.py)
    components    evaluator, metrics, checkpointer: asked after every step (train/components.py)
      evaluator     validation loss                                       (train/evaluator.py)
      tasks         multiple-choice task accuracy                         (train/tasks.py)
      stopping      early stopping and best/ weights                      (train/early_stopping.py)
      metrics       metrics.jsonl, console, wandb, throughput             (train/metrics.py)
      checkpointer  checkpoints on their schedule, resume, final weights  (train/checkpointer.py)
      trackers      TensorBoard, MLflow                                   (train/trackers.py)
    preemption    signals -> checkpoint at the next step boundary        (train/preemption.py)
    faults        failpoints for the crash tests, only when set         (train/faults.py)

Step statistics stay on the device until a component that reads the step (a log, eval or
checkpoint step) or a preemption needs them (`_read_steps`), so steps that nobody looks at never
wait for the device.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from ddptrain.config.schema import TrainConfig
from ddptrain.data.mixture import MixturePlan
from ddptrain.data.prefetch import Prefetcher, pin_memory_available
from ddptrain.distributed import DistInfo
from ddptrain.engine.equivalence import log_equivalence_caveats
from ddptrain.engine.objective import Objective
from ddptrain.engine.stats import StepStats
from ddptrain.runs.fingerprint import check_fingerprint, run_fingerprint
from ddptrain.runs.rundir import RunDir
from ddptrain.train import builder
from ddptrain.train.checkpointer import Checkpointer
from ddptrain.train.components import Component, StepEnd
from ddptrain.train.early_stopping import BestWeights, EarlyStopping
from ddptrain.train.evaluator import Evaluator
from ddptrain.train.faults import FaultInjector
from ddptrain.train.flops import ModelFlops, device_peak_flops
from ddptrain.train.metrics import (MetricsLogger, ThroughputWindow, exit_code_of_current_exception,
                                   peak_memory_bytes)
from ddptrain.train.preemption import Preempted, PreemptionWatcher
from ddptrain.train.summary import log_rl_summary, log_summary
from ddptrain.train.tasks import TaskScorer
from ddptrain.train.trackers import trackers_from_config

log = logging.getLogger(__name__)


class EmptyStepError(RuntimeError):
    """A global batch had no valid target token and trainer.empty_step=stop."""


@dataclass
class TrainState:
    """The loop's counters (a checkpoint's trainer state holds them under these names)."""

    step: int = 0
    """Optimizer steps done."""
    tokens_seen: int = 0
    """Valid target tokens trained on (the sum of every step's N_t)."""
    filler_microbatches: int = 0
    """Microbatches run by ranks with fewer of them (strategies that communicate in every microbatch)."""

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "filler_microbatches": self.filler_microbatches}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.filler_microbatches = state.get("filler_microbatches", 0)


class Trainer:
    """Builds a run from a validated config and fits it."""

    def __init__(self, cfg: TrainConfig, dist_info: DistInfo):
        self.cfg = cfg
        self.dist = dist_info
        self.state = TrainState()
        self.faults = FaultInjector.from_env(dist_info.rank, cfg.run.dir)  # None unless DDPTRAIN_FAILPOINT is set
        self.run_dir = RunDir(cfg)
        self.built: builder.Built | None = None
        self.checkpointer: Checkpointer | None = None
        self.evaluator: Evaluator | None = None
        self.metrics: MetricsLogger | None = None
        self.preemption: PreemptionWatcher | None = None
        self.tasks: TaskScorer | None = None
        self.stopping: EarlyStopping | None = None
        self.best: BestWeights | None = None
        self.trackers: list = []
        self.components: list[Component] = []  # asked after every step, in this order
        self._unread: list[tuple[int, StepStats]] = []
        self.fingerprint: dict = {}
        self._started = time.perf_counter()

    @property
    def step(self) -> int:
        return self.state.step

    @property
    def engine(self):
        return self.built.engine

    @property
    def train_batches(self):
        return self.built.batches

    # -- build ---------------------------------------------------------------------------------

    def build(self) -> "Trainer":
        cfg = self.cfg
        self._started = time.perf_counter()
        self.run_dir.lock()
        if self.dist.device.type == "cuda" and cfg.trainer.precision == "fp32":
            torch.set_float32_matmul_precision("high")  # TF32 matmuls: fp32 runs use the tensor cores
        builder.resolve_tokenizer(cfg)  # before the config diff: checkpoints hold the resolved config
        layout = builder.resolve_layout(cfg)
        saved = self.run_dir.saved_state()
        self.run_dir.write_run_files()
        if layout is not None:
            log.info("layout: %s", layout)  # into train.log too
        self._memory_baseline = peak_memory_bytes(self.dist.device)  # what the run's own memory is measured from
        self.built = builder.build(cfg, self.dist)
        log_equivalence_caveats(self.built.model)  # batch-dependent or stochastic modules: rank 0 warns once
        self._fingerprint_inputs(saved)
        self.checkpointer = Checkpointer(cfg, self.run_dir, self.dist, self.built, self.trainer_state, self.faults)
        if saved:
            self.checkpointer.restore(saved)
            self.state.load_state_dict(saved)
        if self.step < cfg.trainer.max_steps:  # with nothing left to do, config.yaml stays what the run trained with
            self.run_dir.write_config()  # the launch is accepted
        if self.built.rl is not None:  # objective=grpo: its step's counter resumes with the run
            self.built.rl.load_state_dict(saved.get("rl") if saved else None)
        self.evaluator = Evaluator.from_config(self.built.data.val, cfg, self.dist, self.engine,
                                               self.built.reference) if self.built.rl is None else None
        peak_flops = device_peak_flops(self.dist.device, cfg.trainer.precision, cfg.logger.peak_flops)
        flops = ModelFlops.of_module(self.built.model, self.engine.chunked_head,
                                     one_value_per_row=not isinstance(self.engine.objective, Objective))
        window = ThroughputWindow(flops, peak_flops, self.dist.world_size)
        self.metrics = MetricsLogger.from_config(cfg, window, run_id=saved.get("wandb_run_id"),
                                                 resume_step=self.step if saved else None)
        self.preemption = PreemptionWatcher(list(cfg.checkpoint.preempt_signals), self.dist.device,
                                            grace_s=cfg.checkpoint.preempt_grace_s,
                                            check_every=cfg.checkpoint.preempt_check_every)
        if self.evaluator is not None:
            self._build_evaluation(saved)
        else:  # objective=grpo: no validation split (config/validation.py refuses evaluation keys)
            self.trackers = trackers_from_config(cfg, self.step if saved else None)
        # The order is what each leaves for the next: the eval's numbers go to the stopping rules and
        # the metrics line, the metrics line to the trackers.
        evaluation = [part for part in (self.evaluator, self.tasks, self.stopping, self.best) if part is not None]
        self.components = [*evaluation, self.metrics, self.checkpointer, *self.trackers]
        if self.built.rl is None:
            log_summary(cfg, self.dist, self.built, self.metrics, self.step, sampled=self.train_batches.examples)
        else:
            log_rl_summary(cfg, self.dist, self.built, self.step)
        return self

    def _build_evaluation(self, saved: dict) -> None:
        """Task scoring, early stopping, best/ and the trackers; stopping and best/ resume their state."""
        cfg = self.cfg
        self.tasks = TaskScorer.from_config(cfg, self.dist, self.engine, self.evaluator.should_run)
        self.stopping = EarlyStopping.from_config(cfg)
        self.best = BestWeights.from_config(cfg, self.checkpointer.save_best)
        evaluation = saved.get("evaluation", {}) if saved else {}
        for name, part in (("early_stopping", self.stopping), ("best", self.best)):
            if part is not None:
                part.load_state_dict(evaluation.get(name))
        if self._stopped_early():  # a relaunch, whatever its trainer.max_steps, trains no further
            log.warning("this run stopped early at step %d (%s) and a relaunch trains no further, whatever "
                        "trainer.max_steps (now %d); its weights are in final/. To train on, start a new run: another "
                        "run.dir, or checkpoint.resume=none here (this run moves aside to previous/)", self.step,
                        self.stopping.stopped, cfg.trainer.max_steps)
        self.trackers = trackers_from_config(cfg, self.step if saved else None)

    def _fingerprint_inputs(self, saved: dict) -> None:
        """The run's inputs beyond its config (model=hf's config.json, the corpus), for checkpoints;
        on resume compared with the checkpoint's (a difference is refused by name, or a changed
        corpus accepted with checkpoint.accept_changed_data). Its cost is logged."""
        started = time.perf_counter()
        model_cfg = OmegaConf.to_container(self.cfg.model, resolve=True)
        reference = self.built.reference.weights if self.built.reference is not None else None
        self.fingerprint = run_fingerprint(self.built.adapter.architecture(model_cfg), self.built.data.fingerprint,
                                           reference)
        if saved:
            check_fingerprint(saved.get("fingerprint"), self.fingerprint, self.cfg.checkpoint.accept_changed_data)
        log.info("inputs fingerprinted%s in %.2f ms (%.3f%% of start-up so far)", " and compared" if saved else "",
                 1e3 * (time.perf_counter() - started),
                 100 * (time.perf_counter() - started) / (time.perf_counter() - self._started))

    # -- fit -----------------------------------------------------------------------------------

    def fit(self) -> None:
        """Step after step up to trainer.max_steps; after each, every component does what its schedule
        says, off the preemption watchdog's clock, and the preemption decides whether the ranks stop."""
        max_steps = self.cfg.trainer.max_steps
        pin = pin_memory_available(self.dist.device) and self.built.rl is None  # GRPO's steps take prompts
        with Prefetcher(self.train_batches, max_steps, pin) as batches:
            while self.step < max_steps and not self._stopped_early():
                end = self._train_step(batches)
                self.preemption.at_step_end(end, saves=self.checkpointer.saves(end.step))  # before the saves
                read = any(component.reads(end) for component in self.components)
                if read:
                    self._read_steps()  # waits for the device: only on the steps someone reads
                self.metrics.step_done(end.step, end.stats.loss if read else None)
                with self.preemption.unhurried():  # progress: a signal now waits for them, and is asked after
                    for component in self.components:
                        component.on_step_end(end)
                if self.preemption.stops(end):
                    self._preempt(end)
                if end.stop:
                    self._stop_early(end)
        for component in self.components:
            component.on_fit_end(self.step)

    def _stopped_early(self) -> bool:
        return self.stopping is not None and self.stopping.stopped is not None

    def _stop_early(self, end: StepEnd) -> None:
        """Checkpoint this step (its state says the run stopped, so a relaunch trains no further); the
        loop then ends and final/ is written as at trainer.max_steps."""
        if end.saved is None:
            self.checkpointer.save(self.step, last=True)
        log.info("%s; the run ends at step %d of %d", end.stop, self.step, self.cfg.trainer.max_steps)

    def _train_step(self, batches: Prefetcher) -> StepEnd:
        """Engine.step on this rank's microbatches, with the step named in any collective failure
        (a dead or stuck peer); the step is then done, its statistics still on the device."""
        step, rank = self.step + 1, self.dist.rank
        lr = self.built.optimizer.param_groups[0]["lr"]  # the rate this step applies
        microbatches, data_wait_s = batches.get(self.step)
        if self.built.rl is not None:
            return self._rl_step(microbatches, data_wait_s, lr)
        most = max(len(micro) for micro in self.train_batches.layout(self.step))
        faults = self.faults.around_step(step, self.engine.model) if self.faults else contextlib.nullcontext()
        if self.built.reference is not None:  # objective=dpo: the reference's log-probs, without gradients
            microbatches = self.built.reference.fill(microbatches, most)
        try:
            with faults:
                stats = self.engine.step(microbatches, max_microbatches=most)
        except RuntimeError as error:  # gloo reports timeouts and lost peers as RuntimeError
            hint = ""
            peer_words = ("gloo", "NCCL", "Timed out", "Connection")
            if isinstance(error, dist.DistError) or any(word in str(error) for word in peer_words):
                hint = f" (a dead or stuck peer fails the run after dist.timeout_s={self.cfg.dist.timeout_s}s)"
            raise RuntimeError(f"step {step} failed on rank {rank}: {error}{hint}") from error
        self.metrics.window.add(stats, data_wait_s, self.train_batches.global_shapes(self.step),
                                self.train_batches.global_positions(self.step))
        self.state.step = step
        self._unread.append((step, stats))
        return StepEnd(step, step == self.cfg.trainer.max_steps, stats, lr,
                       counters=lambda: {**self._counters(), **self._mixture_figures(step, stats)})

    def _rl_step(self, prompts: list, data_wait_s: float, lr: float) -> StepEnd:
        """objective=grpo: this rank's prompts -> rollouts -> rewards -> advantages -> the update
        (ddptrain/rl/step.py); its rollout metrics ride on the StepEnd to metrics.jsonl."""
        step = self.step + 1
        faults = self.faults.around_step(step, self.engine.model) if self.faults else contextlib.nullcontext()
        with faults:
            result = self.built.rl.step(self.step, prompts)
        self.metrics.window.add(result.stats, data_wait_s, result.shapes, result.positions)
        self.state.step = step
        self._unread.append((step, result.stats))
        return StepEnd(step, step == self.cfg.trainer.max_steps, result.stats, lr, counters=self._counters,
                       rollout=result.metrics)

    def _read_steps(self) -> None:
        """Read the steps since the last read (this waits for the device): counters, skips, policies."""
        for step, stats in self._unread:
            self.state.tokens_seen += stats.tokens
            self.state.filler_microbatches += stats.filler_microbatches
            if stats.skipped:
                if stats.reason == "no_valid_tokens" and self.cfg.trainer.empty_step == "stop":
                    raise EmptyStepError(f"step {step}: the global batch has no valid target token "
                                         "(trainer.empty_step=stop)")
                log.warning("step %d skipped: %s", step, "the global batch holds no valid target token (N_t = 0)"
                            if stats.reason == "no_valid_tokens" else f"non-finite gradient norm {stats.grad_norm}")
        self._unread = []

    def _counters(self) -> dict:
        """The run's counters for a metrics line, read when it is written."""
        counters = {
            "tokens_seen": self.state.tokens_seen,
            "peak_memory_bytes": peak_memory_bytes(self.dist.device),
            "memory_baseline_bytes": self._memory_baseline,
            "skipped_steps": self.engine.skipped_steps,
            "filler_microbatches": self.state.filler_microbatches,
            "samples_seen": self.train_batches.plan.samples_seen(self.step),
            "world_size": self.dist.world_size,
        }
        if self.engine.loss_scale is not None:
            counters["loss_scale"] = float(self.engine.loss_scale.scale)
        return counters

    def _mixture_figures(self, step: int, stats: StepStats) -> dict:
        """data=mixture: mix/<source>/targets, share, epoch, exhausted and loss/<source> of `step`."""
        plan = self.train_batches.plan
        return plan.figures(step, stats.metric_sums or [stats.loss]) if isinstance(plan, MixturePlan) else {}

    def _preempt(self, end: StepEnd) -> None:
        """Checkpoint this step (unless its scheduled checkpoint was just written) and exit. The
        checkpointer logs "checkpoint of step N saved" once; this line only says why the run stops."""
        self._read_steps()
        name = self.preemption.signal_name()
        saved = end.saved if end.saved is not None else self.checkpointer.save(self.step)
        self.checkpointer.save_final(self.step)
        code = self.cfg.checkpoint.preempt_exit_code
        log.warning("preempted by %s at step %d (resumes from %s); exiting with code %d",
                    name, self.step, saved.name, code)
        raise Preempted(code)

    def trainer_state(self) -> dict:
        """What a checkpoint holds besides weights and optimizer state (rank 0 writes it)."""
        return {
            **self.state.state_dict(),
            "engine": self.engine.progress_state_dict(),  # weights and optimizer: state/, Engine.save
            "data": self.train_batches.state_dict(self.step),
            "wandb_run_id": self.metrics.run_id,
            "world_size": self.dist.world_size,
            "config": OmegaConf.to_container(self.cfg, resolve=True),
            "model_spec": self.built.spec.to_dict(),
            "fingerprint": self.fingerprint,  # compared on resume (ddptrain/runs/fingerprint.py)
            "rl": self.built.rl.state_dict() if self.built.rl is not None else None,
            "evaluation": {"early_stopping": self.stopping.state_dict() if self.stopping else None,
                           "best": self.best.state_dict() if self.best else None},
        }

    # -- close ---------------------------------------------------------------------------------

    def close(self) -> None:
        if self.preemption is not None:
            self.preemption.restore()
        if self.built is not None:
            self.built.engine = None  # drop the wrapped model before the process group is destroyed
        if self.evaluator is not None:
            self.evaluator.engine = None
        if self.tasks is not None:
            self.tasks.engine = None
        if self.metrics is not None:
            self.metrics.close()
        for tracker in self.trackers:
            tracker.close(exit_code_of_current_exception())
        self.run_dir.close()  # the lock and train.log
