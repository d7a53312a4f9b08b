"""The built-in GPT as a transformers GPT2LMHeadModel with the same math, for the HF ecosystem
(generate, pipelines, serving). transformers is an optional dependency: imported where used."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ddptrain.models.gpt import GPT

if TYPE_CHECKING:
    from transformers import GPT2LMHeadModel


def gpt_to_hf(model: GPT) -> GPT2LMHeadModel:
    """A GPT2LMHeadModel (eval mode, same dtype) whose logits are those of `model`.

    Differences from stock GPT-2 that the config pins: exact erf GELU (F.gelu), not gelu_new's tanh
    approximation; no dropout anywhere; no per-layer attention scaling. GPT-2 always has biases, so
    a bias=False GPT maps to zero biases (linear and LayerNorm)."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        raise ImportError("exporting to Hugging Face needs transformers: pip install transformers") from None
    cfg = model.cfg
    is_tied = model.head.weight is model.tok_emb.weight or torch.equal(model.head.weight, model.tok_emb.weight)
    hf_config = GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.max_seq_len, n_embd=cfg.n_embd, n_layer=cfg.n_layer,
        n_head=cfg.n_head, n_inner=4 * cfg.n_embd,
        activation_function="gelu",  # MLP uses F.gelu (erf); GPT-2's default gelu_new is the tanh approximation
        layer_norm_epsilon=1e-5,  # nn.LayerNorm's default, which the GPT's LayerNorms use
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0,
        scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
        tie_word_embeddings=is_tied,
        # Token ids are bytes (or a tokenizer's ids) with no reserved BOS: GPT-2's 50256 would be out of
        # range. EOS is the model's own (a data=sft run's EOS and end-of-turn token), else none. pad_token_id
        # stays None as well: with a pad id, generate() infers the attention mask from input_ids != pad
        # and would silently mask every real occurrence of that byte.
        bos_token_id=None, eos_token_id=model.eos_token_id, pad_token_id=None,
    )
    dtype = model.tok_emb.weight.dtype
    hf_model = GPT2LMHeadModel(hf_config).to(dtype)
    hf_model.load_state_dict(_hf_state_dict(model, is_tied), strict=True)
    return hf_model.eval()


def _hf_state_dict(model: GPT, is_tied: bool) -> dict[str, torch.Tensor]:
    """GPT parameter names and layouts -> GPT2LMHeadModel's. Conv1D stores (in, out): nn.Linear's transpose."""

    def linear(name: str, layer: nn.Linear) -> dict[str, torch.Tensor]:
        weight = layer.weight.detach()
        bias = layer.bias.detach() if layer.bias is not None else weight.new_zeros(weight.size(0))
        return {f"{name}.weight": weight.t().contiguous(), f"{name}.bias": bias}

    def layer_norm(name: str, norm: nn.LayerNorm) -> dict[str, torch.Tensor]:
        weight = norm.weight.detach()
        bias = norm.bias.detach() if norm.bias is not None else torch.zeros_like(weight)
        return {f"{name}.weight": weight, f"{name}.bias": bias}

    state = {"transformer.wte.weight": model.tok_emb.weight.detach(),
             "transformer.wpe.weight": model.pos_emb.weight.detach(),
             **layer_norm("transformer.ln_f", model.ln_f)}
    for i, block in enumerate(model.blocks):
        prefix = f"transformer.h.{i}"
        # qkv rows are [q; k; v], each n_embd wide: transposed, they are c_attn's [q | k | v] columns,
        # the order GPT2Attention splits in.
        state |= layer_norm(f"{prefix}.ln_1", block.ln_1) | layer_norm(f"{prefix}.ln_2", block.ln_2)
        state |= linear(f"{prefix}.attn.c_attn", block.attn.qkv) | linear(f"{prefix}.attn.c_proj", block.attn.proj)
        state |= linear(f"{prefix}.mlp.c_fc", block.mlp.fc) | linear(f"{prefix}.mlp.c_proj", block.mlp.proj)
    state["lm_head.weight"] = model.head.weight.detach() if not is_tied else model.tok_emb.weight.detach()
    return state
