"""Model FLOPs of a decoder and the peak FLOP/s of a device, for throughput and MFU.

Model FLOPs per token, forward + backward (the PaLM paper's appendix B, nanoGPT's `estimate_mfu`):

    6 * N  -  2 * N_frozen  +  12 * n_layer * n_embd * T

N counts the parameters that take part in a matmul: every parameter except the learned position
embedding (a lookup, no multiply). The token embedding stays in N because it is tied to the LM
head, whose matmul costs 2 * n_embd * vocab per token forward. Each matmul parameter costs 2 FLOPs
forward, 2 for the input's gradient and 2 for its own gradient; a frozen one (N_frozen: LoRA's base
weights) gets no weight gradient, 4 in all. LoRA's adapters are parameters like any other: A and B
(r x in, out x r) cost 6 x their size, which is exactly their two low-rank matmuls, forward and
backward. The attention term counts the QK^T and AV products over the full T x T square (no
discount for the causal mask), as PaLM does. Norms, softmax, GELU and the loss are not counted (a
few percent at most for small models). Under LoRA the first block's input projections read the
frozen embedding, whose output needs no gradient: their input gradient is counted though not
computed (2 x one block's q, k, v per token, under 1% of a model with more than a few blocks).

With the chunked head (trainer.chunked_head) the head's matmul runs on the valid targets only:
(6 * N - 2 * N_frozen) without the head per processed token plus 6 * n_embd * vocab per valid
target (4 for a frozen head), what is computed. Its gradients are taken in its one forward where
it is a plain nn.Linear or a frozen leaf; a head the chunked path checkpoints (LoRA-wrapped, hooked
by FSDP or ZeRO-3) runs its forward twice, 2 * n_embd * vocab more (ddptrain/engine/chunked.py).

The peak: a table of accelerators (`PEAK_FLOPS`), else (logger.peak_flops=auto: a CPU, an unknown
GPU, fp64) measured at start-up by `probe_peak_flops`: a few square matmuls at the run's dtype and
thread count, the fastest one's rate.

MFU = achieved model FLOP/s / (peak FLOP/s per device x devices). It counts the tokens a
microbatch processes, padding included: the hardware computes them. Padding waste shows up
separately as `padding_efficiency` (and positions without a valid target as `valid_target_fraction`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ddptrain.config.choices import PRECISION_DTYPES
from ddptrain.engine.chunked import recomputes_head
from ddptrain.models.kernel_check import fp32_matmuls_in_tf32

log = logging.getLogger(__name__)

# Dense (not 2:4 sparse) peak FLOP/s per device from the vendors' data sheets. "tf32" is the
# tensor-core rate an fp32 matmul gets when torch allows TF32; "fp32" is the plain CUDA-core
# rate. None: the precision has no fast path there (V100 and T4 have no bf16 tensor cores).
# Keys match torch.cuda.get_device_name() case-insensitively; the first match wins, so the more
# specific names come first. An MI250X shows up as two devices (one per GCD): per-GCD numbers.
PEAK_FLOPS: list[tuple[str, dict[str, float | None]]] = [
    ("h100 pcie", {"bf16": 756e12, "tf32": 378e12, "fp32": 51.2e12}),
    ("h100 nvl", {"bf16": 835e12, "tf32": 418e12, "fp32": 60e12}),
    ("gh200", {"bf16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),
    ("h200", {"bf16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),
    ("h100", {"bf16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),  # SXM ("H100 80GB HBM3")
    ("a100", {"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    ("a10g", {"bf16": 70e12, "tf32": 35e12, "fp32": 35e12}),
    ("a10", {"bf16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12}),
    ("l40s", {"bf16": 362e12, "tf32": 183e12, "fp32": 91.6e12}),
    ("l40", {"bf16": 181e12, "tf32": 90.5e12, "fp32": 90.5e12}),
    ("l4", {"bf16": 121e12, "tf32": 60e12, "fp32": 30.3e12}),
    ("rtx 4090", {"bf16": 165.2e12, "tf32": 82.6e12, "fp32": 82.6e12}),
    ("rtx 3090", {"bf16": 71e12, "tf32": 35.6e12, "fp32": 35.6e12}),
    ("v100", {"bf16": None, "tf32": None, "fp32": 15.7e12}),
    ("t4", {"bf16": None, "tf32": None, "fp32": 8.1e12}),
    ("mi300x", {"bf16": 1307.4e12, "tf32": 653.7e12, "fp32": 163.4e12}),
    ("mi325x", {"bf16": 1307.4e12, "tf32": 653.7e12, "fp32": 163.4e12}),
    ("mi250x", {"bf16": 191.5e12, "tf32": None, "fp32": 47.9e12}),
    ("mi250", {"bf16": 181e12, "tf32": None, "fp32": 45.3e12}),
]


def lookup_peak_flops(device_name: str, precision: str) -> float | None:
    """Peak FLOP/s of one device named `device_name` at `precision` (fp32 | tf32 | bf16), or None."""
    name = device_name.lower()
    for key, peaks in PEAK_FLOPS:
        if key in name:
            return peaks.get(precision)
    return None


def device_peak_flops(device: torch.device, precision: str, setting: float | str | None = "auto") -> float | None:
    """The peak FLOP/s that MFU divides by, per logger.peak_flops (`setting`): a number as given;
    null: none (no MFU); auto: the table, else measured by `probe_peak_flops` (a CPU, a GPU the
    table does not know, fp64).

    An fp32 run on a GPU counts the TF32 rate when torch lets matmuls use TF32
    (torch.set_float32_matmul_precision("high") or allow_tf32), the plain fp32 rate otherwise.
    """
    if setting is None:
        return None
    if setting != "auto":
        return float(setting)
    if device.type == "cuda":
        rate = precision
        if precision == "fp32" and fp32_matmuls_in_tf32(device):
            rate = "tf32"
        known = lookup_peak_flops(torch.cuda.get_device_name(device), rate) if rate in ("bf16", "fp32", "tf32") \
            else None
        if known is not None:
            return known
    probe = probe_peak_flops(device, precision)
    log.info("peak FLOP/s measured: %.3g (the fastest of %d %s %dx%d matmuls on %s%s, %.2f s; "
             "logger.peak_flops=<FLOP/s> skips this)", probe.flops_per_second, probe.matmuls, precision,
             PROBE_SIZE, PROBE_SIZE, device.type,
             f", {torch.get_num_threads()} threads" if device.type == "cpu" else "", probe.seconds)
    return probe.flops_per_second


PROBE_SIZE = 512
"""The probe's matmuls are PROBE_SIZE square (2 x 512^3 = 268 MFLOP each): large enough for a BLAS
to reach its full rate on a CPU core, small enough that one takes well under the budget."""
PROBE_BUDGET_S = 0.2
"""The probe stops starting matmuls once this many seconds have passed (it runs at least two)."""
PROBE_MAX_MATMULS = 32
"""And after this many, whatever the time (a fast GPU is done in milliseconds)."""


@dataclass(frozen=True)
class PeakProbe:
    """What `probe_peak_flops` measured."""

    flops_per_second: float
    """The fastest matmul's rate (2 n^3 / its seconds): the device's peak at this dtype and thread count."""
    matmuls: int
    """Matmuls run, the first (warm-up: kernel selection, first touch of memory) included."""
    seconds: float
    """The probe's own time, by `clock`."""


