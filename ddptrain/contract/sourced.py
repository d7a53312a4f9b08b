"""Sourced targets: a mixture's microbatch targets with the source of each position beside them.

`sources[b, t]` is the index (in data.sources' order) of the source whose example holds target
position (b, t), -1 where no example does (padding). The engine's objective then sums the token
losses per source as well as in total, so each source's loss is an exact global mean over its own
valid targets. `valid_positions` are the flat indices of the valid targets, found on the host
where the batch is made (the chunked head needs them; finding them on the device would sync).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ddptrain.contract.targets import IGNORE_INDEX


@dataclass
class SourcedTargets:
    """Next-token targets (B, T), -100 where ignored; the source of each position (B, T); how many sources."""

    tokens: torch.Tensor
    sources: torch.Tensor
    count: int
    valid_positions: torch.Tensor | None = None

    def to(self, device, non_blocking: bool = False) -> "SourcedTargets":
        move = lambda tensor: None if tensor is None else tensor.to(device, non_blocking=non_blocking)  # noqa: E731
        return replace(self, tokens=move(self.tokens), sources=move(self.sources),
                       valid_positions=move(self.valid_positions))

    def pin_memory(self) -> "SourcedTargets":
        pin = lambda tensor: None if tensor is None else tensor.pin_memory()  # noqa: E731
        return replace(self, tokens=pin(self.tokens), sources=pin(self.sources),
                       valid_positions=pin(self.valid_positions))

    @classmethod
    def empty(cls, like: torch.Tensor, count: int) -> "SourcedTargets":
        """A filler's targets: one ignored position of no source."""
        tokens = torch.full_like(like[:1, :1], IGNORE_INDEX)
        return cls(tokens, torch.full_like(tokens, -1), count, torch.zeros(0, dtype=torch.long, device=like.device))
