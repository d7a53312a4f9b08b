"""Validation of the config in one place, before the process group starts.

`validate` runs on every rank, so a bad value fails fast everywhere with the same message naming
the key, the value and the rule. The allowed values come from ddptrain/config/choices.py.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import math
import os
import signal
import typing
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ddptrain.config import choices
from ddptrain.config.evaluation import validate_evaluation
from ddptrain.config.layout import BatchLayout, resolved, rows_vary
from ddptrain.config.schema import (MODEL_SCHEMAS, ConfigError, DataConfig, MixSourceConfig, ObjectiveConfig,
                                    OptimConfig, RewardConfig, RLConfig, TrainConfig, WandbConfig)
from ddptrain.distributed import replicate_degree

_CHOICES = {
    "trainer.precision": choices.PRECISIONS,
    "trainer.empty_step": choices.STEP_POLICIES,
    "trainer.nonfinite": choices.STEP_POLICIES,
    "trainer.attention": choices.ATTENTION_BACKENDS,
    "optim.name": choices.OPTIMIZERS,
    "optim.schedule": choices.SCHEDULES,
    "data.name": choices.DATA_SOURCES,
    "data.split_by": choices.SPLIT_BY,
    "data.on_decode_error": choices.DECODE_ERRORS,
    "data.dtype": choices.TOKEN_DTYPES,
    "data.format": choices.SFT_FORMATS,
    "data.train_on": choices.SFT_TRAIN_ON,
    "data.truncation": choices.SFT_TRUNCATIONS,
    "data.order": choices.DATA_ORDERS,
    "objective.name": choices.OBJECTIVES,
    "objective.loss_type": choices.DPO_LOSS_TYPES,
    "rl.scale_rewards": choices.SCALE_REWARDS,
    "rl.loss_aggregation": choices.LOSS_AGGREGATIONS,
    "logger.wandb.mode": choices.WANDB_MODES,
    "logger.progress": choices.PROGRESS_MODES,
}
"""Each enumerated key and where its values are declared."""

_SFT_KEYS = ("format", "messages_field", "prompt_field", "completion_field", "train_on")
_DPO_KEYS = ("beta", "loss_type", "precompute_reference")
_READ_ONLY_WHEN = (
    ("data.split_by", DataConfig, "data.name", ("text",)),
    ("data.field", DataConfig, "data.name", ("jsonl", "hf")),
    ("data.dtype", DataConfig, "data.name", ("tokens",)),
    ("data.on_decode_error", DataConfig, "data.name", ("text", "jsonl", "hf", "sft", "preference", "prompts")),
    *((f"data.{key}", DataConfig, "data.name", ("sft",)) for key in _SFT_KEYS if key != "prompt_field"),
    ("data.prompt_field", DataConfig, "data.name", ("sft", "prompts")),
    ("data.truncation", DataConfig, "data.name", ("sft", "preference")),
    *((f"objective.{key}", ObjectiveConfig, "objective.name", ("dpo",)) for key in _DPO_KEYS),
    *((f"objective.{key}", ObjectiveConfig, "objective.name", ("token",)) for key in ("label_smoothing", "z_loss")),
    ("data.messages_field", DataConfig, "data.format", ("auto", "messages")),  # a forced format reads its own
    ("data.prompt_field", DataConfig, "data.format", ("auto", "prompt_completion")),
    ("data.completion_field", DataConfig, "data.format", ("auto", "prompt_completion")),
    ("data.val_percent", DataConfig, "data.val_paths", ([],)),
    ("data.cache_dir", DataConfig, "data.name", ("text", "jsonl", "tokens", "hf", "sft", "preference", "prompts")),
    ("optim.betas", OptimConfig, "optim.name", ("adamw",)),
    ("optim.min_lr_ratio", OptimConfig, "optim.schedule", ("cosine",)),
    ("optim.decay_steps", OptimConfig, "optim.schedule", ("cosine",)),
    *((f"rl.{f.name}", RLConfig, "objective.name", ("grpo",)) for f in dataclasses.fields(RLConfig)),
    *((f"reward.{f.name}", RewardConfig, "objective.name", ("grpo",)) for f in dataclasses.fields(RewardConfig)),
    ("logger.wandb.project", WandbConfig, "logger.wandb.mode", ("online", "offline")),
    ("logger.wandb.name", WandbConfig, "logger.wandb.mode", ("online", "offline")),
)
"""(key, its section's schema, the key that decides whether the run reads it, the values with which it
does): a key set away from its default where the run never reads it is refused, not ignored."""

_POSITIVE = (
    "trainer.max_steps", "trainer.log_every", "trainer.eval_examples",
    "batch.global_size", "batch.micro_size", "batch.seq_len", "dist.timeout_s",
)


def _get(cfg: Any, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def validate(cfg: TrainConfig, world_size: int) -> int:
    """Check every rule; return the gradient accumulation steps. Raises ConfigError."""
    check_known_keys(cfg)
    missing = OmegaConf.missing_keys(cfg) if isinstance(cfg, DictConfig) else set()
    if missing:
        key = sorted(missing)[0]
        raise ConfigError(f"{key} is required and has no value (???), e.g. {key}=/path/to/model_dir"
                          if key == "model.path" else f"{key} is required and has no value (???)")
    return _validate_values(cfg, world_size)


def _validate_values(cfg: Any, world_size: int) -> int:
    cfg = resolved(cfg)  # batch.pack and batch.micro_size as the run decides them (config/layout.py)
    for key, allowed in _CHOICES.items():
        value = _get(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}")
    for key in _POSITIVE:
        value = _get(cfg, key)
        if not value > 0:
            raise ConfigError(f"{key}={value!r} must be > 0")
    if cfg.trainer.head_chunk_tokens is not None and not cfg.trainer.head_chunk_tokens > 0:
        raise ConfigError(f"trainer.head_chunk_tokens={cfg.trainer.head_chunk_tokens!r} must be > 0 or null (chunks of "
                          "at most 64 MiB of fp32 logits)")
    if cfg.optim.decay_steps is not None and not cfg.optim.decay_steps > 0:
        raise ConfigError(f"optim.decay_steps={cfg.optim.decay_steps!r} must be > 0 or null (trainer.max_steps)")
    for key in ("trainer.eval_every", "optim.warmup_steps", "checkpoint.every"):
        if _get(cfg, key) < 0:
            raise ConfigError(f"{key}={_get(cfg, key)!r} must be >= 0")
    if cfg.trainer.grad_clip is not None and not 0 < cfg.trainer.grad_clip < math.inf:
        raise ConfigError(f"trainer.grad_clip={cfg.trainer.grad_clip!r} must be a finite number > 0, or null (no "
                          "clipping)")
    if not 0 <= cfg.run.seed < 1 << 64:  # torch.manual_seed and numpy's generators take unsigned 64-bit seeds
        raise ConfigError(f"run.seed={cfg.run.seed!r} must be in [0, 2**64)")
    _validate_run_dir(cfg.run.dir)
    _validate_optim(cfg.optim)
    if not 0 <= cfg.data.val_percent < 100:
        raise ConfigError(f"data.val_percent={cfg.data.val_percent!r} must be in [0, 100)")
    if cfg.data.max_docs is not None and cfg.data.max_docs < 2:
        raise ConfigError(f"data.max_docs={cfg.data.max_docs!r} must be >= 2 (or null for all documents)")
    _validate_data(cfg.data)
    _refuse_data_in_run_dir(cfg.data, cfg.run.dir)
    for _, source, _ in mixture_sources(cfg.data) if cfg.data.name == "mixture" else ():
        _refuse_data_in_run_dir(source, cfg.run.dir)
    _refuse_unread_keys(cfg)
    peak = cfg.logger.peak_flops
    if peak not in ("auto", None) and not (isinstance(peak, (int, float)) and not isinstance(peak, bool) and peak > 0):
        raise ConfigError(f"logger.peak_flops={peak!r} must be auto (the device table, else a matmul probe), "
                          "FLOP/s > 0, or null (no MFU)")
    _validate_checkpoint(cfg.checkpoint)
    validate_evaluation(cfg)
    _validate_strategy(cfg.strategy, cfg.trainer.precision, world_size)
    _validate_attention(cfg.trainer, cfg.batch.pack)
    _validate_model(cfg.model)
    if not 0 <= cfg.objective.label_smoothing < 1:
        raise ConfigError(f"objective.label_smoothing={cfg.objective.label_smoothing!r} must be in [0, 1)")
    if not 0 <= cfg.objective.z_loss < math.inf:
        raise ConfigError(f"objective.z_loss={cfg.objective.z_loss!r} must be a finite number >= 0")
    _validate_objective(cfg.objective, _data_kind(cfg.data))
    if cfg.objective.name == "grpo":
        validate_rl(cfg, world_size)
    batch = cfg.batch
    if rows_vary(batch):
        if batch.micro_tokens is not None and batch.micro_tokens < batch.seq_len:
            raise ConfigError(f"batch.micro_tokens={batch.micro_tokens} must be >= batch.seq_len={batch.seq_len} "
                              "(a microbatch holds at least one full sequence)")
        if batch.global_size < world_size or (batch.micro_tokens is None and batch.global_size % world_size):
            rule = "at least" if batch.micro_tokens is not None else "divisible by"
            raise ConfigError(f"batch.global_size={batch.global_size} must be {rule} the world size {world_size}")
    return BatchLayout.of(batch, world_size).grad_accum_steps or 0  # 0: varies per step and rank


def _validate_run_dir(run_dir: str) -> None:
    """The filesystem root and the home directory are nobody's run dir: a run writes config.yaml,
    train.log, metrics.jsonl, checkpoints/ and final/ into its run.dir (and moves an earlier run's
    to previous/). What else may be one (empty, or a run's) is decided at the lock (runs/rundir.py)."""
    if not str(run_dir).strip():  # Path("") is the working directory: the run would write into it
        raise ConfigError(f"run.dir={run_dir!r} is empty: give the run's directory, e.g. run.dir=runs/mine "
                          "(run.dir=. for the working directory)")
    resolved = os.path.realpath(os.path.expanduser(run_dir))
    if resolved in (os.path.realpath(os.sep), os.path.realpath(os.path.expanduser("~"))):
        where = "the filesystem root" if resolved == os.path.realpath(os.sep) else "the home directory"
        raise ConfigError(f"run.dir={run_dir} is {where}, where the run's config.yaml, train.log, metrics.jsonl, "
                          f"checkpoints/ and final/ would sit among other files: give the run its own folder, e.g. "
                          f"run.dir={os.path.join(run_dir, 'runs', 'mine')}")


_RUN_FILES = ("config.yaml", "train.log", "metrics.jsonl", "checkpoints/step_00000001/trainer.pt",
              "checkpoints/step_00000001/COMPLETE.json", "final/model.safetensors", "final/ddptrain_model.json",
              "final/tokenizer.json", "final/config.json", "final/adapter_model.safetensors", "servable/config.json",
              "servable/model.safetensors", "previous/20260101-000000/metrics.jsonl")
"""Files a run writes into its run.dir (runs/rundir.py), now or on a later launch."""


def _refuse_data_in_run_dir(data: Any, run_dir: str) -> None:
    """A data path or glob that reaches into run.dir would read the run's own train.log,
    metrics.jsonl or checkpoints as documents (some only on a relaunch, so a run that started fine
    stops later): refused, naming the key, the pattern and the run file it matches."""
    root = os.path.abspath(os.path.expanduser(run_dir))
    for key in ("data.paths", "data.val_paths"):
        for pattern in _get(data, key.removeprefix("data.")) or []:
            pattern = os.path.abspath(os.path.expanduser(str(pattern)))
            caught = next((name for name in _RUN_FILES if _glob_matches(pattern, os.path.join(root, name))), None)
            if caught is None and (pattern == root or pattern.startswith(root + os.sep)):
                caught = os.path.relpath(pattern, root)
            if caught is not None:
                raise ConfigError(f"{key}: {pattern!r} reaches run.dir={run_dir} (it matches the run's own "
                                  f"{caught}): a run must not train on its own logs, metrics or checkpoints. Put "
                                  "the run dir outside the corpus (e.g. run.dir=runs/mine) or narrow the glob")


def _glob_matches(pattern: str, path: str) -> bool:
    """Whether glob.glob(pattern, recursive=True) would list `path` if it existed: `*`, `?` and `[...]`
    within one path component, `**` any number of them."""
    def match(parts: list[str], names: list[str]) -> bool:
        if not parts:
            return not names
        if parts[0] == "**":
            return any(match(parts[1:], names[skip:]) for skip in range(len(names) + 1))
        return bool(names) and fnmatch.fnmatchcase(names[0], parts[0]) and match(parts[1:], names[1:])

    return match(pattern.split(os.sep), path.split(os.sep))


def _validate_checkpoint(checkpoint: Any) -> None:
    if checkpoint.keep < 1:
        raise ConfigError(f"checkpoint.keep={checkpoint.keep!r} must be >= 1")
    for name in checkpoint.preempt_signals:
        if not isinstance(getattr(signal, str(name), None), signal.Signals):
            raise ConfigError(f"checkpoint.preempt_signals has {name!r}, which is not a signal name like SIGUSR1")
        if name in ("SIGKILL", "SIGSTOP"):
            raise ConfigError(f"checkpoint.preempt_signals has {name}, which no process can catch (the run would "
                              "fail installing its handler); use SIGTERM or SIGUSR1")
    if not checkpoint.preempt_check_every > 0:
        raise ConfigError(f"checkpoint.preempt_check_every={checkpoint.preempt_check_every!r} must be > 0")
    if not checkpoint.preempt_grace_s > 0:
        raise ConfigError(f"checkpoint.preempt_grace_s={checkpoint.preempt_grace_s!r} must be > 0")
    if not 0 <= checkpoint.preempt_exit_code <= 255:
        raise ConfigError(f"checkpoint.preempt_exit_code={checkpoint.preempt_exit_code!r} must be in [0, 255]")


def _validate_optim(optim: Any) -> None:
    """torch's optimizers check only their defaults, not the per-group weight decay ddptrain passes, and
    LambdaLR takes any factor: a negative decay or floor would train, silently, the other way."""
    if not 0 < optim.lr < math.inf:
        raise ConfigError(f"optim.lr={optim.lr!r} must be a finite number > 0")
    if not 0 <= optim.weight_decay < math.inf:
        raise ConfigError(f"optim.weight_decay={optim.weight_decay!r} must be a finite number >= 0")
    if not 0 <= optim.min_lr_ratio <= 1:
        raise ConfigError(f"optim.min_lr_ratio={optim.min_lr_ratio!r} must be in [0, 1] (the cosine floor as a "
                          "fraction of optim.lr)")
    if optim.schedule == "cosine" and optim.decay_steps is not None and optim.warmup_steps > optim.decay_steps:
        raise ConfigError(f"optim.warmup_steps={optim.warmup_steps} must be <= optim.decay_steps={optim.decay_steps}, "
                          "the schedule's length (the cosine would drop to its floor the step after warmup)")
    betas = list(optim.betas)
    if len(betas) != 2 or not all(_is_real(beta) and 0 <= beta < 1 for beta in betas):
        raise ConfigError(f"optim.betas={betas!r} must be two numbers in [0, 1), e.g. optim.betas=[0.9,0.95]")


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _refuse_unread_keys(cfg: Any) -> None:
    for dotted, schema, decider, reading in _READ_ONLY_WHEN:
        if dotted.startswith("data.") and cfg.data.name == "mixture":
            continue  # they apply to the sources, each checked as its own kind (mixture_sources)
        value, decided = _plain(_get(cfg, dotted)), _plain(_get(cfg, decider))
        if decided not in reading and value != _default(schema, dotted.rsplit(".", 1)[1]):
            when = "empty" if decider == "data.val_paths" else " or ".join(reading)
            raise ConfigError(f"{dotted}={value!r} is read only when {decider} is {when}, and this run has "
                              f"{decider}={decided!r}: it would be ignored; leave it out")


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value


def _default(schema, name: str) -> Any:
    field = next(f for f in dataclasses.fields(schema) if f.name == name)
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default


def _validate_attention(trainer: Any, pack: bool) -> None:
    """A forced backend must exist on this machine (the device follows CUDA's availability, as in
    ddptrain.distributed) and in trainer.precision; only packed rows read it."""
    if trainer.attention != "auto" and not pack:
        raise ConfigError(f"trainer.attention={trainer.attention} applies to packed rows only (batch.pack=true); "
                          "without packing each row is one document under plain causal attention: leave it out")
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    refusal = choices.attention_refusal(trainer.attention, device_type, trainer.precision)
    if refusal is not None:
        raise ConfigError(refusal)


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
    schema.check(typed)


def _validate_strategy(strategy: Any, precision: str, world_size: int) -> None:
    name = strategy.get("name")
    if name not in choices.STRATEGIES:
        raise ConfigError(f"strategy.name={name!r} is not one of {', '.join(choices.STRATEGY_NAMES)}")
    choice = choices.STRATEGIES[name]
    options = {key: value for key, value in strategy.items() if key != "name"}
    known = [f.name for f in dataclasses.fields(choice.options)]
    for key in options:
        if key not in known:
            raise _unknown_key_error(str(key), ["name", *known], "strategy.")
    try:
        typed = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(choice.options), options))
    except OmegaConfBaseException as error:
        raise ConfigError(f"strategy.{error.full_key}: {str(error).splitlines()[0]} (strategy={name})") from None
    refusal = typed.refusal()
    if refusal is not None:
        raise ConfigError(f"{refusal} (strategy={name})")
    if precision not in choice.precisions:
        raise ConfigError(f"trainer.precision={precision} is not supported with strategy={name} (it supports "
                          f"{', '.join(choice.precisions)})")
    if "replicate" in known:
        try:  # the mesh must tile the world: R replicas x world/R shards
            replicate_degree(options.get("replicate", 1), world_size)
        except ValueError as error:
            raise ConfigError(str(error)) from None


