"""head_token_sum: the head and the objective over valid targets in chunks, against the full logits
through Objective.token_sum (fp64: 1e-9), and the memory it never holds (no (N_valid, V) tensor)."""

from __future__ import annotations

import json
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

from ddptrain.contract.targets import IGNORE_INDEX
from ddptrain.engine.chunked import head_token_sum, recomputes_head
from ddptrain.engine.objective import Objective
from tests.helpers import relative_difference, requires

WIDTH, VOCAB = 8, 40
OBJECTIVES = {"cross_entropy": Objective(), "label_smoothing": Objective(label_smoothing=0.1),
              "z_loss": Objective(z_loss=1e-3), "both": Objective(label_smoothing=0.2, z_loss=1e-2)}
# (B, T) = (3, 9); valid targets per row, scattered: 14 valid in "ragged" (7 divides it), 27 in "all"
# (7 does not), none in "none"
MASKS = {"ragged": [9, 0, 5], "all": [9, 9, 9], "none": [0, 0, 0]}
CHUNKS = [1, 7, 64]


def _case(mask: str, dtype: torch.dtype = torch.float64, seed: int = 0):
    """(hidden (3, 9, WIDTH) requiring grad, head nn.Linear(WIDTH, VOCAB), targets (3, 9))."""
    gen = torch.Generator().manual_seed(seed)
    hidden = (2 * torch.randn(3, 9, WIDTH, generator=gen, dtype=dtype)).requires_grad_()
    head = nn.Linear(WIDTH, VOCAB, dtype=dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(VOCAB, WIDTH, generator=gen))
        head.bias.copy_(torch.randn(VOCAB, generator=gen))
    targets = torch.randint(0, VOCAB, (3, 9), generator=gen)
    for row, valid in enumerate(MASKS[mask]):
        ignored = torch.randperm(9, generator=gen)[valid:]  # scattered, not a suffix
        targets[row, ignored] = IGNORE_INDEX
    return hidden, head, targets


