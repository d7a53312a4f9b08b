"""The memory and communication plan: what one rank holds, and sends, under each strategy.

For the configured model, layout and world size, per rank and per strategy (ddp, zero1/2/3, fsdp,
HSDP): weights, gradients, optimizer state, the activations of one microbatch, other buffers, the
total, whether it fits the device, and the collectives of one optimizer step. Nothing is allocated:
the model is built from its config on the meta device (no weight file is opened).

- Parameters: counted on the meta-device model (measured: the module's own tensors).
- Activations: one forward and backward of one microbatch on the meta device, with
  `torch.autograd.graph.saved_tensors_hooks` adding up the bytes autograd keeps for backward
  (parameters saved by reference excluded, a tensor saved by several operations once, and the
  T x T probabilities of SDPA's meta decomposition left out where the real kernel is fused), through
  the chunked head when the run uses it. Activation checkpointing (its own hooks replace ours
  inside a checkpointed block, so only the block inputs count), bf16 (the model run in bf16 on
  meta: autocast's saved copies) and LoRA (frozen base: no weight gradients) show in the figure.
  Where the meta run fails, a formula: per layer 34·B·T·d + 5·B·h·T² bytes at 2 bytes per value
  (Korthikanti et al. 2022, "Reducing Activation Recomputation", table 2), scaled to the precision,
  plus the logits (B·T·V, twice: the logits and their log-softmax).
- objective=dpo: a microbatch of k pairs is 2k rows (chosen and rejected; packed, k rows of
  2 x seq_len), measured as such; a full fine-tune keeps a frozen copy of the weights as the
  reference (the `reference` column): whole on every rank, divided by the ranks under fsdp and zero3,
  which partition it like the policy (Footprint.frozen_copy_shards). None under
  LoRA (the reference is the base with the adapter disabled) or with precomputed reference
  log-probs (the copy is dropped once they are computed).
- Weights, gradients, optimizer state, other buffers and the collectives of one optimizer step:
  computed from the counts by each registered strategy's `memory_per_rank`
  (ddptrain/strategies/footprint.py has the units and the ring factors); the plan asks every
  strategy rather than knowing their particulars. With bandwidths, the time.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field, fields

import torch
from torch import nn

from ddptrain.config.choices import PRECISION_DTYPES, STRATEGY_NAMES
from ddptrain.config.schema import TrainConfig
from ddptrain.contract.outputs import HEAD_LOSS, logits_of, takes_head_loss
from ddptrain.engine.chunked import HeadLoss, chunk_rows, held_head_grad_bytes
from ddptrain.models.gpt import GPT
from ddptrain.models.lora import is_adapted
from ddptrain.engine.objective import token_loss_sum
from ddptrain.strategies import strategy_class
from ddptrain.strategies.footprint import BYTES_PER_VALUE, MiB, Footprint, Layout, ParameterCounts

GiB = 2**30
ORDER = ("ddp", "zero1", "hsdp", "fsdp", "zero2", "zero3")
"""The pick among those that fit, without bandwidths: least communication across nodes first."""


@dataclass
class Figure:
    bytes: float
    how: str
    """measured | computed"""


@dataclass
class StrategyPlan(Footprint):
    """A strategy's footprint (computed from the counts) with the microbatch's activations beside it."""

    activations: Figure = field(default_factory=lambda: Figure(0.0, "computed"))
    reference: float = 0.0
    """objective=dpo with full fine-tuning: this rank's part of the frozen reference copy of the weights."""

    @property
    def total(self) -> float:
        return (self.weights + self.gradients + self.optimizer_state + self.activations.bytes + self.other
                + self.reference)

    def wire(self, level: str | None = None) -> float:
        return sum(c.wire for c in self.collectives if level is None or c.level == level)

    def seconds(self, bandwidth: float | None, inter_bandwidth: float | None) -> float | None:
        if not bandwidth:
            return None
        return self.wire("intra") / bandwidth + self.wire("inter") / (inter_bandwidth or bandwidth)


@dataclass
class ModelCounts(ParameterCounts):
    activations: Figure
    activation_note: str = ""
    """Why the activations are computed, where the meta run could not measure them."""
    reference_bytes: float = 0.0
    """objective=dpo, full fine-tuning: the frozen reference's weights, held whole by every rank."""
    objective_note: str = ""
    """What the objective adds to the plan (objective=dpo: rows per pair, the reference)."""


