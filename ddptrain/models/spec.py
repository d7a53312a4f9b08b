"""The model contract, and the spec that rebuilds a trained model.

The contract (the same for every kind of model): `model(inputs)` maps token ids (B, T) to logits
(B, T, V) aligned with the targets, or returns an object with `.logits` (a transformers
ModelOutput). ddptrain's data already pairs each input with its next-token target, so nothing
shifts labels and no extra (B, T, V) copy is made. Packed rows arrive as keyword arguments
`idx`, `positions` (restarting at 0 per document), `segments` (a document id per token) and
`documents` (their DocumentBoundaries, ddptrain/contract/boundaries.py: given only to a forward that
takes it); a model that takes them must keep attention inside each document.

`ModelSpec` records what rebuilds the model (kind, config, vocabulary, context length, tied
weights); it is written beside the weights so that `ddptrain.load_model` can rebuild it.

This module imports nothing else of ddptrain.models, so every model module can import it.
"""

from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass, field
import torch
from torch import nn

from ddptrain.contract.outputs import logits_of


class ModelError(ValueError):
    """The configured model cannot be built; the message names the key or path and the rule."""


@dataclass
class ModelSpec:
    """What rebuilds a trained model: written as final/ddptrain_model.json and into checkpoints."""

    kind: str
    """gpt | hf | custom"""
    config: dict
    """The resolved `model` config section."""
    vocab_size: int
    """The data's vocabulary (the model's may be larger: hf)."""
    max_seq_len: int
    """batch.seq_len of the run."""
    class_name: str = ""
    """Fully qualified class of the built module."""
    hf_config: dict | None = None
    """kind=hf: the transformers config (to rebuild from a checkpoint without final/)."""
    tied: dict = field(default_factory=dict)
    """Parameter names that alias another parameter (weight tying): alias -> name stored."""
    base_weights: str | None = None
    """model.lora: the fingerprint (sha256) of the frozen base weights the adapter trains over; a
    resume or a load over other base weights is refused."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ModelSpec":
        return cls(**{key: data[key] for key in cls.__dataclass_fields__ if key in data})


def class_path(module: nn.Module) -> str:
    """`package.module.Class` of `module` (ModelSpec.class_name)."""
    return f"{type(module).__module__}.{type(module).__qualname__}"


def tied_parameters(module: nn.Module) -> dict[str, str]:
    """alias -> first name, for parameters reachable under several names (tied embeddings)."""
    first: dict[int, str] = {}
    tied = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first:
            tied[name] = first[id(param)]
        else:
            first[id(param)] = name
    return tied


def accepts_packed_rows(module: nn.Module) -> bool:
    """True when `module.forward` takes `positions` and `segments` (per-document attention)."""
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return "segments" in params and "positions" in params


def num_parameters(module: nn.Module) -> int:
    """Distinct parameters (tied ones once)."""
    return sum(p.numel() for p in module.parameters())


CONTRACT_TOKENS = 16
"""Positions of the one row the start-up contract check runs the model on (cheap on any model)."""


def check_output_contract(model: nn.Module, inputs, vocab_size: int, what: str) -> None:
    """The model contract on one real microbatch's first row (at most CONTRACT_TOKENS positions):
    `model(inputs)` returns logits (B, T, V) with V >= vocab_size (every token id of the data has a
    column), or an object whose `.logits` has that shape; else a ModelError naming `what` (the
    model's config), the shape it gave and the rule. Eval mode and no grad, so nothing of the run
    changes (no BatchNorm statistics, no dropout draw)."""
    if isinstance(inputs, dict):
        sample = {name: value[:1, :CONTRACT_TOKENS] for name, value in inputs.items()}
        rows, positions = next(iter(sample.values())).shape
    else:
        sample = inputs[:1, :CONTRACT_TOKENS]
        rows, positions = sample.shape
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            output = model(**sample) if isinstance(sample, dict) else model(sample)
    except Exception as error:  # noqa: BLE001 - the user's model: name it and the contract
        raise ModelError(f"{what}: the forward pass on a ({rows}, {positions}) batch of token ids raised "
                         f"{type(error).__name__}: {error} (the model contract: model(inputs) -> logits (B, T, V))") \
            from error
    finally:
        model.train(training)
    logits = output if isinstance(output, torch.Tensor) else getattr(output, "logits", None)
    if not isinstance(logits, torch.Tensor):
        raise ModelError(f"{what} returned {type(output).__name__}, not logits: the model contract is model(inputs) "
                         "-> a tensor (B, T, V) or an object with .logits of that shape")
    shape = tuple(logits.shape)
    if len(shape) != 3 or shape[:2] != (rows, positions) or shape[2] < vocab_size:
        raise ModelError(f"{what} returned logits of shape {shape} for inputs of shape ({rows}, {positions}); the model "
                         f"contract is (B, T) -> (B, T, V) = ({rows}, {positions}, V) with V >= {vocab_size}, the "
                         "data's vocabulary (one column per token id, aligned with the targets: nothing shifts them)")


def head_width_problem(model: nn.Module) -> str | None:
    """For a model that follows the head-loss protocol (ddptrain/contract/outputs.py): None when the
    head it hands `head_loss` is as wide as the logits its forward returns, else both widths in words.
    A head padded past the vocabulary would put its extra columns into the chunked head's softmax
    and train another loss than the logits give. One forward of 4 tokens, eval mode, no grad."""
    parameter = next(model.parameters(), None)
    ids = torch.zeros(1, 4, dtype=torch.long, device=parameter.device if parameter is not None else "cpu")
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            width = logits_of(model(ids)).shape[-1]
            headed = model(ids, head_loss=lambda hidden, head: head(hidden))
    except Exception:  # noqa: BLE001 - a forward that needs more than token ids: its first step will say
        return None
    finally:
        model.train(training)
    head_width = headed.shape[-1] if isinstance(headed, torch.Tensor) else None
    if head_width != width:
        return (f"the head it hands head_loss= gives {head_width} columns but its logits have {width}: the chunked "
                f"head would train on a softmax over {head_width} columns, not the logits' {width}")
    return None


def check_packed_isolation(model: nn.Module, what: str) -> None:
    """Refuse batch.pack unless a packed row computes each document exactly as if it were alone:
    one small forward on CPU of two documents packed in a row (idx, positions, segments) against
    each document on its own row. A forward that takes positions= and segments= but ignores them,
    or an attention that does not honour them, attends across documents; the signature cannot tell,
    this probe does. A forward that raises on packed rows is refused the same way."""
    lengths = (5, 7)
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    vocab = embedding.num_embeddings if embedding is not None else 2
    ids = torch.randint(0, vocab, (1, sum(lengths)), generator=torch.Generator().manual_seed(0))
    segments = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            packed = logits_of(model(idx=ids, positions=positions, segments=segments))
            alone = torch.cat([logits_of(model(idx=ids[:, start:start + n], positions=torch.arange(n)[None],
                                               segments=torch.zeros(1, n, dtype=torch.long)))
                               for start, n in zip((0, lengths[0]), lengths)], dim=1)
    except Exception as error:  # noqa: BLE001 - the user's model, or an attention that cannot take packed rows
        raise ModelError(f"batch.pack=true: {what} fails on packed rows (idx, positions, segments): "
                         f"{type(error).__name__}: {error}; use batch.pack=false") from error
    finally:
        model.train(was_training)
    difference = float((packed.double() - alone.double()).abs().max()) if packed.shape == alone.shape else float("inf")
    if not difference <= 1e-4:
        raise ModelError(f"batch.pack=true: {what} does not keep attention inside each packed document (logits differ "
                         f"by {difference:.3g} from each document alone); use batch.pack=false")
