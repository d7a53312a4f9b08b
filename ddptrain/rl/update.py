"""The GRPO update of one batch of rollouts: log-probs before any update, then exact optimizer steps.

    train_on_rollouts(engine, rollouts, settings, layout, reference=None) -> [StepStats, ...]

1. The rollouts (this rank's share of the step's prompts, whole groups) are split into
   settings.updates_per_rollout parts by prompt: part k holds prompts i with i x U // P == k
   (rl/batches.py's split_parts; P = layout.prompts), the same completions on any world size.
2. Before the first update, every part's microbatches get, without gradients:
   - the rollout-time log-probs (`old`) of their counted tokens under the current policy when
     U > 1; with U = 1 the objective uses the detached current log-probs (ratio 1, the gradient of
     the policy-gradient term), as TRL does;
   - the reference's log-probs when beta > 0: a ddptrain.train.reference.Reference (the policy
     with its LoRA adapter disabled, or a frozen copy of the initial weights), which this module
     reads by its attributes (`model`, `disables_adapter`) so that rl/ imports nothing of train/.
3. One Engine step per part with the GRPO objective (ddptrain/engine/grpo.py): its denominator
   from the part's global counts, all-reduced before the first backward.

The log-probs are the engine's: its precision and autocast, its chunked head where the model has
one (the head on the counted tokens only), at settings.temperature.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from ddptrain.contract.outputs import HEAD_LOSS, logits_of, takes_head_loss
from ddptrain.distributed import is_distributed
from ddptrain.engine.engine import AUTOCAST, Engine, filler_inputs
from ddptrain.engine.grpo import CompletionHeadLoss, CompletionTargets, GRPOObjective, GRPOSettings, target_logps
from ddptrain.engine.stats import StepStats
from ddptrain.rl.batches import RolloutLayout, rollout_microbatches, split_parts
from ddptrain.rl.rollout import Rollout


def train_on_rollouts(engine: Engine, rollouts: list[Rollout], settings: GRPOSettings, layout: RolloutLayout,
                      reference=None) -> list[StepStats]:
    """settings.updates_per_rollout exact optimizer steps over this rank's `rollouts` (module docstring);
    each step's stats: loss, `kl` and `clip_ratio` (metrics), over the loss aggregation's denominator;
    grad_norm; tokens (the counted completion tokens of the part, all ranks). Collective."""
    if settings.beta > 0 and reference is None:
        raise ValueError(f"beta {settings.beta} > 0 needs a reference model (ddptrain.train.reference.Reference)")
    objective = GRPOObjective(settings)
    parts = [rollout_microbatches(part, layout, settings.mask_truncated)
             for part in split_parts(rollouts, layout.prompts, settings.updates_per_rollout)]
    most = _most_microbatches([len(part) for part in parts], engine.device)
    policy = engine.strategy.module
    if settings.updates_per_rollout > 1:
        parts = [_with_logps(engine, policy, part, count, settings.temperature, "old")
                 for part, count in zip(parts, most)]
    if settings.beta > 0:
        parts = [_with_logps(engine, reference.model, part, count, settings.temperature, "reference",
                             disable_adapter=reference.disables_adapter) for part, count in zip(parts, most)]
    return [engine.step(part, max_microbatches=count, objective=objective) for part, count in zip(parts, most)]


def _most_microbatches(counts: list[int], device: torch.device) -> list[int]:
    """The most microbatches any rank holds in each part (one small MAX all-reduce)."""
    if not is_distributed():
        return counts
    most = torch.tensor(counts, dtype=torch.int64, device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return most.tolist()


def _with_logps(engine: Engine, module: nn.Module, microbatches: list[tuple], most: int, temperature: float,
                field: str, disable_adapter: bool = False) -> list[tuple]:
    """The microbatches with `field` ("old" or "reference") set to `module`'s log-probs of their counted
    tokens. Where the strategy communicates in every forward (fsdp, zero3), a rank with fewer
    microbatches runs filler forwards up to `most`, so that every rank joins every collective."""
    filled = []
    for inputs, targets in microbatches:
        logps = completion_logps(engine, module, inputs, targets, temperature, disable_adapter)
        filled.append((inputs, targets.with_logps(**{field: logps})))
    if engine.strategy.communicates_every_microbatch:
        inputs, targets = microbatches[0] if microbatches else _NO_COMPLETION
        for _ in range(most - len(microbatches)):
            completion_logps(engine, module, filler_inputs(inputs), CompletionTargets.empty(targets), temperature,
                             disable_adapter)
    return filled


_NO_COMPLETION = (torch.zeros(1, 1, dtype=torch.long),
                  CompletionTargets(torch.zeros(1, 1, dtype=torch.long), torch.full((1, 1), -1),
                                    torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.float64)))
"""A filler's shape for a rank without rollouts in a part: one token id, no completion."""


@torch.no_grad()
def completion_logps(engine: Engine, module: nn.Module, inputs, targets: CompletionTargets, temperature: float,
                     disable_adapter: bool = False) -> torch.Tensor:
    """(N,) float64: `module`'s log-probs of the counted tokens (flat order) at `temperature`, under the
    engine's precision; the module itself is called, not the strategy's wrapper (DDP would broadcast
    buffers in its forward, a collective ranks with different microbatch counts would not all reach)."""
    device = engine.device
    inputs = {k: v.to(device) for k, v in inputs.items()} if isinstance(inputs, dict) else inputs.to(device)
    targets = targets.to(device)
    autocast = (torch.autocast(device.type, dtype=AUTOCAST[engine.precision]) if engine.precision in AUTOCAST
                else contextlib.nullcontext())
    adapter = module.disable_adapter() if disable_adapter else contextlib.nullcontext()
    keywords = {}
    if engine.chunked_head and takes_head_loss(module):
        chunk = max(targets.tokens.numel(), 1) if engine.strategy.gathers_per_module_call else engine.head_chunk_tokens
        keywords = {HEAD_LOSS: CompletionHeadLoss(targets, temperature, None, chunk)}  # ZeRO-3: one chunk
    with adapter, autocast:
        output = module(**inputs, **keywords) if isinstance(inputs, dict) else module(inputs, **keywords)
    return (output if keywords else target_logps(logits_of(output), targets.tokens, temperature)).double()
