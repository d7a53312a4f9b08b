"""The start-up check of the packed-attention kernel on the run's device (ddptrain/models/kernel_check.py):
the real kernels pass it; a kernel wrong in its forward, in one gradient or in its window fails it,
and so does one that reads strided q, k, v wrongly, since the check hands them over laid out in
memory as the model does (the GPT's and four transformers architectures' layouts are compared with
their real calls);
the trainer refuses a forced backend that fails, on every rank, and lets an `auto` one give way.

The kernels that most need it (varlen, flex) run on CUDA only: their case is skipped here and says so.
"""

from __future__ import annotations

import dataclasses
import logging
import re

import pytest
import torch

from ddptrain.config import compose_config
from ddptrain.models import attention, kernel_check
from ddptrain.models.kernel_check import (HeadLayout, TokenMajor, fp32_matmuls_in_tf32, kernel_problem,
                                          separate_projections)
from ddptrain.models.spec import ModelError
from ddptrain.testing import run_distributed
from ddptrain.train.builder import build_model
from tests.helpers import import_optional

CPU = torch.device("cpu")
HF_TEST_LAYOUT = HeadLayout(4, 2, 16, (None, 4), scale=0.25)  # tests/models/test_attention.py's Llama, Mistral (model=hf)
GPT_LAYOUT = HeadLayout(4, 4, 16, memory=tuple(TokenMajor(192, 16, part * 64) for part in range(3)))  # one projection
NEOX_LAYOUT = HeadLayout(4, 4, 16, memory=(None, None, TokenMajor(192, 48, 32)))  # q, k contiguous; heads interleaved
VOCAB = 64


@pytest.mark.parametrize("precision", ["fp64", "fp32", "bf16", "fp16"])
@pytest.mark.parametrize("layout", [GPT_LAYOUT, HF_TEST_LAYOUT, NEOX_LAYOUT,
                                    pytest.param(HeadLayout(32, 8, 128, (None, 64)), marks=pytest.mark.slow)],
                         ids=["gpt", "gqa_window", "neox", "llama_8b_heads"])  # 8B's heads: seconds per case
def test_the_gather_passes_on_the_cpu(layout, precision):
    assert kernel_problem("gather", layout, CPU, precision, seq_len=2048) is None


def test_the_reference_and_a_models_own_attention_are_not_checked():
    assert kernel_problem("mask", HF_TEST_LAYOUT, CPU, "fp32", 256) is None
    assert kernel_problem("the model's own (its forward takes positions= and segments=)", HF_TEST_LAYOUT, CPU,
                          "fp32", 256) is None


def test_the_check_rows_hold_many_documents_long_and_short_and_padding():
    for width in (320, 96, 16):
        segments = kernel_check.check_segments(width)
        assert segments.shape == (2, width)
        assert (segments[1, -kernel_check.PADDING:] == -1).all() and (segments[0] >= 0).all()
    lengths = torch.from_numpy(kernel_check.check_segments(320)[0]).unique_consecutive(return_counts=True)[1]
    assert lengths.max() > 128 and lengths.min() == 1, "a document beyond a flex block, and one of a single token"


