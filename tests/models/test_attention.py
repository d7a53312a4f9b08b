"""Packed rows' attention from document boundaries: every backend equals the dense-mask reference
(forward and gradients; gather to 1e-9 in fp64, the others to 1e-5 in fp32), on the built-in GPT
and on a tiny Llama (grouped-query) and Mistral (sliding window) through model=hf; backends are
chosen and refused by rule; no host sync.

varlen and flex run on CUDA only (FlexAttention has no backward on CPU in torch 2.13; varlen is
FlashAttention, half precision): their tests are skipped without a GPU and say so. On the CPU
flex's forward still runs (eagerly), which checks its document mask against the reference.
"""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch

import ddptrain
from ddptrain.config.schema import ConfigError
from ddptrain.contract.boundaries import SMALL_DOCUMENT, DocumentBoundaries
from ddptrain.data.dataset import TokenExamples
from ddptrain.data.packing import PackedExamples
from ddptrain.models import GPT, GPTConfig, attention
from ddptrain.models.spec import ModelError
from tests.helpers import import_optional

VOCAB, SEQ = 64, 96
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device: varlen (FlashAttention) and flex (no backward on CPU in "
                                       "torch 2.13) run on CUDA only")


def packed_microbatch(rows: int = 3, seed: int = 0, longest: int = 40):
    """(batch, targets): `rows` packed rows of SEQ tokens cut from documents of 1 to `longest` tokens
    (many documents per row), the last row shorter (padding)."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, VOCAB, size=int(n)).astype(np.uint8) for n in rng.integers(2, longest, size=60)]
    packed = PackedExamples.from_examples(TokenExamples.from_documents(docs, SEQ), SEQ)
    return packed.collate(np.r_[np.arange(rows - 1), len(packed) - 1])


def ragged_segments(rows: int, width: int, seed: int = 0, padding: int = 5) -> np.ndarray:
    rng = np.random.default_rng(seed)
    segments = np.full((rows, width), -1)
    for row in range(rows):
        at = segment = 0
        while at < width - padding:
            length = int(rng.integers(1, 40))
            segments[row, at:at + length] = segment
            at, segment = at + length, segment + 1
    return segments[:, :width]


def qkv(shape, heads_kv, dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    batch, heads, seq, dim = shape
    make = lambda h: torch.randn(batch, h, seq, dim, generator=gen, dtype=torch.float64).to(device, dtype)
    return [t.requires_grad_() for t in (make(heads), make(heads_kv), make(heads_kv))]


def outputs_and_grads(fn, tensors):
    out = fn(*tensors)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = torch.autograd.grad((out * weights.to(out.device, out.dtype)).sum(), tensors)
    return [out.detach(), *grads]


def assert_close(ours, reference, tolerance, what):
    for name, a, b in zip(("output", "grad q", "grad k", "grad v"), ours, reference):
        scale = b.abs().max().clamp_min(1e-30)
        worst = float((a.double() - b.double()).abs().max() / scale)
        assert worst <= tolerance, f"{what}: {name} differs by {worst:.3g} (relative) > {tolerance}"


# -- boundaries ---------------------------------------------------------------------------------------------


def test_boundaries_are_offsets_and_a_bounded_gather_plan():
    segments = ragged_segments(4, 200)
    documents = DocumentBoundaries.from_segments(segments)
    tokens = segments.size
    lengths = np.diff(documents.cu_seqlens.numpy())
    assert documents.cu_seqlens.dtype == torch.int32 and int(documents.cu_seqlens[-1]) == tokens
    assert isinstance(documents.max_length, int) and documents.max_length == lengths.max()
    # every run of one segment id in a row is one document, padding included
    runs = sum(1 + int((row[1:] != row[:-1]).sum()) for row in segments)
    assert len(lengths) == runs
    assert sorted(documents.token_position.tolist()) == sorted(set(documents.token_position.tolist()))
    assert torch.equal(documents.gather_index[documents.token_position], torch.arange(tokens)), "every token once"
    buffer = len(documents.gather_index)
    assert buffer == sum(docs * longest for docs, longest in documents.buckets)
    small = int((lengths <= SMALL_DOCUMENT).sum())
    assert buffer <= 2 * tokens + SMALL_DOCUMENT * small, (buffer, tokens)
    firsts = [longest for _, longest in documents.buckets]
    assert firsts == sorted(firsts, reverse=True) and len(firsts) <= len(np.unique(lengths)), "longest first"


def plan_cost(lengths, plan):
    from ddptrain.contract.boundaries import ATTENTION_PER_CALL, ATTENTION_PER_TOKEN

    return sum(len(docs) * (lengths[docs].max() ** 2 + ATTENTION_PER_TOKEN * lengths[docs].max())
               + ATTENTION_PER_CALL for docs in plan)


@pytest.mark.parametrize("seed", range(4))
def test_the_bucket_plan_is_the_cheapest_within_twice_the_shortest(seed):
    from ddptrain.contract.boundaries import bucket_plan

    rng = np.random.default_rng(seed)
    lengths = np.r_[rng.integers(1, 40, size=30), rng.integers(100, 1025, size=6), 300, 300]
    plan = bucket_plan(lengths)
    assert sorted(np.concatenate(plan).tolist()) == list(range(len(lengths))), "every document in one bucket"
    for docs in plan:
        assert list(lengths[docs]) == sorted(lengths[docs], reverse=True)
        assert lengths[docs].max() <= max(2 * lengths[docs].min(), SMALL_DOCUMENT), lengths[docs]
    # never costlier than bucketing by powers of two (the plan before), and no plan of runs of
    # the sorted lengths is cheaper: every split of a small case, tried
    classes = np.ceil(np.log2(np.maximum(lengths, SMALL_DOCUMENT)))
    by_powers = [np.flatnonzero(classes == c) for c in np.unique(classes)]
    assert plan_cost(lengths, plan) <= plan_cost(lengths, by_powers)
    small = np.r_[rng.integers(17, 200, size=7)]
    order = np.argsort(-small, kind="stable")
    cheapest = min(plan_cost(small, [order[a:b] for a, b in zip((0, *cuts), (*cuts, len(small)))])
                   for mask in range(2 ** (len(small) - 1))
                   for cuts in [tuple(i + 1 for i in range(len(small) - 1) if mask >> i & 1)]
                   if all(small[order[a:b]].max() <= 2 * small[order[a:b]].min()
                          for a, b in zip((0, *cuts), (*cuts, len(small)))))
    assert plan_cost(small, bucket_plan(small)) == cheapest


def test_collation_carries_the_boundaries_and_they_travel_like_tensors():
    batch, _ = packed_microbatch()
    documents = batch["documents"]
    assert documents.segments is batch["segments"] and documents.backend is None
    assert documents.max_length <= SEQ and len(documents.cu_seqlens) > 2 * 3, "many documents per row"
    moved = documents.to("cpu")
    assert moved.max_length == documents.max_length and torch.equal(moved.token_position, documents.token_position)


# -- backends against the dense mask -------------------------------------------------------------------


@pytest.mark.parametrize("window", [None, 6], ids=["causal", "sliding_window"])
@pytest.mark.parametrize("heads_kv", [4, 2], ids=["mha", "gqa"])
def test_gather_equals_the_dense_mask_in_fp64(window, heads_kv):
    documents = DocumentBoundaries.from_segments(ragged_segments(3, 128))
    tensors = qkv((3, 4, 128, 8), heads_kv, torch.float64)
    reference = outputs_and_grads(lambda *t: attention.attend(*t, documents.using("mask"), window=window), tensors)
    ours = outputs_and_grads(lambda *t: attention.attend(*t, documents.using("gather"), window=window), tensors)
    assert_close(ours, reference, 1e-9, "gather")


def backward_nodes(out: torch.Tensor) -> list[str]:
    """The names of every node of `out`'s autograd graph."""
    seen, stack, names = set(), [out.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


def test_the_gather_backward_touches_each_buffer_once_whatever_the_buckets():
    """The backward of the gather is gathers and one cat per q, k, v: no scatter-add (index_select's
    own backward), and no slice backward, which makes a zero tensor of the whole buffer per bucket
    and sums them (measured: 1.7x the gather's fwd+bwd time at T=1024)."""
    documents = DocumentBoundaries.from_segments(ragged_segments(3, 128)).using("gather")
    assert len(documents.buckets) > 1, documents.buckets
    q, k, v = qkv((3, 4, 128, 8), 2, torch.float64)
    nodes = backward_nodes(attention.attend(q, k, v, documents))
    assert not [n for n in nodes if n.startswith(("Slice", "IndexSelect", "Index", "Scatter"))], sorted(set(nodes))
    assert nodes.count("SplitWithSizesBackward0") == 3, sorted(set(nodes))


@pytest.mark.parametrize("window", [None, 6], ids=["causal", "sliding_window"])
@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_flex_document_mask_equals_the_dense_mask_forward_on_cpu(window):
    documents = DocumentBoundaries.from_segments(ragged_segments(2, 64))
    q, k, v = (t.detach().float() for t in qkv((2, 4, 64, 8), 2, torch.float64))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex attention's "not compiled" warning: the CPU has no backward anyway
        flex = attention.attend(q, k, v, documents.using("flex"), window=window)
        reference = attention.attend(q, k, v, documents.using("mask"), window=window)
    assert float((flex - reference).abs().max()) <= 1e-5


@pytest.mark.slow
def test_compiled_flex_keeps_few_graphs_as_microbatch_shapes_change(monkeypatch):
    """Packed microbatches change shape (fewer rows in a rank's last one, T the longest row, the start-up
    check's and evaluation's rows). The compiled block mask and kernel (CUDA's; compiled here on CPU,
    forward only) must not take a graph per shape: at dynamo's recompile limit of 8 graphs, every new
    shape would run uncompiled (the kernel on B x H x T x T scores, the block mask on its grid), without
    an error. 12 shapes in 2 windows take 6 graphs each (per window, the first shape's and a symbolic
    one; one row; rows shorter than a block of 128), each equal to the dense mask; with `dynamic=False`
    the kernel took 8, and the last 4 shapes ran uncompiled. Neither is compiled through
    create_block_mask's deprecated `_compile` flag."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    real = attention._flex_functions
    monkeypatch.setattr(attention, "_COMPILED_FLEX", None)
    monkeypatch.setattr(attention, "_flex_functions", lambda compiled: real(True))
    torch._dynamo.reset()
    shapes = [(2, 320, None), (2, 320, 4), (8, 256, None), (3, 256, None), (7, 200, 4), (5, 240, None),
              (16, 256, None), (9, 256, 4), (11, 131, None), (1, 256, None), (4, 256, None), (6, 96, None)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DeprecationWarning)
        for rows, width, window in shapes:
            documents = DocumentBoundaries.from_segments(ragged_segments(rows, width, seed=rows))
            q, k, v = (t.detach().float() for t in qkv((rows, 4, width, 16), 2, torch.float64, seed=rows))
            with torch.no_grad():
                flex = attention.attend(q, k, v, documents.using("flex"), 0.25, window=window)
                reference = attention.attend(q, k, v, documents.using("mask"), 0.25, window=window)
            assert float((flex - reference).abs().max()) <= 1e-5, (rows, width, window)
    graphs = {function.__name__: len(_debug_get_cache_entry_list(function.__code__))
              for function in (create_block_mask, flex_attention)}
    assert all(count <= 6 for count in graphs.values()), f"{graphs} graphs for {len(shapes)} shapes"
    assert not [str(w.message) for w in caught if "_compile" in str(w.message)]


@needs_cuda
def test_flex_equals_the_dense_mask_as_shapes_change_on_cuda():
    """The compiled kernel on CUDA, forward and backward, over changing shapes: its graphs after the
    first are symbolic in the batch and the length (see the CPU test above)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch.nn.attention.flex_attention import flex_attention

    for rows, width, window in [(2, 320, None), (8, 256, None), (3, 256, 4), (5, 240, None), (1, 256, None),
                                (11, 131, 4), (6, 96, None), (16, 256, None)]:
        documents = DocumentBoundaries.from_segments(ragged_segments(rows, width, seed=rows)).to("cuda")
        tensors = qkv((rows, 4, width, 16), 2, torch.float32, "cuda", seed=rows)
        reference = outputs_and_grads(lambda *t: attention.attend(*t, documents.using("mask"), 0.25, window=window),
                                      tensors)
        ours = outputs_and_grads(lambda *t: attention.attend(*t, documents.using("flex"), 0.25, window=window), tensors)
        assert_close(ours, reference, 1e-5, f"flex, {rows} x {width}, window {window}")
    assert len(_debug_get_cache_entry_list(flex_attention.__code__)) < 8, "dynamo's recompile limit: uncompiled"


@needs_cuda
@pytest.mark.parametrize("backend,dtype,tolerance", [("gather", torch.float32, 1e-5), ("flex", torch.float32, 1e-5),
                                                     ("varlen", torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [None, 6], ids=["causal", "sliding_window"])
def test_every_backend_equals_the_dense_mask_on_cuda(backend, dtype, tolerance, window):
    """varlen is FlashAttention (bf16/fp16 only): compared in bf16, against the mask in fp32."""
    documents = DocumentBoundaries.from_segments(ragged_segments(3, 256)).to("cuda")
    tensors = qkv((3, 4, 256, 32), 2, dtype, "cuda")
    reference = outputs_and_grads(lambda *t: attention.attend(*(x.float() for x in t), documents.using("mask"),
                                                              window=window), tensors)
    ours = outputs_and_grads(lambda *t: attention.attend(*t, documents.using(backend), window=window), tensors)
    assert_close(ours, reference, tolerance, backend)


def reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch 2.9's varlen_attn signature (is_causal; no scale, window_size or enable_gqa), computed
    document by document with causal SDPA at its default 1/sqrt(d) scale: the older API on any device."""
    assert is_causal and key.size(1) == query.size(1) and return_aux is None
    assert torch.equal(cu_seq_q, cu_seq_k) and max_q == max_k == int((cu_seq_q[1:] - cu_seq_q[:-1]).max())
    pieces = []
    for start, end in zip(cu_seq_q[:-1].tolist(), cu_seq_q[1:].tolist()):
        q, k, v = (t[start:end].transpose(0, 1)[None] for t in (query, key, value))  # (1, H, L, d)
        pieces.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)[0].transpose(0, 1))
    return torch.cat(pieces)


@pytest.mark.parametrize("scale", [None, 0.3], ids=["default_scale", "scale"])
def test_varlen_on_an_older_torch_expands_grouped_heads_and_folds_the_scale_into_q(monkeypatch, scale):
    """torch 2.9's varlen_attn takes is_causal and nothing else: grouped key/value heads are
    repeated for it and a custom scale is folded into q; the result equals the dense mask (fp64)."""
    import torch.nn.attention.varlen as varlen

    monkeypatch.setattr(varlen, "varlen_attn", reference_varlen_attn)
    monkeypatch.setattr(attention, "_VARLEN_KEYWORDS", {"is_causal", "return_aux"})
    documents = DocumentBoundaries.from_segments(ragged_segments(3, 128))
    tensors = qkv((3, 4, 128, 8), 2, torch.float64)
    reference = outputs_and_grads(lambda *t: attention.attend(*t, documents.using("mask"), scale=scale), tensors)
    ours = outputs_and_grads(lambda *t: attention.attend(*t, documents.using("varlen"), scale=scale), tensors)
    assert_close(ours, reference, 1e-9, "varlen, older API")
    # A sliding window has no older-API kernel: those layers take the gather backend, still exact.
    windowed = outputs_and_grads(lambda *t: attention.attend(*t, documents.using("varlen"), window=6), tensors)
    assert_close(windowed, outputs_and_grads(lambda *t: attention.attend(*t, documents.using("mask"), window=6),
                                             tensors), 1e-9, "varlen without window_size")


@needs_cuda
@pytest.mark.parametrize("keywords", ["this_torch", "older_torch"])
def test_varlen_equals_the_dense_mask_on_cuda_through_either_api(monkeypatch, keywords):
    """The real kernel, called as this torch's API allows and as older releases allow (grouped heads
    repeated, the scale folded into q, causal through is_causal where window_size is missing)."""
    if keywords == "older_torch":
        kept = {"return_aux"} | ({"is_causal"} & attention._varlen_keywords())
        if "is_causal" not in kept:  # this torch's kernel takes window_size for causality: keep that alone
            kept.add("window_size")
        monkeypatch.setattr(attention, "_VARLEN_KEYWORDS", kept)
    documents = DocumentBoundaries.from_segments(ragged_segments(3, 256)).to("cuda")
    tensors = qkv((3, 4, 256, 32), 2, torch.bfloat16, "cuda")
    reference = outputs_and_grads(lambda *t: attention.attend(*(x.float() for x in t), documents.using("mask"),
                                                              scale=0.2), tensors)
    ours = outputs_and_grads(lambda *t: attention.attend(*t, documents.using("varlen"), scale=0.2), tensors)
    assert_close(ours, reference, 2e-2, f"varlen ({keywords})")


@needs_cuda
def test_flex_refuses_heads_of_fewer_than_16_dimensions_on_cuda():
    documents = DocumentBoundaries.from_segments(ragged_segments(2, 64)).to("cuda")
    q, k, v = qkv((2, 4, 64, 8), 4, torch.float32, "cuda")
    with pytest.raises(attention.AttentionError, match=r"trainer.attention=flex needs a head dimension of at least 16 "
                                                       r"on CUDA .*this model's is 8"):
        attention.attend(q, k, v, documents.using("flex"))


def test_the_gather_buckets_keep_sdpa_off_cudnn_on_cuda_only():
    """cuDNN builds a graph per new shape (2.4 s fwd+bwd of one fresh 16 x 1024 microbatch's buckets,
    seen on an H200): the gather's buckets, new shapes in every microbatch, run on the other kernels."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    with attention._without_cudnn(True):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    with attention._without_cudnn(False):
        assert torch.backends.cuda.cudnn_sdp_enabled() == before


def ragged_batches(pack: bool, micro_tokens: int | None = None):
    """TrainBatches over 300 documents of 2 to 90 tokens, rows of at most 96 (SEQ) tokens."""
    from ddptrain.data import TrainBatches

    rng = np.random.default_rng(7)
    docs = [rng.integers(0, VOCAB, size=int(n)).astype(np.uint8) for n in rng.integers(2, 90, size=300)]
    return TrainBatches(TokenExamples.from_documents(docs, SEQ), 16, 4, seed=0, rank=0, world_size=2,
                        micro_tokens=micro_tokens, pack=pack, seq_len=SEQ)


@pytest.fixture
def cudnn_sdp_on():
    """SDPA's cuDNN backend on, as torch starts (tests/conftest.py restores it after the test)."""
    torch.backends.cuda.enable_cudnn_sdp(True)


@pytest.mark.parametrize("pack, micro_tokens, changing", [(False, 512, True), (False, None, True), (True, 512, False),
                                                          (True, None, False)],
                         ids=["budget", "micro_size", "packed_budget", "packed_micro_size"])
def test_sdpa_keeps_off_cudnn_on_cuda_where_microbatches_change_shape(cudnn_sdp_on, caplog, pack, micro_tokens,
                                                                      changing):
    """Unpacked rows of ragged documents are padded to each microbatch's longest: new shapes in every
    step, for which cuDNN's attention builds a plan each. Packed rows are all of one width. The flag
    is flipped on a CUDA device only (flipping it needs no GPU)."""
    from ddptrain.train import builder

    batches = ragged_batches(pack, micro_tokens)
    shapes = {shape for step in range(builder.SHAPE_SAMPLE_STEPS) for shape in batches.global_shapes(step)}
    assert (len(shapes) > builder.FIXED_SHAPES) == changing, sorted(shapes)
    assert not builder.keep_sdpa_off_cudnn_if_shapes_change(batches, 100, torch.device("cpu"))
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with caplog.at_level("INFO", logger="ddptrain"):
        assert builder.keep_sdpa_off_cudnn_if_shapes_change(batches, 100, torch.device("cuda")) == changing
    assert torch.backends.cuda.cudnn_sdp_enabled() != changing
    assert ("attention: SDPA without cuDNN: the first 16 steps' microbatches take "
            f"{len(shapes)} shapes" in caplog.text) == changing


@needs_cuda
@pytest.mark.slow
def test_ragged_rows_keep_sdpa_off_cudnn_in_a_cli_run_on_cuda(tmp_path):
    """The CLI on the GPU: unpacked paragraphs under a token budget keep SDPA off cuDNN, and say so;
    the same paragraphs packed keep SDPA's own choice."""
    from benchmarks.peer_common import stdlib_glob
    from tests.helpers import TINY_RUN, run_cli

    common = [*TINY_RUN, "data=text", f"data.paths=[{stdlib_glob()}]", "data.split_by=paragraph", "data.max_docs=400",
              "batch.seq_len=256", "batch.global_size=16", "trainer.max_steps=4", "trainer.eval_every=0"]
    runs = [("ragged", ["batch.micro_tokens=1024"], True), ("packed", ["batch.pack=true"], False)]
    for name, extra, expected in runs:
        result = run_cli([*common, *extra, f"run.dir={tmp_path / name}"], env={"CUDA_VISIBLE_DEVICES": "0"})
        assert result.returncode == 0, result.stderr[-4000:]
        assert ("attention: SDPA without cuDNN" in result.stderr + result.stdout) == expected, name


# -- the built-in GPT --------------------------------------------------------------------------------------


def packed_gpt(dtype, backend, device="cpu", n_embd=32):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, n_layer=2, n_head=4, n_embd=n_embd)).to(device, dtype)
    model.attention_backend = backend
    return model


