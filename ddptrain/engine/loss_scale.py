"""Dynamic loss scaling for fp16, with the overflow decided on the GLOBAL gradient norm.

fp16 gradients underflow unless the loss is scaled up before backward. The scale is divided out
before clipping; an overflow (a non-finite global norm, the same on every rank because it is
computed from the synchronised gradients) skips the step on every rank and halves the scale;
`growth_interval` good steps in a row double it. Everything stays on the device
(torch._amp_update_scale_, as torch.amp.GradScaler does), so no step waits for the host.
"""

from __future__ import annotations

import torch


class DynamicLossScale:
    def __init__(self, device: torch.device, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        self.scale = torch.full((), init_scale, dtype=torch.float32, device=device)
        self._growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale.to(loss.dtype)

    def unscale_(self, parameters) -> None:
        grads = [p.grad for p in parameters if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, self.scale.double().reciprocal().float())

    def update(self, applied: torch.Tensor) -> None:
        """Halve the scale after an overflow (a skipped step), grow it after enough good ones."""
        found_inf = (~torch.as_tensor(applied, device=self.scale.device)).to(torch.float32)
        torch._amp_update_scale_(self.scale, self._growth_tracker, found_inf, self.growth_factor,
                                 self.backoff_factor, self.growth_interval)

    def state_dict(self) -> dict:
        return {"scale": self.scale.cpu(), "growth_tracker": self._growth_tracker.cpu()}

    def load_state_dict(self, state: dict) -> None:
        self.scale.copy_(state["scale"])
        self._growth_tracker.copy_(state["growth_tracker"])