class _GradTimes(torch.autograd.Function):
    """Identity forward; its backward scales the gradient (a kernel right forward, wrong backward)."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def wrong_backward_for_k(q, k, v, documents, scale, dropout, window, real=attention._gather):
    return real(q, _GradTimes.apply(k, 1.2), v, documents, scale, dropout, window)


@pytest.mark.parametrize("wrong,expected", [
    (lambda q, k, v, documents, scale, dropout, window: attention.causal(q, k, v, scale),
     r"output differs from the dense mask by 0\.\d+, relative, beyond 0\.05 for bf16, on cpu with 4 heads \(2 "
     r"key/value\) of 16 dimensions \(q: 64 per token, k: 32 per token, v: 32 per token, scale 0\.25\)$"),
    (wrong_backward_for_k, r"grad k differs from the dense mask by 0\.\d+, relative, beyond 0\.0001 for fp32"),
    (lambda q, k, v, documents, scale, dropout, window, real=attention._gather: real(q, k, v, documents, scale,
                                                                                   dropout, None),
     r"output differs .* and a window of 4$"),
], ids=["across_documents", "one_gradient", "window_dropped"])
def test_a_kernel_wrong_in_its_forward_a_gradient_or_its_window_fails(monkeypatch, wrong, expected):
    monkeypatch.setattr(attention, "_gather", wrong)
    precision = "bf16" if "bf16" in expected else "fp32"
    problem = kernel_problem("gather", HF_TEST_LAYOUT, CPU, precision, seq_len=1024)
    assert problem is not None and re.search(expected, problem), problem


def reads_views_as_if_contiguous(q, k, v, documents, scale, dropout, window, real=attention._gather):
    """A kernel that ignores its inputs' strides (as pytorch#146377's compiled flex backward did for
    some): right on contiguous tensors, wrong on the views that models pass."""
    def as_if_contiguous(t):
        return t.as_strided(t.shape, torch.empty(t.shape, device="meta").stride(), t.storage_offset())

    return real(*(as_if_contiguous(t) for t in (q, k, v)), documents, scale, dropout, window)


@pytest.mark.parametrize("layout", [GPT_LAYOUT, NEOX_LAYOUT, HF_TEST_LAYOUT], ids=["gpt", "neox", "llama"])
def test_a_kernel_that_misreads_strided_views_fails_with_the_models_layout(monkeypatch, layout):
    monkeypatch.setattr(attention, "_gather", reads_views_as_if_contiguous)
    contiguous = dataclasses.replace(layout, memory=(None, None, None))
    assert kernel_problem("gather", contiguous, CPU, "fp32", seq_len=1024) is None, "what the check saw before"
    problem = kernel_problem("gather", layout, CPU, "fp32", seq_len=1024)
    assert problem is not None and re.match(r"(output|grad [qkv]) differs from the dense mask by", problem), problem
    assert f"v: {layout.qkv_memory()[2]}" in problem, problem


def test_a_kernel_that_drops_the_models_scale_fails(monkeypatch):
    monkeypatch.setattr(attention, "_gather", lambda q, k, v, documents, scale, dropout, window,
                        real=attention._gather: real(q, k, v, documents, None, dropout, window))
    assert kernel_problem("gather", HF_TEST_LAYOUT, CPU, "fp32", seq_len=1024) is None, "0.25 = 1/sqrt(16)"
    problem = kernel_problem("gather", dataclasses.replace(HF_TEST_LAYOUT, scale=0.125), CPU, "fp32", seq_len=1024)
    assert problem is not None and problem.startswith("output differs") and "scale 0.125" in problem, problem


def _round_to_tf32(t: torch.Tensor) -> torch.Tensor:
    """fp32 `t` with 10 bits of mantissa (round to nearest), as a TF32 matmul reads its operands."""
    bits = t.float().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32).to(t.dtype)


class _TF32Operands(torch.autograd.Function):
    """Rounds a tensor and its gradient to TF32: the operands of the forward and backward matmuls."""

    @staticmethod
    def forward(ctx, t):
        return _round_to_tf32(t)

    @staticmethod
    def backward(ctx, grad):
        return _round_to_tf32(grad)


def test_fp32_on_a_gpu_whose_matmuls_run_in_tf32_is_checked_against_tf32s_bound(monkeypatch):
    """Trainer.build lets fp32 matmuls run in TF32 on CUDA, and compiled flex follows that setting.
    A kernel whose operands are rounded to TF32 is within TF32's bound and beyond fp32's: refused
    before, a correct kernel of an fp32 run on a GPU. A wrong kernel still fails TF32's bound."""
    def tf32_gather(q, k, v, documents, scale, dropout, window, real=attention._gather):
        q, k, v = (_TF32Operands.apply(t) for t in (q, k, v))
        return _TF32Operands.apply(real(q, k, v, documents, scale, dropout, window))

    monkeypatch.setattr(attention, "_gather", tf32_gather)
    problem = kernel_problem("gather", HF_TEST_LAYOUT, CPU, "fp32", seq_len=1024)
    assert problem is not None and "beyond 0.0001 for fp32, on cpu" in problem, problem
    monkeypatch.setattr(kernel_check, "fp32_matmuls_in_tf32", lambda device: True)  # as on CUDA after Trainer.build
    assert kernel_problem("gather", HF_TEST_LAYOUT, CPU, "fp32", seq_len=1024) is None
    assert kernel_problem("gather", HF_TEST_LAYOUT, CPU, "fp64", seq_len=1024) is not None, "fp64 keeps its bound"
    monkeypatch.setattr(attention, "_gather", wrong_backward_for_k)
    problem = kernel_problem("gather", HF_TEST_LAYOUT, CPU, "fp32", seq_len=1024)
    assert problem is not None and "beyond 0.005 for fp32 (matmuls in tf32)" in problem, problem