def _loss_and_grads(loss_of, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{"loss": loss_of(), name: d loss / d tensor for each of `tensors`}; every tensor must be reached."""
    loss = loss_of()
    grads = torch.autograd.grad(loss, list(tensors.values()))
    return {"loss": loss.detach(), **{name: grad for name, grad in zip(tensors, grads)}}


def _full(hidden, head, targets, objective):
    return objective.token_sum(head(hidden), targets)  # (B, T, V) logits: the reference path


def _both(hidden, head, targets, objective, tensors, chunk_tokens):
    chunked = _loss_and_grads(lambda: head_token_sum(hidden, head, targets, objective, chunk_tokens), tensors)
    full = _loss_and_grads(lambda: _full(hidden, head, targets, objective), tensors)
    return chunked, full


# -- exact in fp64 -------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_tokens", CHUNKS)
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_equals_the_full_logits_in_fp64(objective, mask, chunk_tokens):
    hidden, head, targets = _case(mask)
    tensors = {"hidden": hidden, "weight": head.weight, "bias": head.bias}
    chunked, full = _both(hidden, head, targets, OBJECTIVES[objective], tensors, chunk_tokens)
    if mask == "none":  # 0, not NaN, and zero gradients that still reach every parameter
        assert all(torch.equal(value, torch.zeros_like(value)) for value in chunked.values())
    else:
        assert relative_difference(chunked, full) < 1e-9
        assert chunked["loss"].dtype == full["loss"].dtype == torch.float64


def test_chunk_sizes_agree_to_1e_12_in_fp64():
    hidden, head, targets = _case("ragged", seed=3)
    tensors = {"hidden": hidden, "weight": head.weight, "bias": head.bias}
    results = [_loss_and_grads(lambda: head_token_sum(hidden, head, targets, OBJECTIVES["both"], chunk), tensors)
               for chunk in (1, 3, 14)]
    assert max(relative_difference(result, results[-1]) for result in results[:-1]) < 1e-12


def test_a_tied_head_accumulates_into_the_embedding():
    """The embedding's weight is the head's: its gradient is the lookup's plus the head's."""
    gen = torch.Generator().manual_seed(1)
    embedding = nn.Embedding(VOCAB, WIDTH, dtype=torch.float64)
    inputs = torch.randint(0, VOCAB, (3, 9), generator=gen)
    _, _, targets = _case("ragged", seed=1)

    def head(h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, embedding.weight)

    tensors = {"embedding": embedding.weight}
    for objective in OBJECTIVES.values():
        chunked = _loss_and_grads(lambda: head_token_sum(torch.tanh(embedding(inputs)), head, targets, objective, 4),
                                  tensors)
        full = _loss_and_grads(lambda: _full(torch.tanh(embedding(inputs)), head, targets, objective), tensors)
        assert relative_difference(chunked, full) < 1e-9


@requires("peft")
def test_a_lora_wrapped_head():
    """peft's LoRA on the head: the frozen base gets no gradient, both adapters theirs, as on full logits."""
    import peft

    hidden, head, targets = _case("ragged", seed=2)
    holder = nn.Module()
    holder.lm_head = head
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["lm_head"],
                             init_lora_weights=False)  # random B too, so the adapter changes the logits
    lora_head = peft.get_peft_model(holder, config).base_model.model.lm_head.double()
    adapters = {name: p for name, p in lora_head.named_parameters() if p.requires_grad}
    assert len(adapters) == 2 and not head.weight.requires_grad
    for objective in OBJECTIVES.values():
        chunked, full = _both(hidden, lora_head, targets, objective, {"hidden": hidden, **adapters}, 5)
        assert relative_difference(chunked, full) < 1e-9


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_a_frozen_head_gives_the_full_logits_gradient_in_fp64(objective, mask):
    """A head with nothing to train (a LoRA run's output layer) takes the path without recomputation:
    the same loss and hidden-state gradient as the full logits."""
    hidden, head, targets = _case(mask, seed=7)
    head.requires_grad_(False)
    chunked, full = _both(hidden, head, targets, OBJECTIVES[objective], {"hidden": hidden}, 4)
    if mask == "none":
        assert all(torch.equal(value, torch.zeros_like(value)) for value in chunked.values())
    else:
        assert relative_difference(chunked, full) < 1e-9


