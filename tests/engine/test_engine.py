"""The exact step: 2 real gloo ranks against one process that saw everything."""

from __future__ import annotations

import math

import pytest
import torch

import ddptrain
from ddptrain.contract.targets import IGNORE_INDEX
from ddptrain.engine.objective import token_loss_sum
from ddptrain.testing import run_distributed
from tests.engine.reference import CASES, all_microbatches, case_microbatches, reference_step, update
from tests.helpers import microbatch, relative_difference, tiny_gpt


def _engine_step(case: str):
    model = tiny_gpt(torch.float64)
    engine = ddptrain.Engine(model, torch.optim.SGD(model.parameters(), lr=1.0), "ddp", precision="fp64")
    stats = engine.step(case_microbatches(case, ddptrain.get_rank()))
    return stats, engine.model_state_dict()


def _two_rank_scenarios() -> dict:
    """Every 2-rank scenario of this file in one process group (one spawn instead of one each)."""
    return {
        "step": {case: _engine_step(case) for case in CASES},
        "clipped": _step_with_grad_clip("ragged_with_empty_microbatch", 0.1),
        "collectives": _count_gloo_collectives((1, 4, 8)),
        "empty": _empty_global_step(),
    }


@pytest.fixture(scope="module")
def on_two_ranks() -> list[dict]:
    """The scenarios' results of rank 0 and rank 1."""
    return run_distributed(_two_rank_scenarios, 2)


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_ranks_equal_one_process_on_global_mean_token_loss(on_two_ranks, case):
    results = [rank["step"][case] for rank in on_two_ranks]
    ref_loss, ref_tokens, before, ref_params = reference_step(all_microbatches(case))
    for rank, (stats, params) in enumerate(results):
        assert stats.tokens == ref_tokens, f"rank {rank}: N_t {stats.tokens} != {ref_tokens}"
        assert math.isclose(stats.loss, ref_loss, rel_tol=1e-12), f"rank {rank}: loss {stats.loss} != {ref_loss}"
        assert relative_difference(params, ref_params) < 1e-9
        assert relative_difference(update(params, before), update(ref_params, before)) < 1e-9
        assert not stats.skipped
    assert results[0][0].loss == results[1][0].loss, "the reported loss must be the same number on every rank"
    # The data is ragged enough that the naive per-microbatch-mean update is measurably different.
    _, _, _, naive_params = reference_step(all_microbatches(case), naive=True)
    assert relative_difference(update(naive_params, before), update(ref_params, before)) > 0.05


def _step_with_grad_clip(case: str, max_norm: float):
    model = tiny_gpt(torch.float64)
    engine = ddptrain.Engine(model, torch.optim.SGD(model.parameters(), lr=1.0), "ddp", precision="fp64",
                             grad_clip=max_norm)
    stats = engine.step(case_microbatches(case, ddptrain.get_rank()))
    return stats, engine.model_state_dict()


def test_clipping_uses_the_global_norm_after_normalisation(on_two_ranks):
    case = "ragged_with_empty_microbatch"
    microbatches = all_microbatches(case)
    model = tiny_gpt(torch.float64)
    loss = torch.stack([token_loss_sum(model(x), y) for x, y in microbatches]).sum()
    loss = loss / sum(int((y != IGNORE_INDEX).sum()) for _, y in microbatches)
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1))
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    for stats, params in (rank["clipped"] for rank in on_two_ranks):
        assert math.isclose(stats.grad_norm, norm, rel_tol=1e-9)
        assert relative_difference(params, model.state_dict()) < 1e-9
    assert norm > 0.1, "the clip must bite for this test to mean anything"


def _count_gloo_collectives(microbatch_counts: tuple[int, ...]) -> dict[int, int]:
    """Gloo collectives of one step (after a warm-up step) for each number of microbatches; a fresh
    model and DDP wrapper each time, in one process group."""
    from torch.profiler import ProfilerActivity, profile

    counts = {}
    for num_microbatches in microbatch_counts:
        model = tiny_gpt(torch.float32)
        engine = ddptrain.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), "ddp")
        microbatches = [microbatch(2, [12, 5], seed) for seed in range(num_microbatches)]
        engine.step(microbatches)  # warm-up: DDP rebuilds its buckets after the first step
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.step(microbatches).loss  # reading the loss waits for its (asynchronous) all-reduce
        counts[num_microbatches] = sum(1 for event in prof.events() if event.name.startswith("gloo:"))
    return counts


