"""Preference objectives: DPO's losses over the pairs of a step, as sums the Engine divides by P_t.

The step minimises the mean over the global batch's pairs: (sum over every pair of every microbatch
of every rank of its loss) / P_t, P_t the number of those pairs, all-reduced with the other counts
before the first backward. A pair's loss is a function of four per-sequence sums of target
log-probabilities (policy and reference, chosen and rejected), so a pair is never split: its two
sequences share a microbatch (ddptrain/contract/pairs.py) and the microbatch contributes the SUM of
its pairs' losses / P_t. A mean of microbatch means weighs a microbatch of one pair like one of ten.

Formulas are TRL DPOTrainer's (trl/trainer/dpo_trainer.py, `_compute_loss`), with
logratio = logp_policy - logp_reference per sequence and delta = logratio_chosen - logratio_rejected:

    sigmoid   -logsigmoid(beta x delta)                                    (DPO)
    ipo       (logratio_chosen / n_chosen - logratio_rejected / n_rejected - 1 / (2 beta))^2
              n: the sequence's valid targets (its completion tokens)      (IPO, length-normalised)
    rewards   beta x logratio of chosen and of rejected (detached), margin, accuracy (chosen > rejected)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F

from ddptrain.contract.pairs import PairTargets
from ddptrain.contract.targets import IGNORE_INDEX
from ddptrain.engine.chunked import chunk_rows, head_row_values

METRICS = ("reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy")
"""The sums `DPOObjective.pair_sums` returns after the loss, each a global mean over the step's pairs."""


def token_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(N,) log-probability of each target under (N, V) logits, in at least float32; targets all valid."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return -F.cross_entropy(logits, targets, reduction="none")


def sequence_logps(logits: torch.Tensor, pairs: PairTargets) -> torch.Tensor:
    """(S,) sum of the valid targets' log-probabilities of each sequence of the microbatch.

    logits: (B, T, V) aligned with pairs.tokens; positions of no sequence contribute nothing. Only
    the valid rows of the logits are gathered: the softmax runs over them alone."""
    flat_targets = pairs.tokens.reshape(-1)
    is_valid = flat_targets != IGNORE_INDEX
    logps = token_logps(logits.reshape(-1, logits.size(-1))[is_valid], flat_targets[is_valid])
    return sum_by_sequence(logps, pairs.sequences.reshape(-1)[is_valid], pairs.count)


def sum_by_sequence(values: torch.Tensor, sequences: torch.Tensor, count: int) -> torch.Tensor:
    """(count,) sums of `values` (N,) grouped by their sequence ids (N,), in float64."""
    values = values.double()
    return torch.zeros(count, dtype=values.dtype, device=values.device).index_add(0, sequences, values)


def target_counts(pairs: PairTargets) -> torch.Tensor:
    """(S,) valid targets of each sequence (ipo's normaliser), float64."""
    valid = pairs.sequences[pairs.tokens != IGNORE_INDEX]
    return sum_by_sequence(torch.ones_like(valid, dtype=torch.float64), valid, pairs.count)


