"""TensorBoard and MLflow: rank-0 sinks of metrics.jsonl's lines, components of the loop placed
after the metrics logger (which leaves each line on the StepEnd's `record`).

- TensorBoard (logger.tensorboard=true): every numeric key of a line as a scalar at its step, under
  run.dir/tensorboard/, the resolved config as text. A resumed run writes with `purge_step` = the
  checkpoint's step + 1, so readers drop what a killed run wrote after its checkpoint: each step
  once (a fresh run in a used run dir purges from step 0).
- MLflow (logger.mlflow.tracking_uri): the config as params, every metric, final/ as an artifact
  with logger.mlflow.log_final. The run id is kept in run.dir/mlflow.json; a resumed run reopens
  that run and skips the steps it already holds (the resumed steps repeat them exactly).

Both import their library only when asked (optional extra `ddptrain[trackers]`), and neither may
stop training: a failure is a warning naming the cause, and that tracker is off for the rest of
the run. An http(s) tracking server is probed first (a TCP connection within MLFLOW_PROBE_TIMEOUT_S):
MLflow's own client retries with backoff for minutes before it gives up on a server that is not there.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

from omegaconf import OmegaConf

from ddptrain.config.schema import TrainConfig
from ddptrain.distributed import is_rank_zero
from ddptrain.runs.layout import FINAL, MLFLOW_RUN_FILE, TENSORBOARD
from ddptrain.train.components import StepEnd

log = logging.getLogger(__name__)

MLFLOW_PROBE_TIMEOUT_S = 3.0
"""How long start-up waits for an http(s) tracking server to accept a connection before MLflow is off."""


def probe_server(uri: str, timeout_s: float = MLFLOW_PROBE_TIMEOUT_S) -> None:
    """For an http(s) URI, a ConnectionError unless its host accepts a TCP connection on its port
    within `timeout_s`; other URIs (file:, sqlite:, databricks) are left to MLflow."""
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname, port), timeout=timeout_s):
            pass
    except OSError as error:
        raise ConnectionError(f"no tracking server answers at {parts.hostname}:{port} within {timeout_s:g} s "
                              f"({error.strerror or error})") from None


def _scalars(record: dict) -> dict[str, float]:
    return {key: float(value) for key, value in record.items()
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value)}


class _Tracker:
    """A sink that turns itself off, with a warning, at its first failure."""

    name = "tracker"

    def __init__(self):
        self.enabled = is_rank_zero()

    def _guarded(self, what: str, action, *args) -> None:
        if not self.enabled:
            return
        try:
            action(*args)
        except Exception as error:  # noqa: BLE001 - a tracker never stops training
            self.enabled = False
            log.warning("%s failed while %s (%s: %s); it is off for the rest of this run, training goes on",
                        self.name, what, type(error).__name__, error)

    def reads(self, end: StepEnd) -> bool:
        return False  # the metrics logger reads the steps it logs

    def on_step_end(self, end: StepEnd) -> None:
        if end.record is not None:
            self._guarded(f"logging step {end.step}", self._log, end.record, end.step)

    def on_fit_end(self, step: int) -> None:
        pass

    def close(self, exit_code: int = 0) -> None:
        self._guarded("closing", self._close, exit_code)
        self.enabled = False


class TensorBoardTracker(_Tracker):
    name = "TensorBoard (logger.tensorboard)"

    def __init__(self, run_dir: str | Path, config: dict, resume_step: int | None):
        super().__init__()
        self.writer = None
        self._guarded("starting", self._start, Path(run_dir) / TENSORBOARD, config, resume_step)

    def _start(self, directory: Path, config: dict, resume_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter  # lazy: needs the tensorboard package

        purge = 0 if resume_step is None else resume_step + 1
        self.writer = SummaryWriter(str(directory), purge_step=purge)
        text = "```yaml\n" + OmegaConf.to_yaml(OmegaConf.create(config)) + "```"
        self.writer.add_text("config", text, global_step=purge)

    def _log(self, record: dict, step: int) -> None:
        for key, value in _scalars(record).items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def _close(self, exit_code: int) -> None:
        if self.writer is not None:
            self.writer.close()


class MLflowTracker(_Tracker):
    name = "MLflow (logger.mlflow)"

    def __init__(self, run_dir: str | Path, tracking_uri: str, experiment: str, run_name: str | None,
                 config: dict, resume_step: int | None, log_final: bool = False):
        super().__init__()
        self.run_dir = Path(run_dir)
        self.log_final = log_final
        self.client = None
        self.run_id: str | None = None
        self.logged_through = 0  # steps up to here are in the MLflow run already
        self._guarded(f"starting with tracking_uri={tracking_uri}", self._start, tracking_uri, experiment,
                      run_name or self.run_dir.resolve().name, config, resume_step)

    def _start(self, uri: str, experiment: str, run_name: str, config: dict, resume_step: int | None) -> None:
        probe_server(uri)  # seconds, where MLflow's retries take minutes
        if uri.startswith("file:") or "://" not in uri:  # asked for by name: MLflow 3 keeps the file store off
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient  # lazy: the optional extra

        self.client = MlflowClient(tracking_uri=uri)
        saved = self._saved_run(uri) if resume_step is not None else None
        if saved is not None:
            self.run_id = saved
            self.client.update_run(saved, status="RUNNING")
            history = self.client.get_metric_history(saved, "loss")
            self.logged_through = max((metric.step for metric in history), default=0)
            return
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found is not None else self.client.create_experiment(experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        (self.run_dir / MLFLOW_RUN_FILE).write_text(json.dumps({"run_id": self.run_id, "tracking_uri": uri}))
        from mlflow.entities import Param

        params = [Param(key, str(value)[:6000]) for key, value in _flatten(config).items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
            self.client.log_batch(self.run_id, params=params[start:start + 100])

    def _saved_run(self, uri: str) -> str | None:
        """The run id this run dir logged to, when it is of the same store."""
        file = self.run_dir / MLFLOW_RUN_FILE
        if not file.is_file():
            return None
        saved = json.loads(file.read_text())
        if saved.get("tracking_uri") != uri:
            log.info("%s: logged to %s before; a new MLflow run starts in %s", file, saved.get("tracking_uri"), uri)
            return None
        return saved["run_id"]

    def _log(self, record: dict, step: int) -> None:
        if step <= self.logged_through:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for key, value in _scalars(record).items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def on_fit_end(self, step: int) -> None:
        final = self.run_dir / FINAL
        if self.log_final and final.is_dir():
            self._guarded("logging final/ as an artifact", self.client.log_artifacts, self.run_id, str(final), "final")

    def _close(self, exit_code: int) -> None:
        if self.run_id is not None:
            self.client.set_terminated(self.run_id, status="FINISHED" if exit_code == 0 else "FAILED")


def _flatten(config: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def trackers_from_config(cfg: TrainConfig, resume_step: int | None) -> list[_Tracker]:
    """The trackers logger.* asks for (none on ranks other than 0)."""
    if not is_rank_zero():
        return []
    config = OmegaConf.to_container(cfg, resolve=True)
    trackers: list[_Tracker] = []
    if cfg.logger.tensorboard:
        trackers.append(TensorBoardTracker(cfg.run.dir, config, resume_step))
    mlflow = cfg.logger.mlflow
    if mlflow.tracking_uri:
        trackers.append(MLflowTracker(cfg.run.dir, mlflow.tracking_uri, mlflow.experiment, mlflow.run_name, config,
                                      resume_step, mlflow.log_final))
    return trackers
