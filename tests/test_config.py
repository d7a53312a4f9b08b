"""The config layer refuses, before anything starts, values that would train other than asked or fail
late with a traceback: each rule's message names the key, the value and the rule (validate_run, the
check every command runs on its composed config)."""

from __future__ import annotations

import pytest

from ddptrain.config.compose import compose_config
from ddptrain.config.schema import ConfigError
from ddptrain.train.builder import validate_run


def _refusal(overrides: list[str], world_size: int = 1) -> str:
    with pytest.raises(ConfigError) as error:
        validate_run(compose_config(overrides), world_size)
    return str(error.value)


@pytest.mark.parametrize("override, message", [
    # torch checks only its defaults, not ddptrain's per-group decay: -0.1 trained, growing the weights
    ("optim.weight_decay=-0.1", "optim.weight_decay=-0.1 must be a finite number >= 0"),
    ("optim.weight_decay=nan", "optim.weight_decay=nan must be a finite number >= 0"),
    # LambdaLR takes any factor: a negative floor made the last steps' lr negative (gradient ascent)
    ("optim.min_lr_ratio=-1", "optim.min_lr_ratio=-1.0 must be in [0, 1]"),
    ("optim.min_lr_ratio=nan", "optim.min_lr_ratio=nan must be in [0, 1]"),
    # these failed after the build, in torch or in the first steps
    ("optim.lr=inf", "optim.lr=inf must be a finite number > 0"),
    ("optim.betas=[1.5,0.9]", "optim.betas=[1.5, 0.9] must be two numbers in [0, 1)"),
    ("optim.betas=[0.9]", "optim.betas=[0.9] must be two numbers in [0, 1)"),
    ("optim.betas=[a,b]", "optim.betas=['a', 'b'] must be two numbers in [0, 1)"),
    ("objective.z_loss=inf", "objective.z_loss=inf must be a finite number >= 0"),
    ("trainer.grad_clip=inf", "trainer.grad_clip=inf must be a finite number > 0, or null (no clipping)"),
    ("run.seed=-5", "run.seed=-5 must be in [0, 2**64)"),
])
def test_numeric_edge_values_are_refused_with_the_key_the_value_and_the_rule(override, message):
    assert message in _refusal([override])


def test_the_numeric_bounds_still_take_their_edges():
    overrides = ["optim.weight_decay=0", "optim.min_lr_ratio=0", "optim.betas=[0,0.999]", "run.seed=0",
                 "trainer.grad_clip=null", "objective.z_loss=0"]
    assert validate_run(compose_config(overrides), 1) == 2
    assert validate_run(compose_config(["optim.min_lr_ratio=1"]), 1) == 2
