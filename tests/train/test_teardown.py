"""A finished run exits 0, always: ddptrain's own threads are joined in close, in a fixed order, before
the process group is destroyed."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

import pytest
import torch

from ddptrain.train.preemption import PreemptionWatcher
from ddptrain.runs.lock import RunDirLock


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


_PROBE = """
import gc, os, runpy, sys
import ddptrain.__main__  # as a library: the collector is left alone
print("imported", gc.isenabled(), gc.get_freeze_count(), flush=True)
real_exit = os._exit
def report(code):
    print("ran", gc.isenabled(), gc.get_freeze_count(), flush=True)
    real_exit(code)
os._exit = report  # ddptrain's __main__ ends the process with os._exit
sys.argv = ["ddptrain", "--cfg", "job"]  # Hydra prints the job's config and returns
runpy.run_module("ddptrain", run_name="__main__", alter_sys=True)
"""


@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_a_rank_collects_garbage_again_after_its_imports_with_them_frozen():
    """`python -m ddptrain` pauses the collector through its imports; it must be running again,
    with the imports' objects frozen, when the run starts (and importing the module changes nothing)."""
    result = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    states = {line.split()[0]: line.split()[1:] for line in result.stdout.splitlines()
              if line.split()[:1] in (["imported"], ["ran"])}
    assert states["imported"] == ["True", "0"], states
    enabled, frozen = states["ran"]
    assert enabled == "True" and int(frozen) > 100_000, states