# -- counting on the meta device -------------------------------------------------------------------


def count_model(model: nn.Module, blocks: set[str], micro_batch_size: int, seq_len: int, precision: str,
                vocab_size: int, checkpointed: bool = False, head_chunk_tokens: int | None = None) -> ModelCounts:
    """Parameter counts and one microbatch's activations of a model built on the meta device."""
    parameters = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    units = [sum(p.numel() for p in m.parameters()) for m in model.modules() if type(m).__name__ in blocks]
    largest = max(units, default=parameters)
    note = ""
    try:
        activations = Figure(saved_activation_bytes(model, micro_batch_size, seq_len, precision, vocab_size,
                                                     head_chunk_tokens), "measured")
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as error:
        # an op without a meta kernel, or a data-dependent check (transformers' masks call .item()): the formula
        activations = Figure(formula_activation_bytes(model, micro_batch_size, seq_len, precision, vocab_size,
                                                      checkpointed, head_chunk_tokens), "computed")
        note = f"activations from the formula: the meta forward failed ({str(error).splitlines()[0][:120]})"
    return ModelCounts(parameters, trainable, largest, activations, note)


def saved_activation_bytes(model: nn.Module, micro_batch_size: int, seq_len: int, precision: str,
                           vocab_size: int, head_chunk_tokens: int | None = None) -> int:
    """Bytes autograd saves for backward in one forward of one microbatch (meta tensors), then a
    backward (which must run: a saved tensor it cannot use would show as an error here). With
    `head_chunk_tokens` and a model that follows the head-loss protocol, through the chunked head
    with every target valid (its most: the gathered hidden states)."""
    dtype = getattr(torch, PRECISION_DTYPES[precision])
    run = model if next(model.parameters()).dtype == dtype else model.to(dtype)  # meta: no copy of any data
    saved, seen = [0], {}
    fused = _fused_attention(run)

    def pack(tensor: torch.Tensor):
        base = tensor if tensor._base is None else tensor._base
        # Weights saved by reference (or as a view: W.t()) are not activations; a tensor saved by
        # several operations (a block's input, by each of q, k and v's projections) is held once.
        if isinstance(base, nn.Parameter) or id(base) in seen:
            return tensor
        seen[id(base)] = base  # kept alive to the end, so that no other tensor takes its id
        # The meta device runs SDPA's math decomposition, which keeps the (B, H, T, T) probabilities;
        # the fused kernels a real device runs (flash, memory-efficient) keep O(T) per row instead.
        if not (fused and base.dim() >= 3 and base.shape[-1] == base.shape[-2] == seq_len):
            saved[0] += base.numel() * base.element_size()
        return tensor

    inputs = torch.zeros(micro_batch_size, seq_len, dtype=torch.long, device="meta")
    targets = torch.zeros(micro_batch_size, seq_len, dtype=torch.long, device="meta")
    # transformers: with a cache it does not search the position ids for packed sequences, which reads a
    # value (impossible on meta); the cache itself holds no tensor autograd saves.
    extra = {"use_cache": True} if hasattr(getattr(run, "config", None), "use_cache") else {}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        if head_chunk_tokens and takes_head_loss(run):
            every = torch.arange(micro_batch_size * seq_len, device="meta")
            loss = run(inputs, **extra, **{HEAD_LOSS: HeadLoss(targets, None, head_chunk_tokens, every)})
        else:
            loss = token_loss_sum(logits_of(run(inputs, **extra)), targets)
    if loss.requires_grad:
        loss.backward()
    return saved[0]


def _fused_attention(model: nn.Module) -> bool:
    """Whether the model's attention runs a fused SDPA kernel in training (the built-in GPT, and
    transformers' sdpa, flash or ddptrain's packed attention), not one that keeps the T x T
    probabilities (transformers' eager; a `_target_` model, not known: counted as kept)."""
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if implementation is not None:
        return implementation != "eager"
    return isinstance(model, GPT)


