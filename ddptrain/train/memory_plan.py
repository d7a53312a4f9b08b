"""The memory and communication plan: what one rank holds, and sends, under each strategy.

For the configured model, layout and world size, per rank and per strategy (ddp, zero1/2/3, fsdp,
HSDP): weights, gradients, optimizer state, the activations of one microbatch, other buffers, the
total, whether it fits the device, and the collectives of one optimizer step. Nothing real is
allocated: the model is built on the meta device.

- Parameters: counted on the meta-device model (measured: the module's own tensors).
- Activations: one forward and backward of one microbatch on the meta device, with
  `torch.autograd.graph.saved_tensors_hooks` adding up the bytes autograd keeps for backward
  (parameters saved by reference excluded). Activation checkpointing (its own hooks replace ours
  inside a checkpointed block, so only the block inputs count), bf16 (the model run in bf16 on
  meta: autocast's saved copies) and LoRA (frozen base: no weight gradients) show in the figure.
  Where the meta run fails, a formula: per layer 34·B·T·d + 5·B·h·T² bytes at 2 bytes per value
  (Korthikanti et al. 2022, "Reducing Activation Recomputation", table 2), scaled to the precision,
  plus the logits (B·T·V, twice: the logits and their log-softmax).
- Weights, gradients, optimizer state: computed from the counts (bytes per value from
  trainer.precision; AdamW keeps two moments, SGD none), each strategy's sharding, and these
  particulars: FSDP/HSDP keep unsharded gradients while microbatches accumulate (no sync); ZeRO
  keeps an fp32 copy of its partition (DeepSpeed's `single_partition_of_fp32_groups`), its
  reduce buckets, and FSDP one gathered unit (and the next, prefetched) - under "other".
- Communication per optimizer step: each collective's payload (the full tensor: an all-gather's
  output, a reduce-scatter's input), how often (FSDP gathers every microbatch), and the bytes on
  the wire per rank from the standard ring factors: all-reduce 2(n-1)/n x payload, all-gather and
  reduce-scatter (n-1)/n x payload (n: the ranks of the collective). HSDP's intra-node (shard) and
  inter-node (replicate) parts are apart; with bandwidths, the time.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ddptrain.config.choices import PRECISION_DTYPES
from ddptrain.engine.objective import token_loss_sum
from ddptrain.contract.outputs import logits_of

GiB = 2**30
MiB = 2**20
BYTES_PER_VALUE = {"fp64": 8, "fp32": 4, "bf16": 4, "fp16": 4}
"""Weights (and their gradients and optimizer state) per value: fp64 runs in fp64; the others keep
fp32 weights and autocast."""
DEEPSPEED_BUCKETS = {"reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8, "stage3_prefetch_bucket_size": 5e7}
"""DeepSpeed's defaults (elements), unless strategy.deepspeed sets them."""
ORDER = ("ddp", "zero1", "hsdp", "fsdp", "zero2", "zero3")
"""The pick among those that fit, without bandwidths: least communication across nodes first."""


@dataclass
class Figure:
    bytes: float
    how: str
    """measured | computed"""


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
class StrategyPlan:
    name: str
    label: str
    weights: Figure
    gradients: Figure
    optimizer_state: Figure
    activations: Figure
    other: Figure
    collectives: list[Collective] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        return sum(f.bytes for f in (self.weights, self.gradients, self.optimizer_state, self.activations, self.other))

    def wire(self, level: str | None = None) -> float:
        return sum(c.wire for c in self.collectives if level is None or c.level == level)

    def seconds(self, bandwidth: float | None, inter_bandwidth: float | None) -> float | None:
        if not bandwidth:
            return None
        return self.wire("intra") / bandwidth + self.wire("inter") / (inter_bandwidth or bandwidth)


@dataclass
class ModelCounts:
    parameters: int
    trainable: int
    largest_unit: int
    """Parameters of the largest shard unit (a transformer block), for FSDP's gathered buffers."""
    activations: Figure
    activation_note: str = ""
    """Why the activations are computed, where the meta run could not measure them."""


