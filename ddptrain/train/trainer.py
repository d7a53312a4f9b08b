"""The loop: build the pieces from config, fit, evaluate, close."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch import nn

from ddptrain.train import checkpoint as ckpt
from ddptrain.train import faults
from ddptrain.config.schema import TrainConfig, grad_accum_steps, strategy_options
from ddptrain.data import DataSplits, TrainBatches, load_splits
from ddptrain.data.dataset import TokenExamples
from ddptrain.data.prefetch import Prefetcher, pin_memory_available
from ddptrain.distributed import DistInfo, Rank0Filter, all_reduce_sum, barrier, is_rank_zero, raise_on_every_rank
from ddptrain.engine.engine import Engine, StepStats
from ddptrain.train.flops import ModelFlops, device_peak_flops
from ddptrain.fsutil import describe_write_error
from ddptrain.train.metrics import MetricsLogger, ThroughputWindow, peak_memory_bytes
from ddptrain.models.compiling import compile_model
from ddptrain.models.build import ModelError, accepts_packed_rows, build_model, num_parameters
from ddptrain.models.memory import enable_activation_checkpointing
from ddptrain.engine.objective import IGNORE_INDEX, Objective, token_loss_sum
from ddptrain.train.optim import build_optimizer, build_scheduler
from ddptrain.train.preemption import Preempted, PreemptionWatcher
from ddptrain.train.resume import SCHEDULE_KEYS, check_config, defaults_of, reset_learning_rate
from ddptrain.train.rundir import RunDirLock, RunDirLocked, move_previous_run_aside
from ddptrain.verify import log_equivalence_caveats
from ddptrain.train.final import SPEC_FILE, save_final

log = logging.getLogger(__name__)


class EmptyStepError(RuntimeError):
    """A global batch had no valid target token and trainer.empty_step=stop."""


class Trainer:
    """Builds data, model, optimizer and engine from a validated config; runs the loop."""

    def __init__(self, cfg: TrainConfig, dist_info: DistInfo):
        self.cfg = cfg
        self.dist = dist_info
        self.run_dir = Path(cfg.run.dir)
        self.step = 0
        self.tokens_seen = 0
        self.filler_microbatches = 0  # run by ranks with fewer microbatches (strategies that need them)
        self._unread: list[tuple[int, StepStats]] = []
        self._file_log: logging.Handler | None = None
        self._watcher: PreemptionWatcher | None = None
        self._lock: RunDirLock | None = None
        self._config_changes: list = []

    # -- build ---------------------------------------------------------------------------------

    def build(self) -> "Trainer":
        cfg = self.cfg
        self._lock_run_dir()
        if self.dist.device.type == "cuda" and cfg.trainer.precision == "fp32":
            torch.set_float32_matmul_precision("high")  # TF32 matmuls: fp32 runs use the tensor cores
        self._resolve_tokenizer()
        saved = self._saved_state()
        self._write_run_dir()
        torch.manual_seed(cfg.run.seed)
        self.data = self._build_data()
        self.train_batches = TrainBatches(self.data.train, cfg.batch.global_size, cfg.batch.micro_size,
                                          cfg.run.seed, self.dist.rank, self.dist.world_size,
                                          micro_tokens=cfg.batch.micro_tokens, pack=cfg.batch.pack,
                                          seq_len=cfg.batch.seq_len)
        model = self._build_model()
        log_equivalence_caveats(model)  # batch-dependent or stochastic modules: rank 0 warns once
        optimizer = build_optimizer(model, cfg.optim.name, cfg.optim.lr, cfg.optim.weight_decay, tuple(cfg.optim.betas))
        scheduler = build_scheduler(optimizer, cfg.optim.schedule, cfg.optim.warmup_steps, self.decay_steps,
                                    cfg.optim.min_lr_ratio)
        varies = cfg.batch.micro_tokens is not None or cfg.batch.pack  # microbatches per step vary by step and rank
        layout = {"micro_batch_size": cfg.batch.micro_size,
                  "grad_accum_steps": 1 if varies else grad_accum_steps(cfg.batch.global_size, cfg.batch.micro_size,
                                                                        self.dist.world_size)}
        objective = Objective(label_smoothing=cfg.objective.label_smoothing, z_loss=cfg.objective.z_loss)
        self.engine = Engine(model, optimizer, cfg.strategy.name, grad_clip=cfg.trainer.grad_clip,
                             lr_scheduler=scheduler, precision=cfg.trainer.precision, nonfinite=cfg.trainer.nonfinite,
                             device=self.dist.device, strategy_options={**strategy_options(cfg.strategy), **layout},
                             objective=objective)
        self.optimizer = optimizer
        resumed = self._resume(saved)
        self._check_horizon(resumed)
        self.metrics = MetricsLogger(self.run_dir, cfg.logger.wandb.mode, cfg.logger.wandb.project,
                                     cfg.logger.wandb.name, OmegaConf.to_container(cfg, resolve=True),
                                     run_id=resumed.get("wandb_run_id"), resume_step=self.step if resumed else None,
                                     progress=cfg.logger.progress, max_steps=cfg.trainer.max_steps,
                                     window=ThroughputWindow(ModelFlops.of_module(model), device_peak_flops(
                                         self.dist.device, cfg.trainer.precision, cfg.logger.peak_flops),
                                         self.dist.world_size))
        self._watcher = PreemptionWatcher(list(cfg.checkpoint.preempt_signals), self.dist.device,
                                          grace_s=cfg.checkpoint.preempt_grace_s)
        self._log_summary()
        return self

    @property
    def decay_steps(self) -> int:
        """The LR schedule's length: optim.decay_steps, else trainer.max_steps."""
        return self.cfg.optim.decay_steps or self.cfg.trainer.max_steps

    def _resolve_tokenizer(self) -> None:
        """data.tokenizer=null: model=hf's own tokenizer.json when its directory has one, else bytes."""
        data, model = self.cfg.data, self.cfg.model
        if data.tokenizer is None:
            found = None
            if model.get("name") == "hf" and "_target_" not in model:
                from ddptrain.models.hf import tokenizer_file

                found = tokenizer_file(model.path)
            data.tokenizer = str(found) if found is not None else "byte"

    def _build_model(self) -> nn.Module:
        cfg = self.cfg
        torch.manual_seed(cfg.run.seed)  # the same initial weights on every rank
        model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
        model, self.model_spec = build_model(model_cfg, self.data.vocab_size, cfg.batch.seq_len)
        self.unwrapped_model = model
        self.num_parameters = num_parameters(model)
        if cfg.batch.pack:
            if self.model_spec.kind == "hf":
                from ddptrain.models.hf import check_packing

                check_packing(model)
            elif not accepts_packed_rows(model):
                raise ModelError(f"batch.pack=true needs a model whose forward takes positions= and segments= "
                                 f"(attention inside each document); {type(model).__name__}.forward does not; "
                                 "use batch.pack=false")
        if self.model_spec.kind == "hf":
            from ddptrain.models.hf import max_positions

            limit = max_positions(model)
            if limit is not None and cfg.batch.seq_len > limit:
                raise ModelError(f"batch.seq_len={cfg.batch.seq_len} exceeds the model's context of {limit} "
                                 f"positions (model.path={cfg.model.path})")
        if cfg.trainer.activation_checkpointing:
            enable_activation_checkpointing(model, self.model_spec)
        if cfg.trainer.compile:
            compile_model(model)  # after check_packing's eager forward
        return model

    def _write_run_dir(self) -> None:
        if is_rank_zero():
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(self.cfg, resolve=True))
            self._file_log = logging.FileHandler(self.run_dir / "train.log")
            self._file_log.addFilter(Rank0Filter())
            self._file_log.setFormatter(logging.Formatter("[%(asctime)s %(levelname)s] %(message)s", "%H:%M:%S"))
            logging.getLogger("ddptrain").addHandler(self._file_log)
        barrier()

    def _build_data(self) -> DataSplits:
        cfg = self.cfg
        started = time.perf_counter()
        # Local rank 0 of each node preprocesses into the shared cache; the other ranks wait for it.
        data = load_splits(cfg.data, cfg.batch.seq_len, local_rank=self.dist.local_rank)
        log.info("data: %d train documents -> %d examples (%d valid targets), %d validation examples, %.1fs",
                 data.train.documents, len(data.train), data.train.valid_targets(), len(data.val),
                 time.perf_counter() - started)
        return data

    def _log_summary(self) -> None:
        """The start-up summary on rank 0 (one line per topic, so Slurm logs stay greppable)."""
        cfg, d, train = self.cfg, self.dist, self.data.train
        nodes = max(d.world_size // int(os.environ.get("LOCAL_WORLD_SIZE", d.world_size)), 1)
        if d.device.type == "cuda":
            device = f"{torch.cuda.get_device_name(d.device)} ({d.backend})"
        else:
            device = f"cpu, {torch.get_num_threads()} threads per rank ({d.backend})"
        window = self.metrics.window
        peak = f"{window.peak_flops:.3g} FLOP/s per device" if window.peak_flops else "unknown (MFU not reported)"
        mean_targets = train.valid_targets() / len(train)
        log.info("world: %d rank(s) on %d node(s) | device: %s | peak %s", d.world_size, nodes, device, peak)
        if cfg.batch.micro_tokens is None and not cfg.batch.pack:
            accum = grad_accum_steps(cfg.batch.global_size, cfg.batch.micro_size, d.world_size)
            layout = f"micro {cfg.batch.micro_size} x accumulation {accum} x world {d.world_size}"
        else:
            budget = (f"microbatches of <= {cfg.batch.micro_tokens} padded tokens" if cfg.batch.micro_tokens
                      else f"{cfg.batch.micro_size} rows per microbatch")
            layout = f"{'packed rows of ' + str(cfg.batch.seq_len) + ' tokens, ' if cfg.batch.pack else ''}{budget}, world {d.world_size}"
        log.info("strategy: %s | precision %s | global batch %d sequences = %s",
                 cfg.strategy.name, cfg.trainer.precision, cfg.batch.global_size, layout)
        log.info("tokens per step: up to %d (seq_len %d), about %.0f valid targets on average",
                 cfg.batch.global_size * cfg.batch.seq_len, cfg.batch.seq_len, cfg.batch.global_size * mean_targets)
        flops = window.model_flops
        log.info("model: %s (%s), %d parameters (%.2fM)%s", self.model_spec.class_name, self.model_spec.kind,
                 self.num_parameters, self.num_parameters / 1e6,
                 f", {flops.n_layer} layers x {flops.n_embd} wide, {flops.per_token(cfg.batch.seq_len):.3g} training "
                 f"FLOPs per token at seq_len {cfg.batch.seq_len}" if flops else "")
        log.info("dataset: %s, %d train documents -> %d examples, %d valid targets (%.1f per example, %.3g epochs "
                 "in %d steps) | validation %d examples", cfg.data.name, train.documents, len(train),
                 train.valid_targets(), mean_targets, cfg.trainer.max_steps * cfg.batch.global_size / len(train),
                 cfg.trainer.max_steps, len(self.data.val))
        log.info("run dir: %s | steps %d..%d | wandb %s%s", self.run_dir.resolve(), self.step, cfg.trainer.max_steps,
                 cfg.logger.wandb.mode, f" (run id {self.metrics.run_id})" if self.metrics.run_id else "")

    # -- fit -----------------------------------------------------------------------------------

    def fit(self) -> None:
        cfg = self.cfg.trainer
        if self.step == cfg.max_steps:
            if not self._final_is_current():
                self.save_final()
            log.info("nothing to do: this run already finished at step %d (trainer.max_steps=%d); its weights are in "
                     "%s; raise trainer.max_steps to train on", self.step, cfg.max_steps, self.run_dir / "final")
            return
        check_every = self.cfg.checkpoint.preempt_check_every
        with Prefetcher(self.train_batches, cfg.max_steps, pin_memory_available(self.dist.device)) as batches:
            while self.step < cfg.max_steps:
                lr = self.optimizer.param_groups[0]["lr"]  # the rate this step applies
                microbatches, data_wait_s = batches.get(self.step)
                most = max(len(micro) for micro in self.train_batches.layout(self.step))
                stats = self._train_step(microbatches, most)
                self.metrics.window.add(stats, data_wait_s, self.train_batches.global_shapes(self.step))
                self.step += 1
                self._unread.append((self.step, stats))  # read on log, eval and checkpoint steps only
                self.metrics.step_done(self.step, None)
                is_last = self.step == cfg.max_steps
                every = self.cfg.checkpoint.every
                is_eval = bool(cfg.eval_every and self.step % cfg.eval_every == 0) or is_last
                is_log = self.step % cfg.log_every == 0 or is_last
                is_checkpoint = is_last or bool(every and self.step % every == 0)
                if is_eval or is_log or is_checkpoint:
                    self._read_steps()
                val_loss = self.evaluate() if is_eval else None
                if is_log:
                    self._log_step(stats, lr, val_loss)
                if is_checkpoint:
                    self.save_checkpoint()
                if is_last:
                    self.save_final()
                if not is_last and self.step % check_every == 0 and self._watcher.should_stop():
                    self._read_steps()
                    self._preempt()

    def _read_steps(self) -> None:
        """Read the steps since the last read (this waits for the device): counters, skips, policies."""
        for step, stats in self._unread:
            self.tokens_seen += stats.tokens
            self.filler_microbatches += stats.filler_microbatches
            if stats.skipped:
                if stats.reason == "no_valid_tokens" and self.cfg.trainer.empty_step == "stop":
                    raise EmptyStepError(f"step {step}: the global batch has no valid target token "
                                         "(trainer.empty_step=stop)")
                log.warning("step %d skipped: %s", step, "the global batch holds no valid target token (N_t = 0)"
                            if stats.reason == "no_valid_tokens" else f"non-finite gradient norm {stats.grad_norm}")
        self._unread = []

    def _train_step(self, microbatches, max_microbatches: int) -> StepStats:
        """Engine.step, with the step named in any collective failure (a dead or stuck peer)."""
        step = self.step + 1
        rank = self.dist.rank
        if faults.armed("hang", step, rank):
            faults.hang()
        if faults.armed("kill", step, rank):
            faults.kill_self()
        hook = None
        if faults.armed("nan", step, rank):
            hook = self.engine.model.register_forward_hook(lambda module, args, out: out * float("nan"))
        try:
            return self.engine.step(microbatches, max_microbatches=max_microbatches)
        except RuntimeError as error:  # gloo reports timeouts and lost peers as RuntimeError
            hint = ""
            if isinstance(error, dist.DistError) or any(w in str(error) for w in ("gloo", "NCCL", "Timed out", "Connection")):
                hint = f" (a dead or stuck peer fails the run after dist.timeout_s={self.cfg.dist.timeout_s}s)"
            raise RuntimeError(f"step {step} failed on rank {rank}: {error}{hint}") from error
        finally:
            if hook is not None:
                hook.remove()

    def _preempt(self) -> None:
        name = self._watcher.signal_name()
        path = self.save_checkpoint()
        self.save_final()
        code = self.cfg.checkpoint.preempt_exit_code
        log.warning("preempted by %s: checkpoint of step %d saved in %s; exiting with code %d",
                    name, self.step, path, code)
        raise Preempted(code)

    def _log_step(self, stats: StepStats, lr: float, val_loss: float | None) -> None:
        """One metrics line: this step's numbers, and rates and mean times over the steps since the last line."""
        record = {
            "step": self.step,
            "loss": stats.loss,
            "tokens": stats.tokens,
            "tokens_seen": self.tokens_seen,
            "lr": lr,
            "grad_norm": stats.grad_norm,
            **self.metrics.window.summary(),
            "peak_memory_bytes": peak_memory_bytes(self.dist.device),
            "skipped_steps": self.engine.skipped_steps,
            "filler_microbatches": self.filler_microbatches,
            "samples_seen": self.train_batches.plan.samples_seen(self.step),
        }
        if val_loss is not None:
            record["val_loss"] = val_loss
        if self.engine.loss_scale is not None:
            record["loss_scale"] = float(self.engine.loss_scale.scale)
        self.metrics.log(record)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Global mean loss over the valid targets of a fixed validation set, equal for any layout."""
        val: TokenExamples = self.data.val
        ids = np.arange(min(self.cfg.trainer.eval_examples, len(val)))
        share = ids[self.dist.rank :: self.dist.world_size]
        micro = self.cfg.batch.micro_size
        # Every rank runs the same number of forwards (ZeRO-3 gathers weights collectively).
        rounds = math.ceil(math.ceil(len(ids) / self.dist.world_size) / micro)
        sums = torch.zeros(2, dtype=torch.float64, device=self.dist.device)  # (loss sum, valid targets)
        model = self.engine.model
        model.eval()
        for index in range(rounds):
            chunk = share[index * micro : (index + 1) * micro]
            if len(chunk):
                inputs, targets = val.collate(chunk)
            else:
                inputs = torch.zeros(1, 1, dtype=torch.long)
                targets = torch.full((1, 1), IGNORE_INDEX, dtype=torch.long)
            inputs, targets = inputs.to(self.dist.device), targets.to(self.dist.device)
            logits = self.engine.forward(inputs)
            sums[0] += token_loss_sum(logits, targets).double()
            sums[1] += (targets != IGNORE_INDEX).sum()
        model.train()
        all_reduce_sum(sums)
        return float(sums[0] / sums[1]) if sums[1] > 0 else float("nan")

    # -- checkpoints -----------------------------------------------------------------------------

    def trainer_state(self) -> dict:
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "filler_microbatches": self.filler_microbatches,
            "engine": self.engine.progress_state_dict(),  # weights and optimizer: the strategy's own files
            "data": self.train_batches.state_dict(self.step),
            "wandb_run_id": self.metrics.run_id,
            "world_size": self.dist.world_size,
            "config": OmegaConf.to_container(self.cfg, resolve=True),
            "model_spec": self.model_spec.to_dict(),
        }

    def save_checkpoint(self) -> Path:
        """Collective. Refuses to write non-finite weights (the last good checkpoint stays); an error
        on any rank (non-finite weights, a full disk) fails every rank at once."""
        state, error = None, None
        if is_rank_zero():
            try:
                state = self.trainer_state()
            except Exception as caught:  # noqa: BLE001 - the other ranks must not wait for rank 0
                error = caught
        raise_on_every_rank(error)
        step, rank = self.step, self.dist.rank
        failpoint = faults.kill_self if faults.armed("kill_in_checkpoint", step, rank) else None
        path = ckpt.write_checkpoint(self.run_dir, step, state, save_state=self.engine.save, failpoint=failpoint)
        ckpt.purge(self.run_dir, self.cfg.checkpoint.keep, protect=path)
        log.info("checkpoint of step %d saved in %s", step, path)
        return path

    def save_final(self) -> Path:
        """Collective: gathers the full weights (every strategy) and rank 0 writes run.dir/final/."""
        if self._final_is_current():  # a preemption right after the last step's save
            return self.run_dir / "final"
        state = self.engine.model_state_dict()
        path, error = self.run_dir / "final", None
        if is_rank_zero():
            try:
                _check_finite(state, self.step, "final weights are not written and the previous ones are kept")
                path = save_final(self.run_dir, self.unwrapped_model, state, self.model_spec, self.step,
                                  self._tokenizer_files())
                log.info("final weights of step %d saved in %s (ddptrain.load_model(%r) reads them)",
                         self.step, path, str(self.run_dir))
            except FloatingPointError as caught:
                error = caught
            except OSError as caught:
                error = ckpt.CheckpointError(f"final weights of step {self.step} could not be written: "
                                             f"{describe_write_error(caught, path)}")
        raise_on_every_rank(error, ckpt.CheckpointError)
        return path

    def _tokenizer_files(self) -> list[Path]:
        """What final/ needs to tokenize like this run: model=hf's tokenizer files, or data.tokenizer's json."""
        tokenizer = self.cfg.data.tokenizer
        if self.model_spec.kind == "hf":
            from ddptrain.models.hf import TOKENIZER_FILES

            source = Path(self.cfg.model.path).expanduser()
            files = [source / name for name in TOKENIZER_FILES if (source / name).is_file()]
            if tokenizer not in (None, "byte") and Path(tokenizer).expanduser().resolve() != (source / "tokenizer.json").resolve():
                files = [Path(tokenizer).expanduser()]  # the run used another tokenizer than the model's own
            return files
        return [Path(tokenizer).expanduser()] if tokenizer not in (None, "byte") else []

    def _final_is_current(self) -> bool:
        spec = self.run_dir / "final" / SPEC_FILE
        try:
            return json.loads(spec.read_text())["step"] == self.step
        except (OSError, ValueError, KeyError):
            return False

    def _check_horizon(self, resumed: dict) -> None:
        """Resuming with another trainer.max_steps stretches the LR schedule unless optim.decay_steps fixes it."""
        if not resumed:
            return
        saved = resumed.get("config", {})
        before = saved.get("optim", {}).get("decay_steps") or saved.get("trainer", {}).get("max_steps")
        if before is not None and before != self.decay_steps:
            log.warning("the LR schedule now runs over %d steps instead of %d (trainer.max_steps changed on resume); "
                        "set optim.decay_steps to keep one schedule across runs of different lengths",
                        self.decay_steps, before)
        if self.step > self.cfg.trainer.max_steps:
            raise ckpt.CheckpointError(f"the checkpoint is at step {self.step}, past trainer.max_steps="
                                       f"{self.cfg.trainer.max_steps}; raise trainer.max_steps, or start anew with "
                                       "checkpoint.resume=none or another run.dir")

    def _lock_run_dir(self) -> None:
        """Rank 0 takes the run dir's lock; a live holder fails every rank at start-up, by name."""
        error = None
        if is_rank_zero():
            try:
                self._lock = RunDirLock(self.run_dir).acquire()
            except (RunDirLocked, OSError) as caught:
                error = caught
        raise_on_every_rank(error, RunDirLocked)

    def _saved_state(self) -> dict:
        """The trainer state of the checkpoint to resume from ({} for a fresh start), its config
        checked against ours. A fresh start moves an earlier run in the run dir aside first."""
        path = ckpt.agree_on_checkpoint(self.run_dir, self.cfg.checkpoint.resume)
        if path is None:
            if is_rank_zero():
                why = ("checkpoint.resume=none" if self.cfg.checkpoint.resume == "none"
                       else "no complete checkpoint could be resumed")
                move_previous_run_aside(self.run_dir, why)
            barrier()
            return {}
        state = ckpt.load_trainer_state(path)
        state["path"] = path
        current = OmegaConf.to_container(self.cfg, resolve=True)
        self._config_changes = check_config(state.get("config", {}), current, defaults_of(TrainConfig))
        return state

    def _resume(self, state: dict) -> dict:
        """Load the checkpoint state `_saved_state` found; {} when starting fresh."""
        if not state:
            return {}
        path = state["path"]
        try:
            self.engine.load(path / "strategy")
        except (ValueError, FileNotFoundError) as error:  # a checkpoint this world or strategy cannot read
            raise ckpt.CheckpointError(f"{path}: {error}") from error
        self.engine.load_progress_state_dict(state["engine"])
        if any(key in SCHEDULE_KEYS for key, _, _ in self._config_changes):
            reset_learning_rate(self.engine.lr_scheduler, self.cfg.optim.lr)
        self.step = state["step"]
        self.tokens_seen = state["tokens_seen"]
        self.filler_microbatches = state.get("filler_microbatches", 0)
        cursor = state["data"]
        if cursor["samples_seen"] != self.train_batches.plan.samples_seen(self.step):
            raise ckpt.CheckpointError(f"{path}: data cursor {cursor['samples_seen']} does not match step {self.step} "
                                       f"x batch.global_size {self.cfg.batch.global_size}; the global batch size "
                                       "must not change on resume")
        ckpt.load_rng_for_rank(path, self.dist.rank, self.dist.world_size, state["world_size"])
        log.info("resumed from %s at step %d (%d samples seen)", path, self.step, cursor["samples_seen"])
        return state

    # -- close ---------------------------------------------------------------------------------

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.restore()
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        self.engine = None  # drop the wrapped model before the process group is destroyed
        metrics = getattr(self, "metrics", None)
        if metrics is not None:
            metrics.close()
        if self._file_log is not None:
            logging.getLogger("ddptrain").removeHandler(self._file_log)
            self._file_log.close()
            self._file_log = None


def _check_finite(weights: dict[str, torch.Tensor], step: int, consequence: str) -> None:
    bad = [name for name, value in weights.items() if value.is_floating_point() and not torch.isfinite(value).all()]
    if bad:
        raise FloatingPointError(f"step {step}: weights {bad[:3]} are not finite; {consequence}")

