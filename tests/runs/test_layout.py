"""The run dir's one list (ddptrain/runs/layout.py) holds every entry that a run, serve and the
trackers write: a run with every writer on (checkpoints, best/, TensorBoard, MLflow, wandb, a
failpoint), served from final/ and best/, then started afresh over itself (previous/), leaves nothing
at the top of its run dir, or of previous/<time>/, that the list does not name."""

from __future__ import annotations

import pytest

from ddptrain.runs.layout import EARLIER_RUN, RUN_ENTRIES, RUN_MARKERS, is_run_entry
from tests.helpers import RESUME_RUN, import_optional, run_cli

EVERY_WRITER = [*RESUME_RUN, "trainer.max_steps=4", "trainer.eval_every=1", "checkpoint.every=2",
                "checkpoint.keep_best=val_loss", "logger.tensorboard=true", "logger.wandb.mode=offline",
                "trainer.nonfinite=skip"]


def test_the_list_names_each_entry_once_and_what_it_holds():
    assert set(RUN_MARKERS) <= set(RUN_ENTRIES) and set(EARLIER_RUN) <= set(RUN_ENTRIES)
    assert all(what.strip() for what in RUN_ENTRIES.values())
    assert is_run_entry(".tmp-final") and is_run_entry(".servable-best.old") and not is_run_entry("my-export")


@pytest.mark.slow
def test_every_entry_a_run_serve_and_the_trackers_write_is_on_the_list(tmp_path):
    import_optional("tensorboard")
    import_optional("mlflow")
    import_optional("wandb")
    import_optional("transformers")
    from ddptrain.serving.servable import servable_dir

    run_dir = tmp_path / "run"
    args = [*EVERY_WRITER, f"logger.mlflow.tracking_uri=file:{tmp_path / 'mlruns'}", f"run.dir={run_dir}"]
    env = {"WANDB_SILENT": "true", "DDPTRAIN_FAILPOINT": "nan@2:0"}
    first = run_cli(args, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    servable_dir(run_dir, "final"), servable_dir(run_dir, "best")
    again = run_cli([*args, "checkpoint.resume=none"], env=env)  # a fresh start moves the earlier run aside
    assert again.returncode == 0 and "was moved to" in again.stderr, again.stderr[-3000:]
    [earlier] = (run_dir / "previous").iterdir()
    for directory in (run_dir, earlier):
        written = sorted(path.name for path in directory.iterdir())
        assert [name for name in written if not is_run_entry(name)] == [], (directory, written)
    seen = {path.name for path in run_dir.iterdir()} | {path.name for path in earlier.iterdir()}
    assert set(RUN_ENTRIES) - {".lock"} <= seen, "every writer ran: " + ", ".join(sorted(set(RUN_ENTRIES) - seen))
