"""Same objective, not the same arithmetic: the modules that make accumulated or data-parallel
execution compute something else than one large forward pass.

Batch-dependent modules (BatchNorm and kin, or modules a user names, e.g. an MoE router that
balances load per batch) compute a different function on a microbatch than on the global batch,
and stochastic ones (dropout) draw other random masks per microbatch and rank. The trainer warns
about them at start-up; `python -m ddptrain.verify` names them and measures the difference.
"""

from __future__ import annotations

import logging
from typing import Iterable

from torch import nn

from ddptrain.distributed import is_rank_zero

log = logging.getLogger(__name__)

_DROPOUT_ATTRIBUTES = ("dropout", "pdrop", "dropout_p", "attention_dropout")


def _matches(name: str, module: nn.Module, listed: Iterable[str]) -> bool:
    return any(entry in (name, type(module).__name__, f"{type(module).__module__}.{type(module).__qualname__}")
               for entry in listed)


def _batch_dependence(module: nn.Module) -> str | None:
    """Why `module`'s output for a row depends on the other rows of its forward call (None: it does not)."""
    if isinstance(module, nn.SyncBatchNorm):
        return ("normalises with the mean and variance of the rows of one forward call, gathered over ranks: one "
                "microbatch per rank, not the global batch, so accumulation changes its function, and its running "
                "statistics are updated once per microbatch")
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return ("normalises with the mean and variance of the rows of each forward call, so a microbatch computes a "
                "different function than the whole global batch: the gradients (not only their rounding) depend on "
                "micro size x world size, and its running statistics are updated once per microbatch; LayerNorm, "
                "GroupNorm and RMSNorm look at one row and do not have this")
    if isinstance(module, nn.modules.instancenorm._InstanceNorm) and module.track_running_stats:
        return ("normalises each row by itself, but its running statistics average the rows of each forward call and "
                "are updated once per microbatch: evaluation-mode outputs after training depend on the layout")
    return None


def _dropout_probability(module: nn.Module) -> list[tuple[str, float]]:
    """(attribute, p) of every active dropout of `module`: nn.Dropout* modules, and float attributes
    such as an attention's dropout_p handed to scaled_dot_product_attention."""
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return [("p", module.p)] if module.p > 0 else []
    return [(key, value) for key, value in vars(module).items()
            if key in _DROPOUT_ATTRIBUTES and isinstance(value, float) and value > 0]


def equivalence_caveats(model: nn.Module, extra_batch_dependent: Iterable[str] = ()) -> list[str]:
    """One sentence per module that makes accumulated or data-parallel execution differ from one
    large forward pass, although the objective is the same: batch-dependent modules (BatchNorm*,
    SyncBatchNorm, InstanceNorm with running statistics, and `extra_batch_dependent`: class names,
    qualified class names or module names, e.g. an MoE router that balances load per batch) and
    active stochastic ones (dropout with p > 0). Empty when the layout changes only rounding."""
    extra = tuple(extra_batch_dependent)
    caveats = []
    for name, module in model.named_modules():
        where = f"{name or '(model)'} ({type(module).__name__})"
        why = _batch_dependence(module)
        if why is None and extra and _matches(name, module, extra):
            why = ("is listed as batch-dependent: its output for a row depends on the other rows of its forward "
                   "call, so microbatches and ranks compute a different function than the global batch")
        if why is not None:
            caveats.append(f"batch-dependent: {where} {why}")
        for attribute, p in _dropout_probability(module):
            caveats.append(f"stochastic: {where} drops activations with {attribute}={p:g}: every microbatch and rank "
                           "draws its own random mask, so a step is another sample of the same expected objective: a "
                           "run repeats with the same layout and seed, and differs with another layout")
    return caveats


def log_equivalence_caveats(model: nn.Module, extra_batch_dependent: Iterable[str] = ()) -> list[str]:
    """The caveats as warnings, once per job: on rank 0 only, since every rank builds the same model
    (the rank-0 filter lets warnings of every rank through). Returns them."""
    caveats = equivalence_caveats(model, extra_batch_dependent)
    if caveats and is_rank_zero():
        for caveat in caveats:
            log.warning("same objective, not the same arithmetic: %s", caveat)
        log.warning("`python -m ddptrain.verify` with this run's overrides measures the difference")
    return caveats


def disable_dropout(model: nn.Module) -> list[str]:
    """Set every active dropout of `model` to p=0; the names of those changed."""
    changed = []
    for name, module in model.named_modules():
        for attribute, _ in _dropout_probability(module):
            setattr(module, attribute, 0.0)
            changed.append(f"{name or '(model)'}.{attribute}")
    return changed
