"""The start-up check of packed rows' attention kernel on the run's own device.

The test suite proves every backend equal to the dense mask on CPU, but the kernels that matter
most run on CUDA only (FlashAttention varlen, FlexAttention compiled for the GPU at hand, SDPA's
kernels under the gather), and a wrong one would change every update without a sign. So before the
first step the chosen backend runs once on this device, in the run's precision, with the model's
heads, softmax scale and the memory layout its q, k and v arrive in (`HeadLayout`: a kernel may
read strided views wrongly and contiguous tensors right), on two packed rows of ragged documents;
its output and the gradients of q, k and v are compared with the dense mask computed in fp64 from
the same inputs. A backend beyond the bound is refused when forced and replaced when `auto` chose
it (ddptrain/train/builder.py `use_packed_attention`).

The bounds (fp32 1e-4, bf16/fp16 5e-2, relative to the reference's largest entry; TF32's 5e-3 for
fp32 where CUDA matmuls run in TF32) hold the precision's rounding and are far below what a wrong
mask or kernel gives. Why these bounds, and what the check found: docs/architecture.md.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch

from ddptrain.config.choices import PRECISION_DTYPES
from ddptrain.contract.boundaries import DocumentBoundaries
from ddptrain.models import attention

CHECKED_BACKENDS = ("gather", "varlen", "flex")
BOUNDS = {"fp64": 1e-9, "fp32": 1e-4, "tf32": 5e-3, "bf16": 5e-2, "fp16": 5e-2}
"""Largest difference from the fp64 reference, relative to its largest entry, per precision computed in
(tf32: trainer.precision=fp32 where fp32 matmuls run in TF32)."""
CHECK_WIDTH = 320
"""Tokens per row of the check (fewer when batch.seq_len is shorter): 2.5 flex blocks of 128."""
ROW_LENGTHS = ((3, 1, 40, 150, 17, 64, 9, 30, 2, 11), (60, 5, 90, 2, 33, 1, 140))
"""Document lengths of the check's two rows, cut at the row's width; the second row ends in padding."""
PADDING = 7


@dataclass(frozen=True)
class TokenMajor:
    """Where one of q, k, v (B, h, T, d) lies in memory as a model's projection leaves it: a view of
    a token-major buffer of `token_width` elements per token, its heads `head_stride` apart from
    `offset` on. A projection of its own viewed per head (Llama): h x d wide, heads d apart; one
    fused projection split three ways (GPT-2, the GPT): wider, each of q, k, v at its own offset;
    heads interleaved with their q, k and v (GPT-NeoX): heads 3d apart."""

    token_width: int
    head_stride: int
    offset: int = 0

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "TokenMajor | None":
        """The layout of `tensor` (B, h, T, d); None where it is not such a view (contiguous, for one)."""
        batch, heads, seq, dim = tensor.shape
        batch_stride, head_stride, token_width, dim_stride = tensor.stride()
        offset = tensor.storage_offset() % token_width if token_width else 0
        if (dim_stride != 1 or (heads > 1 and head_stride < dim)
                or offset + (heads - 1) * head_stride + dim > token_width
                or (batch > 1 and batch_stride != seq * token_width)):
            return None
        return cls(token_width, head_stride, offset)

    def lay_out(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor`'s values (B, h, T, d) in this layout: a view of a new buffer."""
        batch, _, seq, _ = tensor.shape
        buffer = tensor.new_zeros(batch * seq * self.token_width)
        view = buffer.as_strided(tensor.shape, (seq * self.token_width, self.head_stride, self.token_width, 1),
                                 self.offset)
        return view.copy_(tensor)

    def __str__(self) -> str:
        return f"{self.token_width} per token" + (f" from {self.offset}" if self.offset else "")


def separate_projections(heads: int, kv_heads: int, head_dim: int) -> tuple[TokenMajor, TokenMajor, TokenMajor]:
    """q, k and v each a (B, T, h x d) projection of its own, viewed per head and transposed (most models)."""
    return (TokenMajor(heads * head_dim, head_dim), *[TokenMajor(kv_heads * head_dim, head_dim)] * 2)


@dataclass(frozen=True)
class HeadLayout:
    """The attention heads a model's layers call the kernel with."""

    heads: int
    kv_heads: int
    """Fewer than `heads`: grouped-query attention."""
    head_dim: int
    windows: tuple[int | None, ...] = (None,)
    """The sliding windows its layers use; None: full causal attention."""
    memory: tuple[TokenMajor | None, TokenMajor | None, TokenMajor | None] | None = None
    """How q, k and v lie in memory when they reach the kernel (None for one of them: contiguous);
    None: as `separate_projections` lays them out."""
    scale: float | None = None
    """The softmax scale the model passes (None: the kernel's default, 1/sqrt(head_dim))."""

    def qkv_memory(self) -> tuple[TokenMajor | None, TokenMajor | None, TokenMajor | None]:
        return self.memory or separate_projections(self.heads, self.kv_heads, self.head_dim)

    def __str__(self) -> str:
        memory = ", ".join(f"{name}: {'contiguous' if m is None else m}" for name, m in zip("qkv", self.qkv_memory()))
        scale = "" if self.scale is None else f", scale {self.scale:g}"
        return f"{self.heads} heads ({self.kv_heads} key/value) of {self.head_dim} dimensions ({memory}{scale})"


