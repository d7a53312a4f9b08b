"""One adapter per kind of model: everything that differs between the built-in GPT, a local
transformers directory and a `_target_` factory lives here, so the trainer, verify and final/ ask
an adapter and never compare a kind's name.

    adapter = adapter_for(cfg.model)             # from the `model` config section
    model, spec = adapter.build(model_cfg, vocab_size, seq_len)
    adapter.check_model(model, cfg.model, seq_len, pack)
    adapter_of(spec).load_final(directory, spec)  # from a spec written beside the weights

model=hf with model.lora.r > 0 is peft's LoRA over the frozen weights of model.path
(ddptrain.models.lora): final/ is then a PEFT adapter directory, and checkpoints and final/ hold
the adapter alone (`saves_frozen_weights`).

Activation checkpointing (trainer.activation_checkpointing) keeps each block's input and recomputes
the block in backward, non-reentrant (`use_reentrant=False`: under no_sync, with keyword arguments,
restoring the RNG so dropout draws the same mask). The update is unchanged: the recompute runs the
same operations on the same inputs. What it saves and costs: docs/architecture.md.
"""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from ddptrain.models import attention
from ddptrain.models import hf  # imports no transformers by itself: only its functions do
from ddptrain.models import lora  # nor peft
from ddptrain.models.gpt import GPT, GPTConfig
from ddptrain.models.kernel_check import GENERIC_LAYOUT, HeadLayout, TokenMajor
from ddptrain.contract.outputs import takes_head_loss
from ddptrain.models.spec import (ModelError, ModelSpec, accepts_packed_rows, check_packed_isolation, class_path,
                                  tied_parameters)

WEIGHTS_FILE = "model.safetensors"
"""The weights in final/ (every kind: transformers' save_pretrained writes this name too)."""


