"""PyTorch DDP with gradients SUMMED over ranks and synchronised once per optimizer step."""

# No `from __future__ import annotations`: DDP checks the comm hook's annotations at run time.


import contextlib
from typing import ContextManager

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddptrain.distributed import is_distributed
from ddptrain.strategies.base import Strategy


def sum_allreduce_hook(process_group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook that SUMS gradient buckets over ranks.

    DDP's built-in hook divides by the world size; our per-rank losses are already pieces of the
    global objective (divided by the global token count), so averaging would shrink the update by
    the world size. See torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


class DDPStrategy(Strategy):
    """DistributedDataParallel in a process group; the bare model in a world of one."""

    def __init__(self, bucket_cap_mb: float = 25.0, find_unused_parameters: bool = False):
        self.bucket_cap_mb = bucket_cap_mb
        self.find_unused_parameters = find_unused_parameters
        self.model = None
        self.optimizer = None
        self._module: nn.Module | None = None

    def setup(self, model: nn.Module, optimizer, device: torch.device) -> None:
        if optimizer is None:
            raise ValueError("strategy 'ddp' needs a torch optimizer; got optimizer=None")
        self._module = model
        self.optimizer = optimizer
        if not is_distributed():
            self.model = model
            return
        ddp = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=self.bucket_cap_mb,
            find_unused_parameters=self.find_unused_parameters,
            gradient_as_bucket_view=True,
        )
        ddp.register_comm_hook(state=None, hook=sum_allreduce_hook)
        self.model = ddp

    def microbatch_context(self, is_last: bool) -> ContextManager:
        if is_last or not isinstance(self.model, DistributedDataParallel):
            return contextlib.nullcontext()
        return self.model.no_sync()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        # After the synchronising backward every rank holds the same summed gradients, so this
        # norm is already global and identical on every rank: no extra collective.
        params = [p for p in self._module.parameters() if p.grad is not None]
        if max_norm is not None:
            return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        return torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)

    def optimizer_step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self._module.state_dict().items()}

    def load_model_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._module.load_state_dict(state)
