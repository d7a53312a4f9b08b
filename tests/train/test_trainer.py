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


@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
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


@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
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
        token_sum = engine.token_sum  # what the evaluator runs each eval microbatch through

        def recording(inputs, *args, **kwargs):
            shapes.append(tuple(inputs.shape))
            return token_sum(inputs, *args, **kwargs)

        engine.token_sum = recording
        budgeted = trainer.evaluator.run(engine)
        assert shapes and all(rows * width <= 48 for rows, width in shapes), shapes
        assert sum(rows for rows, _ in shapes) == 16, "every validation example once"
        one_by_one = Evaluator(trainer.built.data.val, 16, 1, 0, 1, trainer.dist).run(engine)
        assert budgeted == pytest.approx(one_by_one, rel=1e-12)
    finally:
        trainer.close()


def test_fit_is_a_screen_that_leaves_the_last_step_to_its_components():
    """The loop asks its components and the preemption; which step is the last, and what happens
    there, is theirs to decide: Trainer.fit holds no == or != comparison and fits on a screen."""
    import ast
    import inspect
    import textwrap

    source = textwrap.dedent(inspect.getsource(Trainer.fit))
    fit = ast.parse(source).body[0]
    equalities = [ast.unparse(node) for node in ast.walk(fit) if isinstance(node, ast.Compare)
                  and any(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops)]
    assert not equalities, f"Trainer.fit compares {equalities}: a component's schedule decides"
    assert fit.end_lineno - fit.lineno + 1 <= 40, f"Trainer.fit is {fit.end_lineno - fit.lineno + 1} lines"


class _Recorder:
    """A component added without editing fit: it reads the numbers of step 2 only."""

    def __init__(self):
        self.ends, self.fit_ends = [], []

    def reads(self, end) -> bool:
        return end.step == 2

    def on_step_end(self, end) -> None:
        self.ends.append((end.step, end.last, end.val_loss is not None, end.saved is not None))

    def on_fit_end(self, step: int) -> None:
        self.fit_ends.append(step)


def test_a_new_component_runs_after_every_step_and_the_stats_are_read_only_where_one_asks(tmp_path):
    """A component appended to Trainer.components is told every step's end (after the evaluator
    and the checkpointer that come before it have left their results) and the end of the fit; the
    step statistics are read (the loop waits for the device) only on steps a component reads:
    here step 2 (the recorder) and the last (eval, log line, checkpoint), never steps 1 and 3."""
    trainer = _trainer(tmp_path, "trainer.max_steps=4", "trainer.log_every=100", "trainer.eval_every=0",
                       "checkpoint.every=0")
    recorder = _Recorder()
    trainer.components.append(recorder)
    read_at = []
    real_read = trainer._read_steps
    trainer._read_steps = lambda: (read_at.append(trainer.step), real_read())[1]
    try:
        trainer.fit()
    finally:
        trainer.close()
    assert recorder.ends == [(1, False, False, False), (2, False, False, False), (3, False, False, False),
                             (4, True, True, True)]
    assert recorder.fit_ends == [4]
    assert read_at == [2, 4]
    assert [m["step"] for m in read_metrics(tmp_path)] == [4]
    assert read_metrics(tmp_path)[0]["tokens_seen"] > 0  # the skipped step 2 and the others, read at 2 and 4
