"""A run directory's layout: every file and folder a run writes into its run.dir, on one list.

    <run.dir>/.lock  config.yaml  train.log  metrics.jsonl  checkpoints/step_N/  final/  best/
              servable/  servable-best/  previous/<time>/  tensorboard/  wandb/  mlflow.json  .failpoints/

Every writer takes its name from here, and every guard reads the list: the start-up check that a
directory is a run's (RUN_MARKERS) and a fresh start that moves an earlier run to previous/
(EARLIER_RUN), both in runs/rundir.py, and export, which refuses to write into any entry (a later
launch, serve or resume replaces, purges, rebuilds or moves it, and what was written there goes
with it). A writer of a new name adds it here, or tests/runs/test_layout.py, which lists what a
run with every writer on leaves, fails.
"""

from __future__ import annotations

LOCK = ".lock"
CONFIG_FILE = "config.yaml"
LOG_FILE = "train.log"
METRICS_FILE = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
FINAL = "final"
BEST = "best"
SERVABLE = "servable"
SERVABLE_BEST = f"{SERVABLE}-{BEST}"
PREVIOUS = "previous"
TENSORBOARD = "tensorboard"
WANDB = "wandb"
MLFLOW_RUN_FILE = "mlflow.json"
FAILPOINTS = ".failpoints"

RUN_ENTRIES: dict[str, str] = {
    LOCK: "the lock of the launch that holds the run dir (runs/lock.py)",
    CONFIG_FILE: "the resolved config of the launch that trained last",
    LOG_FILE: "the console log, appended by every launch",
    METRICS_FILE: "one JSON object per logged step, cut back to the step a resume continues from",
    CHECKPOINTS: "checkpoints/step_N/, purged to checkpoint.keep",
    FINAL: "the final weights, replaced at every end",
    BEST: "the best weights by checkpoint.keep_best, replaced at every improvement",
    SERVABLE: "final/ as a transformers directory, rebuilt by serve when final/ changes",
    SERVABLE_BEST: "best/ as a transformers directory, rebuilt by serve --which best when best/ changes",
    PREVIOUS: "previous/<time>/: earlier runs and abandoned trajectories, moved aside",
    TENSORBOARD: "logger.tensorboard's event files",
    WANDB: "logger.wandb's local files",
    MLFLOW_RUN_FILE: "logger.mlflow's run id, reopened on resume",
    FAILPOINTS: "markers of fault injection (the crash tests)",
}
"""Every top-level entry a run, serve or the trackers write into run.dir, and what it holds."""

STAGING_PREFIXES = (".tmp-", ".old-", f".{SERVABLE}", f"{LOCK}.stale-", f"{METRICS_FILE}.tmp")
"""Names that writers build beside an entry and rename into place (or aside): gone once they finish."""

RUN_MARKERS = (LOCK, LOG_FILE, METRICS_FILE, CHECKPOINTS, FINAL, PREVIOUS)
"""What only a run dir holds: one of them makes a directory a run's (started, refused late, or done)."""

EARLIER_RUN = tuple(name for name in RUN_ENTRIES if name not in (LOCK, PREVIOUS))
"""What a fresh start moves to previous/<time>/: every entry but the lock and previous/ itself."""


def is_run_entry(name: str) -> bool:
    """Whether a top-level name in a run dir is the run's own (RUN_ENTRIES, or a writer's staging name)."""
    return name in RUN_ENTRIES or name.startswith(STAGING_PREFIXES)
