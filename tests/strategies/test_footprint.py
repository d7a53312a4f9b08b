"""Every registered strategy says what one rank holds and sends (the memory plan asks, by name of none)."""

from __future__ import annotations

import pytest

from ddptrain.config.choices import STRATEGY_NAMES
from ddptrain.strategies import strategy_class
from ddptrain.strategies.footprint import Footprint, Layout, ParameterCounts

COUNTS = ParameterCounts(parameters=1000, trainable=800, largest_unit=200)
LAYOUT = Layout(world_size=4, ranks_per_node=2, replicate=2, micro_batch_size=2, seq_len=16, grad_accum_steps=3,
                precision="fp32", optimizer="adamw")


@pytest.mark.parametrize("name", STRATEGY_NAMES)
def test_each_registered_strategy_answers_memory_per_rank_without_being_built(name):
    footprints = strategy_class(name).memory_per_rank(COUNTS, LAYOUT)
    assert footprints and all(isinstance(f, Footprint) for f in footprints)
    assert footprints[0].name == name  # its own row first; fsdp adds HSDP's
    for footprint in footprints:
        assert 0 < footprint.weights <= COUNTS.parameters * 4
        assert 0 < footprint.gradients <= COUNTS.trainable * 4
        assert 0 < footprint.optimizer_state <= 2 * COUNTS.trainable * 4  # AdamW: two moments
        assert footprint.collectives and all(c.payload > 0 and c.calls >= 1 for c in footprint.collectives)


def test_sharding_strategies_hold_less_than_ddp_and_sgd_keeps_no_moments():
    ddp, = strategy_class("ddp").memory_per_rank(COUNTS, LAYOUT)
    zero3, = strategy_class("zero3").memory_per_rank(COUNTS, LAYOUT)
    assert zero3.weights == ddp.weights / 4 and zero3.optimizer_state == ddp.optimizer_state / 4
    sgd = Layout(**{**LAYOUT.__dict__, "optimizer": "sgd"})
    assert all(f.optimizer_state == 0 for name in STRATEGY_NAMES for f in strategy_class(name).memory_per_rank(COUNTS, sgd))
