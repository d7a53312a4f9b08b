"""Run directories written before the run-directory format moved to ddptrain/runs/ still load and
resume: tests/fixtures/run_dir_df46b6a.tar.gz is a run of 4 steps (ddp, 1 rank, fp64, RUN's settings,
its step-4 checkpoint and final/) written by commit df46b6a, the last one before the move."""

from __future__ import annotations

import shutil
import tarfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ddptrain
from tests.helpers import REPO, RESUME_RUN, read_metrics, run_cli

pytestmark = pytest.mark.slow

RUN = [*RESUME_RUN, "dist.timeout_s=60", "checkpoint.every=2", "strategy=ddp", "trainer.precision=fp64"]
OLD_RUN = REPO / "tests" / "fixtures" / "run_dir_df46b6a.tar.gz"


def _old_run(tmp_path: Path) -> Path:
    with tarfile.open(OLD_RUN) as archive:
        archive.extractall(tmp_path, filter="data")
    run_dir = tmp_path / "runs_before_runs_package"
    assert (run_dir / "checkpoints" / "step_00000004" / "COMPLETE.json").is_file()
    return run_dir


def _train(run_dir: Path, steps: int, nproc: int, *extra: str) -> str:
    result = run_cli([*RUN, f"run.dir={run_dir}", f"trainer.max_steps={steps}", *extra], nproc=nproc)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stderr


def test_an_old_run_dir_resumes_on_the_curve_of_a_run_that_never_stopped(tmp_path):
    run_dir = _old_run(tmp_path)
    log = _train(run_dir, 6, 2)  # another world size too; data.order=auto keeps the run's own (the permutation)
    assert "resumed from" in log and "step_00000004" in log, log[-3000:]
    straight = tmp_path / "straight"
    _train(straight, 6, 1, "data.order=permutation")  # the old run's order: its cursor records none
    resumed, reference = [m["loss"] for m in read_metrics(run_dir)], [m["loss"] for m in read_metrics(straight)]
    assert [m["step"] for m in read_metrics(run_dir)] == list(range(1, 7))
    worst = max(abs(a - b) / abs(b) for a, b in zip(resumed, reference))
    assert worst < 1e-9, f"largest relative difference {worst:.2e}"


def test_an_old_run_dir_loads_from_its_final_weights_and_from_its_checkpoint(tmp_path):
    run_dir = _old_run(tmp_path)
    saved = load_file(run_dir / "final" / "model.safetensors")
    from_final = ddptrain.load_model(run_dir).state_dict()
    shutil.rmtree(run_dir / "final")
    from_checkpoint = ddptrain.load_model(run_dir).state_dict()
    for name, tensor in saved.items():
        assert torch.equal(from_final[name], tensor), name
        assert torch.equal(from_checkpoint[name], tensor), name