class _OwnForward(nn.Linear):
    """A Linear with a forward of its own: the chunked head cannot know what it computes."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden)


@pytest.mark.parametrize("head_kind, matmuls", [("frozen", 2), ("trainable", 3), ("own forward", 4), ("hooked", 4)])
def test_the_head_runs_one_forward_per_chunk_unless_it_is_not_a_plain_module(head_kind, matmuls):
    """The head's matmuls per valid target, by torch's FLOP counter: a frozen head's forward and input
    gradient (2), a trainable nn.Linear's forward, input and weight gradients (3: all taken in the
    forward), and one more (the checkpointed chunk's recomputed forward) for a head with a forward of
    its own or a hook, whose computation the chunked head must leave to autograd."""
    from torch.utils.flop_counter import FlopCounterMode

    hidden, head, targets = _case("ragged", seed=8)  # 14 valid targets: 4 chunks of 4
    if head_kind == "own forward":
        own = _OwnForward(WIDTH, VOCAB, dtype=hidden.dtype)
        own.load_state_dict(head.state_dict())
        head = own
    head.requires_grad_(head_kind != "frozen")
    if head_kind == "hooked":
        head.register_forward_pre_hook(lambda module, args: None)
    with FlopCounterMode(display=False) as counter:
        head_token_sum(hidden, head, targets, OBJECTIVES["both"], 4).backward()
    assert counter.get_total_flops() == matmuls * 2 * 14 * WIDTH * VOCAB
    assert recomputes_head(head) == (matmuls == 4)  # what the FLOP count (ModelFlops) is told


@pytest.mark.parametrize("per_row", ["log_probs", "tempered", "losses"])
@pytest.mark.parametrize("trainable", [False, True], ids=["frozen", "trainable"])
def test_one_value_per_row_gives_the_full_logits_values_and_gradients_in_fp64(per_row, trainable):
    """head_row_values (DPO's and GRPO's token log-probs, a mixture's token losses): the values and,
    under an uneven incoming gradient (a weight per row, as sequence sums and pair losses give), the
    hidden states' and head's gradients of the full logits, 1e-9; a frozen head in 2 matmuls per row
    (no recompute), a trainable one checkpointed (4)."""
    from torch.utils.flop_counter import FlopCounterMode

    from ddptrain.engine.chunked import head_row_values
    from ddptrain.engine.preference import token_logps

    function = {"log_probs": token_logps, "tempered": lambda logits, t: token_logps(logits / 0.7, t),
                "losses": OBJECTIVES["both"].token_losses}[per_row]
    hidden, head, targets = _case("all", seed=9)
    head.requires_grad_(trainable)
    rows, flat_targets = hidden.reshape(-1, WIDTH), targets.reshape(-1)
    weights = torch.randn(rows.size(0), generator=torch.Generator().manual_seed(3), dtype=rows.dtype)
    tensors = {"hidden": hidden, **({"weight": head.weight, "bias": head.bias} if trainable else {})}
    with FlopCounterMode(display=False) as counter:
        chunked = _loss_and_grads(lambda: torch.stack([
            head_row_values(h, head, t, function) @ w
            for h, t, w in zip(rows.split(7), flat_targets.split(7), weights.split(7))]).sum(), tensors)
    full = _loss_and_grads(lambda: function(head(rows), flat_targets) @ weights, tensors)
    assert relative_difference(chunked, full) < 1e-9
    assert counter.get_total_flops() == (4 if trainable else 2) * 2 * rows.size(0) * WIDTH * VOCAB
    assert recomputes_head(head, one_value_per_row=True) == trainable


# -- within rounding in fp32 and bf16 --------------------------------------------------------------


def test_fp32_within_rounding():
    """fp32: the sums differ only in the order of additions; 1e-5 relative (fp32's epsilon is 1.2e-7)."""
    hidden, head, targets = _case("ragged", dtype=torch.float32, seed=4)
    tensors = {"hidden": hidden, "weight": head.weight, "bias": head.bias}
    chunked, full = _both(hidden, head, targets, OBJECTIVES["both"], tensors, 5)
    assert chunked["loss"].dtype == torch.float32
    assert relative_difference(chunked, full) < 1e-5


def test_bf16_autocast_within_rounding():
    """Under bf16 autocast both paths take bf16 logits upcast to fp32; the head's bf16 matmul and its
    gradients round to 8 bits (epsilon 3.9e-3): 2e-2 relative, against the full path under autocast."""
    hidden, head, targets = _case("ragged", dtype=torch.float32, seed=5)
    tensors = {"hidden": hidden, "weight": head.weight, "bias": head.bias}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        chunked, full = _both(hidden, head, targets, OBJECTIVES["both"], tensors, 5)
    assert chunked["loss"].dtype == full["loss"].dtype == torch.float32  # upcast, as Objective's
    assert relative_difference(chunked, full) < 2e-2


# -- memory: no (N_valid, V) tensor ----------------------------------------------------------------


def saved_tensor_elements(loss_of) -> tuple[int, int]:
    """(largest, total) elements of the tensors autograd saves for backward in `loss_of()`
    (parameters, saved by reference, are not counted); then the backward, which must run."""
    sizes = []

    def pack(tensor: torch.Tensor):
        if not isinstance(tensor if tensor._base is None else tensor._base, nn.Parameter):
            sizes.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = loss_of()
    loss.backward()
    return max(sizes, default=0), sum(sizes)


def peak_tensor_bytes(loss_of) -> int:
    """Peak bytes of live CPU tensors during `loss_of()` and its backward, above those live before:
    the profiler's memory timeline (every allocation and free), replayed. Transient tensors count,
    the backward's recomputed chunks included, which saved-tensor hooks do not see."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        loss_of().backward()
    with tempfile.TemporaryDirectory() as directory, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated for CUDA's snapshots; the CPU has none
        timeline = Path(directory) / "timeline.json"
        prof.export_memory_timeline(str(timeline), device="cpu")
        _, bytes_by_category = json.loads(timeline.read_text())
    live = [sum(row) for row in bytes_by_category]
    return max(live) - live[0] if live else 0


def _real_vocabulary_case():
    """SmolLM2's vocabulary (49,152) on 2 x 256 positions, 250 valid targets: (hidden, head, targets, N_valid x V)."""
    vocab, width = 49_152, 16
    gen = torch.Generator().manual_seed(6)
    hidden = torch.randn(2, 256, width, generator=gen).requires_grad_()
    head = nn.Linear(width, vocab, bias=False)
    targets = torch.randint(0, vocab, (2, 256), generator=gen)
    targets[0, 200:] = IGNORE_INDEX
    targets[1, 50:] = IGNORE_INDEX
    return hidden, head, targets, vocab * int((targets != IGNORE_INDEX).sum())


@pytest.mark.parametrize("objective", ["cross_entropy", "both"])
def test_no_saved_tensor_holds_the_valid_logits(objective):
    """The full path saves a tensor of N_valid x V elements or more (its logits); the chunked one
    saves nothing near it, not even all together (the gathered (N_valid, D) hidden states at most)."""
    hidden, head, targets, valid_logits = _real_vocabulary_case()
    objective = OBJECTIVES[objective]
    full_largest, _ = saved_tensor_elements(lambda: _full(hidden, head, targets, objective))
    largest, total = saved_tensor_elements(lambda: head_token_sum(hidden, head, targets, objective, 32))
    assert full_largest >= valid_logits  # the measure sees the logits where they are saved
    assert largest < valid_logits, f"a saved tensor of {largest} elements; the valid logits are {valid_logits}"
    assert total < valid_logits, f"saved tensors of {total} elements; the valid logits are {valid_logits}"


@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_the_peak_stays_below_one_valid_logits_tensor():
    """Forward and backward, transients included: the chunked path's peak of live tensor bytes is
    below one fp32 (N_valid, V) tensor (46.9 MiB here); the full path's is far above it."""
    hidden, head, targets, valid_logits = _real_vocabulary_case()
    objective = OBJECTIVES["both"]
    full = peak_tensor_bytes(lambda: _full(hidden, head, targets, objective))
    chunked = peak_tensor_bytes(lambda: head_token_sum(hidden, head, targets, objective, 32))
    assert full >= 4 * valid_logits
    assert chunked < 4 * valid_logits, f"peak {chunked} bytes; one fp32 (N_valid, V) tensor is {4 * valid_logits}"


# -- arguments ----------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_tokens", [0, -3, 2.0, True])
def test_chunk_tokens_must_be_a_positive_int(chunk_tokens):
    hidden, head, targets = _case("ragged")
    with pytest.raises(ValueError, match=f"chunk_tokens {chunk_tokens!r} must be a positive int"):
        head_token_sum(hidden, head, targets, chunk_tokens=chunk_tokens)


def test_the_default_chunk_keeps_its_logits_within_64_mib_whatever_the_vocabulary():
    from ddptrain.engine.chunked import CHUNK_LOGITS_BYTES, chunk_rows

    assert chunk_rows(49_152) == 341 and chunk_rows(151_936) == 110
    for vocab in (256, 49_152, 151_936, 10**7):
        assert chunk_rows(vocab) * vocab * 4 <= max(CHUNK_LOGITS_BYTES, 16 * vocab * 4)
    hidden, head, targets = _case("all")  # 27 valid targets; VOCAB outputs: one default chunk holds them all
    chunked = head_token_sum(hidden, head, targets)
    assert torch.allclose(chunked, _full(hidden, head, targets, Objective()), rtol=1e-12, atol=0)


def test_hidden_states_must_match_the_targets():
    hidden, head, targets = _case("ragged")
    with pytest.raises(ValueError, match=r"hidden states of shape \(3, 9, 8\) must be the targets' shape \(3, 8\)"):
        head_token_sum(hidden, head, targets[:, :8])
