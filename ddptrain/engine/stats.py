"""StepStats: what one optimizer step did, kept on the device until someone reads it.

On a GPU every `float(tensor)` waits for the queue to drain (torchtitan reads metrics only on
logging steps for that reason). The Engine returns device tensors and the pending loss
all-reduce; a property reads them the first time it is asked, so a training loop that reads only
on logging steps never blocks the host between them.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Callable, Iterator

import torch


def _number(value) -> float:
    return float(value) if isinstance(value, torch.Tensor) else value


class StepStats:
    """The same numbers on every rank. Built from plain numbers, or from device tensors (the Engine)."""

    def __init__(self, loss=math.nan, tokens=0, grad_norm=math.nan, skipped=False, *, loss_sum=None,
                 wait: Callable[[], None] | None = None, filler_microbatches: int = 0, metric_names=(),
                 denominator=None):
        self._loss, self._tokens, self._grad_norm, self._skipped = loss, tokens, grad_norm, skipped
        self._denominator = denominator  # what the sums are divided by, where it is not `tokens` (GRPO)
        self._loss_sum = loss_sum  # global sum of token losses (then the metrics' sums), once `wait` has run
        self._metric_names = tuple(metric_names)
        self._metrics: dict[str, float] = {}
        self._wait = wait
        self._fillers = filler_microbatches
        self.forward_backward_s = 0.0
        """Host seconds in forward and backward passes (DDP's overlapped gradient all-reduce included)."""
        self.comm_wait_s = 0.0
        """Host seconds blocked on the one collective the step waits for: the all-reduce of the
        valid-token count, which also carries each rank's microbatch count (fillers need it). Not the
        loss all-reduce: it starts after the optimizer step, and `loss` waits for it when read, after
        the step's clock stopped."""
        self.optimizer_s = 0.0
        """Host seconds in clipping, the optimizer step, the LR schedule and zero_grad."""

    @property
    def tokens(self) -> int:
        """Global number of valid target tokens N_t."""
        return int(self._tokens)

    @property
    def filler_microbatches(self) -> int:
        """Microbatches without targets that ranks with fewer microbatches ran to keep a strategy's
        per-microbatch collectives in step (all ranks together)."""
        return int(self._fillers)

    @property
    def loss(self) -> float:
        """Global mean of the objective over valid target tokens (NaN when the step had none)."""
        if self._loss_sum is None:
            return _number(self._loss)
        self._reduced()
        return float(self._loss_sum.reshape(-1)[0]) / self._divisor() if self.tokens else math.nan

    @property
    def metrics(self) -> dict[str, float]:
        """The objective's metrics (DPO: rewards), each a global mean over the same count as the loss."""
        if self._metric_names and not self._metrics:
            self._reduced()
            sums = self._loss_sum.reshape(-1)[1:].tolist()
            self._metrics = {name: value / self._divisor() if self.tokens else math.nan
                             for name, value in zip(self._metric_names, sums)}
        return self._metrics

    @property
    def metric_sums(self) -> list[float]:
        """The objective's sums after the loss's, summed over ranks and not divided (a mixture's
        per-source loss sums, which the trainer divides by the plan's per-source counts)."""
        if self._loss_sum is None:
            return []
        self._reduced()
        return self._loss_sum.reshape(-1)[1:].tolist()

    def _divisor(self) -> float:
        """The global mean's divisor: N_t, or the objective's denominator (GRPO's loss aggregations)."""
        return self.tokens if self._denominator is None else float(self._denominator)

    def _reduced(self) -> None:
        """Wait for the loss all-reduce (once)."""
        if self._wait is not None:
            self._wait()
            self._wait = None

    @property
    def grad_norm(self) -> float:
        """Global gradient norm before clipping (NaN when the step had no valid token)."""
        return _number(self._grad_norm) if self.tokens else math.nan

    @property
    def skipped(self) -> bool:
        """True when no update was applied (no valid tokens, or a non-finite gradient norm)."""
        return bool(self._skipped)

    @property
    def reason(self) -> str:
        """Why the step was skipped: 'no_valid_tokens' or 'nonfinite' ('' when it was not)."""
        if not self.skipped:
            return ""
        return "no_valid_tokens" if self.tokens == 0 else "nonfinite"

    def __getstate__(self) -> dict:
        """Pickled (sent between processes) as plain numbers: reading them waits for the device."""
        state = dict(self.__dict__)
        state.update(_loss=self.loss, _metrics=self.metrics, _metric_names=(), _loss_sum=None, _wait=None,
                     _denominator=None,
                     _tokens=self.tokens, _grad_norm=_number(self._grad_norm), _skipped=self.skipped,
                     _fillers=self.filler_microbatches)
        return state

    def __repr__(self) -> str:
        return (f"StepStats(loss={self.loss!r}, tokens={self.tokens}, grad_norm={self.grad_norm!r}, "
                f"skipped={self.skipped}, reason={self.reason!r})")


class PhaseClock:
    """Host seconds of one step: comm wait and optimizer inside `phase(...)` blocks, the rest forward-backward.

    The clock stops when the Engine returns the stats (`stamp`); waiting for the loss all-reduce
    later, when `StepStats.loss` is read, is charged to no phase.

    perf_counter readings around calls that already exist: no device sync is added. On a GPU,
    kernels still queued are charged to whatever waits for them next.
    """

    def __init__(self):
        self.began = time.perf_counter()
        self.seconds = {"comm": 0.0, "optimizer": 0.0}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        since = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - since

    def stamp(self, stats: StepStats) -> StepStats:
        total = time.perf_counter() - self.began
        stats.comm_wait_s, stats.optimizer_s = self.seconds["comm"], self.seconds["optimizer"]
        stats.forward_backward_s = max(total - stats.comm_wait_s - stats.optimizer_s, 0.0)
        return stats
