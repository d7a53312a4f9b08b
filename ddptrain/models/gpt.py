"""A small decoder-only GPT (nanoGPT's shape). Plain nn.Module: it knows nothing of ranks.

Packed rows keep attention inside each document through `attention_backend`
(ddptrain/models/attention.py, trainer.attention): the document boundaries that collation computed
reach every layer as they are, and nothing T x T is built unless the backend is `mask`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ddptrain.config.schema import GPTModelConfig
from ddptrain.contract.boundaries import DocumentBoundaries
from ddptrain.contract.outputs import HeadLossFn
from ddptrain.models import attention


@dataclass
class GPTConfig:
    """The architecture; its defaults are model=gpt's, declared once in the config schema."""

    vocab_size: int = 256
    max_seq_len: int = 256
    n_layer: int = GPTModelConfig.n_layer
    n_head: int = GPTModelConfig.n_head
    n_embd: int = GPTModelConfig.n_embd
    dropout: float = GPTModelConfig.dropout
    bias: bool = GPTModelConfig.bias
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward instead of keeping them (less memory, ~1/3 more compute)."""


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor, documents: DocumentBoundaries | None = None) -> torch.Tensor:
        batch, seq, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=2)
        # (B, H, T, C/H)
        q, k, v = (t.view(batch, seq, self.n_head, channels // self.n_head).transpose(1, 2) for t in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        if documents is None:
            y = attention.causal(q, k, v, dropout=dropout)
        else:  # causal and within one packed document
            y = attention.attend(q, k, v, documents, dropout=dropout)
        return self.proj(y.reshape(batch, seq, channels))  # y: (B, T, H, C/H)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, documents: DocumentBoundaries | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), documents)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token ids (B, T) -> logits (B, T, V); position t predicts token t + 1."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.activation_checkpointing = cfg.activation_checkpointing
        self.attention_backend = "gather"
        """Packed rows' attention (trainer.attention, resolved): gather | varlen | flex | mask."""
        self.eos_token_id: int | list[int] | None = None
        """The token(s) that end what it writes (data=sft: EOS and the end-of-turn token), for its export's
        generation config; not the architecture's (load_model sets it from final/generation_config.json)."""
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # weight tying (nanoGPT, GPT-2)
        self.apply(self._init_weights)
        for name, param in self.named_parameters():
            if name.endswith("proj.weight"):  # GPT-2's scaled init of residual projections
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None,
                segments: torch.Tensor | None = None, documents: DocumentBoundaries | None = None,
                head_loss: HeadLossFn | None = None) -> torch.Tensor:
        """Logits (B, T, V). Packed rows pass `positions` (restarting per document) and either the
        document boundaries that collation computed or only `segments` (a document id per token):
        attention then stays inside each document. `head_loss`: return head_loss(hidden, head)
        instead (the head-loss protocol, ddptrain/contract/outputs.py)."""
        seq = idx.size(1)
        if seq > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds the model's max_seq_len {self.cfg.max_seq_len}")
        if positions is None:
            positions = torch.arange(seq, device=idx.device)
        if documents is None and segments is not None:  # segments alone: the dense reference mask, built once
            documents = DocumentBoundaries.for_mask(segments)
        elif documents is not None and documents.backend is None:  # collation's: run them through ours
            documents = documents.using(self.attention_backend)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(positions))
        for block in self.blocks:
            if self.activation_checkpointing and torch.is_grad_enabled():
                # Non-reentrant: works with no_sync, keyword arguments and inputs without grad,
                # and restores the RNG state so that dropout recomputes the same mask.
                x = checkpoint(block, x, documents, use_reentrant=False)
            else:
                x = block(x, documents)
        if head_loss is not None:
            return head_loss(self.ln_f(x), self.head)
        return self.head(self.ln_f(x))  # (B, T, V)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
