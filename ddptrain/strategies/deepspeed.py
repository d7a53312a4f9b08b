"""DeepSpeed ZeRO stages 1, 2 and 3 with the Engine's exact objective (DeepSpeed imported lazily).

DeepSpeed does not minimise the global mean-token loss by itself. By default `engine.backward`
divides the loss by gradient_accumulation_steps, and ZeRO AVERAGES gradients over the
data-parallel ranks (stage 1/2 `average_tensor` / `gradient_reduction_w_predivide`, stage 3
`__avg_scatter_*`: net division by the world size whatever gradient_predivide_factor and
prescale_gradients say). The Engine already hands `backward` the pieces `sum_token_loss / N_t`,
so this strategy undoes both (tests/strategies/test_zero.py measures it):

- `engine.backward(loss, scale_wrt_gas=False)`: no 1/GAS. engine.backward also marks the loss's
  graph, so the output hooks that scale direct `loss.backward()` calls by 1/GAS stay out.
- the loss is multiplied by the data-parallel world size W before backward; ZeRO's mean over W
  ranks then leaves the SUM over ranks (W = 2, 4, 8 ... makes the round trip exact).

DeepSpeed's `engine.step()` fuses norm, clip and update, and skips the update by itself when the
norm is not finite (fp32 weights: stage 1/2 treat an invalid norm as overflow, stage 3 always
does). So `finish_step` runs that step and returns the pre-clip norm. The DeepSpeed config is derived from ours (micro batch,
accumulation, clipping, precision, stage); extra keys are merged and checked against it.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
from collections.abc import Mapping
import json
from pathlib import Path
from typing import Any, ClassVar, ContextManager

import torch
import torch.distributed as dist
from torch import nn

from ddptrain.config.choices import STRATEGIES, ZeROOptions
from ddptrain.distributed import backend_for, get_rank, get_world_size, is_distributed
from ddptrain.strategies import state as neutral
from ddptrain.strategies.base import StepLayout, Strategy
from ddptrain.strategies.footprint import MiB, Collective, Footprint, Layout, ParameterCounts

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'ddptrain[deepspeed]'"
TAG = "zero"
LAYOUT_FILE = "ddptrain_layout.json"
"""DeepSpeed's own checkpoint (tag, and ddptrain's note of the world size): the layout before the
neutral one, still read on the world size that wrote it."""

BUCKETS = {"reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8, "stage3_prefetch_bucket_size": 5e7}
"""DeepSpeed's defaults (elements), unless strategy.deepspeed sets them (for the memory plan)."""

# DeepSpeed config key -> the ddptrain setting it is derived from (for error messages).
_DERIVED_FROM = {
    "train_micro_batch_size_per_gpu": "batch.micro_size",
    "gradient_accumulation_steps": "accumulation steps (batch.global_size / (batch.micro_size x world size))",
    "train_batch_size": "batch.global_size (micro size x accumulation x world size)",
    "gradient_clipping": "trainer.grad_clip (null: no clipping, which DeepSpeed spells 0.0)",
    "zero_optimization.stage": "strategy",
    "bf16.enabled": "trainer.precision (bf16 is the Engine's autocast over fp32 weights)",
    "fp16.enabled": "trainer.precision (fp16 is not supported)",
}

# Extra keys that would silently change the objective or the step: the value they must keep.
_REQUIRED = {
    "gradient_allreduce_op": ("mean", "the strategy turns ZeRO's mean into the sum by scaling the loss by the world size"),
    "zero_optimization.compute_grad_norm": (True, "the Engine reports the global gradient norm and skips non-finite steps"),
    "torch_autocast.enabled": (False, "the Engine applies torch.autocast itself for trainer.precision=bf16"),
    "amp.enabled": (False, "the Engine applies torch.autocast itself for trainer.precision=bf16"),
}

# Extra keys that are rejected outright, with the reason.
_REJECTED = {
    "scheduler": "the Engine steps the learning-rate schedule (Engine(lr_scheduler=...), optim.schedule)",
}


def import_deepspeed(strategy: str = "zero"):
    """`import deepspeed` (its Muon kernels' torch.compile deferred: `_defer_deepspeed_compiles`), or
    an ImportError that says how to install it."""
    try:
        import deepspeed
    except ImportError as err:
        raise ImportError(f"strategy {strategy!r} needs DeepSpeed, which is not installed: {INSTALL_HINT}") from err
    _defer_deepspeed_compiles()
    return deepspeed


