"""Strategies wrap a model for data parallelism: DDP here, DeepSpeed ZeRO imported lazily."""

from __future__ import annotations

from ddptrain.strategies.base import Strategy

STRATEGY_NAMES = ("ddp", "zero1", "zero2", "zero3")


def build_strategy(name: str, **options) -> Strategy:
    """The strategy called `name`; DeepSpeed is imported only when a ZeRO stage is asked for."""
    if name == "ddp":
        from ddptrain.strategies.ddp import DDPStrategy

        return DDPStrategy(**options)
    if name in ("zero1", "zero2", "zero3"):
        from ddptrain.strategies.deepspeed import DeepSpeedStrategy

        return DeepSpeedStrategy(stage=int(name[-1]), **options)
    raise ValueError(f"strategy {name!r} is not one of {', '.join(STRATEGY_NAMES)}")


__all__ = ["Strategy", "build_strategy", "STRATEGY_NAMES"]
