"""GRPO-family objectives: the clipped surrogate over completion tokens, as sums the Engine divides by
the loss aggregation's global denominator.

For a counted completion token t of completion i, with logp the policy's log-probability of it at
the sampling temperature (log_softmax(logits / T)), old the rollout-time log-prob, ref the
reference's, A_i the completion's advantage:

    ratio  = exp(logp - old)
    loss_t = -min(ratio x A_i, clip(ratio, 1 - epsilon, 1 + epsilon_high) x A_i) + beta x kl_t
    kl_t   = exp(ref - logp) - (ref - logp) - 1          (k3, Schulman 2020; >= 0, unbiased)

The step minimises (sum over every counted token of every microbatch of every rank of w_i x
loss_t) / D, where the loss aggregation sets the weight w_i and the global denominator D:

    token_mean     w_i = 1          D = counted tokens of the step            (DAPO)
    sequence_mean  w_i = 1 / n_i    D = completions with a counted token      (GRPO, DeepSeekMath)
    constant       w_i = 1          D = completions x max_new_tokens          (Dr. GRPO)
    token_sum      w_i = 1          D = 1

n_i is completion i's counted tokens. D comes from the counts all-reduced before the first
backward, like N_t (Engine._count_tokens): no microbatch or rank ever divides by a local count.
Counted tokens are the completion's own (prompt tokens never); a truncated completion counts unless
mask_truncated. KL and the clip ratio are reported over the same w_i and D as the loss.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace

import torch

from ddptrain.contract.targets import IGNORE_INDEX
from ddptrain.engine.preference import Head, head_target_logps, token_logps

LOSS_AGGREGATIONS = ("token_mean", "sequence_mean", "constant", "token_sum")
"""rl.loss_aggregation's choices (the weight and the global denominator of each: the module docstring)."""
METRICS = ("kl", "clip_ratio")
"""The sums GRPOObjective reports after the loss, each divided by the loss's denominator."""