@dataclass
class Layout:
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


# -- counting on the meta device -------------------------------------------------------------------


def count_model(model: nn.Module, blocks: set[str], micro_batch_size: int, seq_len: int, precision: str,
                vocab_size: int, checkpointed: bool = False) -> ModelCounts:
    """Parameter counts and one microbatch's activations of a model built on the meta device."""
    parameters = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    units = [sum(p.numel() for p in m.parameters()) for m in model.modules() if type(m).__name__ in blocks]
    largest = max(units, default=parameters)
    note = ""
    try:
        activations = Figure(saved_activation_bytes(model, micro_batch_size, seq_len, precision, vocab_size),
                             "measured")
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as error:
        # an op without a meta kernel, or a data-dependent check (transformers' masks call .item()): the formula
        activations = Figure(formula_activation_bytes(model, micro_batch_size, seq_len, precision, vocab_size,
                                                      checkpointed), "computed")
        note = f"activations from the formula: the meta forward failed ({str(error).splitlines()[0][:120]})"
    return ModelCounts(parameters, trainable, largest, activations, note)


def saved_activation_bytes(model: nn.Module, micro_batch_size: int, seq_len: int, precision: str,
                           vocab_size: int) -> int:
    """Bytes autograd saves for backward in one forward of one microbatch (meta tensors), then a
    backward (which must run: a saved tensor it cannot use would show as an error here)."""
    dtype = getattr(torch, PRECISION_DTYPES[precision])
    run = model if next(model.parameters()).dtype == dtype else model.to(dtype)  # meta: no copy of any data
    saved = [0]

    def pack(tensor: torch.Tensor):  # weights saved by reference (or as a view: W.t()) are not activations
        if not isinstance(tensor if tensor._base is None else tensor._base, nn.Parameter):
            saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    inputs = torch.zeros(micro_batch_size, seq_len, dtype=torch.long, device="meta")
    targets = torch.zeros(micro_batch_size, seq_len, dtype=torch.long, device="meta")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = token_loss_sum(logits_of(run(inputs)), targets)
    if loss.requires_grad:
        loss.backward()
    return saved[0]


def formula_activation_bytes(model: nn.Module, micro_batch_size: int, seq_len: int, precision: str,
                             vocab_size: int, checkpointed: bool = False) -> float:
    """Korthikanti et al. 2022: 34·B·T·d + 5·B·h·T² bytes per layer at 2 bytes per value, plus the
    logits; with activation checkpointing, each block keeps its input (2·B·T·d) and one block's
    activations live at a time (the paper's full recomputation)."""
    config = getattr(model, "config", None) or getattr(model, "cfg", None)  # transformers' | the built-in GPT's
    width = getattr(config, "n_embd", None) or getattr(config, "hidden_size", 0)
    layers = getattr(config, "n_layer", None) or getattr(config, "num_hidden_layers", 0)
    heads = getattr(config, "n_head", None) or getattr(config, "num_attention_heads", 1)
    scale = BYTES_PER_VALUE.get(precision, 4) / 2 if precision != "bf16" else 1.0
    b, t = micro_batch_size, seq_len
    per_layer = 34 * b * t * width + 5 * b * heads * t * t
    blocks = layers * 2 * b * t * width + per_layer if checkpointed else layers * per_layer
    return blocks * scale + 2 * b * t * vocab_size * BYTES_PER_VALUE.get(precision, 4)


# -- the strategies ---------------------------------------------------------------------------------


def plan_strategies(counts: ModelCounts, layout: Layout) -> list[StrategyPlan]:
    """Every strategy's plan for this model and layout."""
    plans = [_plan(name, counts, layout) for name in ("ddp", "zero1", "zero2", "zero3", "fsdp", "hsdp")]
    for plan in plans:  # a collective over one rank is no call at all (FSDP skips it too)
        plan.collectives = [c for c in plan.collectives if c.ranks > 1]
    return plans


def computed(value: float) -> Figure:
    return Figure(value, "computed")


