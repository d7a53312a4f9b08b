"""model.lora: a LoRA adapter through peft (the library made for it) over a frozen model=hf base.

    model = wrap(base, lora_cfg, base_path)       # peft's PeftModelForCausalLM: only lora_A / lora_B train
    save_adapter(model, state_dict, directory)    # a PEFT adapter directory: adapter_config.json + weights
    load_adapter(base, directory)                 # what peft.PeftModel.from_pretrained(base, directory) gives

peft wraps every targeted linear layer in a `lora.Linear` that computes `W x + (alpha / r) B A x`
with A (r x in) random and B (out x r) zero at the start, so training starts from the base's
function, and freezes every other parameter (`requires_grad=False`): the optimizer holds only A
and B, and DDP, FSDP and ZeRO reduce only their gradients. The frozen base is rebuilt from
model.path, never saved again: checkpoints and final/ hold the adapter (and its optimizer state)
alone. `fingerprint(base)` is what says the base is the same one: a resume or a load over other
base weights, or under an edited config.json (`check_base_config`), is refused.

peft is optional (`pip install 'ddptrain[hf]'`) and imported only here, when model.lora.r > 0.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from ddptrain.models.spec import ModelError, tied_parameters

ALL_LINEAR = "all-linear"
"""peft's name for every linear layer but the output head: attention and MLP projections."""


def is_enabled(model_cfg: Mapping) -> bool:
    """Whether the `model` config section asks for LoRA (model.lora.r > 0)."""
    lora = model_cfg.get("lora") or {}
    return bool(lora.get("r"))


def _peft():
    try:
        import peft
    except ImportError:
        raise ModelError("model.lora.r > 0 needs peft: pip install 'ddptrain[hf]'") from None
    return peft


def fingerprint(base: nn.Module) -> str:
    """sha256 of the base weights: every state-dict entry's name, shape and values (floating ones as
    fp32, so a base stored in bf16 and loaded in fp32 for training has the fingerprint it has loaded
    in bf16). Hashes each tensor's bytes in place; about a second per GB."""
    digest = hashlib.sha256()
    for name, tensor in sorted(base.state_dict().items()):
        values = tensor.detach()
        if values.is_floating_point():
            values = values.to(torch.float32)
        values = values.cpu().contiguous().reshape(-1)
        digest.update(f"{name}:{tuple(tensor.shape)}:{values.dtype}\n".encode())
        digest.update(values.view(torch.uint8).numpy().data)
    return digest.hexdigest()


def check_fingerprint(base: nn.Module, expected: str | None, path: str | Path, what: str) -> None:
    """A ModelError when the base at `path` is not the one the adapter of `what` was trained on."""
    if expected is None:
        return
    found = fingerprint(base)
    if found != expected:
        raise ModelError(f"{what} is a LoRA adapter trained over other base weights than those now at "
                         f"model.path={path} (sha256 {found[:12]}..., trained on {expected[:12]}...); put the "
                         "original base weights back at that path")


_UNCOMPARED = ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache")
"""config.json keys that say where, by which version or in which dtype a base was saved, or how it
decodes: the same base function whatever their values."""


def check_base_config(base: nn.Module, trained: Mapping | None, path: str | Path, what: str) -> None:
    """A ModelError naming each config key of `base` (model.path's, as loaded) whose value is not the
    one the adapter of `what` was trained with (`trained`: the run's ModelSpec.hf_config): an edited
    rms_norm_eps or rope_theta is another function of the same weights, refused as a resume refuses
    it. Keys that only one side knows (another transformers version) are not compared."""
    if not trained:
        return
    # Both as the spec is stored (JSON: str keys), whether `trained` was read back or is a live run's
    now = json.loads(json.dumps(base.config.to_dict(), default=str))
    trained = json.loads(json.dumps(dict(trained), default=str))
    changed = [f"{key}: {trained[key]!r} -> {now[key]!r}" for key in sorted(set(trained) & set(now))
               if key not in _UNCOMPARED and trained[key] != now[key]]
    if changed:
        raise ModelError(f"{what} is a LoRA adapter trained over the base at model.path={path} with another "
                         f"config.json ({'; '.join(changed)}); its logits would not be the trained ones. Put the "
                         "base's original config.json back")