def test_fp32_matmuls_in_tf32_reads_torchs_setting_through_either_api():
    cuda = torch.device("cuda")  # a device object only: nothing runs on it
    try:
        assert not fp32_matmuls_in_tf32(cuda), "torch's default: IEEE fp32"
        torch.set_float32_matmul_precision("high")  # what Trainer.build sets for fp32 on CUDA
        assert fp32_matmuls_in_tf32(cuda) and not fp32_matmuls_in_tf32(CPU)
        torch.set_float32_matmul_precision("highest")
        assert not fp32_matmuls_in_tf32(cuda)
        torch.backends.cuda.matmul.fp32_precision = "tf32"  # the newer API
        assert fp32_matmuls_in_tf32(cuda)
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        assert not fp32_matmuls_in_tf32(cuda)
        torch.backends.cuda.matmul.fp32_precision = "none"  # matmuls inherit the global setting:
        torch.backends.fp32_precision = "tf32"  # TF32, and the older API's getter raises (mixed APIs)
        with pytest.raises(RuntimeError, match="mix of the legacy and new APIs"):
            torch.get_float32_matmul_precision()
        assert fp32_matmuls_in_tf32(cuda)
    finally:
        torch.backends.fp32_precision = "none"
        torch.set_float32_matmul_precision("highest")


def _recording_attend(monkeypatch) -> list:
    """The q, k, v and scale of every call of ddptrain's attention backends, as the model passes them."""
    calls, real = [], attention._attend

    def recording(q, k, v, documents, scale, dropout, window):
        calls.append((q, k, v, scale))
        return real(q, k, v, documents, scale, dropout, window)

    monkeypatch.setattr(attention, "_attend", recording)
    return calls


def assert_laid_out_as_called(layout: HeadLayout, call) -> None:
    """The check's q, k and v, made at the call's shape, have the strides and offsets (within a
    token) of the model's; and the scale is the model's."""
    for name, memory, real in zip("qkv", layout.qkv_memory(), call[:3]):
        ours = torch.zeros(real.shape) if memory is None else memory.lay_out(torch.zeros(real.shape))
        assert ours.stride() == real.stride(), (name, ours.stride(), real.stride())
        if memory is not None:
            assert ours.storage_offset() == real.storage_offset() % real.stride(2), name
    assert layout.scale == call[3]


def test_the_gpts_layout_is_how_its_attention_is_called(monkeypatch):
    model, _, adapter = build_model(compose_config(["batch.pack=true", "batch.seq_len=64", "model.n_layer=1",
                                                    "model.n_embd=48", "model.n_head=3"]), VOCAB)
    calls = _recording_attend(monkeypatch)
    segments = torch.tensor([[0] * 5 + [1] * 11, [0] * 9 + [1] * 7])
    documents = attention.DocumentBoundaries.from_segments(segments.numpy()).using("gather")
    model(torch.randint(0, VOCAB, (2, 16)), positions=segments * 0, segments=segments, documents=documents)
    layout = adapter.head_layout(model)
    assert layout.memory == tuple(TokenMajor(144, 16, part * 48) for part in range(3))
    assert_laid_out_as_called(layout, calls[0])
    assert layout.memory != separate_projections(3, 3, 16), "the default would not be the GPT's"