def gpt_outputs(model, batch, targets):
    logits = model(**batch)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).double(), targets.flatten().to(logits.device),
                                             ignore_index=-100, reduction="sum")
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return [logits.detach(), *grads]


def assert_all_close(ours, reference, tolerance, what):
    """Every tensor within `tolerance` of its reference, relative to the reference's largest entry;
    a failure names every tensor that differs (logits or which gradient, by shape), not only the
    first: one run on a GPU tells where a kernel goes wrong."""
    assert len(ours) == len(reference), what
    differing = []
    for index, (a, b) in enumerate(zip(ours, reference)):
        scale = b.abs().max().clamp_min(1e-30)
        worst = float((a.double() - b.double()).abs().max() / scale)
        if not worst <= tolerance:  # NaN too
            differing.append(f"tensor {index} ({'logits' if index == 0 else 'grad'} {tuple(b.shape)}) by {worst:.3g}")
    assert not differing, f"{what}: {len(differing)} of {len(ours)} differ beyond {tolerance:g}: " + "; ".join(differing)


def test_gpt_gather_equals_the_dense_mask_in_fp64_forward_and_gradients():
    batch, targets = packed_microbatch()
    reference = gpt_outputs(packed_gpt(torch.float64, "mask"), batch, targets)
    assert_all_close(gpt_outputs(packed_gpt(torch.float64, "gather"), batch, targets), reference, 1e-9, "gather")
    checkpointed = packed_gpt(torch.float64, "gather")
    checkpointed.activation_checkpointing = True  # the boundaries pass through non-reentrant checkpointing
    assert_all_close(gpt_outputs(checkpointed, batch, targets), reference, 1e-9, "gather, activation checkpointing")
    only_segments = {key: value for key, value in batch.items() if key != "documents"}  # the old contract
    assert_all_close(gpt_outputs(packed_gpt(torch.float64, "gather"), only_segments, targets), reference, 1e-9,
                     "segments alone (dense reference)")