def strategy_options(strategy: Any) -> dict:
    """The strategy section's own options (everything but `name`), as plain values."""
    section = OmegaConf.to_container(strategy, resolve=True) if isinstance(strategy, DictConfig) else dict(strategy)
    return {key: value for key, value in section.items() if key != "name"}


def _data_kind(data: Any) -> str:
    """data.name, or a mixture's kind where it decides a rule: preference (pairs) or mixture."""
    if data.name == "mixture" and data.sources and all(
            isinstance(source, (DictConfig, dict)) and source.get("name") == "preference" for source in data.sources.values()):
        return "preference"
    return data.name


def _validate_data(data: Any) -> None:
    if data.name == "mixture":
        mixture_sources(data)
        return
    if data.sources:
        raise ConfigError(f"data.sources applies to data=mixture only, not data={data.name}: pick data=mixture")
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
    if data.name in ("sft", "preference", "prompts") and data.tokenizer == "byte":
        raise ConfigError(f"data={data.name} needs a real tokenizer with an EOS token and a chat template, not "
                          "data.tokenizer=byte: model=hf's own (data.tokenizer=null) or "
                          "data.tokenizer=<dir>/tokenizer.json")
    if data.name not in ("sft", "preference", "prompts") and data.chat_template is not None:
        raise ConfigError(f"data.chat_template applies to data=sft, preference and prompts only, not data={data.name}")


