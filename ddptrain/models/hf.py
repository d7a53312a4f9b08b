"""model=hf: any causal LM that transformers' AutoModelForCausalLM knows, from a local directory.

transformers is an optional extra (`pip install 'ddptrain[hf]'`) imported only here. Nothing is
ever downloaded: the directory must hold config.json (and weights to fine-tune from; without them
the model is initialised from the config with run.seed).

Packed rows reach the model through transformers' own extension points: an attention function
registered with `AttentionInterface` under PACKED_ATTENTION (its mask function, registered with
`AttentionMaskInterface`, is transformers' sdpa_mask) receives the rows' document boundaries as a
keyword argument (`documents`, passed down by the model's forward like `cu_seq_lens_q` is for
DataCollatorWithFlattening) and runs them through ddptrain's backend (ddptrain/models/attention.py).
Beside the boundaries goes a stand-in 4D mask, a broadcast view of one element (no T x T memory):
transformers returns a 4D mask as given, so it builds no mask and does not search the position ids
for packed sequences (which reads a flag back from the device and builds a dense mask).
Forwards without boundaries (unpacked rows, with or without a padding mask) are exactly
attn_implementation=sdpa's. model.attn_implementation=eager, and architectures whose attention
cannot take the boundaries (the probe tells: the stand-in alone would attend across documents),
keep the dense 4D mask (backend `mask`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import types
from pathlib import Path

import torch
from torch import nn

from ddptrain.contract.boundaries import DocumentBoundaries
from ddptrain.models import attention
from ddptrain.models.kernel_check import HeadLayout, TokenMajor
from ddptrain.models.spec import ModelError

PACKED_ATTENTION = "ddptrain_packed"
"""The attn_implementation name of ddptrain's attention function (AttentionInterface)."""

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")
TOKENIZER_COMPANIONS = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja")
"""What transformers' AutoTokenizer reads beside a tokenizer.json: EOS and other special tokens, the chat template."""


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


def load_causal_lm(path: str, attn_implementation: str, vocab_size: int, weights: bool = True) -> nn.Module:
    """Weights from `path` if it has them (fine-tuning), else a fresh model from its config.json.
    `weights=False`: from config.json whatever the directory holds, no weight file opened (the
    memory plan builds so on the meta device, where from_pretrained refuses to run)."""
    transformers = _transformers()
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise ModelError(f"model.path={path}: no such directory (model=hf loads local files only, never downloads)")
    if not (directory / "config.json").is_file():
        raise ModelError(f"model.path={path}: no config.json in the directory (a transformers model directory "
                         "holds config.json, and weights to fine-tune from)")
    try:
        if weights and has_weights(directory):
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


def load_pretrained_dir(directory: Path, dtype: torch.dtype | str = "auto") -> nn.Module:
    """A save_pretrained directory (final/), in the dtype it was saved in (or `dtype`)."""
    transformers = _transformers()
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=dtype)
    return model


def _prepare_for_training(model: nn.Module) -> None:
    # from_pretrained returns the model in eval mode: dropout off, and activation checkpointing
    # (active only while training) silently off too.
    model.train()
    # A training forward needs no key/value cache: building one costs memory and time.
    model.config.use_cache = False
    take_packed_rows(model)
    model.packed_attention = "mask"  # until the trainer picks its backend (use_packed_attention)


def take_packed_rows(module: nn.Module) -> None:
    """Let `module` (a transformers model, or a peft model around one) take packed rows: idx,
    positions, segments and documents become input_ids, position_ids and either the boundaries
    for ddptrain's attention function or a 4D mask (`use_packed_attention`). A wrapper needs its
    own hook: peft's forward passes unknown keyword arguments on beside input_ids=None."""
    module.register_forward_pre_hook(_packed_rows_to_hf, with_kwargs=True)


