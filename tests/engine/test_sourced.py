"""A mixture's objective: the total is the plain objective's sum, and each source's sum is the plain sum
over that source's positions alone, on the full logits and through the chunked head."""

from __future__ import annotations

import pytest
import torch

from ddptrain.contract.sourced import SourcedTargets
from ddptrain.contract.targets import IGNORE_INDEX
from ddptrain.engine.chunked import valid_positions_of
from ddptrain.engine.objective import Objective
from ddptrain.engine.sourced import SourcedObjective


def _batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, 7, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    head = torch.nn.Linear(8, 11, dtype=torch.float64)
    tokens = torch.randint(0, 11, (3, 7), generator=gen)
    tokens[0, 5:] = IGNORE_INDEX
    tokens[2, :2] = IGNORE_INDEX
    sources = torch.tensor([[0] * 7, [2] * 4 + [1] * 3, [1] * 7])  # a packed row holds two sources
    return hidden, head, SourcedTargets(tokens, sources, 3, valid_positions_of(tokens))


@pytest.mark.parametrize("objective", [Objective(), Objective(label_smoothing=0.1, z_loss=1e-3)])
@pytest.mark.parametrize("chunked", [False, True])
def test_each_sources_sum_is_the_plain_sum_over_its_positions_and_the_total_trains(objective, chunked):
    hidden, head, targets = _batch()
    sourced = SourcedObjective(objective, 3)
    if chunked:
        sums = sourced.head_loss(targets, chunk_tokens=4)(hidden, head)
    else:
        sums = sourced.token_sum(head(hidden), targets)
    assert sums.shape == (4,)
    plain = objective.token_sum(head(hidden), targets.tokens)
    torch.testing.assert_close(sums[0], plain, rtol=1e-12, atol=0)
    for source in range(3):
        alone = targets.tokens.masked_fill(targets.sources != source, IGNORE_INDEX)
        torch.testing.assert_close(sums[1 + source], objective.token_sum(head(hidden), alone), rtol=1e-12, atol=1e-15)
    sums[0].backward()
    reference = hidden.grad.clone()
    hidden.grad = None
    plain.backward()
    torch.testing.assert_close(hidden.grad, reference, rtol=1e-12, atol=0)  # only the total trains


def test_a_filler_has_no_valid_target_and_no_source():
    sourced = SourcedObjective(Objective(), 2)
    filler = sourced.filler(torch.zeros(1, 1, dtype=torch.long))
    assert sourced.count(filler) == 0 and filler.sources.tolist() == [[-1]] and filler.count == 2
