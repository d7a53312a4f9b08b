"""model=hf: any causal LM that transformers' AutoModelForCausalLM knows, from a local directory.

transformers is an optional extra (`pip install 'ddptrain[hf]'`) imported only here. Nothing is
ever downloaded: the directory must hold config.json (and weights to fine-tune from; without them
the model is initialised from the config with run.seed).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from torch import nn

from ddptrain.models.spec import ModelError, check_packed_isolation

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")


def _transformers():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files only, whatever the call site says
    try:
        import transformers
    except ImportError:
        raise ModelError("model=hf needs transformers: pip install 'ddptrain[hf]'") from None
    return transformers


def has_weights(path: Path) -> bool:
    return any((path / name).is_file() for name in WEIGHT_FILES)


def tokenizer_file(path: str | Path) -> Path | None:
    """The directory's tokenizer.json, if it has one."""
    file = Path(path).expanduser() / "tokenizer.json"
    return file if file.is_file() else None


def load_causal_lm(path: str, attn_implementation: str, vocab_size: int) -> nn.Module:
    """Weights from `path` if it has them (fine-tuning), else a fresh model from its config.json."""
    transformers = _transformers()
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise ModelError(f"model.path={path}: no such directory (model=hf loads local files only, never downloads)")
    if not (directory / "config.json").is_file():
        raise ModelError(f"model.path={path}: no config.json in the directory (a transformers model directory "
                         "holds config.json, and weights to fine-tune from)")
    try:
        if has_weights(directory):
            model = transformers.AutoModelForCausalLM.from_pretrained(
                directory, local_files_only=True, attn_implementation=attn_implementation, dtype=torch.float32)
        else:
            config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
            model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation,
                                                                  dtype=torch.float32)
    except (ValueError, OSError, KeyError) as error:
        raise ModelError(f"model.path={path}: transformers cannot build a causal LM from it: "
                         f"{str(error).splitlines()[0]}") from None
    _prepare_for_training(model)
    model_vocab = model.get_input_embeddings().num_embeddings
    if model_vocab < vocab_size:
        raise ModelError(f"model.path={path}: the model's vocabulary ({model_vocab} ids) does not cover the "
                         f"tokenizer's ({vocab_size} ids); use the model's own tokenizer (data.tokenizer) or a "
                         "model with a larger vocabulary")
    return model


def from_config_dict(config: dict) -> nn.Module:
    """A fresh model of the architecture `config` (a transformers config as a dict) describes."""
    transformers = _transformers()
    config = dict(config)
    model_type = config.pop("model_type")
    hf_config = transformers.AutoConfig.for_model(model_type, **config)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    model.config.use_cache = True
    return model


def load_pretrained_dir(directory: Path) -> nn.Module:
    """A save_pretrained directory (final/), in the dtype it was saved in."""
    transformers = _transformers()
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype="auto")
    return model


def _prepare_for_training(model: nn.Module) -> None:
    # from_pretrained returns the model in eval mode: dropout off, and activation checkpointing
    # (active only while training) silently off too.
    model.train()
    # A training forward needs no key/value cache: building one costs memory and time.
    model.config.use_cache = False
    take_packed_rows(model)


def take_packed_rows(module: nn.Module) -> None:
    """Let `module` (a transformers model, or a peft model around one) take packed rows: idx,
    positions and segments become input_ids, position_ids and a 4D attention mask. A wrapper needs
    its own hook: peft's forward passes unknown keyword arguments on beside input_ids=None."""
    module.register_forward_pre_hook(_packed_rows_to_hf, with_kwargs=True)


def enable_activation_checkpointing(model: nn.Module) -> None:
    """transformers' per-layer checkpointing, non-reentrant (keyword arguments, no_sync and
    inputs without grad all work with it). transformers 5 renamed gradient_checkpointing_enable
    to activation_checkpointing_enable and deprecated the old name; older versions have only it."""
    kwargs = {"use_reentrant": False}
    try:
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    except ValueError as error:  # "... does not support activation checkpointing"
        raise ModelError(f"trainer.activation_checkpointing=true: {error}") from None


def max_positions(model: nn.Module) -> int | None:
    config = model.config
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def document_mask(segments: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive (B, 1, T, T) mask: causal and inside one document (0 allowed, dtype's min masked)."""
    seq = segments.size(1)
    causal = torch.ones(seq, seq, dtype=torch.bool, device=segments.device).tril()
    allowed = (segments[:, :, None] == segments[:, None, :]) & causal
    mask = torch.zeros(allowed.shape, dtype=dtype, device=segments.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def _packed_rows_to_hf(module: nn.Module, args: tuple, kwargs: dict):
    """Packed rows come as idx/positions/segments; transformers takes input_ids, position_ids and
    a 4D attention mask (which its masking code uses as given)."""
    if "segments" not in kwargs:
        return None
    kwargs = dict(kwargs)
    input_ids = kwargs.pop("idx") if "idx" in kwargs else args[0]
    dtype = next(module.parameters()).dtype
    kwargs["attention_mask"] = document_mask(kwargs.pop("segments"), dtype)
    kwargs["position_ids"] = kwargs.pop("positions")
    return (), {"input_ids": input_ids, **kwargs}


def check_packing(model: nn.Module) -> None:
    """Refuse packing unless a packed row computes each document exactly as if it were alone.

    Architectures differ in whether they honour a custom 4D mask and position ids (and some, like
    Bloom's eager attention, raise on one); the probe every model kind gets tells, instead of
    silently attending across documents."""
    check_packed_isolation(model, f"{type(model).__name__} with attn_implementation="
                                  f"{model.config._attn_implementation}")


def save_pretrained(model: nn.Module, state_dict: dict[str, torch.Tensor], out_dir: Path) -> None:
    """A transformers directory (config.json + model.safetensors) with these weights."""
    model.config.use_cache = True  # the saved model is for inference
    try:
        model.save_pretrained(out_dir, state_dict=state_dict)
    finally:
        model.config.use_cache = False


def copy_tokenizer_files(source_dir: Path, out_dir: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (source_dir / name).is_file():
            shutil.copy2(source_dir / name, out_dir / name)
            copied.append(name)
    return copied
