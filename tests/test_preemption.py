"""The preemption watchdog (ddptrain/train/preemption.py): a signalled rank whose steps still move
waits for the next preemption check, however many steps away; one that reaches no step boundary
within checkpoint.preempt_grace_s exits 128 + signal."""

from __future__ import annotations

import signal
import subprocess
import sys

# Signalled at once, then 12 step boundaries 0.2 s apart (2.4 s, against a 0.5 s grace) without a
# preemption check among them (check_every=1000), then none: the watchdog must let the moving
# steps be and end the process only in the still part.
_RANK = """
import os, signal, time, torch
from ddptrain.train.preemption import PreemptionWatcher
watcher = PreemptionWatcher(["SIGUSR1"], torch.device("cpu"), grace_s=0.5, check_every=1000)
os.kill(os.getpid(), signal.SIGUSR1)
for step in range(1, 13):
    time.sleep(0.2)
    assert not watcher.should_stop_at(step)
print("steps moved", flush=True)
time.sleep(10)
print("not stopped", flush=True)
"""


def test_a_signalled_rank_whose_steps_move_is_not_stopped_before_its_next_check():
    result = subprocess.run([sys.executable, "-c", _RANK], capture_output=True, text=True, timeout=120)
    assert "steps moved" in result.stdout, result.stderr[-3000:]
    assert "not stopped" not in result.stdout
    assert result.returncode == 128 + signal.SIGUSR1, result.stderr[-3000:]
    assert "no step boundary was reached within checkpoint.preempt_grace_s=0.5s" in result.stderr
