"""Models for the `model._target_` tests: plain factories in a module the tests import by path."""

from __future__ import annotations

import torch
from torch import nn


class CausalConvLM(nn.Module):
    """A tiny causal language model: embeddings, a causal 1D convolution, an MLP, a head.

    Returns raw logits (B, T, V), the simplest side of the model contract."""

    def __init__(self, vocab_size: int, width: int, kernel: int):
        super().__init__()
        self.kernel = kernel
        self.embed = nn.Embedding(vocab_size, width)
        self.conv = nn.Conv1d(width, width, kernel)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.head = nn.Linear(width, vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx).transpose(1, 2)  # (B, C, T)
        x = self.conv(nn.functional.pad(x, (self.kernel - 1, 0))).transpose(1, 2)  # causal: left padding only
        return self.head(x + self.mlp(x))


def make_conv_lm(vocab_size: int, width: int = 32, kernel: int = 4) -> CausalConvLM:
    """The factory named by `model._target_=tests.toy_models.make_conv_lm`; ddptrain passes vocab_size."""
    return CausalConvLM(vocab_size, width, kernel)


class _Reshaped(nn.Module):
    """CausalConvLM with its output bent out of the model contract, for the start-up check's tests."""

    def __init__(self, vocab_size: int, how: str):
        super().__init__()
        self.how = how
        self.inner = CausalConvLM(vocab_size, 16, 2)

    def forward(self, idx: torch.Tensor):
        logits = self.inner(idx)  # (B, T, V)
        return {"v_minus_1": lambda: logits[..., :-1], "t_minus_1": lambda: logits[:, :-1],
                "transposed": lambda: logits.transpose(1, 2), "tuple": lambda: (logits,)}[self.how]()


def make_reshaped_lm(vocab_size: int, how: str) -> nn.Module:
    """`model._target_=tests.toy_models.make_reshaped_lm +model.how=v_minus_1|t_minus_1|transposed|tuple`."""
    return _Reshaped(vocab_size, how)


def make_raising_lm(vocab_size: int) -> nn.Module:
    """A factory with a bug of its own."""
    raise ValueError(f"no model for a vocabulary of {vocab_size}")


class IgnoresPackingLM(CausalConvLM):
    """Takes positions= and segments= (so the signature check passes) but ignores them: its
    convolution reaches across document boundaries in a packed row."""

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None,
                segments: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(idx)


def make_ignores_packing_lm(vocab_size: int) -> IgnoresPackingLM:
    return IgnoresPackingLM(vocab_size, 16, 3)


class FailsOnPackedRowsLM(CausalConvLM):
    """Raises on packed rows, as Bloom's eager attention does on a 4D mask."""

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None,
                segments: torch.Tensor | None = None) -> torch.Tensor:
        if segments is not None:
            first, second = segments.shape  # "too many values to unpack" on a 4D mask in Bloom
            _, _ = segments.unsqueeze(0).shape
        return super().forward(idx)


def make_fails_on_packed_rows_lm(vocab_size: int) -> FailsOnPackedRowsLM:
    return FailsOnPackedRowsLM(vocab_size, 16, 3)


class HeadLossConvLM(CausalConvLM):
    """CausalConvLM following the head-loss protocol: with head_loss=, its hidden states and head."""

    def forward(self, idx: torch.Tensor, head_loss=None) -> torch.Tensor:
        x = self.embed(idx).transpose(1, 2)
        x = self.conv(nn.functional.pad(x, (self.kernel - 1, 0))).transpose(1, 2)
        hidden = x + self.mlp(x)
        return self.head(hidden) if head_loss is None else head_loss(hidden, self.head)


def make_head_loss_conv_lm(vocab_size: int, width: int = 32, kernel: int = 4) -> HeadLossConvLM:
    return HeadLossConvLM(vocab_size, width, kernel)


class PaddedHeadLM(HeadLossConvLM):
    """A head padded past the vocabulary (as many models pad theirs to a multiple of 64): its forward
    returns the vocabulary's columns, yet hands head_loss the whole head."""

    def __init__(self, vocab_size: int, padding: int):
        super().__init__(vocab_size, 16, 2)
        self.vocab_size = vocab_size
        self.head = nn.Linear(16, vocab_size + padding)

    def forward(self, idx: torch.Tensor, head_loss=None) -> torch.Tensor:
        logits_or_loss = super().forward(idx, head_loss)
        return logits_or_loss[..., : self.vocab_size] if head_loss is None else logits_or_loss


def make_padded_head_lm(vocab_size: int, padding: int = 8) -> PaddedHeadLM:
    return PaddedHeadLM(vocab_size, padding)
