"""Typed config: dataclasses in Hydra's ConfigStore, and their validation in one place.

YAML under conf/ only picks and overrides these defaults. `validate` runs before the process
group starts, on every rank, so a bad value fails fast everywhere with the same message.
"""

from __future__ import annotations

import dataclasses
import difflib
import signal
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ddptrain.engine.engine import PRECISIONS


class ConfigError(ValueError):
    """A config value breaks a rule; the message names the key, the value and the rule."""


@dataclass
class RunConfig:
    dir: str = "runs/default"
    """Run directory shared by every rank: metrics.jsonl, config.yaml, train.log, checkpoints."""
    seed: int = 1234
    """Seed of the model init and of the data order (the global batch of step t depends on it)."""


@dataclass
class TrainerConfig:
    max_steps: int = 200
    """Optimizer steps to train."""
    log_every: int = 10
    """Write a metrics line every this many steps (and at the last step)."""
    precision: str = "fp32"
    """fp32 | fp64 | bf16 (autocast) | fp16 (autocast with dynamic loss scaling)."""
    grad_clip: Optional[float] = 1.0
    """Clip the global gradient norm to this value (null: no clipping)."""
    empty_step: str = "skip"
    """A global batch without any valid target token: skip (no update, counted, warned) | stop."""
    nonfinite: str = "skip"
    """A non-finite gradient norm: skip (no update, counted, warned) | stop."""
    eval_every: int = 0
    """Validation loss every this many steps (0: only after the last step)."""
    eval_examples: int = 64
    """Size of the fixed validation set (examples taken from the validation split)."""
    compile: bool = False
    """torch.compile each transformer block (start-up: tens of seconds of compiling on the first steps)."""
    activation_checkpointing: bool = False
    """Recompute each transformer block in backward instead of keeping its activations (less memory, more compute)."""


@dataclass
class BatchConfig:
    global_size: int = 16
    """Sequences per optimizer step, over all ranks and microbatches."""
    micro_size: int = 8
    """Sequences per microbatch per rank."""
    seq_len: int = 256
    """Tokens per sequence (inputs); documents are cut to this and their ends padded."""
    micro_tokens: Optional[int] = None
    """Instead of micro_size: at most this many padded tokens per microbatch (>= seq_len)."""
    pack: bool = False
    """Pack several documents into each row of seq_len tokens (attention stays per document)."""


@dataclass
class OptimConfig:
    name: str = "adamw"
    """adamw | sgd"""
    lr: float = 1e-3
    """Peak learning rate."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices (not on norms and biases)."""
    betas: list = field(default_factory=lambda: [0.9, 0.95])
    """AdamW betas."""
    schedule: str = "cosine"
    """cosine | constant, after linear warmup."""
    warmup_steps: int = 20
    """Linear warmup steps."""
    decay_steps: Optional[int] = None
    """Length of the schedule (null: trainer.max_steps). Fix it to extend a run later without changing its schedule."""
    min_lr_ratio: float = 0.1
    """Cosine floor as a fraction of lr."""


@dataclass
class GPTModelConfig:
    """model=gpt: the built-in decoder-only GPT (ddptrain/models/gpt.py)."""

    name: str = "gpt"
    """Model family: gpt (built in) | hf (a local transformers directory); absent for a `_target_` factory."""
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block."""
    n_embd: int = 128
    """Embedding width (divisible by n_head)."""
    dropout: float = 0.0
    """Dropout probability (0 keeps steps deterministic)."""
    bias: bool = False
    """Biases in linear and norm layers."""


@dataclass
class HFModelConfig:
    """model=hf: any causal LM that transformers' AutoModelForCausalLM knows, from a local directory."""

    name: str = "hf"
    path: str = MISSING
    """Local directory: config.json, and weights to fine-tune from (none: initialised with run.seed). Never downloaded."""
    attn_implementation: str = "sdpa"
    """sdpa | eager: transformers' attention kernel (packing needs one that takes a 4D mask)."""


ModelConfig = GPTModelConfig  # the default model's schema

MODEL_SCHEMAS = {"gpt": GPTModelConfig, "hf": HFModelConfig}
"""Schema of each `model.name`; a node with `_target_` is a user factory and its other keys are its arguments."""


