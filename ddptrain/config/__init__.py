"""Typed config: the schema (schema.py), every choice declared once (choices.py), validation in one
place (validation.py), the step's layout (layout.py) and composition for every command (compose.py).

The names below are loaded lazily (PEP 562), so importing `ddptrain.config.choices` (as the engine
and the strategies do) does not import Hydra.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ConfigError": "schema", "TrainConfig": "schema", "DataConfig": "schema", "MODEL_SCHEMAS": "schema",
    "validate": "validation", "strategy_options": "validation",
    "BatchLayout": "layout", "rows_vary": "layout", "grad_accum_steps": "layout",
    "check_known_keys": "validation",
    "CONFIG_PATH": "compose", "register_configs": "compose", "compose_config": "compose",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"ddptrain.config.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'ddptrain.config' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
