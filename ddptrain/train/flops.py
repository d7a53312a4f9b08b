"""Model FLOPs of the GPT and the peak FLOP/s of known accelerators, for throughput and MFU.

Model FLOPs per token, forward + backward (the PaLM paper's appendix B, nanoGPT's `estimate_mfu`):

    6 * N  +  12 * n_layer * n_embd * T

N counts the parameters that take part in a matmul: every parameter except the learned position
embedding (a lookup, no multiply). The token embedding stays in N because it is tied to the LM
head, whose matmul costs 2 * n_embd * vocab per token forward. The attention term counts the
QK^T and AV products over the full T x T square (no discount for the causal mask), as PaLM does.
Norms, softmax, GELU and the loss are not counted (a few percent at most for small models).

With the chunked head (trainer.chunked_head) the head's matmul runs on the valid targets only, and
twice forward (its logits are recomputed in backward): 6 * (N - head) per processed token plus
8 * n_embd * vocab per valid target, what is computed.

MFU = achieved model FLOP/s / (peak FLOP/s per device x devices). It counts the tokens a
microbatch processes, padding included: the hardware computes them. Padding waste shows up
separately as `padding_efficiency`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ddptrain.models.kernel_check import fp32_matmuls_in_tf32

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


def device_peak_flops(device: torch.device, precision: str, override: float | None = None) -> float | None:
    """The peak FLOP/s that MFU divides by: `override` if given, else the table; None on CPU.

    An fp32 run on a GPU counts the TF32 rate when torch lets matmuls use TF32
    (torch.set_float32_matmul_precision("high") or allow_tf32), the plain fp32 rate otherwise.
    """
    if override is not None:
        return float(override)
    if device.type != "cuda":
        return None
    if precision == "fp32" and fp32_matmuls_in_tf32(device):
        precision = "tf32"
    if precision not in ("bf16", "fp32", "tf32"):
        return None  # fp64: not in the table; set logger.peak_flops
    return lookup_peak_flops(torch.cuda.get_device_name(device), precision)


@dataclass(frozen=True)
class ModelFlops:
    """FLOPs per token of a decoder: 6 * matmul_params + 12 * n_layer * n_embd * T."""

    matmul_params: int
    n_layer: int
    n_embd: int
    head_params: int = 0
    """The output head's matmul parameters (n_embd x vocab), part of matmul_params."""
    chunked_head: bool = False
    """The head runs on valid targets only, its forward twice (`per_valid_target`)."""

    def per_token(self, seq_len: int) -> float:
        """Forward + backward FLOPs of one token in a sequence of `seq_len` positions (all of the head)."""
        return 6.0 * self.matmul_params + 12.0 * self.n_layer * self.n_embd * seq_len

    def per_microbatch(self, rows: int, seq_len: int) -> float:
        """What a microbatch's processed positions cost; with the chunked head, without the head."""
        head = 6.0 * self.head_params if self.chunked_head else 0.0
        return rows * seq_len * (self.per_token(seq_len) - head)

    def per_valid_target(self) -> float:
        """The chunked head's FLOPs per valid target: forward, its recompute and backward (2 + 2 + 4)."""
        return 8.0 * self.head_params if self.chunked_head else 0.0

    @classmethod
    def of_gpt(cls, model: nn.Module, chunked_head: bool = False) -> "ModelFlops":
        """From a ddptrain GPT: all parameters but the position embedding (tied weights once)."""
        matmul_params = model.num_parameters() - model.pos_emb.weight.numel()
        return cls(matmul_params, model.cfg.n_layer, model.cfg.n_embd, model.head.weight.numel(), chunked_head)

    @classmethod
    def of_module(cls, model: nn.Module, chunked_head: bool = False) -> "ModelFlops | None":
        """The built-in GPT, or a transformers decoder (from its config); None for other modules.
        `chunked_head`: the engine runs the head on valid targets only (Engine.chunked_head)."""
        if hasattr(model, "pos_emb") and hasattr(model, "cfg"):
            return cls.of_gpt(model, chunked_head)
        config = getattr(model, "config", None)
        layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
        width = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
        if not (layers and width and hasattr(model, "get_input_embeddings")):
            return None
        embeddings = model.get_input_embeddings().weight
        output = model.get_output_embeddings()
        tied = output is not None and output.weight is embeddings
        # The input embedding is a lookup, not a matmul; a tied one is counted once, as the head.
        params = sum(p.numel() for p in model.parameters()) - (0 if tied else embeddings.numel())
        position = getattr(getattr(model, "transformer", None), "wpe", None)  # GPT-2's learned positions
        if position is not None:
            params -= position.weight.numel()
        return cls(params, int(layers), int(width), output.weight.numel() if output is not None else 0, chunked_head)

