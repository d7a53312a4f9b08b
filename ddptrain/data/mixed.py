"""data=mixture's examples: every source loaded as its own kind, then laid end to end as one set.

Each source goes through `load_splits` with its own config (its keys over the other data.* keys:
config/validation.py's `mixture_sources`), so it has its own cache entry, exactly as if it were
trained alone. The sources' examples are then one TokenExamples (or PackedExamples) whose ids are
the sources' ids shifted by an offset, and whose token (and target mask) arrays are the sources'
memory maps read in place through `ConcatArray`: nothing is copied but the per-example index.

Packing: text-like sources are packed each into its own stream of rows (rows never cross two
sources), as a packed run of that source alone. A mixture with conversations (sft) packs each
step's examples whole instead (ConversationRows: text pieces then are documents of their own), so
a packed step is the same sample as an unpacked one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from ddptrain.config.validation import mixture_sources
from ddptrain.contract.sourced import SourcedTargets
from ddptrain.contract.targets import IGNORE_INDEX
from ddptrain.data.corpus import load_splits
from ddptrain.data.dataset import DataSplits, TokenExamples
from ddptrain.data.mixture import MixSource
from ddptrain.data.packing import PackedExamples

log = logging.getLogger(__name__)


class ConcatArray:
    """Arrays laid end to end, read by a slice or an index array that stays inside one of them
    (an example, a packed row); a part that is None reads as ones (a source without a target mask)."""

    def __init__(self, parts: list, sizes: list[int]):
        self.parts = parts
        self.ends = np.cumsum(sizes, dtype=np.int64)
        self.begins = self.ends - np.asarray(sizes, dtype=np.int64)

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def _part(self, first: int) -> tuple[object, int, int]:
        k = int(np.searchsorted(self.ends, first, side="right"))
        return self.parts[k], int(self.begins[k]), int(self.ends[k] - self.begins[k])

    def __getitem__(self, key):
        if isinstance(key, slice):
            part, begin, size = self._part(key.start or 0)
            local = slice((key.start or 0) - begin, (len(self) if key.stop is None else key.stop) - begin)
            return part[local] if part is not None else np.ones(len(range(size)[local]), dtype=np.uint8)
        key = np.asarray(key)
        part, begin, _ = self._part(int(key.min()) if key.size else 0)
        return part[key - begin] if part is not None else np.ones(key.shape, dtype=np.uint8)


@dataclass
class MixedPackedExamples(PackedExamples):
    """Packed rows of several sources, each source's stream packed on its own."""

    parts: list = field(default_factory=list)

    def attention_work(self) -> np.ndarray:
        return np.concatenate([part.attention_work() for part in self.parts])


@dataclass
class MixtureSplits(DataSplits):
    """A mixture's splits: `train` and `val` hold every source's examples; `parts` each source's own."""

    names: list = field(default_factory=list)
    parts: list = field(default_factory=list)
    """Each source's DataSplits, in the order of data.sources."""
    settings: list = field(default_factory=list)
    """Each source's MixSourceConfig (weight, max_repeat, on_exhausted)."""


def load_mixture(data_cfg, seq_len: int, local_rank: int | None = None, collective: bool = False) -> MixtureSplits:
    """Every source through the cache as its own kind, then laid end to end."""
    names, parts, settings = [], [], []
    for name, source_cfg, mix in mixture_sources(data_cfg):
        log.info("data: source %s (%s, weight %g)", name, source_cfg.name, mix.weight)
        parts.append(load_splits(source_cfg, seq_len, local_rank=local_rank, collective=collective))
        names.append(name)
        settings.append(mix)
    train = combine([part.train for part in parts])
    val = combine([part.val for part in parts])
    # What the evaluator reads to give val_loss/<source>: each source's (name, first id, examples) in `val`.
    val.mixture_sources = [(name, int(first), len(part.val)) for name, first, part
                           in zip(names, np.cumsum([0] + [len(part.val) for part in parts[:-1]]), parts)]
    vocab_size = max(part.vocab_size for part in parts)
    fingerprint = {"sources": {name: part.fingerprint for name, part in zip(names, parts)},
                   "weights": {name: mix.weight for name, mix in zip(names, settings)},
                   "documents": train.documents, "targets": train.valid_targets()}
    return MixtureSplits(train, val, vocab_size, fingerprint, names=names, parts=parts, settings=settings)


