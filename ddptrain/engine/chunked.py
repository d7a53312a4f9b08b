"""The output head and the objective over the valid targets only, a chunk of rows at a time.

head_token_sum(hidden, head, targets, objective) is Objective.token_sum(head(hidden), targets),
the numerator of the step's mean, computed without the (B, T, V) logits: it gathers the positions
whose target is valid and runs head + objective on `chunk_tokens` of them at a time, recomputing
each chunk's logits in backward. What must stay true:

- The same sums as the full logits (the same per-token arithmetic: Objective.token_sum on each
  chunk), up to the order of float additions; the count of valid targets stays the caller's.
- No logits beyond one chunk's are alive, in forward or backward: (min(chunk_tokens, N_valid), V)
  logits and their gradient at most; autograd keeps the gathered (N_valid, D) hidden states.
- The head's FLOPs are spent on valid targets only. Its gradients are taken in the forward, while
  each chunk's logits are alive, where the head is a plain module of its own (an nn.Linear that
  trains, tied or not: `_LinearHeadGradInForward`; any frozen leaf: `_FrozenHeadChunk`): one
  forward and one backward per chunk. Any other head (LoRA-wrapped, hooked by FSDP or ZeRO-3, a
  callable) is checkpointed: one more forward per chunk, in backward (`recomputes_head`).
- No valid target: 0 (not NaN), still through the head, so that every parameter of the head gets
  a gradient (zeros) and DDP and FSDP see it used.
"""

from __future__ import annotations

import numbers
from typing import Callable

import torch
import torch.nn.functional as F
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
    if torch.is_grad_enabled() and _is_plain_linear(head) and head.weight.requires_grad:
        return _LinearHeadGradInForward.apply(valid_hidden, head.weight, head.bias, valid_targets, objective,
                                              chunk_tokens)
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
    """Head + objective on one chunk of a head that is not a plain nn.Linear that trains
    (`_LinearHeadGradInForward` takes those whole), under non-reentrant activation checkpointing.

    Why checkpointing for those: autograd then differentiates whatever the head is. A LoRA-wrapped
    Linear (base frozen, two adapters, dropout), a head under FSDP's or ZeRO-3's hooks or any callable
    works without this module knowing its parameters; the recomputation runs the same operations on
    the same inputs, so the gradients are those of the full logits. Non-reentrant: it works with
    inputs or parameters that need no grad, restores the RNG state (the same dropout mask) and the
    autocast state in the recomputation. The price is one more forward of the head per chunk, which
    a head with nothing to train (the frozen output layer of a LoRA run, a frozen model's) does not
    pay: `_FrozenHeadChunk`.
    """
    if torch.is_grad_enabled() and hidden_chunk.requires_grad and _trains_nothing(head):
        return _FrozenHeadChunk.apply(hidden_chunk, head, target_chunk, objective)
    return checkpoint(_head_objective_sum, hidden_chunk, head, target_chunk, objective, use_reentrant=False)


def recomputes_head(head: Head, one_value_per_row: bool = False) -> bool:
    """Whether the chunked head runs `head`'s forward twice per chunk (checkpointed) where it trains
    or the hidden states need a gradient: not for a frozen leaf module, nor for a plain nn.Linear
    under a token-sum objective, whose gradients are taken in the forward; `one_value_per_row`
    (`head_row_values`: DPO, GRPO, a mixture) checkpoints every head that trains. The FLOP count
    follows (ddptrain/train/flops.py)."""
    if one_value_per_row:
        return not _trains_nothing(head)
    return not (_trains_nothing(head) or _is_plain_linear(head))


def held_head_grad_bytes(head: Head) -> int:
    """Bytes the chunked head holds from forward to backward beside the valid rows' (N_valid, D):
    a trainable plain nn.Linear's weight and bias gradients (`_LinearHeadGradInForward`), else 0."""
    if not (_is_plain_linear(head) and head.weight.requires_grad):
        return 0
    return sum(param.numel() * param.element_size() for param in head.parameters() if param.requires_grad)


def _unhooked_leaf(head: Head) -> bool:
    """Whether `head` is a module of its own (no submodule) with no hook: a plain callable is unknown,
    and a hooked head (FSDP's unshard around its own unit, ZeRO-3's gather) expects its forward and
    backward where autograd runs them, so both keep the checkpointed path. Not while torch.compile
    traces either (it compiles the checkpointed path)."""
    if not isinstance(head, nn.Module) or next(head.children(), None) is not None:
        return False
    hooks = (head._forward_pre_hooks, head._forward_hooks, head._backward_pre_hooks, head._backward_hooks)
    return not any(hooks) and not torch.compiler.is_compiling()


def _trains_nothing(head: Head) -> bool:
    """An unhooked leaf module with no parameter that requires a gradient."""
    return _unhooked_leaf(head) and not any(param.requires_grad for param in head.parameters())


def _is_plain_linear(head: Head) -> bool:
    """An unhooked nn.Linear whose forward is nn.Linear's (F.linear of its weight and bias)."""
    return (isinstance(head, nn.Linear) and getattr(head.forward, "__func__", None) is nn.Linear.forward
            and _unhooked_leaf(head))


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
        with torch.enable_grad(), _inner_graph():
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


