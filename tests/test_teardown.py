"""A finished run exits 0, always (issue 23, item 17): ddptrain's own threads are joined in close,
in a fixed order, before the process group is destroyed."""

from __future__ import annotations

import signal
import threading

import torch

from ddptrain.train.preemption import PreemptionWatcher
from ddptrain.train.rundir import RunDirLock


def _ours() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name in ("preemption-watchdog", "run-dir-heartbeat")]


def test_the_lock_heartbeat_and_the_preemption_watchdog_are_joined_when_closed(tmp_path):
    before = _ours()
    lock = RunDirLock(tmp_path).acquire()
    watcher = PreemptionWatcher(["SIGUSR1"], torch.device("cpu"), grace_s=5.0)
    assert sorted(set(_ours()) - set(before)) == ["preemption-watchdog", "run-dir-heartbeat"]
    watcher.restore()
    lock.release()
    assert _ours() == before, "no thread of ours outlives close"
    assert signal.getsignal(signal.SIGUSR1) is not watcher._handle
