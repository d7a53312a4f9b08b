"""Attention for packed rows: each document attends to itself alone, from its boundaries.

Collation turns a microbatch's segment ids into `DocumentBoundaries` (ddptrain/contract/boundaries.py)
once, on the host. Nothing here builds a T x T tensor unless the `mask` backend is asked for. Every
run of equal segment ids in a row is a document, the row's padding included, so every backend
computes the same numbers at every position, padding too.

Backends (`trainer.attention`, picked at start-up by `select_backend`):

- gather (any device): documents gathered into padded, length-sorted buckets, plain causal SDPA
  (no mask), then put back; one permutation each way, never a scatter-add.
- varlen (CUDA, bf16/fp16): torch's FlashAttention varlen kernel over cu_seqlens.
- flex (CUDA, heads of 16 dimensions or more): compiled FlexAttention with a document block mask.
- mask: the dense (B, 1, T, T) mask with SDPA: the reference, and the fallback (with a warning).

Rows that are whole documents go straight to causal SDPA. Whatever a backend derives from the
boundaries is built once per microbatch and cached on them, never per layer. Sliding windows and
grouped-query attention work on every backend. `attend` runs outside torch.compile's graphs, so a
compiled block does not recompile for each document layout. Design notes: docs/architecture.md.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch
import torch.nn.functional as F

from ddptrain.config.choices import ATTENTION_BACKENDS, attention_refusal
from ddptrain.contract.boundaries import DocumentBoundaries
from ddptrain.models.spec import ModelError

log = logging.getLogger(__name__)

DESCRIPTIONS = {
    "gather": "documents gathered into length-sorted batches, causal SDPA without a mask",
    "varlen": "torch's FlashAttention varlen kernel over cu_seqlens",
    "flex": "FlexAttention with a document block mask",
    "mask": "a dense (B, 1, T, T) mask with SDPA (the reference: T^2 memory per row)",
}


class AttentionError(ModelError):
    """A backend cannot run as asked; the message names the backend and the rule."""


# -- choosing a backend --------------------------------------------------------------------------------


def select_backend(requested: str, device_type: str, precision: str) -> str:
    """The backend that `trainer.attention=requested` means on this device and precision: auto is
    varlen on CUDA in bf16/fp16 and gather everywhere else; a forced one is refused where missing."""
    if requested not in ATTENTION_BACKENDS:
        raise AttentionError(f"trainer.attention={requested!r} is not one of {', '.join(ATTENTION_BACKENDS)}")
    if requested == "auto":
        return "varlen" if _refusal("varlen", device_type, precision) is None else "gather"
    refusal = _refusal(requested, device_type, precision)
    if refusal is not None:
        raise AttentionError(refusal)
    return requested


def _refusal(backend: str, device_type: str, precision: str) -> str | None:
    """attention_refusal's rule for the device and precision, then whether this torch has the kernel."""
    refusal = attention_refusal(backend, device_type, precision)
    if refusal is None and backend == "varlen" and not _varlen_keywords():
        refusal = (f"trainer.attention=varlen needs torch.nn.attention.varlen (torch >= 2.9); this torch is "
                   f"{torch.__version__}: use trainer.attention=auto, gather, flex or mask")
    return refusal


def without_dropout(backend: str, dropout: float, forced: bool) -> str:
    """`backend`, or gather where it has no attention dropout (varlen, flex) and the model has some;
    an AttentionError where that backend was forced."""
    if not dropout or backend not in ("varlen", "flex"):
        return backend
    if forced:
        raise AttentionError(f"trainer.attention={backend} has no attention dropout, and the model's is {dropout}; "
                             "use trainer.attention=auto, gather or mask, or no attention dropout")
    return "gather"


def describe(backend: str) -> str:
    """The backend and what it does, for the start-up line (a `_target_` model's own: as given)."""
    return f"{backend} ({DESCRIPTIONS[backend]})" if backend in DESCRIPTIONS else backend


