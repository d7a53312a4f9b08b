"""The trainer's policies, in one process: empty global batches are skipped and counted, or stop."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from ddptrain.config import CONFIG_PATH
from ddptrain.config import register_configs, validate
from ddptrain.distributed import init_distributed
from ddptrain.contract.targets import IGNORE_INDEX
from ddptrain.train.trainer import EmptyStepError, Trainer
from tests.helpers import TINY_RUN, read_metrics


def _trainer(run_dir, *overrides) -> Trainer:
    register_configs()
    with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
        cfg = compose("config", overrides=[*TINY_RUN, "batch.seq_len=32", "batch.global_size=4",
                                           "batch.micro_size=2", f"run.dir={run_dir}", *overrides])
    validate(cfg, 1)
    trainer = Trainer(cfg, init_distributed()).build()
    real = trainer.train_batches.microbatches

    def without_targets_at_step_two(step):
        microbatches = real(step)
        if step == 1:  # the second optimizer step
            return [(inputs, targets.fill_(IGNORE_INDEX)) for inputs, targets in microbatches]
        return microbatches

    trainer.train_batches.microbatches = without_targets_at_step_two
    return trainer


def test_empty_global_batch_is_skipped_counted_and_warned(tmp_path, caplog):
    trainer = _trainer(tmp_path, "trainer.max_steps=4")
    try:
        trainer.fit()
    finally:
        trainer.close()
    metrics = read_metrics(tmp_path)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert metrics[1]["tokens"] == 0 and metrics[1]["loss"] is None
    assert [m["skipped_steps"] for m in metrics] == [0, 1, 1, 1]
    assert all(m["loss"] is not None for m in metrics[2:]), "training goes on after the skipped step"
    assert "no valid target token" in (tmp_path / "train.log").read_text()


def test_empty_global_batch_stops_when_configured(tmp_path):
    trainer = _trainer(tmp_path, "trainer.max_steps=4", "trainer.empty_step=stop")
    try:
        with pytest.raises(EmptyStepError, match="step 2: the global batch has no valid target token"):
            trainer.fit()
    finally:
        trainer.close()
    assert [m["step"] for m in read_metrics(tmp_path)] == [1]


def test_eval_examples_beyond_the_validation_split_are_named_at_start_up(tmp_path, caplog):
    """The evaluator took min(trainer.eval_examples, split size) without a word: asking for 100000
    evaluated the split's few hundred as if that were what was asked."""
    import logging

    trainer = _trainer(tmp_path / "run", "trainer.max_steps=2", "trainer.eval_examples=8")
    try:
        val, engine = trainer.built.data.val, trainer.engine
        exact = trainer.evaluator.run(engine)
        cfg = trainer.cfg
        from ddptrain.train.evaluator import Evaluator

        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ddptrain"):
            every = Evaluator(val, len(val), cfg.batch.micro_size, 0, 2, trainer.dist)
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert not warnings, f"eval_examples equal to the split's size is not a warning: {warnings}"
        with caplog.at_level(logging.WARNING, logger="ddptrain"):
            beyond = Evaluator(val, 100 * len(val), cfg.batch.micro_size, 0, 2, trainer.dist)
        assert f"trainer.eval_examples={100 * len(val)} > the {len(val)} examples of the validation split: the " \
               f"validation loss is over all {len(val)} of them" in caplog.text
        assert len(beyond.ids) == len(val) and beyond.run(engine) == every.run(engine) != exact
    finally:
        trainer.close()


def test_eval_microbatches_keep_the_token_budget_of_training(tmp_path):
    """With batch.micro_tokens the evaluator still cut the validation set into batch.micro_size rows
    (8 by default, read nowhere else): eval forwards of 8 x 32 positions in a run whose budget, and
    memory plan, is 32, so a run that fit its training steps could run out of memory at its first
    eval. Eval microbatches now keep the training's budget, and the loss stays the exact token mean."""
    from ddptrain.train.evaluator import Evaluator

    register_configs()
    with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
        cfg = compose("config", overrides=[*TINY_RUN, "batch.seq_len=32", "batch.global_size=4",
                                           "batch.micro_tokens=48", "trainer.max_steps=1", "optim.warmup_steps=1",
                                           "trainer.precision=fp64", "trainer.eval_examples=16", f"run.dir={tmp_path}"])
    validate(cfg, 1)
    trainer = Trainer(cfg, init_distributed()).build()
    try:
        engine, shapes = trainer.engine, []
        forward = engine.forward

        def recording(inputs, *args, **kwargs):
            shapes.append(tuple(inputs.shape))
            return forward(inputs, *args, **kwargs)

        engine.forward = recording
        budgeted = trainer.evaluator.run(engine)
        assert shapes and all(rows * width <= 48 for rows, width in shapes), shapes
        assert sum(rows for rows, _ in shapes) == 16, "every validation example once"
        one_by_one = Evaluator(trainer.built.data.val, 16, 1, 0, 1, trainer.dist).run(engine)
        assert budgeted == pytest.approx(one_by_one, rel=1e-12)
    finally:
        trainer.close()
