"""A run directory nobody can corrupt: its lock, workers that die with their launcher, a fresh
start that moves an earlier run aside, config changes on resume, rank-local errors. Full and
read-only filesystems, which need root to mount, are in tests/system/test_filesystems.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from ddptrain.runs import store as ckpt
from ddptrain.runs.lock import LOCK, RunDirLock, RunDirLocked
from tests.helpers import REPO, SMALL_RUN, finished_run, python_command, read_metrics, run_cli, write_earlier_run


def _start(args: list[str], nproc: int, env: dict | None = None) -> subprocess.Popen:
    """torchrun in its own session (so a test can kill the launcher alone, or the whole group)."""
    cmd = python_command(["-m", "ddptrain", *args], nproc=nproc)
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **(env or {})}
    return subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.2)


def _session_pids(sid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    pids.append(int(entry))
            except OSError:
                pass
    return pids


def _lock_holder_alive(run_dir) -> bool:
    try:
        pid = json.loads((run_dir / LOCK).read_text())["pid"]
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, ValueError, KeyError):
        return False


def _logged_steps(run_dir) -> int:
    try:
        return len(read_metrics(run_dir))
    except (OSError, ValueError):
        return 0


def _training(run_dir, overrides: list[str], steps: int, env: dict | None = None) -> subprocess.Popen:
    """SMALL_RUN on 2 ranks in run_dir (its own session), returned once `steps` steps are logged; the
    whole session is killed if they never are."""
    launcher = _start([*SMALL_RUN, *overrides, f"run.dir={run_dir}"], nproc=2, env=env)
    try:
        _wait_for(lambda: _logged_steps(run_dir) >= steps, 600, f"{steps} logged step(s)")  # a hang guard
    except BaseException:
        os.killpg(launcher.pid, signal.SIGKILL)
        raise
    return launcher


# -- the lock -------------------------------------------------------------------------------------


def test_lock_names_a_live_holder_and_takes_over_stale_ones(tmp_path):
    held = RunDirLock(tmp_path).acquire()
    try:
        with pytest.raises(RunDirLocked, match=rf"in use by another run: host {socket.gethostname()}, pid {os.getpid()}"):
            other = RunDirLock(tmp_path)
            other.me["pid"] = os.getpid() + 1  # as another process of this host sees it
            other.acquire()
    finally:
        held.release()
    assert not (tmp_path / LOCK).exists()

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lock = {"host": socket.gethostname(), "pid": int(dead.stdout), "process_start": "1", "started": "earlier"}
    (tmp_path / LOCK).write_text(json.dumps(lock))
    RunDirLock(tmp_path).acquire().release()  # its process is gone: taken over

    (tmp_path / LOCK).write_text(json.dumps({**lock, "host": "another-node", "pid": 1}))
    with pytest.raises(RunDirLocked, match="host another-node"):
        RunDirLock(tmp_path).acquire()  # a fresh heartbeat on another node: alive
    old = time.time() - 120
    os.utime(tmp_path / LOCK, (old, old))
    RunDirLock(tmp_path, stale_after_s=60).acquire().release()  # no heartbeat for 120 s: taken over


@pytest.mark.slow
def test_a_second_launch_on_a_live_run_dir_fails_at_start_up(tmp_path):
    run_dir = tmp_path / "run"
    first = _training(run_dir, ["trainer.max_steps=100000"], steps=1)
    try:
        second = run_cli([*SMALL_RUN, "trainer.max_steps=100000", f"run.dir={run_dir}"], nproc=2)
        assert second.returncode != 0 and "exitcode  : 2" in second.stderr, second.stderr[-3000:]
        assert f"run.dir {run_dir} is in use by another run: host {socket.gethostname()}" in second.stderr
        assert first.poll() is None, "the first run goes on"
        os.kill(first.pid, signal.SIGTERM)  # torchrun forwards it: a preemption checkpoint, then exit
        out, err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert "preempted by SIGTERM" in err, err[-3000:]
    steps = [m["step"] for m in read_metrics(run_dir)]
    assert steps == list(range(1, len(steps) + 1)), "the first run's metrics are whole: no lost or doubled line"
    assert ckpt.list_checkpoints(run_dir)[-1][0] == steps[-1]
    assert not (run_dir / LOCK).exists()


@pytest.mark.slow
def test_workers_do_not_outlive_torchrun_and_the_next_launch_resumes(tmp_path):
    run_dir = tmp_path / "run"
    launcher = _training(run_dir, ["trainer.max_steps=400"], steps=2)
    try:
        os.kill(launcher.pid, signal.SIGKILL)  # torchrun alone: its workers get the parent-death signal
        launcher.wait(timeout=10)
        # torchrun starts its workers in sessions of their own: they are waited for by the run dir's
        # lock, which rank 0 holds until it exits (after its preemption checkpoint)
        _wait_for(lambda: _session_pids(launcher.pid) == [] and not _lock_holder_alive(run_dir), 60,
                  "the orphaned workers to exit")
    finally:
        for pid in _session_pids(launcher.pid):
            os.kill(pid, signal.SIGKILL)
    # Where they stopped is the newest checkpoint's step: metrics.jsonl can hold fewer lines than the steps
    # taken (seen under three test workers: 5 lines beside a checkpoint at step 10).
    stopped_at = max([len(read_metrics(run_dir))] + [step for step, _ in ckpt.list_checkpoints(run_dir)])
    assert stopped_at < 400
    # They took the parent's death as a preemption: a checkpoint at a step boundary, then exit. The next
    # launch resumes from it and trains a few steps more (not the other ~400: they test nothing here).
    resumed = run_cli([*SMALL_RUN, f"trainer.max_steps={stopped_at + 3}", f"run.dir={run_dir}"], nproc=2,
                      timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "in use by another run" not in resumed.stderr


@pytest.mark.slow
def test_a_rank_stuck_in_a_collective_exits_when_torchrun_stops_it(tmp_path):
    run_dir = tmp_path / "run"
    launcher = _training(run_dir, ["trainer.max_steps=50", "checkpoint.preempt_grace_s=3", "dist.timeout_s=300"],
                         steps=2, env={"DDPTRAIN_FAILPOINT": "hang@3:1"})
    try:
        time.sleep(2)  # rank 1 now sleeps before step 3; rank 0 waits for it inside a collective
        os.kill(launcher.pid, signal.SIGTERM)
        out, err = launcher.communicate(timeout=600)  # a hang guard, not a bound
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    # torchrun waits 30 s before it SIGKILLs workers that ignore its SIGTERM; ours left on their own, each
    # right after this line (os._exit), 3 s after the signal: said by what they wrote, not by a stopwatch.
    for rank in (0, 1):
        assert f"rank {rank}: SIGTERM received, but no step boundary was reached within " \
               "checkpoint.preempt_grace_s=3s" in err, err[-3000:]


# -- fresh starts and clean-up --------------------------------------------------------------------


@pytest.mark.slow
def test_a_fresh_start_moves_the_earlier_run_aside_and_keeps_its_own_checkpoints(tmp_path):
    run_dir = tmp_path / "run"
    base = [*SMALL_RUN, f"run.dir={run_dir}", "checkpoint.keep=1"]
    assert run_cli([*base, "trainer.max_steps=6", "checkpoint.every=2"]).returncode == 0
    fresh = run_cli([*base, "trainer.max_steps=2", "checkpoint.every=1", "checkpoint.resume=none"])
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert "held an earlier run; checkpoint.resume=none, so it was moved to" in fresh.stderr
    assert [step for step, _ in ckpt.list_checkpoints(run_dir)] == [2], "the new run's newest checkpoint survives"
    (previous,) = (run_dir / "previous").iterdir()
    assert [step for step, _ in ckpt.list_checkpoints(previous)] == [6]
    assert [m["step"] for m in read_metrics(previous)] == list(range(1, 7))
    again = run_cli([*base, "trainer.max_steps=3"])
    assert again.returncode == 0 and "at step 2" in again.stderr, "resume continues the NEW run"


def test_purge_never_deletes_the_checkpoint_just_written(tmp_path):
    for step in (2, 8, 9):
        path = ckpt.checkpoint_dir(tmp_path) / ckpt.step_name(step)
        path.mkdir(parents=True)
        (path / ckpt.MARKER).write_text("{}")
    just_written = ckpt.checkpoint_dir(tmp_path) / ckpt.step_name(2)
    ckpt.purge(tmp_path, keep=1, protect=just_written)
    # 8 and 9 are newer than the one just written (they did not verify on resume): not counted, not deleted
    assert [step for step, _ in ckpt.list_checkpoints(tmp_path)] == [2, 8, 9]
    ckpt.purge(tmp_path, keep=1, protect=ckpt.checkpoint_dir(tmp_path) / ckpt.step_name(9))
    assert [step for step, _ in ckpt.list_checkpoints(tmp_path)] == [9]


# -- resuming with another config -----------------------------------------------------------------


TWO_STEPS = [*SMALL_RUN, "optim.schedule=constant", "optim.warmup_steps=0", "checkpoint.every=2"]


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory) -> Path:
    """TWO_STEPS trained for 2 steps on one rank: the earlier run of a relaunch; a test relaunches a copy of it."""
    return finished_run(tmp_path_factory, "two-steps", [*TWO_STEPS, "trainer.max_steps=2"])


@pytest.mark.slow
def test_resume_refuses_changed_keys_by_name_and_applies_a_new_learning_rate(two_steps, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(two_steps, run_dir)
    base = [*TWO_STEPS, f"run.dir={run_dir}"]
    config_before = (run_dir / "config.yaml").read_text()
    for change, expected in [("run.seed=7", "run.seed: 1234 -> 7"), ("model.n_embd=64", "model.n_embd: 32 -> 64"),
                             ("optim=sgd", "optim.name: 'adamw' -> 'sgd'"),
                             ("trainer.precision=fp64", "trainer.precision: 'fp32' -> 'fp64'")]:
        result = run_cli([*base, "trainer.max_steps=3", change])
        assert result.returncode == 2, (change, result.stderr[-2000:])
        assert "cannot change on resume" in result.stderr and expected in result.stderr, (change, result.stderr[-2000:])
    assert (run_dir / "config.yaml").read_text() == config_before, "a refused resume changes nothing"
    result = run_cli([*base, "trainer.max_steps=3", "optim.lr=0.005"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "optim.lr changed from 0.001 to 0.005 (applied)" in result.stderr
    assert read_metrics(run_dir)[-1]["lr"] == pytest.approx(0.005)


@pytest.mark.slow
def test_resume_from_a_path_that_does_not_exist_says_so(tmp_path):
    result = run_cli([*SMALL_RUN, f"run.dir={tmp_path}", f"checkpoint.resume={tmp_path / 'nope'}",
                      "trainer.max_steps=1"])
    assert result.returncode == 2 and f"{tmp_path / 'nope'} does not exist" in result.stderr


# -- durable renames ------------------------------------------------------------------------------


def _record_fsyncs(monkeypatch) -> list[tuple[str, list[str] | None]]:
    """Every os.fsync of this process: the path of the fd and, for a directory, its entries then."""
    fsyncs, real = [], os.fsync

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        fsyncs.append((path, sorted(os.listdir(path)) if os.path.isdir(path) else None))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return fsyncs


def test_a_rename_that_publishes_fsyncs_what_it_names_before_and_the_parent_after(tmp_path, monkeypatch):
    """A checkpoint (as final/, through fsutil.replace_dir) and metrics.jsonl cut on resume: the new
    directory's entries, or the new file's data, reach the disk before the rename, and the directory
    holding the name after it (man 2 fsync: a file's fsync does not make its name durable)."""
    from ddptrain.train.metrics import MetricsLogger

    fsyncs = _record_fsyncs(monkeypatch)
    root = ckpt.checkpoint_dir(tmp_path)
    ckpt.write_checkpoint(tmp_path, 6, {"step": 6}, save_state=lambda d: d.mkdir())
    tmp = str(root / ".tmp-step_00000006")
    assert (tmp, ["COMPLETE.json", "rng_rank0.pt", "state", "trainer.pt"]) in fsyncs, fsyncs
    assert (tmp + "/state", []) in fsyncs
    assert (str(root), ["step_00000006"]) in fsyncs, "checkpoints/ after the rename"

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 5)))
    fsyncs.clear()
    MetricsLogger(tmp_path, resume_step=2).close()
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert fsyncs[0] == (str(tmp_path / "metrics.jsonl.tmp"), None), fsyncs
    assert fsyncs[1][0] == str(tmp_path) and "metrics.jsonl.tmp" not in fsyncs[1][1], "run.dir after the rename"


