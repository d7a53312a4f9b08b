"""Preemption: a signal on any rank makes every rank checkpoint at the next step boundary.

The handler only records the signal (nothing else is safe inside a handler); at step boundaries
the watcher asks every rank (`should_stop()`, a tiny MAX all-reduce), so all ranks agree on the
same step and no rank is left waiting in a collective. It owns the stop decision: the loop tells it
each step's end (`at_step_end`, before the step's eval and saves) and asks `stops` after them.

A rank blocked in a collective (a peer hung or died) never reaches that boundary, and a Python
signal handler does not even run while the main thread waits inside C++. So the signal is also
written to a wakeup pipe that a watchdog thread reads: if the trainer reaches no step boundary
within `grace_s` (each boundary restarts the wait, since the check that begins the preemption
checkpoint comes only every `check_every` steps), the process exits (128 + signal) instead of
ignoring the launcher's stop request until it is SIGKILLed. The last complete checkpoint stands.
A step's eval and saves run `unhurried`, off that clock, and the watcher asks again after a save.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from typing import Iterator

import torch

from ddptrain.distributed import any_rank, get_rank
from ddptrain.train.components import StepEnd

log = logging.getLogger(__name__)


class Preempted(SystemExit):
    """Raised after the preemption checkpoint; its code tells the launcher to restart the job."""


class PreemptionWatcher:
    def __init__(self, signal_names: list[str], device: torch.device, grace_s: float | None = None,
                 check_every: int = 1):
        self.device = device
        self.check_every = check_every
        self.grace_s = grace_s
        self.received: int | None = None
        self.stopping = False  # the ranks agreed to stop at the current step
        self._previous = {}
        self._handling = threading.Event()
        self._boundary = threading.Event()  # set at every step boundary: the steps still move
        self._unhurried = threading.Event()  # set while an eval or save runs: progress, not a stuck rank
        self._closed = threading.Event()
        self._signals = {getattr(signal, name) for name in signal_names}
        for signum in self._signals:
            self._previous[signum] = signal.signal(signum, self._handle)
        self._wakeup = None
        self._watchdog: threading.Thread | None = None
        if grace_s is not None and self._signals and threading.current_thread() is threading.main_thread():
            read_fd, write_fd = os.pipe()
            os.set_blocking(write_fd, False)
            self._wakeup = (read_fd, write_fd, signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False))
            self._watchdog = threading.Thread(target=self._watch, args=(read_fd,), name="preemption-watchdog",
                                              daemon=True)
            self._watchdog.start()

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def _watch(self, read_fd: int) -> None:
        while not self._closed.is_set():
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data:
                return
            signals = [s for s in data if s in self._signals]
            if not signals or self._closed.is_set():
                continue
            while True:  # until a grace period passes without a step boundary
                self._boundary.clear()
                if self._handling.wait(self.grace_s) or self._closed.is_set():
                    return
                if not self._boundary.is_set() and not self._unhurried.is_set():
                    break
            signum = signals[0]
            log.error("rank %d: %s received, but no step boundary was reached within checkpoint.preempt_grace_s=%gs "
                      "(stuck in a collective, or a step longer than that); exiting without a checkpoint, the last "
                      "complete one stands", get_rank(), signal.Signals(signum).name, self.grace_s)
            logging.shutdown()
            os._exit(128 + signum)

    def at_step_end(self, end: StepEnd, saves: bool) -> None:
        """A step boundary, before the step's eval and saves (so that they run unhurried once the ranks
        agree to stop): on the last step the run ends (`run_ends`), else the check of `should_stop_at`,
        whose answer `stops` gives."""
        if end.last:
            self.run_ends(end.step)
            self.stopping = False
        else:
            self.stopping = self.should_stop_at(end.step, saves=saves)

    def stops(self, end: StepEnd) -> bool:
        """After the step's eval and saves: whether every rank stops here. A signal that came during a
        checkpoint just written is answered by it (asked again, on every rank alike); the last step
        ends the run anyway."""
        if end.saved is not None and not self.stopping and not end.last:
            self.stopping = self.should_stop()
        return self.stopping

    def should_stop_at(self, step: int, saves: bool = False) -> bool:
        """Collective on every `check_every`-th step and on every step that `saves` a checkpoint (a
        tiny all-reduce the host waits for): did any rank receive a preemption signal? False on other
        steps, without communicating. Every call marks a step boundary for the watchdog. Asked before
        the step's saves: a checkpoint that is written anyway is the preemption checkpoint, and the
        watchdog stands down before it, not in the middle of it: a long save after a signal is not cut
        short, and a signal at a save step off the check schedule is answered by that step's save."""
        self._boundary.set()
        return (saves or step % self.check_every == 0) and self.should_stop()

    @contextlib.contextmanager
    def unhurried(self) -> Iterator[None]:
        """A step's eval and saves, after its check: off the watchdog's clock, which times only how long
        no step boundary comes, so a signal that arrives during them cannot cut a long save short
        (which would leave the step's checkpoint in its .tmp directory). The watcher asks again after
        the saves (`stops`), so the checkpoint just written answers such a signal. A save stuck in a
        collective fails after dist.timeout_s, as a step does."""
        self._unhurried.set()
        try:
            yield
        finally:
            self._boundary.set()  # what ran was progress: the grace period starts again from here
            self._unhurried.clear()

    def should_stop(self) -> bool:
        stop = any_rank(self.received is not None, self.device)
        if stop:
            self._handling.set()  # the checkpoint is under way: the watchdog stands down
        return stop

    def run_ends(self, step: int) -> None:
        """The last step, `step`, has begun: its checkpoint and final weights answer any signal,
        received or to come, as a preemption checkpoint would, so the watchdog stands down as it does
        for one: a signal after the run's last check (check_every may exceed the steps left) must not
        cut the last step's saves short and leave no final/. Rank-local, no collective."""
        self._handling.set()
        if self.received is not None:
            log.warning("%s received, and the run reached its last step, %d, before its next preemption check "
                        "(checkpoint.preempt_check_every=%d): it ends there, with its checkpoint and final weights",
                        signal.Signals(self.received).name, step, self.check_every)

    def signal_name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else "a signal on another rank"

    def restore(self) -> None:
        self._closed.set()
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        if self._wakeup is not None:
            read_fd, write_fd, previous = self._wakeup
            signal.set_wakeup_fd(previous)
            os.close(write_fd)  # the watchdog's read returns: it ends, and is joined before its fd closes
            if self._watchdog is not None:
                self._watchdog.join(timeout=5)
                self._watchdog = None
            os.close(read_fd)
            self._wakeup = None
