"""Build the configured model: the built-in GPT, a local Hugging Face causal LM, or any factory.

Each kind is an adapter (ddptrain.models.adapters); these are the kind-free entry points, and the
model contract's names (ddptrain.models.spec) importable from one place.
"""

from __future__ import annotations

from torch import nn

from ddptrain.models.adapters import adapter_for, adapter_of, resolve_target
from ddptrain.contract.outputs import logits_of
from ddptrain.models.spec import ModelError, ModelSpec, accepts_packed_rows, num_parameters, tied_parameters

__all__ = ["ModelError", "ModelSpec", "accepts_packed_rows", "build_model", "logits_of", "num_parameters",
           "rebuild_model", "resolve_target", "tied_parameters"]


def build_model(model_cfg: dict, vocab_size: int, seq_len: int) -> tuple[nn.Module, ModelSpec]:
    """The module of the `model` config section (a plain dict) and its spec. Seed torch first."""
    return adapter_for(model_cfg).build(model_cfg, vocab_size, seq_len)


def rebuild_model(spec: ModelSpec) -> nn.Module:
    """An untrained module of the same shape as the one `spec` describes (for loading weights)."""
    return adapter_of(spec).rebuild(spec)
