"""Token-budget microbatches and packing: exact, layout-invariant, no cross-document attention."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import numpy as np
import pytest
import torch

import ddptrain
from ddptrain.data.batches import TrainBatches, balanced_shares
from ddptrain.data.dataset import TokenExamples
from ddptrain.testing import run_distributed
from tests.helpers import tiny_gpt

SEQ = 12


def ragged_examples(num_docs: int = 60, seed: int = 0) -> TokenExamples:
    """Documents of 2 to 40 tokens over a 32-token vocabulary: very different lengths."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 32, size=int(n)).astype(np.uint8) for n in rng.integers(2, 40, size=num_docs)]
    return TokenExamples.from_documents(docs, SEQ)


MODES = {
    "micro_size": dict(micro_batch_size=2),
    "micro_tokens_12": dict(micro_batch_size=1, micro_tokens=12),
    "micro_tokens_36": dict(micro_batch_size=1, micro_tokens=36),
    "pack": dict(micro_batch_size=2, pack=True),
    "pack_micro_1": dict(micro_batch_size=1, pack=True),
    "pack_micro_tokens_24": dict(micro_batch_size=1, pack=True, micro_tokens=24),
}


def batches(mode: str, rank: int, world_size: int, examples=None) -> TrainBatches:
    return TrainBatches(examples or ragged_examples(), 8, seed=7, rank=rank, world_size=world_size, seq_len=SEQ,
                        **MODES[mode])


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_example_once_per_epoch_over_two_ranks(mode):
    examples = ragged_examples()
    steps = len(batches(mode, 0, 2, examples).examples) // 8  # whole steps of one epoch
    used = Counter()
    for step in range(steps):
        for rank in range(2):
            for ids in batches(mode, rank, 2, examples).microbatch_ids(step):
                used.update(ids.tolist())
    epoch = set(np.concatenate([batches(mode, 0, 2, examples).plan.global_batch(s) for s in range(steps)]).tolist())
    assert set(used) == epoch and all(count == 1 for count in used.values())


def test_token_budget_and_balance():
    examples = ragged_examples()
    targets = examples.lengths - 1
    for step in range(5):
        ids = batches("micro_size", 0, 2, examples).plan.global_batch(step)
        shares = balanced_shares(ids, targets[ids], 2)
        assert abs(int(targets[shares[0]].sum()) - int(targets[shares[1]].sum())) <= SEQ
        for rank in range(2):
            for micro in batches("micro_tokens_36", rank, 2, examples).rank_microbatches(step, rank):
                assert len(micro) * int(targets[micro].max()) <= 36
                assert int(targets[micro].max()) - int(targets[micro].min()) <= SEQ


def test_packed_rows_are_split_by_attention_work_after_tokens():
    """Rows of seq_len tokens tie on tokens: the rows of long documents (costly attention) go to
    different ranks, never at the price of the token balance."""
    ids = np.arange(4)
    long_short = np.array([4096, 400, 4096, 400])  # squared document lengths of rows 0..3
    by_tokens = balanced_shares(ids, np.full(4, 64), 2)
    assert [long_short[share].sum() for share in by_tokens] == [8192, 800], "the split without attention"
    shares = balanced_shares(ids, np.full(4, 64), 2, long_short)
    assert sorted(long_short[share].sum() for share in shares) == [4496, 4496]
    # Tokens first: the 90-token example is balanced against the two 50-token ones, whatever their work.
    shares = balanced_shares(ids, np.array([90, 50, 50, 10]), 2, np.array([0, 10**6, 10**6, 0]))
    assert sorted(int(np.array([90, 50, 50, 10])[share].sum()) for share in shares) == [100, 100]

    # On packed rows of ragged documents: every step's rows split with the least attention work on
    # the busiest rank that a split of equal tokens allows, within 10% (LPT is greedy).
    layout = batches("pack_micro_tokens_24", 0, 2)
    work = layout.examples.attention_work()
    for step in range(6):
        global_ids = layout.plan.global_batch(step)
        per_rank = [sum(int(work[ids].sum()) for ids in micro) for micro in layout.layout(step)]
        rows = [sum(len(ids) for ids in micro) for micro in layout.layout(step)]
        assert rows == [4, 4], rows
        best = min(max(int(work[list(half)].sum()), int(work[global_ids].sum()) - int(work[list(half)].sum()))
                   for half in itertools.combinations(global_ids, 4))
        assert max(per_rank) <= 1.1 * best, (step, per_rank, best)