def test_gpt_gather_equals_the_dense_mask_in_fp32():
    batch, targets = packed_microbatch(seed=1)
    reference = gpt_outputs(packed_gpt(torch.float64, "mask"), batch, targets)
    assert_all_close(gpt_outputs(packed_gpt(torch.float32, "gather"), batch, targets), reference, 1e-5, "gather fp32")


@needs_cuda
@pytest.mark.parametrize("backend", ["gather", "flex", "varlen"])
def test_gpt_every_backend_equals_the_dense_mask_on_cuda(backend):
    batch, targets = packed_microbatch(rows=4, seed=2)
    on_cuda = {key: value.to("cuda") for key, value in batch.items()}
    # A head dimension of 16: FlexAttention's compiled CUDA kernel takes no less.
    reference = gpt_outputs(packed_gpt(torch.float32, "mask", "cuda", n_embd=64), on_cuda, targets)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=backend == "varlen"):
        ours = gpt_outputs(packed_gpt(torch.float32, backend, "cuda", n_embd=64), on_cuda, targets)
    assert_all_close(ours, reference, 3e-2 if backend == "varlen" else 1e-5, backend)


# -- model=hf ----------------------------------------------------------------------------------------------


def hf_model(tmp_path, kind="llama", attn_implementation="sdpa", hidden_size=32, **extra):
    """A tiny model saved with random weights (no hub), loaded as model=hf loads model.path."""
    transformers = import_optional("transformers")
    from ddptrain.models import hf

    config_class, model_class = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                                 "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[kind]
    config = config_class(vocab_size=VOCAB, hidden_size=hidden_size, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                          bos_token_id=None, eos_token_id=None, pad_token_id=None, **extra)
    path = tmp_path / f"{kind}_{hidden_size}"
    if not path.exists():
        torch.manual_seed(0)
        model_class(config).save_pretrained(path)
    return hf.load_causal_lm(str(path), attn_implementation, VOCAB).double()


