"""The data plan: global batches independent of the layout, documents cut and padded correctly."""

from __future__ import annotations

import numpy as np
import pytest

from ddptrain.data import TrainBatches, load_stdlib
from ddptrain.data.dataset import TokenExamples
from ddptrain.data.global_batch import GlobalBatchPlan
from ddptrain.data.sources import is_validation, stdlib_documents
from ddptrain.contract.targets import IGNORE_INDEX


def _examples(num: int = 50) -> TokenExamples:
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 256, size=int(n), dtype=np.int64).astype(np.uint8) for n in rng.integers(2, 40, size=num)]
    return TokenExamples.from_documents(docs, seq_len=8)


@pytest.mark.parametrize("world_size, micro", [(1, 8), (1, 2), (2, 4), (2, 1), (4, 2), (8, 1)])
def test_rank_shares_and_microbatches_cover_the_global_batch(world_size, micro):
    examples = _examples()
    reference = GlobalBatchPlan(len(examples), 8, seed=3)
    for step in (0, 1, 7, 40):
        pieces = []
        for rank in range(world_size):
            batches = TrainBatches(examples, 8, micro, 3, rank, world_size)
            ids = batches.microbatch_ids(step)
            assert all(len(m) == micro for m in ids)
            pieces.extend(ids)
        assert np.array_equal(np.concatenate(pieces), reference.global_batch(step))


def test_every_example_once_per_epoch_in_a_seeded_order():
    plan = GlobalBatchPlan(40, 8, seed=5)
    epoch = np.concatenate([plan.global_batch(step) for step in range(5)])
    assert sorted(epoch.tolist()) == list(range(40))
    assert not np.array_equal(epoch, np.arange(40)), "the order should be shuffled"
    again = GlobalBatchPlan(40, 8, seed=5)
    assert np.array_equal(again.global_batch(3), plan.global_batch(3))
    assert not np.array_equal(GlobalBatchPlan(40, 8, seed=6).global_batch(0), plan.global_batch(0))
    # A batch straddling two epochs takes the end of one order and the start of the next.
    straddle = GlobalBatchPlan(12, 8, seed=5).global_batch(1)
    assert len(straddle) == 8 and len(set(straddle[:4].tolist())) == 4


def test_documents_are_cut_to_seq_len_and_ragged_ends_padded():
    doc = np.arange(20, dtype=np.uint8)
    examples = TokenExamples.from_documents([doc, np.array([7], dtype=np.uint8)], seq_len=8)
    assert examples.skipped_documents == 1 and examples.documents == 1
    assert examples.lengths.tolist() == [9, 9, 4]  # 19 targets: 8 + 8 + 3
    inputs, targets = examples.collate(np.array([0, 2]))
    assert inputs.shape == (2, 8)
    assert targets[0].tolist() == list(range(1, 9))
    assert targets[1].tolist() == [17, 18, 19] + [IGNORE_INDEX] * 5
    assert inputs[1, :3].tolist() == [16, 17, 18]
    assert examples.valid_targets() == 19


def test_a_corpus_without_any_usable_document_is_a_clear_error():
    with pytest.raises(ValueError, match="no example"):
        TokenExamples.from_documents([np.array([1], dtype=np.uint8)], seq_len=8)


def test_default_data_is_the_stdlib_split_by_name():
    names = [name for name, _ in stdlib_documents(max_docs=200)]
    assert names == sorted(names) and len(names) == 200
    val = [n for n in names if is_validation(n, 5.0)]
    assert 0 < len(val) < 40
    assert [n for n in names if is_validation(n, 5.0)] == val  # deterministic
    data = load_stdlib(seq_len=64, val_percent=5.0, max_docs=200)
    assert data.vocab_size == 256 and len(data.train) > len(data.val) > 0
    lengths = data.train.lengths
    assert lengths.max() == 65 and (lengths < 65).sum() > 0, "ragged document ends must exist"
