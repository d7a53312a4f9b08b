"""Group-relative advantages: each completion's reward less its group's mean, scaled by rl.scale_rewards.

    A_i = (r_i - mean(r of i's group)) / (s + 1e-4)

with s the group's reward std (`group`, GRPO), the whole step's (`batch`, as TRL and Dr. GRPO's
"batch" scaling), or 1 (`none`, Dr. GRPO). Stds are unbiased (torch.std), as TRL computes them. A
group lives on one rank, so `group` needs nothing from the others; `batch` all-reduces the step's
reward count, sum and sum of squares over the ranks, so every rank scales by the same number
whatever the layout.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

EPSILON = 1e-4
"""Added to the std before dividing (TRL's value), so a group whose rewards are all equal gets 0, not NaN."""


def all_reduce_host(tensor: torch.Tensor, op=None) -> None:
    """Sum (or `op`) a host tensor over the ranks, in place; a world of one keeps it (nccl: through the GPU)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else tensor.device
    moved = tensor.to(device)
    dist.all_reduce(moved, op=op or dist.ReduceOp.SUM)
    tensor.copy_(moved.cpu())


def group_advantages(rewards: list[float], group_size: int, scale: str) -> tuple[list[float], dict]:
    """Advantages of this rank's rewards (whole groups, in order) and the step's reward statistics
    over every rank: reward (mean), reward_std (over completions), frac_reward_zero_std (groups
    whose rewards are all equal)."""
    values = torch.tensor(rewards, dtype=torch.float64).view(-1, group_size)  # (groups, G)
    means = values.mean(dim=1, keepdim=True)
    stds = values.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(means)
    sums = torch.tensor([values.numel(), values.sum(), (values ** 2).sum(), float((stds < 1e-12).sum()),
                         values.shape[0]], dtype=torch.float64)
    all_reduce_host(sums)
    count, total, squares, zero_std, groups = sums.tolist()
    mean = total / count
    batch_std = math.sqrt(max(squares - count * mean * mean, 0.0) / (count - 1)) if count > 1 else 0.0
    centred = values - means
    if scale == "group":
        advantages = centred / (stds + EPSILON)
    elif scale == "batch":
        advantages = centred / (batch_std + EPSILON)
    else:
        advantages = centred
    stats = {"reward": mean, "reward_std": batch_std, "frac_reward_zero_std": zero_std / groups}
    return advantages.reshape(-1).tolist(), stats