def hf_outputs(model, batch, targets):
    logits = model(**batch).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100,
                                             reduction="sum")
    grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
    return [logits.detach(), *grads]


@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_llama_through_model_hf_gather_equals_the_dense_mask_in_fp64(tmp_path):
    from ddptrain.models import hf

    batch, targets = packed_microbatch()
    model = hf_model(tmp_path)
    assert model.config.num_key_value_heads < model.config.num_attention_heads, "grouped-query attention"
    reference = hf_outputs(model, batch, targets)  # load_causal_lm starts on the dense mask
    hf.use_packed_attention(model, "gather")
    assert model.config._attn_implementation == hf.PACKED_ATTENTION
    assert_all_close(hf_outputs(model, batch, targets), reference, 1e-9, "llama gather")
    assert "attn_implementation" not in str(model.config.to_dict()), "final/'s config.json names no ddptrain attention"
    # Unpacked rows, a padding mask included, are exactly attn_implementation=sdpa's.
    sdpa = hf_model(tmp_path)
    ids, padding = batch["idx"][:2], torch.ones_like(batch["idx"][:2])
    padding[0, :7] = 0
    with torch.no_grad():
        for kwargs in ({"input_ids": ids}, {"input_ids": ids, "attention_mask": padding}):
            assert torch.equal(model(**kwargs).logits, sdpa(**kwargs).logits), kwargs.keys()


