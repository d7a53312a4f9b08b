"""The reference that the exact step is checked against: one process that saw every microbatch of
the step, taking one SGD(lr=1) step on the global mean over valid targets (so the update is minus
the gradient), and the ragged cases that make a wrong mean show.
"""

from __future__ import annotations

import torch

from ddptrain.contract.targets import IGNORE_INDEX
from ddptrain.engine.objective import token_loss_sum
from tests.helpers import microbatch, tiny_gpt

# rank -> microbatches, each (rows, valid target count per row, seed). Ranks hold different numbers
# of microbatches with very different valid-token counts; one microbatch has no valid target.
CASES = {
    "ragged_with_empty_microbatch": {
        0: [(2, [12, 3], 1), (1, [0], 2), (3, [5, 12, 1], 3)],
        1: [(2, [7, 2], 4), (2, [12, 12], 5)],
    },
    "rank_without_valid_targets": {
        0: [(2, [12, 4], 6), (2, [9, 1], 7)],
        1: [(2, [0, 0], 8), (1, [0], 9)],
    },
}


def case_microbatches(case: str, rank: int):
    return [microbatch(rows, lengths, seed) for rows, lengths, seed in CASES[case][rank]]


def all_microbatches(case: str):
    return [mb for rank in sorted(CASES[case]) for mb in case_microbatches(case, rank)]


def reference_step(microbatches, naive: bool = False, token_sum=token_loss_sum):
    """One process, one SGD(lr=1) step of tiny_gpt in fp64 on sum(token_sum) / N_t over `microbatches`
    (or, naive=True, on the mean of per-microbatch means: what averaging them does, empty microbatches
    dropped, else NaN). `token_sum(logits, targets)` is the summed objective of one microbatch.
    Returns (loss, N_t, weights before, weights after)."""
    model = tiny_gpt(torch.float64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sums = [token_sum(model(x), y) for x, y in microbatches]
    counts = [int((y != IGNORE_INDEX).sum()) for _, y in microbatches]
    if naive:
        loss = torch.stack([s / c for s, c in zip(sums, counts) if c > 0]).mean()
    else:
        loss = torch.stack(sums).sum() / sum(counts)
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    return float(loss.detach()), sum(counts), before, {k: v.detach().clone() for k, v in model.state_dict().items()}


def update(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}
