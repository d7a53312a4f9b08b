"""Fault injection for the crash tests: a component the trainer installs only when
DDPTRAIN_FAILPOINT is set (parsed once, at start-up).

    DDPTRAIN_FAILPOINT="nan@5:1"                 rank 1 produces NaN logits at step 5
    DDPTRAIN_FAILPOINT="hang@3:1"                rank 1 stops responding before step 3
    DDPTRAIN_FAILPOINT="kill@5:1"                rank 1 is SIGKILLed before step 5
    DDPTRAIN_FAILPOINT="kill_in_checkpoint@4:0"  rank 0 is SIGKILLed half-way through writing
                                                 the checkpoint of step 4
    DDPTRAIN_FAILPOINT="slow@1:0"                rank 0 sleeps SLOW_STEP_S before every step from
                                                 step 1 on (a run slow enough for a test to act
                                                 on it mid-run: kill a node, add one)

Steps count from 1 (the step being run or saved); the rank defaults to 0. Several failpoints are
separated by commas. A failpoint fires once per run dir, so a restarted run can show that it
recovers: before firing, it leaves a marker in `<run.dir>/.failpoints/`, and a failpoint with a
marker never fires again. The marker, not TORCHELASTIC_RESTART_COUNT, is what tells a restart: torch's
agent counts only failed attempts, so the restart after a node joins keeps the count, and the
joining node's workers start at 0 while the others are at 1. `slow` is no fault and holds in every
attempt.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Callable, Iterator

from torch import nn

from ddptrain.runs.layout import FAILPOINTS

ENV = "DDPTRAIN_FAILPOINT"
KINDS = ("nan", "hang", "kill", "kill_in_checkpoint", "slow")
SLOW_STEP_S = 0.1


class FaultInjector:
    """The failpoints of one rank, parsed from the environment."""

    def __init__(self, points: set[tuple[str, int]], rank: int = 0, run_dir: str | Path | None = None):
        self.points = points  # (kind, step) for this rank
        self.rank = rank
        self.markers = Path(run_dir) / FAILPOINTS if run_dir is not None else None
        self.slow_from = min((step for kind, step in points if kind == "slow"), default=None)

    @classmethod
    def from_env(cls, rank: int, run_dir: str | Path | None = None) -> "FaultInjector | None":
        """The injector for `rank`, or None when no failpoint is set. Without a run dir a failpoint
        fires in every attempt."""
        spec = os.environ.get(ENV, "")
        if not spec:
            return None
        points = set()
        for item in filter(None, (part.strip() for part in spec.split(","))):
            kind, _, where = item.partition("@")
            step, _, at_rank = where.partition(":")
            if kind not in KINDS or not step.isdigit() or not (at_rank or "0").isdigit():
                raise ValueError(f"{ENV}={spec!r}: {item!r} is not KIND@STEP[:RANK] with KIND one of "
                                 f"{', '.join(KINDS)}")
            if int(at_rank or 0) == rank:
                points.add((kind, int(step)))
        return cls(points, rank, run_dir)

    def _fires(self, kind: str, step: int) -> bool:
        """Is (kind, step) a failpoint of this rank that has not fired in this run dir yet? If so it
        is marked as fired (before it fires: a kill leaves no time after)."""
        if (kind, step) not in self.points:
            return False
        if self.markers is None:
            return True
        marker = self.markers / f"{kind}@{step}:{self.rank}"
        if marker.exists():
            return False
        self.markers.mkdir(parents=True, exist_ok=True)
        marker.write_text(f"fired at pid {os.getpid()}\n")
        return True

    @contextlib.contextmanager
    def around_step(self, step: int, model: nn.Module) -> Iterator[None]:
        """Before step `step`: slow down, hang or die; during it: NaN logits."""
        if self.slow_from is not None and step >= self.slow_from:
            time.sleep(SLOW_STEP_S)
        if self._fires("hang", step):
            time.sleep(3600)
        if self._fires("kill", step):
            _kill_self()
        hook = None
        if self._fires("nan", step):
            hook = model.register_forward_hook(lambda module, args, out: out * float("nan"))
        try:
            yield
        finally:
            if hook is not None:
                hook.remove()

    def in_checkpoint(self, step: int) -> Callable[[], None] | None:
        """What to call half-way through writing the checkpoint of `step` (None: nothing)."""
        return _kill_self if self._fires("kill_in_checkpoint", step) else None


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