def _plan(name: str, counts: ModelCounts, layout: Layout) -> StrategyPlan:
    n, b = layout.world_size, BYTES_PER_VALUE[layout.precision]
    accumulation = layout.grad_accum_steps
    all_params, trained = counts.parameters * b, counts.trainable * b
    moments = 2 * trained if layout.optimizer == "adamw" else 0
    shards = n // layout.replicate if name == "hsdp" else n
    gathered_level = "intra" if name == "hsdp" or layout.nodes == 1 else "inter"
    world_level = "intra" if layout.nodes == 1 else "inter"
    acts = counts.activations
    label = name if name != "hsdp" else f"hsdp {layout.replicate}x{shards}"
    notes: list[str] = []
    if name == "ddp":
        return StrategyPlan(name, label, computed(all_params), computed(trained), computed(moments), acts, computed(0),
                            [Collective("gradient all-reduce", "all_reduce", trained, 1, n, world_level)])
    if name.startswith("zero"):
        stage = int(name[-1])
        buckets = {**DEEPSPEED_BUCKETS, **{k: v for k, v in layout.deepspeed.get("zero_optimization", {}).items()
                                          if k in DEEPSPEED_BUCKETS}}
        reduce_bucket = min(buckets["reduce_bucket_size"], counts.trainable) * b
        master = trained / n  # DeepSpeed's fp32 copy of this rank's partition
        weights = all_params / n if stage == 3 else all_params
        grads = trained if stage == 1 else trained / n
        other = master + (reduce_bucket if stage >= 2 else 0)
        notes.append(f"{name}: other = fp32 partition copy {master / MiB:.1f} MiB"
                     + (f" + reduce bucket {buckets['reduce_bucket_size']:.0e} elements" if stage >= 2 else "")
                     + f"; DeepSpeed buckets: reduce {buckets['reduce_bucket_size']:.0e}, allgather "
                       f"{buckets['allgather_bucket_size']:.0e}"
                     + (f", stage3 prefetch {buckets['stage3_prefetch_bucket_size']:.0e}" if stage == 3 else "")
                     + " elements")
        if stage == 1:
            comms = [Collective("gradient reduce-scatter", "reduce_scatter", trained, 1, n, world_level),
                     Collective("parameter all-gather after the update", "all_gather", trained, 1, n, world_level)]
        elif stage == 2:
            comms = [Collective("gradient reduce-scatter (every microbatch)", "reduce_scatter", trained,
                                accumulation, n, world_level),
                     Collective("parameter all-gather after the update", "all_gather", trained, 1, n, world_level)]
        else:
            comms = [Collective("parameter all-gather, forward", "all_gather", all_params, accumulation, n,
                                world_level),
                     Collective("parameter all-gather, backward", "all_gather", all_params, accumulation, n,
                                world_level),
                     Collective("gradient reduce-scatter (every microbatch)", "reduce_scatter", trained,
                                accumulation, n, world_level)]
        return StrategyPlan(name, label, computed(weights), computed(grads), computed(moments / n), acts,
                            computed(other), comms, notes)
    # fsdp and hsdp: shard over `shards` ranks; HSDP all-reduces each shard across the replicas
    grads = trained if accumulation > 1 else trained / shards
    if accumulation > 1:
        notes.append(f"{label}: gradients stay unsharded while {accumulation} microbatches accumulate (no sync)")
    gather_b = 2 if layout.precision == "bf16" else b  # MixedPrecisionPolicy(param_dtype=bf16) gathers bf16
    gathered = min(2 * counts.largest_unit, counts.parameters) * gather_b  # one unit + the prefetched
    # fully_shard(model, reshard_after_forward=True) reshards the root unit too (counted on gloo ranks:
    # the backward gathers every parameter again)
    backward_gather = counts.parameters * gather_b if layout.reshard_after_forward else 0
    comms = [Collective("parameter all-gather, forward (every microbatch)", "all_gather",
                        counts.parameters * gather_b, accumulation, shards, gathered_level)]
    if backward_gather:
        comms.append(Collective("parameter all-gather, backward (every microbatch)",
                                "all_gather", backward_gather, accumulation, shards, gathered_level))
    comms.append(Collective("gradient reduce-scatter", "reduce_scatter", trained, 1, shards, gathered_level))
    if name == "hsdp" and layout.replicate > 1:
        comms.append(Collective("gradient all-reduce of the shards across replicas", "all_reduce", trained / shards,
                                1, layout.replicate, "inter" if layout.nodes > 1 else "intra"))
    return StrategyPlan(name, label, computed(all_params / shards), computed(grads), computed(moments / shards), acts,
                        computed(gathered), comms, notes)