def use_packed_attention(model: nn.Module, backend: str) -> None:
    """Run packed rows through `backend` (gather | varlen | flex: ddptrain's attention function;
    mask: the dense 4D mask through the model's own attn_implementation). `model` may be a peft
    wrapper: its base model's attention is switched, and both carry the backend."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not hasattr(base, "ddptrain_attn_implementation"):
        base.ddptrain_attn_implementation = base.config._attn_implementation  # what unpacked rows asked for
    if backend == "mask":
        base.set_attn_implementation(base.ddptrain_attn_implementation)
    else:
        _register_packed_attention()
        base.set_attn_implementation(PACKED_ATTENTION)
    for module in {id(model): model, id(base): base}.values():
        module.packed_attention = backend
    base.__dict__.pop(_PROBE_KEPT, None)  # the last probe spoke of the attention this call replaced


def _register_packed_attention() -> None:
    transformers = _transformers()
    from transformers.masking_utils import sdpa_mask

    transformers.AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)
    transformers.AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)


def packed_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                             documents: DocumentBoundaries | None = None, sliding_window: int | None = None,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: q (B, H, T, d), k and v (B, Hkv, T, d) -> ((B, T, H, d), None).
    With `documents`, attention stays inside each document (the mask is the stand-in); without,
    transformers' own sdpa attention with the mask it built."""
    if documents is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    unsupported = [name for name in ("softcap", "s_aux") if kwargs.get(name) is not None]
    if unsupported or not getattr(module, "is_causal", True):
        what = ", ".join(unsupported) if unsupported else "non-causal attention"
        raise attention.AttentionError(f"ddptrain's packed attention does not implement {what}")
    return attention.attend(query, key, value, documents, scaling, dropout, sliding_window), None


def give_head_loss(model: nn.Module) -> bool:
    """Let `model` (a transformers causal LM, or a peft model around one) follow the head-loss
    protocol (ddptrain/contract/outputs.py): with `head_loss=`, its forward runs the decoder
    (`base_model`) and hands the last hidden states and `get_output_embeddings()` (tied or not, LoRA
    on it or not) to head_loss, instead of making logits. Installed as a method bound to the model
    instance (a deep copy rebinds it to the copy); a forward without head_loss is the class's own.
    False where the architecture has no separate decoder and output layer. Whether the head alone
    gives the logits (no soft-capping or scaling after it) is `head_loss_problem`'s to say."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if base.base_model is base or base.get_output_embeddings() is None:
        return False
    base.forward = types.MethodType(_forward_with_head_loss, base)
    if model is not base:
        model.passes_head_loss = True  # peft's forward passes unknown keyword arguments on to the base
    return True


def take_back_head_loss(model: nn.Module) -> None:
    """Undo `give_head_loss`: the forward is the class's own again."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.__dict__.pop("forward", None)
    model.__dict__.pop("passes_head_loss", None)


def _forward_with_head_loss(self: nn.Module, *args, head_loss=None, **kwargs):
    if head_loss is None:
        return type(self).forward(self, *args, **kwargs)
    if kwargs.pop("labels", None) is not None:
        raise ValueError("head_loss= computes the loss: pass no labels= beside it")
    kwargs.pop("logits_to_keep", None)
    hidden = self.base_model(*args, **kwargs)[0]  # last_hidden_state, after the final norm
    return head_loss(hidden, self.get_output_embeddings())


def head_loss_problem(model: nn.Module) -> str | None:
    """Why the head-loss path of `model` (`give_head_loss`) would not compute its logits (a
    soft-capping or scaling after the head, a decoder that returns something else); None if it
    does. One small forward on CPU of both paths, compared."""
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (1, 8), generator=torch.Generator().manual_seed(0))
    device = next(model.parameters()).device
    try:
        with _probing(model):
            full = model(ids.to(device)).logits
            headed = model(ids.to(device), head_loss=lambda hidden, head: head(hidden))
    except Exception as error:  # noqa: BLE001 - an architecture whose decoder cannot be called alone
        return f"the decoder alone fails: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    if not isinstance(headed, torch.Tensor) or headed.shape != full.shape:
        return f"the head on the decoder's output gives {getattr(headed, 'shape', type(headed))}, not the logits"
    config = (model.get_base_model() if hasattr(model, "get_base_model") else model).config
    scaled = {name: getattr(config, name) for name, neutral in LOGIT_TRANSFORMS.items()
              if getattr(config, name, neutral) not in (neutral, None)}
    if scaled:
        return f"the model transforms its logits after the head ({', '.join(f'{k}={v}' for k, v in scaled.items())})"
    # The same operations on the same tensor: equal bit for bit, unless something follows the head
    # (with small random logits a soft-capping differs by little, so nothing but 0 passes).
    difference = float((headed.double() - full.double()).abs().max())
    if difference != 0:
        return f"the head on the decoder's output differs from the logits by {difference:.3g} (the model " \
               "transforms its logits after the head)"
    return None


