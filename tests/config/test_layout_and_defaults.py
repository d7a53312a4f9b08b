"""The step's layout is decided in one place, and the built-in GPT's defaults are declared once."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from ddptrain.config import compose_config
from ddptrain.config.layout import BatchLayout, rows_vary
from ddptrain.config.schema import ConfigError, GPTModelConfig
from ddptrain.models.gpt import GPTConfig
from tests.helpers import REPO


@pytest.mark.parametrize("overrides, varies, accumulation", [
    (["batch.global_size=8", "batch.micro_size=2"], False, 2),
    (["batch.global_size=8", "batch.micro_size=2", "batch.pack=true"], True, None),
    (["batch.global_size=8", "batch.micro_tokens=512"], True, None),
])
def test_the_batch_layout_says_whether_rows_vary_and_the_accumulation(overrides, varies, accumulation):
    batch = compose_config(overrides).batch
    layout = BatchLayout.of(batch, 2)
    assert rows_vary(batch) == layout.rows_vary == varies
    assert layout.grad_accum_steps == accumulation
    assert layout.microbatches_per_step == (accumulation or 1)


def test_a_fixed_layout_that_does_not_divide_names_the_three_numbers():
    with pytest.raises(ConfigError, match=r"batch.global_size=10 must be divisible by batch.micro_size=2 x world "
                                          r"size 2 = 4"):
        BatchLayout.of(compose_config(["batch.global_size=10", "batch.micro_size=2"]).batch, 2)


def test_gpt_defaults_are_declared_once():
    """conf/model/gpt.yaml picks GPTModelConfig's defaults and spells none; GPTConfig's are the same."""
    defaults = dataclasses.asdict(GPTModelConfig())
    assert OmegaConf.to_container(compose_config([]).model) == defaults
    spelled = OmegaConf.load(REPO / "conf" / "model" / "gpt.yaml")
    assert set(spelled) == {"defaults"}, f"conf/model/gpt.yaml spells {sorted(set(spelled) - {'defaults'})}"
    architecture = dataclasses.asdict(GPTConfig())
    assert {key: architecture[key] for key in defaults if key != "name"} == \
        {key: value for key, value in defaults.items() if key != "name"}