def pick(plans: list[StrategyPlan], device_memory: float | None, bandwidth: float | None = None,
         inter_bandwidth: float | None = None) -> StrategyPlan | None:
    """The strategy to use: among those that fit, the fastest communication with bandwidths, else
    the first of ORDER (least traffic across nodes); None when none fits."""
    fitting = [p for p in plans if device_memory is None or p.total <= device_memory]
    if not fitting:
        return None
    if bandwidth:
        return min(fitting, key=lambda p: (p.seconds(bandwidth, inter_bandwidth), ORDER.index(p.name)))
    return min(fitting, key=lambda p: ORDER.index(p.name))


# -- the table --------------------------------------------------------------------------------------


def _size(value: float) -> str:
    return f"{value / GiB:8.2f}G" if value >= GiB else f"{value / MiB:8.1f}M"


def format_plan(plans: list[StrategyPlan], counts: ModelCounts, layout: Layout, device_memory: float | None,
                bandwidth: float | None = None, inter_bandwidth: float | None = None, details: bool = True) -> str:
    """The plan as the table `python -m ddptrain.plan` prints; without `details` (the start-up
    summary), one wire line per strategy and no per-collective lines or notes."""
    chosen = pick(plans, device_memory, bandwidth, inter_bandwidth)
    lines = [f"memory plan: {counts.parameters:,} parameters ({counts.trainable:,} train), {layout.precision}, "
             f"{layout.optimizer}, world {layout.world_size} = {layout.nodes} node(s) x {layout.ranks_per_node}, "
             f"micro {layout.micro_batch_size} x seq {layout.seq_len} x accumulation {layout.grad_accum_steps}",
             "per rank; m = measured on the meta device, c = computed from the counts"
             + (f"; device memory {device_memory / GiB:.1f} GiB" if device_memory else ""),
             f"{'strategy':12} {'weights':>10} {'grads':>10} {'optimizer':>10} {'activations':>12} {'other':>10} "
             f"{'total':>10} {'fits':>5}"]
    for p in plans:
        fits = "-" if device_memory is None else ("yes" if p.total <= device_memory else "no")
        cells = [f"{_size(f.bytes)} {f.how[0]}" for f in (p.weights, p.gradients, p.optimizer_state)]
        lines.append(f"{p.label:12} {cells[0]:>10} {cells[1]:>10} {cells[2]:>10} "
                     f"{_size(p.activations.bytes) + ' ' + p.activations.how[0]:>12} "
                     f"{_size(p.other.bytes) + ' ' + p.other.how[0]:>10} {_size(p.total):>10} {fits:>5}")
    lines.append("communication per optimizer step, per rank (payload = full tensor per call; wire = payload x "
                 "calls x ring factor: all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n)")
    for p in plans:
        time = p.seconds(bandwidth, inter_bandwidth)
        lines.append(f"  {p.label}: wire {_size(p.wire()).strip()} (intra-node {_size(p.wire('intra')).strip()}, "
                     f"inter-node {_size(p.wire('inter')).strip()})" + (f", {time * 1e3:.1f} ms" if time else ""))
        for c in p.collectives if details else ():
            lines.append(f"    {c.what}: payload {_size(c.payload).strip()} x {c.calls}, {c.ranks} ranks {c.level}, "
                         f"factor {c.ring_factor:.3f} -> {_size(c.wire).strip()}")
    for p in plans if details else ():
        lines.extend(f"  note: {note}" for note in p.notes)
    if counts.activation_note:
        lines.append(f"  note: {counts.activation_note}")
    if device_memory is not None or bandwidth:
        lines.append(f"pick: {chosen.label}" if chosen else "pick: none fits; try activation checkpointing, "
                     "a smaller batch.micro_size, or more ranks")
    return "\n".join(lines)