LOGIT_TRANSFORMS = {"final_logit_softcapping": None, "logit_scale": 1.0, "logits_scaling": 1.0}
"""transformers config keys of what some architectures do to the logits after the head (Gemma 2 and 3's
soft-capping, Cohere's scale, Granite's divisor), with the value that does nothing."""


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


def document_mask(segments: torch.Tensor, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
    """Additive (B, 1, T, T) mask: causal and inside one document (and the sliding window), 0
    allowed, dtype's min masked. The `mask` backend's form for transformers' own attention functions."""
    allowed = attention.dense_mask(segments, window)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=segments.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


def _packed_rows_to_hf(module: nn.Module, args: tuple, kwargs: dict):
    """Packed rows come as idx/positions/segments/documents; transformers takes input_ids and
    position_ids, and either the boundaries (ddptrain's attention function) or a 4D attention
    mask (which its masking code uses as given)."""
    if "segments" not in kwargs:
        return None
    kwargs = dict(kwargs)
    input_ids = kwargs.pop("idx") if "idx" in kwargs else args[0]
    segments, documents = kwargs.pop("segments"), kwargs.pop("documents", None)
    backend = getattr(module, "packed_attention", "mask")
    if backend == "mask" or documents is None:
        kwargs["attention_mask"] = document_mask(segments, next(module.parameters()).dtype, _sliding_window(module))
    else:
        kwargs["documents"] = documents if documents.backend is not None else documents.using(backend)
        # A 4D mask is used as given: transformers builds none. A broadcast view, no T x T memory.
        batch, seq = segments.shape
        kwargs["attention_mask"] = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=segments.device).expand(
            batch, 1, seq, seq)
    kwargs["position_ids"] = kwargs.pop("positions")
    return (), {"input_ids": input_ids, **kwargs}


def _sliding_window(model: nn.Module) -> int | None:
    """The window of a model whose every layer slides (Mistral): a 4D mask given to transformers
    replaces its own, window included. Models that mix windowed and full layers (Qwen2's
    layer_types) cannot share one 4D mask; the probe then tells where documents exceed the window."""
    config = model.config
    window, layer_types = getattr(config, "sliding_window", None), getattr(config, "layer_types", None)
    if window is None or (layer_types is not None and set(layer_types) != {"sliding_attention"}):
        return None
    return window


