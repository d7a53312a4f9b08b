"""Preemption: a signal on any rank makes every rank checkpoint at the next step boundary.

The handler only records the signal (nothing else is safe inside a handler); the trainer asks
`should_stop()` once per step, a tiny MAX all-reduce, so all ranks agree on the same step and no
rank is left waiting in a collective.
"""

from __future__ import annotations

import logging
import signal

import torch

from ddptrain.distributed import any_rank

log = logging.getLogger(__name__)


class Preempted(SystemExit):
    """Raised after the preemption checkpoint; its code tells the launcher to restart the job."""


class PreemptionWatcher:
    def __init__(self, signal_names: list[str], device: torch.device):
        self.device = device
        self.received: int | None = None
        self._previous = {}
        for name in signal_names:
            signum = getattr(signal, name)
            self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def should_stop(self) -> bool:
        return any_rank(self.received is not None, self.device)

    def signal_name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else "a signal on another rank"

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