def test_moving_an_earlier_run_aside_fsyncs_what_it_moves_before_and_both_parents_after(tmp_path, monkeypatch):
    """previous/ gets the earlier run by fsutil.rename, like every rename that moves data out of sight:
    the moved file's data and the moved directories' entries at their old place first, then run.dir
    (the names gone) and previous/<time>/ (the names there)."""
    from ddptrain.runs.rundir import move_previous_run_aside

    files = write_earlier_run(tmp_path)
    fsyncs = _record_fsyncs(monkeypatch)
    target = move_previous_run_aside(tmp_path, "a fresh start")
    assert {name: (target / name).read_bytes() for name in files} == files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["previous"], "nothing of the earlier run is left in place"
    paths = [path for path, _ in fsyncs]
    for name in ("metrics.jsonl", "checkpoints", "checkpoints/step_00000002", "final"):
        assert str(tmp_path / name) in paths, (name, fsyncs)
    assert (str(tmp_path), ["previous"]) in fsyncs, "run.dir after the last rename"
    named = (str(target), ["checkpoints", "final", "metrics.jsonl"])
    assert named in fsyncs, "previous/<time>/ after the last rename"
    assert paths.index(str(tmp_path / "metrics.jsonl")) < fsyncs.index(named), "the data before the name"


def test_runs_move_aside_into_a_previous_dir_on_another_filesystem(tmp_path):
    """previous/ a link to other storage (here /dev/shm, a tmpfs): a rename there fails with EXDEV,
    so the move copies, fsyncs and only then removes; an earlier run and an abandoned trajectory
    both arrive whole and leave nothing behind."""
    from ddptrain.runs.rundir import move_abandoned_aside, move_previous_run_aside

    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK) or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs a writable /dev/shm on another filesystem than the test's tmp_path")
    elsewhere = Path(tempfile.mkdtemp(prefix="ddptrain-previous-", dir=shm))
    try:
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        (run_dir / "previous").symlink_to(elsewhere)
        files = write_earlier_run(run_dir)
        target = move_previous_run_aside(run_dir, "a fresh start")
        assert target.resolve().parent == elsewhere.resolve()
        assert {name: (target / name).read_bytes() for name in files} == files
        assert sorted(p.name for p in run_dir.iterdir()) == ["previous"]

        files = write_earlier_run(run_dir)
        aside = move_abandoned_aside(run_dir, [run_dir / "checkpoints" / "step_00000002", run_dir / "final"])
        assert {name: (aside / name).read_bytes() for name in files} == files, "moved, and metrics.jsonl copied"
        assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints", "metrics.jsonl", "previous"]
        assert list((run_dir / "checkpoints").iterdir()) == []
    finally:
        shutil.rmtree(elsewhere)


