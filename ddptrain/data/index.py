"""The index of a split's examples as part of the cache: built once, memory-mapped by every rank.

Cutting documents into examples (`TokenExamples.from_token_array`) and laying them out as packed
rows (`PackedExamples.from_examples`) give arrays of O(examples) entries (starts, lengths, document
ids; row starts, the stream's documents). Held in memory, every rank pays them at every start-up: 24
bytes per example, plus a copy of the whole token stream for packing. Here they are computed once,
a bounded chunk of documents at a time, into `<entry>/index/<kind>-<split>-<seq_len>/` (a cache
entry of its own, with checksums, built by the team's rank 0 while the others wait) and opened with
`np.load(mmap_mode="r")`: a rank reads the pages of the examples its steps touch, and start-up
time and resident memory do not grow with the corpus (docs/data.md, 'The cost at scale').
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ddptrain.data.cache import TokenWriter, build_or_wait

log = logging.getLogger(__name__)

CHUNK = 1 << 20
"""Documents (or rows) per pass: the index build holds O(CHUNK) entries, whatever the corpus."""


@dataclass(frozen=True)
class IndexHome:
    """Where a split's index lives in its cache entry, and who builds it."""

    entry: Path
    split: str
    seq_len: int
    is_builder: bool
    launch: str  # names the failure marker the builder writes and the others poll

    def arrays(self, kind: str, build: Callable[[dict[str, TokenWriter]], dict],
               names: tuple[str, ...]) -> tuple[dict[str, np.ndarray], dict] | None:
        """({name: memory-mapped array}, meta) of the index `kind`, built once by `build(writers)` (int64
        writers by name; returns the meta); None where the entry cannot be written (a read-only
        cache): the caller then computes the arrays in memory."""
        home = self.entry / "index"
        key = f"{kind}-{self.split}-{self.seq_len}"

        def write(tmp: Path) -> dict:
            writers = {name: TokenWriter(tmp / f"{name}.npy", np.int64) for name in names}
            try:
                return build(writers)
            finally:
                for writer in writers.values():
                    writer.close()

        try:
            home.mkdir(exist_ok=True)
            directory, meta, built = build_or_wait(home, key, write, self.is_builder,
                                                   failed=home / f"{key}.failed-{self.launch}")
        except PermissionError as error:
            log.warning("data: cannot write the %s index into %s (%s): computed in memory", kind, home, error)
            return None
        if built:
            log.info("data: built the %s index of the %s split (seq_len %d) in %s", kind, self.split, self.seq_len,
                     directory)
        return {name: np.load(directory / f"{name}.npy", mmap_mode="r") for name in names}, meta


def write_example_index(writers: dict[str, TokenWriter], doc_starts: np.ndarray, doc_lengths: np.ndarray,
                        seq_len: int) -> dict:
    """Examples of (start, length) documents, as TokenExamples.from_token_array cuts them, a chunk of
    documents at a time: starts, lengths, doc_ids, and each kept document's (begin, end)."""
    documents = skipped = targets = 0
    for at in range(0, len(doc_starts), CHUNK):
        starts = np.asarray(doc_starts[at : at + CHUNK], dtype=np.int64)
        lengths = np.asarray(doc_lengths[at : at + CHUNK], dtype=np.int64)
        usable = lengths >= 2  # a document of one token has no (input, target) pair
        skipped += int((~usable).sum())
        starts, lengths = starts[usable], lengths[usable]
        per_doc = (lengths - 2) // seq_len + 1  # pieces begin at 0, seq_len, ... < length - 1
        local = np.repeat(np.arange(len(starts), dtype=np.int64), per_doc)
        first = np.cumsum(per_doc) - per_doc
        begins = (np.arange(len(local), dtype=np.int64) - first[local]) * seq_len
        example_lengths = np.minimum(seq_len + 1, lengths[local] - begins)
        writers["starts"].append(starts[local] + begins)
        writers["lengths"].append(example_lengths)
        writers["doc_ids"].append(local + documents)
        writers["doc_begins"].append(starts)
        writers["doc_ends"].append(starts + lengths)
        documents += len(starts)
        targets += int((example_lengths - 1).sum())
    return {"documents": documents, "skipped": skipped, "valid_targets": targets}


def write_packed_index(writers: dict[str, TokenWriter], doc_begins: np.ndarray, doc_ends: np.ndarray,
                       seq_len: int) -> dict:
    """Packed rows of the documents [begin, end) laid end to end, as PackedExamples.from_examples lays
    them: each document's offset in the stream and in the source, and the rows' starts and lengths."""
    offset = 0
    for at in range(0, len(doc_begins), CHUNK):
        begins = np.asarray(doc_begins[at : at + CHUNK], dtype=np.int64)
        sizes = np.asarray(doc_ends[at : at + CHUNK], dtype=np.int64) - begins
        writers["doc_starts"].append(offset + np.cumsum(sizes) - sizes)
        writers["doc_sources"].append(begins)
        offset += int(sizes.sum())
    for at in range(0, max(offset - 1, 0), CHUNK * seq_len):
        starts = np.arange(at, min(at + CHUNK * seq_len, offset - 1), seq_len, dtype=np.int64)
        writers["starts"].append(starts)
        writers["lengths"].append(np.minimum(seq_len + 1, offset - starts))
    return {"stream_tokens": offset, "documents": len(doc_begins)}
