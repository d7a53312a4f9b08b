"""torch.compile and activation checkpointing change how a step computes, not what it computes."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import ddptrain
from ddptrain.models.compiling import compile_model
from ddptrain.models.adapters import adapter_for, enable_activation_checkpointing
from ddptrain.models.spec import ModelError, ModelSpec
from ddptrain.contract.targets import IGNORE_INDEX
from tests.helpers import SEQ, VOCAB, import_optional, microbatch, relative_difference

GPT_CFG = {"name": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 16}


def ragged_microbatches(seed: int, width: int = SEQ) -> list:
    """Two microbatches with very different valid-token counts (one row has none)."""
    return [microbatch(2, [width, 3], seed, width), microbatch(3, [7, width, 0], seed + 1, width)]


def learnable_microbatches(seed: int, width: int) -> list:
    """Ragged microbatches whose targets are a function of the input token (loss falls fast)."""
    batches = []
    for inputs, targets in ragged_microbatches(seed, width):
        batches.append((inputs, torch.where(targets == IGNORE_INDEX, targets, (3 * inputs + 1) % VOCAB)))
    return batches


def tiny_llama_dir(directory) -> str:
    """config.json of a 2-layer Llama (grouped-query attention, RoPE, SwiGLU); no weights: built from it."""
    transformers = import_optional("transformers")
    transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ,
                             use_cache=False).save_pretrained(directory)
    return str(directory)


def blocks_of(model: nn.Module) -> nn.ModuleList:
    return model.blocks if hasattr(model, "blocks") else model.model.layers


def count_block_calls(model: nn.Module) -> list[int]:
    """A one-element counter of block forward passes (a recompute in backward runs one more).

    It counts calls of each block's first norm: transformers checkpoints a layer's `forward`, not
    its `__call__`, so hooks on the layer itself stay outside the checkpoint and run once."""
    calls = [0]

    def hook(module, args):
        calls[0] += 1

    for block in blocks_of(model):
        (block.ln_1 if hasattr(block, "ln_1") else block.input_layernorm).register_forward_pre_hook(hook)
    return calls


def sgd_step(model_cfg: dict, checkpointing: bool) -> tuple[float, dict, dict, int]:
    """One fp64 Engine step with SGD(lr=1): the update is minus the gradient of the global objective."""
    torch.manual_seed(0)
    model, spec = adapter_for(model_cfg).build(model_cfg, VOCAB, SEQ)
    if checkpointing:
        enable_activation_checkpointing(model, spec)
    calls = count_block_calls(model)
    engine = ddptrain.Engine(model, torch.optim.SGD(model.parameters(), lr=1.0), "ddp", precision="fp64")
    before = {k: v.clone() for k, v in engine.model_state_dict().items()}
    stats = engine.step(ragged_microbatches(seed=3))
    after = engine.model_state_dict()
    return float(stats.loss), before, {k: after[k] - before[k] for k in after}, calls[0]


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_activation_checkpointing_matches_plain_in_fp64(kind, tmp_path):
    model_cfg = GPT_CFG if kind == "gpt" else {"name": "hf", "path": tiny_llama_dir(tmp_path),
                                               "attn_implementation": "sdpa"}
    plain_loss, plain_init, plain_grad, plain_calls = sgd_step(model_cfg, False)
    ckpt_loss, ckpt_init, ckpt_grad, ckpt_calls = sgd_step(model_cfg, True)
    assert relative_difference(ckpt_init, plain_init) == 0.0, "both runs must start from the same weights"
    # 2 microbatches x 2 blocks forward; checkpointing runs each block once more in backward.
    assert plain_calls == 4 and ckpt_calls == 8, f"block calls: plain {plain_calls}, checkpointed {ckpt_calls}"
    assert math.isclose(ckpt_loss, plain_loss, rel_tol=1e-12), f"loss {ckpt_loss} != {plain_loss}"
    assert relative_difference(ckpt_grad, plain_grad) < 1e-12
    assert max(float(g.abs().max()) for g in plain_grad.values()) > 0, "the step must have moved the weights"


class NoBlocksKnown(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)


class HFStyle(NoBlocksKnown):
    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        self.kwargs = gradient_checkpointing_kwargs


def test_custom_model_needs_gradient_checkpointing_enable():
    spec = ModelSpec(kind="custom", config={"_target_": "my_pkg.build"}, vocab_size=VOCAB, max_seq_len=SEQ)
    with pytest.raises(ModelError, match=r"NoBlocksKnown \(model._target_=my_pkg.build\) has no "
                                         r"gradient_checkpointing_enable.*trainer.activation_checkpointing=false"):
        enable_activation_checkpointing(NoBlocksKnown(), spec)
    module = enable_activation_checkpointing(HFStyle(), spec)
    assert module.kwargs == {"use_reentrant": False}


def train_losses(compiled: bool, steps: int) -> tuple[list[float], list[bool]]:
    """fp32 AdamW steps with clipping on ragged microbatches whose width changes (a recompile)."""
    torch.manual_seed(0)
    model, _ = adapter_for(GPT_CFG).build(GPT_CFG, VOCAB, SEQ)
    tracing = []  # torch.compiler.is_compiling() as seen by a block's forward hook
    blocks_of(model)[0].register_forward_hook(lambda *_: tracing.append(torch.compiler.is_compiling()))
    if compiled:
        compile_model(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = ddptrain.Engine(model, optimizer, "ddp", grad_clip=1.0)
    losses = [float(engine.step(learnable_microbatches(seed=step, width=SEQ if step % 3 else SEQ - 3)).loss)
              for step in range(steps)]
    return losses, tracing


@pytest.mark.slow  # compiling on CPU takes tens of seconds
def test_compile_matches_eager_over_twelve_steps():
    eager, eager_tracing = train_losses(compiled=False, steps=12)
    compiled, compiled_tracing = train_losses(compiled=True, steps=12)
    assert not any(eager_tracing) and any(compiled_tracing), "the compiled run must run blocks through torch.compile"
    assert eager[-1] < 0.85 * eager[0], f"the model should learn, so that the weights matter: losses {eager}"
    for step, (a, b) in enumerate(zip(compiled, eager)):
        assert math.isclose(a, b, rel_tol=1e-3), f"step {step}: compiled loss {a} vs eager {b}"
