"""The index of a split's examples and packed rows is part of the cache (ddptrain/data/index.py): built
once, memory-mapped, and the same examples, rows, counts and microbatches as the arrays computed in
memory."""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest

from ddptrain.config import DataConfig
from ddptrain.data import TrainBatches, load_splits
from ddptrain.data import index as index_module
from ddptrain.data.dataset import TokenExamples
from ddptrain.data.packing import PackedExamples

SEQ_LEN = 16


def _corpus(tmp_path, documents: int = 300):
    path = tmp_path / "c.jsonl"
    rng = np.random.default_rng(0)
    path.write_text("".join(json.dumps({"text": "x" * int(rng.integers(1, 90))}) + "\n" for _ in range(documents)))
    return DataConfig(name="jsonl", paths=[str(path)], field="text", cache_dir=str(tmp_path / "cache"))


def _in_memory(examples: TokenExamples, entry_docs: np.ndarray) -> TokenExamples:
    return TokenExamples.from_token_array(examples.tokens, entry_docs[:, 0], entry_docs[:, 1], SEQ_LEN)


def _old_attention_work(packed: PackedExamples) -> np.ndarray:
    """The whole-corpus computation this index replaced, as the reference."""
    starts, lengths = np.asarray(packed.starts), np.asarray(packed.lengths)
    ends = starts + lengths - 1
    cuts = np.union1d(np.asarray(packed.doc_starts), starts)
    cuts = cuts[cuts < ends[-1]]
    pieces = np.diff(np.r_[cuts, ends[-1]])
    rows = np.searchsorted(starts, cuts, side="right") - 1
    return np.bincount(rows, weights=pieces.astype(np.float64) ** 2, minlength=len(starts)).astype(np.int64)


def test_the_cached_index_gives_the_same_examples_rows_and_microbatches_as_in_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(index_module, "CHUNK", 7)  # many chunks: their seams must not show
    cfg = _corpus(tmp_path)
    data = load_splits(cfg, SEQ_LEN, local_rank=0)
    entry = next(p for p in (tmp_path / "cache").iterdir() if p.is_dir())
    for split, examples in (("train", data.train), ("val", data.val)):
        assert isinstance(examples.starts, np.memmap) and isinstance(examples.doc_ids, np.memmap)
        reference = _in_memory(examples, np.load(entry / f"{split}.docs.npy"))
        for name in ("starts", "lengths", "doc_ids"):
            assert np.array_equal(getattr(examples, name), getattr(reference, name)), (split, name)
        assert (examples.documents, examples.skipped_documents) == (reference.documents, reference.skipped_documents)
        assert examples.valid_targets() == int((reference.lengths - 1).sum())
    reference = _in_memory(data.train, np.load(entry / "train.docs.npy"))
    packed, packed_reference = PackedExamples.from_examples(data.train, SEQ_LEN), \
        PackedExamples.from_examples(reference, SEQ_LEN)
    assert isinstance(packed.starts, np.memmap) and packed.doc_sources is not None
    assert len(packed) == len(packed_reference) and packed.valid_targets() == packed_reference.valid_targets()
    assert np.array_equal(packed.doc_starts, packed_reference.doc_starts)
    rows = np.arange(len(packed))
    assert np.array_equal(packed.attention_work()[rows], _old_attention_work(packed_reference))
    inputs, targets = packed.collate(rows)
    inputs_ref, targets_ref = packed_reference.collate(rows)
    assert all(np.array_equal(inputs[k], inputs_ref[k]) for k in ("idx", "positions", "segments"))
    assert np.array_equal(targets, targets_ref)
    for layout in ({}, {"micro_tokens": 40}, {"pack": True, "seq_len": SEQ_LEN},
                   {"pack": True, "seq_len": SEQ_LEN, "micro_tokens": 40}):
        cached, memory = (TrainBatches(examples, 8, 4, 1234, 0, 2, **layout) for examples in (data.train, reference))
        for step in range(5):
            assert [[ids.tolist() for ids in rank] for rank in cached.layout(step)] == \
                   [[ids.tolist() for ids in rank] for rank in memory.layout(step)], (layout, step)
            for mine, theirs in zip(cached.microbatches(step), memory.microbatches(step)):
                assert np.array_equal(mine[1], theirs[1])


def test_the_index_is_built_once_and_a_damaged_one_is_rebuilt(tmp_path, caplog):
    cfg = _corpus(tmp_path)
    with caplog.at_level(logging.INFO, logger="ddptrain"):
        first = load_splits(cfg, SEQ_LEN, local_rank=0)
        PackedExamples.from_examples(first.train, SEQ_LEN)
    assert caplog.text.count("built the examples index") == 2 and caplog.text.count("built the packed index") == 1
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ddptrain"):
        again = load_splits(cfg, SEQ_LEN, local_rank=0)
        PackedExamples.from_examples(again.train, SEQ_LEN)
    assert "built the" not in caplog.text, "reused"
    expected = np.array(first.train.starts)  # a copy: the test damages the file this memory map reads
    assert np.array_equal(again.train.starts, expected)
    entry = next(p for p in (tmp_path / "cache").iterdir() if p.is_dir())
    starts = next((entry / "index").glob("examples-train-*")) / "starts.npy"
    data = bytearray(starts.read_bytes())
    data[-8:] = b"\x01" * 8
    starts.write_bytes(bytes(data))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ddptrain"):
        rebuilt = load_splits(cfg, SEQ_LEN, local_rank=0)
    assert "starts.npy does not match its checksum" in caplog.text and "built the examples index" in caplog.text
    assert np.array_equal(rebuilt.train.starts, expected)
    other = load_splits(cfg, 2 * SEQ_LEN, local_rank=0)  # another seq_len: an index of its own
    assert len(other.train) < len(first.train) and len(list((entry / "index").glob("examples-train-*"))) == 2


def test_a_read_only_entry_computes_the_index_in_memory(tmp_path, caplog):
    cfg = _corpus(tmp_path)
    expected = load_splits(cfg, SEQ_LEN, local_rank=0).train
    entry = next(p for p in (tmp_path / "cache").iterdir() if p.is_dir())
    for directory in (entry / "index").iterdir():
        if directory.is_dir():
            for file in directory.iterdir():
                file.unlink()
            directory.rmdir()
    (entry / "index").chmod(0o555)
    try:
        if os.access(entry / "index", os.W_OK):
            pytest.skip("running as root: a read-only directory is still writable")
        with caplog.at_level(logging.WARNING, logger="ddptrain"):
            data = load_splits(cfg, SEQ_LEN, local_rank=0)
    finally:
        (entry / "index").chmod(0o755)
    assert "computed in memory" in caplog.text and np.array_equal(data.train.starts, expected.starts)
