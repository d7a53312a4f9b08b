"""The model contract, and the spec that rebuilds a trained model.

The contract (the same for every kind of model): `model(inputs)` maps token ids (B, T) to logits
(B, T, V) aligned with the targets, or returns an object with `.logits` (a transformers
ModelOutput). ddptrain's data already pairs each input with its next-token target, so nothing
shifts labels and no extra (B, T, V) copy is made. Packed rows arrive as keyword arguments
`idx`, `positions` (restarting at 0 per document), `segments` (a document id per token) and
`documents` (their DocumentBoundaries, ddptrain/data/boundaries.py: given only to a forward that
takes it); a model that takes them must keep attention inside each document.

`ModelSpec` records what rebuilds the model (kind, config, vocabulary, context length, tied
weights); it is written beside the weights so that `ddptrain.load_model` can rebuild it.

This module imports nothing else of ddptrain.models, so every model module can import it.
"""

from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn


class ModelError(ValueError):
    """The configured model cannot be built; the message names the key or path and the rule."""


@dataclass
class ModelSpec:
    """What rebuilds a trained model: written as final/ddptrain_model.json and into checkpoints."""

    kind: str
    """gpt | hf | custom"""
    config: dict
    """The resolved `model` config section."""
    vocab_size: int
    """The data's vocabulary (the model's may be larger: hf)."""
    max_seq_len: int
    """batch.seq_len of the run."""
    class_name: str = ""
    """Fully qualified class of the built module."""
    hf_config: dict | None = None
    """kind=hf: the transformers config (to rebuild from a checkpoint without final/)."""
    tied: dict = field(default_factory=dict)
    """Parameter names that alias another parameter (weight tying): alias -> name stored."""
    base_weights: str | None = None
    """model.lora: the fingerprint (sha256) of the frozen base weights the adapter trains over; a
    resume or a load over other base weights is refused."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ModelSpec":
        return cls(**{key: data[key] for key in cls.__dataclass_fields__ if key in data})


def class_path(module: nn.Module) -> str:
    """`package.module.Class` of `module` (ModelSpec.class_name)."""
    return f"{type(module).__module__}.{type(module).__qualname__}"


def tied_parameters(module: nn.Module) -> dict[str, str]:
    """alias -> first name, for parameters reachable under several names (tied embeddings)."""
    first: dict[int, str] = {}
    tied = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first:
            tied[name] = first[id(param)]
        else:
            first[id(param)] = name
    return tied


def accepts_packed_rows(module: nn.Module) -> bool:
    """True when `module.forward` takes `positions` and `segments` (per-document attention)."""
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return "segments" in params and "positions" in params


def num_parameters(module: nn.Module) -> int:
    """Distinct parameters (tied ones once)."""
    return sum(p.numel() for p in module.parameters())


def logits_of(output: Any) -> torch.Tensor:
    """The model contract: logits, or an object with `.logits` (a transformers ModelOutput)."""
    return output if isinstance(output, torch.Tensor) else output.logits