def test_a_complete_copy_whose_original_cannot_be_removed_is_named_and_the_rest_moves_back(tmp_path):
    """previous/ a link to /dev/shm (another filesystem, so each move copies, then removes), and a
    file of final/ immutable (chattr +i: root cannot delete it either). checkpoints/ moves, final/ is
    copied whole but its original cannot be removed: the RunDirError says that previous/<time>/final
    is a complete copy and what is left of the original, checkpoints/ comes back, and between the
    two places nothing of the earlier run is lost."""
    from ddptrain.runs.lock import RunDirError
    from ddptrain.runs.rundir import move_previous_run_aside

    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK) or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs a writable /dev/shm on another filesystem than the test's tmp_path")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    files = write_earlier_run(run_dir)
    files["final/config.json"] = b"{}"
    (run_dir / "final" / "config.json").write_bytes(files["final/config.json"])
    pinned = run_dir / "final" / "model.safetensors"
    if subprocess.run(["chattr", "+i", str(pinned)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not supported on tmp_path's filesystem")
    elsewhere = Path(tempfile.mkdtemp(prefix="ddptrain-previous-", dir=shm))
    try:
        (run_dir / "previous").symlink_to(elsewhere)
        with pytest.raises(RunDirError) as raised:
            move_previous_run_aside(run_dir, "a fresh start")
        message = str(raised.value)
        [target] = list(elsewhere.iterdir())
        assert f"moving {run_dir / 'final'}" in message and "Operation not permitted" in message, message
        assert "Nothing was deleted, but not all of it is where it was" in message, message
        assert f"{run_dir / 'previous' / target.name / 'final'} is a complete copy of {run_dir / 'final'}, of which " \
               "what could not be removed is left (delete it once checked)" in message, message
        assert _files_of(target) == {name: data for name, data in files.items() if name.startswith("final/")}
        assert pinned.read_bytes() == files["final/model.safetensors"], "the original's file that would not go"
        kept = _files_of(run_dir)
        assert {name: kept[name] for name in ("checkpoints/step_00000002/trainer.pt", "metrics.jsonl")} == \
            {name: files[name] for name in ("checkpoints/step_00000002/trainer.pt", "metrics.jsonl")}, "moved back"
    finally:
        subprocess.run(["chattr", "-i", str(pinned)], capture_output=True)
        shutil.rmtree(elsewhere)


def _files_of(directory: Path) -> dict[str, bytes]:
    return {str(path.relative_to(directory)): path.read_bytes() for path in sorted(directory.rglob("*"))
            if path.is_file()}


@pytest.mark.slow
def test_an_earlier_run_that_cannot_be_moved_aside_is_a_run_dir_error_on_every_rank_and_stays_whole(two_steps,
                                                                                                    tmp_path):
    """previous/ a FILE (root cannot create a directory under a file either): rank 0's move fails
    before anything moves; every rank reports the run.dir error and exits 2, none waits at the
    barrier for the timeout, and the earlier run is untouched."""
    run_dir = tmp_path / "run"
    shutil.copytree(two_steps, run_dir)
    base = [*TWO_STEPS, f"run.dir={run_dir}", "trainer.max_steps=2"]
    (run_dir / "previous").write_text("not a directory")
    before = _files_of(run_dir)
    # A rank waiting at the barrier would wait dist.timeout_s (1800 s): the command's own limit (600 s) ends
    # that wait as a failure, with no bound on how long a launch takes.
    fresh = run_cli([*base, "checkpoint.resume=none", "dist.timeout_s=1800"], nproc=2, timeout=600)
    assert fresh.returncode != 0 and "exitcode  : 2" in fresh.stderr, fresh.stderr[-3000:]  # torchrun exits 1
    for rank in (0, 1):
        assert f"rank{rank} error] run.dir error:" in fresh.stderr, fresh.stderr[-3000:]
    assert f"{run_dir / 'previous'}/<time>/" in fresh.stderr and "could not be created" in fresh.stderr
    assert "Nothing was moved" in fresh.stderr, fresh.stderr[-3000:]
    frames = [line for line in fresh.stderr.splitlines() if line.lstrip().startswith('File "')]
    assert not [frame for frame in frames if "/ddptrain/" in frame], "no rank's traceback (torchrun prints its own)"
    after = _files_of(run_dir)
    del after["train.log"], before["train.log"]  # the refused launch logs its error there
    assert after == before, "the earlier run is where it was, byte for byte"


# -- checkpoints at scale -------------------------------------------------------------------------


@pytest.mark.slow
def test_each_rank_hashes_a_balanced_share_and_a_step_saved_again_replaces_the_old_one(tmp_path):
    from ddptrain.testing import run_distributed

    run_distributed(_write_twice, 2, str(tmp_path))
    path = ckpt.checkpoint_dir(tmp_path) / ckpt.step_name(3)
    meta = ckpt.verify(path)
    assert sorted(meta["sha256"]) == ["big_rank0.pt", "big_rank1.pt", "rng_rank0.pt", "rng_rank1.pt", "trainer.pt"]
    replaced = ckpt.verify(ckpt.checkpoint_dir(tmp_path) / ".replaced-step_00000003")
    assert replaced["sha256"]["big_rank1.pt"] != meta["sha256"]["big_rank1.pt"], "the first save, kept aside"
    files = [path / name for name in meta["sha256"]]
    shares = ckpt._shares(files, 2)
    sizes = [sum(p.stat().st_size for p in share) for share in shares]
    assert max(sizes) < 0.75 * sum(sizes), sizes


def _save_shard(directory) -> None:
    """Stands in for a strategy that writes its own file on every rank."""
    from ddptrain.distributed import get_rank

    directory.parent.joinpath(f"big_rank{get_rank()}.pt").write_bytes(os.urandom(200_000))


def _write_twice(tmp: str) -> None:
    """A second save of a step (what the Checkpointer does only for another trajectory's checkpoint
    of it) replaces the first once every rank has written, never mixing their files."""
    from ddptrain.distributed import barrier

    first = ckpt.write_checkpoint(tmp, 3, {"step": 3}, save_state=_save_shard)
    before = (first / ckpt.MARKER).read_text()
    barrier()  # every rank has read the first save before rank 0 moves it aside for the second
    again = ckpt.write_checkpoint(tmp, 3, {"step": 3}, save_state=_save_shard)
    assert again == first and (first / ckpt.MARKER).read_text() != before, "the step is written again"


# -- rank-local errors ----------------------------------------------------------------------------


@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_an_error_on_one_rank_reaches_every_rank_and_an_empty_rank_does_not_hang():
    from ddptrain.testing import run_distributed

    run_distributed(_one_rank_fails, world_size=2)


def _one_rank_fails() -> None:
    from ddptrain.distributed import get_rank, raise_on_every_rank
    from ddptrain.engine.engine import Engine
    from tests.helpers import microbatch, tiny_gpt

    started = time.monotonic()
    with pytest.raises(Exception, match="rank 0") as raised:
        raise_on_every_rank(FloatingPointError("rank 0 found NaN weights") if get_rank() == 0 else None)
    assert get_rank() == 0 or isinstance(raised.value, RuntimeError)
    model = tiny_gpt()
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), "ddp", device=torch.device("cpu"))
    mine = [] if get_rank() == 1 else [microbatch(2, [12, 5], seed=1)]
    stats = engine.step(mine)  # a rank without microbatches runs a filler: it neither hangs nor adds anything
    assert stats.tokens == 17 and not stats.skipped
    # run_distributed's process group times out after 120 s; this takes a second or two (60 s: a wide margin)
    assert time.monotonic() - started < 60, "no rank may wait for the timeout"


