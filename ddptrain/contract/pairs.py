"""Pair targets: what a preference microbatch gives its objective beside the token targets.

Sequence 2k of a microbatch is the chosen completion of its pair k and sequence 2k + 1 the rejected
one, each with its prompt; the two always share a microbatch, so a pair's loss is computed where
both are. `sequences[b, t]` names the sequence of target position (b, t) (-1: padding, or a
position of no sequence), whatever the layout: one sequence per row, or several packed in a row.
`reference` holds the reference model's log-probability of each sequence once it is known
(precomputed, or computed just before the step), float64 so that layouts agree to 1e-9.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ddptrain.contract.targets import IGNORE_INDEX


@dataclass
class PairTargets:
    """Next-token targets (B, T), -100 where ignored, the sequence of each position (B, T), and the
    number of sequences (2 x pairs); `reference` (S,), the reference log-probs, when known."""

    tokens: torch.Tensor
    sequences: torch.Tensor
    count: int
    reference: torch.Tensor | None = None

    @property
    def pairs(self) -> int:
        return self.count // 2

    def to(self, device, non_blocking: bool = False) -> "PairTargets":
        move = lambda tensor: None if tensor is None else tensor.to(device, non_blocking=non_blocking)  # noqa: E731
        return replace(self, tokens=move(self.tokens), sequences=move(self.sequences), reference=move(self.reference))

    def with_reference(self, reference: torch.Tensor) -> "PairTargets":
        return replace(self, reference=reference)

    @classmethod
    def empty(cls, like: "PairTargets") -> "PairTargets":
        """A filler's targets: one ignored position, no sequence, no pair."""
        tokens = torch.full_like(like.tokens[:1, :1], IGNORE_INDEX)
        reference = like.reference[:0] if like.reference is not None else None
        return cls(tokens, torch.full_like(like.sequences[:1, :1], -1), 0, reference)
