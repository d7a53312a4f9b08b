"""Token examples: documents cut into pieces of at most seq_len + 1 tokens, or whole conversations.

An example of L tokens gives L - 1 (input, target) pairs. A document's ragged end is a shorter
example, padded at collation with target -100, so valid-token counts really differ between
microbatches (which is exactly the case the global mean-token objective exists for).

Fine-tuning examples (data=sft) are whole conversations with a target mask beside the tokens
(`mask[i] == 1`: token i is a target): every other position's target is -100, and the counts of
valid targets (`valid_targets`, `targets_per_example`) count only the masked-in ones.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np
import torch

from ddptrain.data.index import IndexHome, write_example_index
from ddptrain.data.sources import DataError
from ddptrain.contract.targets import IGNORE_INDEX

log = logging.getLogger(__name__)

EXAMPLE_ARRAYS = ("starts", "lengths", "doc_ids", "doc_begins", "doc_ends")
"""The cached index of a split's examples (ddptrain/data/index.py), each (N,) or (D,) int64."""


@dataclass
class DataSplits:
    """What a data source gives the trainer: training and validation examples and the vocabulary size."""

    train: TokenExamples
    val: TokenExamples
    vocab_size: int
    fingerprint: dict = field(default_factory=dict)
    """What defines the corpus, for the resume check (ddptrain/runs/fingerprint.py): the sources
    (names relative to their common directory, sizes, mtimes), the tokenizer's hash, the document and
    valid-target counts of the training split."""


def assign_splits(names: list[str], docs: np.ndarray, is_val: np.ndarray, has_val_files: bool,
                  usable: str = "document of at least 2 tokens", skipped: str = "") -> dict:
    """(D, k) documents per split; an empty corpus or an empty validation split is a clear error,
    which says `skipped` (what preprocessing left out, and why) where it is not empty."""
    train, val = docs[~is_val], docs[is_val]
    why = f" ({skipped})" if skipped else ""
    if not len(train) and not len(val):
        raise DataError(f"the corpus is empty: no {usable} in data.paths{why}")
    if not len(val):
        if has_val_files:
            raise DataError(f"data.val_paths produced no {usable}{why}")
        if len(train) < 2:
            raise DataError(f"the corpus has only {len(train)} {usable}, but training needs "
                            "one to train on and one for validation; add data (data=text data.split_by=paragraph "
                            "cuts files into more documents) or give data.val_paths")
        train, val = train[:-1], train[-1:]  # tiny corpora still get a validation set
        log.info("data: no document hashed into the validation split; using the last one (%s)", names[-1])
    if not len(train):
        raise DataError(f"the corpus has only {len(val)} usable document(s), all in the validation split; "
                        "add data or lower data.val_percent")
    return {"train": train, "val": val}


