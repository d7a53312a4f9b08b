"""Resuming across strategies and world sizes through the CLI: one run, restarted with another
strategy or rank count, keeps the loss curve of a run that never stopped. Each test is a row of the
transition table in docs/checkpoints-and-preemption.md."""

from __future__ import annotations

import shutil
import tarfile
from pathlib import Path

import pytest

from tests.helpers import REPO, RESUME_RUN, import_deepspeed, read_metrics, run_cli, straight_run

pytestmark = pytest.mark.slow

RUN = [*RESUME_RUN, "dist.timeout_s=60", "checkpoint.every=2", "data.order=permutation"]
"""data.order=permutation: the legacy checkpoints' runs drew their epochs in that order (their cursors record
none), so the straight runs they are compared with do too."""
LEGACY = REPO / "tests" / "fixtures" / "legacy_checkpoints.tar.gz"
"""Runs of 4 steps written by ddptrain before checkpoints were strategy-neutral (ddp on 2 ranks in
fp64, zero2 on 2 ranks in fp32), with RUN's settings and checkpoint.every=4."""


def train(run_dir: Path, steps: int, strategy: str, nproc: int, precision: str, *extra: str) -> str:
    result = run_cli([*RUN, f"run.dir={run_dir}", f"trainer.max_steps={steps}", f"strategy={strategy}",
                      f"trainer.precision={precision}", *extra], nproc=nproc)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stderr


def chain(run_dir: Path, precision: str, legs: list[tuple[int, str, int]]) -> list[float]:
    """Train one run dir leg by leg: (up to step, strategy, ranks); every leg resumes. The first leg
    is already in run_dir (`prefix`: the straight run's first steps) and is not trained again."""
    for steps, strategy, nproc in legs[1:]:
        log = train(run_dir, steps, strategy, nproc, precision)
        assert "resumed from" in log, log[-3000:]
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, legs[-1][0] + 1)), "one metrics line per step"
    return [m["loss"] for m in metrics]


def assert_same_curve(losses: list[float], reference: list[float], tolerance: float) -> None:
    assert len(losses) <= len(reference)
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
    assert worst < tolerance, f"largest relative difference {worst:.2e} (allowed {tolerance:.0e})"


def straight(tmp_path_factory, name: str, steps: int, precision: str) -> Path:
    """ddp on 2 ranks from step 1 to `steps`, every checkpoint kept: the reference curve, and the
    first leg of a chain (`prefix`)."""
    return straight_run(tmp_path_factory, name, [*RUN, f"trainer.max_steps={steps}", "strategy=ddp",
                                                 f"trainer.precision={precision}", f"checkpoint.keep={steps // 2}"])


def prefix(straight_dir: Path, steps: int, run_dir: Path) -> Path:
    """A copy of the straight run as it stood after `steps` steps (its checkpoint of that step the
    newest, one metrics line per step): the ddp leg that begins a chain, not trained a second time."""
    shutil.copytree(straight_dir, run_dir)
    shutil.rmtree(run_dir / "final")
    for checkpoint in (run_dir / "checkpoints").iterdir():
        if int(checkpoint.name.removeprefix("step_")) > steps:
            shutil.rmtree(checkpoint)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    (run_dir / "metrics.jsonl").write_text("\n".join(lines[:steps]) + "\n")
    return run_dir


@pytest.fixture(scope="module")
def straight_fp64(tmp_path_factory) -> Path:
    return straight(tmp_path_factory, "straight_fp64", 10, "fp64")


@pytest.fixture(scope="module")
def straight_fp32(tmp_path_factory) -> Path:
    return straight(tmp_path_factory, "straight_fp32", 12, "fp32")


def losses_of(run_dir: Path) -> list[float]:
    return [m["loss"] for m in read_metrics(run_dir)]