@pytest.mark.slow
def test_a_malformed_marker_is_skipped_by_name_on_every_rank(tmp_path):
    from ddptrain.testing import run_distributed

    good = ckpt.checkpoint_dir(tmp_path) / ckpt.step_name(1)
    bad = ckpt.checkpoint_dir(tmp_path) / ckpt.step_name(2)
    for path in (good, bad):
        path.mkdir(parents=True)
    (good / ckpt.MARKER).write_text(json.dumps({"step": 1, "sha256": {}}))
    (bad / ckpt.MARKER).write_text(json.dumps({"step": 2}))  # no checksums: a KeyError, not a CheckpointError
    run_distributed(_agree, 2, str(tmp_path), str(good))


def _agree(run_dir: str, expected: str) -> None:
    assert str(ckpt.agree_on_checkpoint(run_dir, "auto")) == expected


# -- degenerate input -----------------------------------------------------------------------------


@pytest.mark.slow
def test_a_token_file_of_only_end_of_document_tokens_is_refused_in_bounded_memory(tmp_path):
    path = tmp_path / "eod.bin"
    import numpy as np

    np.full(100_000_000, 7, dtype=np.uint16).tofile(path)  # 200 MB: 100 million one-token documents
    stale = tmp_path / "cache" / f"abc.tmp-{socket.gethostname()}-999999999-deadbeef"
    stale.mkdir(parents=True)
    script = (
        "import sys\n"
        "from ddptrain.config import DataConfig\n"
        "from ddptrain.data import load_splits\n"
        "from ddptrain.data.sources import DataError\n"
        f"cfg = DataConfig(name='tokens', paths=[{str(path)!r}], vocab_size=50, eod_token=7, cache_dir={str(tmp_path / 'cache')!r})\n"
        "try:\n"
        "    load_splits(cfg, 64)\n"
        "except DataError as error:\n"
        "    print('ERROR', error)\n"
        # VmHWM, this process's own peak: ru_maxrss keeps the launching process's peak across exec
        # (Linux), and the test worker that starts this one may itself hold 2 GB
        "hwm = [line for line in open('/proc/self/status') if line.startswith('VmHWM:')][0]\n"
        "print('RSS_MB', int(hwm.split()[1]) // 1024)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ERROR the corpus is empty: no document of at least 2 tokens" in result.stdout, result.stdout
    rss_mb = int(result.stdout.split("RSS_MB")[1])
    # Measured here: 1231 MB (torch, the 200 MB file mapped in, one chunk); the unbounded code before: 4345 MB.
    assert rss_mb < 2000, f"peak RSS {rss_mb} MB: preprocessing memory is not bounded"
    assert not stale.exists(), "a dead build's temporary directory is removed"
    assert not list((tmp_path / "cache").glob("*.tmp-*")), "the failed build leaves no temporary directory"


@pytest.mark.slow
def test_a_single_document_corpus_does_not_blame_val_percent(tmp_path):
    (tmp_path / "one.txt").write_text("just one document")
    result = run_cli([*SMALL_RUN, "data=text", f"data.paths=[{tmp_path / 'one.txt'}]", "data.val_percent=0",
                      "trainer.max_steps=1", f"run.dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}"])
    assert result.returncode == 2 and "needs one to train on and one for validation" in result.stderr
    assert "val_percent" not in result.stderr.split("data error:")[1]


def test_the_run_directory_package_imports_nothing_of_the_training_loop_and_its_lock_is_only_the_lock():
    """runs/ is read by serving, export and load_model: none of its modules imports ddptrain.train,
    not even inside a function; runs/lock.py holds the lock and its errors, the moves aside live
    with the run directory's layout (runs/rundir.py)."""
    import ast

    import ddptrain.runs

    package = Path(ddptrain.runs.__file__).parent
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not [name for name in names if name.startswith("ddptrain.train")], f"{path.name} imports {names}"
    lock = ast.parse((package / "lock.py").read_text())
    public = {node.name for node in lock.body if isinstance(node, (ast.ClassDef, ast.FunctionDef))
              and not node.name.startswith("_")}
    assert public == {"RunDirError", "RunDirLocked", "RunDirLock"}, public


def test_a_run_dir_names_its_layout(tmp_path):
    from ddptrain.config.compose import compose_config
    from ddptrain.runs.rundir import RunDir

    run_dir = RunDir(compose_config([f"run.dir={tmp_path / 'run'}"]))
    assert (run_dir.checkpoints, run_dir.final, run_dir.config_file, run_dir.log_file, run_dir.metrics_file) == (
        tmp_path / "run" / "checkpoints", tmp_path / "run" / "final", tmp_path / "run" / "config.yaml",
        tmp_path / "run" / "train.log", tmp_path / "run" / "metrics.jsonl")
    assert run_dir.final_step() is None


@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_a_run_dir_holding_the_users_own_files_is_refused_by_name_and_nothing_is_touched(tmp_path):
    mine = {"config.yaml": "my: own config\n", "notes.txt": "do not lose\n"}
    for name, text in mine.items():
        (tmp_path / name).write_text(text)
    result = run_cli([*SMALL_RUN, "trainer.max_steps=1", "run.dir=."], cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "run.dir" in result.stderr and "config.yaml" in result.stderr and "notes.txt" in result.stderr
    assert "empty" in result.stderr  # the rule
    assert sorted(os.listdir(tmp_path)) == sorted(mine)  # no lock, no train.log, nothing
    assert all((tmp_path / name).read_text() == text for name, text in mine.items())


@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_the_home_directory_is_never_a_run_dir(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    result = run_cli([*SMALL_RUN, "trainer.max_steps=1", "run.dir='~'"], cwd=tmp_path, env={"HOME": str(home)})
    assert result.returncode == 2, result.stderr[-2000:]
    assert "run.dir=~" in result.stderr and "its own folder" in result.stderr
    assert os.listdir(home) == []


def test_the_filesystem_root_is_never_a_run_dir():
    from ddptrain.config.compose import compose_config
    from ddptrain.config.schema import ConfigError
    from ddptrain.train.builder import validate_run

    # in-process and refused by validation: a launch on the old rules wrote its run files into /
    with pytest.raises(ConfigError, match=r"run.dir=/ .*its own folder"):
        validate_run(compose_config(["run.dir=/"]), 1)


@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_a_run_dir_with_a_tilde_is_in_the_home_directory(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    result = run_cli([*SMALL_RUN, "trainer.max_steps=1", "checkpoint.every=0", "run.dir='~/runs/x'"], cwd=tmp_path,
                     env={"HOME": str(home)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert (home / "runs" / "x" / "final").is_dir()
    assert not (tmp_path / "~").exists()


@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_an_earlier_run_dir_and_an_empty_one_are_accepted(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    result = run_cli([*SMALL_RUN, "trainer.max_steps=1", "checkpoint.every=0", f"run.dir={empty}"])
    assert result.returncode == 0, result.stderr[-2000:]
    (empty / "my_notes.txt").write_text("a note beside the run\n")  # a run dir stays one with a file added
    result = run_cli([*SMALL_RUN, "trainer.max_steps=2", "checkpoint.every=0", f"run.dir={empty}"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert (empty / "my_notes.txt").read_text() == "a note beside the run\n"


@pytest.mark.parametrize("data, run_dir", [
    (["data=text", "data.paths=[{corpus}/*]"], "{corpus}"),  # the run's train.log a document
    (["data=sft", "data.paths=['{corpus}/**/*.jsonl']"], "{corpus}/run"),  # its metrics.jsonl a chat on relaunch
    (["data=text", "data.paths=[{corpus}/*.txt]", "data.val_paths=['{corpus}/**']"], "{corpus}/runs/a"),
])
@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_a_data_glob_that_reaches_the_run_dir_is_refused_by_name_and_nothing_is_written(tmp_path, data, run_dir):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for index in range(4):
        (corpus / f"doc{index}.txt").write_text("some text to train on\n" * 20)
    (corpus / "chats.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    before = sorted(str(path) for path in tmp_path.rglob("*"))
    result = run_cli([*SMALL_RUN, "trainer.max_steps=1", *(item.format(corpus=corpus) for item in data),
                      f"run.dir={run_dir.format(corpus=corpus)}"])
    assert result.returncode == 2, result.stderr[-2000:]
    assert "config error" in result.stderr and "reaches run.dir=" in result.stderr, result.stderr[-2000:]
    assert "data.paths" in result.stderr or "data.val_paths" in result.stderr
    assert sorted(str(path) for path in tmp_path.rglob("*")) == before


@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_a_data_glob_beside_the_run_dir_is_accepted(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for index in range(4):
        (corpus / f"doc{index}.txt").write_text("some text to train on\n" * 20)
    result = run_cli([*SMALL_RUN, "trainer.max_steps=1", "checkpoint.every=0", "data=text",
                      f"data.paths=[{corpus}/*.txt]", f"run.dir={corpus}/run"])
    assert result.returncode == 0, result.stderr[-2000:]