def padding_efficiency(mode: str, examples: TokenExamples, steps: int = 6) -> float:
    b = batches(mode, 0, 2, examples)
    valid = processed = 0
    for step in range(steps):
        _, targets = zip(*(b.examples.collate(ids) for ids in
                           (i for r in range(2) for i in b.rank_microbatches(step, r))))
        valid += sum(int((t != -100).sum()) for t in targets)
        processed += sum(rows * width for rows, width in b.global_shapes(step))
    return valid / processed


def test_budgets_and_packing_cut_padding():
    examples = ragged_examples()
    fixed, budget, packed = (padding_efficiency(m, examples) for m in ("micro_size", "micro_tokens_12", "pack"))
    assert fixed < 0.9, "the data must be ragged for this test to mean anything"
    assert budget > fixed and packed >= 0.99 * (SEQ - 1) / SEQ, (fixed, budget, packed)


def _losses(mode: str, steps: int):
    examples = ragged_examples()
    data = batches(mode, ddptrain.get_rank(), ddptrain.get_world_size(), examples)
    model = tiny_gpt(torch.float64)
    engine = ddptrain.Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), precision="fp64")
    return [engine.step(data.microbatches(step)).loss for step in range(steps)]


FAMILIES = {
    "unpacked": ["micro_size", "micro_tokens_12", "micro_tokens_36"],
    "packed": ["pack", "pack_micro_1", "pack_micro_tokens_24"],
}


def _losses_of_each(modes: list[str], steps: int) -> dict[str, list[float]]:
    return {mode: _losses(mode, steps) for mode in modes}


@pytest.fixture(scope="module")
def two_rank_losses() -> dict[str, list[float]]:
    """5 steps of every mode on 2 ranks, all in one process group (one spawn)."""
    return run_distributed(_losses_of_each, 2, [mode for modes in FAMILIES.values() for mode in modes], 5)[0]


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_every_layout_gives_the_same_losses_in_fp64(two_rank_losses, family):
    modes = FAMILIES[family]
    reference = _losses(modes[0], 5)  # one process
    on_two_ranks = two_rank_losses
    for mode in modes:
        for world_size in (1, 2):
            losses = _losses(mode, 5) if world_size == 1 else on_two_ranks[mode]
            for step, (mine, ref) in enumerate(zip(losses, reference)):
                assert math.isclose(mine, ref, rel_tol=1e-9), (mode, world_size, step, mine, ref)


def _packed_row_with(examples: TokenExamples, documents: int):
    packed = batches("pack", 0, 1, examples).examples
    for index in range(len(packed)):
        batch, targets = packed.collate(np.array([index]))
        if int(batch["segments"].max()) + 1 >= documents:
            return batch, targets
    raise AssertionError(f"no packed row holds {documents} documents")


def test_packed_rows_do_not_attend_across_documents():
    batch, _ = _packed_row_with(ragged_examples(), 3)
    model = tiny_gpt(torch.float64).eval()
    segments = batch["segments"][0]
    changed = dict(batch, idx=batch["idx"].clone())
    changed["idx"][0, segments == 1] = (changed["idx"][0, segments == 1] + 5) % 32
    with torch.no_grad():
        before, after = model(**batch), model(**changed)
        plain_before, plain_after = model(batch["idx"]), model(changed["idx"])
    others = segments != 1
    assert torch.equal(before[0, others], after[0, others]), "another document's logits changed"
    assert not torch.equal(before[0, segments == 1], after[0, segments == 1])
    later = segments == 2
    assert not torch.allclose(plain_before[0, later], plain_after[0, later]), "plain causal attention would leak"


def test_packed_document_is_computed_as_if_alone():
    batch, targets = _packed_row_with(ragged_examples(), 3)
    model = tiny_gpt(torch.float64).eval()
    segments = batch["segments"][0]
    inside = segments == 1  # a whole document: it starts and ends inside the row
    assert batch["positions"][0, inside][0] == 0
    alone = batch["idx"][0, inside][None]
    with torch.no_grad():
        assert torch.allclose(model(**batch)[0, inside], model(alone)[0], rtol=0, atol=1e-12)
    # its last input predicts nothing: the next token belongs to the next document
    last = int(inside.nonzero().max())
    assert targets[0, last] == -100 and targets[0, last - 1] != -100


def test_packing_keeps_every_target_once():
    examples = ragged_examples()
    packed = batches("pack", 0, 1, examples).examples
    targets = torch.cat([packed.collate(np.array([i]))[1].flatten() for i in range(len(packed))])
    assert int((targets != -100).sum()) == examples.valid_targets() == packed.valid_targets()