@pytest.mark.parametrize("kind,extra", [("llama", {}), ("mistral", {"sliding_window": 4})],
                         ids=["llama_gqa", "mistral_sliding_window"])
@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_model_hf_flex_logits_equal_the_dense_mask_on_cpu(tmp_path, monkeypatch, kind, extra, compiled):
    """The CUDA test's models and microbatch (grouped-query heads of 16 dimensions, a window of 4,
    a padded last row), forward only: the CPU has no flex backward. So the boundaries, the window
    and the grouped-query heads reach flex attention through transformers' attention interface as
    they reach the mask, padding included. `compiled`: the block mask and the kernel compiled as on
    CUDA (CPU's code generation, not Triton's), so what the H200's failure leaves is the CUDA kernel
    and its backward."""
    from ddptrain.models import hf

    if compiled:
        real = attention._flex_functions
        monkeypatch.setattr(attention, "_COMPILED_FLEX", None)
        monkeypatch.setattr(attention, "_flex_functions", lambda compiled: real(True))
    batch, _ = packed_microbatch(rows=4, seed=4)
    assert (batch["segments"] < 0).any(), "a padded row"
    model = hf_model(tmp_path, kind, hidden_size=64, **extra).float()
    assert model.config.head_dim == 16 and model.config.num_key_value_heads < model.config.num_attention_heads
    logits = {}
    for backend in ("mask", "flex"):
        hf.use_packed_attention(model, backend)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # flex attention's "not compiled" warning
            logits[backend] = model(**batch).logits
    assert_all_close([logits["flex"]], [logits["mask"]], 1e-5, f"{kind} flex on cpu")


