"""The preemption watchdog (ddptrain/train/preemption.py): a signalled rank whose steps still move
waits for the next preemption check, however many steps away; one that reaches no step boundary
within checkpoint.preempt_grace_s exits 128 + signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

# Signalled at once, then 100 step boundaries 0.02 s apart (2 s, against a 0.5 s grace) without a
# preemption check among them (check_every=1000), then none: the watchdog must let the moving
# steps be and end the process only in the still part. A step 25x shorter than the grace, and a
# still part 20x longer: a loaded machine that wakes a sleeper late changes neither verdict.
_RANK = """
import os, signal, time, torch
from ddptrain.train.preemption import PreemptionWatcher
watcher = PreemptionWatcher(["SIGUSR1"], torch.device("cpu"), grace_s=0.5, check_every=1000)
os.kill(os.getpid(), signal.SIGUSR1)
for step in range(1, 101):
    time.sleep(0.02)
    assert not watcher.should_stop_at(step)
print("steps moved", flush=True)
time.sleep(10)
print("not stopped", flush=True)
"""


@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_a_signalled_rank_whose_steps_move_is_not_stopped_before_its_next_check():
    result = subprocess.run([sys.executable, "-c", _RANK], capture_output=True, text=True, timeout=120)
    assert "steps moved" in result.stdout, result.stderr[-3000:]
    assert "not stopped" not in result.stdout
    assert result.returncode == 128 + signal.SIGUSR1, result.stderr[-3000:]
    assert "no step boundary was reached within checkpoint.preempt_grace_s=0.5s" in result.stderr


# A run whose checkpoints take longer than the grace period to write (a slow disk), with SIGUSR1 on
# its last rank before its first step; the test's overrides follow the run dir on the command line.
_SLOW_SAVES = """
import os, signal, sys, time
from ddptrain.config.compose import compose_config
from ddptrain.distributed import barrier, get_rank, get_world_size, init_distributed, setup_logging
from ddptrain.train.builder import validate_run
from ddptrain.train.trainer import Trainer
from tests.helpers import TINY_RUN
setup_logging()
cfg = compose_config([*TINY_RUN, "batch.seq_len=32", "batch.global_size=4", "batch.micro_size=2",
                      "checkpoint.preempt_grace_s=1", f"run.dir={sys.argv[1]}", *sys.argv[2:]])
validate_run(cfg, int(os.environ.get("WORLD_SIZE", 1)))
trainer = Trainer(cfg, init_distributed()).build()
write = trainer.checkpointer.save
signalled = get_rank() == get_world_size() - 1
in_save = os.environ.get("SIGNAL_IN_SAVE") == "1"  # else before the first step
def slow_write(*args, **kwargs):  # a disk slower than the grace period
    if signalled and in_save and not trainer.preemption.received:
        os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(2)
    return write(*args, **kwargs)
trainer.checkpointer.save = slow_write
if signalled and not in_save:
    os.kill(os.getpid(), signal.SIGUSR1)
try:
    trainer.fit()
except SystemExit as stop:  # a preemption: said by every rank before torchrun stops the others
    print(f"rank {get_rank()} exits with code {stop.code}", flush=True)
    barrier()
    raise
finally:
    trainer.close()
print("finished at step", trainer.step, flush=True)
"""


def _slow_saves(run_dir, *overrides: str, nproc: int = 1, in_save: bool = False) -> subprocess.CompletedProcess:
    from tests.helpers import REPO

    script = run_dir.parent / "slow_saves.py"
    script.write_text(_SLOW_SAVES)
    launch = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                  f"--nproc_per_node={nproc}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "SIGNAL_IN_SAVE": "1" if in_save else "0"}
    return subprocess.run([*launch, str(script), str(run_dir), *overrides], capture_output=True, text=True,
                          timeout=240, cwd=REPO, env=env)


@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_a_signal_in_the_last_steps_before_any_check_lets_the_final_saves_finish(tmp_path):
    """Before, the watchdog timed the last step's saves with its grace period (no check had begun a
    preemption checkpoint, which stands it down): a slow save was cut short, exit 138, and a run
    with checkpoint.every=0 kept nothing. The run gets its signal before its first preemption check
    (check_every 10 > max_steps 3) and ends at its last step instead."""
    run_dir = tmp_path / "run"
    result = _slow_saves(run_dir, "trainer.max_steps=3", "checkpoint.preempt_check_every=10")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "finished at step 3" in result.stdout
    assert (run_dir / "final").is_dir() and [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_00000003"]
    assert "SIGUSR1 received, and the run reached its last step, 3, before its next preemption check " \
           "(checkpoint.preempt_check_every=10)" in result.stderr


@pytest.mark.parametrize("every, check_every", [(3, 5), (5, 5)], ids=["off-the-check-schedule", "on-a-check-step"])
@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_a_scheduled_checkpoint_after_a_signal_is_the_preemption_checkpoint(tmp_path, every, check_every):
    """2 ranks, SIGUSR1 on rank 1 only, saves slower than the grace period. Before, the step's
    checkpoint.every save ran on the watchdog's clock (the check came after it, or not at that step
    at all): rank 1 exited 138 in the middle of it and no checkpoint was left. Now the ranks agree
    before the save that they stop: it is the preemption checkpoint, unhurried, and both exit 75."""
    run_dir = tmp_path / "run"
    result = _slow_saves(run_dir, "trainer.max_steps=8", f"checkpoint.every={every}",
                         f"checkpoint.preempt_check_every={check_every}", nproc=2)
    assert "no step boundary was reached" not in result.stderr, result.stderr[-3000:]
    assert "rank 0 exits with code 75" in result.stdout and "rank 1 exits with code 75" in result.stdout, \
        result.stderr[-3000:]
    assert f"preempted by SIGUSR1 at step {every} (resumes from step_{every:08d})" in result.stderr
    assert "preempted by a signal on another rank at step" in result.stderr  # rank 0 stopped with rank 1
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == [f"step_{every:08d}"]
    assert (run_dir / "final").is_dir()


@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_a_signal_during_a_scheduled_save_is_answered_by_that_checkpoint(tmp_path):
    """2 ranks, SIGUSR1 on rank 1 as the checkpoint of step 2 begins, saves slower than the grace
    period, no preemption check before step 5. Before, the signal started the watchdog's clock in
    the middle of the save: rank 1 exited 138 with step 2's checkpoint half written, and the run fell
    back to none at all. Now the save finishes, the ranks ask again after it, and that checkpoint is
    the preemption checkpoint: both exit 75 at step 2, with no second save."""
    run_dir = tmp_path / "run"
    result = _slow_saves(run_dir, "trainer.max_steps=8", "checkpoint.every=2", "checkpoint.preempt_check_every=5",
                         nproc=2, in_save=True)
    assert "no step boundary was reached" not in result.stderr, result.stderr[-3000:]
    assert "rank 0 exits with code 75" in result.stdout and "rank 1 exits with code 75" in result.stdout, \
        result.stderr[-3000:]
    assert "preempted by SIGUSR1 at step 2 (resumes from step_00000002)" in result.stderr
    assert "preempted by a signal on another rank at step 2" in result.stderr
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_00000002"]
    assert result.stderr.count("checkpoint of step 2 saved") == 1 and (run_dir / "final").is_dir()