class ModelAdapter:
    """What one kind of model needs done its own way. Stateless but for CustomAdapter's target."""

    kind: str = ""
    """gpt | hf | custom (ModelSpec.kind)"""

    def default_tokenizer(self, model_cfg: Mapping) -> str | None:
        """The tokenizer of a run with data.tokenizer=null; None: bytes."""
        return None

    def build(self, model_cfg: dict, vocab_size: int, seq_len: int,
              weights: bool = True) -> tuple[nn.Module, ModelSpec]:
        """The module of the `model` config section (a plain dict) and its spec. Seed torch first.
        `weights=False`: the same module (shapes, dtypes, what trains) with no weight file read, for
        the memory plan on the meta device; the built-in GPT never reads one, and a `_target_`
        factory is called as for training (what it reads is its own)."""
        config = dict(model_cfg)
        module = self._new_module(config, vocab_size, seq_len)
        spec = ModelSpec(kind=self.kind, config=config, vocab_size=vocab_size, max_seq_len=seq_len,
                         class_name=class_path(module), tied=tied_parameters(module))
        return module, spec

    def _new_module(self, config: dict, vocab_size: int, seq_len: int) -> nn.Module:
        raise NotImplementedError

    def check_model(self, model: nn.Module, model_cfg: Mapping, seq_len: int, pack: bool) -> None:
        """A ModelError when `model` cannot train as configured (batch.pack, batch.seq_len)."""
        if pack and not accepts_packed_rows(model):
            raise ModelError(f"batch.pack=true needs a model whose forward takes positions= and segments= "
                             f"(attention inside each document); {type(model).__name__}.forward does not; "
                             "use batch.pack=false")
        if pack:  # taking them is not honouring them: the probe HF models get, for every kind
            check_packed_isolation(model, f"{type(model).__name__} ({self.kind} model)")

    def use_attention(self, model: nn.Module, backend: str, forced: bool) -> str:
        """Run packed rows through attention `backend` (ddptrain.models.attention.select_backend);
        returns the backend that runs them (the dense `mask` where the model cannot take another
        and `forced` is False, with a warning; a ModelError where it is forced). The default: a
        `_target_` model whose forward takes `documents=` gets the boundaries with the backend
        set; one that takes only positions= and segments= keeps its own attention."""
        if "documents" not in _forward_parameters(model):
            model.register_forward_pre_hook(_without_documents, with_kwargs=True)
            return "the model's own (its forward takes positions= and segments=)"
        if not hasattr(model, "packed_attention"):  # one hook, whatever backend it is switched to later
            model.register_forward_pre_hook(_documents_through, with_kwargs=True)
        model.packed_attention = backend
        return backend

    def use_head_loss(self, model: nn.Module) -> str | None:
        """Let `model` follow the head-loss protocol (ddptrain/contract/outputs.py) for the chunked
        head; returns why it cannot (None: it does). The built-in GPT does; a `_target_` model does
        when its forward takes head_loss=."""
        if takes_head_loss(model):
            return None
        return f"{type(model).__name__}.forward takes no head_loss= (the head-loss protocol: docs/architecture.md)"

    def head_layout(self, model: nn.Module) -> HeadLayout:
        """The heads its attention layers call the packed-attention kernel with, for the start-up
        check (ddptrain.models.kernel_check); a `_target_` model's are not known: a generic layout."""
        return GENERIC_LAYOUT

    def enable_activation_checkpointing(self, model: nn.Module) -> None:
        """Checkpoint every transformer block of `model` (see the module docstring)."""
        raise NotImplementedError

    def architecture(self, model_cfg: Mapping) -> dict:
        """What defines the architecture beyond the `model` config section (which resume already
        compares key by key), for the run's fingerprint: nothing, but for model=hf."""
        return {}

    def tokenizer_files(self, model_cfg: Mapping, tokenizer: str | None) -> dict[str, Path]:
        """What final/ needs to tokenize like this run, by its name there: data.tokenizer as
        tokenizer.json and its companions beside it (`tokenizer_beside`); nothing for bytes."""
        return tokenizer_beside(tokenizer)

    def save_final(self, module: nn.Module, state_dict: dict[str, torch.Tensor], directory: Path,
                   spec: ModelSpec) -> None:
        """Write the weights into `directory`: model.safetensors, tied aliases stored once."""
        from safetensors.torch import save_file

        stored = {name: tensor.contiguous() for name, tensor in state_dict.items() if name not in spec.tied}
        save_file(stored, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})

    def load_final(self, directory: Path, spec: ModelSpec) -> nn.Module:
        """The module `save_final` wrote into `directory`, in the dtype it was saved in."""
        from safetensors.torch import load_file

        model = self.rebuild(spec)
        load_weights(model, load_file(str(directory / WEIGHTS_FILE)), spec, directory)
        return model

    def rebuild(self, spec: ModelSpec) -> nn.Module:
        """An untrained module of the same shape as the one `spec` describes (for loading weights)."""
        return self._new_module(spec.config, spec.vocab_size, spec.max_seq_len)

    def saves_frozen_weights(self, spec: ModelSpec) -> bool:
        """Whether checkpoints and final/ hold the parameters that do not train (requires_grad False).
        False only where `build` and `rebuild` restore them exactly (model.lora: the base weights of
        model.path, fingerprinted): then both hold the trained parameters alone."""
        return True

    def stop_at(self, model: nn.Module, eos: int | list[int]) -> None:
        """Make `eos` (final/generation_config.json's eos_token_id) the tokens `model`'s generation
        and its export stop at; a `_target_` model has no generation settings: nothing."""


