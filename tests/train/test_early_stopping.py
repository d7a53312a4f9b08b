"""Early stopping and best/: a run whose validation loss rises stops cleanly after `patience` evals,
best/ holds the best step's weights (export and serving take them), a resume in the middle takes
the same decision, a relaunch after the stop trains no further. Real CLI runs, tiny."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ddptrain
from ddptrain.config.schema import ConfigError
from ddptrain.runs import store as ckpt
from ddptrain.runs.weights import SPEC_FILE, TrainedWeights, load_trained
from tests.helpers import RESUME_RUN, import_optional, read_metrics, run_cli

PATIENCE = 2
# A high constant rate: the validation loss falls for a step or two, then rises (the same on every launch).
STOPPING = [*RESUME_RUN, "optim.lr=0.05", "trainer.max_steps=20", "trainer.eval_every=1",
            "trainer.early_stopping.metric=val_loss", f"trainer.early_stopping.patience={PATIENCE}",
            "checkpoint.keep_best=val_loss", "checkpoint.every=1", "checkpoint.keep=100"]


def _ok(result):
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def expected_decision(val_losses: list[tuple[int, float]], patience: int) -> tuple[int, int]:
    """(best step, stop step) of the rule, computed here from the logged losses."""
    best, best_step, bad = float("inf"), None, 0
    for step, value in val_losses:
        if value < best:
            best, best_step, bad = value, step, 0
        else:
            bad += 1
            if bad >= patience:
                return best_step, step
    raise AssertionError(f"the validation loss never stopped improving: {val_losses}")


def _val_losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(row["step"], row["val_loss"]) for row in read_metrics(run_dir) if row.get("val_loss") is not None]


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory) -> tuple[Path, object]:
    run_dir = tmp_path_factory.mktemp("stopping") / "run"
    return run_dir, _ok(run_cli([*STOPPING, f"run.dir={run_dir}"]))


def _logits(model: torch.nn.Module) -> torch.Tensor:
    torch.manual_seed(0)
    with torch.no_grad():
        return model(torch.randint(0, 256, (2, 16)))


@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_a_rising_validation_loss_stops_the_run_after_patience_evals_with_exit_0_and_final(stopped_run):
    run_dir, result = stopped_run
    best_step, stop_step = expected_decision(_val_losses(run_dir), PATIENCE)
    assert stop_step < 20
    assert read_metrics(run_dir)[-1]["step"] == stop_step  # no step after the stop
    assert json.loads((run_dir / "final" / SPEC_FILE).read_text())["step"] == stop_step
    assert "early stopping: val_loss has not improved" in result.stderr
    assert f"the run ends at step {stop_step} of 20" in result.stderr
    assert json.loads((run_dir / "best" / SPEC_FILE).read_text())["step"] == best_step


@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_best_holds_the_weights_of_the_best_step_and_load_model_export_and_serve_take_it(stopped_run, tmp_path):
    run_dir, _ = stopped_run
    best_step, stop_step = expected_decision(_val_losses(run_dir), PATIENCE)
    assert best_step != stop_step  # best/ is not final/
    checkpoint = run_dir / "checkpoints" / ckpt.step_name(best_step)
    at_best = load_trained(TrainedWeights(checkpoint, ckpt.load_trainer_state(checkpoint)))
    best = ddptrain.load_model(run_dir, which="best")
    assert torch.equal(_logits(best), _logits(at_best))
    assert not torch.equal(_logits(ddptrain.load_model(run_dir)), _logits(best))

    from ddptrain.export import main as export_main

    export_main([str(run_dir), str(tmp_path / "hf"), "--which", "best"])
    transformers = import_optional("transformers")
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    torch.manual_seed(0)
    inputs = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        assert torch.allclose(exported(inputs).logits, best(inputs), atol=1e-5)

    from ddptrain.serving.servable import MARKER, servable_dir

    served = servable_dir(run_dir, "best")
    assert served.name == "servable-best"
    assert json.loads((served / MARKER).read_text())["source"] == str((run_dir / "best").resolve())


@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_a_resume_in_the_middle_takes_the_same_decision(stopped_run, tmp_path):
    run_dir, _ = stopped_run
    best_step, stop_step = expected_decision(_val_losses(run_dir), PATIENCE)
    resumed = tmp_path / "run"
    first = [override for override in STOPPING if not override.startswith("trainer.max_steps")]
    _ok(run_cli([*first, f"trainer.max_steps={stop_step - 1}", f"run.dir={resumed}"]))  # one bad eval in
    result = _ok(run_cli([*STOPPING, f"run.dir={resumed}"]))
    assert f"the run ends at step {stop_step} of 20" in result.stderr
    assert _val_losses(resumed) == _val_losses(run_dir)
    assert json.loads((resumed / "best" / SPEC_FILE).read_text())["step"] == best_step
    assert json.loads((resumed / "final" / SPEC_FILE).read_text())["step"] == stop_step


@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_a_relaunch_after_the_stop_trains_no_further(stopped_run, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(stopped_run[0], run_dir)
    before = read_metrics(run_dir)
    _ok(run_cli([*STOPPING, f"run.dir={run_dir}"]))
    assert read_metrics(run_dir) == before


@pytest.mark.parametrize("overrides, words", [
    (["trainer.early_stopping.metric=eval/nope/acc"], "trainer.early_stopping.metric='eval/nope/acc' is not a metric"),
    (["checkpoint.keep_best=accuracy"], "checkpoint.keep_best='accuracy' is not a metric"),
    (["trainer.early_stopping.metric=val_loss", "trainer.early_stopping.patience=0"], "must be >= 1"),
    (["trainer.early_stopping.metric=val_loss", "trainer.early_stopping.mode=up"], "is not one of min, max"),
])
def test_a_stopping_rule_that_names_no_evaluated_metric_is_a_config_error(overrides, words):
    from hydra import compose, initialize_config_dir

    from ddptrain.config import CONFIG_PATH, register_configs, validate

    register_configs()
    with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    with pytest.raises(ConfigError) as error:
        validate(cfg, 1)
    assert words in str(error.value)


def _stop_reason(val_losses: list[float], patience: int = 2) -> str | None:
    from ddptrain.train.components import StepEnd
    from ddptrain.train.early_stopping import EarlyStopping

    stopping = EarlyStopping("val_loss", "min", patience)
    for step, value in enumerate(val_losses, 1):
        end = StepEnd(step=step, last=False, stats=None, lr=0.1, val_loss=value)
        stopping.on_step_end(end)
        if end.stop:
            return end.stop
    return None


def test_a_validation_loss_that_is_not_finite_stops_the_run_with_a_message_that_says_so():
    """It said 'has not improved on None (step None)'."""
    reason = _stop_reason([float("nan"), float("nan")])
    assert "None" not in reason, reason
    assert "val_loss was not finite (nan) in each of the 2 evaluations so far" in reason, reason
    assert "never counts as an improvement" in reason and "patience=2" in reason, reason
    reason = _stop_reason([3.0, float("inf"), float("nan")])
    assert "has not improved on 3.0 (step 1)" in reason and "the latest was nan" in reason, reason
    assert _stop_reason([3.0, 2.0, 1.0]) is None


@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_relaunching_a_stopped_run_with_more_steps_says_it_stopped_early_and_how_to_train_on(stopped_run, tmp_path):
    """It said 'raise trainer.max_steps to train on', which trains no further."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(stopped_run[0], run_dir)
    _, stop_step = expected_decision(_val_losses(run_dir), PATIENCE)
    before = read_metrics(run_dir)
    longer = [override for override in STOPPING if not override.startswith("trainer.max_steps")]
    result = _ok(run_cli([*longer, "trainer.max_steps=40", f"run.dir={run_dir}"]))
    assert read_metrics(run_dir) == before
    assert "raise trainer.max_steps" not in result.stderr, result.stderr[-3000:]
    assert f"this run stopped early at step {stop_step} (early stopping: val_loss has not improved" in result.stderr
    assert "a relaunch trains no further, whatever trainer.max_steps (now 40)" in result.stderr, result.stderr[-3000:]
    assert "start a new run: another run.dir, or checkpoint.resume=none" in result.stderr
