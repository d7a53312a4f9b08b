"""Data: sources, byte tokenizer, examples, the global-batch plan and per-rank microbatches."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from ddptrain.data.dataset import TokenExamples
from ddptrain.data.plan import GlobalBatchPlan, rank_share, split_micro
from ddptrain.data.sources import is_validation, stdlib_documents
from ddptrain.data.tokenizer import ByteTokenizer

log = logging.getLogger(__name__)

Microbatch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class DataSplits:
    train: TokenExamples
    val: TokenExamples
    vocab_size: int


def load_stdlib(seq_len: int, val_percent: float, max_docs: int | None = None) -> DataSplits:
    """The default data: standard-library sources, byte tokens, split by a hash of the file name."""
    tokenizer = ByteTokenizer()
    train_docs, val_docs = [], []
    for name, data in stdlib_documents(max_docs):
        (val_docs if is_validation(name, val_percent) else train_docs).append(tokenizer.encode(data))
    if not val_docs:  # tiny corpora (max_docs) still get a validation set
        val_docs.append(train_docs.pop())
    return DataSplits(
        TokenExamples.from_documents(train_docs, seq_len),
        TokenExamples.from_documents(val_docs, seq_len),
        tokenizer.vocab_size,
    )


class TrainBatches:
    """This rank's microbatches of every step, plus the global cursor for checkpoints."""

    def __init__(self, examples: TokenExamples, global_batch_size: int, micro_batch_size: int,
                 seed: int, rank: int, world_size: int):
        self.examples = examples
        self.plan = GlobalBatchPlan(len(examples), global_batch_size, seed)
        self.micro_batch_size = micro_batch_size
        self.rank = rank
        self.world_size = world_size

    def microbatch_ids(self, step: int) -> list[np.ndarray]:
        share = rank_share(self.plan.global_batch(step), self.rank, self.world_size)
        return split_micro(share, self.micro_batch_size)

    def microbatches(self, step: int) -> list[Microbatch]:
        return [self.examples.collate(ids) for ids in self.microbatch_ids(step)]

    def state_dict(self, step: int) -> dict:
        return {"samples_seen": self.plan.samples_seen(step), "seed": self.plan.seed,
                "global_batch_size": self.plan.global_batch_size}


__all__ = ["DataSplits", "TokenExamples", "GlobalBatchPlan", "TrainBatches", "load_stdlib", "ByteTokenizer"]
