"""What the Engine asks of a strategy; strategies know nothing of data."""

from __future__ import annotations

import abc
import contextlib
from typing import ContextManager

import torch
from torch import nn


class Strategy(abc.ABC):
    """Wraps a model so that, after the last microbatch of a step, every rank holds the SUM over
    ranks of the gradients of what `backward` was given.

    The Engine hands `backward` the pieces `sum_token_loss / N_t` of the global objective, so the
    summed gradients are exactly the gradient of the global mean-token loss. A strategy whose
    library averages over ranks or divides by accumulation steps must undo that itself.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer | None

    def configure(self, *, grad_clip: float | None, precision: str) -> None:
        """The Engine's step settings, given before `setup`. A library that clips inside its own
        optimizer step (DeepSpeed) needs them in its config; the default needs nothing."""

    @abc.abstractmethod
    def setup(self, model: nn.Module, optimizer, device: torch.device) -> None:
        """Wrap `model` (already on `device`) and take charge of `optimizer`."""

    def start_step(self, num_microbatches: int) -> None:
        """Called once per step, before the first forward, with this rank's microbatch count."""

    def microbatch_context(self, is_last: bool) -> ContextManager:
        """Context for one microbatch's forward and backward; non-final ones skip gradient sync."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradient of `loss` (a piece of the global objective)."""

    @abc.abstractmethod
    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        """Global norm of the synchronised gradients before clipping; clips when max_norm is set.

        A library that fuses clipping into its update (DeepSpeed) may apply the update here,
        provided it applies none when the norm is not finite; `optimizer_step` is then a no-op.
        """

    @abc.abstractmethod
    def optimizer_step(self) -> None:
        """Apply the update with the accumulated gradients."""

    @abc.abstractmethod
    def zero_grad(self) -> None:
        """Drop the accumulated gradients (after a step, or instead of a skipped one)."""

    @abc.abstractmethod
    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """Full, unsharded weights as CPU tensors, on every rank."""

    def load_model_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load full weights (as returned by model_state_dict) on every rank."""
        raise NotImplementedError(f"{type(self).__name__} cannot load a full model state dict")

    def state_dict(self) -> dict:
        """Optimizer (and strategy) state for checkpoints."""
        return {"optimizer": self.optimizer.state_dict()} if self.optimizer is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.optimizer is not None and "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
