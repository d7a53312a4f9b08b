"""TensorBoard and MLflow read back with their own readers: every logged step of `loss` once, also
across a resume from an earlier checkpoint (the steps after it written twice by the runs); an MLflow
store that cannot be written warns and the run trains on. Real CLI runs, tiny."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import RESUME_RUN, import_optional, read_metrics, run_cli

TRACKED = [*RESUME_RUN, "checkpoint.every=2", "checkpoint.keep=10", "logger.tensorboard=true"]


def _ok(result):
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory) -> tuple[Path, str]:
    """6 steps, then a resume from the checkpoint of step 4 to step 8: steps 5 and 6 are logged twice."""
    root = tmp_path_factory.mktemp("trackers")
    run_dir, uri = root / "run", f"file:{root / 'mlruns'}"
    tracked = [*TRACKED, f"logger.mlflow.tracking_uri={uri}", "logger.mlflow.log_final=true", f"run.dir={run_dir}"]
    _ok(run_cli([*tracked, "trainer.max_steps=6"]))
    _ok(run_cli([*tracked, "trainer.max_steps=8", f"checkpoint.resume={run_dir}/checkpoints/step_00000004"]))
    return run_dir, uri


@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_tensorboard_holds_every_logged_step_of_loss_once_across_a_resume(resumed_run):
    run_dir, _ = resumed_run
    import_optional("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    losses = events.Scalars("loss")
    assert [event.step for event in losses] == list(range(1, 9))
    logged = {row["step"]: row["loss"] for row in read_metrics(run_dir)}
    assert [pytest.approx(logged[event.step], rel=1e-6) for event in losses] == [event.value for event in losses]
    assert "val_loss" in events.Tags()["scalars"] and "config" in str(events.Tags()["tensors"])


@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_mlflow_holds_one_run_with_the_params_and_every_step_of_loss_once_across_a_resume(resumed_run):
    run_dir, uri = resumed_run
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for the file store by name
    mlflow = import_optional("mlflow")
    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=["ddptrain"])
    assert len(runs) == 1
    assert runs["params.trainer.max_steps"][0] == "6"  # the params of the run as it started
    assert runs["params.checkpoint.every"][0] == "2"
    run_id = runs["run_id"][0]
    history = mlflow.tracking.MlflowClient(uri).get_metric_history(run_id, "loss")
    assert sorted(metric.step for metric in history) == list(range(1, 9))
    assert runs["status"][0] == "FINISHED"
    artifacts = [item.path for item in mlflow.tracking.MlflowClient(uri).list_artifacts(run_id, "final")]
    assert "final/model.safetensors" in artifacts


@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_an_mlflow_store_that_cannot_be_written_warns_and_training_goes_on(tmp_path):
    not_a_dir = tmp_path / "a_file"
    not_a_dir.write_text("")
    run_dir = tmp_path / "run"
    result = _ok(run_cli([*RESUME_RUN, "trainer.max_steps=3", f"logger.mlflow.tracking_uri=file:{not_a_dir}/mlruns",
                          f"run.dir={run_dir}"]))
    assert "MLflow (logger.mlflow) failed while starting" in result.stderr
    assert "training goes on" in result.stderr
    assert [row["step"] for row in read_metrics(run_dir)] == [1, 2, 3]
    assert (run_dir / "final").is_dir()


@pytest.mark.slow  # a training launch that waits out the probe: out of the fast tier
def test_an_mlflow_server_that_is_not_there_warns_within_seconds_and_training_goes_on(tmp_path):
    """MLflow's client retried with backoff for about four minutes, silently, before the run trained."""
    import time

    from ddptrain.testing import free_port
    from ddptrain.train.trackers import MLflowTracker

    import_optional("mlflow")
    uri = f"http://127.0.0.1:{free_port()}/"  # nothing listens there
    started = time.monotonic()
    tracker = MLflowTracker(tmp_path / "direct", uri, "ddptrain", None, {}, None)
    took = time.monotonic() - started
    assert not tracker.enabled
    # The probe gives up after 3 s at most (a refused connection: at once); MLflow's retries took ~240 s.
    assert took < 60, took
    run_dir = tmp_path / "run"
    result = _ok(run_cli([*RESUME_RUN, "trainer.max_steps=3", f"logger.mlflow.tracking_uri={uri}",
                          f"run.dir={run_dir}"]))
    assert f"MLflow (logger.mlflow) failed while starting with tracking_uri={uri} (ConnectionError: no tracking " \
           "server answers at 127.0.0.1:" in result.stderr, result.stderr[-3000:]
    assert "it is off for the rest of this run, training goes on" in result.stderr
    assert [row["step"] for row in read_metrics(run_dir)] == [1, 2, 3]
