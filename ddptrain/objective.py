"""The objective's two pieces: the SUM of token cross-entropies and the count of valid targets.

The global mean-token loss of a step is (sum over every valid target of every microbatch of every
rank) / (number of those targets). Neither piece is a mean: means of unequal pieces cannot be
averaged into the global mean (transformers PR 34191 tells the story).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def count_valid_tokens(targets: torch.Tensor) -> int:
    """Number of targets that take part in the loss (those not equal to -100)."""
    return int((targets != IGNORE_INDEX).sum().item())


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of cross-entropies over the valid targets; 0 (not NaN) when there are none.

    logits: (..., V), targets: (...) with -100 for ignored positions. The sum is taken in at least
    float32 so that bf16 logits do not lose the small terms.
    """
    vocab = logits.size(-1)
    flat_logits = logits.reshape(-1, vocab)
    if flat_logits.dtype in (torch.float16, torch.bfloat16):
        flat_logits = flat_logits.float()
    return F.cross_entropy(flat_logits, targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