def wrap(base: nn.Module, lora_cfg: Mapping, base_path: str | Path) -> nn.Module:
    """`base` with a LoRA adapter on model.lora.target_modules; every base parameter frozen."""
    peft = _peft()
    targets = lora_cfg.get("target_modules") or ALL_LINEAR
    targets = targets if isinstance(targets, str) else [str(name) for name in targets]
    if not isinstance(targets, str):
        check_targets(base, targets, base_path)
    config = peft.LoraConfig(r=int(lora_cfg["r"]), lora_alpha=float(lora_cfg.get("alpha", 16.0)),
                             lora_dropout=float(lora_cfg.get("dropout", 0.0)), target_modules=targets,
                             task_type="CAUSAL_LM")
    try:
        with _quiet():
            model = peft.get_peft_model(base, config)
    except ValueError as error:  # "Target modules {...} not found in the base model"
        raise ModelError(f"model.lora.target_modules={targets!r}: {str(error).splitlines()[0]}") from None
    # Where PeftModel.from_pretrained(final) and AutoPeftModelForCausalLM find the base: absolute,
    # so final/ loads from any working directory.
    model.peft_config["default"].base_model_name_or_path = str(Path(base_path).expanduser().resolve())
    return model


ADAPTABLE = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d)
"""The layers peft's LoRA adapts (and transformers' GPT-2 style Conv1D, matched by name)."""


def _is_adaptable(module: nn.Module) -> bool:
    return isinstance(module, ADAPTABLE) or type(module).__name__ == "Conv1D"


def check_targets(base: nn.Module, targets: list[str], base_path: str | Path) -> None:
    """A ModelError unless every name of model.lora.target_modules names adaptable layers of `base`
    as peft matches them (a module's full name, or its last components): peft itself trains
    without a misspelt name as long as one other matches, and names the module class alone."""
    modules = dict(base.named_modules())
    for target in targets:
        matched = [name for name in modules if name == target or name.endswith("." + target)]
        if not matched:
            names = sorted({name.rpartition(".")[2] for name, module in modules.items() if _is_adaptable(module)})
            raise ModelError(f"model.lora.target_modules={targets!r}: {target!r} matches no module of the model "
                             f"at model.path={base_path}; its adaptable layers are named: {', '.join(names)}")
        other = [name for name in matched if not _is_adaptable(modules[name])]
        if other:
            kinds = sorted({type(modules[name]).__name__ for name in other})
            more = f" and {len(other) - 1} more" if len(other) > 1 else ""
            raise ModelError(f"model.lora.target_modules={targets!r}: {target!r} matches {', '.join(kinds)} "
                             f"modules ({other[0]}{more}); LoRA adapts Linear, Embedding and Conv layers only")


@contextlib.contextmanager
def _quiet():
    """peft still asks transformers 5 for `is_gradient_checkpointing` (deprecated, renamed): not the user's to fix."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def trainable_parameters(model: nn.Module) -> tuple[int, int]:
    """(parameters that train, all parameters)."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def save_adapter(model: nn.Module, state_dict: dict[str, torch.Tensor], directory: Path) -> None:
    """A PEFT adapter directory of `state_dict`'s adapter weights (the wrapped model's names;
    frozen base weights may be absent): adapter_config.json, adapter_model.safetensors."""
    # save_embedding_layers=False: "auto" would look for the base's config.json on the Hub.
    model.save_pretrained(directory, state_dict=state_dict, save_embedding_layers=False)


def load_adapter(base: nn.Module, directory: Path) -> nn.Module:
    """peft.PeftModel.from_pretrained(base, directory), on the CPU (peft would pick a GPU)."""
    peft = _peft()
    with _quiet():
        return peft.PeftModel.from_pretrained(base, directory, is_trainable=False, torch_device="cpu")


def merge(model: nn.Module) -> nn.Module:
    """The base model with each adapter folded into its weight (W + (alpha / r) B A): a plain
    transformers model (peft's merge_and_unload), with the adapted model's logits. An adapter on a
    weight that two layers share (the head and the input embeddings of a tie_word_embeddings model)
    would be folded into both: that tie is cut first (peft issue 2777)."""
    _untie_adapted(model.get_base_model())
    return model.merge_and_unload()


def _untie_adapted(base: nn.Module) -> None:
    """Give every alias of a tied weight under an adapted layer (peft's `base_layer`) its own copy,
    and tell the config so: save_pretrained then writes both, and from_pretrained ties nothing."""
    untied = False
    for alias, first in tied_parameters(base).items():
        if ".base_layer." in f".{alias}" or ".base_layer." in f".{first}":
            owner, _, name = alias.rpartition(".")
            module = base.get_submodule(owner)
            setattr(module, name, nn.Parameter(getattr(module, name).detach().clone(), requires_grad=False))
            untied = True
    if untied:
        base.config.tie_word_embeddings = False
        base.config.get_text_config().tie_word_embeddings = False  # composite configs keep it in their text part


def is_adapted(model: nn.Module) -> bool:
    """Whether `model` is a peft model (an adapter over a base); peft not imported: it cannot be."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)
