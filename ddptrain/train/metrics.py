"""What rank 0 records: metrics.jsonl (one JSON object per logged step), console lines or a
progress bar, and wandb; plus the per-window throughput, MFU, padding and time-split numbers.
The logger is a component of the loop (train/components.py): a line every trainer.log_every steps
and at the last."""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

from ddptrain.config.schema import TrainConfig
from ddptrain.distributed import is_rank_zero
from ddptrain.fsutil import rename
from ddptrain.train.flops import ModelFlops
from ddptrain.train.components import StepEnd
from ddptrain.train.progress import Progress

log = logging.getLogger(__name__)

TIME_SPLIT = ("data_wait_s", "forward_backward_s", "comm_wait_s", "optimizer_s")


def _clean(value):
    """JSON has no NaN/inf: write them as null so every line parses with any reader."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


# -- throughput -------------------------------------------------------------------------------


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated memory on a GPU; on CPU the process's peak resident set size: Linux's VmHWM,
    this process's own (getrusage's ru_maxrss keeps the high-water mark of the process it was
    exec'd from: a launcher or a test runner holding gigabytes would set it), else ru_maxrss."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB


class ThroughputWindow:
    """Sums the training steps since the last logged step: tokens, FLOPs and time per phase.

    Rates divide by the time spent in training steps (data wait + Engine.step), so evaluation
    and checkpoint time do not lower tokens/s or MFU. FLOPs and tokens are global (all ranks);
    MFU divides by the peak of one device times the world size.
    """

    def __init__(self, model_flops: ModelFlops | None, peak_flops: float | None, world_size: int):
        self.model_flops = model_flops
        self.peak_flops = peak_flops
        self.world_size = world_size
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self._unread: list = []  # StepStats not read yet
        self.valid_tokens = 0
        self.processed_tokens = 0
        self.real_positions = 0
        self._real_unknown = False
        self.flops = 0.0
        self.seconds = dict.fromkeys(TIME_SPLIT, 0.0)

    def add(self, stats, data_wait_s: float, shapes: list[tuple[int, int]], real_positions: int | None = None) -> None:
        """One step: (rows, padded width) of its microbatches and the positions that hold a token
        (`real_positions`; None: every valid target's, as in pretraining). Its valid target count is
        read at `summary` (a logging step), not now."""
        self.steps += 1
        self._unread.append(stats)
        processed = sum(rows * width for rows, width in shapes)
        self.processed_tokens += processed
        if real_positions is not None:
            self.real_positions += real_positions
        else:
            self._real_unknown = True
        if self.model_flops is not None:
            self.flops += sum(self.model_flops.per_microbatch(rows, width) for rows, width in shapes)
        self.seconds["data_wait_s"] += data_wait_s
        for key in TIME_SPLIT[1:]:
            self.seconds[key] += getattr(stats, key, 0.0)

    def summary(self) -> dict:
        """The window's rates and per-step mean times; then starts a new window."""
        new_valid = sum(stats.tokens for stats in self._unread)
        self.valid_tokens += new_valid
        if self.model_flops is not None:
            self.flops += self.model_flops.per_valid_target() * new_valid  # the chunked head's
        self._unread = []
        train_s = max(sum(self.seconds.values()), 1e-9)
        steps = max(self.steps, 1)
        processed = self.processed_tokens
        flops_per_second = self.flops / train_s if self.model_flops is not None else None
        peak = self.peak_flops * self.world_size if self.peak_flops else None
        record = {
            "tokens_per_second": self.valid_tokens / train_s,
            "flops_per_second": flops_per_second,
            "mfu": flops_per_second / peak if peak and flops_per_second is not None else None,
            "padding_efficiency": (self.valid_tokens if self._real_unknown else self.real_positions) / processed
            if processed else None,
            "valid_target_fraction": self.valid_tokens / processed if processed else None,
            "step_time_s": train_s / steps,
            **{key: value / steps for key, value in self.seconds.items()},
        }
        self.reset()
        return record


# -- the logger -------------------------------------------------------------------------------


def _has_wandb_credentials(wandb) -> bool:
    """True when wandb can log in without asking anyone (no prompt, no network)."""
    try:
        return bool(wandb.login(prompt=False, verify=False))
    except TypeError:  # a wandb without login(prompt=...)
        return bool(os.environ.get("WANDB_API_KEY"))


class MetricsLogger:
    """Appends to `<run_dir>/metrics.jsonl` on rank 0; console lines or a bar; optional wandb.

    Silent on other ranks. wandb starts on rank 0 only, after the process group exists (the
    trainer builds this after init_distributed), never prompts, and `close` always finishes it.
    """

    def __init__(self, run_dir: str | Path, wandb_mode: str = "disabled", wandb_project: str = "ddptrain",
                 wandb_name: str | None = None, config: dict | None = None, run_id: str | None = None,
                 resume_step: int | None = None, progress: str = "lines", max_steps: int | None = None,
                 window: ThroughputWindow | None = None, every: int = 1):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.every = every
        self.last_step = max_steps
        self.enabled = is_rank_zero()
        self.run_id = run_id
        self.window = window or ThroughputWindow(None, None, 1)
        self.progress = Progress(max_steps or 1, resume_step or 0, progress if max_steps else "lines")
        self._file = None
        self._wandb_run = None
        self._wandb_logged_through = 0  # steps up to here are already in the wandb run
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        logged_through = self._truncate_after(resume_step)
        self._file = open(self.path, "a", encoding="utf-8")
        if wandb_mode != "disabled":
            self._wandb_run = self._start_wandb(wandb_mode, wandb_project, wandb_name or Path(run_dir).name, config,
                                                run_dir, run_id)
            self.run_id = self._wandb_run.id
            # A run killed after its last checkpoint already sent the steps that the resumed run
            # repeats (with the same values: resume is exact). wandb cannot take a step twice, so
            # those are written to metrics.jsonl again but not to wandb.
            if run_id is not None:
                self._wandb_logged_through = max(logged_through, int(self._wandb_run.step or 0) - 1)

    @classmethod
    def from_config(cls, cfg: TrainConfig, window: ThroughputWindow, run_id: str | None = None,
                    resume_step: int | None = None) -> "MetricsLogger":
        """The run's logger: logger.* and trainer.log_every; `run_id` and `resume_step` from the checkpoint resumed."""
        wandb = cfg.logger.wandb
        return cls(cfg.run.dir, wandb.mode, wandb.project, wandb.name, OmegaConf.to_container(cfg, resolve=True),
                   run_id=run_id, resume_step=resume_step, progress=cfg.logger.progress,
                   max_steps=cfg.trainer.max_steps, window=window, every=cfg.trainer.log_every)

    def _truncate_after(self, resume_step: int | None) -> int:
        """On resume, drop lines of steps after the checkpoint: they will be logged again.

        A fresh run (no checkpoint) in a run dir with an old metrics.jsonl starts the file anew.
        Returns the last step the file held before (0 if none).
        """
        if not self.path.exists():
            return 0
        keep, last = [], 0
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                step = json.loads(line)["step"]
            except (ValueError, KeyError, TypeError):
                continue  # a line cut by a crash
            last = max(last, step)
            if resume_step is not None and step <= resume_step:
                keep.append(line)
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in keep), encoding="utf-8")
        rename(tmp, self.path)  # fsynced: a crash never leaves an empty or a half-written file
        return last

    @staticmethod
    def _start_wandb(mode: str, project: str, name: str, config: dict | None, run_dir, run_id: str | None):
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb  # lazy: wandb is heavy and optional at run time

        if mode == "online" and not _has_wandb_credentials(wandb):
            log.warning("logger.wandb.mode=online but no wandb credentials (WANDB_API_KEY, netrc): logging offline; "
                        "upload later with `wandb sync %s/wandb/offline-run-*`", run_dir)
            mode = "offline"
        # console="off": wandb must not wrap stdout/stderr (the progress bar and log lines own them).
        settings = wandb.Settings(console="off", silent=True)
        return wandb.init(mode=mode, project=project, name=name, config=config, dir=str(run_dir), id=run_id,
                          resume="allow" if run_id else None, settings=settings)

    def should_log(self, step: int) -> bool:
        """Log steps: every logger's `every` steps, and the last."""
        return step % self.every == 0 or step == self.last_step

    def reads(self, end: StepEnd) -> bool:
        return self.should_log(end.step)

    def on_step_end(self, end: StepEnd) -> None:
        """On log steps, one line: this step's numbers, and rates and mean times over the steps since the last line."""
        if not self.should_log(end.step):
            return
        stats = end.stats
        record = {"step": end.step, "loss": stats.loss, "tokens": stats.tokens, "lr": end.lr,
                  "grad_norm": stats.grad_norm, **stats.metrics, **self.window.summary(), **end.counters()}
        if end.val_loss is not None:
            record["val_loss"] = end.val_loss
        record.update(end.rollout)  # objective=grpo: reward, completion lengths, ...
        record.update(end.evals)  # eval/<task>/acc, ...: the task scorer's
        self.log(record)
        end.record = record  # for the trackers after this component

    def on_fit_end(self, step: int) -> None:
        pass

    def log(self, metrics: dict) -> None:
        """One logged step: metrics.jsonl, wandb, and the console (a line above the bar, or a log line)."""
        if not self.enabled:
            return
        record = {key: _clean(value) for key, value in metrics.items()}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        step = int(metrics["step"])
        if self._wandb_run is not None and step > self._wandb_logged_through:
            self._wandb_run.log({k: v for k, v in record.items() if k != "step" and v is not None}, step=step)
        log.info(format_line(record) if self.progress.is_bar else format_line(record, self.progress.suffix(step)))

    def step_done(self, step: int, loss: float | None) -> None:
        """After every optimizer step: moves the bar (rank 0, on a terminal)."""
        if self.enabled:
            self.progress.update(step, loss if loss is not None and math.isfinite(loss) else None)

    def close(self, exit_code: int | None = None) -> None:
        """Flush and close; `wandb.finish()` always runs, with `exit_code`, by default the process's own."""
        self.progress.close()
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._wandb_run is not None:
            run, self._wandb_run = self._wandb_run, None
            run.finish(exit_code=exit_code_of_current_exception() if exit_code is None else exit_code)


