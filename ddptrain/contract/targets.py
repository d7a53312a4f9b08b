"""Targets: which positions take part in the loss.

A target equal to IGNORE_INDEX (-100, PyTorch's and transformers' convention) is ignored: padding,
masked prompts and filler microbatches. Every layer counts valid targets the same way.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


def count_valid_tokens(targets: torch.Tensor) -> int:
    """Number of targets that take part in the loss (those not equal to -100)."""
    return int((targets != IGNORE_INDEX).sum().item())
