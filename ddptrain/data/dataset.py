"""Token examples: documents cut into pieces of at most seq_len + 1 tokens.

An example of L tokens gives L - 1 (input, target) pairs. A document's ragged end is a shorter
example, padded at collation with target -100, so valid-token counts really differ between
microbatches (which is exactly the case the global mean-token objective exists for).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable

import numpy as np
import torch

from ddptrain.engine.objective import IGNORE_INDEX

log = logging.getLogger(__name__)


@dataclass
class DataSplits:
    """What a data source gives the trainer: training and validation examples and the vocabulary size."""

    train: TokenExamples
    val: TokenExamples
    vocab_size: int


@dataclass
class TokenExamples:
    """All examples of one split: a flat token array and (start, length) of every example."""

    tokens: np.ndarray
    starts: np.ndarray  # (N,) int64
    lengths: np.ndarray  # (N,) int64, each in [2, seq_len + 1]
    documents: int
    skipped_documents: int
    doc_ids: np.ndarray  # (N,) int64: which document of this split (0..documents-1) each example comes from

    def __len__(self) -> int:
        return len(self.starts)

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
                         seq_len: int) -> "TokenExamples":
        """The same cut as `from_documents`, for documents given as (start, length) in a flat array.

        `tokens` may be a read-only memory map of any size: nothing here touches the tokens, the
        examples are computed from the document offsets alone (vectorised, O(examples)).
        """
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

    def valid_targets(self) -> int:
        return int((self.lengths - 1).sum())

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
            targets[row, : length - 1] = piece[1:]
        return torch.from_numpy(inputs), torch.from_numpy(targets)
