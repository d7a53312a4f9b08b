"""The objective's numerator: the SUM of token losses over the valid targets.

The global mean-token loss of a step is (sum over every valid target of every microbatch of every
rank) / (number of those targets); the count is ddptrain/contract/targets.py's. Neither piece is a
mean: means of unequal pieces cannot be averaged into the global mean (transformers PR 34191 tells
the story). Label smoothing and the z-loss are per-token terms too, so they join the same sum and
keep the same divisor N_t.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ddptrain.contract.targets import IGNORE_INDEX

def _flat_logits(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) -> (M, V), in at least float32 so that bf16/fp16 logits do not lose the small terms."""
    flat_logits = logits.reshape(-1, logits.size(-1))
    if flat_logits.dtype in (torch.float16, torch.bfloat16):
        flat_logits = flat_logits.float()
    return flat_logits


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Sum of (label-smoothed) cross-entropies over the valid targets; 0 (not NaN) when there are none.

    logits: (..., V), targets: (...) with -100 for ignored positions. The sum is taken in at least
    float32 so that bf16 logits do not lose the small terms.
    """
    return F.cross_entropy(_flat_logits(logits), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                           reduction="sum", label_smoothing=label_smoothing)


@dataclass(frozen=True)
class Objective:
    """Per-token loss whose sum over valid targets, divided by the global N_t, the step minimises.

    For a valid target y with logits z (V classes) and lse = logsumexp(z):

        (1 - label_smoothing) * (lse - z_y) + label_smoothing * mean_v(lse - z_v) + z_loss * lse^2

    The first two terms are F.cross_entropy with label_smoothing; the last is PaLM's auxiliary
    z-loss (Chowdhery et al. 2022, section 5), which keeps log Z near 0. Ignored targets contribute
    nothing to any term. Objective() is plain cross-entropy, the same arithmetic as token_loss_sum.
    """

    label_smoothing: float = 0.0
    """Weight moved from the target to the uniform distribution over the vocabulary, in [0, 1)."""
    z_loss: float = 0.0
    """Weight of logsumexp(logits)^2 per valid target, >= 0 (0: off)."""

    sums = 1
    """How many sums a microbatch gives (the token loss's); other objectives (DPO) add metrics' sums after it."""
    metric_names = ()
    counts = 1
    """How many counts a microbatch gives (`count`), all-reduced before the first backward; the first
    is the step's tokens, whose 0 skips the step."""

    def count(self, targets: torch.Tensor) -> torch.Tensor:
        """What the step's mean divides by: the microbatch's valid targets."""
        return (targets != IGNORE_INDEX).sum()

    def denominator(self, counts: torch.Tensor) -> torch.Tensor:
        """The divisor of the step's sums from the global counts: N_t (1 when there is none)."""
        return counts[0].clamp_min(1)

    def filler(self, targets: torch.Tensor) -> torch.Tensor:
        """A filler microbatch's targets: one position, ignored."""
        return torch.full_like(targets[:1, :1], IGNORE_INDEX)

    def __post_init__(self):
        object.__setattr__(self, "label_smoothing", _checked_number(
            "label_smoothing", self.label_smoothing, "a number in [0, 1)", lambda x: 0 <= x < 1))
        object.__setattr__(self, "z_loss", _checked_number(
            "z_loss", self.z_loss, "a finite number >= 0", lambda x: math.isfinite(x) and x >= 0))

    def token_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Sum of the per-token objective over the valid targets; 0 (not NaN) when there are none.

        logits: (..., V), targets: (...) with -100 for ignored positions. The sum is in at least
        float32, as token_loss_sum's.
        """
        if self.z_loss == 0:  # the fused library kernel does it all
            return token_loss_sum(logits, targets, self.label_smoothing)
        return self.token_losses(logits, targets).sum()

    def token_losses(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """(M,) the per-token objective of every flattened position, 0 where the target is ignored: what
        a mixture sums per source (ddptrain/engine/sourced.py)."""
        if self.z_loss == 0:
            return F.cross_entropy(_flat_logits(logits), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                                   reduction="none", label_smoothing=self.label_smoothing)
        flat_logits = _flat_logits(logits)  # (M, V)
        flat_targets = targets.reshape(-1)  # (M,)
        is_valid = flat_targets != IGNORE_INDEX
        # One logsumexp feeds both the cross-entropy and the z-loss (F.cross_entropy would compute
        # its own). Rows of ignored targets are computed and then masked, not gathered out, so
        # that no (valid, V) copy of the logits is made.
        lse = torch.logsumexp(flat_logits, dim=-1)  # (M,)
        target_logit = flat_logits.gather(-1, torch.where(is_valid, flat_targets, 0).unsqueeze(-1)).squeeze(-1)
        per_token = lse - target_logit  # -log p(y)
        if self.label_smoothing:
            # mean_v(-log p_v) = lse - mean_v(z_v)
            smooth = lse - flat_logits.mean(dim=-1)
            per_token = (1 - self.label_smoothing) * per_token + self.label_smoothing * smooth
        per_token = per_token + self.z_loss * lse.square()
        return torch.where(is_valid, per_token, 0)


def _checked_number(name: str, value, rule: str, holds) -> float:
    """`value` as a float, or a ValueError naming the value and the rule it breaks."""
    number = float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else None
    if number is None or not holds(number):  # NaN fails every comparison, so every rule
        raise ValueError(f"{name} {value!r} must be {rule}")
    return number
