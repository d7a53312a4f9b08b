"""PyTorch FSDP2 (`fully_shard`): weights, gradients and optimizer state sharded over ranks.

The exact objective needs summed gradients and one gradient reduction per step:
`set_gradient_divide_factor(1.0)` makes the reduce-scatter SUM instead of averaging, and
`set_requires_gradient_sync(False)` on non-final microbatches accumulates unsharded gradients that
are reduce-scattered once, in the last microbatch's backward. Forwards all-gather weights in every
microbatch, so ranks with fewer microbatches run fillers (the Engine does). The global gradient norm
comes from the sharded gradients (DTensors) and clipping scales the shards.

HSDP (`replicate` R > 1, or "auto": the number of nodes): a 2-D mesh of R replicas x world/R shards
(ddptrain.distributed.device_mesh); FSDP2 shards within a replica and all-reduces the shards across
replicas. Both collectives SUM and both are skipped on non-final microbatches; weight all-gathers stay
inside a node.

Checkpoints are the neutral layout (Strategy.save, a DCP directory) that any strategy on any number of
ranks resumes from. Frozen parameters (model.lora's base) are sharded like the others and get no
gradient; with `save_frozen` False checkpoints leave them out (DCP's `ignore_frozen_params`).
"""

from __future__ import annotations

import contextlib
import logging
from typing import ContextManager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from ddptrain.config.choices import FSDPOptions
from ddptrain.config.schema import ConfigError
from ddptrain.distributed import backend_for, device_mesh, get_world_size, is_distributed, replicate_degree
from ddptrain.contract.blocks import block_class_names
from ddptrain.strategies.base import StepLayout, Strategy
from ddptrain.strategies.footprint import Collective, Footprint, Layout, ParameterCounts

log = logging.getLogger(__name__)


def default_shard_modules(model: nn.Module) -> set[str]:
    """Class names of the transformer blocks (ddptrain.contract.blocks: the built-in GPT's Block, a
    transformers model's decoder layers); each block is one shard unit."""
    return block_class_names(model)


