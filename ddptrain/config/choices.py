"""Every choice of the config, declared once: the allowed values of each enumerated key, and each
strategy's own options. The engine, the strategies, the builder and validation read them from here.

This module imports nothing of ddptrain (nor Hydra): it is the bottom of the import graph, so the
library API (`ddptrain.Engine`) can read it without pulling in the config machinery.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PRECISIONS = ("fp32", "fp64", "bf16", "fp16")
"""trainer.precision: fp32 and fp64 weights and math; bf16 and fp16 autocast over fp32 weights (fp16 with
dynamic loss scaling)."""
PRECISION_DTYPES = {"fp32": "float32", "fp64": "float64", "bf16": "bfloat16", "fp16": "float16"}
"""The torch dtype each trainer.precision computes in, by name (this module imports no torch):
`getattr(torch, PRECISION_DTYPES[precision])`."""
STEP_POLICIES = ("skip", "stop")
"""trainer.empty_step and trainer.nonfinite: skip the update (counted, warned) | stop the run."""
OPTIMIZERS = ("adamw", "sgd")
"""optim.name"""
SCHEDULES = ("cosine", "constant")
"""optim.schedule (after linear warmup)."""
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
"""model=hf: model.attn_implementation."""
ATTENTION_BACKENDS = ("auto", "gather", "varlen", "flex", "mask")
"""trainer.attention: how packed rows keep attention inside each document (ddptrain/models/attention.py).
auto: varlen on CUDA in bf16/fp16, else gather; gather: documents batched by length, causal SDPA (any
device); varlen: FlashAttention varlen (CUDA, bf16/fp16); flex: FlexAttention with a document block mask
(CUDA); mask: the dense (B, 1, T, T) mask, the reference."""
ATTENTION_NEEDS = {
    "varlen": (("cuda",), ("bf16", "fp16"), "torch's varlen attention runs FlashAttention kernels, CUDA only and in half "
               "precision"),
    "flex": (("cuda",), ("fp32", "bf16", "fp16"), "FlexAttention has no backward on CPU in torch 2.13, and no fp64 kernel"),
}
"""trainer.attention: the devices and precisions a backend runs on, and why (the others run anywhere)."""


def attention_refusal(backend: str, device_type: str, precision: str) -> str | None:
    """Why trainer.attention=`backend` cannot run on this device type and trainer.precision; None if it can."""
    if backend not in ATTENTION_NEEDS:
        return None
    devices, precisions, why = ATTENTION_NEEDS[backend]
    if device_type not in devices or precision not in precisions:
        return (f"trainer.attention={backend} needs {' or '.join(devices)} and trainer.precision "
                f"{' | '.join(precisions)} ({why}); this run has {device_type} and {precision}: use "
                "trainer.attention=auto, gather or mask")
    return None
DATA_SOURCES = ("stdlib", "text", "jsonl", "tokens", "hf", "sft", "preference", "mixture", "prompts")
"""data.name"""
MIX_KINDS = ("text", "jsonl", "tokens", "hf", "sft", "preference")
"""data.sources.<source>.name (data=mixture): the kinds a source may be; pairs (preference) mix only with pairs."""
ON_EXHAUSTED = ("error", "renormalize")
"""data.sources.<source>.on_exhausted: past its max_repeat, stop the run naming it | drop it, the others in proportion."""
DATA_ORDERS = ("auto", "bijection", "permutation")
"""data.order: an epoch's order; auto: a seeded bijection for a new run, a resumed run's own (ddptrain/data/order.py)."""
SFT_FORMATS = ("auto", "messages", "prompt_completion")
"""data.format (data=sft): TRL's conversational or prompt-completion records; auto tells them by their fields."""
SFT_TRAIN_ON = ("all_assistant", "last_assistant")
"""data.train_on (data=sft): which assistant turns of a conversation are targets."""
SFT_TRUNCATIONS = ("drop", "right", "error")
"""data.truncation (data=sft): an example longer than batch.seq_len + 1 is dropped (counted), cut at its end, or an error."""
OBJECTIVES = ("token", "dpo", "grpo")
"""objective.name: the mean token loss over valid targets, DPO's mean over preference pairs (data=preference), or
GRPO on rollouts of prompts (data=prompts)."""
SCALE_REWARDS = ("group", "batch", "none")
"""rl.scale_rewards (objective=grpo): divide each advantage by its group's reward std, the batch's, or not at all."""
LOSS_AGGREGATIONS = ("token_mean", "sequence_mean", "constant", "token_sum")
"""rl.loss_aggregation (objective=grpo): DAPO's token mean over the step, GRPO's mean of sequence means, Dr. GRPO's
constant normaliser (completions x rl.max_new_tokens), or the plain token sum."""
BUILTIN_REWARDS = ("exact_match", "format")
"""reward.functions entries without a `module:function` path: ddptrain's own reward functions."""
DPO_LOSS_TYPES = ("sigmoid", "ipo")
"""objective.loss_type (objective=dpo): TRL's formulas of the same names."""
SPLIT_BY = ("file", "paragraph")
"""data.split_by (data=text)."""
DECODE_ERRORS = ("replace", "error")
"""data.on_decode_error"""
TOKEN_DTYPES = ("uint16", "uint32")
"""data.dtype (data=tokens)."""
WANDB_MODES = ("online", "offline", "disabled")
"""logger.wandb.mode"""
PROGRESS_MODES = ("auto", "bar", "lines")
"""logger.progress"""
RESUME_MODES = ("auto", "none")
"""checkpoint.resume, besides a checkpoint path."""