def _validate_objective(objective: Any, data_name: str) -> None:
    """DPO needs pairs and pairs need DPO: a token objective over pairs would train on both completions."""
    if (objective.name == "dpo") != (data_name == "preference"):
        raise ConfigError(f"objective={objective.name} with data={data_name}: objective=dpo trains on preference pairs "
                          "and data=preference is trained with objective=dpo; use both, or neither")
    if (objective.name == "grpo") != (data_name == "prompts"):
        raise ConfigError(f"objective={objective.name} with data={data_name}: objective=grpo trains on rollouts of "
                          "prompts and data=prompts is trained with objective=grpo; use both, or neither")
    if not 0 < objective.beta < math.inf:
        raise ConfigError(f"objective.beta={objective.beta!r} must be a finite number > 0")



# -- data=mixture --------------------------------------------------------------------------------

_MIX_KEYS = tuple(f.name for f in dataclasses.fields(MixSourceConfig))
_GLOBAL_ONLY = ("sources", "order")  # keys of the mixture, not of a source
_SOURCE_NAME = "a name of letters, digits, '_', '-' or '.' (it names metrics: mix/<source>/share, loss/<source>)"


def mixture_sources(data: Any) -> list[tuple[str, DictConfig, MixSourceConfig]]:
    """(name, its data config, its mixture settings) of every source of data=mixture, in the order given:
    each source's keys over the other data.* keys, checked as a config of its own kind. Each bad input is a
    ConfigError naming the source and the rule."""
    if data.paths or data.val_paths:
        raise ConfigError("data.paths / data.val_paths are not used by data=mixture: each source has its own, "
                          "data.sources.<source>.paths")
    sources = data.sources
    if not isinstance(sources, (DictConfig, dict)) or not sources:
        raise ConfigError("data.sources is empty: data=mixture needs sources, e.g. "
                          "'data.sources={web: {name: text, paths: [web/*.txt], weight: 0.7}, "
                          "code: {name: jsonl, paths: [code/*.jsonl], weight: 0.3}}'")
    shared = {key: value for key, value in _plain(data).items() if key not in ("name", *_GLOBAL_ONLY)}
    specs = []
    for name, source in sources.items():
        specs.append(_mixture_source(str(name), source, shared))
    _check_weights(specs)
    kinds = {spec[1].name for spec in specs}
    if "preference" in kinds and kinds != {"preference"}:
        pairs = next(name for name, cfg, _ in specs if cfg.name == "preference")
        other = next(name for name, cfg, _ in specs if cfg.name != "preference")
        raise ConfigError(f"data.sources.{pairs} (name=preference) cannot mix with data.sources.{other} "
                          f"(name={sources[other].get('name')}): preference pairs are trained with objective=dpo over "
                          "pairs, the others with the token objective over valid targets; mix pairs only with pairs")
    if kinds == {"preference"}:
        raise ConfigError("data=mixture of preference sources is not supported yet: train one data=preference "
                          "source, or mix token sources (text, jsonl, tokens, hf, sft)")
    return specs