class FSDPStrategy(Strategy):
    name = "fsdp"
    communicates_every_microbatch = True
    shards_weights = True

    Options = FSDPOptions

    @classmethod
    def from_config(cls, options: dict, layout: StepLayout) -> "FSDPStrategy":
        return cls(**options)

    @classmethod
    def memory_per_rank(cls, counts: ParameterCounts, layout: Layout) -> list[Footprint]:
        """Two ways it runs: sharded over the whole world (fsdp), and HSDP (layout.replicate
        replicas of world/replicate shards, the shards inside a node)."""
        world = cls._footprint(cls.name, counts, layout, layout.world_size, layout.world_level)
        shards = layout.world_size // layout.replicate
        hsdp = cls._footprint("hsdp", counts, layout, shards, "intra", label=f"hsdp {layout.replicate}x{shards}")
        if layout.replicate > 1:
            hsdp.collectives.append(Collective("gradient all-reduce of the shards across replicas", "all_reduce",
                                               counts.trainable * layout.bytes_per_value / shards, 1,
                                               layout.replicate, layout.world_level))
        return [world, hsdp]

    @staticmethod
    def _footprint(name: str, counts: ParameterCounts, layout: Layout, shards: int, level: str,
                   label: str | None = None) -> Footprint:
        """Sharded over `shards` ranks whose collectives run at `level`."""
        b, accumulation = layout.bytes_per_value, layout.grad_accum_steps
        trained = counts.trainable * b
        label = label or name
        notes = []
        grads = trained if accumulation > 1 else trained / shards
        if accumulation > 1:
            notes.append(f"{label}: gradients stay unsharded while {accumulation} microbatches accumulate (no sync)")
        gather_b = 2 if layout.precision == "bf16" else b  # MixedPrecisionPolicy(param_dtype=bf16) gathers bf16
        gathered = min(2 * counts.largest_unit, counts.parameters) * gather_b  # one unit + the prefetched
        # fully_shard(model, reshard_after_forward=True) reshards the root unit too (counted on gloo ranks:
        # the backward gathers every parameter again)
        comms = [Collective("parameter all-gather, forward (every microbatch)", "all_gather",
                            counts.parameters * gather_b, accumulation, shards, level)]
        if layout.reshard_after_forward:
            comms.append(Collective("parameter all-gather, backward (every microbatch)", "all_gather",
                                    counts.parameters * gather_b, accumulation, shards, level))
        comms.append(Collective("gradient reduce-scatter", "reduce_scatter", trained, 1, shards, level))
        return Footprint(name, label, counts.parameters * b / shards, grads,
                         layout.optimizer_state_bytes(trained) / shards, gathered, comms, notes,
                         frozen_copy_shards=shards)

    def __init__(self, reshard_after_forward: bool = True, shard_modules: list | tuple = (), replicate: int | str = 1):
        self.reshard_after_forward = reshard_after_forward
        self.shard_modules = list(shard_modules)
        self.replicate = replicate
        self.mesh = None
        self.model = None
        self.optimizer = None

    def setup(self, model: nn.Module, optimizer, device: torch.device) -> None:
        if optimizer is None:
            raise ValueError("strategy 'fsdp' needs a torch optimizer; got optimizer=None")
        names = self.shard_unit_names(model)  # before any process group or mesh: a typo fails alike on every rank
        if not is_distributed():  # a world of one still gets a process group: fully_shard needs a mesh
            dist.init_process_group(backend_for(device), store=dist.HashStore(), rank=0, world_size=1)
        replicas = replicate_degree(self.replicate, get_world_size())
        mesh = device_mesh(device.type, replicas)
        if replicas > 1:
            log.info("fsdp: HSDP mesh of %d replicas x %d shards (sharded within a replica, replicated across)",
                     replicas, get_world_size() // replicas)
        by_name = {id(param): name for name, param in model.named_parameters()}
        self.mesh = mesh
        self._shard(model, names, self.reshard_after_forward)
        for module in model.modules():  # SUM over ranks: the losses are already pieces of the global mean
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)  # per module: the setter does not recurse
                # A plain SUM reduce-scatter (and, under HSDP, a SUM all-reduce over the replicas):
                # a divide factor otherwise becomes NCCL's PREMUL_SUM, which gloo lacks, or AVG
                # (torch's _get_gradient_divide_factors); a factor of 1 needs no scaling at all.
                module.set_force_sum_reduction_for_comms(True)
        # fully_shard replaced the parameters by sharded DTensor parameters: the optimizer (built
        # before, with no state yet) must hold the new ones, in the same groups.
        sharded = dict(model.named_parameters())
        for group in optimizer.param_groups:
            group["params"] = [sharded[by_name[id(param)]] for param in group["params"]]
            if isinstance(optimizer, torch.optim.SGD):  # fused SGD has no sharding rule for DTensor parameters
                group["fused"] = False
        self.model = model
        self.optimizer = optimizer

    def _shard(self, model: nn.Module, unit_names: set[str], reshard_after_forward: bool) -> None:
        """fully_shard each unit of `model`, then its root, over this strategy's mesh."""
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if self.precision == "bf16" else MixedPrecisionPolicy()
        for module in list(model.modules())[1:]:
            if type(module).__name__ in unit_names:
                fully_shard(module, mesh=self.mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        fully_shard(model, mesh=self.mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)

    @classmethod
    def frozen_copy(cls, model: nn.Module) -> nn.Module:
        """The copy's structure, its parameters on the meta device (`Strategy.meta_skeleton`):
        `hold_frozen` fills this rank's shards from the model's, so no rank ever holds a whole copy."""
        return cls.meta_skeleton(model)

    def hold_frozen(self, module: nn.Module, device: torch.device, dtype: torch.dtype | None) -> nn.Module:
        """Sharded as the model is (the same units, mesh and mixed precision), each unit gathered for
        its forward and freed after it (reshard_after_forward), whatever the model's setting. A
        `frozen_copy` skeleton (parameters on the meta device) gets copies of the model's own shards,
        taken before the first step: the initial weights. A module with weights of its own (another
        model: a test's reference, a separate base) is sharded with those weights, never the model's."""
        skeleton = any(param.is_meta for param in module.parameters())
        if dtype is not None:
            module = module.to(dtype=dtype)
        self._shard(module, self.shard_unit_names(module), reshard_after_forward=True)
        if not skeleton:
            return module.to(device=device).eval()
        module.to_empty(device=device)
        policy = dict(self.model.named_parameters())
        buffers = dict(self.model.named_buffers())
        with torch.no_grad():
            for name, param in module.named_parameters():
                mine, theirs = self.local_tensor(param), self.local_tensor(policy[name])
                if mine.shape != theirs.shape or mine.dtype != theirs.dtype:
                    raise RuntimeError(f"fsdp: the frozen copy's shard of {name} is {tuple(mine.shape)} "
                                       f"{mine.dtype}, the model's {tuple(theirs.shape)} {theirs.dtype}")
                mine.copy_(theirs)
            for name, buffer in module.named_buffers():
                buffer.copy_(buffers[name])
        return module.eval()

    def shard_unit_names(self, model: nn.Module) -> set[str]:
        """The class names sharded as units: strategy.shard_modules, else the model's blocks. A name
        that is no class in `model` is a ConfigError naming the classes it has (the valid names are
        only known once the model is built, which is why validation cannot check them)."""
        present = {type(module).__name__ for module in model.modules()}
        unknown = sorted(set(self.shard_modules) - present)
        if unknown:
            blocks = ", ".join(sorted(default_shard_modules(model))) or "none: the model is sharded whole"
            raise ConfigError(f"strategy.shard_modules={self.shard_modules!r} names {', '.join(unknown)}, which "
                              f"{type(model).__name__} does not contain; its module classes are "
                              f"{', '.join(sorted(present))} (strategy.shard_modules=[], the default, shards its "
                              f"blocks: {blocks})")
        return set(self.shard_modules) or default_shard_modules(model)

    def microbatch_context(self, is_last: bool) -> ContextManager:
        self.model.set_requires_gradient_sync(is_last)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def finish_step(self, max_norm: float | None, skip: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()  # the shards' partial norms reduced over ranks: the global norm
        return self.clip_and_update(params, norm, max_norm, skip)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def model_state_dict(self, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        """Full weights on every rank (each sharded tensor all-gathered once; frozen ones not at all
        with `trainable_only`)."""
        skip = self.frozen_names(self.model) if trainable_only else set()
        out = {}
        for name, value in self.model.state_dict().items():
            if name in skip:
                continue
            full = value.full_tensor() if isinstance(value, DTensor) else value
            out[name] = full.detach().cpu().clone()
        return out
