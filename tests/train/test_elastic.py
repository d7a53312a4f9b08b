"""Live elasticity: torchrun agents (`--nnodes=1:2`, c10d rendezvous on 127.0.0.1) that leave and
join a running job, and the run's loss curve is still that of a straight run.

Each agent is one "node" with one CPU rank. The recipe is the one docs/slurm-and-docker.md gives:
`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`, without which torch 2.13's agent cannot take a joining
node (its rank 0 keeps the first round's store address and never publishes it again). The
`slow@1:0` failpoint makes every step take at least 0.1 s, so the test can act mid-run.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddptrain.testing import free_port
from ddptrain.train.faults import FaultInjector
from tests.helpers import REPO, TINY_RUN, read_metrics, straight_run

MAX_STEPS = 160
RUN = [*TINY_RUN, "batch.seq_len=32", "batch.global_size=4", "batch.micro_size=1", "optim.schedule=constant",
       "trainer.precision=fp64", "trainer.eval_examples=4", "checkpoint.every=5", "checkpoint.keep=2",
       "dist.timeout_s=30", f"trainer.max_steps={MAX_STEPS}"]
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "DDPTRAIN_FAILPOINT": "slow@1:0",
               "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def start_agent(run_dir: Path, port: int, name: str, is_host: bool) -> subprocess.Popen:
    """One node: a torchrun agent with one rank, in its own session (its log is run_dir/../NAME.log)."""
    conf = f"last_call_timeout=2,join_timeout=120,keep_alive_interval=2,keep_alive_max_attempt=3,is_host={int(is_host)}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic", f"--rdzv-conf={conf}",
           "--max-restarts=3", "--monitor-interval=0.5", "-m", "ddptrain", *RUN, f"run.dir={run_dir}"]
    log = open(run_dir.parent / f"{name}.log", "w")
    return subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **ELASTIC_ENV}, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_node(agent: subprocess.Popen) -> None:
    """SIGKILL an agent and its workers at once, as a node that is lost (torchrun starts each
    worker in a session of its own, so the agent's process group does not hold them)."""
    for pid in [agent.pid, *descendants(agent.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    agent.wait(timeout=30)


def wait_for(condition, what: str, timeout: float, agents: list[subprocess.Popen]):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if all(agent.poll() is not None for agent in agents):
            break
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def logged(run_dir: Path) -> list[dict]:
    try:
        return read_metrics(run_dir)
    except (FileNotFoundError, ValueError):  # not yet written, or a line being written
        return []


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> list[dict]:
    """The uninterrupted reference: 2 ranks from start to end."""
    return read_metrics(straight_run(tmp_path_factory, "straight", RUN))


@pytest.mark.slow
def test_a_node_lost_then_one_joining_keep_the_straight_runs_curve(straight, tmp_path):
    """2 nodes; one is SIGKILLed mid-run (the survivor redoes the steps after the last checkpoint
    on 1 rank); a node joins again (torchrun SIGTERMs the workers, which checkpoint the step they
    finished and resume on 2 ranks). One metrics line per step, each loss the straight run's."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    port = free_port()
    agents = [start_agent(run_dir, port, "node_a", is_host=True)]
    try:
        time.sleep(1)  # node a hosts the rendezvous store
        agents.append(start_agent(run_dir, port, "node_b", is_host=False))
        # Kill node b between checkpoints (every 5 steps), so that the survivor must redo steps.
        last_before_kill = wait_for(lambda: next((m["step"] for m in logged(run_dir)[-1:]
                                                  if m["step"] >= 8 and m["step"] % 5 in (1, 2)), None),
                                    "steps on 2 ranks", 600, agents)  # hang guards, not bounds
        kill_node(agents[1])
        wait_for(lambda: any(m["world_size"] == 1 for m in logged(run_dir)), "steps on 1 rank", 600, agents)
        agents.append(start_agent(run_dir, port, "node_c", is_host=False))
        assert agents[0].wait(timeout=600) == 0, (tmp_path / "node_a.log").read_text()[-4000:]
        assert agents[2].wait(timeout=60) == 0, (tmp_path / "node_c.log").read_text()[-4000:]
    finally:
        for agent in agents:
            if agent.poll() is None:
                kill_node(agent)

    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, MAX_STEPS + 1)), "exactly one line per step"
    for mine, reference in zip(metrics, straight):
        assert math.isclose(mine["loss"], reference["loss"], rel_tol=0, abs_tol=1e-9), (mine, reference)
    sizes = [m["world_size"] for m in metrics]
    changes = [sizes[0]] + [b for a, b in zip(sizes, sizes[1:]) if a != b]
    assert changes == [2, 1, 2], f"world sizes by step: {sizes}"

    log = (run_dir / "train.log").read_text()
    resumes = [int(line.split("step_")[1][:8]) for line in log.splitlines() if "resumed from" in line]
    assert len(resumes) == 2, resumes
    assert resumes[0] < last_before_kill, "the survivor redid the steps after the last checkpoint"
    last_on_one = sizes.index(2, sizes.index(1))  # metrics[i] is step i + 1
    preempted = [line for line in log.splitlines() if "preempted by SIGTERM" in line]
    assert preempted and f"at step {last_on_one} " in preempted[-1], preempted
    assert resumes[1] == last_on_one, "the join lost no finished step: 2 ranks resume after the last step on 1"
    assert log.count(f"checkpoint of step {last_on_one} saved") == 1


def test_a_failpoint_fires_once_per_run_dir(tmp_path, monkeypatch):
    """Restarts after a node joins keep TORCHELASTIC_RESTART_COUNT; failpoints count on a marker."""
    monkeypatch.setenv("DDPTRAIN_FAILPOINT", "kill_in_checkpoint@4:1,slow@2:1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert FaultInjector.from_env(0, tmp_path).in_checkpoint(4) is None, "rank 0 has no failpoint"
    first, again = FaultInjector.from_env(1, tmp_path), FaultInjector.from_env(1, tmp_path)
    assert first.in_checkpoint(3) is None and first.in_checkpoint(4) is not None
    assert again.in_checkpoint(4) is None, "fired already in this run dir"
    assert FaultInjector.from_env(1, tmp_path / "other").in_checkpoint(4) is not None
    assert first.slow_from == 2


@pytest.mark.slow
def test_sigterm_on_a_scheduled_checkpoint_step_saves_and_logs_it_once(tmp_path):
    """checkpoint.every=1: the step that the preemption checkpoints was just saved on schedule."""
    run = subprocess.Popen([sys.executable, "-m", "ddptrain", *RUN, "checkpoint.every=1", f"run.dir={tmp_path}"],
                           cwd=REPO, env={**os.environ, **ELASTIC_ENV}, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        wait_for(lambda: len(logged(tmp_path)) >= 3, "3 steps", 600, [run])
        run.send_signal(signal.SIGTERM)
        output, _ = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 75, output[-3000:]
    step = read_metrics(tmp_path)[-1]["step"]
    assert f"preempted by SIGTERM at step {step} " in output, output[-3000:]
    assert output.count(f"checkpoint of step {step} saved") == 1, output[-3000:]
