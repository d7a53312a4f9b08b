"""The step's layout: how the global batch of one optimizer step splits over ranks and microbatches.

Decided once, from the batch section and the world size, and read by validation, the builder, the
start-up summary and the memory plan. Either every rank runs the same number of microbatches of
`batch.micro_size` rows (global = micro x accumulation x world, which must divide), or rows vary:
a token budget (batch.micro_tokens) or packing (batch.pack) makes the number of microbatches, and
of rows in them, differ by step and rank, and no accumulation count is fixed.

`batch.pack=null` is decided here (`default_packing`): conversations (data=sft) and preference pairs
(data=preference) are packed, whole, per step, which keeps the step's sample and computes the fewest
positions; everything else stays unpacked, since packing a text stream changes which examples a step
draws. `batch.micro_size=null` is decided after it (`default_micro_size`): rows packed whole per step
vary in width, so one row per microbatch keeps each at its own width (no row padded to a wider one:
less memory and compute); everything else takes DEFAULT_MICRO_SIZE rows. `resolve_layout` decides both
once, before anything reads them; a run's config records the values it decided.
"""

from __future__ import annotations

import copy

from dataclasses import dataclass

from typing import Any

from ddptrain.config.schema import BatchConfig, ConfigError


def rows_vary(batch: BatchConfig) -> bool:
    """Whether the microbatches per step (and the rows in them) vary by step and rank."""
    return batch.micro_tokens is not None or bool(batch.pack)


DEFAULT_MICRO_SIZE = 8
"""Rows per microbatch where batch.micro_size is null and rows are not packed whole per step."""

PACKED_WHOLE = {"sft": "conversations", "preference": "pairs"}
"""The data whose steps pack their own examples whole (ddptrain/data/packing.py, data/preference.py):
packed or not, a step draws the same sample."""


def default_packing(cfg: Any) -> tuple[bool, str]:
    """What `batch.pack=null` means for this run, and why, in words for the start-up line."""
    if cfg.data.name == "prompts":
        return False, "unpacked rollouts, one completion per row (batch.pack=true packs each step's completions)"
    if cfg.data.name not in PACKED_WHOLE:
        return False, (f"unpacked rows: data={cfg.data.name} packed would draw other examples per step "
                       "(set batch.pack=true to pack the stream)")
    what = PACKED_WHOLE[cfg.data.name]
    if cfg.batch.micro_tokens is not None:
        return False, (f"unpacked {what} under batch.micro_tokens, which you set "
                       "(batch.pack=true packs them, whole, into the budget's rows)")
    if "_target_" in cfg.model:
        return False, (f"unpacked {what}: a model._target_ model packs only if its forward takes positions= "
                       "and segments= and keeps attention inside each document (set batch.pack=true to try)")
    if what == "pairs":
        return True, ("packed pairs (the default for data=preference): each step's pairs packed whole, chosen and "
                      "rejected as two documents of a row, so the step's sample and loss are those of unpacked "
                      "pairs with the fewest padded positions (batch.pack=false: two rows per pair)")
    return True, ("packed conversations (the default for data=sft): each step's conversations packed whole, "
                  "attention and targets per conversation, so the step's sample and loss are those of unpacked "
                  "rows with the fewest padded positions (batch.pack=false: one conversation per row)")


def default_micro_size(cfg: Any) -> tuple[int, str]:
    """What `batch.micro_size=null` means for this run (batch.pack decided), and why, for the start-up line."""
    if cfg.batch.pack and cfg.data.name in PACKED_WHOLE and cfg.batch.micro_tokens is None:
        return 1, ("one packed row per microbatch (batch.micro_size=null where rows are packed whole: each row "
                   "keeps its own width; batch.micro_size=N pads N rows to the widest of them)")
    unit = {"preference": "pairs", "prompts": "prompts, each with its group,"}.get(cfg.data.name, "rows")
    return DEFAULT_MICRO_SIZE, f"{DEFAULT_MICRO_SIZE} {unit} per microbatch (batch.micro_size=null)"


def resolve_layout(cfg: Any) -> str | None:
    """batch.pack=null, then batch.micro_size=null, become this run's defaults; returns why, for the
    start-up line, where it decided (None where both were set). Decided once, before anything reads
    them (and before the config diff on resume: checkpoints hold the resolved config)."""
    reasons = []
    if cfg.batch.pack is None:
        cfg.batch.pack, reason = default_packing(cfg)
        reasons.append(reason)
    if cfg.batch.micro_size is None:
        cfg.batch.micro_size, reason = default_micro_size(cfg)
        reasons.append(reason)
    return "; ".join(reasons) or None


def resolved(cfg: Any) -> Any:
    """`cfg` where its layout is decided, else a copy with it decided: for readers (validation, the memory
    plan) that may be handed a config before the run resolves it."""
    if cfg.batch.pack is not None and cfg.batch.micro_size is not None:
        return cfg
    cfg = copy.deepcopy(cfg)
    resolve_layout(cfg)
    return cfg


def eval_micro_tokens(batch: BatchConfig, pairs: bool = False) -> int | None:
    """The padded positions an evaluation microbatch (unpacked rows) may hold: batch.micro_tokens, else under
    packing what a training microbatch of micro_size packed rows holds at most (seq_len positions a row, a
    pair's 2 x seq_len), so that one packed row per microbatch does not evaluate one example per forward;
    else None: micro_size rows."""
    if batch.micro_tokens is not None or not batch.pack:
        return batch.micro_tokens
    return batch.micro_size * batch.seq_len * (2 if pairs else 1)


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