def warn_dense_fallback(reason: str) -> None:
    log.warning("packed attention falls back to the dense mask: %s; it costs T^2 memory per row and "
                "SDPA's masked path", reason)


# -- the backends: q, k, v (B, H, T, d) -> (B, T, H, d) ---------------------------------------------------


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: DocumentBoundaries,
           scale: float | None = None, dropout: float = 0.0, window: int | None = None) -> torch.Tensor:
    """Attention of every query to the earlier keys of its own document (the `window` latest
    ones, when given) through `documents.backend`. q (B, H, T, d), k and v (B, Hkv, T, d) with H a
    multiple of Hkv; returns (B, T, H, d).

    Under torch.compile it runs eagerly, between a compiled block's graphs (ragged, data-dependent
    shapes). The torch.compiler.disable wrapper is made on the first compiled call, not at import:
    making it imports torch._dynamo, which a process that compiles nothing should not pay for."""
    if torch.compiler.is_compiling():
        return _outside_graphs()(q, k, v, documents, scale, dropout, window)
    return _attend(q, k, v, documents, scale, dropout, window)


_EAGER_ATTEND = None


def _outside_graphs():
    global _EAGER_ATTEND
    if _EAGER_ATTEND is None:
        _EAGER_ATTEND = torch.compiler.disable(_attend)
    return _EAGER_ATTEND


def _attend(q, k, v, documents, scale, dropout, window):
    backend = documents.backend or "gather"
    if dropout and backend in ("varlen", "flex"):
        raise AttentionError(f"trainer.attention={backend} has no attention dropout ({dropout}); "
                             "use trainer.attention=gather or mask")
    if backend == "gather" or (backend in ("varlen", "flex") and documents.rows_are_documents):
        # Rows that are whole documents need no kernel of documents: causal SDPA over the rows is
        # exact, and faster than the varlen and flex kernels (H200, bf16: varlen 1.7x its time at T=4096).
        return _gather(q, k, v, documents, scale, dropout, window)
    if backend == "varlen":
        return _varlen(q, k, v, documents, scale, window)
    if backend == "flex":
        return _flex(q, k, v, documents, scale, window)
    if backend == "mask":
        mask = documents.cached(("dense", window, q.device), lambda: dense_mask(documents.segments, window))
        return _sdpa(q, k, v, mask, scale, dropout).transpose(1, 2)
    raise AttentionError(f"unknown attention backend {backend!r} (one of {', '.join(DESCRIPTIONS)})")


def causal(q, k, v, scale: float | None = None, dropout: float = 0.0) -> torch.Tensor:
    """Plain causal attention over whole rows (unpacked), (B, H, T, d) -> (B, T, H, d)."""
    return _sdpa(q, k, v, None, scale, dropout).transpose(1, 2)


def _sdpa(q, k, v, mask, scale, dropout):
    gqa = k.size(1) != q.size(1)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale, enable_gqa=gqa)


def band_mask(length: int, window: int | None, device) -> torch.Tensor:
    """(L, L) boolean: causal, and within the `window` latest keys when given."""
    rows = torch.arange(length, device=device)
    distance = rows[:, None] - rows[None, :]
    allowed = distance >= 0
    return allowed if window is None else allowed & (distance < window)


