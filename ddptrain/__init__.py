"""ddptrain: data-parallel training whose update is exactly the global mean-token-loss update.

The library API is loaded lazily (PEP 562): `import ddptrain` costs nothing until a name is used,
so the commands beside the trainer (`python -m ddptrain.plot`, `.serve`) import only what they need.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "init_distributed": "ddptrain.distributed",
    "get_rank": "ddptrain.distributed",
    "get_world_size": "ddptrain.distributed",
    "is_distributed": "ddptrain.distributed",
    "Engine": "ddptrain.engine.engine",
    "StepStats": "ddptrain.engine.stats",
    "count_valid_tokens": "ddptrain.contract.targets",
    "token_loss_sum": "ddptrain.engine.objective",
    "load_model": "ddptrain.runs.weights",
}

if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names come from __getattr__
    from ddptrain.distributed import get_rank, get_world_size, init_distributed, is_distributed
    from ddptrain.engine.engine import Engine
    from ddptrain.contract.targets import count_valid_tokens
    from ddptrain.engine.objective import token_loss_sum
    from ddptrain.engine.stats import StepStats
    from ddptrain.runs.weights import load_model


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'ddptrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = list(_EXPORTS)
__version__ = "0.1.0"
