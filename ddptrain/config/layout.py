"""The step's layout: how the global batch of one optimizer step splits over ranks and microbatches.

Decided once, from the batch section and the world size, and read by validation, the builder, the
start-up summary and the memory plan. Either every rank runs the same number of microbatches of
`batch.micro_size` rows (global = micro x accumulation x world, which must divide), or rows vary:
a token budget (batch.micro_tokens) or packing (batch.pack) makes the number of microbatches, and
of rows in them, differ by step and rank, and no accumulation count is fixed.

`batch.pack=null` is decided here (`default_packing`): conversations (data=sft) are packed, whole,
per step, which keeps the step's sample and computes the fewest positions; everything else stays
unpacked, since packing a text stream changes which examples a step draws.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import Any

from ddptrain.config.schema import BatchConfig, ConfigError


def rows_vary(batch: BatchConfig) -> bool:
    """Whether the microbatches per step (and the rows in them) vary by step and rank."""
    return batch.micro_tokens is not None or bool(batch.pack)


def default_packing(cfg: Any) -> tuple[bool, str]:
    """What `batch.pack=null` means for this run, and why, in words for the start-up line."""
    if cfg.data.name == "preference":
        return False, ("unpacked pairs, two rows each (batch.pack=true packs each step's pairs whole, chosen and "
                       "rejected as two documents of a row: the same sample, fewer padded positions)")
    if cfg.data.name == "prompts":
        return False, "unpacked rollouts, one completion per row (batch.pack=true packs each step's completions)"
    if cfg.data.name != "sft":
        return False, (f"unpacked rows: data={cfg.data.name} packed would draw other examples per step "
                       "(set batch.pack=true to pack the stream)")
    if cfg.batch.micro_tokens is not None:
        return False, ("unpacked conversations under batch.micro_tokens, which you set "
                       "(batch.pack=true packs them, whole, into the budget's rows)")
    if "_target_" in cfg.model:
        return False, ("unpacked conversations: a model._target_ model packs only if its forward takes positions= "
                       "and segments= and keeps attention inside each document (set batch.pack=true to try)")
    return True, ("packed conversations (the default for data=sft): each step's conversations packed whole, "
                  "attention and targets per conversation, so the step's sample and loss are those of unpacked "
                  "rows with the fewest padded positions (batch.pack=false: one conversation per row)")


def grad_accum_steps(global_batch_size: int, micro_batch_size: int, world_size: int) -> int:
    """global / (micro x world), or a ConfigError naming the three numbers."""
    per_step = micro_batch_size * world_size
    if global_batch_size % per_step:
        raise ConfigError(
            f"batch.global_size={global_batch_size} must be divisible by batch.micro_size={micro_batch_size} "
            f"x world size {world_size} = {per_step}"
        )
    return global_batch_size // per_step


@dataclass(frozen=True)
class BatchLayout:
    """The layout of a validated batch section on `world_size` ranks."""

    world_size: int
    micro_batch_size: int
    rows_vary: bool
    grad_accum_steps: int | None
    """Microbatches per rank per step; None where rows vary."""

    @classmethod
    def of(cls, batch: BatchConfig, world_size: int) -> BatchLayout:
        """A ConfigError naming the numbers where fixed rows do not divide the global batch."""
        varies = rows_vary(batch)
        accumulation = None if varies else grad_accum_steps(batch.global_size, batch.micro_size, world_size)
        return cls(world_size, batch.micro_size, varies, accumulation)

    @property
    def microbatches_per_step(self) -> int:
        """What a strategy and the memory plan take as accumulation steps: the fixed count, or 1 where
        rows vary (DeepSpeed's bookkeeping only; the Engine sets the boundary per microbatch)."""
        return self.grad_accum_steps or 1
