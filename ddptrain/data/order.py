"""The order of an epoch: a seeded bijection of [0, N), computed only at the positions a step needs.

An endless stream of examples is epoch after epoch of the same N examples, each epoch in its own
seeded order; position p of the stream is example `order(p // N)[p % N]`. Two orders exist:

- bijection (the default of new runs): a Feistel network over the 2^(2h) >= N ids of `2h` bits,
  walked back into [0, N) (cycle-walking: an id outside is sent through the network again until
  it lands inside; a permutation of the larger domain restricted this way is a permutation of
  [0, N)). It costs O(positions asked) time and O(1) memory, whatever N: no per-rank array of N ids.
- permutation: numpy's `default_rng([seed, epoch]).permutation(N)`, 8 bytes per example per rank,
  built whole at every new epoch. Runs started with it (before the bijection, their data cursor
  says no order) keep it, so that they resume on the same examples.
"""

from __future__ import annotations

import numpy as np

ORDERS = ("bijection", "permutation")
"""The orders a run's data cursor may record; a cursor without one was written with `permutation`."""
LEGACY_ORDER = "permutation"

_ROUNDS = 6  # Luby-Rackoff: 4 rounds make a pseudorandom permutation; 2 more are cheap
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(values: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijective, well-mixing hash of uint64 values (wrapping arithmetic)."""
    values = (values ^ (values >> np.uint64(30))) * _MIX1
    values = (values ^ (values >> np.uint64(27))) * _MIX2
    return values ^ (values >> np.uint64(31))


class Bijection:
    """A seeded bijection of [0, n): `self(positions)` maps an array of positions to example ids."""

    def __init__(self, n: int, key: list[int]):
        if n <= 0:
            raise ValueError(f"an order of {n} examples; at least 1 is needed")
        self.n = n
        self.half_bits = max(1, (int(n - 1).bit_length() + 1) // 2)  # 4^h >= n, so < 4n ids are walked over
        self.mask = np.uint64((1 << self.half_bits) - 1)
        self.round_keys = np.random.SeedSequence([int(k) for k in key]).generate_state(_ROUNDS, np.uint64)

    def _network(self, ids: np.ndarray) -> np.ndarray:
        shift = np.uint64(self.half_bits)
        left, right = ids >> shift, ids & self.mask
        for round_key in self.round_keys:
            left, right = right, left ^ (_mix(right ^ round_key) & self.mask)
        return (left << shift) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        ids = self._network(np.asarray(positions, dtype=np.uint64))
        outside = np.flatnonzero(ids >= self.n)
        while len(outside):  # cycle-walking: ends inside [0, n) after fewer than 4 passes on average
            ids[outside] = self._network(ids[outside])
            outside = outside[ids[outside] >= self.n]
        return ids.astype(np.int64)

    __getitem__ = __call__  # indexed like the permutation array it replaces


class EpochStream:
    """Positions of an endless stream of epochs of `n` examples -> example ids, each epoch in the
    seeded `order` keyed by `key + [epoch]` (the permutation keeps its historical key `[seed, epoch]`)."""

    def __init__(self, n: int, key: list[int], order: str = "bijection"):
        if order not in ORDERS:
            raise ValueError(f"order {order!r} is not one of {', '.join(ORDERS)}")
        if n <= 0:
            raise ValueError(f"the data has {n} examples; at least 1 is needed")
        self.n, self.key, self.order = n, list(key), order
        self._cached: tuple[int, object] = (-1, None)  # the last epoch's order (a permutation costs O(n))

    def _epoch(self, epoch: int):
        if self._cached[0] != epoch:
            if self.order == "permutation":
                self._cached = (epoch, np.random.default_rng([*self.key, epoch]).permutation(self.n))
            else:
                self._cached = (epoch, Bijection(self.n, [*self.key, epoch]))
        return self._cached[1]

    def ids(self, start: int, count: int) -> np.ndarray:
        """Example ids at stream positions [start, start + count)."""
        positions = np.arange(start, start + count, dtype=np.int64)
        epochs, offsets = np.divmod(positions, self.n)
        ids = np.empty_like(positions)
        for epoch in np.unique(epochs):
            inside = epochs == epoch
            ids[inside] = self._epoch(int(epoch))[offsets[inside]]
        return ids
