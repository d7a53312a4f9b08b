"""The model's output contract: logits aligned with the targets, or an object with `.logits`; and
the optional head-loss protocol that lets the engine skip the logits.

The head-loss protocol: a model whose forward takes a keyword argument `head_loss` and, when it is
given (not None), returns `head_loss(hidden, head)` instead of its logits, where `hidden` are the
last hidden states (..., D), after the final norm, aligned with the targets, and `head` is the
callable the logits would come from, (N, D) -> (N, V) (its output layer: an nn.Linear, a LoRA-wrapped
one, a tied embedding's weight in F.linear). Then `head(hidden)` must equal the logits the forward
returns without it. The engine passes a callable that runs head and objective on the valid targets
only (ddptrain/engine/chunked.py), so the loss never needs the (B, T, V) logits. A wrapper whose
forward passes keyword arguments on to such a model (peft's) says so with `passes_head_loss = True`.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
from torch import nn

HEAD_LOSS = "head_loss"
"""The forward keyword of the head-loss protocol."""

HeadLossFn = Callable[[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]], torch.Tensor]
"""head_loss(hidden, head) -> a 0-d loss tensor."""


def logits_of(output: Any) -> torch.Tensor:
    """The model contract: logits, or an object with `.logits` (a transformers ModelOutput)."""
    return output if isinstance(output, torch.Tensor) else output.logits


def takes_head_loss(module: nn.Module) -> bool:
    """True when `module`'s forward follows the head-loss protocol (see the module docstring)."""
    if getattr(module, "passes_head_loss", False):
        return True
    try:
        return HEAD_LOSS in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
