"""The loop: build the pieces from config, fit, evaluate, close."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from ddptrain.config import TrainConfig
from ddptrain.data import DataSplits, TrainBatches, load_stdlib
from ddptrain.data.dataset import TokenExamples
from ddptrain.distributed import DistInfo, all_reduce_sum, is_rank_zero, Rank0Filter, barrier
from ddptrain.engine import Engine, StepStats
from ddptrain.metrics import MetricsLogger, format_line
from ddptrain.models import GPT, GPTConfig
from ddptrain.objective import IGNORE_INDEX, token_loss_sum
from ddptrain.optim import build_optimizer, build_scheduler

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
        self._file_log: logging.Handler | None = None

    # -- build ---------------------------------------------------------------------------------

    def build(self) -> "Trainer":
        cfg = self.cfg
        self._write_run_dir()
        torch.manual_seed(cfg.run.seed)
        self.data = self._build_data()
        self.train_batches = TrainBatches(self.data.train, cfg.batch.global_size, cfg.batch.micro_size,
                                          cfg.run.seed, self.dist.rank, self.dist.world_size)
        model = GPT(GPTConfig(vocab_size=self.data.vocab_size, max_seq_len=cfg.batch.seq_len, n_layer=cfg.model.n_layer,
                              n_head=cfg.model.n_head, n_embd=cfg.model.n_embd, dropout=cfg.model.dropout,
                              bias=cfg.model.bias))
        self.num_parameters = model.num_parameters()
        if cfg.trainer.precision == "fp64":
            model = model.double()  # before the optimizer sees the parameters
        optimizer = build_optimizer(model, cfg.optim.name, cfg.optim.lr, cfg.optim.weight_decay, tuple(cfg.optim.betas))
        scheduler = build_scheduler(optimizer, cfg.optim.schedule, cfg.optim.warmup_steps, cfg.trainer.max_steps,
                                    cfg.optim.min_lr_ratio)
        strategy_options = {"bucket_cap_mb": cfg.strategy.bucket_cap_mb,
                            "find_unused_parameters": cfg.strategy.find_unused_parameters}
        self.engine = Engine(model, optimizer, cfg.strategy.name, grad_clip=cfg.trainer.grad_clip,
                             lr_scheduler=scheduler, precision=cfg.trainer.precision, nonfinite=cfg.trainer.nonfinite,
                             device=self.dist.device, strategy_options=strategy_options)
        self.optimizer = optimizer
        self.metrics = MetricsLogger(self.run_dir, cfg.logger.wandb.mode, cfg.logger.wandb.project,
                                     cfg.logger.wandb.name, OmegaConf.to_container(cfg, resolve=True))
        self._log_summary()
        return self

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
        data = load_stdlib(cfg.batch.seq_len, cfg.data.val_percent, cfg.data.max_docs)
        log.info("data: %d train documents -> %d examples (%d valid targets), %d validation examples, %.1fs",
                 data.train.documents, len(data.train), data.train.valid_targets(), len(data.val),
                 time.perf_counter() - started)
        return data

    def _log_summary(self) -> None:
        cfg, d = self.cfg, self.dist
        accum = cfg.batch.global_size // (cfg.batch.micro_size * d.world_size)
        log.info("world %d on %s (%s) | strategy %s | global batch %d = micro %d x accumulation %d x world %d | "
                 "up to %d tokens/step | model %.2fM parameters | precision %s | run dir %s",
                 d.world_size, d.device, d.backend, cfg.strategy.name, cfg.batch.global_size, cfg.batch.micro_size,
                 accum, d.world_size, cfg.batch.global_size * cfg.batch.seq_len, self.num_parameters / 1e6,
                 cfg.trainer.precision, self.run_dir)

    # -- fit -----------------------------------------------------------------------------------

    def fit(self) -> None:
        cfg = self.cfg.trainer
        window_tokens, window_start = 0, time.perf_counter()
        while self.step < cfg.max_steps:
            lr = self.optimizer.param_groups[0]["lr"]  # the rate this step applies
            stats = self.engine.step(self.train_batches.microbatches(self.step))
            if stats.skipped and stats.reason == "no_valid_tokens" and cfg.empty_step == "stop":
                raise EmptyStepError(f"step {self.step + 1}: the global batch has no valid target token "
                                     "(trainer.empty_step=stop)")
            self.step += 1
            window_tokens += stats.tokens
            is_last = self.step == cfg.max_steps
            val_loss = None
            if (cfg.eval_every and self.step % cfg.eval_every == 0) or is_last:
                val_loss = self.evaluate()
            if self.step % cfg.log_every == 0 or is_last:
                elapsed = time.perf_counter() - window_start
                self._log_step(stats, lr, val_loss, window_tokens / max(elapsed, 1e-9))
                window_tokens, window_start = 0, time.perf_counter()

    def _log_step(self, stats: StepStats, lr: float, val_loss: float | None, tokens_per_second: float) -> None:
        record = {
            "step": self.step,
            "loss": stats.loss,
            "tokens": stats.tokens,
            "lr": lr,
            "grad_norm": stats.grad_norm,
            "tokens_per_second": tokens_per_second,
            "skipped_steps": self.engine.skipped_steps,
            "samples_seen": self.train_batches.plan.samples_seen(self.step),
        }
        if val_loss is not None:
            record["val_loss"] = val_loss
        self.metrics.log(record)
        log.info(format_line(record))

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

    # -- close ---------------------------------------------------------------------------------

    def close(self) -> None:
        metrics = getattr(self, "metrics", None)
        if metrics is not None:
            metrics.close()
        if self._file_log is not None:
            logging.getLogger("ddptrain").removeHandler(self._file_log)
            self._file_log.close()
            self._file_log = None
