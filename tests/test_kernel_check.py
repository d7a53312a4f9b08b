"""The start-up check of the packed-attention kernel on the run's device (ddptrain/models/kernel_check.py):
the real kernels pass it; a kernel wrong in its forward, in one gradient or in its window fails it;
the trainer refuses a forced backend that fails, on every rank, and lets an `auto` one give way.

The kernels that most need it (varlen, flex) run on CUDA only: their case is skipped here and says so.
"""

from __future__ import annotations

import logging
import re

import pytest
import torch

from ddptrain.config import compose_config
from ddptrain.models import attention, kernel_check
from ddptrain.models.kernel_check import HeadLayout, kernel_problem
from ddptrain.models.spec import ModelError
from ddptrain.testing import run_distributed
from ddptrain.train.builder import build_model
from tests.helpers import import_optional

CPU = torch.device("cpu")
HF_TEST_LAYOUT = HeadLayout(4, 2, 16, (None, 4))  # tests/test_attention.py's Llama and Mistral through model=hf
VOCAB = 64


@pytest.mark.parametrize("precision", ["fp64", "fp32", "bf16", "fp16"])
@pytest.mark.parametrize("layout", [HeadLayout(4, 4, 16), HF_TEST_LAYOUT, HeadLayout(32, 8, 128, (None, 64))],
                         ids=["gpt", "gqa_window", "llama_8b_heads"])
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
     r"key/value\) of 16 dimensions$"),
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


def gpt_config(attention_backend: str):
    return compose_config(["batch.pack=true", "batch.seq_len=64", "model.n_layer=1", "model.n_embd=32",
                           f"trainer.attention={attention_backend}"])


def test_a_forced_backend_that_fails_is_refused_and_auto_gives_way(monkeypatch, caplog):
    monkeypatch.setattr(attention, "_gather", wrong_backward_for_k)
    with pytest.raises(ModelError, match=r"trainer.attention=gather: its kernel does not compute what the dense mask "
                                         r"does here \(grad k differs .* with 4 heads \(4 key/value\) of 8 dimensions\); "
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
                                         r"16 dimensions and a window of 4\)"):
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
@pytest.mark.parametrize("layout", [HeadLayout(4, 4, 16), HF_TEST_LAYOUT, HeadLayout(32, 8, 128, (None, 64))],
                         ids=["gpt", "gqa_window", "llama_8b_heads"])
def test_every_backend_passes_the_check_on_cuda(layout, backend, precision):
    """The kernels themselves, with the heads of tests/test_attention.py's model=hf case (whose flex
    case failed once on an H200): this passing while that fails puts the fault outside the kernel."""
    assert kernel_problem(backend, layout, torch.device("cuda"), precision, seq_len=2048) is None