def formula_activation_bytes(model: nn.Module, micro_batch_size: int, seq_len: int, precision: str,
                             vocab_size: int, checkpointed: bool = False, head_chunk_tokens: int | None = None) -> float:
    """Korthikanti et al. 2022: 34·B·T·d + 5·B·h·T² bytes per layer at 2 bytes per value, plus the
    logits (and the weight gradient the chunked head holds from forward to backward); with
    activation checkpointing, each block keeps its input (2·B·T·d) and one block's activations live
    at a time (the paper's full recomputation)."""
    config = getattr(model, "config", None) or getattr(model, "cfg", None)  # transformers' | the built-in GPT's
    width = getattr(config, "n_embd", None) or getattr(config, "hidden_size", 0)
    layers = getattr(config, "n_layer", None) or getattr(config, "num_hidden_layers", 0)
    heads = getattr(config, "n_head", None) or getattr(config, "num_attention_heads", 1)
    scale = BYTES_PER_VALUE.get(precision, 4) / 2 if precision != "bf16" else 1.0
    b, t = micro_batch_size, seq_len
    per_layer = 34 * b * t * width + 5 * b * heads * t * t
    blocks = layers * 2 * b * t * width + per_layer if checkpointed else layers * per_layer
    logit_rows = min(b * t, head_chunk_tokens) if head_chunk_tokens else b * t  # the chunked head: one chunk's
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else getattr(model, "head", None)
    held = held_head_grad_bytes(head) if head_chunk_tokens and head is not None else 0
    return blocks * scale + 2 * logit_rows * vocab_size * BYTES_PER_VALUE.get(precision, 4) + held


# -- the strategies ---------------------------------------------------------------------------------


def plan_strategies(counts: ModelCounts, layout: Layout) -> list[StrategyPlan]:
    """Every registered strategy's plan (each one's `memory_per_rank`) for this model and layout."""
    plans = [StrategyPlan(**{f.name: getattr(rank, f.name) for f in fields(rank)}, activations=counts.activations,
                          reference=counts.reference_bytes / rank.frozen_copy_shards)
             for name in STRATEGY_NAMES for rank in strategy_class(name).memory_per_rank(counts, layout)]
    for plan in plans:
        plan.collectives = [c for c in plan.collectives if c.ranks > 1]  # FSDP skips a one-rank call too
    return plans


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
    reference = counts.reference_bytes > 0  # objective=dpo, full fine-tuning: its own column
    lines = [f"memory plan: {counts.parameters:,} parameters ({counts.trainable:,} train), {layout.precision}, "
             f"{layout.optimizer}, world {layout.world_size} = {layout.nodes} node(s) x {layout.ranks_per_node}, "
             f"micro {layout.micro_batch_size} x seq {layout.seq_len} x accumulation {layout.grad_accum_steps}",
             "per rank; m = measured on the meta device, c = computed from the counts"
             + (f"; device memory {device_memory / GiB:.1f} GiB" if device_memory else ""),
             f"{'strategy':12} {'weights':>10} {'grads':>10} {'optimizer':>10} {'activations':>12} {'other':>10} "
             + (f"{'reference':>10} " if reference else "") + f"{'total':>10} {'fits':>5}"]
    for p in plans:
        fits = "-" if device_memory is None else ("yes" if p.total <= device_memory else "no")
        cells = [f"{_size(value)} c" for value in (p.weights, p.gradients, p.optimizer_state, p.other)]
        lines.append(f"{p.label:12} {cells[0]:>10} {cells[1]:>10} {cells[2]:>10} "
                     f"{_size(p.activations.bytes) + ' ' + p.activations.how[0]:>12} "
                     f"{cells[3]:>10} " + (f"{_size(p.reference) + ' c':>10} " if reference else "")
                     + f"{_size(p.total):>10} {fits:>5}")
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
    if counts.objective_note:
        lines.append(f"  note: {counts.objective_note}")
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


