"""Which examples each step, rank and microbatch take.

The global batch of step t depends only on (seed, t, data, global batch size): sample positions
[t * G, (t + 1) * G) of an endless sequence of epochs, each a seeded permutation of the examples.
Rank r takes a contiguous share of it, then cuts the share into microbatches. So any
(world size x micro size) layout sees the same examples in the same step, and the cursor that a
checkpoint needs is one global number.
"""

from __future__ import annotations

import numpy as np


class GlobalBatchPlan:
    """Deterministic global batches over `num_examples` examples."""

    def __init__(self, num_examples: int, global_batch_size: int, seed: int):
        if num_examples <= 0:
            raise ValueError(f"the data has {num_examples} examples; at least 1 is needed")
        self.num_examples = num_examples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self._epoch = -1
        self._order = np.arange(0)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The permutation of example ids used by `epoch`."""
        if epoch != self._epoch:
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)
            self._epoch = epoch
        return self._order

    def global_batch(self, step: int) -> np.ndarray:
        """Example ids of the global batch of `step` (length global_batch_size)."""
        positions = np.arange(step * self.global_batch_size, (step + 1) * self.global_batch_size, dtype=np.int64)
        epochs, offsets = np.divmod(positions, self.num_examples)
        ids = np.empty_like(positions)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            ids[mask] = self.epoch_order(int(epoch))[offsets[mask]]
        return ids

    def samples_seen(self, step: int) -> int:
        """The global data cursor after `step` steps."""
        return step * self.global_batch_size


def rank_share(global_ids: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """Rank `rank`'s contiguous share of a global batch (the sizes divide: checked in config)."""
    per_rank = len(global_ids) // world_size
    return global_ids[rank * per_rank : (rank + 1) * per_rank]


def split_micro(ids: np.ndarray, micro_batch_size: int) -> list[np.ndarray]:
    return [ids[i : i + micro_batch_size] for i in range(0, len(ids), micro_batch_size)]