@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_model_hf_layouts_are_how_each_architecture_calls_attention(tmp_path, monkeypatch):
    """Llama (a projection each), GPT-2 (views of one), Phi-3 and GPT-NeoX (q and k contiguous, v a
    view: one fused projection, heads interleaved in NeoX's): hf.head_layout's, recorded through
    transformers' attention interface, equal what a packed forward passes to the backend."""
    transformers = import_optional("transformers")
    from ddptrain.models import hf

    common = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  max_position_embeddings=128, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    models = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(num_key_value_heads=2, **common)),
        "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel,
                 dict(n_embd=64, n_layer=1, n_head=4, n_positions=128, bos_token_id=None, eos_token_id=None)),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, dict(num_key_value_heads=2, **common)),
        "neox": (transformers.GPTNeoXConfig, transformers.GPTNeoXForCausalLM, common),
    }
    expected_v = {"llama": TokenMajor(32, 16), "gpt2": TokenMajor(192, 16, 128), "phi3": TokenMajor(128, 16, 96),
                  "neox": TokenMajor(192, 48, 32)}
    for name, (config_class, model_class, options) in models.items():
        torch.manual_seed(0)
        model_class(config_class(vocab_size=VOCAB, **options)).save_pretrained(tmp_path / name)
        model = hf.load_causal_lm(str(tmp_path / name), "sdpa", VOCAB)
        assert hf.head_layout(model).memory is None, "the dense mask: nothing of ours is called"
        hf.use_packed_attention(model, "gather")
        layout = hf.head_layout(model)
        assert layout.memory[2] == expected_v[name], (name, layout)
        assert hf.packing_problem(model) is None, name
        calls = _recording_attend(monkeypatch)
        with torch.no_grad():
            hf._packed_probe(model, lengths=(5, 7))  # a packed forward, through the registered function again
        assert_laid_out_as_called(layout, calls[0])
        monkeypatch.undo()


def test_model_hf_start_up_runs_the_packing_probe_once(tmp_path, monkeypatch):
    """build_model with packed rows asks for the probe three times (the adapter's choice of backend,
    the kernel check's layout, check_model's refusal) and runs its forwards (a packed row, each of
    its two documents alone) once; through the dense mask, whose probe is not kept, once too."""
    transformers = import_optional("transformers")
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    forwards, real = [], transformers.LlamaForCausalLM.forward

    def counted(self, *args, **kwargs):
        forwards.append((kwargs["input_ids"] if "input_ids" in kwargs else args[0]).size(1))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(transformers.LlamaForCausalLM, "forward", counted)
    # trainer.chunked_head=false: its own probe (one more forward of 8 positions) is not this test's
    overrides = ["model=hf", f"model.path={tmp_path / 'llama'}", "batch.pack=true", "batch.seq_len=64",
                 "trainer.chunked_head=false"]
    for backend in ("auto", "mask"):
        forwards.clear()
        model, _, adapter = build_model(compose_config([*overrides, f"trainer.attention={backend}"]), VOCAB)
        assert model.packed_attention == ("gather" if backend == "auto" else "mask")
        assert sorted(forwards) == [5, 7, 12], (backend, forwards)
        if backend == "auto":
            assert adapter.head_layout(model).memory == separate_projections(4, 2, 16)
            assert len(forwards) == 3, "the layout is the probe's, kept"


def gpt_config(attention_backend: str):
    return compose_config(["batch.pack=true", "batch.seq_len=64", "model.n_layer=1", "model.n_embd=32",
                           f"trainer.attention={attention_backend}"])


@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_a_forced_backend_that_fails_is_refused_and_auto_gives_way(monkeypatch, caplog):
    monkeypatch.setattr(attention, "_gather", wrong_backward_for_k)
    with pytest.raises(ModelError, match=r"trainer.attention=gather: its kernel does not compute what the dense mask "
                                         r"does here \(grad k differs .* with 4 heads \(4 key/value\) of 8 dimensions "
                                         r"\(q: 96 per token, k: 96 per token from 32, v: 96 per token from 64\)\); "
                                         r"use trainer.attention=auto, gather or mask"):
        build_model(gpt_config("gather"), VOCAB)
    with caplog.at_level(logging.WARNING):
        model, _, _ = build_model(gpt_config("auto"), VOCAB)
    assert model.attention_backend == "mask"
    assert "packed attention: gather fails its check on this device (grad k differs" in caplog.text
    assert "using mask" in caplog.text
    monkeypatch.undo()
    model, _, _ = build_model(gpt_config("auto"), VOCAB)
    assert model.attention_backend == "gather"


