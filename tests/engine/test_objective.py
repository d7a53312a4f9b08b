"""Label smoothing and z-loss: against a hand-written reference, and still the exact global mean."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import ddptrain
from ddptrain.contract.targets import IGNORE_INDEX
from ddptrain.engine.objective import Objective, token_loss_sum
from ddptrain.testing import run_distributed
from tests.engine.reference import reference_step as shared_reference_step, update
from tests.helpers import TINY_RUN, VOCAB, microbatch, read_metrics, relative_difference, run_cli, tiny_gpt

SMOOTHING, Z_LOSS = 0.1, 1e-3
OBJECTIVES = [(0.0, 0.0), (SMOOTHING, 0.0), (0.0, Z_LOSS), (SMOOTHING, Z_LOSS), (0.3, 0.05)]


def hand_token_sum(logits: torch.Tensor, targets: torch.Tensor, label_smoothing: float, z_loss: float,
                   terms: tuple[str, ...] = ("nll", "smooth", "z")) -> torch.Tensor:
    """The objective written out: log-softmax by hand, smoothing and z-loss term by term, in fp64.

    `terms` drops pieces, so that a test can show its tolerance would notice a missing one.
    """
    is_valid = targets.reshape(-1) != IGNORE_INDEX
    logits = logits.reshape(-1, logits.size(-1))[is_valid].double()  # (n, V), valid rows only
    targets = targets.reshape(-1)[is_valid]
    top = logits.max(dim=-1, keepdim=True).values
    lse = top + (logits - top).exp().sum(dim=-1, keepdim=True).log()  # (n, 1)
    log_probs = logits - lse
    nll = -log_probs[torch.arange(len(targets)), targets]
    uniform = -log_probs.mean(dim=-1)  # cross-entropy against the uniform distribution
    per_token = torch.zeros_like(nll)
    if "nll" in terms:
        per_token = per_token + (1 - label_smoothing) * nll
    if "smooth" in terms:
        per_token = per_token + label_smoothing * uniform
    if "z" in terms:
        per_token = per_token + z_loss * lse.squeeze(-1) ** 2
    return per_token.sum()


def _logits_and_targets(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(3, 7, VOCAB, generator=gen, dtype=torch.float64) + 2).requires_grad_()  # (B, T, V)
    targets = torch.randint(0, VOCAB, (3, 7), generator=gen)
    targets[0, 4:] = IGNORE_INDEX
    targets[2, :] = IGNORE_INDEX
    targets[1, 0] = IGNORE_INDEX
    return logits, targets


# -- one process: the formula ------------------------------------------------------------------


@pytest.mark.parametrize("label_smoothing, z_loss", OBJECTIVES)
def test_token_sum_matches_the_hand_written_objective(label_smoothing, z_loss):
    logits, targets = _logits_and_targets()
    objective = Objective(label_smoothing=label_smoothing, z_loss=z_loss)
    mine = objective.token_sum(logits, targets)
    (mine_grad,) = torch.autograd.grad(mine, logits)
    ref = hand_token_sum(logits, targets, label_smoothing, z_loss)
    (ref_grad,) = torch.autograd.grad(ref, logits)
    assert mine.dtype == torch.float64
    mine, ref = float(mine.detach()), float(ref.detach())
    assert math.isclose(mine, ref, rel_tol=1e-12), (mine, ref)
    assert float((mine_grad - ref_grad).abs().max()) < 1e-12 * float(ref_grad.abs().max())
    assert torch.equal(mine_grad[targets == IGNORE_INDEX], torch.zeros_like(mine_grad[targets == IGNORE_INDEX]))
    # The tolerance notices each term: dropping any that is switched on moves the sum far more.
    for dropped, weight in (("smooth", label_smoothing), ("z", z_loss)):
        if weight:
            kept = tuple(t for t in ("nll", "smooth", "z") if t != dropped)
            partial = float(hand_token_sum(logits, targets, label_smoothing, z_loss, terms=kept).detach())
            assert not math.isclose(mine, partial, rel_tol=1e-6), dropped
    if z_loss == 0:  # the hand smoothing formula is torch's definition
        torch_sum = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                                    reduction="sum", label_smoothing=label_smoothing)
        assert math.isclose(float(torch_sum.detach()), ref, rel_tol=1e-12)


@pytest.mark.parametrize("label_smoothing, z_loss", OBJECTIVES)
def test_all_ignored_microbatch_sums_to_zero_not_nan(label_smoothing, z_loss):
    logits, targets = _logits_and_targets()
    total = Objective(label_smoothing, z_loss).token_sum(logits, torch.full_like(targets, IGNORE_INDEX))
    total.backward()
    assert float(total.detach()) == 0.0
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_plain_objective_is_token_loss_sum():
    logits, targets = _logits_and_targets()
    assert torch.equal(Objective().token_sum(logits, targets), token_loss_sum(logits, targets))


@pytest.mark.parametrize("label_smoothing, z_loss", [(SMOOTHING, 0.0), (SMOOTHING, Z_LOSS)])
def test_half_precision_logits_are_summed_in_float32(label_smoothing, z_loss):
    logits, targets = _logits_and_targets()
    low = logits.detach().bfloat16()
    total = Objective(label_smoothing, z_loss).token_sum(low, targets)
    assert total.dtype == torch.float32
    assert math.isclose(float(total), float(hand_token_sum(low, targets, label_smoothing, z_loss)), rel_tol=1e-5)


@pytest.mark.parametrize("kwargs, message", [
    ({"label_smoothing": 1.0}, r"label_smoothing 1.0 must be a number in \[0, 1\)"),
    ({"label_smoothing": -0.1}, r"label_smoothing -0.1 must be a number in \[0, 1\)"),
    ({"label_smoothing": float("nan")}, r"label_smoothing nan must be a number in \[0, 1\)"),
    ({"label_smoothing": "0.1"}, r"label_smoothing '0.1' must be a number in \[0, 1\)"),
    ({"z_loss": -1e-3}, "z_loss -0.001 must be a finite number >= 0"),
    ({"z_loss": float("inf")}, "z_loss inf must be a finite number >= 0"),
    ({"z_loss": None}, "z_loss None must be a finite number >= 0"),
])
def test_objective_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Objective(**kwargs)


# -- the Engine: still the exact global mean ---------------------------------------------------

# rank -> microbatches (rows, valid target count per row, seed): ragged, one without valid targets.
RANK_MICROBATCHES = {
    0: [(2, [12, 3], 31), (1, [0], 32), (3, [5, 12, 1], 33)],
    1: [(2, [7, 2], 34), (2, [12, 12], 35)],
}


def rank_microbatches(rank: int):
    return [microbatch(rows, lengths, seed) for rows, lengths, seed in RANK_MICROBATCHES[rank]]


def all_microbatches():
    return [mb for rank in sorted(RANK_MICROBATCHES) for mb in rank_microbatches(rank)]


def _engine_step(label_smoothing: float, z_loss: float, rank: int | None = None):
    model = tiny_gpt(torch.float64)
    engine = ddptrain.Engine(model, torch.optim.SGD(model.parameters(), lr=1.0), "ddp", precision="fp64",
                             objective=Objective(label_smoothing=label_smoothing, z_loss=z_loss))
    microbatches = all_microbatches() if rank is None else rank_microbatches(rank)
    stats = engine.step(microbatches)
    return stats, engine.model_state_dict()


def _engine_step_on_this_rank(label_smoothing: float, z_loss: float):
    return _engine_step(label_smoothing, z_loss, ddptrain.get_rank())


def reference_step(label_smoothing: float, z_loss: float, naive: bool = False):
    """One process that saw every microbatch: SGD(lr=1) on sum(objective) / N_t, the objective by hand
    (naive=True: the mean of per-microbatch means instead)."""
    return shared_reference_step(all_microbatches(), naive,
                                 lambda logits, targets: hand_token_sum(logits, targets, label_smoothing, z_loss))


def test_engine_in_one_process_minimises_the_objective_mean():
    stats, params = _engine_step(SMOOTHING, Z_LOSS)
    ref_loss, ref_tokens, before, ref_params = reference_step(SMOOTHING, Z_LOSS)
    assert stats.tokens == ref_tokens and math.isclose(stats.loss, ref_loss, rel_tol=1e-12)
    assert relative_difference(update(params, before), update(ref_params, before)) < 1e-9


@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_two_ranks_equal_one_process_with_label_smoothing_and_z_loss():
    results = run_distributed(_engine_step_on_this_rank, 2, SMOOTHING, Z_LOSS)
    ref_loss, ref_tokens, before, ref_params = reference_step(SMOOTHING, Z_LOSS)
    ref_update = update(ref_params, before)
    for rank, (stats, params) in enumerate(results):
        assert stats.tokens == ref_tokens, f"rank {rank}: N_t {stats.tokens} != {ref_tokens}"
        assert math.isclose(stats.loss, ref_loss, rel_tol=1e-12), f"rank {rank}: loss {stats.loss} != {ref_loss}"
        assert relative_difference(params, ref_params) < 1e-9
        assert relative_difference(update(params, before), ref_update) < 1e-9
        assert not stats.skipped
    assert results[0][0].loss == results[1][0].loss, "the reported loss must be the same number on every rank"
    # The 1e-9 bound means something: the mean of per-microbatch means, or the objective without
    # either term, moves the update by far more.
    for name, (label_smoothing, z_loss, naive), bound in [
        ("per-microbatch means", (SMOOTHING, Z_LOSS, True), 0.1),
        ("no z-loss", (SMOOTHING, 0.0, False), 1e-3),
        ("no label smoothing", (0.0, Z_LOSS, False), 1e-2),
    ]:
        _, _, _, other_params = reference_step(label_smoothing, z_loss, naive)
        assert relative_difference(update(other_params, before), ref_update) > bound, name


# -- the command line: the same loss curve on every layout ---------------------------------------


@pytest.mark.slow
def test_objective_options_keep_the_loss_curve_across_layouts(tmp_path):
    base = [*TINY_RUN, "batch.global_size=8", "batch.seq_len=256", "trainer.max_steps=20",
            "trainer.precision=fp64"]
    options = [f"objective.label_smoothing={SMOOTHING}", f"objective.z_loss={Z_LOSS}"]
    curves = {}
    for name, ranks, extra in [("1x8", 1, ["batch.micro_size=8", *options]),
                               ("2x2", 2, ["batch.micro_size=2", *options]),
                               ("plain", 1, ["batch.micro_size=8", "trainer.max_steps=1"])]:
        run_dir = tmp_path / name
        result = run_cli([*base, *extra, f"run.dir={run_dir}"], nproc=ranks)
        assert result.returncode == 0, result.stderr[-3000:]
        curves[name] = read_metrics(run_dir)
    reference = curves["1x8"]
    assert [m["step"] for m in reference] == list(range(1, 21))
    assert any(m["tokens"] < 8 * 256 for m in reference), "no ragged step: the test would not show the objective"
    assert [m["tokens"] for m in curves["2x2"]] == [m["tokens"] for m in reference]
    for mine, ref in zip(curves["2x2"], reference):
        assert math.isclose(mine["loss"], ref["loss"], rel_tol=1e-9), (mine["step"], mine["loss"], ref["loss"])
    # The options reach the loss: the first step (same weights, same batch) reports another number.
    plain = curves["plain"][0]
    assert plain["tokens"] == reference[0]["tokens"]
    assert not math.isclose(plain["loss"], reference[0]["loss"], rel_tol=1e-4), (plain["loss"], reference[0]["loss"])
