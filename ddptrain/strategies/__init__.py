"""The strategies, one file each, looked up by name in the config's one list of them
(`ddptrain.config.choices.STRATEGIES`: where each class is, its options and precisions).

Adding a strategy is its own file here, one line in that list, and `conf/strategy/<name>.yaml`.
Each is imported only when asked for, so DeepSpeed stays an optional dependency.
"""

from __future__ import annotations

import dataclasses
import importlib

from ddptrain.config.choices import STRATEGIES, STRATEGY_NAMES
from ddptrain.strategies.base import StepLayout, Strategy


def strategy_class(name: str) -> type[Strategy]:
    """The class registered as `name` (its module imported now)."""
    if name not in STRATEGIES:
        raise ValueError(f"strategy {name!r} is not one of {', '.join(STRATEGY_NAMES)}")
    module, _, attr = STRATEGIES[name].target.partition(":")
    return getattr(importlib.import_module(module), attr)


def build_strategy(name: str, **options) -> Strategy:
    """The strategy called `name`, from its options (`micro_batch_size` and `grad_accum_steps`
    describe the step layout; the other keys are the strategy's own Options)."""
    layout_keys = {f.name for f in dataclasses.fields(StepLayout)}
    layout = StepLayout(**{k: v for k, v in options.items() if k in layout_keys})
    return strategy_class(name).from_config({k: v for k, v in options.items() if k not in layout_keys}, layout)


__all__ = ["Strategy", "StepLayout", "build_strategy", "strategy_class", "STRATEGY_NAMES"]