@dataclass
class ObjectiveConfig:
    label_smoothing: float = 0.0
    """Label smoothing epsilon in [0, 1): still a sum over valid tokens divided by the global count N_t."""
    z_loss: float = 0.0
    """Weight of PaLM's z-loss, log(Z)^2 summed over valid tokens (0: off)."""


@dataclass
class DataConfig:
    name: str = "stdlib"
    """stdlib (the interpreter's standard-library sources) | text | jsonl | tokens | hf (optional extra)."""
    val_percent: float = 5.0
    """Percent of documents (by a hash of their name) held out for validation (unless val_paths)."""
    max_docs: Optional[int] = None
    """Use only the first N documents (quick experiments and tests)."""
    paths: list = field(default_factory=list)
    """Source files or globs (`**` recursive); hf: data files or one save_to_disk directory."""
    val_paths: list = field(default_factory=list)
    """Separate validation files or globs (instead of the hash split by val_percent)."""
    split_by: str = "file"
    """text: one document per file | paragraph (per blank-line-separated paragraph)."""
    field: str = "text"
    """jsonl and hf: the string field (column) holding each document."""
    tokenizer: Optional[str] = None
    """byte | path to a Hugging Face tokenizer.json (optional extra); null: model=hf's own tokenizer.json, else byte."""
    on_decode_error: str = "replace"
    """Bytes that are not UTF-8 where text is needed (jsonl, tokenizer.json): replace (U+FFFD, counted) | error."""
    dtype: str = "uint16"
    """tokens: uint16 | uint32, the element type of the flat token files (nanoGPT writes uint16)."""
    eod_token: Optional[int] = None
    """tokens: the end-of-document id that ends (and belongs to) each document."""
    index: Optional[str] = None
    """tokens: a .npy of document start offsets into the one file of data.paths (instead of eod_token)."""
    vocab_size: Optional[int] = None
    """Model vocabulary; required for data=tokens (ids must be below it); default: the tokenizer's."""
    cache_dir: Optional[str] = None
    """Preprocessing cache, shared by the ranks of a node (default: $XDG_CACHE_HOME/ddptrain or ~/.cache/ddptrain)."""


@dataclass
class WandbConfig:
    mode: str = "disabled"
    """online | offline | disabled"""
    project: str = "ddptrain"
    """wandb project."""
    name: Optional[str] = None
    """wandb run name (default: the run dir's name)."""


@dataclass
class LoggerConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    progress: str = "auto"
    """Rank-0 console: auto (a bar on a terminal, log lines otherwise) | bar | lines."""
    peak_flops: Optional[float] = None
    """Peak FLOP/s of one device for MFU (null: from the table of known accelerators; none on CPU)."""


@dataclass
class CheckpointConfig:
    every: int = 0
    """Save a checkpoint every this many steps (0: only on preemption)."""
    keep: int = 2
    """Keep the newest K complete checkpoints (the only complete one is never deleted)."""
    resume: str = "auto"
    """auto (latest complete checkpoint in run.dir, else fresh) | none | a checkpoint path."""
    preempt_signals: list = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    """Signals that make every rank checkpoint at the next step boundary and exit."""
    preempt_check_every: int = 5
    """Ask every rank for a preemption signal every this many steps (a tiny all-reduce the host waits for)."""
    preempt_grace_s: float = 25.0
    """After a preemption signal, a rank that reaches no step boundary within this many seconds (stuck in a
    collective) exits instead of waiting to be SIGKILLed (torchrun waits 30 s)."""
    preempt_exit_code: int = 75
    """Exit code after a preemption checkpoint (EX_TEMPFAIL): the job should be restarted."""


@dataclass
class DistConfig:
    timeout_s: float = 600.0
    """Process-group timeout: a dead or stuck peer fails the run after this many seconds."""