@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_model_hf_heads_and_windows_are_the_models_and_a_failing_kernel_is_caught(tmp_path, monkeypatch):
    """The layout comes from the transformers config (grouped-query heads, head_dim, every layer's
    window); a kernel wrong in backward only passes the probe (a forward) and fails the check."""
    transformers = import_optional("transformers")
    from ddptrain.models import hf

    def saved(config_class, model_class, **extra):
        config = config_class(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                              bos_token_id=None, eos_token_id=None, pad_token_id=None, **extra)
        path = tmp_path / model_class.__name__
        torch.manual_seed(0)
        model_class(config).save_pretrained(path)
        return path

    llama = saved(transformers.LlamaConfig, transformers.LlamaForCausalLM)
    mistral = saved(transformers.MistralConfig, transformers.MistralForCausalLM, sliding_window=4)
    qwen2 = saved(transformers.Qwen2Config, transformers.Qwen2ForCausalLM, use_sliding_window=True,
                  sliding_window=4, max_window_layers=1)
    assert hf.head_layout(hf.load_causal_lm(str(llama), "sdpa", VOCAB)) == HeadLayout(4, 2, 16, (None,))
    assert hf.head_layout(hf.load_causal_lm(str(mistral), "sdpa", VOCAB)) == HeadLayout(4, 2, 16, (4,))
    assert hf.head_layout(hf.load_causal_lm(str(qwen2), "sdpa", VOCAB)).windows == (None, 4)

    monkeypatch.setattr(attention, "_gather", wrong_backward_for_k)
    overrides = ["model=hf", f"model.path={mistral}", "batch.pack=true", "batch.seq_len=64"]
    with pytest.raises(ModelError, match=r"trainer.attention=gather: .*grad k differs .* 4 heads \(2 key/value\) of "
                                         r"16 dimensions \(q: 64 per token, k: 32 per token, v: 32 per token, "
                                         r"scale 0\.25\) and a window of 4\)"):
        build_model(compose_config([*overrides, "trainer.attention=gather"]), VOCAB)
    model, _, _ = build_model(compose_config([*overrides, "trainer.attention=auto"]), VOCAB)
    assert model.packed_attention == "mask"


def _build_with_a_wrong_kernel_on_rank(wrong_rank: int, backend: str) -> str:
    import ddptrain.distributed as distributed

    if distributed.get_rank() == wrong_rank:
        attention._gather = wrong_backward_for_k
    try:
        model, _, _ = build_model(gpt_config(backend), VOCAB)
    except ModelError as error:
        return f"refused: {error}"
    return f"built: {model.attention_backend}"


@pytest.mark.slow
def test_a_kernel_that_fails_on_one_rank_is_refused_on_every_rank():
    """Two real gloo ranks, the kernel wrong on rank 1 alone: both refuse the forced backend at the
    same point (no rank is left waiting in a collective); under auto, rank 1 alone gives way."""
    forced = run_distributed(_build_with_a_wrong_kernel_on_rank, 2, 1, "gather")
    assert forced[0].startswith("refused: rank 1 failed: AttentionError: trainer.attention=gather: its kernel"), forced
    assert forced[1].startswith("refused: trainer.attention=gather: its kernel"), forced
    assert run_distributed(_build_with_a_wrong_kernel_on_rank, 2, 1, "auto") == ["built: gather", "built: mask"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: varlen and flex run on CUDA only")
@pytest.mark.parametrize("backend,precision", [("gather", "fp32"), ("flex", "fp32"), ("gather", "bf16"),
                                               ("varlen", "bf16"), ("flex", "bf16")])
@pytest.mark.parametrize("layout", [GPT_LAYOUT, HF_TEST_LAYOUT, NEOX_LAYOUT,
                                    pytest.param(HeadLayout(32, 8, 128, (None, 64)), marks=pytest.mark.slow)],
                         ids=["gpt", "gqa_window", "neox", "llama_8b_heads"])  # 8B's heads: seconds per case
@pytest.mark.parametrize("seq_len", [2048, 96], ids=["width_320", "width_96"])
def test_every_backend_passes_the_check_on_cuda(layout, backend, precision, seq_len):
    """The kernels themselves, with the heads, scale and strided q, k, v of tests/models/test_attention.py's
    model=hf case (whose flex case failed once on an H200), in the check's rows of 320 tokens and in
    rows of that case's 96 (less than one flex block of 128): this passing while that fails puts the
    fault outside the kernel; width_96 failing alone puts it in rows shorter than a block."""
    assert kernel_problem(backend, layout, torch.device("cuda"), precision, seq_len=seq_len) is None
