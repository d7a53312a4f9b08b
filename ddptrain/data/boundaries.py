"""The document boundaries of a packed microbatch, computed once in collation, on the host.

Every run of equal segment ids in a row is a document (the row's padding, segment -1, included).
The boundaries hold what every attention backend of ddptrain/models/attention.py needs, so that
no backend reads a length back from the device (`.item()`) or builds a T x T tensor: cu_seqlens
offsets over the flattened (B * T) rows, the longest document as a host int, and the gather plan
(documents bucketed by length, each bucket padded to its longest: at most twice its shortest, all
documents up to SMALL_DOCUMENT tokens together). The gather buffer is so bounded: at most
2 x B x T positions, plus SMALL_DOCUMENT per document of up to SMALL_DOCUMENT tokens, and one
attention call per bucket, at most log2(T) - 3 of them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

SMALL_DOCUMENT = 16
"""Documents up to this many tokens share one gather bucket (padding them costs little)."""


@dataclass
class GatherBucket:
    index: torch.Tensor  # (n, L) int64: each document's positions in the flattened rows (padding: 0)
    keep: torch.Tensor  # (m,) int64: the real tokens among the n * L gathered positions


@dataclass
class DocumentBoundaries:
    """Where each document of a packed microbatch starts and ends, computed once on the host.

    Tensors move with `.to(device)` (and `.pin_memory()`), host ints stay ints. `backend` is the
    attention backend the model runs them through (set by the model, not by collation)."""

    segments: torch.Tensor  # (B, T) int64: a document id per position (padding: -1, its own document)
    cu_seqlens: torch.Tensor  # (D + 1,) int32: offsets of the D documents in the flattened B * T rows
    max_length: int  # the longest document (host int: no sync to size a kernel)
    buckets: list[GatherBucket]  # gather: documents of similar length, longest first
    inverse: torch.Tensor  # (B * T,) int64: where each token lands in the concatenated buckets
    backend: str | None = None  # None: the model's own (trainer.attention); collation leaves it so
    cache: dict = field(default_factory=dict, repr=False, compare=False)  # per microbatch: masks

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.segments.shape)

    @classmethod
    def from_segments(cls, segments: np.ndarray) -> "DocumentBoundaries":
        """Boundaries of rows of segment ids (B, T): every run of equal ids in a row is a document."""
        rows, width = segments.shape
        flat = segments.reshape(-1)
        change = np.ones(flat.shape, dtype=bool)
        change[1:] = flat[1:] != flat[:-1]
        change[::width] = True  # a row starts a document
        starts = np.flatnonzero(change)
        lengths = np.diff(np.r_[starts, flat.size])
        cu_seqlens = np.r_[0, np.cumsum(lengths)].astype(np.int32)
        buckets, order = [], []
        size_class = np.ceil(np.log2(np.maximum(lengths, SMALL_DOCUMENT))).astype(np.int64)
        for bucket in np.unique(size_class)[::-1]:
            docs = np.flatnonzero(size_class == bucket)
            docs = docs[np.lexsort((docs, -lengths[docs]))]  # longest first, ties in order
            longest = int(lengths[docs[0]])
            offsets = np.arange(longest)
            real = offsets[None, :] < lengths[docs][:, None]  # (n, L)
            index = np.where(real, starts[docs][:, None] + offsets[None, :], 0)
            keep = np.flatnonzero(real.ravel())
            order.append(index.ravel()[keep])
            buckets.append(GatherBucket(torch.from_numpy(index), torch.from_numpy(keep)))
        inverse = np.empty(flat.size, dtype=np.int64)
        inverse[np.concatenate(order)] = np.arange(flat.size)
        return cls(torch.from_numpy(np.ascontiguousarray(segments, dtype=np.int64)), torch.from_numpy(cu_seqlens),
                   int(lengths.max()), buckets, torch.from_numpy(inverse))

    @classmethod
    def for_mask(cls, segments: torch.Tensor) -> "DocumentBoundaries":
        """Segment ids alone, for callers that pass no boundaries: only the dense `mask` backend
        (the reference) can run them, and it needs nothing else."""
        empty = torch.zeros(0, dtype=torch.int64, device=segments.device)
        return cls(segments, empty.int(), 0, [], empty, backend="mask")

    def _map(self, fn) -> "DocumentBoundaries":
        buckets = [GatherBucket(fn(b.index), fn(b.keep)) for b in self.buckets]
        return dataclasses.replace(self, segments=fn(self.segments), cu_seqlens=fn(self.cu_seqlens),
                                   buckets=buckets, inverse=fn(self.inverse), cache={})

    def to(self, device, non_blocking: bool = False) -> "DocumentBoundaries":
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "DocumentBoundaries":
        return self._map(lambda t: t.pin_memory())

    def using(self, backend: str) -> "DocumentBoundaries":
        """The same boundaries, run through `backend` (sharing the per-microbatch cache); segments
        alone (`for_mask`) stay with the mask."""
        if backend == self.backend or not self.buckets:
            return self
        return dataclasses.replace(self, backend=backend)

    def cached(self, key, build):
        if key not in self.cache:
            self.cache[key] = build()
        return self.cache[key]
