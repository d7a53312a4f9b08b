"""GRPO's objective: bad settings refused, the chunked head's same sums, and one rank's update equal
to the exact fp64 GRPO (tests/engine/grpo_reference.py) for every loss aggregation, to 1e-9. The
layouts on two ranks, fsdp and zero2 are in tests/rl/test_update.py; TRL's GRPOTrainer in
tests/rl/test_against_trl.py."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from ddptrain.contract.targets import IGNORE_INDEX
from ddptrain.engine.engine import Engine
from ddptrain.engine.grpo import LOSS_AGGREGATIONS, CompletionHeadLoss, CompletionTargets, GRPOObjective, GRPOSettings
from ddptrain.rl.batches import RolloutLayout, split_parts
from ddptrain.rl.update import train_on_rollouts
from ddptrain.train.reference import Reference
from tests.engine.grpo_reference import (LR, VARIANTS, exact_update, grpo_material, relative_update_difference,
                                        tiny_llama)


@pytest.mark.parametrize("change, message", [
    (dict(loss_aggregation="mean"), "loss_aggregation 'mean' is not one of token_mean, sequence_mean, constant, "
                                    "token_sum"),
    (dict(epsilon=0), "epsilon 0 must be a finite number > 0"),
    (dict(epsilon=-0.1), "epsilon -0.1 must be a finite number > 0"),
    (dict(epsilon_high=0.1), r"epsilon_high 0.1 must be a finite number >= epsilon \(0.2\)"),
    (dict(beta=-0.01), "beta -0.01 must be a finite number >= 0"),
    (dict(beta=math.nan), "beta nan must be a finite number >= 0"),
    (dict(updates_per_rollout=0), "updates_per_rollout 0 must be an int >= 1"),
    (dict(updates_per_rollout=1.5), "updates_per_rollout 1.5 must be an int >= 1"),
    (dict(max_new_tokens=0), "max_new_tokens 0 must be an int >= 1"),
    (dict(temperature=0), "temperature 0 must be a finite number > 0"),
])
def test_bad_settings_are_refused_naming_the_value(change, message):
    with pytest.raises(ValueError, match=message):
        GRPOSettings(**change)
    assert GRPOSettings(epsilon_high=0.28).clip_high == 0.28 and GRPOSettings().clip_high == 0.2


def _completions(seed: int = 0) -> tuple[torch.Tensor, torch.nn.Linear, CompletionTargets]:
    """Hidden states of 3 rows, a head, and 4 completions (one row holds two) with old and reference log-probs."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, 8, 6, generator=generator, dtype=torch.float64, requires_grad=True)
    head = torch.nn.Linear(6, 11, bias=False).double()
    tokens = torch.randint(0, 11, (3, 8), generator=generator)
    sequences = torch.full((3, 8), -1)
    for row, (start, end, completion) in enumerate([(2, 7, 0), (1, 4, 1), (5, 8, 3)]):
        sequences[row, start:end] = completion
    sequences[1, 5:8] = 2
    tokens[sequences < 0] = IGNORE_INDEX
    lengths = torch.bincount(sequences[sequences >= 0], minlength=4).double()
    counted = int(lengths.sum())
    targets = CompletionTargets(tokens, sequences, torch.tensor([1.0, -0.5, 2.0, -1.5], dtype=torch.float64), lengths,
                                old=torch.randn(counted, generator=generator, dtype=torch.float64) * 0.3 - 2.5,
                                reference=torch.randn(counted, generator=generator, dtype=torch.float64) * 0.3 - 2.5)
    return hidden, head, targets


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
def test_the_chunked_head_gives_the_full_logits_sums_and_gradients(aggregation):
    hidden, head, targets = _completions()
    objective = GRPOObjective(GRPOSettings(aggregation, beta=0.1, temperature=0.7, epsilon_high=0.28))
    full = objective.token_sum(head(hidden), targets)
    full[0].backward()
    expected = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None
    chunked = CompletionHeadLoss(targets, 0.7, objective, chunk_tokens=4)(hidden, head)
    chunked[0].backward()
    assert torch.allclose(chunked, full, rtol=1e-12)
    assert torch.allclose(hidden.grad, expected[0], rtol=1e-10) and torch.allclose(head.weight.grad, expected[1])
    assert full[2] > 0, "some tokens are clipped (old log-probs far from the current ones)"


def test_the_counts_and_denominators_of_each_aggregation():
    _, _, targets = _completions()
    targets.lengths[2] = 0  # a masked completion: counted nowhere but in `constant`'s completions
    counts = GRPOObjective(GRPOSettings()).count(targets)
    assert counts.tolist() == [int((targets.tokens != IGNORE_INDEX).sum()), 3, 4]
    denominators = {aggregation: int(GRPOObjective(GRPOSettings(aggregation, max_new_tokens=9)).denominator(counts))
                    for aggregation in LOSS_AGGREGATIONS}
    assert denominators == {"token_mean": counts[0], "sequence_mean": 3, "constant": 36, "token_sum": 1}


@pytest.mark.slow
@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
def test_one_rank_gives_the_exact_grpo_update(tmp_path, aggregation):
    """1 rank x 8 prompts per microbatch, and 1 prompt per microbatch: loss, KL, clip ratio and the
    weights after each update equal the exact GRPO's (one plain forward per completion) to 1e-9."""
    material = grpo_material(tmp_path)
    for variant, extra in VARIANTS.items():
        settings = GRPOSettings(aggregation, max_new_tokens=material.max_new_tokens, **extra)
        reference_model = tiny_llama(material.vocab_size, seed=1)
        parts = split_parts(material.rollouts, material.prompts, settings.updates_per_rollout)
        exact, exact_weights = exact_update(tiny_llama(material.vocab_size), material.rollouts, settings, parts,
                                            reference_model, LR[aggregation])
        for micro_size in (8, 1):
            model = tiny_llama(material.vocab_size)
            engine = Engine(model, torch.optim.SGD(model.parameters(), lr=LR[aggregation]), "ddp", precision="fp64",
                            device=torch.device("cpu"))
            reference = Reference(engine, model, copy.deepcopy(reference_model)) if settings.beta else None
            stats = train_on_rollouts(engine, material.rollouts, settings,
                                      RolloutLayout(material.prompts, micro_size=micro_size), reference)
            assert len(stats) == settings.updates_per_rollout
            for got, want in zip(stats, exact):
                assert math.isclose(got.loss, want["loss"], rel_tol=1e-9, abs_tol=1e-12), (variant, got.loss, want)
                for key in ("kl", "clip_ratio"):
                    assert math.isclose(got.metrics[key], want[key], rel_tol=1e-9, abs_tol=1e-12), (variant, key)
            assert relative_update_difference(engine.model_state_dict(), exact_weights, material.initial) <= 1e-9, \
                variant
        if settings.updates_per_rollout > 1:
            assert exact[1]["kl"] > 0 and exact[1]["clip_ratio"] > 0, "the second update is off-policy and clips"