class _LinearHeadGradInForward(torch.autograd.Function):
    """Head + objective over all the valid rows of a trainable nn.Linear head, a chunk at a time, with
    every gradient taken in the forward while the chunk's logits are alive: the hidden states' (N_valid,
    D), kept in place of the hidden states checkpointing keeps, and the weight's (V, D) and the bias's,
    summed over the chunks. Backward scales them by the incoming gradient and hands them to autograd
    as the weight's and bias's gradients, so that they accumulate into the parameters (into the
    embedding where the weight is tied) and DDP's and ZeRO's gradient hooks see them as from
    nn.Linear. The head runs one forward and one backward per chunk, against checkpointing's two
    forwards; the price is the weight's gradient held from forward to backward, one copy of the
    weight (113 MiB fp32 at V = 49,152, D = 576). Each chunk's gradients are autograd's own over
    F.linear and the objective, so any objective and autocast are differentiated as in nn.Linear.
    Liger's fused linear cross-entropy does the same for cross-entropy."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                objective: Objective, chunk_tokens: int) -> torch.Tensor:
        wanted = ctx.needs_input_grad[:3]
        leaves = [t.detach().requires_grad_(want) if t is not None else None
                  for t, want in zip((hidden, weight, bias), wanted)]
        hidden_grads, weight_grad, bias_grad, pieces = [], None, None, []
        with torch.enable_grad(), _inner_graph():
            # With no valid target, split gives one empty chunk: 0, and zero gradients for the head
            for hidden_chunk, target_chunk in zip(leaves[0].split(chunk_tokens), targets.split(chunk_tokens)):
                piece = objective.token_sum(F.linear(hidden_chunk, leaves[1], leaves[2]), target_chunk)
                inputs = [t for t, want in zip((hidden_chunk, leaves[1], leaves[2]), wanted) if want]
                grads = iter(torch.autograd.grad(piece, inputs, allow_unused=True) if piece.requires_grad
                             else [None] * len(inputs))
                if wanted[0]:
                    hidden_grads.append(_or_zeros(next(grads), hidden_chunk))
                weight_grad = _summed(weight_grad, next(grads), leaves[1]) if wanted[1] else None
                bias_grad = _summed(bias_grad, next(grads), leaves[2]) if wanted[2] else None
                pieces.append(piece.detach())
        hidden_grad = torch.cat(hidden_grads) if wanted[0] else None
        ctx.save_for_backward(hidden_grad, weight_grad, bias_grad)
        return pieces[0] if len(pieces) == 1 else torch.stack(pieces).sum()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grads = tuple(g * grad_output if g is not None else None for g in ctx.saved_tensors)
        return (*grads, None, None, None)


def _inner_graph():
    """Around a graph built and differentiated within a forward: what it saves is freed before the
    forward returns, so the saved-tensor hooks of the caller (the memory plan's measure, offloading
    to the host) must not see it: identity hooks on top of theirs."""
    return torch.autograd.graph.saved_tensors_hooks(_same, _same)


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _or_zeros(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return grad if grad is not None else torch.zeros_like(like)


def _summed(total: torch.Tensor | None, grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """total + grad, in place after the first chunk (the first chunk's gradient is autograd's fresh tensor)."""
    grad = _or_zeros(grad, like)
    return grad if total is None else total.add_(grad)


def head_row_values(hidden_chunk: torch.Tensor, head: Head, target_chunk: torch.Tensor,
                    per_row: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """per_row(head(hidden_chunk), target_chunk), one value per row (C,), each from its own row's logits
    (a token's log-prob or loss: DPO's and GRPO's sequences, a mixture's sources), without the chunk's
    logits kept for backward. A head with nothing to train gives each row's gradient with respect to
    its hidden state in the forward (`_FrozenHeadRows`, no recompute); any other is checkpointed."""
    if torch.is_grad_enabled() and hidden_chunk.requires_grad and _trains_nothing(head):
        return _FrozenHeadRows.apply(hidden_chunk, head, target_chunk, per_row)
    if not torch.is_grad_enabled():
        return per_row(head(hidden_chunk), target_chunk)
    return checkpoint(_head_rows, hidden_chunk, head, target_chunk, per_row, use_reentrant=False)


def _head_rows(hidden_chunk: torch.Tensor, head: Head, target_chunk: torch.Tensor, per_row) -> torch.Tensor:
    return per_row(head(hidden_chunk), target_chunk)  # (C, V) logits alive only in here


class _FrozenHeadRows(torch.autograd.Function):
    """`_FrozenHeadChunk` for one value per row: row i's value depends on row i's hidden state only
    (the head maps rows to rows, which chunking already relies on), so the gradient of the values' sum
    with respect to the hidden states holds each row's own gradient, (C, D), and backward scales row
    i's by the incoming gradient's element i."""

    @staticmethod
    def forward(ctx, hidden_chunk: torch.Tensor, head: Head, target_chunk: torch.Tensor, per_row) -> torch.Tensor:
        with torch.enable_grad(), _inner_graph():
            detached = hidden_chunk.detach().requires_grad_()
            values = per_row(head.forward(detached), target_chunk)  # head.forward: as in _FrozenHeadChunk
            (grad,) = torch.autograd.grad(values.sum(), detached, allow_unused=True)
        ctx.save_for_backward(_or_zeros(grad, detached))
        return values.detach()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return grad * grad_output.unsqueeze(-1).to(grad.dtype), None, None, None


def _head_objective_sum(hidden_chunk: torch.Tensor, head: Head, target_chunk: torch.Tensor,
                        objective: Objective) -> torch.Tensor:
    return objective.token_sum(head(hidden_chunk), target_chunk)  # (C, V) logits alive only in here
