"""The model's output contract: logits aligned with the targets, or an object with `.logits`."""

from __future__ import annotations

from typing import Any

import torch


def logits_of(output: Any) -> torch.Tensor:
    """The model contract: logits, or an object with `.logits` (a transformers ModelOutput)."""
    return output if isinstance(output, torch.Tensor) else output.logits