class GPTAdapter(ModelAdapter):
    """model=gpt: the built-in GPT (ddptrain.models.gpt); it takes packed rows."""

    kind = "gpt"

    def _new_module(self, config: dict, vocab_size: int, seq_len: int) -> GPT:
        fields = {key: value for key, value in config.items() if key != "name"}
        return GPT(GPTConfig(vocab_size=vocab_size, max_seq_len=seq_len, **fields))

    def load_final(self, directory: Path, spec: ModelSpec) -> GPT:
        """The GPT with the tokens that end its turns (final/generation_config.json), for its export."""
        model = super().load_final(directory, spec)
        self.stop_at(model, generation_eos(directory))
        return model

    def stop_at(self, model: nn.Module, eos: int | list[int] | None) -> None:
        model.eos_token_id = eos

    def use_attention(self, model: nn.Module, backend: str, forced: bool) -> str:
        backend = attention.without_dropout(backend, model.cfg.dropout, forced)
        model.attention_backend = backend  # every backend runs in GPT's attention
        return backend

    def head_layout(self, model: nn.Module) -> HeadLayout:
        cfg = model.cfg
        dim = cfg.n_embd // cfg.n_head
        # CausalSelfAttention splits one qkv projection: q, k, v are views of it, n_embd apart
        fused = tuple(TokenMajor(3 * cfg.n_embd, dim, part * cfg.n_embd) for part in range(3))
        return HeadLayout(cfg.n_head, cfg.n_head, dim, memory=fused)

    def enable_activation_checkpointing(self, model: nn.Module) -> None:
        model.activation_checkpointing = True  # GPT's own per-block flag