def dense_mask(segments: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """(B, 1, T, T) boolean: causal, inside one document (and the window): the reference."""
    same = segments[:, :, None] == segments[:, None, :]
    return (same & band_mask(segments.size(1), window, segments.device))[:, None]


class _Reindex(torch.autograd.Function):
    """out = x.index_select(0, index), with a backward that is a gather too: grad.index_select(0, back).

    Gathering rows into the buffer (index: gather_index, back: token_position): every token sits
    at one buffer position; padding positions get exactly zero gradient (no real query attends to
    them, their outputs are dropped), so nothing is summed. Scattering the buffer back (index:
    token_position, back: gather_padded, `zero_row`): the padding positions' gradient is zero, read
    from a zero row appended to the gradient. Neither way is a scatter-add (index_select's own
    backward, slow on CPU)."""

    @staticmethod
    def forward(ctx, x, index, back, zero_row: bool):
        ctx.save_for_backward(back)
        ctx.zero_row = zero_row
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (back,) = ctx.saved_tensors
        if ctx.zero_row:
            grad = torch.cat([grad, grad.new_zeros(1, *grad.shape[1:])])
        return grad.index_select(0, back), None, None, None


def _gather(q, k, v, documents, scale, dropout, window):
    batch, heads, seq, dim = q.shape
    if documents.rows_are_documents:  # nothing to gather: the rows are the documents
        band = None
        if window is not None and window < seq:
            band = documents.cached(("band", "rows", window, q.device), lambda: band_mask(seq, window, q.device))
        return _sdpa(q, k, v, band, scale, dropout).transpose(1, 2)
    gathered = [_Reindex.apply(t.transpose(1, 2).reshape(batch * seq, t.size(1), dim), documents.gather_index,
                               documents.token_position, False) for t in (q, k, v)]  # (P, H, d); the reshape is a view in GPT
    # split, not a slice per bucket: a slice's backward is a zero tensor of the whole buffer (per
    # bucket and per q, k, v, summed); split's is one cat.
    sizes = [docs * longest for docs, longest in documents.buckets]
    pieces = []
    with _without_cudnn(q.is_cuda):
        for number, ((docs, longest), *qkv) in enumerate(zip(documents.buckets, *(t.split(sizes) for t in gathered))):
            qb, kb, vb = (t.view(docs, longest, t.size(1), dim).transpose(1, 2) for t in qkv)
            mask = None
            if window is not None and window < longest:
                mask = documents.cached(("band", number, window, q.device),
                                        lambda: band_mask(longest, window, q.device))
            pieces.append(_sdpa(qb, kb, vb, mask, scale, dropout).transpose(1, 2).reshape(docs * longest, heads, dim))
    buffer = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    rows = _Reindex.apply(buffer, documents.token_position, documents.gather_padded, True)
    return rows.view(batch, seq, heads, dim)


def _without_cudnn(on_cuda: bool):
    """SDPA without its cuDNN backend for the gather's buckets, on CUDA. Their shapes change with
    every microbatch, and cuDNN builds a graph for each new shape, which costs far more than the
    attention itself (docs/benchmarks.md, "On a GPU")."""
    if not on_cuda:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _varlen(q, k, v, documents, scale, window):
    from torch.nn.attention.varlen import varlen_attn

    batch, heads, seq, dim = q.shape
    keywords = _varlen_keywords()
    if window is not None and "window_size" not in keywords:
        _warn_varlen_has_no_window()
        return _gather(q, k, v, documents, scale, 0.0, window)
    flat = [t.transpose(1, 2).reshape(batch * seq, t.size(1), dim) for t in (q, k, v)]  # (B * T, H, d)
    dtypes = {t.dtype for t in flat}
    if q.is_cuda and (dtypes - {torch.float16, torch.bfloat16} or len(dtypes) > 1):
        # FlashAttention is half precision only. Under autocast, q and k may arrive in fp32 (a
        # Llama's rotary embedding multiplies by fp32 cos/sin): cast as SDPA under autocast would.
        if not torch.is_autocast_enabled(q.device.type):
            raise AttentionError(f"trainer.attention=varlen runs in bf16 or fp16 only, and q, k, v are "
                                 f"{q.dtype}, {k.dtype}, {v.dtype} outside autocast: use trainer.precision=bf16 "
                                 "or fp16, or trainer.attention=auto")
        half = torch.get_autocast_dtype(q.device.type)
        flat = [t.to(half) for t in flat]
    options = {}
    if k.size(1) != heads:
        if "enable_gqa" in keywords:
            options["enable_gqa"] = True
        else:  # older varlen_attn: every query head gets its own copy of its key/value head
            flat[1:] = [t.repeat_interleave(heads // k.size(1), dim=1) for t in flat[1:]]
    if scale is not None:
        if "scale" in keywords:
            options["scale"] = scale
        else:  # older varlen_attn scales by 1/sqrt(d): fold the rest of `scale` into q
            flat[0] = flat[0] * (scale * dim ** 0.5)
    if "window_size" in keywords:
        options["window_size"] = (-1 if window is None else window - 1, 0)  # flash counts the keys before the query
    else:
        options["is_causal"] = True  # torch 2.9's API (later replaced by window_size=(-1, 0))
    cu = documents.cu_seqlens
    out = varlen_attn(*flat, cu, cu, documents.max_length, documents.max_length, **options)
    return out.view(batch, seq, heads, dim)


_VARLEN_KEYWORDS: set[str] | None = None


def _varlen_keywords() -> set[str]:
    """The keyword arguments this torch's varlen_attn takes (none: this torch has no varlen_attn).
    Its API grew between releases (torch 2.9's: is_causal; 2.11's: scale and window_size; 2.13's:
    enable_gqa too)."""
    global _VARLEN_KEYWORDS
    if _VARLEN_KEYWORDS is None:
        import inspect

        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:
            _VARLEN_KEYWORDS = set()
        else:
            _VARLEN_KEYWORDS = set(inspect.signature(varlen_attn).parameters)
    return _VARLEN_KEYWORDS


@functools.cache
def _warn_varlen_has_no_window() -> None:
    log.warning("torch %s's varlen_attn has no window_size (newer releases have it): sliding-window layers use "
                "the gather backend", torch.__version__)


_COMPILED_FLEX = None
"""(create_block_mask, flex_attention), each compiled once per process (`_flex_functions`)."""


def _flex_functions(compiled: bool):
    """create_block_mask and flex_attention, compiled (once per process) or as they are. Uncompiled,
    the block mask is built from a B x T x T grid and the kernel materialises the scores (CPU: forward
    only, no backward in torch 2.13); compiled, the mask is evaluated block by block (torchtitan
    compiles create_block_mask so; its `_compile=True` flag is deprecated since torch 2.13) and the
    kernel is fused.

    Compiled with dynamo's automatic dynamic shapes, not `dynamic=False`: packed microbatches change
    shape (a rank's last microbatch has fewer rows, T is the longest row, evaluation's and the start-up
    check's rows differ). A graph per shape reaches dynamo's recompile limit of 8 graphs, after which
    every new shape silently runs uncompiled: the kernel on B x H x T x T scores (seen on CPU's
    compiled forward: the ninth shape), the block mask on its grid. This way the second shape makes
    the batch and the length symbolic: a few graphs in all for each function (per window; one row,
    and rows shorter than a block of 128, get their own)."""
    global _COMPILED_FLEX
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if not compiled:
        return create_block_mask, flex_attention
    if _COMPILED_FLEX is None:
        _COMPILED_FLEX = torch.compile(create_block_mask), torch.compile(flex_attention)
    return _COMPILED_FLEX


def _flex(q, k, v, documents, scale, window):
    segments = documents.segments
    batch, _, seq, dim = q.shape
    if q.is_cuda and dim < 16:
        raise AttentionError(f"trainer.attention=flex needs a head dimension of at least 16 on CUDA (FlexAttention's "
                             f"compiled kernel), and this model's is {dim}: use trainer.attention=auto, gather, "
                             "varlen or mask")

    def document_causal(b, h, q_idx, kv_idx):
        allowed = (segments[b, q_idx] == segments[b, kv_idx]) & (q_idx >= kv_idx)
        return allowed if window is None else allowed & (q_idx - kv_idx < window)

    create_block_mask, flex = _flex_functions(compiled=q.is_cuda)
    block_mask = documents.cached(("flex", window, q.device), lambda: create_block_mask(
        document_causal, batch, None, seq, seq, device=q.device))
    out = flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=k.size(1) != q.size(1))
    return out.transpose(1, 2)
