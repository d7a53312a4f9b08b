"""Optimizer and learning-rate schedule from config."""

from __future__ import annotations

import math

import torch
from torch import nn

from ddptrain.config.choices import OPTIMIZERS, SCHEDULES


def build_optimizer(model: nn.Module, name: str, lr: float, weight_decay: float,
                    betas: tuple[float, float], fused: bool = True) -> torch.optim.Optimizer:
    """AdamW (decay on matrices only, as nanoGPT) or plain SGD.

    `fused`: one kernel per step on CUDA and CPU, and it can skip a non-finite step on the device
    (GradScaler's found_inf), so the step never waits for the host."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    # An empty group is left out (a LoRA adapter has matrices only): ZeRO-3 drops empty groups from
    # the optimizer, and the LR schedule must see the groups the optimizer keeps.
    groups = [{"params": params, "weight_decay": decay_rate}
              for params, decay_rate in ((decay, weight_decay), (no_decay, 0.0)) if params]
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), fused=fused)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, fused=fused)
    raise ValueError(f"optim.name {name!r} is not one of {', '.join(OPTIMIZERS)}")


def build_scheduler(optimizer: torch.optim.Optimizer, schedule: str, warmup_steps: int, max_steps: int,
                    min_lr_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup, then cosine decay to min_lr_ratio x lr (or constant)."""

    def factor(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    if schedule not in SCHEDULES:
        raise ValueError(f"optim.schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