def head_layout(model: nn.Module) -> HeadLayout:
    """The heads of its attention layers (query, key/value, dimensions), the windows they slide
    over (one where every layer slides: Mistral; none and the window where some do: Qwen2's
    layer_types; none where none does), and how its q, k and v reach ddptrain's attention
    function: their memory layout and softmax scale, as the probe's packed forward hands them over
    (architectures differ: Llama's each a projection of its own, GPT-2's views of one, Phi-3's and
    GPT-NeoX's q and k contiguous beside a v that is a view)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    every_layer = _sliding_window(base)
    window, layer_types = getattr(config, "sliding_window", None), getattr(config, "layer_types", None) or ()
    if every_layer is not None:
        windows = (every_layer,)
    else:
        windows = (None, window) if window is not None and "sliding_attention" in layer_types else (None,)
    memory, scale = _probe(model).call if _through_our_function(model) else (None, None)
    return HeadLayout(heads, kv_heads, head_dim, windows, memory, scale)


@dataclasses.dataclass(frozen=True)
class _Probe:
    """What one packed row of two short documents showed: `problem`, why its logits are not each
    document's alone (None: they are); `call`, the memory layouts (kernel_check.TokenMajor) of the
    q, k and v the first layer passed to ddptrain's attention function, and its scaling ((None,
    None) where the row did not reach that function)."""

    problem: str | None
    call: tuple = (None, None)


_PROBE_KEPT = "ddptrain_packed_probe"
"""Where a model keeps its probe through ddptrain's attention function until use_packed_attention
switches its attention again: start-up asks three times (the adapter's choice of backend, the
kernel check's layout, check_model)."""


def _through_our_function(model: nn.Module) -> bool:
    return getattr(model, "packed_attention", "mask") != "mask"


def _probe(model: nn.Module) -> _Probe:
    """The probe of the attention packed rows take now (`use_packed_attention`). Through
    ddptrain's function it is kept on the model (its verdict does not depend on which of gather,
    varlen or flex: the probe runs the gather); through the dense mask it runs every time."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    kept = base.__dict__.get(_PROBE_KEPT)
    if kept is not None and _through_our_function(model):
        return kept
    probe = _run_probe(model)
    if _through_our_function(model):
        base.__dict__[_PROBE_KEPT] = probe
    return probe


def _run_probe(model: nn.Module) -> _Probe:
    """Architectures differ in whether they honour the boundaries (or a custom 4D mask) and position
    ids; one small forward on CPU tells, instead of silently attending across documents. The
    probe's boundaries run the gather backend (varlen and flex need CUDA; the route to the kernel
    is the same). Its packed forward goes through a recording wrapper of ddptrain's attention
    function, registered under transformers' AttentionInterface for the probe alone."""
    transformers, calls = _transformers(), []

    def recording(module, query, key, value, *args, **kwargs):
        if not calls and kwargs.get("documents") is not None:
            calls.append(((TokenMajor.of(query), TokenMajor.of(key), TokenMajor.of(value)), kwargs.get("scaling")))
        return packed_attention_forward(module, query, key, value, *args, **kwargs)

    lengths = (5, 7)
    recorded = _through_our_function(model)
    if recorded:
        transformers.AttentionInterface.register(PACKED_ATTENTION, recording)
    try:
        with _probing(model):
            packed, ids = _packed_probe(model, lengths)
            alone = torch.cat([model(ids[:, start:start + n]).logits
                               for start, n in zip((0, lengths[0]), lengths)], dim=1)
    except Exception as error:  # noqa: BLE001 - an attention that cannot take packed rows (Bloom's eager raises)
        return _Probe(f"fails on packed rows (idx, positions, segments, documents): {type(error).__name__}: "
                      f"{str(error).splitlines()[0]}")
    finally:
        if recorded:
            transformers.AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)
    difference = float((packed - alone).abs().max())
    problem = None if difference <= 1e-4 else f"logits differ by {difference:.3g} from each document alone"
    return _Probe(problem, calls[0] if calls else (None, None))


@contextlib.contextmanager
def _probing(model: nn.Module):
    """Eval mode (no dropout) and no grad for a probe forward; the model's mode restored after."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def _packed_probe(model: nn.Module, lengths: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """One packed row of random documents of `lengths` through `model` with the gather backend's
    boundaries: its logits and the row's token ids."""
    vocab = model.get_input_embeddings().num_embeddings
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, sum(lengths)), generator=generator)
    segments = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    documents = DocumentBoundaries.from_segments(segments.numpy()).using("gather")
    return model(idx=ids, positions=positions, segments=segments, documents=documents).logits, ids


def packing_problem(model: nn.Module) -> str | None:
    """Why a packed row does not compute each document exactly as if it were alone; None if it does
    (the probe, `_probe`)."""
    return _probe(model).problem


def check_packing(model: nn.Module) -> None:
    """Refuse packing unless a packed row computes each document exactly as if it were alone."""
    problem = packing_problem(model)
    if problem is not None:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        what = f"{type(model).__name__} with attn_implementation={base.config._attn_implementation}"
        if not problem.startswith("fails"):
            problem = f"does not keep attention inside each packed document ({problem})"
        raise ModelError(f"batch.pack=true: {what} {problem}; use batch.pack=false")


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