@needs_cuda
@pytest.mark.parametrize("kind,extra", [("llama", {}), ("mistral", {"sliding_window": 4})],
                         ids=["llama_gqa", "mistral_sliding_window"])
@pytest.mark.parametrize("backend", ["gather", "flex", "varlen"])
def test_model_hf_every_backend_equals_the_dense_mask_on_cuda(tmp_path, kind, extra, backend):
    """Llama (grouped-query) and Mistral (a window of 4) through model=hf on CUDA, logits and
    gradients: gather and flex in fp32 to 1e-5, varlen under bf16 autocast (q and k leave the rotary
    embedding in fp32 there), each against the dense mask in fp32. Heads of 16 dimensions (flex's least)."""
    from ddptrain.models import hf

    batch, targets = packed_microbatch(rows=4, seed=4)
    on_cuda = {key: value.to("cuda") for key, value in batch.items()}
    reference_model = hf_model(tmp_path, kind, hidden_size=64, **extra).float().cuda()
    hf.use_packed_attention(reference_model, "mask")
    reference = hf_outputs(reference_model, on_cuda, targets.cuda())
    model = hf_model(tmp_path, kind, hidden_size=64, **extra).float().cuda()
    hf.use_packed_attention(model, backend)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=backend == "varlen"):
        ours = hf_outputs(model, on_cuda, targets.cuda())
    assert_all_close([t.float() for t in ours], reference, 3e-2 if backend == "varlen" else 1e-5, f"{kind} {backend}")


@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_a_sliding_window_model_computes_each_document_as_if_alone(tmp_path):
    """Mistral with a window of 4 tokens, documents far longer: every backend keeps the window."""
    from ddptrain.models import hf

    batch, _ = packed_microbatch(rows=2, seed=3)
    model = hf_model(tmp_path, "mistral", sliding_window=4).eval()
    alone = hf_model(tmp_path, "mistral", sliding_window=4).eval()  # transformers' own sdpa and window mask
    segments, ids = batch["segments"], batch["idx"]
    with torch.no_grad():
        expected = torch.zeros(*ids.shape, VOCAB, dtype=torch.float64)
        for row in range(ids.size(0)):
            for segment in segments[row].unique():
                where = segments[row] == segment
                expected[row, where] = alone(ids[row, where][None]).logits[0]
        for backend in ("gather", "mask"):
            hf.use_packed_attention(model, backend)
            logits = model(**batch).logits
            assert float((logits - expected).abs().max()) <= 1e-9, backend


