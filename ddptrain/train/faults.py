"""Fault injection for the crash tests: a component the trainer installs only when
DDPTRAIN_FAILPOINT is set (parsed once, at start-up).

    DDPTRAIN_FAILPOINT="nan@5:1"                 rank 1 produces NaN logits at step 5
    DDPTRAIN_FAILPOINT="hang@3:1"                rank 1 stops responding before step 3
    DDPTRAIN_FAILPOINT="kill@5:1"                rank 1 is SIGKILLed before step 5
    DDPTRAIN_FAILPOINT="kill_in_checkpoint@4:0"  rank 0 is SIGKILLed half-way through writing
                                                 the checkpoint of step 4

Steps count from 1 (the step being run or saved); the rank defaults to 0. Several failpoints are
separated by commas. A failpoint fires only in the first attempt of a run (not after a torchrun
restart), so a restarted run can show that it recovers.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Callable, Iterator

from torch import nn

ENV = "DDPTRAIN_FAILPOINT"
KINDS = ("nan", "hang", "kill", "kill_in_checkpoint")


class FaultInjector:
    """The failpoints of one rank, parsed from the environment."""

    def __init__(self, points: set[tuple[str, int]]):
        self.points = points  # (kind, step) for this rank

    @classmethod
    def from_env(cls, rank: int) -> "FaultInjector | None":
        """The injector for `rank`, or None when no failpoint is set (or after a torchrun restart)."""
        spec = os.environ.get(ENV, "")
        if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
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
        return cls(points)

    @contextlib.contextmanager
    def around_step(self, step: int, model: nn.Module) -> Iterator[None]:
        """Before step `step`: hang or die; during it: NaN logits."""
        if ("hang", step) in self.points:
            time.sleep(3600)
        if ("kill", step) in self.points:
            _kill_self()
        hook = None
        if ("nan", step) in self.points:
            hook = model.register_forward_hook(lambda module, args, out: out * float("nan"))
        try:
            yield
        finally:
            if hook is not None:
                hook.remove()

    def in_checkpoint(self, step: int) -> Callable[[], None] | None:
        """What to call half-way through writing the checkpoint of `step` (None: nothing)."""
        return _kill_self if ("kill_in_checkpoint", step) in self.points else None


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
