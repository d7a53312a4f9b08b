"""Data: sources, byte tokenizer, examples, the global-batch plan and per-rank microbatches."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from ddptrain.data.dataset import TokenExamples
from ddptrain.data.batches import TrainBatches
from ddptrain.data.plan import GlobalBatchPlan
from ddptrain.data.corpus import load_splits
from ddptrain.data.sources import DataError, is_validation, stdlib_documents
from ddptrain.data.tokenizer import ByteTokenizer

log = logging.getLogger(__name__)

Microbatch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class DataSplits:
    train: TokenExamples
    val: TokenExamples
    vocab_size: int


def load_stdlib(seq_len: int, val_percent: float, max_docs: int | None = None, tokenizer=None) -> DataSplits:
    """The default data: standard-library sources, byte tokens (or `tokenizer`), split by a hash of the file name."""
    tokenizer = tokenizer or ByteTokenizer()
    train_docs, val_docs = [], []
    for name, data in stdlib_documents(max_docs):
        if tokenizer.needs_text:
            data = data.decode("utf-8", errors="replace")
        (val_docs if is_validation(name, val_percent) else train_docs).append(tokenizer.encode(data))
    if not val_docs:  # tiny corpora (max_docs) still get a validation set
        val_docs.append(train_docs.pop())
    return DataSplits(
        TokenExamples.from_documents(train_docs, seq_len),
        TokenExamples.from_documents(val_docs, seq_len),
        tokenizer.vocab_size,
    )


__all__ = ["DataSplits", "DataError", "TokenExamples", "GlobalBatchPlan", "TrainBatches", "load_splits", "load_stdlib",
           "ByteTokenizer"]
