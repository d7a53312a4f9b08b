"""What a run evaluates, by name: the validation loss and each task's accuracies, and which way each
improves. Early stopping (trainer.early_stopping.metric) and the best weights (checkpoint.keep_best)
name one of these; the rules between the keys are checked here, before the process group starts.

A task is named by its file's stem (`tasks/arc_easy.jsonl` logs `eval/arc_easy/acc`), so two task
files with one stem are refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ddptrain.config.schema import ConfigError

MODES = ("min", "max")
TASK_METRICS = ("acc", "acc_norm")


def task_name(path: str | Path) -> str:
    return Path(str(path)).stem


def evaluated_metrics(trainer: Any) -> dict[str, str]:
    """Every metric an eval step logs -> the mode in which it improves (val_loss: min, accuracies: max)."""
    metrics = {"val_loss": "min"}
    for path in trainer.eval_tasks:
        metrics.update({f"eval/{task_name(path)}/{metric}": "max" for metric in TASK_METRICS})
    return metrics


def metric_mode(trainer: Any, metric: str, mode: str | None) -> str:
    """`mode` when given, else the one the metric's kind implies."""
    return mode or evaluated_metrics(trainer)[metric]


def validate_evaluation(cfg: Any) -> None:
    trainer = cfg.trainer
    names = [task_name(path) for path in trainer.eval_tasks]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ConfigError(f"trainer.eval_tasks={list(trainer.eval_tasks)} holds two files named {twice[0]}: a task "
                          "is logged by its file's stem (eval/<stem>/acc), so each stem must be unique")
    for path in trainer.eval_tasks:
        if not Path(str(path)).expanduser().is_file():
            raise ConfigError(f"trainer.eval_tasks: {path} is not a file (a JSONL of "
                              '{"context": str, "choices": [str, ...], "label": int} per line)')
    known = evaluated_metrics(trainer)
    stopping = trainer.early_stopping
    for key, metric in (("trainer.early_stopping.metric", stopping.metric), ("checkpoint.keep_best",
                                                                               cfg.checkpoint.keep_best)):
        if metric is not None and metric not in known:
            raise ConfigError(f"{key}={metric!r} is not a metric this run evaluates: one of {', '.join(known)} "
                              "(eval/<task>/... for each file of trainer.eval_tasks)")
    if stopping.mode is not None and stopping.mode not in MODES:
        raise ConfigError(f"trainer.early_stopping.mode={stopping.mode!r} is not one of {', '.join(MODES)} "
                          "(or null: inferred from the metric)")
    if stopping.patience < 1:
        raise ConfigError(f"trainer.early_stopping.patience={stopping.patience!r} must be >= 1 (evaluations "
                          "without an improvement before the run stops)")
    if not stopping.min_delta >= 0:
        raise ConfigError(f"trainer.early_stopping.min_delta={stopping.min_delta!r} must be >= 0")
