"""Build the configured model: the built-in GPT, a local Hugging Face causal LM, or any factory.

The model contract (the same for all three): `model(inputs)` maps token ids (B, T) to logits
(B, T, V) aligned with the targets, or returns an object with `.logits` (a transformers
ModelOutput). ddptrain's data already pairs each input with its next-token target, so nothing
shifts labels and no extra (B, T, V) copy is made. Packed rows arrive as keyword arguments
`idx`, `positions` (restarting at 0 per document) and `segments` (a document id per token); a
model that takes them must keep attention inside each document.

`ModelSpec` records what rebuilds the model (kind, config, vocabulary, context length, tied
weights); it is written beside the weights so that `ddptrain.load_model` can rebuild it.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ddptrain.models.gpt import GPT, GPTConfig


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

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ModelSpec":
        return cls(**{key: data[key] for key in cls.__dataclass_fields__ if key in data})


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


def build_model(model_cfg: dict, vocab_size: int, seq_len: int) -> tuple[nn.Module, ModelSpec]:
    """The module of the `model` config section (a plain dict) and its spec. Seed torch first."""
    config = dict(model_cfg)
    if "_target_" in config:
        module, kind = _build_custom(config, vocab_size, seq_len), "custom"
        hf_config = None
    elif config.get("name") == "hf":
        from ddptrain.models import hf  # transformers is imported only for model=hf

        module, kind = hf.load_causal_lm(config["path"], config.get("attn_implementation", "sdpa"), vocab_size), "hf"
        hf_config = module.config.to_dict()
    else:
        module, kind = _build_gpt(config, vocab_size, seq_len), "gpt"
        hf_config = None
    spec = ModelSpec(kind=kind, config=config, vocab_size=vocab_size, max_seq_len=seq_len,
                     class_name=f"{type(module).__module__}.{type(module).__qualname__}", hf_config=hf_config,
                     tied=tied_parameters(module))
    return module, spec


def _build_gpt(config: dict, vocab_size: int, seq_len: int) -> GPT:
    fields = {key: value for key, value in config.items() if key != "name"}
    return GPT(GPTConfig(vocab_size=vocab_size, max_seq_len=seq_len, **fields))


def resolve_target(target: str):
    """The callable at the dotted path `target` (`pkg.module.factory` or `pkg.module.Class`)."""
    module_name, _, attr = target.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as error:
        raise ModelError(f"model._target_={target!r} cannot be imported: {error} "
                         "(is its package on PYTHONPATH / installed?)") from None


def _build_custom(config: dict, vocab_size: int, seq_len: int) -> nn.Module:
    """Hydra's instantiate convention: `_target_` is called with the other keys as keyword arguments.

    `vocab_size` and `max_seq_len` are passed too when the factory takes them and the config does
    not set them: the data decides the vocabulary.
    """
    target = config["_target_"]
    factory = resolve_target(target)
    kwargs = {key: value for key, value in config.items() if not (key.startswith("_") and key.endswith("_"))}
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    for name, value in (("vocab_size", vocab_size), ("max_seq_len", seq_len)):
        if name in params and name not in kwargs:
            kwargs[name] = value
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    unknown = [key for key in kwargs if params and not takes_any and key not in params]
    if unknown:
        raise ModelError(f"model._target_={target} does not take {', '.join(unknown)} (its arguments: "
                         f"{', '.join(params)}); with model=custom only the factory's arguments belong under model.*")
    module = factory(**kwargs)
    if not isinstance(module, nn.Module):
        raise ModelError(f"model._target_={target} returned {type(module).__name__}, not a torch.nn.Module")
    return module


def rebuild_model(spec: ModelSpec) -> nn.Module:
    """An untrained module of the same shape as the one `spec` describes (for loading weights)."""
    if spec.kind == "gpt":
        return _build_gpt(spec.config, spec.vocab_size, spec.max_seq_len)
    if spec.kind == "custom":
        return _build_custom(spec.config, spec.vocab_size, spec.max_seq_len)
    from ddptrain.models import hf

    return hf.from_config_dict(spec.hf_config)


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


def logits_of(output: Any) -> torch.Tensor:
    """The model contract: logits, or an object with `.logits` (a transformers ModelOutput)."""
    return output if isinstance(output, torch.Tensor) else output.logits
