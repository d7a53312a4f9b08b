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


def _split_layout(options: dict) -> tuple[dict, StepLayout]:
    """The strategy's own options, and the step layout (`micro_batch_size`, `grad_accum_steps`)."""
    layout_keys = {f.name for f in dataclasses.fields(StepLayout)}
    layout = StepLayout(**{k: v for k, v in options.items() if k in layout_keys})
    return {k: v for k, v in options.items() if k not in layout_keys}, layout


def build_strategy(name: str, **options) -> Strategy:
    """The strategy called `name`, from its options (`micro_batch_size` and `grad_accum_steps`
    describe the step layout; the other keys are the strategy's own Options)."""
    return strategy_class(name).from_config(*_split_layout(options))


def check_strategy_config(name: str, *, world_size: int, grad_clip: float | None, **options) -> None:
    """What `build_strategy(name, **options)` and its `setup` would refuse (a ValueError), checked
    now, without the strategy's library or a process group."""
    strategy_class(name).check_config(*_split_layout(options), world_size=world_size, grad_clip=grad_clip)


__all__ = ["Strategy", "StepLayout", "build_strategy", "check_strategy_config", "strategy_class", "STRATEGY_NAMES"]
