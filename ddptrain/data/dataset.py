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

from ddptrain.objective import IGNORE_INDEX

log = logging.getLogger(__name__)


@dataclass
class TokenExamples:
    """All examples of one split: a flat token array and (start, length) of every example."""

    tokens: np.ndarray
    starts: np.ndarray  # (N,) int64
    lengths: np.ndarray  # (N,) int64, each in [2, seq_len + 1]
    documents: int
    skipped_documents: int

    def __len__(self) -> int:
        return len(self.starts)

    @classmethod
    def from_documents(cls, docs: Iterable[np.ndarray], seq_len: int) -> "TokenExamples":
        pieces, starts, lengths = [], [], []
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
            offset += len(doc)
        if not starts:
            raise ValueError("the data source produced no example: every document was shorter than 2 tokens")
        tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint8)
        return cls(tokens, np.asarray(starts, dtype=np.int64), np.asarray(lengths, dtype=np.int64), documents, skipped)

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