def _mixture_source(name: str, source: Any, shared: dict) -> tuple[str, DictConfig, MixSourceConfig]:
    where = f"data.sources.{name}"
    if not name or not all(char.isalnum() or char in "_-." for char in name):
        raise ConfigError(f"{where}: the source's name {name!r} must be {_SOURCE_NAME}")
    if not isinstance(source, (DictConfig, dict)):
        raise ConfigError(f"{where}={_plain(source)!r} must be a mapping: {{name: text, paths: [...], weight: 1}}")
    source = _plain(source)
    kind = source.get("name")
    if kind not in choices.MIX_KINDS:
        raise ConfigError(f"{where}.name={kind!r} must be the source's kind, one of {', '.join(choices.MIX_KINDS)}")
    known = [key for key in _schema_keys(DataConfig) if key not in _GLOBAL_ONLY] + list(_MIX_KEYS)
    for key in source:
        if key not in known:
            raise _unknown_key_error(str(key), known, f"{where}.")
    weight = source.get("weight", 1.0)
    if not _is_real(weight) or not math.isfinite(weight) or weight < 0:
        raise ConfigError(f"{where}.weight={weight!r} must be a finite number >= 0 (its share of the valid targets is "
                          "weight / sum of the weights)")
    max_repeat = source.get("max_repeat")
    if max_repeat is not None and (isinstance(max_repeat, bool) or not isinstance(max_repeat, int) or max_repeat < 0):
        raise ConfigError(f"{where}.max_repeat={max_repeat!r} must be an integer >= 0 (passes after the first) or "
                          "null (unlimited)")
    on_exhausted = source.get("on_exhausted", "error")
    if on_exhausted not in choices.ON_EXHAUSTED:
        raise ConfigError(f"{where}.on_exhausted={on_exhausted!r} is not one of {', '.join(choices.ON_EXHAUSTED)}")
    own = {key: value for key, value in source.items() if key not in _MIX_KEYS}
    if not own.get("paths"):
        raise ConfigError(f"{where}.paths is empty: a source needs its files or globs, e.g. {where}.paths=[corpus/*.txt]")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(DataConfig), shared, own)
    except OmegaConfBaseException as error:
        raise ConfigError(f"{where}.{error.full_key}: {str(error).splitlines()[0]}") from None
    for key, allowed in _CHOICES.items():
        if key.startswith("data.") and merged[key.removeprefix("data.")] not in allowed:
            raise ConfigError(f"{where}.{key.removeprefix('data.')}={merged[key.removeprefix('data.')]!r} is not one "
                              f"of {', '.join(allowed)}")
    try:
        _validate_data(merged)
        _refuse_unread_source_keys(merged, own, where)
    except ConfigError as error:
        raise ConfigError(f"{where} (name={kind}): {error}") from None
    return name, merged, MixSourceConfig(float(weight), max_repeat, on_exhausted)


