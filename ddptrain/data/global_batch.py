"""Which examples each step, rank and microbatch take.

The global batch of step t depends only on (seed, t, data, global batch size): sample positions
[t * G, (t + 1) * G) of an endless sequence of epochs, each in a seeded order (ddptrain/data/order.py:
a bijection computed at those positions, or the materialised permutation of runs started before it).
Rank r takes a contiguous share of it, then cuts the share into microbatches. So any
(world size x micro size) layout sees the same examples in the same step, and the cursor that a
checkpoint needs is one global number.
"""

from __future__ import annotations

import numpy as np

from ddptrain.data.order import LEGACY_ORDER, EpochStream


class GlobalBatchPlan:
    """Deterministic global batches over `num_examples` examples."""

    def __init__(self, num_examples: int, global_batch_size: int, seed: int, order: str = "bijection"):
        if num_examples <= 0:
            raise ValueError(f"the data has {num_examples} examples; at least 1 is needed")
        self.num_examples = num_examples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.stream = EpochStream(num_examples, [seed], order)

    @property
    def order(self) -> str:
        return self.stream.order

    def use_order(self, order: str) -> None:
        """Continue in `order` (a resumed run's: its data cursor says which)."""
        if order != self.order:
            self.stream = EpochStream(self.num_examples, [self.seed], order)

    def global_batch(self, step: int) -> np.ndarray:
        """Example ids of the global batch of `step` (length global_batch_size)."""
        return self.stream.ids(step * self.global_batch_size, self.global_batch_size)

    def samples_seen(self, step: int) -> int:
        """The global data cursor after `step` steps."""
        return step * self.global_batch_size

    def state_dict(self, step: int) -> dict:
        return {"samples_seen": self.samples_seen(step), "seed": self.seed,
                "global_batch_size": self.global_batch_size, "order": self.order}

    def load_state_dict(self, state: dict, step: int) -> None:
        """The cursor of a checkpoint at `step`: its order (none recorded: the permutation)."""
        self.use_order(state.get("order", LEGACY_ORDER))


def rank_share(global_ids: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """Rank `rank`'s contiguous share of a global batch (the sizes divide: checked in config)."""
    per_rank = len(global_ids) // world_size
    return global_ids[rank * per_rank : (rank + 1) * per_rank]


def split_micro(ids: np.ndarray, micro_batch_size: int) -> list[np.ndarray]:
    return [ids[i : i + micro_batch_size] for i in range(0, len(ids), micro_batch_size)]