def test_collectives_per_step_do_not_grow_with_microbatches(on_two_ranks):
    counts = on_two_ranks[0]["collectives"]
    assert counts[1] > 0, "the profiler saw no gloo collective: the count proves nothing"
    assert counts[1] == counts[4] == counts[8], counts


def _empty_global_step():
    model = tiny_gpt(torch.float64)
    engine = ddptrain.Engine(model, torch.optim.SGD(model.parameters(), lr=1.0), "ddp", precision="fp64")
    before = engine.model_state_dict()
    stats = engine.step([microbatch(2, [0, 0], 11 + ddptrain.get_rank())])
    after_empty = engine.model_state_dict()
    next_stats = engine.step([microbatch(2, [6, 12], 21 + ddptrain.get_rank())])
    return stats, before, after_empty, next_stats, engine.model_state_dict(), engine.skipped_steps


def test_global_step_without_valid_tokens_is_skipped_on_every_rank(on_two_ranks):
    for stats, before, after_empty, next_stats, after_next, skipped in (rank["empty"] for rank in on_two_ranks):
        assert stats.skipped and stats.reason == "no_valid_tokens" and stats.tokens == 0
        assert all(torch.equal(before[k], after_empty[k]) for k in before), "a skipped step changed weights"
        assert not next_stats.skipped and math.isfinite(next_stats.loss)
        assert all(torch.isfinite(v).all() for v in after_next.values()), "NaN reached the parameters"
        assert not all(torch.equal(before[k], after_next[k]) for k in before)
        assert skipped == 1


def test_world_of_one_without_torchrun():
    model = tiny_gpt(torch.float64)
    engine = ddptrain.Engine(model, torch.optim.SGD(model.parameters(), lr=1.0), precision="fp64")
    microbatches = all_microbatches("ragged_with_empty_microbatch")
    stats = engine.step(microbatches)
    ref_loss, ref_tokens, _, ref_params = reference_step(microbatches)
    assert not ddptrain.is_distributed()
    assert stats.tokens == ref_tokens and math.isclose(stats.loss, ref_loss, rel_tol=1e-12)
    assert relative_difference(engine.model_state_dict(), ref_params) < 1e-12


def test_nonfinite_gradient_is_skipped_or_stops():
    model = tiny_gpt(torch.float64)
    engine = ddptrain.Engine(model, torch.optim.SGD(model.parameters(), lr=1.0), precision="fp64")
    before = engine.model_state_dict()
    with torch.no_grad():
        model.tok_emb.weight[0, 0] = float("nan")
    stats = engine.step([microbatch(2, [12, 12], 3)])
    assert stats.skipped and stats.reason == "nonfinite" and engine.skipped_steps == 1
    assert torch.isnan(engine.model_state_dict()["tok_emb.weight"][0, 0])  # untouched, not updated
    assert torch.equal(engine.model_state_dict()["blocks.0.mlp.fc.weight"], before["blocks.0.mlp.fc.weight"])
    stopping = ddptrain.Engine(model, torch.optim.SGD(model.parameters(), lr=1.0), precision="fp64", nonfinite="stop")
    with pytest.raises(FloatingPointError, match="non-finite gradient norm"):
        stopping.step([microbatch(2, [12, 12], 3)])


@pytest.mark.parametrize("kwargs, message", [
    ({"strategy": "zero9"}, "strategy 'zero9' is not one of"),
    ({"precision": "fp8"}, "precision 'fp8' is not one of"),
    ({"grad_clip": -1.0}, "grad_clip -1.0 must be > 0"),
    ({"nonfinite": "ignore"}, "nonfinite policy 'ignore'"),
])
def test_engine_rejects_bad_options(kwargs, message):
    model = tiny_gpt(torch.float32)
    with pytest.raises(ValueError, match=message):
        ddptrain.Engine(model, torch.optim.SGD(model.parameters(), lr=1.0), **kwargs)


def test_a_step_without_microbatches_is_an_empty_step():
    model = tiny_gpt(torch.float32)
    engine = ddptrain.Engine(model, torch.optim.SGD(model.parameters(), lr=1.0))
    before = engine.model_state_dict()
    stats = engine.step([])
    assert stats.skipped and stats.reason == "no_valid_tokens" and stats.tokens == 0
    assert all(torch.equal(before[k], v) for k, v in engine.model_state_dict().items())