def pair_losses(policy: torch.Tensor, reference: torch.Tensor, lengths: torch.Tensor, beta: float,
                loss_type: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(losses (P,), chosen rewards (P,), rejected rewards (P,)) of sequences laid out chosen, rejected per pair.

    policy, reference, lengths: (2P,) per-sequence log-prob sums and valid-target counts."""
    logratios = policy - reference
    chosen, rejected = logratios[0::2], logratios[1::2]
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * (chosen - rejected))
    elif loss_type == "ipo":
        delta = chosen / lengths[0::2].clamp_min(1) - rejected / lengths[1::2].clamp_min(1)
        losses = (delta - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"loss_type {loss_type!r} is not one of sigmoid, ipo")
    return losses, beta * chosen.detach(), beta * rejected.detach()


@dataclass(frozen=True)
class DPOObjective:
    """The DPO loss of each pair, summed over a microbatch's pairs; the Engine divides by the global P_t.

    The reference log-probs come with the targets (PairTargets.reference): precomputed, or computed
    just before the step by `ddptrain.train.reference`. The objective itself needs only the policy's
    logits."""

    beta: float = 0.1
    loss_type: str = "sigmoid"

    def __post_init__(self):
        if not (isinstance(self.beta, (int, float)) and 0 < self.beta < math.inf):
            raise ValueError(f"beta {self.beta!r} must be a finite number > 0")
        if self.loss_type not in ("sigmoid", "ipo"):
            raise ValueError(f"loss_type {self.loss_type!r} is not one of sigmoid, ipo")

    metric_names = METRICS

    def count(self, pairs: PairTargets) -> int:
        """What the step's mean divides by: the microbatch's pairs."""
        return pairs.pairs

    counts = 1

    def denominator(self, counts: torch.Tensor) -> torch.Tensor:
        """The divisor of the step's sums: P_t, the global pair count (1 when there is none)."""
        return counts[0].clamp_min(1)

    def pair_sums(self, policy: torch.Tensor, pairs: PairTargets) -> torch.Tensor:
        """(1 + len(METRICS),) float64: the sum of the pairs' losses (the only one with a gradient), then
        the sums of the rewards, margins and accuracies."""
        if pairs.reference is None:
            raise ValueError("the microbatch's reference log-probs are missing: compute them before the step "
                             "(ddptrain.train.reference) or precompute them (objective.precompute_reference=true)")
        losses, chosen, rejected = pair_losses(policy, pairs.reference.double(), target_counts(pairs), self.beta,
                                               self.loss_type)
        metrics = torch.stack([chosen.sum(), rejected.sum(), (chosen - rejected).sum(),
                               (chosen > rejected).double().sum()])
        return torch.cat([losses.sum().reshape(1), metrics])

    sums = 1 + len(METRICS)
    """How many sums a microbatch gives (the Engine all-reduces them with the loss's)."""

    def filler(self, pairs: PairTargets) -> PairTargets:
        return PairTargets.empty(pairs)

    def token_sum(self, logits: torch.Tensor, pairs: PairTargets) -> torch.Tensor:
        """pair_sums from the policy's (B, T, V) logits: the Engine's name for a microbatch's sums."""
        return self.pair_sums(sequence_logps(logits, pairs), pairs)

    def head_loss(self, pairs: PairTargets, chunk_tokens: int | None) -> "PairHeadLoss":
        """The head-loss callable (ddptrain/contract/outputs.py) giving pair_sums without the (B, T, V) logits."""
        return PairHeadLoss(pairs, self, chunk_tokens)


Head = Callable[[torch.Tensor], torch.Tensor]


def head_sequence_logps(hidden: torch.Tensor, head: Head, pairs: PairTargets,
                        chunk_tokens: int | None = None) -> torch.Tensor:
    """sequence_logps(head(hidden), pairs) from the last hidden states (B, T, D), without the (B, T, V)
    logits (head_target_logps)."""
    logps, valid = head_target_logps(hidden, head, pairs.tokens, chunk_tokens)
    return sum_by_sequence(logps, pairs.sequences.reshape(-1).index_select(0, valid), pairs.count)


def head_target_logps(hidden: torch.Tensor, head: Head, targets: torch.Tensor, chunk_tokens: int | None = None,
                      temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs (N_valid,) of the valid targets under head(hidden) / temperature, their flat positions).

    hidden: (B, T, D), the last hidden states; targets (B, T), -100 where ignored. The head runs on the
    valid targets only, chunk_tokens rows at a time (chunked.head_row_values: a frozen head's gradient
    taken in the forward, any other's chunk recomputed in backward): no (B, T, V) tensor."""
    flat_targets = targets.reshape(-1)
    valid = (flat_targets != IGNORE_INDEX).nonzero().squeeze(1)
    valid_hidden = hidden.reshape(-1, hidden.size(-1)).index_select(0, valid)  # (N_valid, D)
    valid_targets = flat_targets.index_select(0, valid)
    chunk_tokens = chunk_tokens or chunk_rows(getattr(head, "out_features", None))
    chunks = zip(valid_hidden.split(chunk_tokens), valid_targets.split(chunk_tokens))
    per_row = token_logps if temperature == 1.0 else partial(_tempered_logps, temperature=temperature)
    pieces = [head_row_values(h, head, t, per_row) for h, t in chunks]
    return (torch.cat(pieces) if pieces else valid_hidden.new_zeros(0)), valid


def _tempered_logps(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    return token_logps(logits / temperature, targets)


class PairHeadLoss:
    """head_loss(hidden, head) for pairs: the objective's pair sums (objective None: the sequences'
    log-probs, for the reference). A plain class: wrappers (DDP) pass it on as it is."""

    def __init__(self, pairs: PairTargets, objective: DPOObjective | None, chunk_tokens: int | None = None):
        self.pairs, self.objective, self.chunk_tokens = pairs, objective, chunk_tokens

    def __call__(self, hidden: torch.Tensor, head: Head) -> torch.Tensor:
        logps = head_sequence_logps(hidden, head, self.pairs, self.chunk_tokens)
        return logps if self.objective is None else self.objective.pair_sums(logps, self.pairs)
