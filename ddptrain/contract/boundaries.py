"""The document boundaries of a packed microbatch, computed once in collation, on the host.

Every run of equal segment ids in a row is a document (the row's padding, segment -1, included).
The boundaries hold what every attention backend of ddptrain/models/attention.py needs, so that
no backend reads a length back from the device (`.item()`) or builds a T x T tensor: cu_seqlens
offsets over the flattened (B * T) rows, the longest document as a host int, and the gather plan.

The gather plan puts the documents, longest first, into buckets, each padded to its longest
document and run as one attention call. Which documents share a bucket is the cheapest plan under
a cost model of causal attention (`bucket_plan`): a bucket of n documents padded to length L costs
n x (L^2 + ATTENTION_PER_TOKEN x L) + ATTENTION_PER_CALL, so padding a long document is worth a
call saved only when little is padded. A bucket's longest document is at most twice its shortest
(or at most SMALL_DOCUMENT tokens long), so the buffer is bounded: at most 2 x B x T positions, plus
SMALL_DOCUMENT per document of up to SMALL_DOCUMENT tokens. The plan is never costlier than
bucketing by powers of two (each such class is one feasible plan), and has one call at most per
distinct document length.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

SMALL_DOCUMENT = 16
"""Documents up to this many tokens may share one gather bucket whatever their lengths (padding
them costs little)."""

ATTENTION_PER_TOKEN = 64
ATTENTION_PER_CALL = 128 ** 2
"""The cost model of `bucket_plan`, in units of one causal score (of L^2 per document of L): what
a padded position costs beyond its scores (projections in and out, the kernel's per-row work), and
what one more attention call costs (its launch and slicing, forward and backward). Fitted to
torch's CPU flash kernel, whose fwd+bwd time these predict within about 25% from 16 x 32 to
2 x 1024 (documents x length)."""


def bucket_plan(lengths: np.ndarray) -> list[np.ndarray]:
    """The documents of each gather bucket (indices into `lengths`), longest bucket first and each
    longest first (ties in order): the plan of least modelled cost in which every bucket's longest
    document is at most twice its shortest, or at most SMALL_DOCUMENT tokens long. A dynamic
    program over the distinct lengths, longest first (a bucket is a run of them)."""
    distinct, counts = np.unique(lengths, return_counts=True)
    distinct, counts = distinct[::-1].astype(np.float64), counts[::-1]  # longest first
    before = np.r_[0, np.cumsum(counts)]  # documents longer than distinct[i]: before[i]
    best = np.zeros(len(distinct) + 1)
    cut = np.zeros(len(distinct) + 1, dtype=np.int64)
    for end in range(1, len(distinct) + 1):  # the cheapest plan of distinct[:end]; its last bucket starts at cut
        first = np.arange(end)
        longest = distinct[first]
        cost = (best[first] + (before[end] - before[first]) * (longest ** 2 + ATTENTION_PER_TOKEN * longest)
                + ATTENTION_PER_CALL)
        cost[(longest > 2 * distinct[end - 1]) & (longest > SMALL_DOCUMENT)] = np.inf
        cut[end] = int(np.argmin(cost))
        best[end] = cost[cut[end]]
    bounds, end = [], len(distinct)
    while end:
        bounds.append((cut[end], end))
        end = cut[end]
    order = np.lexsort((np.arange(len(lengths)), -lengths))  # longest first, ties in order
    return [order[before[start]:before[stop]] for start, stop in reversed(bounds)]


@dataclass
class DocumentBoundaries:
    """Where each document of a packed microbatch starts and ends, computed once on the host.

    Tensors move with `.to(device)` (and `.pin_memory()`), host ints stay ints. `backend` is the
    attention backend the model runs them through (set by the model, not by collation).

    The gather plan is a permutation with padding: the buffer of all buckets, laid end to end, takes
    token `gather_index[p]` at position p, and token t lands at `token_position[t]`. Both ways are
    then gathers (index_select), forward and backward: no scatter-add."""

    segments: torch.Tensor  # (B, T) int64: a document id per position (padding: -1, its own document)
    cu_seqlens: torch.Tensor  # (D + 1,) int32: offsets of the D documents in the flattened B * T rows
    max_length: int  # the longest document (host int: no sync to size a kernel)
    buckets: list[tuple[int, int]]  # gather: (documents, padded length) of each bucket, longest first
    gather_index: torch.Tensor  # (P,) int64: the token at each buffer position (padding: 0, any token)
    gather_padded: torch.Tensor  # (P,) int64: the same, padding -> B * T (a zero row appended)
    token_position: torch.Tensor  # (B * T,) int64: where each token lands in the buffer
    backend: str | None = None  # None: the model's own (trainer.attention); collation leaves it so
    cache: dict = field(default_factory=dict, repr=False, compare=False)  # per microbatch: masks

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.segments.shape)

    @property
    def rows_are_documents(self) -> bool:
        """One document per row: plain causal attention over the rows is per-document attention."""
        return len(self.cu_seqlens) - 1 == self.segments.size(0) and bool(self.buckets)

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
        buckets, indices = [], []
        for docs in bucket_plan(lengths):
            longest = int(lengths[docs[0]])
            offsets = np.arange(longest)
            real = offsets[None, :] < lengths[docs][:, None]  # (n, L)
            indices.append(np.where(real, starts[docs][:, None] + offsets[None, :], -1).ravel())
            buckets.append((len(docs), longest))
        index = np.concatenate(indices)
        real = index >= 0
        token_position = np.empty(flat.size, dtype=np.int64)
        token_position[index[real]] = np.flatnonzero(real)
        as_tensor = lambda array: torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))
        return cls(as_tensor(segments), torch.from_numpy(cu_seqlens), int(lengths.max()), buckets,
                   as_tensor(np.where(real, index, 0)), as_tensor(np.where(real, index, flat.size)),
                   as_tensor(token_position))

    @classmethod
    def for_mask(cls, segments: torch.Tensor) -> "DocumentBoundaries":
        """Segment ids alone, for callers that pass no boundaries: only the dense `mask` backend
        (the reference) can run them, and it needs nothing else."""
        empty = torch.zeros(0, dtype=torch.int64, device=segments.device)
        return cls(segments, empty.int(), 0, [], empty, empty, empty, backend="mask")

    def __getitem__(self, key) -> "DocumentBoundaries":
        """`[rows, :1]`: the boundaries of one token per row, each its own document (exact, and
        known without reading the data back). The Engine's filler microbatches slice every input
        so (`value[:1, :1]`); other slices would need the host's segments again."""
        segments = self.segments[key]
        if segments.dim() != 2 or segments.size(1) != 1:
            raise TypeError(f"DocumentBoundaries can be cut to one token per row ([rows, :1]), not {key!r}: "
                            "collate the rows again instead")
        count, device = segments.size(0), segments.device
        tokens = torch.arange(count, device=device)  # token t is document t, at buffer position t
        cu_seqlens = torch.arange(count + 1, dtype=torch.int32, device=device)
        return DocumentBoundaries(segments, cu_seqlens, 1, [(count, 1)], tokens, tokens, tokens, backend=self.backend)

    def _map(self, fn) -> "DocumentBoundaries":
        return dataclasses.replace(self, segments=fn(self.segments), cu_seqlens=fn(self.cu_seqlens),
                                   gather_index=fn(self.gather_index), gather_padded=fn(self.gather_padded),
                                   token_position=fn(self.token_position), cache={})

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