@dataclass
class TrainConfig:
    run: RunConfig = field(default_factory=RunConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    model: Any = field(default_factory=dict)
    """Checked against MODEL_SCHEMAS[model.name] by `validate` (a `_target_` factory takes any keys)."""
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    data: DataConfig = field(default_factory=DataConfig)
    strategy: Any = field(default_factory=dict)
    """`name` (a key of ddptrain.strategies.REGISTRY) and that strategy's own Options, checked by `validate`."""
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistConfig = field(default_factory=DistConfig)


def register_configs() -> None:
    ConfigStore.instance().store(name="base_config", node=TrainConfig)


_CHOICES = {
    "trainer.precision": PRECISIONS,
    "trainer.empty_step": ("skip", "stop"),
    "trainer.nonfinite": ("skip", "stop"),
    "optim.name": ("adamw", "sgd"),
    "optim.schedule": ("cosine", "constant"),
    "data.name": ("stdlib", "text", "jsonl", "tokens", "hf"),
    "data.split_by": ("file", "paragraph"),
    "data.on_decode_error": ("replace", "error"),
    "data.dtype": ("uint16", "uint32"),
    "logger.wandb.mode": ("online", "offline", "disabled"),
    "logger.progress": ("auto", "bar", "lines"),
}

_POSITIVE = (
    "trainer.max_steps", "trainer.log_every", "trainer.eval_examples", "batch.global_size", "batch.micro_size",
    "batch.seq_len", "dist.timeout_s",
)


def _get(cfg: Any, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def validate(cfg: Any, world_size: int) -> int:
    """Check every rule; return the gradient accumulation steps. Raises ConfigError."""
    check_known_keys(cfg)
    missing = OmegaConf.missing_keys(cfg) if isinstance(cfg, DictConfig) else set()
    if missing:
        key = sorted(missing)[0]
        raise ConfigError(f"{key} is required and has no value (???), e.g. {key}=/path/to/model_dir"
                          if key == "model.path" else f"{key} is required and has no value (???)")
    return _validate_values(cfg, world_size)


def _validate_values(cfg: Any, world_size: int) -> int:
    for key, allowed in _CHOICES.items():
        value = _get(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}")
    for key in _POSITIVE:
        value = _get(cfg, key)
        if not value > 0:
            raise ConfigError(f"{key}={value!r} must be > 0")
    if cfg.optim.decay_steps is not None and not cfg.optim.decay_steps > 0:
        raise ConfigError(f"optim.decay_steps={cfg.optim.decay_steps!r} must be > 0 or null (trainer.max_steps)")
    for key in ("trainer.eval_every", "optim.warmup_steps", "checkpoint.every"):
        if _get(cfg, key) < 0:
            raise ConfigError(f"{key}={_get(cfg, key)!r} must be >= 0")
    if cfg.trainer.grad_clip is not None and not cfg.trainer.grad_clip > 0:
        raise ConfigError(f"trainer.grad_clip={cfg.trainer.grad_clip!r} must be > 0 or null (no clipping)")
    if not cfg.optim.lr > 0:
        raise ConfigError(f"optim.lr={cfg.optim.lr!r} must be > 0")
    if not 0 <= cfg.data.val_percent < 100:
        raise ConfigError(f"data.val_percent={cfg.data.val_percent!r} must be in [0, 100)")
    if cfg.data.max_docs is not None and cfg.data.max_docs < 2:
        raise ConfigError(f"data.max_docs={cfg.data.max_docs!r} must be >= 2 (or null for all documents)")
    _validate_data(cfg.data)
    if cfg.logger.peak_flops is not None and not cfg.logger.peak_flops > 0:
        raise ConfigError(f"logger.peak_flops={cfg.logger.peak_flops!r} must be > 0 or null (from the device table)")
    if cfg.checkpoint.keep < 1:
        raise ConfigError(f"checkpoint.keep={cfg.checkpoint.keep!r} must be >= 1")
    for name in cfg.checkpoint.preempt_signals:
        if not isinstance(getattr(signal, str(name), None), signal.Signals):
            raise ConfigError(f"checkpoint.preempt_signals has {name!r}, which is not a signal name like SIGUSR1")
    if not cfg.checkpoint.preempt_check_every > 0:
        raise ConfigError(f"checkpoint.preempt_check_every={cfg.checkpoint.preempt_check_every!r} must be > 0")
    if not cfg.checkpoint.preempt_grace_s > 0:
        raise ConfigError(f"checkpoint.preempt_grace_s={cfg.checkpoint.preempt_grace_s!r} must be > 0")
    if not 0 <= cfg.checkpoint.preempt_exit_code <= 255:
        raise ConfigError(f"checkpoint.preempt_exit_code={cfg.checkpoint.preempt_exit_code!r} must be in [0, 255]")
    _validate_strategy(cfg.strategy, cfg.trainer.precision)
    _validate_model(cfg.model)
    if not 0 <= cfg.objective.label_smoothing < 1:
        raise ConfigError(f"objective.label_smoothing={cfg.objective.label_smoothing!r} must be in [0, 1)")
    if not cfg.objective.z_loss >= 0:
        raise ConfigError(f"objective.z_loss={cfg.objective.z_loss!r} must be >= 0")
    batch = cfg.batch
    if batch.micro_tokens is not None or batch.pack:
        if batch.micro_tokens is not None and batch.micro_tokens < batch.seq_len:
            raise ConfigError(f"batch.micro_tokens={batch.micro_tokens} must be >= batch.seq_len={batch.seq_len} "
                              "(a microbatch holds at least one full sequence)")
        if batch.global_size < world_size or (batch.micro_tokens is None and batch.global_size % world_size):
            rule = "at least" if batch.micro_tokens is not None else "divisible by"
            raise ConfigError(f"batch.global_size={batch.global_size} must be {rule} the world size {world_size}")
        return 0  # varies per step and rank
    return grad_accum_steps(batch.global_size, batch.micro_size, world_size)


def _schema_keys(schema) -> list[str]:
    return [f.name for f in dataclasses.fields(schema)]


def _unknown_key_error(key: str, known: list[str], prefix: str) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
    return ConfigError(f"{prefix}{key} is not a config key{hint}; the keys of {prefix.rstrip('.') or 'the config'} "
                       f"are: {', '.join(known)}")


def check_known_keys(cfg: Any, schema=None, prefix: str = "") -> None:
    """Every key of `cfg` is a field of the schema (Hydra's `+key=value` adds keys no schema knows).

    The `model` node is checked against its own kind's schema; a `_target_` factory's other keys
    are its keyword arguments and are not checked here. Plain `dict` fields are free-form.
    """
    schema = schema or TrainConfig
    known = _schema_keys(schema)
    types = typing.get_type_hints(schema)
    for key in cfg.keys():
        if key not in known:
            raise _unknown_key_error(str(key), known, prefix)
        field_type = types[key]
        if prefix == "" and key in ("model", "strategy"):
            continue  # checked per kind: _validate_model, _validate_strategy
        if dataclasses.is_dataclass(field_type) and isinstance(cfg[key], DictConfig):
            check_known_keys(cfg[key], field_type, f"{prefix}{key}.")


def _validate_model(model: Any) -> None:
    if "_target_" in model:
        if not isinstance(model["_target_"], str) or "." not in model["_target_"]:
            raise ConfigError(f"model._target_={model['_target_']!r} must be a dotted path to a callable that "
                              "returns an nn.Module, e.g. my_package.models.build")
        return
    name = model.get("name")
    if name not in MODEL_SCHEMAS:
        raise ConfigError(f"model.name={name!r} is not one of {', '.join(MODEL_SCHEMAS)} "
                          "(or give model._target_=pkg.module.factory for your own model)")
    schema = MODEL_SCHEMAS[name]
    check_known_keys(model, schema, "model.")
    try:
        typed = OmegaConf.merge(OmegaConf.structured(schema), model)
    except OmegaConfBaseException as error:
        message = str(error).split("\n")[0]
        raise ConfigError(f"model.{error.full_key}: {message} (model={name})") from None
    for key in OmegaConf.missing_keys(typed):
        raise ConfigError(f"model.{key} is required for model={name}, e.g. model.{key}=/path/to/model_dir")
    if name == "gpt":
        for key in ("n_layer", "n_head", "n_embd"):
            if not typed[key] > 0:
                raise ConfigError(f"model.{key}={typed[key]!r} must be > 0")
        if typed.n_embd % typed.n_head:
            raise ConfigError(f"model.n_embd={typed.n_embd} must be divisible by model.n_head={typed.n_head}")
        if not 0 <= typed.dropout < 1:
            raise ConfigError(f"model.dropout={typed.dropout!r} must be in [0, 1)")
    if name == "hf" and typed.attn_implementation not in ("sdpa", "eager"):
        raise ConfigError(f"model.attn_implementation={typed.attn_implementation!r} is not one of sdpa, eager")


def _validate_strategy(strategy: Any, precision: str) -> None:
    from ddptrain.strategies import STRATEGY_NAMES, strategy_class

    name = strategy.get("name")
    if name not in STRATEGY_NAMES:
        raise ConfigError(f"strategy.name={name!r} is not one of {', '.join(STRATEGY_NAMES)}")
    cls = strategy_class(name)
    options = {key: value for key, value in strategy.items() if key != "name"}
    known = [f.name for f in dataclasses.fields(cls.Options)]
    for key in options:
        if key not in known:
            raise _unknown_key_error(str(key), ["name", *known], "strategy.")
    try:
        OmegaConf.merge(OmegaConf.structured(cls.Options), options)
    except OmegaConfBaseException as error:
        raise ConfigError(f"strategy.{error.full_key}: {str(error).splitlines()[0]} (strategy={name})") from None
    if precision not in cls.supported_precisions:
        raise ConfigError(f"trainer.precision={precision} is not supported with strategy={name} (it supports "
                          f"{', '.join(cls.supported_precisions)})")


def strategy_options(strategy: Any) -> dict:
    """The strategy section's own options (everything but `name`), as plain values."""
    section = OmegaConf.to_container(strategy, resolve=True) if isinstance(strategy, DictConfig) else dict(strategy)
    return {key: value for key, value in section.items() if key != "name"}


def _validate_data(data: Any) -> None:
    if data.name != "stdlib" and not data.paths:
        raise ConfigError(f"data.paths is empty: data={data.name} needs files or globs, e.g. data.paths=[corpus/*.txt]")
    if data.name == "stdlib" and (data.paths or data.val_paths):
        raise ConfigError("data.paths / data.val_paths are not used by data=stdlib; pick data=text, jsonl, tokens or hf")
    if data.vocab_size is not None and data.vocab_size < 2:
        raise ConfigError(f"data.vocab_size={data.vocab_size!r} must be >= 2 (or null: the tokenizer's)")
    if data.name == "tokens":
        if data.vocab_size is None:
            raise ConfigError("data.vocab_size is required for data=tokens: the model's vocabulary, above every "
                              "token id in the files (e.g. 50304 for GPT-2 tokens)")
        if data.tokenizer not in (None, "byte"):
            raise ConfigError(f"data.tokenizer={data.tokenizer!r} does not apply to data=tokens (already tokenized)")
        if data.eod_token is not None and data.index is not None:
            raise ConfigError("data.eod_token and data.index both split token files into documents; set one")
        if data.eod_token is not None and not 0 <= data.eod_token < data.vocab_size:
            raise ConfigError(f"data.eod_token={data.eod_token} must be in [0, data.vocab_size={data.vocab_size})")
        max_id = 1 << (16 if data.dtype == "uint16" else 32)
        if data.vocab_size > max_id:
            raise ConfigError(f"data.vocab_size={data.vocab_size} does not fit data.dtype={data.dtype} "
                              f"(ids < {max_id}); use data.dtype=uint32")
    elif data.eod_token is not None or data.index is not None:
        raise ConfigError(f"data.eod_token / data.index apply to data=tokens only, not data={data.name}")


def grad_accum_steps(global_batch_size: int, micro_batch_size: int, world_size: int) -> int:
    """global / (micro x world), or a ConfigError naming the three numbers."""
    per_step = micro_batch_size * world_size
    if global_batch_size % per_step:
        raise ConfigError(
            f"batch.global_size={global_batch_size} must be divisible by batch.micro_size={micro_batch_size} "
            f"x world size {world_size} = {per_step}"
        )
    return global_batch_size // per_step


__all__ = ["TrainConfig", "ConfigError", "validate", "grad_accum_steps", "register_configs", "MISSING"]
