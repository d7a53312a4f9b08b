"""PyTorch DDP with gradients SUMMED over ranks and synchronised once per optimizer step."""

# No `from __future__ import annotations`: DDP checks the comm hook's annotations at run time.


import contextlib
from pathlib import Path
from typing import ContextManager

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddptrain.config.choices import DDPOptions
from ddptrain.distributed import is_distributed
from ddptrain.fsutil import load_torch
from ddptrain.strategies.base import Strategy
from ddptrain.strategies.footprint import Collective, Footprint, Layout, ParameterCounts

MODEL_FILE = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"
"""The files of a ddp checkpoint from before the neutral layout (ddptrain/strategies/state.py)."""


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
    """DistributedDataParallel in a process group; the bare model in a world of one.

    Every rank holds the full weights and optimizer state; a checkpoint is the neutral layout
    (each tensor written once, by one rank). Frozen parameters (requires_grad False) get no
    gradient and no bucket; with `save_frozen` False, checkpoints leave them out (a LoRA
    checkpoint holds the adapter and its optimizer state)."""

    name = "ddp"
    Options = DDPOptions

    def __init__(self, bucket_cap_mb: float = 25.0, find_unused_parameters: bool = False):
        self.bucket_cap_mb = bucket_cap_mb
        self.find_unused_parameters = find_unused_parameters
        self.model = None
        self.optimizer = None
        self._module: nn.Module | None = None

    @classmethod
    def memory_per_rank(cls, counts: ParameterCounts, layout: Layout) -> list[Footprint]:
        """Every rank holds everything; one all-reduce of the trained gradients per step."""
        b = layout.bytes_per_value
        trained = counts.trainable * b
        return [Footprint(cls.name, cls.name, counts.parameters * b, trained, layout.optimizer_state_bytes(trained), 0,
                          [Collective("gradient all-reduce", "all_reduce", trained, 1, layout.world_size,
                                      layout.world_level)])]

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

    def finish_step(self, max_norm: float | None, skip: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # After the synchronising backward every rank holds the same summed gradients, so this
        # norm is already global and identical on every rank: no extra collective.
        params = [p for p in self._module.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        return self.clip_and_update(params, norm, max_norm, skip)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def model_state_dict(self, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        skip = self.frozen_names(self._module) if trainable_only else set()
        return {k: v.detach().cpu().clone() for k, v in self._module.state_dict().items() if k not in skip}

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])

    def load_legacy(self, directory: Path) -> None:
        """A checkpoint from before the neutral layout: model.pt and optimizer.pt, written by rank 0."""
        if not (directory / MODEL_FILE).is_file():
            super().load_legacy(directory)
        weights = torch.load(directory / MODEL_FILE, map_location="cpu", weights_only=True)
        if self.save_frozen:
            self._module.load_state_dict(weights)
        else:  # the frozen parameters are the model's own (its build restored them)
            missing, unexpected = self._module.load_state_dict(weights, strict=False)
            self.check_loaded(missing, unexpected, self.frozen_names(self._module), directory)
        state = load_torch(directory / OPTIMIZER_FILE)  # tensors and plain containers: weights_only
        self.load_state_dict(state)

    @staticmethod
    def read_legacy_weights(directory: Path) -> dict[str, torch.Tensor]:
        return torch.load(directory / MODEL_FILE, map_location="cpu", weights_only=True)
