"""The output head and the objective over the valid targets only, a chunk of rows at a time.

head_token_sum(hidden, head, targets, objective) is Objective.token_sum(head(hidden), targets),
the numerator of the step's mean, computed without the (B, T, V) logits: it gathers the positions
whose target is valid and runs head + objective on `chunk_tokens` of them at a time, recomputing
each chunk's logits in backward. What must stay true:

- The same sums as the full logits (the same per-token arithmetic: Objective.token_sum on each
  chunk), up to the order of float additions; the count of valid targets stays the caller's.
- No logits beyond one chunk's are alive, in forward or backward: (min(chunk_tokens, N_valid), V)
  logits and their gradient at most; autograd keeps the gathered (N_valid, D) hidden states.
- The head's FLOPs are spent on valid targets only (one more forward of the head per chunk, in
  backward, where the head has parameters to train; none where it has not).
- No valid target: 0 (not NaN), still through the head, so that every parameter of the head gets
  a gradient (zeros) and DDP and FSDP see it used.
"""

from __future__ import annotations

import numbers
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ddptrain.contract.targets import IGNORE_INDEX
from ddptrain.engine.objective import Objective

CHUNK_LOGITS_BYTES = 64 * 2**20
"""The default chunk: as many rows as keep its fp32 logits within 64 MiB (341 rows at V = 49,152, 110 at
151,936), so that the chunk's logits, their softmax and gradients stay small beside the model whatever
its vocabulary; a (rows, D) x (D, V) matmul of that size still runs at full speed (Liger's fused
linear cross-entropy sizes its chunks the same way, logits about the size of the hidden states)."""
DEFAULT_CHUNK_TOKENS = 1024
"""Rows per chunk where the head does not say its vocabulary (a callable that is not a Linear)."""
MIN_CHUNK_TOKENS = 16

Head = Callable[[torch.Tensor], torch.Tensor]


def head_token_sum(hidden: torch.Tensor, head: Head, targets: torch.Tensor, objective: Objective | None = None,
                   chunk_tokens: int | None = None, valid_positions: torch.Tensor | None = None) -> torch.Tensor:
    """objective.token_sum(head(hidden), targets), without ever holding more than one chunk's logits.

    hidden: (..., D), the last hidden states; targets: (...), -100 where ignored; head: any callable
    from (N, D) to (N, V) logits (an nn.Linear, a tied embedding's weight in F.linear, a LoRA-wrapped
    Linear); objective: None for plain cross-entropy; chunk_tokens: rows per chunk (None: `chunk_rows`). The sum is in at least float32, as
    Objective.token_sum's (bf16 or fp16 logits are upcast per chunk). `valid_positions`: the flat
    indices of the valid targets (`valid_positions_of(targets)`), computed where the targets were
    made (on the host): then nothing here waits for the device.
    """
    chunk_tokens = check_chunk_tokens(chunk_tokens) or chunk_rows(getattr(head, "out_features", None))
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden states of shape {tuple(hidden.shape)} must be the targets' shape "
                         f"{tuple(targets.shape)} plus one hidden dimension")
    objective = objective if objective is not None else Objective()
    flat_targets = targets.reshape(-1)
    if valid_positions is None:
        # Finding them on the device tells the host N_valid (one sync on CUDA): the price of running
        # the head on valid rows only, in chunks whose shapes are known.
        valid_positions = valid_positions_of(flat_targets)
    valid_positions = valid_positions.to(hidden.device, non_blocking=True)
    valid_hidden = hidden.reshape(-1, hidden.size(-1)).index_select(0, valid_positions)  # (N_valid, D)
    valid_targets = flat_targets.index_select(0, valid_positions)  # (N_valid,)
    # With no valid target, split gives one empty chunk: head + objective on 0 rows is 0, and its
    # graph still reaches the head's parameters.
    pieces = [
        _chunk_sum(hidden_chunk, head, target_chunk, objective)
        for hidden_chunk, target_chunk in zip(valid_hidden.split(chunk_tokens), valid_targets.split(chunk_tokens))
    ]
    return pieces[0] if len(pieces) == 1 else torch.stack(pieces).sum()


def check_chunk_tokens(chunk_tokens) -> int | None:
    """`chunk_tokens` if it is a positive int or None (the default), else a ValueError naming it and the rule."""
    if chunk_tokens is None:
        return None
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, numbers.Integral) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens {chunk_tokens!r} must be a positive int (or None: the default)")
    return int(chunk_tokens)