def _refuse_unread_source_keys(merged: Any, own: dict, where: str) -> None:
    """A key the source sets itself that its kind never reads is refused, as for data=<kind>."""
    for dotted, _, decider, reading in _READ_ONLY_WHEN:
        key = dotted.removeprefix("data.")
        if dotted.startswith("data.") and decider == "data.name" and key in own and merged.name not in reading:
            raise ConfigError(f"{where}.{key} is read only when the source's name is {' or '.join(reading)}: "
                              "it would be ignored; leave it out")


def _check_weights(specs: list) -> None:
    if not any(mix.weight > 0 for _, _, mix in specs):
        raise ConfigError("data.sources: every weight is 0 (" + ", ".join(f"{name}={mix.weight:g}" for name, _, mix
                                                                          in specs) + "): at least one must be > 0")


def refuse_repeated_sources(overrides: list[str]) -> None:
    """A source named twice in one `data.sources={...}` override: Hydra's dict keeps the last silently, so
    the command line's text is read here (a YAML file refuses a duplicate key itself, when it is loaded)."""
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if key != "data.sources":
            continue
        names, depth, quote, token = [], 0, "", ""
        for char in value:
            if quote:
                if char == quote:
                    quote = ""
                else:
                    token += char
            elif char in "'\"":
                quote = char
            elif char in "{[":
                depth += 1
                token = ""
            elif char in "}]":
                depth -= 1
            elif depth == 1 and char == ":":
                names.append(token.strip())
                token = ""
            elif depth == 1 and char == ",":
                token = ""
            elif depth == 1:
                token += char
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ConfigError(f"data.sources names {', '.join(repeated)} more than once: each source needs a name of "
                              "its own (the mapping would keep only the last one)")