def _defer_deepspeed_compiles() -> None:
    """Wrap the functions DeepSpeed decorates with `deepspeed.runtime.compiler.compile()` in
    torch.compile at their first call, not when their module is imported.

    `deepspeed.initialize` imports its Muon optimizer on every ZeRO stage, Muon or not (to ask
    `isinstance(optimizer, MuonWithAuxAdam)`), and that module applies `@compiler.compile()` to its
    kernels at import: `torch.compile(fn)` loads TorchInductor there and then, seconds of CPU per
    rank at every start (docs/benchmarks.md; the kernels compile at their first call either way). In
    DeepSpeed 0.19 only those kernels use `compiler.compile`; deferring the wrapper changes when
    Inductor is loaded, nothing that runs. A no-op once the Muon module is imported (its kernels
    are wrapped already).
    """
    import functools
    import sys

    from deepspeed.runtime import compiler

    if getattr(compiler.compile, "deferred_by_ddptrain", False) or \
            "deepspeed.runtime.zero.muon.original_muon" in sys.modules:
        return
    eager = compiler.compile

    def deferred_compile():
        def decorate(function):
            compiled = None

            @functools.wraps(function)
            def call(*args, **kwargs):
                nonlocal compiled
                if compiled is None:
                    compiled = eager()(function)
                return compiled(*args, **kwargs)

            return call

        return decorate

    deferred_compile.deferred_by_ddptrain = True
    compiler.compile = deferred_compile


