"""data=mixture's plan, alone (no model): every source within one example of its share of the valid
targets after every step, on any layout; its streams, cursors, repetition and exhausted sources;
the epoch order as a seeded bijection."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from ddptrain.data import TrainBatches
from ddptrain.data.dataset import TokenExamples
from ddptrain.data.global_batch import GlobalBatchPlan
from ddptrain.contract.targets import IGNORE_INDEX
from ddptrain.data.mixed import SourceLabels, combine, example_targets
from ddptrain.data.mixture import MixSource, MixturePlan, SourceExhausted
from ddptrain.data.order import Bijection, EpochStream
from ddptrain.data.packing import PackedExamples


def _source_examples(rng, documents: int, longest: int, seq_len: int) -> TokenExamples:
    docs = [rng.integers(0, 200, size=int(n)).astype(np.uint8) for n in rng.integers(1, longest, size=documents)]
    docs[0] = np.arange(3, dtype=np.uint8)  # at least one usable document
    return TokenExamples.from_documents(docs, seq_len=seq_len)


def _deviation(plan: MixturePlan, weights: np.ndarray, step: int) -> float:
    """max over sources of |C_s - p_s T| after `step` steps, in units of one example (the plan's bound)."""
    after = plan.state_after(step)
    live = np.asarray(after.active)
    taken = np.asarray(after.targets, dtype=np.float64)
    shares = np.where(live, weights, 0) / np.where(live, weights, 0).sum()
    return float(np.abs(taken - shares * taken[live].sum())[live].max() / plan.bound)


@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_every_source_is_within_one_example_of_its_share_after_every_step_on_every_layout():
    """The property: random weights, example sizes (pieces, packed rows), global batches, world sizes
    1/2/4/8, token budgets and packing; the layout then only splits the plan's global batch."""
    rng = np.random.default_rng(55)
    worst = 0.0
    for trial in range(40):
        sources = int(rng.integers(1, 6))
        weights = rng.random(sources) ** 3 + 1e-3
        seq_len = int(rng.integers(4, 24))
        world_size = int(rng.choice([1, 2, 4, 8]))
        global_size = world_size * int(rng.integers(1, 5))
        pack = bool(rng.integers(2))
        parts = [_source_examples(rng, int(rng.integers(2, 30)), int(rng.integers(3, 60)), seq_len)
                 for _ in range(sources)]
        if pack:
            parts = [PackedExamples.from_examples(part, seq_len) for part in parts]
        offsets = np.cumsum([0] + [len(part) for part in parts[:-1]])
        mix = [MixSource(f"s{k}", float(weights[k]), example_targets(part), int(offsets[k]))
               for k, part in enumerate(parts)]
        plan = MixturePlan(mix, global_size, seed=trial)
        examples = combine(parts)
        budget = None if rng.integers(2) else seq_len * int(rng.integers(1, 4))
        ranks = [TrainBatches(examples, global_size, 1, trial, rank, world_size, micro_tokens=budget, pack=pack,
                              seq_len=seq_len, plan=plan) for rank in range(world_size)]
        targets = np.concatenate([example_targets(part) for part in parts])
        for step in range(25):
            ids = np.concatenate([np.concatenate(batches.microbatch_ids(step)) for batches in ranks
                                  if batches.microbatch_ids(step)])
            assert sorted(ids.tolist()) == sorted(plan.global_batch(step).tolist())  # the layout splits, never picks
            per_source = np.bincount(np.searchsorted(offsets, ids, side="right") - 1, weights=targets[ids],
                                     minlength=sources)
            assert np.array_equal(per_source, plan.step(step).targets)
            deviation = _deviation(plan, weights, step + 1)
            assert deviation <= 1.0, (trial, step, deviation)
            worst = max(worst, deviation)
    assert worst > 0.5  # the test reaches the bound's neighbourhood, it does not pass trivially


def test_a_plain_largest_deficit_rule_would_drift_past_one_example():
    """Why the plan uses deadlines: the largest deficit alone leaves a source 1.5 examples short here."""
    rng = np.random.default_rng(1)
    worst = 0.0
    for _ in range(200):
        k = 5
        p = rng.random(k) ** 3 + 1e-3
        p /= p.sum()
        sizes = rng.integers(1, 8, size=(k, 400))
        taken, used = np.zeros(k), np.zeros(k, dtype=int)
        for _ in range(300):
            s = int(np.argmax(p * taken.sum() - taken))
            taken[s] += sizes[s, used[s]]
            used[s] += 1
            worst = max(worst, np.abs(taken - p * taken.sum()).max() / sizes.max())
    assert worst > 1.0


def test_a_mixture_of_one_source_is_the_plain_global_batch_plan():
    examples = TokenExamples.from_documents([np.arange(n, dtype=np.uint8) for n in range(2, 40)], seq_len=8)
    plan = MixturePlan([MixSource("only", 1.0, example_targets(examples))], 8, seed=3)
    plain = GlobalBatchPlan(len(examples), 8, seed=3)
    for step in range(30):  # several epochs
        assert np.array_equal(plan.global_batch(step), plain.global_batch(step))


def test_each_source_repeats_in_a_new_seeded_order_and_the_cursor_is_one_position_per_source():
    small = MixSource("small", 1.0, np.full(5, 3), 0)
    big = MixSource("big", 1.0, np.full(100, 3), 5)
    plan = MixturePlan([small, big], 4, seed=1)
    ids = np.concatenate([plan.global_batch(step) for step in range(10)])
    taken = ids[ids < 5]
    assert len(taken) == 20  # half the targets, every example of equal size: half the slots
    epochs = taken.reshape(4, 5)
    assert all(sorted(epoch.tolist()) == list(range(5)) for epoch in epochs)
    assert len({tuple(epoch) for epoch in epochs}) == 4  # a new order every pass
    state = plan.state_dict(10)
    assert state["sources"]["small"]["position"] == 20 and state["sources"]["big"]["position"] == 20
    again = MixturePlan([small, big], 4, seed=1)
    again.load_state_dict(state, 10)
    assert np.array_equal(again.global_batch(10), plan.global_batch(10))
    assert np.array_equal(again.global_batch(13), plan.global_batch(13))


def test_max_repeat_then_an_error_naming_the_source_or_renormalize():
    small = MixSource("small", 1.0, np.full(5, 2), 0, max_repeat=1)
    big = MixSource("big", 1.0, np.full(100, 2), 5)
    plan = MixturePlan([small, big], 4, seed=0)
    for step in range(4):  # two of `small` a step: 8 of its 10 (2 passes of 5, max_repeat=1)
        plan.global_batch(step)
    assert plan.state_after(4).positions[0] == 8
    with pytest.raises(SourceExhausted, match=r"step 5: data.sources.small is exhausted: its 5 examples were read "
                                              r"2 times \(max_repeat=1\) and on_exhausted=error"):
        plan.global_batch(4)  # its last two, then nothing: the step cannot be formed
    small.on_exhausted = "renormalize"
    plan = MixturePlan([small, big], 4, seed=0)
    assert plan.step(4).dropped == ["small"] and (plan.global_batch(4) < 5).sum() == 2
    assert (plan.global_batch(5) >= 5).all()
    figures = plan.figures(6, [0.0, 0.0])
    assert figures["mix/small/exhausted"] == 1 and figures["mix/small/epoch"] == 2.0
    assert figures["mix/small/targets"] == 0 and figures["mix/big/targets"] == 8


def test_a_weight_change_on_resume_continues_from_the_cursors():
    sources = [MixSource("a", 1.0, np.full(50, 1), 0), MixSource("b", 1.0, np.full(50, 1), 50)]
    plan = MixturePlan(sources, 10, seed=2)
    state = plan.state_dict(3)  # 15 examples of each
    changed = MixturePlan([MixSource("a", 3.0, np.full(50, 1), 0), MixSource("b", 1.0, np.full(50, 1), 50)], 10, 2)
    changed.load_state_dict(state, 3)
    ids = changed.global_batch(3)
    a_stream = EpochStream(50, [2, zlib.crc32(b"a")]).ids(15, 20)
    taken_a = ids[ids < 50]
    assert np.array_equal(taken_a, a_stream[: len(taken_a)])  # a's stream goes on where it stopped
    assert len(taken_a) == 10  # 15 + 10 = 25 of 40 first; the share climbs toward 3/4 from the cursors
    later = changed.state_after(20)
    assert abs(later.targets[0] / sum(later.targets) - 0.75) < 0.1


def test_the_bijection_is_a_permutation_of_every_size_and_seeded():
    for n in (1, 2, 3, 4, 5, 17, 64, 1000, 4097):
        ids = Bijection(n, [7, 0])(np.arange(n))
        assert sorted(ids.tolist()) == list(range(n)), n
    a, b = Bijection(1000, [7, 0])(np.arange(1000)), Bijection(1000, [7, 1])(np.arange(1000))
    assert not np.array_equal(a, b) and not np.array_equal(a, np.arange(1000))
    # Any positions, in any order, without the others: O(batch), whatever N.
    huge = Bijection(10**12, [1, 2])
    positions = np.array([0, 10**12 - 1, 123456789])
    ids = huge(positions)
    assert ((ids >= 0) & (ids < 10**12)).all() and len(set(ids.tolist())) == 3
    assert np.array_equal(huge(positions[::-1]), ids[::-1])


def test_the_order_of_runs_started_before_the_bijection_is_kept():
    plan = GlobalBatchPlan(40, 8, seed=5)
    plan.load_state_dict({"samples_seen": 16}, 2)  # a cursor without an order: the materialised permutation
    assert plan.order == "permutation"
    assert np.array_equal(plan.global_batch(2), np.random.default_rng([5, 0]).permutation(40)[16:24])
    assert np.array_equal(plan.global_batch(5), np.random.default_rng([5, 1]).permutation(40)[0:8])
    assert GlobalBatchPlan(40, 8, seed=5).state_dict(2)["order"] == "bijection"


def test_sources_laid_end_to_end_collate_as_each_alone_masks_included():
    """A text source (no mask) beside conversations (a target mask): the combined examples give every
    example the rows it gives in its own source, read from the sources' arrays in place."""
    text = TokenExamples.from_documents([np.arange(2, 30, dtype=np.uint8), np.arange(40, 45, dtype=np.uint8)], 8)
    tokens = np.arange(100, 120, dtype=np.uint16)
    mask = (np.arange(20) % 3 == 0).astype(np.uint8)
    chats = TokenExamples.whole(tokens, mask, np.array([[0, 9, int(mask[1:9].sum())], [9, 11, int(mask[10:20].sum())]]))
    mixed = combine([text, chats])
    assert mixed.is_conversations and len(mixed) == len(text) + 2
    assert example_targets(mixed).tolist() == [*example_targets(text).tolist(), *example_targets(chats).tolist()]
    for ids, part, local in (([0, 3], text, [0, 3]), ([len(text), len(text) + 1], chats, [0, 1])):
        inputs, targets = mixed.collate(np.array(ids))
        alone_inputs, alone_targets = part.collate(np.array(local))
        assert inputs.tolist() == alone_inputs.tolist() and targets.tolist() == alone_targets.tolist()


@pytest.mark.parametrize("pack", [False, True])
def test_each_position_is_labelled_with_its_source_in_rows_and_in_packed_conversation_rows(pack):
    rng = np.random.default_rng(3)
    text = _source_examples(rng, 12, 30, 8)
    tokens = rng.integers(0, 200, size=60).astype(np.uint16)
    mask = (rng.random(60) < 0.5).astype(np.uint8)
    spans = np.array([[start, 6, int(mask[start + 1 : start + 6].sum())] for start in range(0, 60, 6)])
    chats = TokenExamples.whole(tokens, mask, spans)
    parts = [text, chats]
    mixed = combine(parts)
    offsets = [0, len(text)]
    plan = MixturePlan([MixSource("text", 1.0, example_targets(text), 0),
                        MixSource("chats", 2.0, example_targets(chats), len(text))], 6, seed=4)
    for rank in range(2):
        batches = TrainBatches(mixed, 6, 2, 4, rank, 2, pack=pack, seq_len=8, plan=plan,
                               labels=SourceLabels(offsets, mixed.lengths))
        for step in range(4):
            counts = np.zeros(2, dtype=np.int64)
            for other in range(2):  # every rank's share of the step
                batches.rank = other
                for _, targets in batches.microbatches(step):
                    valid = targets.tokens != IGNORE_INDEX
                    assert (targets.sources[valid] >= 0).all()
                    counts += np.bincount(targets.sources[valid].numpy(), minlength=2)
                    assert targets.valid_positions.tolist() == valid.reshape(-1).nonzero().squeeze(1).tolist()
            assert counts.tolist() == plan.step(step).targets.tolist()