class HFAdapter(ModelAdapter):
    """model=hf: a causal LM from a local transformers directory (ddptrain.models.hf)."""

    kind = "hf"

    def default_tokenizer(self, model_cfg: Mapping) -> str | None:
        found = hf.tokenizer_file(model_cfg["path"])
        return str(found) if found is not None else None

    def build(self, model_cfg: dict, vocab_size: int, seq_len: int,
              weights: bool = True) -> tuple[nn.Module, ModelSpec]:
        """The model of model.path; with model.lora, peft's adapter over it, the base frozen and
        fingerprinted (ddptrain.models.lora). `weights=False`: built from config.json, the weight
        files neither loaded nor hashed (the spec then holds no fingerprint of the base)."""
        config = dict(model_cfg)
        module = hf.load_causal_lm(config["path"], config.get("attn_implementation", "sdpa"), vocab_size, weights)
        hf_config, base_weights = module.config.to_dict(), None
        if lora.is_enabled(config):
            if not hf.has_weights(Path(config["path"]).expanduser()):
                raise ModelError(f"model.lora.r={config['lora']['r']}: model.path={config['path']} has no weights "
                                 f"({', '.join(hf.WEIGHT_FILES)}); LoRA trains an adapter over pretrained weights, "
                                 "set model.lora.r=0 to train every weight from the config")
            base_weights = lora.fingerprint(module) if weights else None
            module = lora.wrap(module, config["lora"], config["path"])
            hf.take_packed_rows(module)
        hf.give_head_loss(module)  # checked by use_head_loss before training (the plan builds on the meta device)
        spec = ModelSpec(kind=self.kind, config=config, vocab_size=vocab_size, max_seq_len=seq_len,
                         class_name=class_path(module), hf_config=hf_config, tied=tied_parameters(module),
                         base_weights=base_weights)
        return module, spec

    def saves_frozen_weights(self, spec: ModelSpec) -> bool:
        return not lora.is_enabled(spec.config)  # LoRA: the frozen base is model.path's, fingerprinted

    def use_attention(self, model: nn.Module, backend: str, forced: bool) -> str:
        """ddptrain's attention function where the probe shows that the architecture passes the
        boundaries on to it (ddptrain.models.hf); else the dense mask (refused when forced)."""
        problem = None
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        backend = attention.without_dropout(backend, getattr(base.config, "attention_dropout", 0.0), forced)
        if backend != "mask":
            implementation = getattr(base, "ddptrain_attn_implementation", base.config._attn_implementation)
            if implementation != "sdpa":
                problem = f"model.attn_implementation={implementation} keeps transformers' own attention"
            else:
                hf.use_packed_attention(model, backend)
                problem = hf.packing_problem(model)
            if problem is None:
                return backend
            if forced:
                raise ModelError(f"trainer.attention={backend}: {type(model).__name__} cannot run it ({problem}); "
                                 "use trainer.attention=auto or mask")
            attention.warn_dense_fallback(f"{type(model).__name__}: {problem}")
        hf.use_packed_attention(model, "mask")
        return "mask"

    def head_layout(self, model: nn.Module) -> HeadLayout:
        return hf.head_layout(model)

    def use_head_loss(self, model: nn.Module) -> str | None:
        """The decoder's hidden states and get_output_embeddings(), where one probe forward shows
        that the head alone gives the logits (ddptrain.models.hf.head_loss_problem)."""
        if not takes_head_loss(model) and not hf.give_head_loss(model):
            return f"{type(model).__name__} has no separate decoder and output embeddings"
        problem = hf.head_loss_problem(model)
        if problem is not None:
            hf.take_back_head_loss(model)
        return problem

    def check_model(self, model: nn.Module, model_cfg: Mapping, seq_len: int, pack: bool) -> None:
        if pack:
            hf.check_packing(model)  # architectures differ in honouring a 4D mask: one probe forward tells
        limit = hf.max_positions(model)
        if limit is not None and seq_len > limit:
            raise ModelError(f"batch.seq_len={seq_len} exceeds the model's context of {limit} "
                             f"positions (model.path={model_cfg['path']})")

    def enable_activation_checkpointing(self, model: nn.Module) -> None:
        hf.enable_activation_checkpointing(model)

    def architecture(self, model_cfg: Mapping) -> dict:
        """model.path's config.json, but for what says where or by which version it was written."""
        config = json.loads((Path(model_cfg["path"]).expanduser() / "config.json").read_text())
        return {key: value for key, value in config.items() if key not in ("_name_or_path", "transformers_version")}

    def tokenizer_files(self, model_cfg: Mapping, tokenizer: str | None) -> dict[str, Path]:
        """The model directory's tokenizer files, unless the run used another tokenizer (then that one
        as tokenizer.json, with its companions)."""
        source = Path(model_cfg["path"]).expanduser()
        if tokenizer not in (None, "byte") and \
                Path(tokenizer).expanduser().resolve() != (source / "tokenizer.json").resolve():
            return tokenizer_beside(tokenizer)
        return {name: source / name for name in hf.TOKENIZER_FILES if (source / name).is_file()}

    def save_final(self, module: nn.Module, state_dict: dict[str, torch.Tensor], directory: Path,
                   spec: ModelSpec) -> None:
        """A save_pretrained directory; with model.lora, a PEFT adapter directory (the adapter alone)."""
        if lora.is_enabled(spec.config):
            lora.save_adapter(module, state_dict, directory)
        else:
            hf.save_pretrained(module, state_dict, directory)  # exactly a save_pretrained directory

    def load_final(self, directory: Path, spec: ModelSpec) -> nn.Module:
        if lora.is_enabled(spec.config):  # what PeftModel.from_pretrained(base, final) gives
            base = self._base(spec, directory)
            eos = generation_eos(directory)  # final/'s, where the run's data says which tokens end a turn
            if eos is not None:
                self.stop_at(base, eos)
            model = lora.load_adapter(base, directory)
            model.config.use_cache = True
            return model
        return hf.load_pretrained_dir(directory)

    def stop_at(self, model: nn.Module, eos: int | list[int]) -> None:
        """The model's (a LoRA run's: its base's) generation_config stops at `eos` too, as final/'s
        generation_config.json adds `eos` to save_pretrained's."""
        base = model.get_base_model() if lora.is_adapted(model) else model
        base.generation_config.eos_token_id = merge_eos(base.generation_config.eos_token_id, eos)

    def rebuild(self, spec: ModelSpec) -> nn.Module:
        """A fresh model of the spec's architecture; with model.lora, model.path's base (checked
        against the spec's fingerprint) with a fresh adapter."""
        if lora.is_enabled(spec.config):
            model = lora.wrap(self._base(spec, spec.config["path"]), spec.config["lora"], spec.config["path"])
            model.config.use_cache = True
            return model
        return hf.from_config_dict(spec.hf_config)

    @staticmethod
    def _base(spec: ModelSpec, what) -> nn.Module:
        """model.path's base weights, the same ones the run trained over, in fp32 as the run trained
        them (hf.load_causal_lm): a base stored in bf16 gives the trained module, and merges in fp32."""
        path = Path(spec.config["path"]).expanduser()
        if not path.is_dir():  # transformers would take the path for a Hub repo id and say that instead
            raise ModelError(f"{what} is a LoRA adapter over model.path={path}, which is not there (any more): put "
                             "the base model it was trained over back at that path; the adapter holds the LoRA "
                             "weights only")
        try:
            base = hf.load_pretrained_dir(path, dtype=torch.float32)
        except (OSError, ValueError) as error:
            raise ModelError(f"{what} is a LoRA adapter over model.path={path}, which cannot be loaded: "
                             f"{str(error).splitlines()[0]}") from None
        lora.check_fingerprint(base, spec.base_weights, path, str(what))
        lora.check_base_config(base, spec.hf_config, path, str(what))
        return base