@dataclass(frozen=True)
class GRPOSettings:
    """What one GRPO update needs besides the rollouts and the layout (TrainConfig's rl.* mapped onto it)."""

    loss_aggregation: str = "token_mean"
    """token_mean (DAPO) | sequence_mean (GRPO) | constant (Dr. GRPO) | token_sum."""
    epsilon: float = 0.2
    """The ratio's lower clip: 1 - epsilon; > 0."""
    epsilon_high: float | None = None
    """The ratio's upper clip: 1 + epsilon_high (DAPO's clip-higher); None: epsilon; >= epsilon."""
    beta: float = 0.0
    """Weight of the k3 KL to the reference, >= 0 (0: no reference is needed)."""
    mask_truncated: bool = False
    """Leave out the tokens of completions that hit max_new_tokens without an end (DAPO's overlong filter)."""
    updates_per_rollout: int = 1
    """Optimizer steps per batch of rollouts, each over its own part of them; >= 1."""
    max_new_tokens: int = 256
    """The generation limit; the constant aggregation's per-completion normaliser; >= 1."""
    temperature: float = 1.0
    """The sampling temperature: log-probs are taken from logits / temperature, as TRL does; > 0."""

    def __post_init__(self):
        check_settings(self)

    @property
    def clip_high(self) -> float:
        """epsilon_high, or epsilon where it is not set."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def check_settings(settings: GRPOSettings) -> None:
    """A ValueError naming the first setting that breaks its rule (config/validation.py shares them)."""
    if settings.loss_aggregation not in LOSS_AGGREGATIONS:
        raise ValueError(f"loss_aggregation {settings.loss_aggregation!r} is not one of {', '.join(LOSS_AGGREGATIONS)}")
    _check("epsilon", settings.epsilon, "a finite number > 0", lambda x: 0 < x < math.inf)
    if settings.epsilon_high is not None:
        _check("epsilon_high", settings.epsilon_high, f"a finite number >= epsilon ({settings.epsilon!r})",
               lambda x: settings.epsilon <= x < math.inf)
    _check("beta", settings.beta, "a finite number >= 0", lambda x: 0 <= x < math.inf)
    _check("temperature", settings.temperature, "a finite number > 0", lambda x: 0 < x < math.inf)
    for name in ("updates_per_rollout", "max_new_tokens"):
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name} {value!r} must be an int >= 1")


def _check(name: str, value, rule: str, holds) -> None:
    number = float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else None
    if number is None or not holds(number):  # NaN fails every comparison
        raise ValueError(f"{name} {value!r} must be {rule}")


@dataclass
class CompletionTargets:
    """What a GRPO microbatch gives its objective beside the inputs.

    tokens (B, T): next-token targets, the counted completion tokens only (-100 on prompts, padding
    and masked completions); sequences (B, T): the microbatch's completion of each counted position
    (-1 elsewhere); advantages (S,) and counted lengths (S,) of its S completions, float64; old and
    reference (N,): the rollout-time and reference log-probs of its N counted tokens in flat order
    (row-major over (B, T)), float64, once known (None: not computed)."""

    tokens: torch.Tensor
    sequences: torch.Tensor
    advantages: torch.Tensor
    lengths: torch.Tensor
    old: torch.Tensor | None = None
    reference: torch.Tensor | None = None

    @property
    def count(self) -> int:
        """Completions in the microbatch (masked ones included)."""
        return len(self.advantages)

    def to(self, device, non_blocking: bool = False) -> "CompletionTargets":
        move = lambda tensor: None if tensor is None else tensor.to(device, non_blocking=non_blocking)  # noqa: E731
        return CompletionTargets(*(move(getattr(self, name)) for name in
                                   ("tokens", "sequences", "advantages", "lengths", "old", "reference")))

    def with_logps(self, old: torch.Tensor | None = None, reference: torch.Tensor | None = None):
        return replace(self, old=self.old if old is None else old,
                       reference=self.reference if reference is None else reference)

    @classmethod
    def empty(cls, like: "CompletionTargets") -> "CompletionTargets":
        """A filler's targets: one ignored position, no completion."""
        none = like.advantages[:0]
        return cls(torch.full_like(like.tokens[:1, :1], IGNORE_INDEX), torch.full_like(like.sequences[:1, :1], -1),
                   none, like.lengths[:0], None if like.old is None else none,
                   None if like.reference is None else none)


