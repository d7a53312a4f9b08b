"""Resuming with a changed config: apply what may change deliberately, refuse the rest by name.

A checkpoint carries the resolved config it was trained with. On resume every difference with the
new config is either one of the keys below, applied on purpose (the learning rate and schedule,
the length of the run, logging, evaluation, checkpointing, the layout of ranks and microbatches
and the strategy, which the objective does not depend on: checkpoints are strategy-neutral; data.order,
which the checkpoint's data cursor decides and checks), or
it is refused with the key, the old and the new value: a changed model, seed, data, global batch,
precision or objective would silently continue another run, or fail deep inside torch. The paths of
the inputs (RELOCATABLE) may change where the checkpoint's fingerprint guards what they hold.
"""

from __future__ import annotations

import logging
from typing import Any

from omegaconf import OmegaConf

from ddptrain.config.schema import MODEL_SCHEMAS
from ddptrain.runs.store import CheckpointError

log = logging.getLogger(__name__)

MAY_CHANGE = (
    "run.dir", "trainer.max_steps", "trainer.log_every", "trainer.eval_every", "trainer.eval_examples",
    "trainer.grad_clip", "trainer.empty_step", "trainer.nonfinite", "optim.lr", "optim.schedule",
    "optim.warmup_steps", "optim.min_lr_ratio", "optim.decay_steps", "batch.micro_size", "batch.micro_tokens",
    "data.cache_dir", "data.order", "logger", "checkpoint", "dist", "strategy",
)
"""Keys (or whole sections) that may differ from the checkpoint's config. The world size is not in
the config: it may change too."""

RELOCATABLE = ("data.paths", "data.val_paths", "data.index", "data.tokenizer", "data.chat_template", "model.path")
"""Where the run's inputs lie, which may be spelled another way (relative or absolute) or moved when
the checkpoint holds the fingerprint of what they hold (ddptrain/runs/fingerprint.py: the corpus'
files relative to their common directory, the tokenizer's and chat template's hashes, model=hf's
config.json, a LoRA base's weights), compared after the build: other content is refused there by
name. A checkpoint without a fingerprint (an older ddptrain) refuses them here, as any other key."""

SAME_SAMPLE_WHEN = {"batch.pack": ("data.name", ("sft", "preference"))}
"""Keys that may change where another key has one of these values: packed conversations and pairs are
the step's own conversations (pairs) packed whole (ddptrain/data/packing.py, data/preference.py), so
packing them or not keeps the sample; a packed text stream draws other examples."""

DEFAULTS_BEFORE = {"batch.pack": False}
"""What a checkpoint written without the key (by an older ddptrain) trained with, where the default
has since become one decided at start-up (null)."""

SCHEDULE_KEYS = ("optim.lr", "optim.schedule", "optim.warmup_steps", "optim.min_lr_ratio", "optim.decay_steps",
                 "trainer.max_steps")


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        flat: dict[str, Any] = {}
        for key, value in tree.items():
            flat.update(flatten(value, f"{prefix}{key}."))
        return flat if flat or not prefix else {prefix[:-1]: {}}
    return {prefix[:-1]: tree}


def _may_change(key: str, allowed_keys: tuple[str, ...]) -> bool:
    return any(key == allowed or key.startswith(allowed + ".") for allowed in allowed_keys)


def config_changes(saved: dict, current: dict, defaults: dict) -> list[tuple[str, Any, Any]]:
    """(key, old, new) for every key whose value differs. A key the checkpoint does not have
    (written by an older ddptrain) counts as its default."""
    old, new = flatten(saved), flatten(current)
    changes = []
    for key in sorted(set(old) | set(new)):
        before = old.get(key, DEFAULTS_BEFORE.get(key, defaults.get(key)))
        after = new.get(key, defaults.get(key))
        if before != after:
            changes.append((key, before, after))
    return changes


def check_config(saved: dict, current: dict, defaults: dict, fingerprinted: bool = False) -> list[tuple[str, Any, Any]]:
    """The changes to apply; raises CheckpointError listing every change that may not be made.
    `fingerprinted`: the checkpoint holds its inputs' fingerprint, so RELOCATABLE keys may change too."""
    changes = config_changes(saved, current, defaults)
    allowed = MAY_CHANGE + (RELOCATABLE if fingerprinted else ())
    allowed += tuple(key for key, (decider, values) in SAME_SAMPLE_WHEN.items()
                     if flatten(saved).get(decider) == flatten(current).get(decider) in values)
    refused = [change for change in changes if not _may_change(change[0], allowed) and not is_mixture_weight(change[0])]
    if refused:
        lines = "; ".join(f"{key}: {old!r} -> {new!r}" for key, old, new in refused)
        raise CheckpointError(f"the config differs from the checkpoint's in keys that cannot change on resume: {lines}."
                              " Resume with the checkpoint's values, or start a new run (another run.dir, or "
                              f"checkpoint.resume=none). Keys that may change: {', '.join(allowed)}")
    return changes


def is_mixture_weight(key: str) -> bool:
    """data.sources.<source>.weight: a mixture's weights may change on resume; the mix continues from
    each source's cursor (ddptrain/data/mixture.py), and the fingerprint records the weights."""
    parts = key.split(".")
    return len(parts) == 4 and parts[:2] == ["data", "sources"] and parts[3] == "weight"


def log_applied(changes: list[tuple[str, Any, Any]]) -> None:
    """Say each change `check_config` accepted: said only when steps remain to train with them."""
    for key, old, new in changes:
        moved = " (the same inputs elsewhere: their fingerprint is compared)" if _may_change(key, RELOCATABLE) else ""
        log.info("resume: %s changed from %r to %r (applied)%s", key, old, new, moved)


def defaults_of(schema) -> dict[str, Any]:
    return flatten(OmegaConf.to_container(OmegaConf.structured(schema), resolve=True))


def model_defaults(model: dict) -> dict[str, Any]:
    """The defaults of the model kind's own keys, as `model.<key>` (a checkpoint written before a
    key existed, e.g. model.lora, counts as its default); none for a `_target_` factory."""
    schema = MODEL_SCHEMAS.get(model.get("name")) if "_target_" not in model else None
    if schema is None:
        return {}
    return {f"model.{key}": value for key, value in defaults_of(schema).items() if value != "???"}


def check_base_weights(saved_spec: dict, spec, path) -> None:
    """A CheckpointError when a LoRA checkpoint's base weights (ModelSpec.base_weights, a sha256) are
    not the ones this run built its model on: the adapter would continue over another model."""
    saved = saved_spec.get("base_weights")
    if saved is not None and saved != spec.base_weights:
        found = spec.base_weights[:12] + "..." if spec.base_weights else "none"
        raise CheckpointError(f"{path}: its LoRA adapter was trained over other base weights than those now at "
                              f"model.path={spec.config.get('path')} (sha256 {found}, the checkpoint's "
                              f"{saved[:12]}...); resume with the original base weights at that path, or start a "
                              "new run (another run.dir, or checkpoint.resume=none)")


def reset_learning_rate(scheduler, lr: float) -> None:
    """After loading a scheduler's state: make `lr` the peak rate and recompute this step's rate
    from the new schedule (the saved state would keep the old ones)."""
    scheduler.base_lrs = [lr] * len(scheduler.optimizer.param_groups)
    step = scheduler.last_epoch
    for group, base_lr, factor in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["initial_lr"] = base_lr
        group["lr"] = base_lr * factor(step)
