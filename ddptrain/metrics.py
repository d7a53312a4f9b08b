"""What rank 0 records: metrics.jsonl (one JSON object per logged step), console lines, wandb."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

from ddptrain.distributed import is_rank_zero

log = logging.getLogger(__name__)


def _clean(value):
    """JSON has no NaN/inf: write them as null so every line parses with any reader."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLogger:
    """Appends to `<run_dir>/metrics.jsonl` on rank 0; optional wandb; silent on other ranks."""

    def __init__(self, run_dir: str | Path, wandb_mode: str = "disabled", wandb_project: str = "ddptrain",
                 wandb_name: str | None = None, config: dict | None = None, run_id: str | None = None,
                 resume_step: int | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.enabled = is_rank_zero()
        self.run_id = run_id
        self._file = None
        self._wandb_run = None
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._truncate_after(resume_step)
        self._file = open(self.path, "a", encoding="utf-8")
        if wandb_mode != "disabled":
            self._wandb_run = self._start_wandb(wandb_mode, wandb_project, wandb_name or Path(run_dir).name, config,
                                                run_dir, run_id)
            self.run_id = self._wandb_run.id

    def _truncate_after(self, resume_step: int | None) -> None:
        """On resume, drop lines of steps after the checkpoint: they will be logged again.

        A fresh run (no checkpoint) in a run dir with an old metrics.jsonl starts the file anew.
        """
        if not self.path.exists():
            return
        keep = []
        if resume_step is not None:
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    if json.loads(line)["step"] <= resume_step:
                        keep.append(line)
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut by a crash
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in keep), encoding="utf-8")
        os.replace(tmp, self.path)

    @staticmethod
    def _start_wandb(mode: str, project: str, name: str, config: dict | None, run_dir, run_id: str | None):
        import wandb  # lazy: wandb is heavy and optional at run time

        os.environ.setdefault("WANDB_SILENT", "true")
        return wandb.init(mode=mode, project=project, name=name, config=config, dir=str(run_dir), id=run_id,
                          resume="allow" if run_id else None)

    def log(self, metrics: dict) -> None:
        if not self.enabled:
            return
        record = {key: _clean(value) for key, value in metrics.items()}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._wandb_run is not None:
            self._wandb_run.log({k: v for k, v in metrics.items() if k != "step"}, step=int(metrics["step"]))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None


def format_line(metrics: dict) -> str:
    parts = [f"step {metrics['step']}"]
    for key, fmt in (("loss", "{:.4f}"), ("val_loss", "{:.4f}"), ("lr", "{:.2e}"), ("grad_norm", "{:.3f}"),
                     ("tokens", "{:d}"), ("tokens_per_second", "{:.0f}")):
        if key in metrics and metrics[key] is not None:
            parts.append(f"{key} " + fmt.format(metrics[key]))
    if metrics.get("skipped_steps"):
        parts.append(f"skipped {metrics['skipped_steps']}")
    return " | ".join(parts)