def target_logps(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """(N,) log-probs of the valid targets (flat order) under (B, T, V) logits / temperature."""
    flat_targets = targets.reshape(-1)
    valid = flat_targets != IGNORE_INDEX
    logits = logits.reshape(-1, logits.size(-1))[valid]
    return token_logps(logits if temperature == 1.0 else logits / temperature, flat_targets[valid])


@dataclass(frozen=True)
class GRPOObjective:
    """The GRPO surrogate of a microbatch's counted tokens, weighted per the loss aggregation and summed:
    (loss, kl, clipped) sums that the Engine divides by `denominator` of the global counts."""

    settings: GRPOSettings

    sums = 1 + len(METRICS)
    metric_names = METRICS
    counts = 3
    """tokens counted, completions with a counted token, completions: all-reduced before the first backward."""

    def count(self, targets: CompletionTargets) -> torch.Tensor:
        tokens = (targets.tokens != IGNORE_INDEX).sum()
        counted = (targets.lengths > 0).sum()
        return torch.stack([tokens, counted, counted.new_tensor(targets.count)])

    def denominator(self, counts: torch.Tensor) -> torch.Tensor:
        """D of the loss aggregation from the global counts (module docstring); at least 1."""
        aggregation = self.settings.loss_aggregation
        if aggregation == "token_mean":
            return counts[0].clamp_min(1)
        if aggregation == "sequence_mean":
            return counts[1].clamp_min(1)
        if aggregation == "constant":
            return (counts[2] * self.settings.max_new_tokens).clamp_min(1)
        return torch.ones_like(counts[0])

    def filler(self, targets: CompletionTargets | torch.Tensor) -> CompletionTargets:
        """A filler's targets: no completion (`targets` is the engine's token template on a rank that has
        held no microbatch yet)."""
        if isinstance(targets, torch.Tensor):
            none = torch.zeros(0, dtype=torch.float64, device=targets.device)
            return CompletionTargets(torch.full_like(targets[:1, :1], IGNORE_INDEX), torch.full_like(targets[:1, :1], -1),
                                     none, none)
        return CompletionTargets.empty(targets)

    def token_sum(self, logits: torch.Tensor, targets: CompletionTargets) -> torch.Tensor:
        """The microbatch's sums from its (B, T, V) logits: the Engine's name for them."""
        return self.completion_sums(target_logps(logits, targets.tokens, self.settings.temperature), targets)

    def head_loss(self, targets: CompletionTargets, chunk_tokens: int | None) -> "CompletionHeadLoss":
        """The head-loss callable (ddptrain/contract/outputs.py): the sums without the (B, T, V) logits."""
        return CompletionHeadLoss(targets, self.settings.temperature, self, chunk_tokens)

    def completion_sums(self, logps: torch.Tensor, targets: CompletionTargets) -> torch.Tensor:
        """(3,) float64: sum of w_i x loss_t (the only one with a gradient), of w_i x kl_t, of w_i x
        [token clipped], over the microbatch's counted tokens; logps (N,) in flat order."""
        settings = self.settings
        logps = logps.double()
        sequences = targets.sequences.reshape(-1)[targets.tokens.reshape(-1) != IGNORE_INDEX]
        advantages = targets.advantages.double()[sequences]
        # updates_per_rollout == 1: the policy is the rollouts' own, so the ratio is 1 with the
        # gradient of logp (TRL's old = logp.detach()).
        old = logps.detach() if targets.old is None else targets.old.double()
        ratio = torch.exp(logps - old)
        clipped_ratio = ratio.clamp(1 - settings.epsilon, 1 + settings.clip_high)
        losses = -torch.minimum(ratio * advantages, clipped_ratio * advantages)
        clipped = ((ratio < 1 - settings.epsilon) & (advantages < 0)) | ((ratio > 1 + settings.clip_high) &
                                                                          (advantages > 0))
        kl = torch.zeros_like(losses)
        if settings.beta > 0:
            if targets.reference is None and len(logps):  # a filler has no token and needs none
                raise ValueError("beta > 0 needs the reference log-probs of the microbatch: give train_on_rollouts "
                                 "a reference")
            delta = (logps.detach() if targets.reference is None else targets.reference.double()) - logps
            kl = torch.exp(delta) - delta - 1
            losses = losses + settings.beta * kl
        weights = (1 / targets.lengths.double().clamp_min(1))[sequences] if \
            settings.loss_aggregation == "sequence_mean" else torch.ones_like(losses)
        return torch.stack([(weights * losses).sum(), (weights * kl).sum().detach(),
                            (weights * clipped.double()).sum()])


class CompletionHeadLoss:
    """head_loss(hidden, head) for completions: the objective's sums (objective None: the counted
    tokens' log-probs (N,), for old and reference log-probs). A plain class: wrappers (DDP) pass it on
    as it is."""

    def __init__(self, targets: CompletionTargets, temperature: float, objective: GRPOObjective | None = None,
                 chunk_tokens: int | None = None):
        self.targets, self.temperature = targets, temperature
        self.objective, self.chunk_tokens = objective, chunk_tokens

    def __call__(self, hidden: torch.Tensor, head: Head) -> torch.Tensor:
        logps, _ = head_target_logps(hidden, head, self.targets.tokens, self.chunk_tokens, self.temperature)
        return logps if self.objective is None else self.objective.completion_sums(logps, self.targets)