def test_fp64_ddp_to_fsdp_on_one_rank_and_back_keeps_the_curve(tmp_path, straight_fp64):
    """ddp on 2 ranks to step 4 (the straight run's), fsdp on 1 to step 8, ddp on 2 to step 10."""
    run_dir = prefix(straight_fp64, 4, tmp_path / "run")
    losses = chain(run_dir, "fp64", [(4, "ddp", 2), (8, "fsdp", 1), (10, "ddp", 2)])
    assert_same_curve(losses, losses_of(straight_fp64), 1e-9)


def test_fp32_ddp_through_zero2_and_zero3_on_one_and_two_ranks_keeps_the_curve(tmp_path, straight_fp32):
    """Every ZeRO save resumed on the other rank count: zero2 and zero3 each saved on 1 rank and on 2,
    each resumed by the next leg on the other (ddp's save on 2, the straight run's of step 2, begins it)."""
    import_deepspeed()
    legs = [(2, "ddp", 2), (4, "zero2", 1), (6, "zero2", 2), (8, "zero3", 1), (10, "zero3", 2), (12, "zero2", 1)]
    run_dir = prefix(straight_fp32, 2, tmp_path / "run")
    assert_same_curve(chain(run_dir, "fp32", legs), losses_of(straight_fp32), 2e-5)


def _legacy_run(tmp_path: Path, name: str) -> Path:
    with tarfile.open(LEGACY) as archive:
        archive.extractall(tmp_path, filter="data")
    run_dir = tmp_path / name
    assert (run_dir / "checkpoints" / "step_00000004" / "strategy").is_dir()  # the old layout
    return run_dir


@pytest.mark.parametrize("strategy, precision, tolerance", [("ddp", "fp64", 1e-9), ("zero2", "fp32", 2e-5)])
def test_a_checkpoint_from_before_the_neutral_layout_resumes_with_its_strategy(tmp_path, request, strategy, precision,
                                                                               tolerance):
    if strategy.startswith("zero"):
        import_deepspeed()
    run_dir = _legacy_run(tmp_path, strategy)
    log = train(run_dir, 6, strategy, 2, precision, "checkpoint.every=4")
    assert "resumed from" in log and "step_00000004" in log
    if strategy == "ddp":  # the fp64 chain's straight run: ddp on 2 ranks, its first 6 steps
        straight = request.getfixturevalue("straight_fp64")
    else:
        straight = tmp_path / "straight"
        train(straight, 6, strategy, 2, precision, "checkpoint.every=4")
    assert_same_curve(losses_of(run_dir), losses_of(straight), tolerance)
    assert (run_dir / "checkpoints" / "step_00000006" / "state" / ".metadata").is_file(), "the next one is neutral"


def test_a_checkpoint_from_before_the_neutral_layout_names_its_strategy_when_another_resumes_it(tmp_path):
    run_dir = _legacy_run(tmp_path, "ddp")
    result = run_cli([*RUN, f"run.dir={run_dir}", "trainer.max_steps=6", "strategy=fsdp", "trainer.precision=fp64",
                      "checkpoint.every=4"], nproc=1)
    assert result.returncode != 0
    assert "written by strategy=ddp before checkpoints were strategy-neutral" in result.stderr, result.stderr[-3000:]
    assert "resume it once with strategy=ddp" in result.stderr
    assert (run_dir / "checkpoints" / "step_00000004" / "COMPLETE.json").is_file(), "nothing saved is lost"


def test_a_zero_checkpoint_from_before_the_neutral_layout_names_its_world_size_on_another(tmp_path):
    import_deepspeed()
    run_dir = _legacy_run(tmp_path, "zero2")
    result = run_cli([*RUN, f"run.dir={run_dir}", "trainer.max_steps=6", "strategy=zero2", "checkpoint.every=4",
                      "batch.micro_size=4"], nproc=1)
    assert result.returncode != 0
    assert ("a zero2 checkpoint written on 2 ranks before checkpoints were strategy-neutral cannot be resumed on 1"
            in result.stderr), result.stderr[-3000:]
    assert "resume it once on 2 ranks" in result.stderr