def combine(parts: list):
    """The examples of several sources as one set (one source: itself), ids shifted by each one's offset."""
    if len(parts) == 1:
        return parts[0]
    if all(isinstance(part, PackedExamples) for part in parts):
        return _combine_packed(parts)
    sizes = [len(part.tokens) for part in parts]
    token_offsets = np.cumsum([0] + sizes[:-1])
    doc_offsets = np.cumsum([0] + [part.documents for part in parts[:-1]])
    has_mask = any(part.mask is not None for part in parts)
    return TokenExamples(
        ConcatArray([part.tokens for part in parts], sizes),
        np.concatenate([part.starts + offset for part, offset in zip(parts, token_offsets)]),
        np.concatenate([part.lengths for part in parts]),
        sum(part.documents for part in parts), sum(part.skipped_documents for part in parts),
        np.concatenate([part.doc_ids + offset for part, offset in zip(parts, doc_offsets)]),
        ConcatArray([part.mask for part in parts], sizes) if has_mask else None,
        np.concatenate([part.targets_per_example() for part in parts]) if has_mask else None)


def _combine_packed(parts: list[PackedExamples]) -> MixedPackedExamples:
    sizes = [len(part.tokens) for part in parts]
    offsets = np.cumsum([0] + sizes[:-1])
    return MixedPackedExamples(
        ConcatArray([part.tokens for part in parts], sizes),
        np.concatenate([part.doc_starts + offset for part, offset in zip(parts, offsets)]),
        np.concatenate([part.starts + offset for part, offset in zip(parts, offsets)]),
        np.concatenate([part.lengths for part in parts]),
        sum(part.documents for part in parts), sum(part.skipped_documents for part in parts), parts=parts)


def example_targets(examples) -> np.ndarray:
    """(N,) valid targets of each example: a piece's or conversation's own, or a packed row's (its
    positions minus the document starts among its targets, which are ignored)."""
    if not isinstance(examples, PackedExamples):
        return examples.targets_per_example()
    first = np.searchsorted(examples.doc_starts, examples.starts + 1, side="left")
    last = np.searchsorted(examples.doc_starts, examples.starts + examples.lengths - 1, side="right")
    return examples.lengths - 1 - (last - first)


def mixture_training_examples(splits: MixtureSplits, pack: bool, seq_len: int):
    """(the combined training examples as TrainBatches takes them, the plan's sources). Text-like
    sources are packed each into its own stream where the mixture has no conversations."""
    parts = [part.train for part in splits.parts]
    if pack and not any(part.is_conversations for part in parts):
        parts = [PackedExamples.from_examples(part, seq_len) for part in parts]
    offsets = np.cumsum([0] + [len(part) for part in parts[:-1]])
    sources = [MixSource(name, mix.weight, example_targets(part), int(offset), mix.max_repeat, mix.on_exhausted)
               for name, mix, part, offset in zip(splits.names, splits.settings, parts, offsets)]
    return combine(parts), sources


class SourceLabels:
    """A mixture's microbatch targets with the source of each position (SourcedTargets), from each
    example's id: the sources' ids are consecutive ranges starting at `offsets`."""

    def __init__(self, offsets: list[int], lengths: np.ndarray):
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.lengths = lengths  # (N,) of the combined examples: a conversation row's pieces are L - 1 positions

    def source_of(self, ids: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.offsets, ids, side="right") - 1

    def __call__(self, ids, targets: torch.Tensor) -> SourcedTargets:
        """`ids`: the microbatch's example ids (a row each), or its packed rows (a list of id arrays)."""
        if isinstance(ids, list):  # rows of whole examples laid end to end (packing.lay_out_rows)
            sources = np.full(tuple(targets.shape), -1, dtype=np.int64)
            for row, members in enumerate(ids):
                widths = self.lengths[members] - 1
                sources[row, : int(widths.sum())] = np.repeat(self.source_of(members), widths)
        else:
            sources = np.repeat(self.source_of(np.asarray(ids))[:, None], targets.shape[1], axis=1)
        valid = (targets.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)  # on the host: the chunked head's
        return SourcedTargets(targets, torch.from_numpy(sources), len(self.offsets), valid)