def validate_rl(cfg: Any, world_size: int) -> None:
    """objective=grpo: rl.* and reward.* (a reward path's import is checked by the builder, before
    the run dir is written: ddptrain/rl/rewards.py)."""
    rl, reward, batch = cfg.rl, cfg.reward, cfg.batch
    if not rl.group_size >= 2:
        raise ConfigError(f"rl.group_size={rl.group_size!r} must be >= 2: a group's advantages are its rewards "
                          "less the group's mean, so a group of one has no advantage to learn from")
    if not rl.max_new_tokens >= 1:
        raise ConfigError(f"rl.max_new_tokens={rl.max_new_tokens!r} must be >= 1")
    if not rl.max_new_tokens < batch.seq_len:
        raise ConfigError(f"rl.max_new_tokens={rl.max_new_tokens} must be < batch.seq_len={batch.seq_len}: a "
                          "prompt and its completion share one sequence of batch.seq_len tokens")
    if not 0 < rl.temperature <= 2:
        raise ConfigError(f"rl.temperature={rl.temperature!r} must be in (0, 2]: rollouts are sampled")
    if not 0 < rl.top_p <= 1:
        raise ConfigError(f"rl.top_p={rl.top_p!r} must be in (0, 1]")
    stops = list(rl.stop)
    if len(stops) > 4 or not all(isinstance(stop, str) and stop for stop in stops):
        raise ConfigError(f"rl.stop={stops!r} must be a list of at most 4 non-empty strings")
    if not 0 <= rl.epsilon < 1:
        raise ConfigError(f"rl.epsilon={rl.epsilon!r} must be in [0, 1)")
    if rl.epsilon_high is not None and not 0 <= rl.epsilon_high < math.inf:
        raise ConfigError(f"rl.epsilon_high={rl.epsilon_high!r} must be a finite number >= 0, or null (rl.epsilon)")
    if not 0 <= rl.beta < math.inf:
        raise ConfigError(f"rl.beta={rl.beta!r} must be a finite number >= 0")
    if not rl.updates_per_rollout >= 1:
        raise ConfigError(f"rl.updates_per_rollout={rl.updates_per_rollout!r} must be >= 1")
    if batch.global_size % world_size:
        raise ConfigError(f"batch.global_size={batch.global_size} prompts must be divisible by the world size "
                          f"{world_size}: each rank generates whole groups for an equal share of the prompts")
    if rl.updates_per_rollout > batch.global_size:
        raise ConfigError(f"rl.updates_per_rollout={rl.updates_per_rollout} must be <= batch.global_size="
                          f"{batch.global_size}: each update takes its own part of the step's prompts")
    evaluation = {"trainer.eval_every": cfg.trainer.eval_every, "trainer.eval_tasks": list(cfg.trainer.eval_tasks),
                  "trainer.early_stopping.metric": cfg.trainer.early_stopping.metric,
                  "checkpoint.keep_best": cfg.checkpoint.keep_best}
    for key, value in evaluation.items():
        if value:
            raise ConfigError(f"{key}={value!r}: objective=grpo has no validation split to evaluate (its metrics are "
                              "the rollouts' rewards, in metrics.jsonl); leave it unset")
    functions = list(reward.functions)
    if not functions:
        raise ConfigError("reward.functions is empty: objective=grpo needs at least one reward function, e.g. "
                          "reward.functions=[exact_match] or reward.functions=[my_rewards:correct]")
    for name in functions:
        if not isinstance(name, str) or (name not in choices.BUILTIN_REWARDS and ":" not in name):
            raise ConfigError(f"reward.functions: {name!r} is neither a built-in reward "
                              f"({', '.join(choices.BUILTIN_REWARDS)}) nor a `module:function` path")
    if reward.weights is not None:
        weights = list(reward.weights)
        if len(weights) != len(functions):
            raise ConfigError(f"reward.weights={weights} has {len(weights)} weight(s) for {len(functions)} "
                              f"reward.functions {functions}: give one per function, or null (1 each)")
        if not all(isinstance(w, (int, float)) and math.isfinite(w) for w in weights):
            raise ConfigError(f"reward.weights={weights} must be finite numbers")
