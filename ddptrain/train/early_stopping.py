"""Early stopping and the best weights: two components of the loop (train/components.py) that read
the numbers an eval step leaves on the StepEnd (the evaluator's val_loss, the task scorer's evals).

Every rank holds the same reduced numbers, yet the decision is rank 0's, broadcast, so no float
path can make ranks disagree about stopping (one would wait in a collective forever). A stop is a
clean end: the trainer checkpoints the step, writes final/ and exits 0, the reason logged. The best
weights go to run.dir/best/ in final/'s format, written atomically and never purged. Both keep
their best-so-far (and early stopping its patience counter, and whether it stopped) in the
checkpoint's trainer state, so a resumed run takes the same decisions as an uninterrupted one.
"""

from __future__ import annotations

import logging
import math
from typing import Callable

import torch.distributed as dist

from ddptrain.config.evaluation import metric_mode
from ddptrain.config.schema import TrainConfig
from ddptrain.train.components import StepEnd

log = logging.getLogger(__name__)


def _from_rank_zero(values: list) -> list:
    """Rank 0's `values` on every rank (a world of one: as they are)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(values, src=0)
    return values


def metric_of(end: StepEnd, metric: str) -> float | None:
    """The metric's value at this step, None where the step evaluated nothing."""
    return end.val_loss if metric == "val_loss" else end.evals.get(metric)


class BestSoFar:
    """The best value of one metric and its step; `bad_evals` counts evaluations since it improved."""

    def __init__(self, metric: str, mode: str, min_delta: float = 0.0):
        self.metric, self.mode, self.min_delta = metric, mode, min_delta
        self.best: float | None = None
        self.best_step: int | None = None
        self.bad_evals = 0

    def is_improvement(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.best is None:
            return True
        return value < self.best - self.min_delta if self.mode == "min" else value > self.best + self.min_delta

    def update(self, value: float, step: int, improved: bool) -> None:
        if improved:
            self.best, self.best_step, self.bad_evals = value, step, 0
        else:
            self.bad_evals += 1

    def state_dict(self) -> dict:
        return {"metric": self.metric, "mode": self.mode, "best": self.best, "best_step": self.best_step,
                "bad_evals": self.bad_evals}

    def load_state_dict(self, state: dict | None) -> None:
        """A saved state of the same metric and mode; another one's is said and left (a changed config)."""
        if not state:
            return
        if (state.get("metric"), state.get("mode")) != (self.metric, self.mode):
            log.warning("the checkpoint tracked %s (%s) and this run tracks %s (%s): the best so far starts anew",
                        state.get("metric"), state.get("mode"), self.metric, self.mode)
            return
        self.best, self.best_step, self.bad_evals = state["best"], state["best_step"], state["bad_evals"]


class EarlyStopping:
    """Stops the run after trainer.early_stopping.patience evaluations without an improvement."""

    def __init__(self, metric: str, mode: str, patience: int, min_delta: float = 0.0):
        self.tracked = BestSoFar(metric, mode, min_delta)
        self.patience = patience
        self.stopped: str | None = None  # the reason, once the run stopped

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> "EarlyStopping | None":
        stopping = cfg.trainer.early_stopping
        if stopping.metric is None:
            return None
        return cls(stopping.metric, metric_mode(cfg.trainer, stopping.metric, stopping.mode), stopping.patience,
                   stopping.min_delta)

    def reads(self, end: StepEnd) -> bool:
        return False  # the eval components read the step when they run

    def on_step_end(self, end: StepEnd) -> None:
        value = metric_of(end, self.tracked.metric)
        if value is None:
            return
        tracked = self.tracked
        improved, = _from_rank_zero([tracked.is_improvement(value)])
        tracked.update(value, end.step, improved)
        if tracked.bad_evals >= self.patience:
            self.stopped = f"early stopping: {self._why(value)} (trainer.early_stopping.patience={self.patience})"
            end.stop = self.stopped

    def _why(self, value: float) -> str:
        """Why the run stops; a value that is not finite never improves, and is named as such."""
        tracked, evals = self.tracked, self.tracked.bad_evals
        if tracked.best is None:
            return (f"{tracked.metric} was not finite ({value}) in each of the {evals} evaluations so far: a NaN or "
                    "infinite value never counts as an improvement, so there is no best to wait for")
        latest = "" if math.isfinite(value) else f"; the latest was {value}, which never counts as an improvement"
        return (f"{tracked.metric} has not improved on {tracked.best} (step {tracked.best_step}) by more than "
                f"{tracked.min_delta} for {evals} evaluations{latest}")

    def on_fit_end(self, step: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {**self.tracked.state_dict(), "stopped": self.stopped}

    def load_state_dict(self, state: dict | None) -> None:
        self.tracked.load_state_dict(state)
        if state and state.get("metric") == self.tracked.metric:
            self.stopped = state.get("stopped")


class BestWeights:
    """Writes run.dir/best/ at each evaluation that improves checkpoint.keep_best."""

    def __init__(self, metric: str, mode: str, write: Callable[[int], object]):
        self.tracked = BestSoFar(metric, mode)
        self.write = write  # collective: the full weights of this step into best/

    @classmethod
    def from_config(cls, cfg: TrainConfig, write: Callable[[int], object]) -> "BestWeights | None":
        metric = cfg.checkpoint.keep_best
        if metric is None:
            return None
        stopping = cfg.trainer.early_stopping
        mode = stopping.mode if stopping.metric == metric else None  # the one stated for this metric, if any
        return cls(metric, metric_mode(cfg.trainer, metric, mode), write)

    def reads(self, end: StepEnd) -> bool:
        return False

    def on_step_end(self, end: StepEnd) -> None:
        value = metric_of(end, self.tracked.metric)
        if value is None:
            return
        improved, = _from_rank_zero([self.tracked.is_improvement(value)])
        self.tracked.update(value, end.step, improved)
        if improved:
            end.improved = True
            path = self.write(end.step)
            log.info("best %s so far (%.6g) at step %d: weights saved in %s", self.tracked.metric, value, end.step,
                     path)

    def on_fit_end(self, step: int) -> None:
        pass

    def state_dict(self) -> dict:
        return self.tracked.state_dict()

    def load_state_dict(self, state: dict | None) -> None:
        self.tracked.load_state_dict(state)
