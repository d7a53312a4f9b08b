"""A run directory on filesystems that fail: read-only, full, a mount point that cannot be renamed.
Each test mounts a tmpfs (root and mount rights; skipped without them)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import pytest

from ddptrain.config.compose import compose_config
from ddptrain.runs import store as ckpt
from ddptrain.runs.lock import RunDirError
from ddptrain.runs.rundir import RunDir, move_abandoned_aside, move_previous_run_aside
from tests.helpers import SMALL_RUN, run_cli, write_earlier_run

pytestmark = pytest.mark.system


@contextlib.contextmanager
def tmpfs(mount: Path, options: str):
    """A tmpfs mounted on `mount` (`options`: what `mount -o` takes), unmounted after; the test is
    skipped where it cannot be mounted (it needs root and mount rights)."""
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs ({options}) here (needs root and mount rights): {made.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_run_dir_on_a_read_only_filesystem_is_a_run_dir_error(tmp_path):
    mount = tmp_path / "ro"
    mount.mkdir()
    with tmpfs(mount, "ro,size=1m"):
        with pytest.raises(RunDirError, match=r"cannot be used: Read-only file system \(EROFS\)"):
            RunDir(compose_config([f"run.dir={mount / 'run'}"])).lock()


# -- a full disk ----------------------------------------------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path):
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    with tmpfs(mount, "size=8m"):
        yield mount


@pytest.mark.slow
def test_a_full_disk_names_the_path_on_every_rank_and_keeps_the_previous_checkpoint(small_tmpfs):
    run_dir = small_tmpfs / "run"
    # ~0.43M parameters: the first checkpoint (weights + AdamW state, ~5 MB) fits in 8 MB, the second does not.
    result = run_cli([*SMALL_RUN, "model.n_embd=128", "model.n_layer=2", "model.n_head=4", "trainer.max_steps=4",
                      "checkpoint.every=2", f"run.dir={run_dir}"], nproc=2)
    assert result.returncode != 0 and "exitcode  : 2" in result.stderr, result.stderr[-3000:]  # torchrun exits 1
    for rank in (0, 1):
        assert f"rank{rank} error] checkpoint error:" in result.stderr, result.stderr[-3000:]
    assert "No space left on device (ENOSPC)" in result.stderr and str(run_dir / "checkpoints") in result.stderr
    assert [step for step, _ in ckpt.list_checkpoints(run_dir)] == [2]
    ckpt.verify(ckpt.checkpoint_dir(run_dir) / ckpt.step_name(2))
    assert not list(ckpt.checkpoint_dir(run_dir).glob(".tmp-*")), "the partial directory is removed"


# -- moving an earlier run aside ------------------------------------------------------------------


def test_a_move_aside_that_fails_half_way_moves_back_what_it_moved(tmp_path):
    """final/ a mount point (rename: EBUSY, for root too): checkpoints/ was already moved to
    previous/<time>/ when final/ failed; it goes back, previous/<time>/ goes, and the RunDirError
    names final/ and the cause. The same for an abandoned trajectory."""
    files = write_earlier_run(tmp_path)
    (tmp_path / "final" / "model.safetensors").unlink()
    with tmpfs(tmp_path / "final", "size=1m"):
        (tmp_path / "final" / "model.safetensors").write_bytes(files["final/model.safetensors"])
        for move_aside in (lambda: move_previous_run_aside(tmp_path, "a fresh start"),
                           lambda: move_abandoned_aside(tmp_path, [tmp_path / "checkpoints" / "step_00000002",
                                                                   tmp_path / "final"])):
            with pytest.raises(RunDirError) as raised:
                move_aside()
            message = str(raised.value)
            assert f"moving {tmp_path / 'final'}" in message and "(EBUSY)" in message, message
            assert "Nothing was moved: the earlier data is where it was." in message, message
            assert {name: (tmp_path / name).read_bytes() for name in files} == files
            assert list((tmp_path / "previous").iterdir()) == [], "no half-filled previous/<time>/"


def test_a_copy_to_a_full_previous_dir_elsewhere_is_removed_and_the_earlier_run_stays(small_tmpfs, tmp_path):
    """previous/ a link to a small filesystem: the cross-device copy of checkpoints/ (the first thing
    moved) fails half way with ENOSPC; the partial copy is removed, and the earlier run stays whole
    in run.dir."""
    if small_tmpfs.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs the tmpfs on another filesystem than tmp_path")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "previous").symlink_to(small_tmpfs)
    files = write_earlier_run(run_dir)
    big = "checkpoints/step_00000002/model.pt"
    files[big] = os.urandom(12 << 20)  # more than the 8 MB tmpfs holds
    (run_dir / big).write_bytes(files[big])
    with pytest.raises(RunDirError) as raised:
        move_previous_run_aside(run_dir, "a fresh start")
    message = str(raised.value)
    assert f"moving {run_dir / 'checkpoints'}" in message and "No space left on device" in message, message
    assert "Nothing was moved: the earlier data is where it was." in message, message
    assert {name: (run_dir / name).read_bytes() for name in files} == files
    assert list(small_tmpfs.iterdir()) == [], "no partial copy is left in previous/"