@contextlib.contextmanager
def meta_device():
    """Build modules on the meta device: shapes and dtypes, no memory."""
    with torch.device("meta"):
        yield


def parse_bytes(text: str) -> float:
    """'80GiB', '80GB', '512MiB', '1.5e9' -> bytes; '50GB/s' -> bytes per second."""
    value = text.strip().removesuffix("/s")
    units = {"TIB": 2**40, "GIB": GiB, "MIB": MiB, "KIB": 2**10, "TB": 1e12, "GB": 1e9, "MB": 1e6, "KB": 1e3, "B": 1}
    for unit, scale in units.items():
        if value.upper().endswith(unit):
            return float(value[: -len(unit)]) * scale
    number = float(value)
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"{text!r} is not a size like 80GiB or a bandwidth like 50GB/s")
    return number


# -- from a config ----------------------------------------------------------------------------------


def plan_for_config(cfg, world_size: int, ranks_per_node: int | None = None) -> tuple[list[StrategyPlan], ModelCounts,
                                                                                   Layout]:
    """The plans of a validated config on `world_size` ranks, the model built on the meta device
    (the vocabulary from data.vocab_size or the tokenizer file: no data is read)."""
    from omegaconf import OmegaConf

    from ddptrain.config.validation import grad_accum_steps, strategy_options
    from ddptrain.data.tokenizer import load_tokenizer
    from ddptrain.models.adapters import adapter_for
    from ddptrain.contract.blocks import block_class_names

    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    adapter = adapter_for(model_cfg)
    tokenizer = cfg.data.tokenizer if cfg.data.tokenizer is not None else adapter.default_tokenizer(model_cfg)
    vocab_size = int(cfg.data.vocab_size or load_tokenizer(tokenizer).vocab_size)
    with meta_device():
        model, _ = adapter.build(model_cfg, vocab_size, cfg.batch.seq_len)
    if cfg.trainer.activation_checkpointing:
        adapter.enable_activation_checkpointing(model)
    batch = cfg.batch
    fixed = batch.micro_tokens is None and not batch.pack
    # A budget microbatch holds at most micro_tokens padded positions in rows of at most seq_len: planned
    # as whole rows of seq_len that hold them all (rounded up: 48 tokens of rows of 32 may be 3 rows of
    # 16, and the linear layers' activations follow positions; a row's attention is at most seq_len^2).
    micro_rows = batch.micro_size if batch.micro_tokens is None else -(-batch.micro_tokens // batch.seq_len)
    options = strategy_options(cfg.strategy)
    ranks_per_node = ranks_per_node or min(world_size, 8)
    replicate = options.get("replicate", "auto")  # fsdp's; the HSDP row of other strategies: one replica per node
    nodes = max(1, world_size // ranks_per_node)
    layout = Layout(world_size=world_size, ranks_per_node=min(ranks_per_node, world_size),
                    replicate=nodes if replicate in ("auto", 1) else int(replicate),
                    micro_batch_size=micro_rows, seq_len=batch.seq_len,
                    grad_accum_steps=grad_accum_steps(batch.global_size, batch.micro_size, world_size) if fixed else 1,
                    precision=cfg.trainer.precision, optimizer=cfg.optim.name,
                    reshard_after_forward=bool(options.get("reshard_after_forward", True)),
                    deepspeed=dict(options.get("deepspeed", {}) or {}))
    counts = count_model(model, block_class_names(model), micro_rows, batch.seq_len, cfg.trainer.precision,
                         vocab_size, checkpointed=bool(cfg.trainer.activation_checkpointing))
    return plan_strategies(counts, layout), counts, layout