class CustomAdapter(ModelAdapter):
    """model._target_: any factory returning an nn.Module, called Hydra's instantiate way."""

    kind = "custom"

    def __init__(self, target: str = ""):
        self.target = target
        """model._target_ (for messages)."""

    def _new_module(self, config: dict, vocab_size: int, seq_len: int) -> nn.Module:
        """`_target_` is called with the other keys as keyword arguments. `vocab_size` and
        `max_seq_len` are passed too when the factory takes them and the config does not set them:
        the data decides the vocabulary."""
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
                             f"{', '.join(params)}); with model=custom only the factory's arguments belong under "
                             "model.*")
        try:
            module = factory(**kwargs)
        except Exception as error:  # noqa: BLE001 - the user's code: its error is theirs to fix, named
            raise ModelError(f"model._target_={target} raised {type(error).__name__}: {error} (called with "
                             f"{', '.join(sorted(kwargs)) or 'no arguments'})") from error
        if not isinstance(module, nn.Module):
            raise ModelError(f"model._target_={target} returned {type(module).__name__}, not a torch.nn.Module")
        return module

    def enable_activation_checkpointing(self, model: nn.Module) -> None:
        """The built-in GPT's flag if the factory returned one; else transformers' convention,
        `gradient_checkpointing_enable` (per decoder layer); else a ModelError, since only the
        module knows where its blocks are."""
        if isinstance(model, GPT):
            GPTAdapter().enable_activation_checkpointing(model)
        elif callable(getattr(model, "gradient_checkpointing_enable", None)):
            hf.enable_activation_checkpointing(model)
        else:
            raise ModelError(f"trainer.activation_checkpointing=true: {type(model).__name__} (model._target_="
                             f"{self.target}) has no gradient_checkpointing_enable(gradient_checkpointing_kwargs=...) "
                             "method, so ddptrain does not know its blocks; add that method (transformers' "
                             "convention, e.g. wrapping each block in torch.utils.checkpoint.checkpoint(..., "
                             "use_reentrant=False)) or set trainer.activation_checkpointing=false")


def _forward_parameters(model: nn.Module):
    try:
        return inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}


def _without_documents(module: nn.Module, args: tuple, kwargs: dict):
    """A `_target_` model that takes positions= and segments= only: the boundaries are not its business."""
    if "documents" not in kwargs:
        return None
    return args, {key: value for key, value in kwargs.items() if key != "documents"}


def _documents_through(module: nn.Module, args: tuple, kwargs: dict):
    """The boundaries of a `_target_` model's packed rows, run through its `packed_attention` backend."""
    documents = kwargs.get("documents")
    if documents is None or documents.backend is not None:
        return None
    return args, {**kwargs, "documents": documents.using(module.packed_attention)}


NAMED = {"gpt": GPTAdapter, "hf": HFAdapter}
"""model.name -> adapter (a `_target_` factory is CustomAdapter whatever its name)."""


def adapter_for(model_cfg: Mapping) -> ModelAdapter:
    """The adapter of the `model` config section (a plain dict or a DictConfig): `_target_` present
    is a custom factory, else model.name picks (absent: the built-in GPT)."""
    if "_target_" in model_cfg:
        return CustomAdapter(str(model_cfg["_target_"]))
    name = model_cfg.get("name") or "gpt"
    if name not in NAMED:
        raise ModelError(f"model.name={name!r} is not one of {', '.join(NAMED)} "
                         "(or give model._target_=pkg.module.factory for your own model)")
    return NAMED[name]()


