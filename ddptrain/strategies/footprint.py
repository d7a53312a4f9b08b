"""What one rank holds and sends under a strategy: the vocabulary of `Strategy.memory_per_rank`.

The memory plan (ddptrain/train/memory_plan.py) gives every registered strategy the model's
parameter counts and a `Layout` (world, nodes, accumulation, precision, optimizer) and gets back
one `Footprint` per way the strategy runs: bytes of weights, gradients, optimizer state and other
buffers per rank, and the collectives of one optimizer step. Nothing is built and no process group
exists: the figures are computed from the counts.

Bytes on the wire follow the standard ring factors: all-reduce 2(n-1)/n x payload, all-gather and
reduce-scatter (n-1)/n x payload, n the ranks of the collective.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MiB = 2**20
BYTES_PER_VALUE = {"fp64": 8, "fp32": 4, "bf16": 4, "fp16": 4}
"""Weights (and their gradients and optimizer state) per value: fp64 runs in fp64; the others keep
fp32 weights and autocast."""


@dataclass
class ParameterCounts:
    parameters: int
    trainable: int
    largest_unit: int
    """Parameters of the largest shard unit (a transformer block), for FSDP's gathered buffers."""


@dataclass
class Layout:
    """The world and the step a plan is made for."""

    world_size: int
    ranks_per_node: int
    replicate: int
    """HSDP's replicas (nodes, or strategy.replicate)."""
    micro_batch_size: int
    seq_len: int
    grad_accum_steps: int
    precision: str
    optimizer: str
    reshard_after_forward: bool = True
    deepspeed: dict = field(default_factory=dict)

    @property
    def nodes(self) -> int:
        return max(1, self.world_size // self.ranks_per_node)

    @property
    def world_level(self) -> str:
        """Where a collective over every rank runs: intra (one node) | inter (across nodes)."""
        return "intra" if self.nodes == 1 else "inter"

    @property
    def bytes_per_value(self) -> int:
        return BYTES_PER_VALUE[self.precision]

    def optimizer_state_bytes(self, trained: float) -> float:
        """The optimizer's state for `trained` bytes of parameters: AdamW keeps two moments, SGD none."""
        return 2 * trained if self.optimizer == "adamw" else 0


@dataclass
class Collective:
    what: str
    """e.g. "gradient all-reduce"."""
    kind: str
    """all_reduce | reduce_scatter | all_gather"""
    payload: float
    """Bytes of the full tensor of one call."""
    calls: int
    """Per optimizer step."""
    ranks: int
    """The ranks of the collective."""
    level: str
    """intra (inside a node) | inter (across nodes)"""

    @property
    def ring_factor(self) -> float:
        n = self.ranks
        return 2 * (n - 1) / n if self.kind == "all_reduce" else (n - 1) / n

    @property
    def wire(self) -> float:
        """Bytes this rank sends per step (ring algorithm)."""
        return self.payload * self.calls * self.ring_factor


@dataclass
class Footprint:
    """Per rank, in bytes, under one strategy (one row of the plan)."""

    name: str
    """The plan's name of the row: the strategy's, or a way it runs (fsdp's hsdp)."""
    label: str
    weights: float
    gradients: float
    optimizer_state: float
    other: float
    """Buffers of the strategy's own: ZeRO's fp32 partition and buckets, FSDP's gathered units."""
    collectives: list[Collective] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    frozen_copy_shards: int = 1
    """Ranks a frozen copy of the weights (DPO's reference: Strategy.hold_frozen) is split over."""