@dataclass
class TokenExamples:
    """All examples of one split: a flat token array and (start, length) of every example."""

    tokens: np.ndarray
    starts: np.ndarray  # (N,) int64
    lengths: np.ndarray  # (N,) int64, each in [2, seq_len + 1]
    documents: int
    skipped_documents: int
    doc_ids: np.ndarray  # (N,) int64: which document of this split (0..documents-1) each example comes from
    mask: np.ndarray | None = None  # like `tokens`: 1 where the token is a target (data=sft), None: all are
    example_targets: np.ndarray | None = None  # (N,) int64: valid targets of each example, with a mask
    total_targets: int | None = None  # valid targets of the split, where the cached index counted them
    home: IndexHome | None = None  # where the split's index is cached (ddptrain/data/index.py), if it is
    doc_spans: tuple[np.ndarray, np.ndarray] | None = None  # (D,) begin and end of each document, if indexed

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def is_conversations(self) -> bool:
        """Whole examples with a target mask (data=sft): packing keeps each one whole."""
        return self.mask is not None

    @classmethod
    def whole(cls, tokens: np.ndarray, mask: np.ndarray, docs: np.ndarray, skipped: int = 0) -> "TokenExamples":
        """One example per document of (D, 3) (start, length, valid targets), each already at most
        seq_len + 1 tokens long (data=sft truncates when it preprocesses)."""
        docs = np.asarray(docs, dtype=np.int64).reshape(-1, 3)
        if not len(docs):
            raise ValueError("the data source produced no example")
        return cls(tokens, docs[:, 0].copy(), docs[:, 1].copy(), len(docs), skipped,
                   np.arange(len(docs), dtype=np.int64), mask, docs[:, 2].copy())

    @classmethod
    def from_documents(cls, docs: Iterable[np.ndarray], seq_len: int) -> "TokenExamples":
        pieces, starts, lengths, doc_ids = [], [], [], []
        offset = documents = skipped = 0
        span = seq_len + 1
        for doc in docs:
            if len(doc) < 2:  # a document of one token has no (input, target) pair
                skipped += 1
                continue
            documents += 1
            pieces.append(doc)
            for begin in range(0, len(doc) - 1, seq_len):
                length = min(span, len(doc) - begin)
                if length < 2:
                    break
                starts.append(offset + begin)
                lengths.append(length)
                doc_ids.append(documents - 1)
            offset += len(doc)
        if not starts:
            raise ValueError("the data source produced no example: every document was shorter than 2 tokens")
        tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint8)
        return cls(tokens, np.asarray(starts, dtype=np.int64), np.asarray(lengths, dtype=np.int64), documents, skipped,
                   np.asarray(doc_ids, dtype=np.int64))

    @classmethod
    def from_token_array(cls, tokens: np.ndarray, doc_starts: np.ndarray, doc_lengths: np.ndarray,
                         seq_len: int, home: IndexHome | None = None) -> "TokenExamples":
        """The same cut as `from_documents`, for documents given as (start, length) in a flat array.

        `tokens` may be a read-only memory map of any size: nothing here touches the tokens, the
        examples are computed from the document offsets alone (vectorised, O(examples)). With `home`,
        they are computed once into the cache and memory-mapped (ddptrain/data/index.py).
        """
        if home is not None:
            found = home.arrays("examples", lambda writers: write_example_index(writers, doc_starts, doc_lengths,
                                                                                seq_len), EXAMPLE_ARRAYS)
            if found is not None:
                arrays, meta = found
                if not meta["documents"]:
                    raise ValueError("the data source produced no example: every document was shorter than 2 tokens")
                return cls(tokens, arrays["starts"], arrays["lengths"], meta["documents"], meta["skipped"],
                           arrays["doc_ids"], total_targets=meta["valid_targets"], home=home,
                           doc_spans=(arrays["doc_begins"], arrays["doc_ends"]))
        doc_starts = np.asarray(doc_starts, dtype=np.int64)
        doc_lengths = np.asarray(doc_lengths, dtype=np.int64)
        usable = doc_lengths >= 2  # a document of one token has no (input, target) pair
        doc_starts, doc_lengths = doc_starts[usable], doc_lengths[usable]
        skipped = int((~usable).sum())
        if not len(doc_starts):
            raise ValueError("the data source produced no example: every document was shorter than 2 tokens")
        per_doc = (doc_lengths - 2) // seq_len + 1  # pieces begin at 0, seq_len, ... < length - 1
        doc_ids = np.repeat(np.arange(len(doc_starts), dtype=np.int64), per_doc)
        first = np.cumsum(per_doc) - per_doc
        begins = (np.arange(len(doc_ids), dtype=np.int64) - first[doc_ids]) * seq_len
        starts = doc_starts[doc_ids] + begins
        lengths = np.minimum(seq_len + 1, doc_lengths[doc_ids] - begins)
        return cls(tokens, starts, lengths, len(doc_starts), skipped, doc_ids)

    def targets_per_example(self) -> np.ndarray:
        """(N,) valid targets of each example: L - 1, or the masked-in ones."""
        return self.example_targets if self.mask is not None else self.lengths - 1

    def valid_targets(self) -> int:
        if self.total_targets is not None and self.mask is None:
            return self.total_targets
        return int(self.targets_per_example().sum())

    def collate(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of shape (B, T) for the given examples, T the longest among them.

        Padding goes at the end: with causal attention it cannot change the earlier positions.
        """
        width = int(self.lengths[indices].max()) - 1
        inputs = np.zeros((len(indices), width), dtype=np.int64)
        targets = np.full((len(indices), width), IGNORE_INDEX, dtype=np.int64)
        for row, index in enumerate(indices):
            start, length = self.starts[index], self.lengths[index]
            piece = self.tokens[start : start + length]
            inputs[row, : length - 1] = piece[:-1]
            targets[row, : length - 1] = self.example_targets_of(start, length, piece)
        return torch.from_numpy(inputs), torch.from_numpy(targets)

    def example_targets_of(self, start: int, length: int, piece: np.ndarray) -> np.ndarray:
        """(length - 1,) targets of the example at `start`: the next tokens, -100 where masked out."""
        targets = piece[1:].astype(np.int64)
        if self.mask is not None:
            targets[self.mask[start + 1 : start + length] == 0] = IGNORE_INDEX
        return targets