def plan_for_config(cfg: TrainConfig, world_size: int,
                    ranks_per_node: int | None = None) -> tuple[list[StrategyPlan], ModelCounts, Layout]:
    """The plans of a validated config on `world_size` ranks, the model built on the meta device
    (the vocabulary from data.vocab_size or the tokenizer file: no data is read)."""
    from omegaconf import OmegaConf

    from ddptrain.config.layout import BatchLayout, resolved
    from ddptrain.config.validation import strategy_options
    from ddptrain.contract.blocks import block_class_names
    from ddptrain.data.tokenizer import load_tokenizer
    from ddptrain.models.adapters import adapter_for

    cfg = resolved(cfg)  # the layout the run would take
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    adapter = adapter_for(model_cfg)
    tokenizer = cfg.data.tokenizer if cfg.data.tokenizer is not None else adapter.default_tokenizer(model_cfg)
    vocab_size = int(cfg.data.vocab_size or load_tokenizer(tokenizer).vocab_size)
    with meta_device():  # from the config: a weight file is neither read nor hashed (LoRA's base fingerprint)
        model, _ = adapter.build(model_cfg, vocab_size, cfg.batch.seq_len, weights=False)
    if cfg.trainer.activation_checkpointing:
        adapter.enable_activation_checkpointing(model)
    batch = cfg.batch
    # A budget microbatch holds at most micro_tokens padded positions in rows of at most seq_len: planned
    # as whole rows of seq_len that hold them all (rounded up: 48 tokens of rows of 32 may be 3 rows of
    # 16, and the linear layers' activations follow positions; a row's attention is at most seq_len^2).
    # objective=dpo: micro_size counts pairs, two rows each (packed: one row of 2 x seq_len per pair's
    # worth); a budget already counts both sequences' positions.
    pairs = cfg.objective.name == "dpo"
    rows_per_example = 2 if pairs else 1
    micro_rows = (rows_per_example * batch.micro_size if batch.micro_tokens is None
                  else -(-batch.micro_tokens // batch.seq_len))
    options = strategy_options(cfg.strategy)
    ranks_per_node = ranks_per_node or min(world_size, 8)
    replicate = options.get("replicate", "auto")  # fsdp's; the HSDP row of other strategies: one replica per node
    nodes = max(1, world_size // ranks_per_node)
    layout = Layout(world_size=world_size, ranks_per_node=min(ranks_per_node, world_size),
                    replicate=nodes if replicate in ("auto", 1) else int(replicate),
                    micro_batch_size=micro_rows, seq_len=batch.seq_len,
                    grad_accum_steps=BatchLayout.of(batch, world_size).microbatches_per_step,
                    precision=cfg.trainer.precision, optimizer=cfg.optim.name,
                    reshard_after_forward=bool(options.get("reshard_after_forward", True)),
                    deepspeed=dict(options.get("deepspeed", {}) or {}))
    counts = count_model(model, block_class_names(model), micro_rows, batch.seq_len, cfg.trainer.precision,
                         vocab_size, checkpointed=bool(cfg.trainer.activation_checkpointing),
                         head_chunk_tokens=(cfg.trainer.head_chunk_tokens or chunk_rows(vocab_size))
                         if cfg.trainer.chunked_head else None)
    if pairs:
        plan_reference(counts, layout, is_adapted(model), cfg.objective.precompute_reference, batch.micro_size,
                       batch.micro_tokens)
    return plan_strategies(counts, layout), counts, layout


def plan_reference(counts: ModelCounts, layout: Layout, adapted: bool, precomputed: bool, micro_pairs: int,
                   micro_tokens: int | None) -> None:
    """objective=dpo's part of the plan: the frozen reference copy a full fine-tune holds (whole; each
    strategy's plan divides it by the ranks that shard it: Footprint.frozen_copy_shards), and the note
    that says what was counted."""
    held = not adapted and not precomputed
    counts.reference_bytes = counts.parameters * layout.bytes_per_value if held else 0.0
    rows = (f"{layout.micro_batch_size} rows of seq_len hold micro_tokens={micro_tokens} positions of pairs"
            if micro_tokens is not None else
            f"{micro_pairs} pair(s) per microbatch are {layout.micro_batch_size} rows (chosen and rejected)")
    reference = ("the reference is the frozen copy of the weights, sharded as fsdp and zero3 shard the policy, whole on "
                 "every rank otherwise (the reference column)"
                 if held else "the reference's log-probs are precomputed (no copy of the weights is kept)"
                 if precomputed else "the reference is the base with the LoRA adapter disabled (no copy)")
    counts.objective_note = f"objective=dpo: {rows}; {reference}"
