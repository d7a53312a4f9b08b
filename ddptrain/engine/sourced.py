"""A mixture's objective: the token objective, summed in total and per source.

The step still minimises the one global mean over valid targets (the total's sum, divided by
N_t); the per-source sums ride along as the objective's further sums, detached, so that
`loss/<source>` is each source's exact global mean: its summed token losses (all-reduced with the
loss, as DPO's metrics are) over its valid targets (which the plan already knows). The chunked head
keeps its shape: head + objective over the valid targets only, a chunk at a time, each chunk's
logits recomputed in backward (ddptrain/engine/chunked.py); here each chunk's per-token losses are
added up per source as well.
"""

from __future__ import annotations

import torch

from ddptrain.contract.sourced import SourcedTargets
from ddptrain.engine.chunked import Head, chunk_rows, head_row_values, valid_positions_of
from ddptrain.engine.objective import Objective


class SourcedObjective:
    """`base`'s per-token loss over SourcedTargets: sums (total, source 0, ..., source K-1)."""

    metric_names = ()  # the per-source sums are read by the trainer, over per-source counts
    counts = 1  # N_t, the valid targets of every source: the one mean the step minimises

    def __init__(self, base: Objective, sources: int):
        self.base, self.sources = base, sources
        self.sums = 1 + sources

    def count(self, targets: SourcedTargets) -> torch.Tensor:
        return self.base.count(targets.tokens)

    def denominator(self, counts: torch.Tensor) -> torch.Tensor:
        return self.base.denominator(counts)

    def filler(self, targets) -> SourcedTargets:
        return SourcedTargets.empty(targets.tokens if isinstance(targets, SourcedTargets) else targets, self.sources)

    def _sums(self, losses: torch.Tensor, sources: torch.Tensor) -> torch.Tensor:
        """(1 + K,) the total of `losses` (N,) and its sum per source; only the total has a gradient."""
        by_source = torch.zeros(self.sources, dtype=losses.dtype, device=losses.device)
        by_source.index_add_(0, sources.clamp_min(0), losses.detach())
        return torch.cat([losses.sum().reshape(1), by_source])

    def token_sum(self, logits: torch.Tensor, targets: SourcedTargets) -> torch.Tensor:
        """On the full logits (trainer.chunked_head=false, or a model without the head-loss protocol)."""
        return self._sums(self.base.token_losses(logits, targets.tokens), targets.sources.reshape(-1))

    def head_loss(self, targets: SourcedTargets, chunk_tokens: int | None):
        """The head-loss callable (ddptrain/contract/outputs.py) of one microbatch."""
        return lambda hidden, head: self._head_sums(hidden, head, targets, chunk_tokens)

    def _head_sums(self, hidden: torch.Tensor, head: Head, targets: SourcedTargets,
                   chunk_tokens: int | None) -> torch.Tensor:
        chunk_tokens = chunk_tokens or chunk_rows(getattr(head, "out_features", None))
        flat_targets = targets.tokens.reshape(-1)
        positions = targets.valid_positions
        if positions is None:
            positions = valid_positions_of(flat_targets)
        positions = positions.to(hidden.device, non_blocking=True)
        valid_hidden = hidden.reshape(-1, hidden.size(-1)).index_select(0, positions)  # (N_valid, D)
        valid_targets = flat_targets.index_select(0, positions)
        sources = targets.sources.reshape(-1).index_select(0, positions)
        # No valid target: one empty chunk, still through the head (its parameters get zero gradients).
        losses = [head_row_values(chunk, head, target_chunk, self.base.token_losses)
                  for chunk, target_chunk in zip(valid_hidden.split(chunk_tokens), valid_targets.split(chunk_tokens))]
        return self._sums(torch.cat(losses), sources)

