"""Checkpoints that survive crashes and preemption: real runs, real kills, real signals."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import time

import pytest
import torch

from ddptrain.runs import store as ckpt
from ddptrain.testing import free_port
from tests.helpers import REPO, RESUME_RUN, import_deepspeed, python_command, read_metrics, run_cli, straight_run
from tests.zygote import launch_command

pytestmark = pytest.mark.slow

# Constant LR so that a run of N steps and the first N steps of a longer run are the same run.
RUN = [*RESUME_RUN, "dist.timeout_s=60"]


def final_weights(run_dir, step: int) -> dict[str, torch.Tensor]:
    return ckpt.read_weights(run_dir / "checkpoints" / ckpt.step_name(step))


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs"


def losses(run_dir) -> list[float]:
    return [m["loss"] for m in read_metrics(run_dir)]


def train(run_dir, *overrides, nproc=2, env=None, torchrun_args=(), check=True):
    args = [*RUN, f"run.dir={run_dir}", *overrides]
    if torchrun_args:
        cmd = python_command(["-m", "ddptrain", *args], nproc=nproc, torchrun_args=torchrun_args)
        result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240,
                                env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    else:
        result = run_cli(args, nproc=nproc, env=env)
    if check:
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted reference: 2 ranks, 12 steps, checkpoints every 3."""
    return straight_run(tmp_path_factory, "straight", [*RUN, "trainer.max_steps=12", "checkpoint.every=3",
                                                       "checkpoint.keep=5"])


@pytest.fixture(scope="module")
def six_steps(tmp_path_factory):
    """The first launch of a resumed run: 2 ranks, 6 steps, checkpoints every 3; a test resumes a copy of it."""
    run_dir = tmp_path_factory.mktemp("six-steps") / "run"
    train(run_dir, "trainer.max_steps=6", "checkpoint.every=3")
    return run_dir


def test_resume_is_bitwise_exact(straight, six_steps, tmp_path):
    shutil.copytree(six_steps, tmp_path, dirs_exist_ok=True)
    train(tmp_path, "trainer.max_steps=12", "checkpoint.every=3")
    assert "resumed from" in (tmp_path / "train.log").read_text()
    assert [m["step"] for m in read_metrics(tmp_path)] == list(range(1, 13))
    assert losses(tmp_path) == losses(straight)
    assert_bitwise_equal(final_weights(tmp_path, 12), final_weights(straight, 12))
    assert len(ckpt.list_checkpoints(tmp_path)) == 2, "checkpoint.keep=2 keeps the newest two"


def test_sigkilled_worker_restarts_and_matches(straight, tmp_path):
    result = train(tmp_path, "trainer.max_steps=12", "checkpoint.every=3", env={"DDPTRAIN_FAILPOINT": "kill@8:1"},
                   torchrun_args=["--max-restarts=1"])
    assert "Signals.SIGKILL" in result.stderr or "exitcode  : -9" in result.stderr or "restart" in result.stderr.lower()
    log = (tmp_path / "train.log").read_text()
    assert "resumed from" in log and "step_00000006" in log
    assert_bitwise_equal(final_weights(tmp_path, 12), final_weights(straight, 12))
    assert losses(tmp_path) == losses(straight)


def test_kill_while_writing_a_checkpoint_falls_back_to_the_previous(straight, tmp_path):
    train(tmp_path, "trainer.max_steps=12", "checkpoint.every=3",
          env={"DDPTRAIN_FAILPOINT": "kill_in_checkpoint@6:0"}, torchrun_args=["--max-restarts=1"])
    log = (tmp_path / "train.log").read_text()
    assert "step_00000003" in log.split("resumed from", 1)[1].splitlines()[0], "must resume from step 3"
    assert_bitwise_equal(final_weights(tmp_path, 12), final_weights(straight, 12))


def test_async_saves_commit_in_the_background_and_resume_bitwise(straight, tmp_path):
    train(tmp_path, "trainer.max_steps=7", "checkpoint.every=3", "checkpoint.async_save=true", "checkpoint.keep=5")
    assert [step for step, _ in ckpt.list_checkpoints(tmp_path)] == [3, 6, 7], "every background save committed"
    log = (tmp_path / "train.log").read_text()
    assert log.count("checkpoint of step 3 saved") == 1 and log.count("checkpoint of step 6 saved") == 1
    train(tmp_path, "trainer.max_steps=12", "checkpoint.every=3", "checkpoint.async_save=true",
          "checkpoint.resume=" + str(ckpt.checkpoint_dir(tmp_path) / ckpt.step_name(6)))
    assert losses(tmp_path) == losses(straight)
    assert_bitwise_equal(final_weights(tmp_path, 12), final_weights(straight, 12))


