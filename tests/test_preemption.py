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


# A run that gets its signal before its first preemption check (check_every 10 > max_steps 3) ends
# at its last step instead; that step's checkpoint takes longer than the grace period to write.
_LAST_STEPS = """
import os, signal, sys, time
from ddptrain.config.compose import compose_config
from ddptrain.distributed import init_distributed, setup_logging
from ddptrain.train.builder import validate_run
from ddptrain.train.trainer import Trainer
from tests.helpers import TINY_RUN
setup_logging()
cfg = compose_config([*TINY_RUN, "batch.seq_len=32", "batch.global_size=4", "batch.micro_size=2", "trainer.max_steps=3",
                      "checkpoint.preempt_check_every=10", "checkpoint.preempt_grace_s=1", f"run.dir={sys.argv[1]}"])
validate_run(cfg, 1)
trainer = Trainer(cfg, init_distributed()).build()
write = trainer.checkpointer.save
def slow_write(*args, **kwargs):  # a disk slower than the grace period
    time.sleep(2)
    return write(*args, **kwargs)
trainer.checkpointer.save = slow_write
os.kill(os.getpid(), signal.SIGUSR1)
try:
    trainer.fit()
finally:
    trainer.close()
print("finished at step", trainer.step, flush=True)
"""


def test_a_signal_in_the_last_steps_before_any_check_lets_the_final_saves_finish(tmp_path):
    """Before, the watchdog timed the last step's saves with its grace period (no check had begun a
    preemption checkpoint, which stands it down): a slow save was cut short, exit 138, and a run
    with checkpoint.every=0 kept nothing."""
    from tests.helpers import REPO

    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-c", _LAST_STEPS, str(run_dir)], capture_output=True, text=True,
                            timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "finished at step 3" in result.stdout
    assert (run_dir / "final").is_dir() and [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_00000003"]
    assert "SIGUSR1 received, and the run reached its last step, 3, before its next preemption check " \
           "(checkpoint.preempt_check_every=10)" in result.stderr