GENERIC_LAYOUT = HeadLayout(heads=4, kv_heads=4, head_dim=64)
"""For a `_target_` model, whose heads ddptrain does not know (q, k, v as `separate_projections`)."""


def fp32_matmuls_in_tf32(device: torch.device) -> bool:
    """Whether fp32 matmuls on `device` compute in TF32 (10 bits of mantissa): on CUDA, after
    torch.set_float32_matmul_precision("high") (Trainer.build sets it for fp32 runs there) or
    torch.backends.cuda.matmul.fp32_precision = "tf32". The kernel check's bound and the MFU's peak
    rate (train/flops.py) follow it. torch 2.9+ keeps the answer in `fp32_precision`;
    `torch.get_float32_matmul_precision()` raises once the two APIs were mixed."""
    if device.type != "cuda":
        return False
    precision = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
    if precision is not None and precision != "none":
        return precision == "tf32"
    return torch.get_float32_matmul_precision() != "highest"


def check_segments(width: int) -> np.ndarray:
    """(2, width) segment ids: ROW_LENGTHS' documents, the second row's last PADDING tokens padding (-1)."""
    segments = np.full((2, width), -1, dtype=np.int64)
    for row, lengths in enumerate(ROW_LENGTHS):
        end = width - PADDING * row if width > 2 * PADDING else width
        at = 0
        for segment, length in enumerate(lengths * (1 + width // sum(lengths))):
            if at >= end:
                break
            segments[row, at:min(at + length, end)] = segment
            at += length
    return segments


def kernel_problem(backend: str, layout: HeadLayout, device: torch.device, precision: str,
                   seq_len: int) -> str | None:
    """How `backend` differs from the dense mask on `device` in `precision`, beyond the bound; None
    if it does not (or if it is not a kernel of ours: mask is the reference, a `_target_` model may
    keep its own attention)."""
    if backend not in CHECKED_BACKENDS:
        return None
    width = min(seq_len, CHECK_WIDTH)
    documents = DocumentBoundaries.from_segments(check_segments(width)).to(device)
    generator = torch.Generator().manual_seed(0)
    heads = (layout.heads, layout.kv_heads, layout.kv_heads)
    inputs = [torch.randn(2, h, width, layout.head_dim, generator=generator, dtype=torch.float64) for h in heads]
    cotangent = torch.randn(2, width, layout.heads, layout.head_dim, generator=generator, dtype=torch.float64)
    half = precision in ("bf16", "fp16")
    computes_in = getattr(torch, PRECISION_DTYPES[precision])
    dtype = torch.float32 if half else computes_in  # half: fp32 inputs under autocast, as in a step
    laid_out = [t.to(device, dtype) if memory is None else memory.lay_out(t.to(device, dtype))
                for t, memory in zip(inputs, layout.qkv_memory())]
    bound = "tf32" if precision == "fp32" and fp32_matmuls_in_tf32(device) else precision
    for window in layout.windows:
        theirs = _output_and_grads(backend, laid_out, cotangent.to(device, dtype), documents, window, layout.scale,
                                   computes_in if half else None)
        reference = _output_and_grads("mask", [t.to(device) for t in inputs], cotangent.to(device), documents,
                                      window, layout.scale, None)
        for name, ours, exact in zip(("output", "grad q", "grad k", "grad v"), theirs, reference):
            worst = float((ours.double() - exact).abs().max() / exact.abs().max().clamp_min(1e-30))
            if not worst <= BOUNDS[bound]:  # NaN too
                arithmetic = precision if bound == precision else f"{precision} (matmuls in {bound})"
                return (f"{name} differs from the dense mask by {worst:.3g}, relative, beyond {BOUNDS[bound]:g} "
                        f"for {arithmetic}, on {device.type} with {layout}"
                        f"{'' if window is None else f' and a window of {window}'}")
    return None


def _output_and_grads(backend, tensors, cotangent, documents, window, scale, autocast_dtype):
    leaves = [t.detach().requires_grad_() for t in tensors]  # detach: a view of its own, strides kept
    autocast = (torch.autocast(leaves[0].device.type, dtype=autocast_dtype) if autocast_dtype is not None
                else contextlib.nullcontext())
    with torch.enable_grad(), autocast:
        out = attention.attend(*leaves, documents.using(backend), scale, window=window)
    grads = torch.autograd.grad(out, leaves, cotangent.to(out.dtype))
    return [out.detach(), *grads]
