"""Checkpoints that heal: a step whose checkpoint does not verify is written again, a leftover step
directory never blocks a save, purging keeps the newest checkpoint that verifies, final/ verifies
like a checkpoint and is rebuilt when it does not, and a refused launch leaves config.yaml as it
was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ddptrain
from ddptrain.runs import store as ckpt
from ddptrain.runs.weights import SPEC_FILE, final_dir, weights_dir
from tests.helpers import RESUME_RUN, run_cli


def _save(run_dir, step: int, value: float = 1.0):
    def save_state(directory):
        directory.mkdir()
        torch.save({"w": torch.full((64,), value)}, directory / "model.pt")

    return ckpt.write_checkpoint(run_dir, step, {"step": step}, save_state=save_state)


def test_a_step_directory_already_there_is_moved_aside_unread_and_written_again(tmp_path, caplog, monkeypatch):
    """One put there by hand (a resume moves every later one aside): it is replaced whether it
    verifies or not, so hashing it first would be a collective read of it for nothing."""
    path = _save(tmp_path, 6)
    (path / "state" / "model.pt").write_bytes(b"x" * 100)  # damaged or another trajectory's: the same to a save
    hashed, sha256_file = [], ckpt.sha256_file
    monkeypatch.setattr(ckpt, "sha256_file", lambda file: hashed.append(Path(file)) or sha256_file(file))
    with caplog.at_level("WARNING", logger="ddptrain"):
        again = _save(tmp_path, 6, value=2.0)
    assert again == path
    assert hashed and not [file for file in hashed if file.is_relative_to(path)], "none of its files is read"
    ckpt.verify(path)  # the rewrite is step 6 now
    assert torch.load(path / "state" / "model.pt")["w"][0] == 2.0
    aside = ckpt.checkpoint_dir(tmp_path) / ".replaced-step_00000006"
    assert (aside / "state" / "model.pt").read_bytes() == b"x" * 100, "moved aside as it was"
    assert "step 6" in caplog.text and "is not this run's" in caplog.text and "unread" in caplog.text


def test_a_leftover_step_directory_without_a_marker_never_blocks_a_save(tmp_path):
    leftover = ckpt.checkpoint_dir(tmp_path) / ckpt.step_name(6)
    (leftover / "state").mkdir(parents=True)
    (leftover / "state" / "model.pt").write_bytes(b"half")
    path = _save(tmp_path, 6)
    ckpt.verify(path)
    assert [step for step, _ in ckpt.list_checkpoints(tmp_path)] == [6]


def test_purge_never_removes_the_newest_checkpoint_that_verifies(tmp_path):
    _save(tmp_path, 4)
    bad = _save(tmp_path, 6)
    (bad / "state" / "model.pt").write_bytes(b"x")  # step 6 does not verify: a resume takes step 4
    five = _save(tmp_path, 5)
    ckpt.purge(tmp_path, keep=1, protect=five)
    assert [step for step, _ in ckpt.list_checkpoints(tmp_path)] == [5, 6]
    assert ckpt.find_latest(tmp_path) == five


def test_a_final_dir_that_does_not_verify_names_the_file(tmp_path):
    final = final_dir(tmp_path)
    final.mkdir()
    (final / "model.safetensors").write_bytes(b"weights")
    digest = ckpt.sha256_file(final / "model.safetensors")
    (final / SPEC_FILE).write_text(json.dumps({"step": 3, "sha256": {"model.safetensors": digest}}))
    assert weights_dir(tmp_path) == final
    (final / "model.safetensors").write_bytes(b"weigh")
    with pytest.raises(ckpt.CheckpointError, match="model.safetensors is corrupted.*rerun the training command"):
        weights_dir(tmp_path)


RUN = [*RESUME_RUN, "checkpoint.every=2"]


@pytest.mark.slow
def test_damaged_checkpoints_and_final_weights_heal_and_a_refused_launch_changes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    base = [*RUN, f"run.dir={run_dir}", "trainer.max_steps=6"]
    first = run_cli([*base, "checkpoint.keep=2"], nproc=2)
    assert first.returncode == 0, first.stderr[-3000:]
    step6 = ckpt.checkpoint_dir(run_dir) / ckpt.step_name(6)
    shard = max((step6 / "state").glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[:100])

    # A damaged checkpoint: step 6 does not verify, so the run resumes from 4, moves the bad 6 (and final/ of step 6)
    # to previous/, writes 6 again and never purges 4 for a bad 6
    second = run_cli([*base, "checkpoint.keep=1"], nproc=2)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stderr and "step_00000004" in second.stderr
    assert f"skipping checkpoint step_00000006: {shard} is corrupted" in second.stderr, second.stderr[-3000:]
    assert "checkpoints of steps (6) and final/ of step 6 come after step 4" in second.stderr, second.stderr[-3000:]
    (previous,) = (run_dir / "previous").iterdir()
    assert (ckpt.checkpoint_dir(previous) / ckpt.step_name(6)).is_dir(), "the damaged one is kept aside"
    ckpt.verify(step6)
    assert ckpt.find_latest(run_dir) == step6

    # A damaged final/: a truncated final/model.safetensors is named, and the same command rebuilds it
    weights = final_dir(run_dir) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ckpt.CheckpointError, match="model.safetensors is corrupted"):
        ddptrain.load_model(run_dir)
    third = run_cli([*base, "checkpoint.keep=1"])
    assert third.returncode == 0, third.stderr[-3000:]
    assert "final/ is rebuilt" in third.stderr
    ddptrain.load_model(run_dir)

    # A refused launch (max_steps below the checkpoint's step) leaves config.yaml as it was
    config_before = (run_dir / "config.yaml").read_text()
    refused = run_cli([*RUN, f"run.dir={run_dir}", "trainer.max_steps=5"])
    assert refused.returncode == 2 and "past trainer.max_steps=5" in refused.stderr, refused.stderr[-2000:]
    assert (run_dir / "config.yaml").read_text() == config_before

    # A leftover: a step directory without COMPLETE.json (a save that never finished) never blocks that step
    leftover = ckpt.checkpoint_dir(run_dir) / ckpt.step_name(8)
    (leftover / "state").mkdir(parents=True)
    (leftover / "state" / "half.distcp").write_bytes(b"half")
    fourth = run_cli([*RUN, f"run.dir={run_dir}", "trainer.max_steps=8", "checkpoint.keep=1"])
    assert fourth.returncode == 0, fourth.stderr[-3000:]
    ckpt.verify(leftover)
    assert ckpt.find_latest(run_dir) == leftover
