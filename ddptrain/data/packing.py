"""Packing: rows of exactly seq_len + 1 tokens cut from the stream of all documents.

With `batch.pack=true` the examples ARE these rows: documents are laid end to end and the stream
is cut every seq_len tokens, so every row but the corpus's last is full and almost nothing is
padding. Inside a row each document gets its own segment id and positions that restart at 0,
and the model attends only within a segment: no token sees another document. A target that
would be the first token of the next document is ignored (-100), so a document of L tokens
still contributes L - 1 targets, wherever the cuts fall. A document cut by a row boundary
continues in the next row without the context before the cut (as in every packed trainer).

Because the rows depend only on the data and seq_len, any (world size x micro size/tokens)
layout of packed rows sees the same examples: the layout invariance holds within packing.

Conversations (data=sft) are packed differently, so that a packed step is the same sample as an
unpacked one: `ConversationRows` takes the examples that the step's global batch already drew and
packs them, whole, into rows of at most seq_len positions (best-fit decreasing). Each keeps its
own positions, attention segment and masked targets, so the packed step computes the same loss
as the unpacked step, and `batch.global_size` still counts conversations.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ddptrain.data.dataset import TokenExamples
from ddptrain.data.index import write_packed_index
from ddptrain.contract.targets import IGNORE_INDEX
from ddptrain.contract.boundaries import DocumentBoundaries


@dataclass
class PackedExamples:
    """Rows of a packed token stream; `starts`/`lengths` play the role of TokenExamples' fields."""

    tokens: np.ndarray  # the stream: every document once, end to end (or, with doc_sources, where they are)
    doc_starts: np.ndarray  # (D,) offset of each document in the stream, increasing
    starts: np.ndarray  # (N,) row starts (multiples of seq_len)
    lengths: np.ndarray  # (N,) seq_len + 1, except the last row
    documents: int
    skipped_documents: int
    doc_sources: np.ndarray | None = None  # (D,) where each document starts in `tokens`; None: `tokens` is the stream
    stream_tokens: int | None = None  # the stream's length, where `tokens` is not the stream

    def __len__(self) -> int:
        return len(self.starts)

    @classmethod
    def from_examples(cls, examples: TokenExamples, seq_len: int) -> "PackedExamples":
        """Re-lay the documents behind `examples` (pieces overlapping by one token) as a stream: in place,
        through a memory-mapped index in the cache, when the examples have one (ddptrain/data/index.py)."""
        if examples.home is not None and examples.doc_spans is not None:
            begins, ends = examples.doc_spans
            found = examples.home.arrays("packed", lambda writers: write_packed_index(writers, begins, ends, seq_len),
                                         ("doc_starts", "doc_sources", "starts", "lengths"))
            if found is not None:
                arrays, meta = found
                return cls(examples.tokens, arrays["doc_starts"], arrays["starts"], arrays["lengths"],
                           meta["documents"], examples.skipped_documents, arrays["doc_sources"], meta["stream_tokens"])
        order = np.argsort(examples.doc_ids, kind="stable")
        doc_ids = examples.doc_ids[order]
        first = np.flatnonzero(np.r_[True, doc_ids[1:] != doc_ids[:-1]])
        last = np.r_[first[1:] - 1, len(order) - 1]
        begins = examples.starts[order[first]]
        ends = examples.starts[order[last]] + examples.lengths[order[last]]
        tokens = np.concatenate([examples.tokens[b:e] for b, e in zip(begins, ends)])
        doc_starts = np.concatenate([[0], np.cumsum(ends - begins)[:-1]]).astype(np.int64)
        starts = np.arange(0, len(tokens) - 1, seq_len, dtype=np.int64)
        lengths = np.minimum(seq_len + 1, len(tokens) - starts)
        return cls(tokens, doc_starts, starts, lengths, len(begins), examples.skipped_documents)

    def _row(self, index: int):
        start, length = int(self.starts[index]), int(self.lengths[index])
        span = np.arange(start, start + length)
        # The row's documents: a contiguous slice of the (memory-mapped) offsets, then each token's.
        first = int(np.searchsorted(self.doc_starts, start, side="right")) - 1
        end = int(np.searchsorted(self.doc_starts, start + length, side="left"))
        starts = np.asarray(self.doc_starts[first:end])
        local = np.searchsorted(starts, span, side="right") - 1
        doc = first + local  # document of each token
        tokens = (self.tokens[span] if self.doc_sources is None else
                  self.tokens[np.asarray(self.doc_sources[first:end])[local] + (span - starts[local])])
        inputs, targets = tokens[:-1], tokens[1:].astype(np.int64)
        targets[doc[1:] != doc[:-1]] = IGNORE_INDEX  # never predict the next document's first token
        segments = doc[:-1] - doc[0]
        positions = span[:-1] - np.maximum(starts[local[:-1]], start)
        return inputs, targets, positions, segments

    def attention_work(self) -> "RowWork":
        """Per row (indexed by row ids), the sum of the squared lengths of the document pieces among its
        inputs: what causal attention within each document costs, up to a constant (a row of one
        document of T tokens costs T^2, a row of k documents of T / k tokens T^2 / k). Computed for
        the rows asked for: a step's, not the corpus's."""
        return RowWork(self)

    def valid_targets(self) -> int:
        # Rows overlap by one token: len(stream) - 1 pairs, minus one per document boundary.
        return (len(self.tokens) if self.stream_tokens is None else self.stream_tokens) - self.documents

    def collate(self, indices: np.ndarray) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """({"idx", "positions", "segments", "documents"}, targets): (B, T) tensors with T the longest
        row, and the rows' DocumentBoundaries."""
        inputs, targets, positions, segments = empty_rows(len(indices), int(self.lengths[indices].max()) - 1)
        for row, index in enumerate(indices):
            row_inputs, row_targets, row_positions, row_segments = self._row(int(index))
            used = len(row_inputs)
            inputs[row, :used], targets[row, :used] = row_inputs, row_targets
            positions[row, :used], segments[row, :used] = row_positions, row_segments
        return packed_batch(inputs, positions, segments), torch.from_numpy(targets)