def test_a_kill_during_an_async_save_resumes_from_the_previous_checkpoint_bitwise(straight, tmp_path):
    """Rank 0 is SIGKILLed right after the background write of step 6 started: step 6 never
    becomes complete, and the restart resumes from step 3."""
    train(tmp_path, "trainer.max_steps=12", "checkpoint.every=3", "checkpoint.async_save=true",
          env={"DDPTRAIN_FAILPOINT": "kill_in_checkpoint@6:0"}, torchrun_args=["--max-restarts=1"])
    log = (tmp_path / "train.log").read_text()
    assert "step_00000003" in log.split("resumed from", 1)[1].splitlines()[0], "must resume from step 3"
    assert [m["step"] for m in read_metrics(tmp_path)] == list(range(1, 13))
    assert losses(tmp_path) == losses(straight)
    assert_bitwise_equal(final_weights(tmp_path, 12), final_weights(straight, 12))


@pytest.fixture(scope="module")
def nine_steps(tmp_path_factory):
    """A 1-rank run with checkpoints at steps 3, 6 and 9, for tests that damage a copy of it."""
    run_dir = tmp_path_factory.mktemp("nine-steps") / "run"
    train(run_dir, "trainer.max_steps=9", "checkpoint.every=3", "checkpoint.keep=5", nproc=1)
    return run_dir


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupted_newest_checkpoint_is_named_and_skipped(nine_steps, tmp_path, damage):
    shutil.copytree(nine_steps, tmp_path, dirs_exist_ok=True)
    bad = tmp_path / "checkpoints" / ckpt.step_name(9) / "trainer.pt"
    data = bytearray(bad.read_bytes())
    bad.write_bytes(data[: len(data) // 2] if damage == "truncate" else data[:100] + bytes(b ^ 0xFF for b in data[100:140]) + data[140:])
    result = train(tmp_path, "trainer.max_steps=12", "checkpoint.every=3", "checkpoint.keep=5", nproc=1)
    output = result.stdout + result.stderr
    assert str(bad) in output and "corrupted" in output, output[-3000:]
    assert "step_00000006" in (tmp_path / "train.log").read_text().split("resumed from", 1)[1].splitlines()[0]


def _final_weights_file(run_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(run_dir / "final" / "model.safetensors")


def test_a_rollback_moves_the_abandoned_trajectory_aside_and_auto_resumes_the_new_one(nine_steps, tmp_path):
    """Resumed on 2 ranks from step 3 of a 9-step run with another learning rate, the run moves the
    abandoned trajectory's later checkpoints and final/ to previous/ (rank 0, the other waiting),
    then dies at step 8; `auto` resumes its own step 6, not the abandoned step 9, and finishes it."""
    shutil.copytree(nine_steps, tmp_path, dirs_exist_ok=True)
    root = ckpt.checkpoint_dir(tmp_path)
    old = {step: ckpt.read_weights(root / ckpt.step_name(step)) for step in (6, 9)}
    old_final = _final_weights_file(tmp_path)
    relaunch = ["trainer.max_steps=9", "checkpoint.every=3", "checkpoint.keep=5", "optim.lr=0.01"]
    rolled = train(tmp_path, *relaunch, f"checkpoint.resume={root / ckpt.step_name(3)}", nproc=2,
                   env={"DDPTRAIN_FAILPOINT": "kill@8:1"}, check=False)
    assert rolled.returncode != 0, rolled.stderr[-3000:]
    (previous,) = (tmp_path / "previous").iterdir()
    assert ("checkpoints of steps (6, 9) and final/ of step 9 come after step 3, the one this run continues from "
            f"(an abandoned trajectory's, or ones that did not verify): moved to {previous}") in rolled.stderr, \
        rolled.stderr[-3000:]
    for step in (6, 9):
        ckpt.verify(ckpt.checkpoint_dir(previous) / ckpt.step_name(step))
        assert_bitwise_equal(ckpt.read_weights(ckpt.checkpoint_dir(previous) / ckpt.step_name(step)), old[step])
    assert_bitwise_equal(_final_weights_file(previous), old_final)
    assert [m["step"] for m in read_metrics(previous)] == list(range(1, 10)), "the abandoned curve is kept"
    assert [step for step, _ in ckpt.list_checkpoints(tmp_path)] == [3, 6], "the new trajectory's step 6"

    train(tmp_path, *relaunch, nproc=1)  # checkpoint.resume=auto
    log = (tmp_path / "train.log").read_text()
    assert ckpt.step_name(6) in log.rsplit("resumed from", 1)[1].splitlines()[0], "auto takes the new step 6"
    step9 = root / ckpt.step_name(9)
    assert ckpt.load_trainer_state(step9)["config"]["optim"]["lr"] == 0.01
    new9, final = ckpt.read_weights(step9), _final_weights_file(tmp_path)
    assert any(not torch.equal(new9[key], old[9][key]) for key in old[9]), "step 9 of the new trajectory"
    assert all(torch.equal(final[key], new9[key]) for key in final), "final/ holds the new step 9"
    assert [m["step"] for m in read_metrics(tmp_path)] == list(range(1, 10))
    assert [m["lr"] for m in read_metrics(tmp_path)[3:]] == [0.01] * 6


def test_a_relaunch_with_nothing_left_to_do_applies_no_change_and_keeps_config_and_final(nine_steps, tmp_path):
    shutil.copytree(nine_steps, tmp_path, dirs_exist_ok=True)
    config, marker = (tmp_path / "config.yaml").read_text(), tmp_path / "final" / "ddptrain_model.json"
    written = marker.stat().st_mtime_ns
    result = train(tmp_path, "trainer.max_steps=9", "checkpoint.every=3", "checkpoint.keep=5", "optim.lr=0.01",
                   nproc=1)
    assert "nothing to do: this run already finished at step 9" in result.stderr, result.stderr[-3000:]
    assert "(applied)" not in result.stderr, "no setting of this launch is used"
    assert (tmp_path / "config.yaml").read_text() == config
    assert marker.stat().st_mtime_ns == written, "this run's final/ of step 9 is kept"


def test_a_resume_from_another_runs_checkpoint_moves_the_run_dirs_earlier_run_aside(nine_steps, tmp_path):
    run_dir = tmp_path / "run"
    train(run_dir, "trainer.max_steps=9", "checkpoint.every=3", "run.seed=7", nproc=1)
    resume = ckpt.checkpoint_dir(nine_steps) / ckpt.step_name(6)
    result = train(run_dir, "trainer.max_steps=9", "checkpoint.every=3", f"checkpoint.resume={resume}", nproc=1)
    assert f"held an earlier run; checkpoint.resume={resume} is not one of its checkpoints, so it was moved to" \
        in result.stderr, result.stderr[-3000:]
    (previous,) = (run_dir / "previous").iterdir()
    assert [m["step"] for m in read_metrics(previous)] == list(range(1, 10))
    assert [step for step, _ in ckpt.list_checkpoints(previous)] == [6, 9]
    assert [m["step"] for m in read_metrics(run_dir)] == [7, 8, 9], "no line of the seed-7 run"
    assert losses(run_dir) == losses(nine_steps)[6:]
    assert [step for step, _ in ckpt.list_checkpoints(run_dir)] == [9]
    assert_bitwise_equal(_final_weights_file(run_dir), _final_weights_file(nine_steps))


def _start_ranks(run_dir, overrides, world_size=2):
    """Two plain `python -m ddptrain` processes forming one group, so each exit code is visible."""
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size)}
        procs.append(subprocess.Popen([*launch_command(["-m", "ddptrain"]), *RUN, f"run.dir={run_dir}", *overrides],
                                      cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def _wait_for_step(run_dir, step: int, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        path = run_dir / "metrics.jsonl"
        if path.exists():
            lines = [line for line in path.read_text().splitlines() if line.strip()]
            if lines and json.loads(lines[-1])["step"] >= step:
                return json.loads(lines[-1])["step"]
        time.sleep(0.01)
    raise TimeoutError(f"step {step} never logged")


def test_sigterm_to_one_rank_checkpoints_and_exits_with_the_documented_code(tmp_path):
    steps = ["trainer.max_steps=60"]
    reference = tmp_path / "reference"
    train(reference, *steps, "checkpoint.every=60")
    run_dir = tmp_path / "run"
    procs = _start_ranks(run_dir, steps)
    seen = _wait_for_step(run_dir, 3)
    procs[1].send_signal(signal.SIGTERM)
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [75, 75], outputs
    saved = [step for step, _ in ckpt.list_checkpoints(run_dir)]
    assert len(saved) == 1 and seen <= saved[0] <= seen + 2, (seen, saved)
    assert "preempted by SIGTERM" in outputs[1] or "preempted by" in outputs[0]
    train(run_dir, *steps, "checkpoint.every=60")
    assert_bitwise_equal(final_weights(run_dir, 60), final_weights(reference, 60))


def test_resume_on_fewer_ranks_continues_the_same_samples(straight, six_steps, tmp_path):
    shutil.copytree(six_steps, tmp_path, dirs_exist_ok=True)
    train(tmp_path, "trainer.max_steps=12", "checkpoint.every=3", nproc=1)
    mine, reference = read_metrics(tmp_path), read_metrics(straight)
    assert [m["samples_seen"] for m in mine] == [m["samples_seen"] for m in reference]
    assert [m["tokens"] for m in mine] == [m["tokens"] for m in reference]
    for a, b in zip(mine, reference):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-4), (a["step"], a["loss"], b["loss"])


def test_nan_on_one_rank_is_skipped_by_all_ranks(tmp_path):
    train(tmp_path, "trainer.max_steps=6", "checkpoint.every=2", env={"DDPTRAIN_FAILPOINT": "nan@3:1"})
    metrics = read_metrics(tmp_path)
    assert metrics[2]["loss"] is None and [m["skipped_steps"] for m in metrics] == [0, 0, 1, 1, 1, 1]
    assert all(m["loss"] is not None and math.isfinite(m["loss"]) for m in metrics[3:])
    for value in final_weights(tmp_path, 6).values():
        assert torch.isfinite(value).all()


def test_nan_with_stop_policy_exits_on_every_rank_and_keeps_the_last_checkpoint(tmp_path):
    result = train(tmp_path, "trainer.max_steps=6", "checkpoint.every=2", "trainer.nonfinite=stop",
                   env={"DDPTRAIN_FAILPOINT": "nan@3:1"}, check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert output.count("non-finite gradient norm") >= 2, output[-3000:]
    assert [step for step, _ in ckpt.list_checkpoints(tmp_path)] == [2]
    ckpt.verify(tmp_path / "checkpoints" / ckpt.step_name(2))


def test_stuck_peer_fails_within_the_timeout_naming_the_step(tmp_path):
    # the stuck rank, SIGTERMed by torchrun, waits checkpoint.preempt_grace_s for a step boundary it
    # never reaches (25 s by default; test_rundir tests that wait): 2 s here. dist.timeout_s=30 ends the
    # wait (10x what a healthy collective of a loaded machine takes); the default (600 s) would outlast the
    # command's own limit (300 s), which fails the test: no wall-clock bound of ours is needed.
    result = train(tmp_path, "trainer.max_steps=6", "dist.timeout_s=30", "checkpoint.preempt_grace_s=2",
                   env={"DDPTRAIN_FAILPOINT": "hang@3:1"}, check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "step 3 failed on rank 0" in output, output[-4000:]


def test_explicit_resume_path_that_is_incomplete_is_a_clear_error(tmp_path):
    (tmp_path / "checkpoints" / "step_00000004").mkdir(parents=True)
    result = train(tmp_path, "trainer.max_steps=6", f"checkpoint.resume={tmp_path}/checkpoints/step_00000004",
                   nproc=1, check=False)
    assert result.returncode != 0
    assert "has no COMPLETE.json" in result.stdout + result.stderr


def test_zero2_resume_is_bitwise_exact(tmp_path):
    import_deepspeed()
    zero = ["strategy=zero2", "checkpoint.every=3"]
    train(tmp_path / "straight", "trainer.max_steps=6", *zero)
    train(tmp_path / "resumed", "trainer.max_steps=3", *zero)
    train(tmp_path / "resumed", "trainer.max_steps=6", *zero)
    assert "resumed from" in (tmp_path / "resumed" / "train.log").read_text()
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")
    assert_bitwise_equal(*(final_weights(tmp_path / run, 6) for run in ("straight", "resumed")))