def exit_code_of_current_exception() -> int:
    """The code the process is leaving with: a SystemExit's own (75 after a preemption checkpoint, 2
    after a reported bad input), 1 for any other exception, 0 when none is being raised. Called in a
    `finally`, where sys.exc_info() is the exception on its way out."""
    error = sys.exc_info()[1]
    if error is None:
        return 0
    if isinstance(error, SystemExit):
        return error.code if isinstance(error.code, int) else (0 if error.code is None else 1)
    return 1


_FORMATS = (("loss", "{:.4f}"), ("val_loss", "{:.4f}"), ("lr", "{:.2e}"), ("grad_norm", "{:.3f}"),
            ("tokens", "{:d}"), ("tokens_per_second", "{:,.0f}"), ("flops_per_second", "{:.3g}"), ("mfu", "{:.1%}"),
            ("padding_efficiency", "{:.1%}"), ("valid_target_fraction", "{:.1%}"), ("reward", "{:.3f}"),
            ("completion_length", "{:.1f}"))


def format_line(metrics: dict, step_suffix: str = "") -> str:
    """`step 10/200 (5%) | ETA 01:23 | loss 3.1416 | ...` (the suffix comes from Progress)."""
    parts = [f"step {metrics['step']}{step_suffix}"]
    for key, fmt in _FORMATS:
        if metrics.get(key) is not None:
            parts.append(f"{key} " + fmt.format(metrics[key]))
    parts += [f"{key} {value:.3f}" for key, value in metrics.items() if key.startswith("eval/") and value is not None]
    shares = [f"{key[4:-6]} {value:.0%}" for key, value in metrics.items()
              if key.startswith("mix/") and key.endswith("/share") and value is not None]
    if shares:  # data=mixture: each source's cumulative share of the valid targets
        parts.append("mix " + " ".join(shares))
    if metrics.get("step_time_s") is not None:
        split = "/".join(f"{metrics.get(key) or 0:.3f}" for key in TIME_SPLIT)
        parts.append(f"step {metrics['step_time_s']:.3f}s (data/fwd-bwd/comm/optim {split})")
    if metrics.get("peak_memory_bytes"):
        parts.append(f"peak mem {metrics['peak_memory_bytes'] / 2**20:,.0f} MiB")
    if metrics.get("skipped_steps"):
        parts.append(f"skipped {metrics['skipped_steps']}")
    return " | ".join(parts)
