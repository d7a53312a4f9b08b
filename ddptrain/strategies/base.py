"""What the Engine, the trainer and checkpoints ask of a strategy; strategies know nothing of data.

A strategy is one file: a subclass of `Strategy` with its own `Options` dataclass (the keys of
its `strategy=<name>` config section besides `name`), registered by one line in
`ddptrain.config.choices.STRATEGIES`. Nothing outside its file branches on its name.
"""

from __future__ import annotations

import abc
import contextlib
import copy
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, ContextManager

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from ddptrain.config.choices import PRECISIONS
from ddptrain.strategies import state as neutral
from ddptrain.strategies.footprint import Footprint, Layout, ParameterCounts


@dataclass(frozen=True)
class StepLayout:
    """What a strategy may need to know of the run when it is built from config."""

    micro_batch_size: int = 1
    """Sequences per microbatch per rank (DeepSpeed's bookkeeping)."""
    grad_accum_steps: int = 1
    """Microbatches per rank per step when that is fixed (DeepSpeed's bookkeeping)."""


class Strategy(abc.ABC):
    """Wraps a model so that, after the last microbatch of a step, the gradients are the SUM over
    ranks of the gradients of what `backward` was given, then finishes the step.

    The Engine hands `backward` the pieces `sum_token_loss / N_t` of the global objective, so the
    summed gradients are exactly the gradient of the global mean-token loss. A strategy whose
    library averages over ranks or divides by accumulation steps must undo that itself.
    """

    name: ClassVar[str]
    communicates_every_microbatch: ClassVar[bool] = False
    """True when every microbatch's forward or backward is a collective (parameter gathers,
    gradient reduce-scatters): ranks with fewer microbatches then run filler microbatches."""
    gathers_per_module_call: ClassVar[bool] = False
    """True when each call of a module gathers its weights (a collective): every rank must then call
    the output head as often as the others, so the chunked head runs the valid targets of a
    microbatch in one chunk (the count of valid targets differs between ranks, the count of
    microbatches does not)."""
    shards_weights: ClassVar[bool] = False
    """True when no rank holds the whole model between steps (fsdp, zero3): generating from the
    policy (RL rollouts) then needs its full weights gathered into a copy (`model_state_dict`)."""
    supported_precisions: ClassVar[tuple[str, ...]] = PRECISIONS

    @dataclass
    class Options:
        """The strategy's config keys besides `name` (none by default)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    save_frozen: bool = True
    """Whether `save` writes the parameters that do not train (requires_grad False). False where the
    model's build restores them (model.lora's frozen base): `save` then writes the trained
    parameters and the optimizer state alone, and `load` expects the frozen ones absent."""

    @property
    def module(self) -> nn.Module:
        """The model itself, under whatever wrapper the strategy put around it (DDP, DeepSpeed's engine)."""
        module = getattr(self, "_module", None)
        return module if module is not None else self.model  # not `or`: a module may define __len__

    @classmethod
    def from_config(cls, options: dict, layout: StepLayout) -> "Strategy":
        """Built from its config section (a dict without `name`)."""
        return cls(**options)

    @classmethod
    def check_config(cls, options: dict, layout: StepLayout, *, world_size: int, grad_clip: float | None) -> None:
        """Refuse (ValueError naming the key, the value and the rule) options that `setup` would
        refuse, before any process group or run dir exists. Nothing to check by default."""

    @classmethod
    def memory_per_rank(cls, counts: ParameterCounts, layout: Layout) -> list[Footprint]:
        """What one rank holds (weights, gradients, optimizer state, other buffers) and sends per
        optimizer step under this strategy, for `python -m ddptrain.plan`: one Footprint per way it
        runs. Computed from the counts, without building the strategy or a process group."""
        raise NotImplementedError(f"strategy={cls.name} does not say what a rank holds and sends")

    def configure(self, *, grad_clip: float | None, precision: str, save_frozen: bool = True) -> None:
        """The Engine's step settings, given before `setup`."""
        if precision not in self.supported_precisions:
            raise ValueError(f"trainer.precision={precision} is not supported by strategy={self.name} "
                             f"(it supports {', '.join(self.supported_precisions)})")
        self.grad_clip = grad_clip
        self.precision = precision
        self.save_frozen = save_frozen

    @abc.abstractmethod
    def setup(self, model: nn.Module, optimizer, device: torch.device) -> None:
        """Wrap `model` (already on `device`) and take charge of `optimizer`."""

    def microbatch_context(self, is_last: bool) -> ContextManager:
        """Context for one microbatch's forward and backward; non-final ones skip gradient sync."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradient of `loss` (a piece of the global objective)."""

    @abc.abstractmethod
    def finish_step(self, max_norm: float | None, skip: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(global gradient norm before clipping, whether the update was applied), device tensors.

        Clips by the global norm when `max_norm` is set and applies the optimizer update, unless
        `skip` (a device bool: the global batch had no valid token) or the norm is not finite:
        then nothing is applied (the same on every rank, since both are global). The Engine zeroes
        gradients, steps the LR schedule and counts skips."""

    @abc.abstractmethod
    def zero_grad(self) -> None:
        """Drop the accumulated gradients (after a step, or instead of a skipped one)."""

    @abc.abstractmethod
    def model_state_dict(self, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        """Full, unsharded weights as CPU tensors, on every rank (collective when sharded);
        `trainable_only`: only the parameters that train (and the buffers), nothing frozen gathered."""

    def nonfinite_weights(self) -> list[str]:
        """Names of this rank's weights (its shards, where sharded) that hold a NaN or inf. Local:
        no collective, no gather (the Engine combines the ranks' answers before a save)."""
        bad = []
        for name, param in self.model.named_parameters():
            local = self.local_tensor(param)
            if local.is_floating_point() and local.numel() and not torch.isfinite(local).all():
                bad.append(name)
        return bad

    # -- a frozen copy of the weights (DPO's reference) --------------------------------------------

    @classmethod
    def frozen_copy(cls, model: nn.Module) -> nn.Module:
        """A copy of `model`'s current weights that never trains, taken before `setup` (which may
        cast or move them) and handed to `hold_frozen` after it: whole by default."""
        reference = copy.deepcopy(model)
        reference.requires_grad_(False)
        return reference.eval()

    @staticmethod
    def meta_skeleton(model: nn.Module) -> nn.Module:
        """A frozen copy of `model`'s structure, its parameters on the meta device (no memory; ties
        kept; buffers copied): what a strategy that shards weights fills from the model's own shards
        in `hold_frozen`, so that no rank ever holds a whole copy."""
        memo = {id(param): nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=False)
                for param in model.parameters()}  # deepcopy takes these for the parameters (ties kept)
        reference = copy.deepcopy(model, memo)
        return reference.requires_grad_(False)  # eval() once materialized: transformers' eval() refuses meta

    def hold_frozen(self, module: nn.Module, device: torch.device, dtype: torch.dtype | None) -> nn.Module:
        """`frozen_copy`'s copy, on `device` (in `dtype` if given), held as this strategy holds the
        model's weights: whole on every rank by default, as ddp and ZeRO-1/2 hold the model's. Its
        forward is called without gradients and, where the strategy `communicates_every_microbatch`,
        on every rank as often as on the others."""
        module = module.to(device=device)
        return module.to(dtype=dtype) if dtype is not None else module

    @staticmethod
    def frozen_names(module: nn.Module) -> set[str]:
        """State-dict names (every alias) of `module`'s parameters that do not train."""
        return {name for name, param in module.named_parameters(remove_duplicate=False) if not param.requires_grad}

    @staticmethod
    def check_loaded(missing: list[str], unexpected: list[str], frozen: set[str], directory: Path) -> None:
        """After a non-strict load of a checkpoint saved without its frozen parameters: only those may be missing."""
        missing = [name for name in missing if name not in frozen]
        if missing or unexpected:
            raise ValueError(f"{directory}: the saved weights do not fit the model (missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]})")

    @staticmethod
    def local_tensor(param: torch.Tensor) -> torch.Tensor:
        """What this rank holds of `param` (a DTensor's local shard)."""
        return param.to_local() if isinstance(param, DTensor) else param.detach()

    def whole_tensor(self, param: torch.Tensor) -> torch.Tensor:
        """`param` whole, on every rank (collective where it is sharded: a DTensor's shards gathered)."""
        return param.full_tensor().detach() if isinstance(param, DTensor) else param.detach()

    # -- checkpoints: the strategy-neutral layout of ddptrain/strategies/state.py -----------------

    def save(self, directory: Path, background: bool = False):
        """Collective: write the full-model view of weights and optimizer state to `directory` (a DCP
        directory, each rank its part), in the layout every strategy loads on any world size.

        `background`: return once the state is copied off the device, with a future of the write,
        which DCP does in a background thread (ddptrain/strategies/state.py `save_async`)."""
        state = self.state_to_save()
        if background:
            return neutral.save_async(state, directory)
        neutral.save(state, directory)
        return None

    def state_to_save(self) -> dict:
        """Collective: {"model": ..., "optimizer": ...} in the neutral layout's names, tensors as the
        strategy holds them (DTensor shards, or full tensors every rank has).

        This default is torch's own `get_state_dict` over a torch model and optimizer (ddp, fsdp);
        a strategy that keeps its state elsewhere (DeepSpeed's partitions) maps it to the same names."""
        fresh = not self.optimizer.state
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=self._state_options())
        if fresh:  # torch created the state by a step at learning rate 0, which counted: uncount it
            neutral.zero_step_counts(self.optimizer.state.values())
            neutral.zero_step_counts(optimizer_state["state"].values())
        return {"model": model_state, "optimizer": optimizer_state}

    def load(self, directory: Path) -> None:
        """Collective: restore what any strategy's `save` wrote, on any world size (DCP reshards), or a
        checkpoint of this strategy's own layout from before checkpoints were neutral (`load_legacy`)."""
        if not neutral.is_neutral(directory):
            self.load_legacy(directory)
            return
        options = self._state_options()
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=options)
        state = {"model": model_state, "optimizer": optimizer_state}
        neutral.load_into(state, directory)
        result = set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                                optim_state_dict=state["optimizer"], options=options)
        if not self.save_frozen:  # missing keys are named as the wrapper names them (DDP: "module.")
            frozen = self.frozen_names(self.module) | self.frozen_names(self.model)
            self.check_loaded(result.missing_keys, result.unexpected_keys, frozen, directory)

    def _state_options(self) -> StateDictOptions:
        # Without the frozen parameters (save_frozen False: the model's build restores them), the
        # load cannot be strict; `load` checks that only they are missing.
        return StateDictOptions(ignore_frozen_params=not self.save_frozen, strict=self.save_frozen)

    def load_legacy(self, directory: Path) -> None:
        """Restore a checkpoint this strategy wrote in its own layout, before checkpoints were neutral."""
        raise FileNotFoundError(f"{directory} holds no checkpoint state strategy={self.name} can read (no DCP "
                                f"{neutral.METADATA})")

    @staticmethod
    def read_legacy_weights(directory: Path) -> dict[str, torch.Tensor]:
        """The full weights of a checkpoint in this strategy's pre-neutral layout, in one process."""
        raise FileNotFoundError(f"{directory} holds no DCP {neutral.METADATA}")

    def clip_and_update(self, params: list, norm: torch.Tensor, max_norm: float | None,
                        skip: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Clip `params`' gradients by the global `norm` and update, unless `skip` or the norm is not
        finite; returns (norm, applied) for finish_step."""
        applied = torch.isfinite(norm) & ~skip
        if max_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
        self.apply_update(self.optimizer, applied)
        return norm, applied

    @staticmethod
    def apply_update(optimizer: torch.optim.Optimizer, applied: torch.Tensor) -> None:
        """optimizer.step(), or nothing where `applied` is False, decided on the device when the
        optimizer can (fused AdamW/Adam/SGD take GradScaler's `found_inf`); others read the flag
        once (a host sync)."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if getattr(optimizer, "_step_supports_amp_scaling", False) and not any(isinstance(p, DTensor) for p in params):
            optimizer.grad_scale, optimizer.found_inf = None, (~applied).to(torch.float32)
            try:
                optimizer.step()
            finally:
                del optimizer.grad_scale, optimizer.found_inf
        elif bool(applied):
            optimizer.step()

    def state_dict(self) -> dict:
        """Optimizer (and strategy) state in memory, when it fits in one process; a sharded
        strategy raises instead of returning state without its optimizer (use save/load)."""
        raise NotImplementedError(f"strategy={self.name} keeps its optimizer state sharded over ranks: use "
                                  "Engine.save(directory) / Engine.load(directory) on every rank")

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError(f"strategy={self.name}: use Engine.load(directory) on every rank")
