"""Data: sources, tokenizers, examples, the global-batch plan and per-rank microbatches."""

from __future__ import annotations

from ddptrain.data.batches import TrainBatches
from ddptrain.data.corpus import load_splits
from ddptrain.data.dataset import DataSplits, TokenExamples
from ddptrain.data.global_batch import GlobalBatchPlan
from ddptrain.data.sources import DataError
from ddptrain.data.stdlib import load_stdlib
from ddptrain.data.tokenizer import ByteTokenizer

__all__ = ["DataSplits", "DataError", "TokenExamples", "GlobalBatchPlan", "TrainBatches", "load_splits", "load_stdlib",
           "ByteTokenizer"]
