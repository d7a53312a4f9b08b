"""Engine: one exact accumulated optimizer step, independent of the strategy.

The step minimises the GLOBAL mean loss over valid target tokens of all microbatches of all ranks:

    count tokens -> all-reduce N_t (async) -> forward/backward each microbatch with
    sum_token_loss / N_t (non-final ones under no_sync) -> clip by the global norm -> step

Gradients are sums of pieces of the one objective, and the strategy sums them over ranks, so the
update equals, up to float rounding, that of one process that saw the whole global batch.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ddptrain.distributed import get_rank, get_world_size, init_distributed, is_distributed
from ddptrain.models.build import logits_of
from ddptrain.objective import IGNORE_INDEX, Objective
from ddptrain.strategies import Strategy, build_strategy

log = logging.getLogger(__name__)

Microbatch = tuple[torch.Tensor, torch.Tensor]

PRECISIONS = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16}


@dataclass
class StepStats:
    """What one optimizer step did, the same numbers on every rank."""

    loss: float
    """Global mean of the Engine's objective over valid target tokens: cross-entropy, label-smoothed
    and plus the z-loss when the objective sets them (NaN when the step had none)."""
    tokens: int
    """Global number of valid target tokens N_t."""
    grad_norm: float
    """Global gradient norm before clipping (NaN when the step was skipped before backward)."""
    skipped: bool = False
    """True when no update was applied (no valid tokens, or a non-finite gradient norm)."""
    reason: str = ""
    """Why the step was skipped: 'no_valid_tokens' or 'nonfinite'."""
    filler_microbatches: int = 0
    """Microbatches without targets that ranks with fewer microbatches ran to keep a strategy's
    per-microbatch collectives in step (all ranks together)."""
    forward_backward_s: float = 0.0
    """Host seconds in forward and backward passes (DDP's overlapped gradient all-reduce included)."""
    comm_wait_s: float = 0.0
    """Host seconds blocked on the token-count and loss all-reduces (and the syncs they imply)."""
    optimizer_s: float = 0.0
    """Host seconds in clipping, the optimizer step, the LR schedule and zero_grad."""


class _PhaseClock:
    """Host seconds of one step: comm wait and optimizer inside `phase(...)` blocks, the rest forward-backward.

    perf_counter readings around calls that already exist: no device sync is added. On a GPU,
    kernels still queued are charged to the next sync point (the token count's or the loss's .item()).
    """

    def __init__(self):
        self.began = time.perf_counter()
        self.seconds = {"comm": 0.0, "optimizer": 0.0}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        since = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - since

    def stamp(self, stats: StepStats) -> StepStats:
        total = time.perf_counter() - self.began
        stats.comm_wait_s, stats.optimizer_s = self.seconds["comm"], self.seconds["optimizer"]
        stats.forward_backward_s = max(total - stats.comm_wait_s - stats.optimizer_s, 0.0)
        return stats


class Engine:
    """Runs exact accumulated steps for `model` with `optimizer` under a strategy.

    Args:
        model: an nn.Module mapping inputs to logits aligned with targets, (B, T) -> (B, T, V).
        optimizer: a torch optimizer over `model`'s parameters (None if the strategy builds one).
        strategy: a name of ddptrain.strategies.STRATEGY_NAMES ("ddp", "zero1", "zero2", "zero3",
            "fsdp"), or a Strategy instance.
        grad_clip: clip the global gradient norm to this value after normalisation (None: no clip).
        lr_scheduler: stepped once after every applied optimizer step.
        precision: "fp32" | "fp64" (the model is cast) | "bf16" (autocast).
        nonfinite: "skip" (no update, counted) or "stop" (raise) when the gradient norm is not finite.
        device: where microbatches go; defaults to the device of init_distributed().
        objective: the per-token loss summed over valid targets and divided by the global N_t
            (label smoothing, z-loss); None: plain cross-entropy.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        strategy: str | Strategy = "ddp",
        *,
        grad_clip: float | None = None,
        lr_scheduler=None,
        precision: str = "fp32",
        nonfinite: str = "skip",
        device: torch.device | None = None,
        strategy_options: dict | None = None,
        objective: Objective | None = None,
    ):
        if precision not in PRECISIONS:
            raise ValueError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
        if nonfinite not in ("skip", "stop"):
            raise ValueError(f"nonfinite policy {nonfinite!r} must be 'skip' or 'stop'")
        if grad_clip is not None and not grad_clip > 0:
            raise ValueError(f"grad_clip {grad_clip!r} must be > 0 (or None for no clipping)")
        self.device = device if device is not None else init_distributed().device
        self.precision = precision
        self.grad_clip = grad_clip
        self.nonfinite = nonfinite
        self.lr_scheduler = lr_scheduler
        self.objective = objective if objective is not None else Objective()
        if precision == "fp64":
            model = model.to(dtype=torch.float64)
        model = model.to(self.device)
        if isinstance(strategy, str):
            strategy = build_strategy(strategy, **(strategy_options or {}))
        self.strategy = strategy
        self.strategy.configure(grad_clip=grad_clip, precision=precision)
        self.strategy.setup(model, optimizer, self.device)
        self.skipped_steps = 0

    @property
    def model(self) -> nn.Module:
        """The wrapped module to call for forward passes."""
        return self.strategy.model

    # -- the step ------------------------------------------------------------------------------

    def step(self, microbatches: Sequence[Microbatch]) -> StepStats:
        """One optimizer step over this rank's microbatches of the global batch.

        Every rank must call it once per step; ranks may hold different numbers of microbatches.
        """
        if len(microbatches) == 0:  # the other ranks must hear of it in the token count, not wait for us
            self._count_tokens([])[1]()
            raise ValueError(f"Engine.step needs at least one microbatch on every rank; rank {get_rank()} got none")
        clock = _PhaseClock()
        microbatches = [self._to_device(inputs, targets) for inputs, targets in microbatches]
        counts, wait_for_counts = self._count_tokens(microbatches)
        fillers = 0
        if self.strategy.communicates_every_microbatch and is_distributed():
            with clock.phase("comm"):  # the strategy's collectives need every rank in every microbatch
                wait_for_counts()
                per_rank = counts[2:].tolist()
            if min(per_rank) == 0:
                raise ValueError(f"Engine.step needs at least one microbatch on every rank; "
                                 f"{per_rank.count(0)} rank(s) got none")
            microbatches = microbatches + [_filler(*microbatches[0])] * (max(per_rank) - len(microbatches))
            fillers = sum(max(per_rank) - count for count in per_rank)
        loss_sum = self._forward_backward(microbatches, counts, wait_for_counts, clock)
        if loss_sum is None:
            return clock.stamp(self._skip_empty_step())
        with clock.phase("optimizer"):
            grad_norm, applied = self.strategy.finish_step(self.grad_clip)
        with clock.phase("comm"):
            tokens = int(counts[0].item())
            loss = self._global_loss(loss_sum) / tokens
        with clock.phase("optimizer"):
            stats = self._update(loss, tokens, float(grad_norm), applied)
        stats.filler_microbatches = fillers
        return clock.stamp(stats)

    def _forward_backward(self, microbatches: list[Microbatch], counts: torch.Tensor, wait_for_counts,
                          clock: _PhaseClock) -> torch.Tensor | None:
        """Backward of each microbatch's sum_token_loss / N_t, non-final ones without gradient sync.

        Returns this rank's loss sum, or None when the global batch has no valid target (N_t = 0,
        known on every rank at once: nothing was backpropagated)."""
        global_tokens = counts[0]
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for index, (inputs, targets) in enumerate(microbatches):
            with self.strategy.microbatch_context(is_last=index == len(microbatches) - 1):
                piece = self._forward(inputs, targets)
                if index == 0:  # the count's all-reduce overlapped the first forward; backward needs N_t
                    with clock.phase("comm"):
                        wait_for_counts()
                        if counts[1].item() > 0:
                            raise ValueError(f"Engine.step needs at least one microbatch on every rank; "
                                             f"{counts[1].item()} rank(s) got none")
                        is_empty = global_tokens.item() == 0
                    if is_empty:
                        return None
                loss_sum += piece.detach().double()
                self.strategy.backward(piece / global_tokens.to(piece.dtype))
        return loss_sum

    def _update(self, loss: float, tokens: int, grad_norm: float, applied: bool) -> StepStats:
        """LR schedule and zero_grad after the strategy's update; a skip when it applied none
        (a non-finite norm: global, so the same on every rank)."""
        if not applied:
            return self._skip_nonfinite(loss, tokens, grad_norm)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.strategy.zero_grad()
        return StepStats(loss=loss, tokens=tokens, grad_norm=grad_norm)

    def _to_device(self, inputs, targets: torch.Tensor) -> Microbatch:
        non_blocking = self.device.type == "cuda"
        if isinstance(inputs, dict):
            inputs = {k: v.to(self.device, non_blocking=non_blocking) for k, v in inputs.items()}
        else:
            inputs = inputs.to(self.device, non_blocking=non_blocking)
        return inputs, targets.to(self.device, non_blocking=non_blocking)

    def _count_tokens(self, microbatches: list[Microbatch]):
        """Start the all-reduce of [valid tokens, ranks without microbatches, microbatches of each
        rank] (one small SUM); return (tensor, wait)."""
        local = torch.zeros(2 + get_world_size(), dtype=torch.int64, device=self.device)
        for _, targets in microbatches:
            local[0] += (targets != IGNORE_INDEX).sum()
        local[1] = int(not microbatches)
        local[2 + get_rank()] = len(microbatches)
        if not is_distributed():
            return local, lambda: None
        work = dist.all_reduce(local, op=dist.ReduceOp.SUM, async_op=True)
        return local, work.wait

    def forward(self, inputs) -> torch.Tensor:
        """Logits of the wrapped model under this engine's precision, (B, T) -> (B, T, V).

        `inputs` is a tensor, or a dict of tensors passed to the model as keyword arguments."""
        if self.precision != "bf16":
            return self._call_model(inputs)
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            return self._call_model(inputs)

    def _call_model(self, inputs) -> torch.Tensor:
        # A dict of tensors (packed rows: idx, positions, segments) goes in as keyword arguments.
        output = self.model(**inputs) if isinstance(inputs, dict) else self.model(inputs)
        return logits_of(output)  # logits, or a transformers ModelOutput's .logits

    def _forward(self, inputs, targets: torch.Tensor) -> torch.Tensor:
        return self.objective.token_sum(self.forward(inputs), targets)

    def _global_loss(self, loss_sum: torch.Tensor) -> float:
        if is_distributed():
            dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
        return float(loss_sum.item())

    def _skip_empty_step(self) -> StepStats:
        # N_t is global, so every rank takes this branch at the same step; no backward has run.
        self.strategy.zero_grad()
        self.skipped_steps += 1
        log.warning("step skipped: the global batch holds no valid target token (N_t = 0)")
        return StepStats(loss=float("nan"), tokens=0, grad_norm=float("nan"), skipped=True, reason="no_valid_tokens")

    def _skip_nonfinite(self, loss: float, tokens: int, grad_norm: float) -> StepStats:
        # The norm is of the synchronised gradients, so every rank sees the same non-finite value.
        self.strategy.zero_grad()
        if self.nonfinite == "stop":
            raise FloatingPointError(f"non-finite gradient norm {grad_norm} (loss {loss}); nonfinite='stop'")
        self.skipped_steps += 1
        log.warning("step skipped: non-finite gradient norm %s (loss %s)", grad_norm, loss)
        return StepStats(loss=loss, tokens=tokens, grad_norm=grad_norm, skipped=True, reason="nonfinite")

    # -- state ---------------------------------------------------------------------------------

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """Full, unsharded weights as CPU tensors."""
        return self.strategy.model_state_dict()

    def state_dict(self) -> dict:
        """Everything needed to resume, in memory: optimizer state, LR schedule and counters.
        A strategy that shards its optimizer state raises instead (use `save` / `load`)."""
        return {"strategy": self.strategy.state_dict(), **self.progress_state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.strategy.load_state_dict(state["strategy"])
        self.load_progress_state_dict(state)

    def progress_state_dict(self) -> dict:
        """The LR schedule and the skipped-step count: what `save` does not hold."""
        state: dict = {"skipped_steps": self.skipped_steps}
        if self.lr_scheduler is not None:
            state["lr_scheduler"] = self.lr_scheduler.state_dict()
        return state

    def load_progress_state_dict(self, state: dict) -> None:
        self.skipped_steps = state.get("skipped_steps", 0)
        if self.lr_scheduler is not None and "lr_scheduler" in state:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])

    def save(self, directory: str | Path) -> None:
        """Collective: the strategy writes weights and optimizer state to `directory` (each rank its part)."""
        self.strategy.save(Path(directory))

    def load(self, directory: str | Path) -> None:
        """Collective: restore what `save` wrote (sharded strategies may reshard to this world size)."""
        self.strategy.load(Path(directory))


def _filler(inputs, targets: torch.Tensor) -> Microbatch:
    """The smallest microbatch shaped like a real one: one token, its target ignored. Its forward and
    backward run every collective of the strategy and add nothing to the loss or the gradient."""
    if isinstance(inputs, dict):
        inputs = {key: value[:1, :1] for key, value in inputs.items()}
    else:
        inputs = inputs[:1, :1]
    return inputs, torch.full_like(targets[:1, :1], IGNORE_INDEX)