def chunk_rows(vocab_size: int | None) -> int:
    """The default rows per chunk for a head of `vocab_size` outputs (CHUNK_LOGITS_BYTES); None: unknown."""
    if not vocab_size:
        return DEFAULT_CHUNK_TOKENS
    return max(MIN_CHUNK_TOKENS, CHUNK_LOGITS_BYTES // (4 * int(vocab_size)))


def valid_positions_of(targets: torch.Tensor) -> torch.Tensor:
    """Flat indices (int64) of the targets that are not IGNORE_INDEX."""
    return (targets.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)


class HeadLoss:
    """The engine's side of the head-loss protocol (ddptrain/contract/outputs.py): called by the
    model with its last hidden states and its head, it returns head_token_sum over `targets`.
    A plain class, not a dataclass: wrappers that move a forward's arguments to the device (DDP)
    pass it on as it is."""

    def __init__(self, targets: torch.Tensor, objective: Objective | None = None,
                 chunk_tokens: int | None = None, valid_positions: torch.Tensor | None = None):
        self.targets, self.objective = targets, objective
        self.chunk_tokens, self.valid_positions = chunk_tokens, valid_positions

    def __call__(self, hidden: torch.Tensor, head: Head) -> torch.Tensor:
        return head_token_sum(hidden, head, self.targets, self.objective, self.chunk_tokens, self.valid_positions)


def _chunk_sum(hidden_chunk: torch.Tensor, head: Head, target_chunk: torch.Tensor,
               objective: Objective) -> torch.Tensor:
    """Head + objective on one chunk, under non-reentrant activation checkpointing.

    Why checkpointing and not a hand-written autograd.Function that computes the gradients of the
    chunk's hidden states and of the head's weight in its forward (Liger's fused linear
    cross-entropy): autograd then differentiates whatever the head is. A LoRA-wrapped Linear (base
    frozen, two adapters, dropout), a weight tied to the embedding (its gradient accumulates into
    the one parameter), a head under FSDP or autocast all work without this module knowing their
    parameters; the recomputation runs the same operations on the same inputs, so the gradients are
    those of the full logits. Non-reentrant: it works with inputs or parameters that need no grad,
    restores the RNG state (the same dropout mask) and the autocast state in the recomputation.
    The price is one more forward of the head per chunk, which a head with nothing to train (the
    frozen output layer of a LoRA run, a frozen model's) does not pay: `_FrozenHeadChunk`.
    """
    if torch.is_grad_enabled() and hidden_chunk.requires_grad and _trains_nothing(head):
        return _FrozenHeadChunk.apply(hidden_chunk, head, target_chunk, objective)
    return checkpoint(_head_objective_sum, hidden_chunk, head, target_chunk, objective, use_reentrant=False)


def _trains_nothing(head: Head) -> bool:
    """Whether `head` is a module of its own (no submodule) with no parameter that requires a gradient
    and no hook: a plain callable is unknown, and a hooked head (FSDP's unshard around its own unit,
    ZeRO-3's gather) expects its forward and backward where autograd runs them, so both keep the
    checkpointed path. Not while torch.compile traces either."""
    if not isinstance(head, nn.Module) or next(head.children(), None) is not None:
        return False
    hooks = (head._forward_pre_hooks, head._forward_hooks, head._backward_pre_hooks, head._backward_hooks)
    return (not any(hooks) and not any(param.requires_grad for param in head.parameters())
            and not torch.compiler.is_compiling())


class _FrozenHeadChunk(torch.autograd.Function):
    """Head + objective on one chunk of a head with nothing to train: the chunk's gradient with
    respect to its hidden states is computed in forward, while its logits are alive (autograd
    differentiates the head and the objective there, whatever they are), and kept, (C, D), for
    backward, which scales it by the incoming gradient. No recomputation: the head runs one forward
    and one backward per chunk instead of two forwards and a backward; what is held for backward is
    the same size as what checkpointing holds (the chunk's hidden states). Liger's fused linear
    cross-entropy does the same for a Linear head."""

    @staticmethod
    def forward(ctx, hidden_chunk: torch.Tensor, head: Head, target_chunk: torch.Tensor,
                objective: Objective) -> torch.Tensor:
        with torch.enable_grad():
            detached = hidden_chunk.detach().requires_grad_()
            # head.forward, not head(): the module has no hook of its own (`_trains_nothing`), and a
            # global one (a FLOP counter's module tracker) would hook tensors of this inner graph
            total = objective.token_sum(head.forward(detached), target_chunk)
            (grad,) = torch.autograd.grad(total, detached, allow_unused=True)
        ctx.save_for_backward(grad if grad is not None else torch.zeros_like(detached))
        return total.detach()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return grad * grad_output, None, None, None


def _head_objective_sum(hidden_chunk: torch.Tensor, head: Head, target_chunk: torch.Tensor,
                        objective: Objective) -> torch.Tensor:
    return objective.token_sum(head(hidden_chunk), target_chunk)  # (C, V) logits alive only in here