def test_the_probe_falls_back_to_the_mask_or_refuses(tmp_path, monkeypatch, caplog):
    from ddptrain.models.adapters import HFAdapter

    model = hf_model(tmp_path)
    assert HFAdapter().use_attention(model, "gather", forced=True) == "gather"
    leak = lambda q, k, v, documents, *args, **kwargs: attention.causal(q, k, v)  # attends across documents
    monkeypatch.setattr(attention, "attend", leak)
    with pytest.raises(ModelError, match=r"trainer.attention=gather: LlamaForCausalLM cannot run it \(logits "
                                         r"differ by .* from each document alone\); use trainer.attention=auto or mask"):
        HFAdapter().use_attention(model, "gather", forced=True)
    with caplog.at_level("WARNING"):
        assert HFAdapter().use_attention(model, "gather", forced=False) == "mask"
    assert "packed attention falls back to the dense mask: LlamaForCausalLM: logits differ" in caplog.text
    HFAdapter().check_model(model, {"path": "x"}, SEQ, pack=True)  # the mask keeps documents apart

    eager = hf_model(tmp_path, attn_implementation="eager")
    with pytest.raises(ModelError, match="model.attn_implementation=eager keeps transformers' own attention"):
        HFAdapter().use_attention(eager, "gather", forced=True)
    assert HFAdapter().use_attention(eager, "gather", forced=False) == "mask"


# -- `_target_` models ---------------------------------------------------------------------------------------


class SegmentsOnly(torch.nn.Module):
    """A `_target_` model of today's contract: positions= and segments=, no boundaries."""

    def __init__(self):
        super().__init__()
        self.gpt = packed_gpt(torch.float64, "mask")

    def forward(self, idx, positions=None, segments=None):
        return self.gpt(idx, positions=positions, segments=segments)


def test_target_models_keep_positions_and_segments_or_take_the_boundaries():
    from ddptrain.models.adapters import CustomAdapter

    batch, targets = packed_microbatch()
    reference = gpt_outputs(packed_gpt(torch.float64, "mask"), batch, targets)
    own = SegmentsOnly()
    assert CustomAdapter("x").use_attention(own, "gather", forced=False).startswith("the model's own")
    assert_all_close(gpt_outputs(own, batch, targets), reference, 1e-9, "positions= and segments= only")
    takes = packed_gpt(torch.float64, "mask")  # forward(documents=...): the hook sets the backend
    assert CustomAdapter("x").use_attention(takes, "gather", forced=False) == "gather"
    seen = []
    takes.blocks[0].attn.register_forward_pre_hook(lambda module, args: seen.append(args[1].backend))
    assert_all_close(gpt_outputs(takes, batch, targets), reference, 1e-9, "documents=")
    assert seen == ["gather"]
    # Switched again (the start-up check's fallback does so): the new backend runs, through one hook.
    assert CustomAdapter("x").use_attention(takes, "mask", forced=False) == "mask"
    gpt_outputs(takes, batch, targets)
    assert seen == ["gather", "mask"]


# -- choosing a backend ------------------------------------------------------------------------------------


def test_auto_picks_by_device_and_precision_and_a_missing_backend_is_refused():
    assert attention.select_backend("auto", "cpu", "fp32") == "gather"
    assert attention.select_backend("auto", "cpu", "fp64") == "gather"
    assert attention.select_backend("auto", "cuda", "bf16") == "varlen"
    assert attention.select_backend("auto", "cuda", "fp32") == "gather"
    assert attention.select_backend("flex", "cuda", "fp32") == "flex"
    assert attention.select_backend("mask", "cpu", "fp64") == "mask"
    with pytest.raises(attention.AttentionError, match=r"trainer.attention=flex needs cuda and trainer.precision "
                                                       r"fp32 \| bf16 \| fp16 \(FlexAttention has no backward on CPU "
                                                       r"in torch 2.13.*this run has cpu and fp32"):
        attention.select_backend("flex", "cpu", "fp32")
    with pytest.raises(attention.AttentionError, match=r"trainer.attention=varlen needs cuda and trainer.precision "
                                                       r"bf16 \| fp16 .*this run has cuda and fp32"):
        attention.select_backend("varlen", "cuda", "fp32")


def test_a_torch_without_varlen_attn_gets_the_gather_from_auto_and_a_refusal_when_forced(monkeypatch):
    monkeypatch.setattr(attention, "_VARLEN_KEYWORDS", set())  # as _varlen_keywords finds no varlen_attn
    assert attention.select_backend("auto", "cuda", "bf16") == "gather"
    with pytest.raises(attention.AttentionError, match=r"trainer.attention=varlen needs torch.nn.attention.varlen "
                                                       rf"\(torch >= 2.9\); this torch is {re.escape(torch.__version__)}"):
        attention.select_backend("varlen", "cuda", "bf16")