def _plain(value: Any) -> Any:
    """Nested Mappings (OmegaConf DictConfig included) and lists as plain dicts and lists."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig":
        return [_plain(v) for v in value]
    return value


def _flatten(tree: Mapping, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, path + "."))
        else:
            flat[path] = value
    return flat


def _deep_merge(base: dict, extra: Mapping) -> dict:
    merged = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def deepspeed_config(stage: int, *, micro_batch_size: int, grad_accum_steps: int, world_size: int,
                     grad_clip: float | None, extra: Mapping | None = None,
                     has_torch_optimizer: bool = True) -> dict:
    """The DeepSpeed config derived from ddptrain's settings, with `extra` merged and checked.

    A key of `extra` that ddptrain derives must hold the same value; a key that would change the
    objective or the step is rejected. Either is a ValueError naming both values.
    """
    ours = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum_steps,
        "train_batch_size": micro_batch_size * grad_accum_steps * world_size,
        "gradient_clipping": float(grad_clip) if grad_clip is not None else 0.0,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
    }
    defaults = {
        # Torch optimizers DeepSpeed has not listed (SGD, ...) are fine: ZeRO only partitions them.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,  # ddptrain logs the steps
        "wall_clock_breakdown": False,
    }
    extra = _plain(extra or {})
    ours_flat = _flatten(ours)
    for path, value in _flatten(extra).items():
        if path in ours_flat and value != ours_flat[path] and not _same_number(value, ours_flat[path]):
            raise ValueError(f"strategy.deepspeed.{path}={value!r} contradicts {_DERIVED_FROM[path]}, from which "
                             f"ddptrain derives {path}={ours_flat[path]!r}: remove the key or change the setting")
        if path in _REQUIRED and value != _REQUIRED[path][0]:
            required, why = _REQUIRED[path]
            raise ValueError(f"strategy.deepspeed.{path}={value!r} is not supported: it must be {required!r} "
                             f"because {why}")
    for key, why in _REJECTED.items():
        if key in extra:
            raise ValueError(f"strategy.deepspeed.{key} is not supported: {why}")
    if "optimizer" in extra and has_torch_optimizer:
        raise ValueError("strategy.deepspeed.optimizer asks DeepSpeed to build the optimizer, but a torch optimizer "
                         "was given too; pass optimizer=None to the Engine to use DeepSpeed's (library use only)")
    if "optimizer" not in extra and not has_torch_optimizer:
        raise ValueError("a ZeRO strategy needs an optimizer: a torch optimizer, or strategy.deepspeed.optimizer "
                         "(DeepSpeed's, e.g. {'type': 'AdamW', 'params': {'lr': 1e-3}})")
    return _deep_merge(_deep_merge(defaults, ours), extra)


def _same_number(a: Any, b: Any) -> bool:
    return isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) and float(a) == float(b)


def _ensure_process_group(device: torch.device) -> None:
    """DeepSpeed needs a process group; in a world of one without torchrun, start a group of one.

    DeepSpeed's own fallback (MPI discovery through mpi4py) fails on a laptop. An in-memory
    HashStore needs no port; `ddptrain.destroy_distributed()` ends it like any other group.
    DeepSpeed also insists on LOCAL_RANK (engine `_do_args_sanity_check`), which is 0 here.
    """
    if not is_distributed():
        os.environ.setdefault("LOCAL_RANK", "0")
        dist.init_process_group(backend_for(device), store=dist.HashStore(), rank=0, world_size=1)


def _disable_shm_comm_op(deepspeed) -> None:
    """Keep DeepSpeed's CPU shared-memory comm op from being JIT-built at start-up.

    DeepSpeed's TorchBackend builds it (`build_shm_op`, a ninja C++ build into the torch
    extensions dir) whenever the CPU accelerator is active, although only
    `inference_all_reduce` uses it. Every rank of a fresh machine then compiles it at once,
    which is slow and can kill a rank with SIGABRT. Training never uses it, so we mark
    the op incompatible in DeepSpeed's op table (a module-level dict that DeepSpeed caches and
    reads in build_shm_op) before DeepSpeed's comm backend starts.
    """
    if deepspeed.accelerator.get_accelerator().device_name() != "cpu":
        return
    if deepspeed.comm.is_initialized():
        return  # someone started DeepSpeed's comm already; nothing left to prevent
    compatible_ops = deepspeed.ops.__compatible_ops__
    if compatible_ops.get("deepspeed_shm_comm"):
        compatible_ops["deepspeed_shm_comm"] = False


LOAD_PART_ELEMENTS = 2**26
"""How many elements (weights and per-element optimizer state) a ZeRO load reads at a time: 256 MB
of fp32 on each rank (a larger parameter with its state is read alone)."""


def _elements(entry: Any) -> int:
    return math.prod(entry.size) if hasattr(entry, "size") else 0


def _parts(own: dict[str, torch.Tensor], weights: dict[str, Any], states: dict[str, dict[str, Any]],
           name_of: dict[int, str]):
    """The checkpoint's per-parameter items, in the model's order, in parts of at most
    LOAD_PART_ELEMENTS elements: each parameter's weight (one name for tied ones) and its
    per-element optimizer state together. Every rank computes the same parts."""
    part: list[tuple] = []
    size = 0
    done: set[int] = set()
    for key, tensor in own.items():
        if id(tensor) in done or key not in weights:
            continue
        done.add(id(tensor))
        items = [("model", key)]
        name = name_of.get(id(tensor))
        items += [("optimizer", "state", name, state) for state, entry in states.get(name, {}).items()
                  if len(getattr(entry, "size", ())) > 0]  # per-element state; step counts come after
        elements = sum(_elements(weights[key] if item[0] == "model" else states[name][item[3]]) for item in items)
        if part and size + elements > LOAD_PART_ELEMENTS:
            yield part
            part, size = [], 0
        part += items
        size += elements
    if part:
        yield part


class DeepSpeedStrategy(Strategy):
    """DeepSpeed ZeRO stage 1, 2 or 3; gradients summed over ranks, once per optimizer step.

    Args:
        micro_batch_size: sequences per microbatch per rank (DeepSpeed's bookkeeping only).
        grad_accum_steps: microbatches per rank per step (DeepSpeed's bookkeeping only; the
            accumulation boundary is set per microbatch, so a step may hold any number).
        deepspeed: extra DeepSpeed config keys (offload, bucket sizes...), checked against ours.
    """

    stage: ClassVar[int]
    supported_precisions = STRATEGIES["zero1"].precisions  # the same for every stage
    Options = ZeROOptions

    @classmethod
    def from_config(cls, options: dict, layout: StepLayout) -> "DeepSpeedStrategy":
        return cls(micro_batch_size=layout.micro_batch_size, grad_accum_steps=layout.grad_accum_steps, **options)

    @classmethod
    def check_config(cls, options: dict, layout: StepLayout, *, world_size: int, grad_clip: float | None) -> None:
        # the config `setup` derives, without DeepSpeed: the same checks, before anything starts
        deepspeed_config(cls.stage, micro_batch_size=layout.micro_batch_size, grad_accum_steps=layout.grad_accum_steps,
                         world_size=world_size, grad_clip=grad_clip, extra=options.get("deepspeed"))

    @classmethod
    def memory_per_rank(cls, counts: ParameterCounts, layout: Layout) -> list[Footprint]:
        """Optimizer state partitioned (every stage), gradients from stage 2, weights at stage 3; each
        rank also keeps an fp32 copy of its partition (DeepSpeed's `single_partition_of_fp32_groups`)
        and, from stage 2, a reduce bucket."""
        n, b, stage, accumulation = layout.world_size, layout.bytes_per_value, cls.stage, layout.grad_accum_steps
        all_params, trained, level = counts.parameters * b, counts.trainable * b, layout.world_level
        buckets = {**BUCKETS, **{k: v for k, v in layout.deepspeed.get("zero_optimization", {}).items()
                                 if k in BUCKETS}}
        reduce_bucket = min(buckets["reduce_bucket_size"], counts.trainable) * b
        master = trained / n
        other = master + (reduce_bucket if stage >= 2 else 0)
        note = (f"{cls.name}: other = fp32 partition copy {master / MiB:.1f} MiB"
                + (f" + reduce bucket {buckets['reduce_bucket_size']:.0e} elements" if stage >= 2 else "")
                + f"; DeepSpeed buckets: reduce {buckets['reduce_bucket_size']:.0e}, allgather "
                  f"{buckets['allgather_bucket_size']:.0e}"
                + (f", stage3 prefetch {buckets['stage3_prefetch_bucket_size']:.0e}" if stage == 3 else "")
                + " elements")
        update_gather = Collective("parameter all-gather after the update", "all_gather", trained, 1, n, level)
        if stage == 1:
            comms = [Collective("gradient reduce-scatter", "reduce_scatter", trained, 1, n, level), update_gather]
        elif stage == 2:
            comms = [Collective("gradient reduce-scatter (every microbatch)", "reduce_scatter", trained,
                                accumulation, n, level), update_gather]
        else:
            comms = [Collective("parameter all-gather, forward", "all_gather", all_params, accumulation, n, level),
                     Collective("parameter all-gather, backward", "all_gather", all_params, accumulation, n, level),
                     Collective("gradient reduce-scatter (every microbatch)", "reduce_scatter", trained,
                                accumulation, n, level)]
        return [Footprint(cls.name, cls.name, all_params / n if stage == 3 else all_params,
                          trained if stage == 1 else trained / n, layout.optimizer_state_bytes(trained) / n, other,
                          comms, [note], frozen_copy_shards=n if stage == 3 else 1)]  # ZeRO3.hold_frozen

    def __init__(self, micro_batch_size: int = 1, grad_accum_steps: int = 1, deepspeed: Mapping | None = None):
        self._deepspeed = import_deepspeed(self.name)
        self.micro_batch_size = micro_batch_size
        self.grad_accum_steps = grad_accum_steps
        self.extra_config = _plain(deepspeed or {})
        self.grad_clip: float | None = None
        self.model = None
        self.optimizer = None
        self.config: dict | None = None
        self._module: nn.Module | None = None
        self._world_size = 1
        self._group_names: list[list[str]] = []  # parameter names of each optimizer group (the neutral layout's)
        self._state_ready = False  # whether the optimizer's state exists (see _optimizer_keys)

    # -- set up --------------------------------------------------------------------------------

    def setup(self, model: nn.Module, optimizer, device: torch.device) -> None:
        bad = sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch.float32})
        if bad:
            raise ValueError(f"strategy {self.name!r} needs fp32 weights (trainer.precision fp32 or bf16, which "
                             f"autocasts); the model has {', '.join(bad)} parameters")
        _ensure_process_group(device)
        self._world_size = get_world_size()
        self.config = deepspeed_config(self.stage, micro_batch_size=self.micro_batch_size,
                                       grad_accum_steps=self.grad_accum_steps, world_size=self._world_size,
                                       grad_clip=self.grad_clip, extra=self.extra_config,
                                       has_torch_optimizer=optimizer is not None)
        by_id = {id(param): name for name, param in model.named_parameters()}
        self._group_names = ([[by_id[id(param)] for param in group["params"]] for group in optimizer.param_groups]
                             if optimizer is not None else [list(neutral.trainable_names(model))])
        deepspeed = self._deepspeed
        _disable_shm_comm_op(deepspeed)
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # its INFO dumps the whole config
        engine, ds_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=self.config,
                                                          model_parameters=None if optimizer is not None
                                                          else [p for p in model.parameters() if p.requires_grad])
        self.model = engine
        self._module = engine.module
        # The torch optimizer (whose param_groups DeepSpeed's ZeRO optimizer shares, so an LR
        # schedule over it still applies), or DeepSpeed's own when none was given.
        self.optimizer = optimizer if optimizer is not None else ds_optimizer

    # -- the step ------------------------------------------------------------------------------

    def microbatch_context(self, is_last: bool) -> ContextManager:
        # DeepSpeed's own counter would call every gradient_accumulation_steps-th microbatch the
        # boundary; the Engine knows which one is last, so say it (ZeRO reduces on the boundary).
        self.model.set_gradient_accumulation_boundary(is_last)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        # x W: ZeRO averages over the W data-parallel ranks; no 1/GAS: the Engine normalised by N_t.
        self.model.backward(loss * self._world_size, scale_wrt_gas=False)

    def finish_step(self, max_norm: float | None, skip: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSpeed's fused norm + clip + update; the global norm before clipping.

        DeepSpeed applies no update when that norm is not finite (and clears the gradients), so
        `applied` is whether the norm was finite. Its step reads numbers on the host anyway (its
        overflow and norm checks), so `skip` is read here too."""
        if max_norm != self.grad_clip and not (max_norm is None and self.grad_clip is None):
            raise ValueError(f"finish_step(max_norm={max_norm!r}) but DeepSpeed was configured with "
                             f"gradient_clipping from grad_clip={self.grad_clip!r}")
        if bool(skip):  # no valid token anywhere: no update (and no weight decay, no moment update)
            self.model.zero_grad()
            return torch.tensor(float("nan"), dtype=torch.float64), torch.tensor(False)
        self.model.step()
        norm = self.model.get_global_grad_norm()
        if norm is None:
            raise RuntimeError("DeepSpeed computed no gradient norm (zero_optimization.compute_grad_norm=false?)")
        norm = torch.as_tensor(float(norm), dtype=torch.float64)
        return norm, torch.isfinite(norm)

    def zero_grad(self) -> None:
        # DeepSpeed clears its (partitioned) gradients itself after an update or a skipped
        # non-finite step; a step skipped for N_t = 0 never ran backward. Clear the module's
        # .grad anyway (cheap, and what DeepSpeed's engine.zero_grad does).
        self.model.zero_grad()

    # -- state ---------------------------------------------------------------------------------

    @staticmethod
    def local_tensor(param: torch.Tensor) -> torch.Tensor:
        """ZeRO-3 keeps this rank's partition of a parameter in `ds_tensor` (the parameter itself is
        empty outside a gather); stages 1 and 2 hold the full weights."""
        return getattr(param, "ds_tensor", param).detach()

    def whole_tensor(self, param: torch.Tensor) -> torch.Tensor:
        """Stage 3: a copy of `param` gathered from its partitions (collective); stages 1 and 2: itself."""
        if not hasattr(param, "ds_id"):
            return param.detach()
        with self._deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            return param.detach().clone()

    def model_state_dict(self, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        """Full weights as CPU tensors on every rank; stage 3 gathers each parameter collectively
        (with `trainable_only`, only those that train)."""
        return self._full_weights(trainable_only, keep=lambda tensor: True)

    def _full_weights(self, trainable_only: bool, keep) -> dict[str, torch.Tensor]:
        """The full weights for which `keep(tensor)` holds, as CPU copies (tied weights share one).
        Collective on stage 3: every rank joins each parameter's gather, kept or not."""
        skip = self.frozen_names(self._module) if trainable_only else set()
        state = {k: v for k, v in self._module.state_dict(keep_vars=True).items() if k not in skip}
        copies: dict[int, torch.Tensor] = {}  # by id: tied weights are one parameter
        out = {}
        for key, tensor in state.items():
            if id(tensor) not in copies:
                # stage 3: the parameter is whole only inside a gather
                whole = (self._deepspeed.zero.GatheredParameters([tensor], modifier_rank=None)
                         if hasattr(tensor, "ds_id") else contextlib.nullcontext())
                with whole:
                    copies[id(tensor)] = tensor.detach().cpu().clone() if keep(tensor) else None
            if copies[id(tensor)] is not None:
                out[key] = copies[id(tensor)]
        return out

    def _owners(self) -> dict[int, int]:
        """The rank that holds and writes each tensor of a checkpoint (by id), weights and optimizer
        state together, balanced by size (`neutral.balanced_owners`)."""
        sizes: dict[int, int] = {}
        for tensor in self._module.state_dict(keep_vars=True).values():
            sizes.setdefault(id(tensor), math.prod(getattr(tensor, "ds_shape", tensor.shape)))
        return neutral.balanced_owners(sizes, self._world_size)

    def state_to_save(self) -> dict:
        """The neutral layout (ddptrain/strategies/state.py) that every strategy loads: the full fp32
        weights, and each parameter's optimizer state assembled from ZeRO's partitions by name
        (DeepSpeed's `safe_get_full_optimizer_state`; collective, one parameter at a time).

        Each rank keeps only its share (`_owners`), so no rank holds the whole model and its
        optimizer state in host memory at once: the largest is about 1/world of it, plus the one
        parameter being assembled. DCP writes each key from the rank that holds it."""
        from deepspeed.utils import safe_get_full_optimizer_state

        owner, rank = self._owners(), get_rank()
        model = self._full_weights(not self.save_frozen, keep=lambda tensor: owner[id(tensor)] == rank)
        scalars, moments = self._optimizer_keys()
        states = {}
        for name, param in neutral.trainable_names(self._module).items():
            mine = owner[id(param)] == rank
            entry = {}
            for key in moments:  # collective: every rank assembles it, its owner keeps it
                value = safe_get_full_optimizer_state(param, key)
                if mine:
                    entry[key] = value.detach().cpu()
            if mine:
                entry.update({key: value.detach().cpu().clone() for key, value in scalars.items()})
                states[name] = entry
        groups = [{**{key: value for key, value in group.items() if key != "params"}, "params": names}
                  for group, names in zip(self.optimizer.param_groups, self._group_names)]
        return {"model": model, "optimizer": {"state": states, "param_groups": groups}}

    def load(self, directory: Path) -> None:
        """Whatever any strategy saved, on any world size: the full weights go into the module (ZeRO-3
        scatters each one from its gather) and refresh ZeRO's fp32 master copies; each parameter's
        optimizer state goes into its partitions (`safe_set_full_optimizer_state`).

        The directory is read a part at a time (`LOAD_PART_ELEMENTS`: parameters with their
        optimizer state), so a rank holds one part of the full state in host memory, not all of it;
        every rank reads the same parts, since DeepSpeed's setters are collective."""
        from deepspeed.utils import safe_set_full_optimizer_state

        if not neutral.is_neutral(directory):
            self.load_legacy(directory)
            return
        entries = neutral.contents(directory)
        weights = {path[1]: entry for path, entry in entries.items() if path[0] == "model"}
        states: dict[str, dict[str, Any]] = {}
        for path, entry in entries.items():
            if path[:2] == ("optimizer", "state"):
                states.setdefault(path[2], {})[path[3]] = entry
        own = self._module.state_dict(keep_vars=True)
        self._check_weights(own, weights, directory)
        names = neutral.trainable_names(self._module)
        scalars, moments = self._optimizer_keys()  # ZeRO's flat state exists, linked to the parameters
        missing = [name for name in names if name not in states]
        if missing and (scalars or moments):  # an optimizer without state (plain SGD) saves none
            raise ValueError(f"{directory}: the checkpoint holds no optimizer state for {missing[:5]}")
        name_of = {id(param): name for name, param in names.items()}
        for part in _parts(own, weights, states, name_of):
            read = neutral.read_paths(directory, {path: entries[path] for path in part})
            for path in part:
                if path[0] == "model":
                    self._set_weight(own[path[1]], read["model"][path[1]])
                else:  # ("optimizer", "state", name, key)
                    safe_set_full_optimizer_state(names[path[2]], read["optimizer"]["state"][path[2]][path[3]],
                                                  path[3])
        self.model.optimizer.refresh_fp32_params()  # ZeRO's fp32 masters from the weights just set
        small = {path: entry for path, entry in entries.items() if path[:2] == ("optimizer", "param_groups")
                 or (path[:2] == ("optimizer", "state") and getattr(entry, "size", None) == torch.Size([]))}
        self._load_optimizer_scalars(neutral.read_paths(directory, small).get("optimizer", {}))

    def _check_weights(self, own: dict[str, torch.Tensor], weights: dict[str, Any], directory: Path) -> None:
        """The saved weights' names and shapes (from the metadata) against the model's, before reading."""
        frozen = set() if self.save_frozen else self.frozen_names(self._module)
        self.check_loaded([key for key in own if key not in weights], [key for key in weights if key not in own],
                          frozen, directory)
        for key, entry in weights.items():
            shape = tuple(getattr(own[key], "ds_shape", own[key].shape))
            if tuple(entry.size) != shape:
                raise ValueError(f"{directory}: {key} has shape {tuple(entry.size)} in the checkpoint but "
                                 f"{shape} in the model")

    def _set_weight(self, tensor: torch.Tensor, value: torch.Tensor) -> None:
        if hasattr(tensor, "ds_id"):  # ZeRO-3: gather, set on rank 0, scatter back into the partitions
            with self._deepspeed.zero.GatheredParameters([tensor], modifier_rank=0):
                if get_rank() == 0:
                    tensor.data.copy_(value)
        else:
            tensor.data.copy_(value)

    def _load_optimizer_scalars(self, optimizer: dict) -> None:
        """The step counts and the param groups' settings (the per-element state is set by `load`)."""
        states = optimizer.get("state", {})
        # Step counts are one number per flat partition here and per parameter elsewhere; ddptrain
        # steps every parameter together, so they agree.
        scalars = {key: value for key, value in next(iter(states.values()), {}).items() if value.dim() == 0}
        for flat_state in self.model.optimizer.optimizer.state.values():
            for key, value in scalars.items():
                if key in flat_state:
                    flat_state[key].copy_(value)
        for group, saved in zip(self.optimizer.param_groups, optimizer.get("param_groups", [])):
            group.update({key: value for key, value in saved.items() if key != "params" and key in group})

    def _optimizer_keys(self) -> tuple[dict[str, torch.Tensor], list[str]]:
        """(the scalar state shared by every parameter, e.g. Adam's step; the names of the per-element
        state, e.g. exp_avg) of ZeRO's torch optimizer, after making sure that state exists.

        torch optimizers create their state in their first step and ZeRO-1/2 link it to the
        parameters only then; before it (a checkpoint of a run whose steps were all skipped, or a
        resume into a fresh engine) one step at learning rate 0 over zero gradients creates it
        (`neutral.zero_step_counts` says why that is a fresh optimizer's state)."""
        zero_optimizer = self.model.optimizer
        base = zero_optimizer.optimizer
        # ZeRO's flat fp32 partitions, and the torch param group of each (ZeRO-3 may split a group).
        flats = getattr(zero_optimizer, "single_partition_of_fp32_groups", None) or zero_optimizer.fp32_partitioned_groups_flat
        group_of = getattr(zero_optimizer, "sub_group_to_group_id", None) or {index: index for index in range(len(flats))}
        if not self._state_ready and any(flat not in base.state for flat in flats):
            groups = base.param_groups
            for index, flat in enumerate(flats):  # one step per partition, as ZeRO steps them
                grad, flat.grad = flat.grad, torch.zeros_like(flat)
                base.param_groups = [{**groups[group_of[index]], "params": [flat], "lr": 0.0}]
                try:
                    base.step()
                finally:
                    base.param_groups, flat.grad = groups, grad
            neutral.zero_step_counts(base.state.values())
        self._state_ready = True
        if hasattr(zero_optimizer, "single_partition_of_fp32_groups"):  # ZeRO-1/2: link the state to the parameters
            # DeepSpeed links it after the first group's first step, when the other groups have no
            # state yet, and never again: their parameters would have no optimizer state to read.
            from deepspeed.utils.mixed_precision_linkage import lazy_init_hp_params_optimizer_state

            for params, flat in zip(zero_optimizer.bit16_groups, zero_optimizer.single_partition_of_fp32_groups):
                lazy_init_hp_params_optimizer_state(params, flat, base.state)
        first = base.state.get(flats[0], {})  # empty for an optimizer without state (plain SGD)
        scalars = {key: value for key, value in first.items() if torch.is_tensor(value) and value.dim() == 0}
        moments = [key for key, value in first.items()
                   if torch.is_tensor(value) and value.dim() > 0 and value.shape == flats[0].shape]
        return scalars, moments

    def load_legacy(self, directory: Path) -> None:
        """A checkpoint from before the neutral layout: DeepSpeed's own, readable only on the world size
        that wrote it (its optimizer state is partitioned by rank)."""
        layout_file = Path(directory) / LAYOUT_FILE
        saved = json.loads(layout_file.read_text()) if layout_file.is_file() else {}
        if saved.get("world_size", self._world_size) != self._world_size:
            raise ValueError(f"a {saved.get('strategy', self.name)} checkpoint written on {saved['world_size']} ranks "
                             f"before checkpoints were strategy-neutral cannot be resumed on {self._world_size}: "
                             f"DeepSpeed partitioned its optimizer state by rank; resume it once on "
                             f"{saved['world_size']} ranks (its next checkpoint is neutral and resumes anywhere)")
        # Saved without the frozen parameters: the module's load cannot be strict (they stay as built).
        path, _ = self.model.load_checkpoint(str(directory), tag=TAG, load_optimizer_states=True,
                                             load_lr_scheduler_states=False, load_module_strict=self.save_frozen)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint with tag {TAG!r} under {directory}")

    @staticmethod
    def read_legacy_weights(directory: Path) -> dict[str, torch.Tensor]:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=TAG)


class ZeRO1(DeepSpeedStrategy):
    """Optimizer state partitioned; gradients reduced only on the last microbatch (like DDP)."""

    name, stage = "zero1", 1


class ZeRO2(DeepSpeedStrategy):
    """+ gradients partitioned: reduce-scattered in every microbatch's backward."""

    name, stage = "zero2", 2
    communicates_every_microbatch = True


class ZeRO3(DeepSpeedStrategy):
    """+ weights partitioned: gathered in every forward and backward."""

    name, stage = "zero3", 3
    communicates_every_microbatch = True
    gathers_per_module_call = True  # its hooks gather a module's partitioned weights on each call
    shards_weights = True

    @classmethod
    def frozen_copy(cls, model: nn.Module) -> nn.Module:
        """The copy's structure, its parameters on the meta device (`Strategy.meta_skeleton`):
        `hold_frozen` fills this rank's partitions from the model's, so no rank holds a whole copy."""
        return cls.meta_skeleton(model)

    def hold_frozen(self, module: nn.Module, device: torch.device, dtype: torch.dtype | None) -> nn.Module:
        """Partitioned over the ranks as the model is (the same group and partition sizes, through
        the model's own `zero.Init` settings), one parameter at a time, then wrapped in an engine
        without optimizer whose hooks gather each module's weights for its forward and free them
        after (TRL holds its ZeRO-3 reference so too). A `frozen_copy` skeleton (parameters on the
        meta device) gets copies of the model's own partitions (`ds_tensor`), taken before the first
        step: the initial weights; no rank holds more than one of its parameters whole. A module with
        weights of its own is partitioned with those weights (rank 0's: DeepSpeed's Init broadcasts
        each parameter before it partitions it, the skeleton's uninitialised ones too, once at the
        start). Its forward must run on every rank alike (the Reference's filler forwards)."""
        skeleton = any(param.is_meta for param in module.parameters())
        dtype = dtype or torch.float32  # DeepSpeed partitions fp32 weights here (setup refuses others)
        policy = dict(self._module.named_parameters())
        anchor = next(param for param in policy.values() if hasattr(param, "ds_id"))
        with torch.no_grad():
            for name, param in _one_at_a_time(module, device, dtype):
                anchor.convert_to_zero_parameters(param_list=[param])  # partition, free the whole tensor
                if skeleton:
                    mine, theirs = param.ds_tensor, policy[name].ds_tensor
                    if mine.shape != theirs.shape or mine.dtype != theirs.dtype:
                        raise RuntimeError(f"zero3: the frozen copy's partition of {name} is {tuple(mine.shape)} "
                                           f"{mine.dtype}, the model's {tuple(theirs.shape)} {theirs.dtype}")
                    mine.copy_(theirs)
            for owner in module.modules():  # the engine leaves a partitioned module where it is
                for key, buffer in owner._buffers.items():
                    if buffer is not None:
                        owner._buffers[key] = buffer.to(device)
        config = {key: value for key, value in self.config.items() if key not in ("optimizer", "scheduler")}
        engine, *_ = self._deepspeed.initialize(model=module, config=config)
        # Kept as long as the module (not as a submodule): the engine removes its hooks when deleted.
        module.__dict__["_deepspeed_engine"] = engine
        return module.eval()


def _one_at_a_time(module: nn.Module, device: torch.device, dtype: torch.dtype):
    """Each distinct parameter of `module` (name, parameter), replaced in its module(s) by a frozen
    one on `device`: a meta one by an uninitialised tensor of its shape, created only when yielded
    (so one parameter is whole at a time); tied parameters stay one."""
    done: dict[int, nn.Parameter] = {}
    named = {id(param): name for name, param in module.named_parameters()}
    for owner in module.modules():
        for key, param in list(owner._parameters.items()):
            if param is None:
                continue
            if id(param) not in done:
                data = (torch.empty(param.shape, dtype=dtype, device=device) if param.is_meta
                        else param.detach().to(device=device, dtype=dtype))
                done[id(param)] = nn.Parameter(data, requires_grad=False)
                owner._parameters[key] = done[id(param)]
                yield named[id(param)], done[id(param)]
            owner._parameters[key] = done[id(param)]