class RowWork:
    """PackedExamples.attention_work, row by row: `work[ids]` is an (len(ids),) int64 array."""

    def __init__(self, packed: PackedExamples):
        self.packed = packed

    def __len__(self) -> int:
        return len(self.packed)

    def __getitem__(self, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        work = np.empty(len(ids), dtype=np.int64)
        for k, row in enumerate(ids):
            start = int(self.packed.starts[row])
            end = start + int(self.packed.lengths[row]) - 1  # a row's inputs: [start, start + length - 1)
            inside = self.packed.doc_starts[np.searchsorted(self.packed.doc_starts, start, side="right"):
                                            np.searchsorted(self.packed.doc_starts, end, side="left")]
            # A piece ends at the next document start inside the row, or at the end of the row's inputs.
            work[k] = int((np.diff(np.r_[start, inside, end]).astype(np.int64) ** 2).sum())
        return work


def empty_rows(rows: int, width: int) -> tuple[np.ndarray, ...]:
    """(inputs, targets, positions, segments) of `rows` packed rows of `width`, all padding: targets
    ignored, and the padding a segment of its own (-1)."""
    shape = (rows, width)
    return (np.zeros(shape, dtype=np.int64), np.full(shape, IGNORE_INDEX, dtype=np.int64),
            np.zeros(shape, dtype=np.int64), np.full(shape, -1, dtype=np.int64))


def packed_batch(inputs: np.ndarray, positions: np.ndarray, segments: np.ndarray) -> dict:
    """The model's keyword arguments for packed rows: idx, positions, segments (B, T), and the
    document boundaries (offsets, the longest length, the gather plan) computed here, on the host,
    once per microbatch (ddptrain/contract/boundaries.py)."""
    documents = DocumentBoundaries.from_segments(segments)
    return {"idx": torch.from_numpy(inputs), "positions": torch.from_numpy(positions),
            "segments": documents.segments, "documents": documents}


def best_fit_decreasing(ids: np.ndarray, sizes: np.ndarray, capacity: int) -> list[np.ndarray]:
    """`ids` in rows of at most `capacity` total size: longest first (ties by position), each into the
    fullest row it fits, else a new row. Deterministic; every size must be <= capacity."""
    rows: list[list[int]] = []
    free: list[int] = []
    for index in np.lexsort((np.arange(len(ids)), -sizes)):
        size = int(sizes[index])
        fits = [row for row, room in enumerate(free) if size <= room]
        if fits:
            row = min(fits, key=lambda r: (free[r], r))
            rows[row].append(int(ids[index]))
            free[row] -= size
        else:
            rows.append([int(ids[index])])
            free.append(capacity - size)
    return [np.asarray(row, dtype=np.int64) for row in rows]


def pack_into_rows(ids: np.ndarray, sizes: np.ndarray, capacity: int, min_rows: int = 1) -> list[np.ndarray]:
    """Best-fit decreasing of whole units (`sizes` positions each) into rows of at most `capacity`,
    narrower where that makes at least `min_rows` rows (the world size: every rank gets a row)."""
    if min_rows > 1 and len(sizes):
        capacity = min(capacity, max(int(sizes.max()), -(-int(sizes.sum()) // min_rows)))
    return best_fit_decreasing(ids, sizes, capacity)


def lay_out_rows(examples, rows: list[np.ndarray], width: int) -> tuple[np.ndarray, ...]:
    """(inputs, targets, positions, segments), (len(rows), width) arrays of whole examples laid end
    to end in each row, each a document of its own: positions restart, segments count the row's
    documents from 0 (padding: -1), targets are the examples' own (IGNORE_INDEX where masked)."""
    inputs, targets, positions, segments = empty_rows(len(rows), width)
    for r, row in enumerate(rows):
        at = 0
        for segment, index in enumerate(row):
            start, length = int(examples.starts[index]), int(examples.lengths[index])
            piece = examples.tokens[start : start + length]
            used = slice(at, at + length - 1)
            inputs[r, used] = piece[:-1]
            targets[r, used] = examples.example_targets_of(start, length, piece)
            positions[r, used] = np.arange(length - 1)
            segments[r, used] = segment
            at += length - 1
    return inputs, targets, positions, segments


class ConversationRows:
    """Whole examples (conversations with a target mask) packed into rows of at most seq_len positions."""

    def __init__(self, examples: TokenExamples, seq_len: int):
        self.examples = examples
        self.seq_len = seq_len
        self.positions = examples.lengths - 1  # an example of L tokens takes L - 1 input positions

    def pack(self, ids: np.ndarray, min_rows: int = 1) -> list[np.ndarray]:
        """The rows of these examples (a step's global batch), each an array of example ids; rows are
        narrower than seq_len where that makes at least `min_rows` of them (the world size), so that
        a step of few short conversations still gives every rank a row."""
        return pack_into_rows(ids, self.positions[ids], self.seq_len, min_rows)

    def width(self, row: np.ndarray) -> int:
        return int(self.positions[row].sum())

    def collate(self, rows: list[np.ndarray]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """({"idx", "positions", "segments", "documents"}, targets): (B, T) tensors (B rows, T the
        widest), and the rows' DocumentBoundaries."""
        inputs, targets, positions, segments = lay_out_rows(self.examples, rows,
                                                            max(self.width(row) for row in rows))
        return packed_batch(inputs, positions, segments), torch.from_numpy(targets)