def _validate(*overrides):
    from ddptrain.config import compose_config
    from ddptrain.config.validation import validate

    return validate(compose_config(list(overrides)), 1)


def test_trainer_attention_is_validated_before_the_process_group():
    _validate("trainer.attention=gather", "batch.pack=true")
    with pytest.raises(ConfigError, match="trainer.attention='dense' is not one of auto, gather, varlen, flex, mask"):
        _validate("trainer.attention=dense")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"trainer.attention=varlen needs cuda .*this run has cpu and fp32: "
                                              "use trainer.attention=auto, gather or mask"):
            _validate("trainer.attention=varlen", "batch.pack=true")
    with pytest.raises(ConfigError, match="model.attention is not a config key"):
        _validate("+model.attention=gather")


# -- no host sync ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["gather", "mask"])
def test_a_packed_step_reads_nothing_back_from_the_device(backend):
    from tests.engine.syncs import host_syncs

    model = packed_gpt(torch.float32, backend)
    engine = ddptrain.Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), "ddp")
    steps = [[packed_microbatch(2, seed), packed_microbatch(1, seed + 9)] for seed in range(3)]
    engine.step(steps[0])
    with host_syncs() as calls:
        for microbatches in steps[1:]:
            engine.step(microbatches)
    assert calls == [], f"host syncs in packed steps: {calls}"


@needs_cuda
@pytest.mark.parametrize("backend", ["gather", "varlen", "flex"])
def test_a_packed_step_makes_no_host_sync_on_cuda(backend):
    from tests.engine.syncs import device_syncs

    model = packed_gpt(torch.float32, backend, "cuda", n_embd=64)
    engine = ddptrain.Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), "ddp",
                             precision="bf16" if backend == "varlen" else "fp32", device=torch.device("cuda"))
    pin = lambda mb: ({k: v.pin_memory() for k, v in mb[0].items()}, mb[1].pin_memory())
    steps = [[pin(packed_microbatch(2, seed)), pin(packed_microbatch(1, seed + 9))] for seed in range(4)]
    engine.step(steps[0])
    engine.step(steps[1])  # flex: the compiled kernel's first shapes
    with device_syncs() as calls:
        for microbatches in steps[2:]:
            engine.step(microbatches)
    assert calls == [], f"host syncs in packed steps on CUDA ({backend}): {calls}"


def test_attention_dropout_keeps_gather_or_is_refused_for_varlen_and_flex():
    from ddptrain.models.adapters import GPTAdapter

    model = GPT(GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, n_layer=1, n_head=2, n_embd=16, dropout=0.1))
    assert GPTAdapter().use_attention(model, "varlen", forced=False) == "gather" == model.attention_backend
    with pytest.raises(ModelError, match="trainer.attention=flex has no attention dropout, and the model's is 0.1"):
        GPTAdapter().use_attention(model, "flex", forced=True)


def test_gather_of_one_document_per_row_is_causal_attention_over_the_rows():
    documents = DocumentBoundaries.from_segments(np.zeros((2, 64), dtype=np.int64))
    assert documents.rows_are_documents
    tensors = qkv((2, 4, 64, 8), 2, torch.float64)
    reference = outputs_and_grads(lambda *t: attention.attend(*t, documents.using("mask"), window=5), tensors)
    for backend in ("gather", "varlen", "flex"):  # varlen and flex too: causal SDPA is exact and faster there
        ours = outputs_and_grads(lambda *t: attention.attend(*t, documents.using(backend), window=5), tensors)
        assert_close(ours, reference, 1e-9, f"{backend}, whole rows")


@pytest.mark.slow
def test_gather_runs_under_compile_without_recompiling_per_microbatch():
    """trainer.compile compiles each block; the gather (data-dependent shapes) runs eagerly between
    graphs, so new document layouts of the same (B, T) reuse the graphs."""
    from ddptrain.models.compiling import compile_model

    torch._dynamo.reset()
    model = compile_model(packed_gpt(torch.float32, "gather"))
    eager = packed_gpt(torch.float32, "gather")
    microbatches = [packed_microbatch(rows=2, seed=seed) for seed in range(5)]
    for batch, targets in microbatches[:2]:  # the first graphs (and, at most, one dynamic-shape recompile)
        gpt_outputs(model, batch, targets)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for batch, targets in microbatches[2:]:
            assert_all_close(gpt_outputs(model, batch, targets), gpt_outputs(eager, batch, targets), 1e-4, "compiled")


def test_a_filler_cut_of_the_boundaries_is_one_document_per_token():
    """The Engine's fillers (ranks with fewer microbatches, zero2/zero3/fsdp) cut every input to [:1, :1]."""
    batch, _ = packed_microbatch()
    one = batch["documents"][:1, :1]
    assert one.rows_are_documents and one.max_length == 1 and one.cu_seqlens.tolist() == [0, 1]
    model = packed_gpt(torch.float64, "gather")
    cut = {key: value[:1, :1] for key, value in batch.items()}
    assert torch.allclose(model(**cut), model(batch["idx"][:1, :1]), atol=1e-12)
    with pytest.raises(TypeError, match=r"can be cut to one token per row \(\[rows, :1\]\)"):
        batch["documents"][:, :2]
