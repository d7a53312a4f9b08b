"""Fault injection for the crash tests, off unless DDPTRAIN_FAILPOINT is set.

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

import os
import signal
import time


def _parse() -> list[tuple[str, int, int]]:
    spec = os.environ.get("DDPTRAIN_FAILPOINT", "")
    points = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        kind, _, where = item.partition("@")
        step, _, rank = where.partition(":")
        points.append((kind, int(step), int(rank or 0)))
    return points


def armed(kind: str, step: int, rank: int) -> bool:
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return False
    return (kind, step, rank) in _parse()


def hang() -> None:
    time.sleep(3600)


def kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