# -- strategies: each one's options (the keys of its `strategy=<name>` section besides `name`) -----------


@dataclass
class StrategyOptions:
    """A strategy's options: the fields of its section, and the rules on their values."""

    def refusal(self) -> str | None:
        """Why these values cannot run (naming the key, the value and the rule); None if they can."""
        return None


@dataclass
class DDPOptions(StrategyOptions):
    bucket_cap_mb: float = 25.0
    """DDP gradient bucket size in MiB (> 0, finite)."""
    find_unused_parameters: bool = False
    """Allow parameters that get no gradient in a step."""

    def refusal(self) -> str | None:
        # DDP takes int(bucket_cap_mb * 2**20): nan fails once the group is up, and <= 0 buckets each tensor alone
        if not 0 < self.bucket_cap_mb < float("inf"):
            return f"strategy.bucket_cap_mb={self.bucket_cap_mb!r} must be a finite number > 0 (MiB per bucket)"
        return None


@dataclass
class ZeROOptions(StrategyOptions):
    deepspeed: dict = field(default_factory=dict)
    """Extra DeepSpeed config keys, merged into the config ddptrain derives and checked against it."""


@dataclass
class FSDPOptions(StrategyOptions):
    reshard_after_forward: bool = True
    """Free gathered weights after each forward (less memory, one more all-gather in backward)."""
    shard_modules: list = field(default_factory=list)
    """Class names to shard as units (default: the model's transformer blocks)."""
    replicate: Any = 1
    """HSDP: replicas R of a 2-D mesh (R x world/R shards, replicated across, sharded within), or auto
    (the number of nodes); 1 shards over the whole world."""

    def refusal(self) -> str | None:
        # Which classes exist is known once the model is built (FSDPStrategy.shard_unit_names); a
        # name's form is known now.
        if not all(isinstance(name, str) and name.strip() for name in self.shard_modules):
            return (f"strategy.shard_modules={self.shard_modules!r} must be a list of module class names, "
                    "e.g. strategy.shard_modules=[Block]")
        return None


@dataclass(frozen=True)
class StrategyChoice:
    """What the config knows of a strategy: where its class is, its options, its precisions."""

    target: str
    """module:Class of its implementation (imported only when the strategy is built)."""
    options: type
    """Its Options dataclass."""
    precisions: tuple[str, ...] = PRECISIONS
    """The trainer.precision values it supports."""


_ZERO_PRECISIONS = ("fp32", "bf16")  # DeepSpeed keeps fp32 master weights; the Engine autocasts bf16

STRATEGIES = {
    "ddp": StrategyChoice("ddptrain.strategies.ddp:DDPStrategy", DDPOptions),
    "zero1": StrategyChoice("ddptrain.strategies.deepspeed:ZeRO1", ZeROOptions, _ZERO_PRECISIONS),
    "zero2": StrategyChoice("ddptrain.strategies.deepspeed:ZeRO2", ZeROOptions, _ZERO_PRECISIONS),
    "zero3": StrategyChoice("ddptrain.strategies.deepspeed:ZeRO3", ZeROOptions, _ZERO_PRECISIONS),
    "fsdp": StrategyChoice("ddptrain.strategies.fsdp:FSDPStrategy", FSDPOptions),
}
"""The strategies by name: the one list of them. Adding one is its file in ddptrain/strategies/,
one line here, and conf/strategy/<name>.yaml."""
STRATEGY_NAMES = tuple(STRATEGIES)