def adapter_of(spec: ModelSpec) -> ModelAdapter:
    """The adapter of the model `spec` describes (spec.kind, as written beside its weights)."""
    if spec.kind == CustomAdapter.kind:
        return CustomAdapter(spec.config.get("_target_", spec.class_name))
    if spec.kind not in NAMED:
        raise ModelError(f"model spec kind={spec.kind!r} is not one of {', '.join([*NAMED, CustomAdapter.kind])} "
                         f"(class {spec.class_name}); was it written by a newer ddptrain?")
    return NAMED[spec.kind]()


def enable_activation_checkpointing(module: nn.Module, spec: ModelSpec) -> nn.Module:
    """Checkpoint every transformer block of `module` (built as `spec` says); returns `module`."""
    adapter_of(spec).enable_activation_checkpointing(module)
    return module


def resolve_target(target: str):
    """The callable at the dotted path `target` (`pkg.module.factory` or `pkg.module.Class`)."""
    module_name, _, attr = target.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as error:
        raise ModelError(f"model._target_={target!r} cannot be imported: {error} "
                         "(is its package on PYTHONPATH / installed?)") from None


def tokenizer_beside(tokenizer: str | None) -> dict[str, Path]:
    """data.tokenizer as final/'s tokenizer.json, whatever its own name (export and serving read that
    name), and the companions beside it that transformers' AutoTokenizer reads with it (EOS,
    special tokens, chat template: hf.TOKENIZER_COMPANIONS); nothing for the byte tokenizer."""
    if tokenizer in (None, "byte"):
        return {}
    file = Path(tokenizer).expanduser()
    companions = {name: file.parent / name for name in hf.TOKENIZER_COMPANIONS if (file.parent / name).is_file()}
    return {"tokenizer.json": file, **companions}


GENERATION_CONFIG = "generation_config.json"
"""transformers' generation settings, where final/ records the tokens that end what the model writes."""


def generation_eos(directory: Path) -> int | list[int] | None:
    """eos_token_id of `directory`'s generation_config.json (None: no file, or none in it)."""
    try:
        return json.loads((directory / GENERATION_CONFIG).read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return None


def merge_eos(eos: int | list[int] | None, more: int | list[int] | None) -> int | list[int] | None:
    """The tokens of both eos_token_id values, sorted, in transformers' form (one id alone is an int)."""
    ids = sorted({*_ids(eos), *_ids(more)})
    return None if not ids else ids[0] if len(ids) == 1 else ids


def _ids(eos: int | list[int] | None) -> list[int]:
    return [] if eos is None else list(eos) if isinstance(eos, list) else [eos]


def load_weights(model: nn.Module, state: dict[str, torch.Tensor], spec: ModelSpec, source: Path) -> None:
    """Load `state` (all weights, tied aliases possibly left out, and the frozen ones where the kind
    restores them: `saves_frozen_weights`) into `model`, in `state`'s dtype.

    Weights that do not fit the module `spec` rebuilds (names missing or left over, or a shape
    that differs: a factory changed since the run, a hand-edited spec) are a ModelError naming
    `source`, which the commands report like their other model errors (exit code 2, no traceback)."""
    dtype = next(iter(state.values())).dtype if state else torch.float32
    model.to(dtype=dtype)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as error:  # non-strict loading still refuses a shape that differs
        mismatches = [line.strip().rstrip(".") for line in str(error).splitlines()[1:] if line.strip()]
        raise ModelError(f"{source}: the weights do not fit {spec.class_name} ({len(mismatches)} differ: "
                         f"{'; '.join(mismatches[:3])})") from None
    restored = set() if adapter_of(spec).saves_frozen_weights(spec) else \
        {name for name, param in model.named_parameters(remove_duplicate=False) if not param.requires_grad}
    missing = [name for name in missing if name not in spec.tied and name not in restored]
    if missing or unexpected:
        raise ModelError(f"{source}: the weights do not fit {spec.class_name} (missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]})")