def probe_peak_flops(device: torch.device, precision: str, budget_s: float = PROBE_BUDGET_S,
                     clock: Callable[[], float] = time.perf_counter) -> PeakProbe:
    """The peak matmul FLOP/s of `device` in `precision`, with this process's torch threads: square
    PROBE_SIZE matmuls in the dtype the run's matmuls use (bf16 and fp16: autocast's), one after
    another until `budget_s` has passed (at least two, at most PROBE_MAX_MATMULS); the fastest one's
    rate. A peak, not an average: a shared machine's slow moments do not lower it."""
    dtype = getattr(torch, PRECISION_DTYPES[precision])
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(PROBE_SIZE, PROBE_SIZE, generator=generator).to(device=device, dtype=dtype) for _ in range(2))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fastest, matmuls = float("inf"), 0
    started = clock()
    while matmuls < PROBE_MAX_MATMULS and (matmuls < 2 or clock() - started < budget_s):
        sync()
        begin = clock()
        torch.mm(a, b)
        sync()
        if matmuls:  # the first one warms up
            fastest = min(fastest, clock() - begin)
        matmuls += 1
    return PeakProbe(2.0 * PROBE_SIZE**3 / max(fastest, 1e-12), matmuls, clock() - started)


@dataclass(frozen=True)
class ModelFlops:
    """FLOPs per token of a decoder: 6 * matmul_params - 2 * frozen_params + 12 * n_layer * n_embd * T."""

    matmul_params: int
    n_layer: int
    n_embd: int
    head_params: int = 0
    """The output head's matmul parameters (n_embd x vocab), part of matmul_params."""
    chunked_head: bool = False
    """The head runs on valid targets only, its forward twice where it trains (`per_valid_target`)."""
    frozen_params: int = 0
    """Matmul parameters that get no weight gradient (LoRA's base), part of matmul_params."""
    head_frozen: bool = False
    """The head is frozen (its parameters are in frozen_params)."""
    head_recomputed: bool = False
    """The chunked head's forward runs twice per chunk (checkpointed: `chunked.recomputes_head`)."""

    def per_token(self, seq_len: int) -> float:
        """Forward + backward FLOPs of one token in a sequence of `seq_len` positions (all of the head)."""
        return 6.0 * self.matmul_params - 2.0 * self.frozen_params + 12.0 * self.n_layer * self.n_embd * seq_len

    def _head_per_position(self) -> float:
        """The head's FLOPs per position it runs on, forward + backward: 6 x its size, 4 frozen."""
        return (4.0 if self.head_frozen else 6.0) * self.head_params

    def per_microbatch(self, rows: int, seq_len: int) -> float:
        """What a microbatch's processed positions cost; with the chunked head, without the head."""
        head = self._head_per_position() if self.chunked_head else 0.0
        return rows * seq_len * (self.per_token(seq_len) - head)

    def per_valid_target(self) -> float:
        """The chunked head's FLOPs per valid target: the above, plus its forward's recompute (2 x its size)
        where it is checkpointed (a plain Linear's or a frozen leaf's gradients are taken in its one forward)."""
        if not self.chunked_head:
            return 0.0
        return self._head_per_position() + (2.0 * self.head_params if self.head_recomputed else 0.0)

    @classmethod
    def of_gpt(cls, model: nn.Module, chunked_head: bool = False, one_value_per_row: bool = False) -> "ModelFlops":
        """From a ddptrain GPT: all parameters but the position embedding (tied weights once)."""
        matmul = [p for name, p in model.named_parameters() if name != "pos_emb.weight"]
        return cls(sum(p.numel() for p in matmul), model.cfg.n_layer, model.cfg.n_embd, model.head.weight.numel(),
                   chunked_head, _frozen(matmul), not model.head.weight.requires_grad,
                   chunked_head and recomputes_head(model.head, one_value_per_row))

    @classmethod
    def of_module(cls, model: nn.Module, chunked_head: bool = False,
                  one_value_per_row: bool = False) -> "ModelFlops | None":
        """The built-in GPT, or a transformers decoder (from its config; a peft model's too); None for
        other modules. `chunked_head`: the engine runs the head on valid targets only (Engine.chunked_head);
        `one_value_per_row`: its objective takes each valid target's value (DPO, GRPO, a mixture), not their sum."""
        if hasattr(model, "pos_emb") and hasattr(model, "cfg"):
            return cls.of_gpt(model, chunked_head, one_value_per_row)
        config = getattr(model, "config", None)
        layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
        width = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
        if not (layers and width and hasattr(model, "get_input_embeddings")):
            return None
        embeddings = model.get_input_embeddings().weight
        output = model.get_output_embeddings()
        tied = output is not None and output.weight is embeddings
        position = getattr(getattr(model, "transformer", None), "wpe", None)  # GPT-2's learned positions
        # The input embedding is a lookup, not a matmul; a tied one is counted once, as the head.
        lookups = {id(embeddings)} if not tied else set()
        if position is not None:
            lookups.add(id(position.weight))
        matmul = [p for p in model.parameters() if id(p) not in lookups]
        head_frozen = output is not None and not output.weight.requires_grad
        return cls(sum(p.numel() for p in matmul), int(layers), int(width),
                   output.weight.numel() if output is not None else 0, chunked_head, _frozen(matmul), head_frozen,
                   chunked_head and output is not None and recomputes_head(output, one_value_per_row))


def _frozen(params: list[nn.Parameter]) -> int:
    return sum(p.numel() for p in params if not p.requires_grad)
