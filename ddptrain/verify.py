"""`python -m ddptrain.verify [OVERRIDES]`: is the configured layout's update the one-process update?

    python -m ddptrain.verify batch.micro_size=2                      # accumulation, in one process
    torchrun --nproc_per_node=2 -m ddptrain.verify batch.micro_size=2  # and data parallel

It takes the same Hydra overrides as training, builds the configured data, model, strategy and
layout (world size x microbatches), and runs a few steps of it beside ONE process that sees the
whole global batch of each step at once and minimises the same objective the plain way: one
forward, sum of token losses / valid tokens, backward, clip, optimizer and schedule step. Both
start from the same weights, in fp64 on the CPU (--device configured: the run's device and
trainer.precision). Every step prints the relative differences of the losses and of the gradient
norms before clipping (AdamW and clipping would hide a gradient off by a constant factor from the
weights), and the largest relative parameter difference; the end, a verdict against the tolerance
(fp64: 1e-9).

The objective is the same for every layout; the arithmetic is not always. Before the steps it
names the modules that make a layout compute something else than one big pass
(`equivalence_caveats`): batch-dependent ones (BatchNorm and kin, modules listed with
--batch-dependent) compute a different function on a microbatch than on the global batch, and
stochastic ones (dropout) draw other random masks. Dropout is turned off for the comparison, and
the report says so; a batch-dependent module shows as a difference. `log_equivalence_caveats`
gives the trainer the same warnings at start-up.
"""

from __future__ import annotations

import argparse
import copy
import logging
import math
import sys
from dataclasses import dataclass, field
from typing import Iterable

import torch
from torch import nn

log = logging.getLogger(__name__)

TOLERANCES = {"fp64": 1e-9, "fp32": 1e-4, "bf16": 3e-2}
"""Largest relative difference (loss and parameters) that still counts as agreement, per precision."""

_DROPOUT_ATTRIBUTES = ("dropout", "pdrop", "dropout_p", "attention_dropout")


# -- what makes a layout compute something else than one big pass -------------------------------------


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
    from ddptrain.distributed import is_rank_zero

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


# -- the comparison ---------------------------------------------------------------------------------------


@dataclass
class StepComparison:
    step: int
    loss: float
    """The configured layout's global mean loss."""
    reference_loss: float
    """One process's loss over the whole global batch."""
    tokens: int
    loss_difference: float
    """|loss - reference_loss| / |reference_loss|."""
    grad_norm_difference: float
    """Relative difference of the global gradient norms before clipping: AdamW and clipping hide a
    gradient off by a constant factor from the parameters, not from this."""
    parameter_difference: float
    """Largest over parameters of max|p - p_ref| / max|p_ref| after the step."""


@dataclass
class Report:
    layout: str
    precision: str
    device: str
    tolerance: float
    caveats: list[str]
    dropout_disabled: list[str]
    steps: list[StepComparison] = field(default_factory=list)

    @property
    def worst(self) -> float:
        return max((max(s.loss_difference, s.grad_norm_difference, s.parameter_difference) for s in self.steps),
                   default=0.0)

    @property
    def agrees(self) -> bool:
        return self.worst <= self.tolerance  # NaN never agrees


def relative_difference(mine: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """Largest over tensors of max|a - b| / max|b|."""
    worst = 0.0
    for name, ref in reference.items():
        scale = ref.detach().double().abs().max().clamp_min(1e-30)
        difference = (mine[name].detach().double().cpu() - ref.detach().double().cpu()).abs().max()
        worst = max(worst, float(difference / scale))
    return worst


def _relative(value: float, reference: float) -> float:
    if math.isnan(value) and math.isnan(reference):  # both skipped the step (no valid target)
        return 0.0
    return abs(value - reference) / max(abs(reference), 1e-30)


def _resolve_tokenizer(cfg) -> None:
    """As the trainer does: data.tokenizer=null is model=hf's own tokenizer.json when it has one, else bytes."""
    if cfg.data.tokenizer is None:
        found = None
        if cfg.model.get("name") == "hf" and "_target_" not in cfg.model:
            from ddptrain.models.hf import tokenizer_file

            found = tokenizer_file(cfg.model.path)
        cfg.data.tokenizer = str(found) if found is not None else "byte"


def _precision(cfg, on_configured_device: bool) -> str:
    from ddptrain.strategies import strategy_class

    wanted = cfg.trainer.precision if on_configured_device else "fp64"
    supported = strategy_class(cfg.strategy.name).supported_precisions
    return wanted if wanted in supported else "fp32"


def verify(cfg, steps: int = 3, on_configured_device: bool = False, tolerance: float | None = None,
           extra_batch_dependent: Iterable[str] = ()) -> Report:
    """Run `steps` steps of the configured layout and of one process over the whole global batch.

    Call on every rank (inside torchrun, or after ddptrain.init_distributed); every rank returns the
    same report. `cfg` is a validated training config (see compose_config)."""
    from omegaconf import OmegaConf

    from ddptrain.config.schema import grad_accum_steps, strategy_options
    from ddptrain.data import TrainBatches, load_splits
    from ddptrain.distributed import init_distributed
    from ddptrain.engine.engine import Engine
    from ddptrain.models.build import build_model
    from ddptrain.engine.objective import Objective
    from ddptrain.train.optim import build_optimizer, build_scheduler

    dist_info = init_distributed(cfg.dist.timeout_s)
    device = dist_info.device if on_configured_device else torch.device("cpu")
    precision = _precision(cfg, on_configured_device)
    _resolve_tokenizer(cfg)
    batch = cfg.batch
    data = load_splits(cfg.data, batch.seq_len, local_rank=dist_info.local_rank)
    batches = TrainBatches(data.train, batch.global_size, batch.micro_size, cfg.run.seed, dist_info.rank,
                           dist_info.world_size, micro_tokens=batch.micro_tokens, pack=batch.pack,
                           seq_len=batch.seq_len)
    torch.manual_seed(cfg.run.seed)
    model, _ = build_model(OmegaConf.to_container(cfg.model, resolve=True), data.vocab_size, batch.seq_len)
    caveats = equivalence_caveats(model, extra_batch_dependent)
    dropout_disabled = disable_dropout(model)
    reference = copy.deepcopy(model)  # the same initial weights

    def optimizer_and_schedule(module):
        optimizer = build_optimizer(module, cfg.optim.name, cfg.optim.lr, cfg.optim.weight_decay,
                                    tuple(cfg.optim.betas))
        return optimizer, build_scheduler(optimizer, cfg.optim.schedule, cfg.optim.warmup_steps,
                                          cfg.optim.decay_steps or cfg.trainer.max_steps, cfg.optim.min_lr_ratio)

    varies = batch.micro_tokens is not None or batch.pack
    layout_options = {"micro_batch_size": batch.micro_size,
                      "grad_accum_steps": 1 if varies else grad_accum_steps(batch.global_size, batch.micro_size,
                                                                            dist_info.world_size)}
    objective = Objective(label_smoothing=cfg.objective.label_smoothing, z_loss=cfg.objective.z_loss)
    optimizer, scheduler = optimizer_and_schedule(model)
    engine = Engine(model, optimizer, cfg.strategy.name, grad_clip=cfg.trainer.grad_clip, lr_scheduler=scheduler,
                    precision=precision, nonfinite="skip", device=device, objective=objective,
                    strategy_options={**strategy_options(cfg.strategy), **layout_options})
    one_process = _OneProcess(reference, *optimizer_and_schedule(reference), objective, cfg.trainer.grad_clip,
                              precision, device)
    names = [name for name, _ in reference.named_parameters()]
    report = Report(_describe_layout(cfg, dist_info.world_size), precision, str(device),
                    tolerance if tolerance is not None else TOLERANCES[precision], caveats, dropout_disabled)
    for step in range(steps):
        most = max(len(micro) for micro in batches.layout(step))  # strategies that talk every microbatch need it
        stats = engine.step(batches.microbatches(step), max_microbatches=most)
        reference_loss, reference_norm = one_process.step(*batches.examples.collate(batches.plan.global_batch(step)))
        weights = engine.model_state_dict()  # collective (sharded strategies gather)
        difference = relative_difference({n: weights[n] for n in names}, dict(reference.named_parameters()))
        report.steps.append(StepComparison(step + 1, stats.loss, reference_loss, stats.tokens,
                                           _relative(stats.loss, reference_loss),
                                           _relative(stats.grad_norm, reference_norm), difference))
    return report


class _OneProcess:
    """The objective the plain way, on one process: one forward over the whole global batch."""

    def __init__(self, model, optimizer, scheduler, objective, grad_clip, precision: str, device):
        self.model = model.to(device=device, dtype=torch.float64 if precision == "fp64" else None)
        self.optimizer, self.scheduler, self.objective = optimizer, scheduler, objective
        self.grad_clip, self.precision, self.device = grad_clip, precision, device

    def step(self, inputs, targets: torch.Tensor) -> tuple[float, float]:
        """(loss, gradient norm before clipping) of one step; NaNs when the batch has no valid target."""
        from ddptrain.models.build import logits_of
        from ddptrain.engine.objective import IGNORE_INDEX

        targets = targets.to(self.device)
        tokens = int((targets != IGNORE_INDEX).sum())
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.precision == "bf16"):
            if isinstance(inputs, dict):
                output = self.model(**{key: value.to(self.device) for key, value in inputs.items()})
            else:
                output = self.model(inputs.to(self.device))
            loss_sum = self.objective.token_sum(logits_of(output), targets)
        if tokens == 0:  # the trainer skips such a step
            self.optimizer.zero_grad(set_to_none=True)
            return float("nan"), float("nan")
        (loss_sum / tokens).backward()
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.grad_clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, self.grad_clip, foreach=True)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        if math.isfinite(float(norm)):
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss_sum.detach()) / tokens, float(norm)


def _describe_layout(cfg, world_size: int) -> str:
    from ddptrain.config.schema import grad_accum_steps

    batch = cfg.batch
    if batch.micro_tokens is not None:
        micro = f"microbatches of <= {batch.micro_tokens} padded tokens"
    else:
        micro = f"micro {batch.micro_size}"
        if not batch.pack:
            micro += f" x accumulation {grad_accum_steps(batch.global_size, batch.micro_size, world_size)}"
    packed = ", packed rows" if batch.pack else ""
    return (f"strategy {cfg.strategy.name}, {micro} x world {world_size} = global batch {batch.global_size} "
            f"sequences{packed}")


# -- command line -------------------------------------------------------------------------------------------


def compose_config(overrides: list[str]):
    """The training config for these Hydra overrides (conf/ and the typed defaults), not validated."""
    from hydra import compose, initialize_config_dir, initialize_config_module

    from ddptrain.__main__ import CONFIG_PATH
    from ddptrain.config.schema import register_configs

    register_configs()
    if CONFIG_PATH.startswith("pkg://"):
        context = initialize_config_module(config_module=CONFIG_PATH.removeprefix("pkg://"), version_base="1.3")
    else:
        context = initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3")
    with context:
        return compose(config_name="config", overrides=list(overrides))


def format_report(report: Report) -> str:
    lines = [f"layout: {report.layout} | {report.precision} on {report.device}",
             "caveats:" if report.caveats else "caveats: none (no batch-dependent or stochastic module found)"]
    lines += [f"  - {caveat}" for caveat in report.caveats]
    if report.dropout_disabled:
        lines.append(f"dropout is off (p=0) in both runs for this comparison: {', '.join(report.dropout_disabled)}; "
                     "with it on, no two layouts draw the same masks")
    lines.append(f"{'step':>4}  {'loss (layout)':>20}  {'loss (one process)':>20}  {'tokens':>7}  "
                 f"{'loss rel. diff':>14}  {'grad norm rel. diff':>19}  {'max param rel. diff':>19}")
    for s in report.steps:
        lines.append(f"{s.step:>4}  {s.loss:>20.15g}  {s.reference_loss:>20.15g}  {s.tokens:>7}  "
                     f"{s.loss_difference:>14.3e}  {s.grad_norm_difference:>19.3e}  {s.parameter_difference:>19.3e}")
    if report.agrees:
        off = " (with dropout off)" if report.dropout_disabled else ""
        lines.append(f"verdict: AGREE - the layout's update equals one process's over the whole global batch{off} "
                     f"(largest relative difference {report.worst:.3e} <= {report.tolerance:g})")
    else:
        cause = ("; the batch-dependent modules above compute another function on a microbatch"
                 if any(c.startswith("batch-dependent") for c in report.caveats) else "")
        lines.append(f"verdict: DIFFERENT - largest relative difference {report.worst:.3e} > {report.tolerance:g}"
                     f"{cause}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m ddptrain.verify",
        description="Run a few steps of the configured layout beside one process that sees the whole global batch, "
                    "and compare losses and parameters. Takes the training overrides (key=value).")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for `python -m ddptrain`")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps to compare (default: 3)")
    parser.add_argument("--device", choices=("cpu", "configured"), default="cpu",
                        help="cpu: fp64 on the CPU (default); configured: the run's device and trainer.precision")
    parser.add_argument("--tolerance", type=float, default=None,
                        help=f"largest relative difference that agrees (default: {TOLERANCES})")
    parser.add_argument("--batch-dependent", action="append", default=[], metavar="NAME",
                        help="a module (class name or module path) whose output depends on the other rows of its "
                             "batch, e.g. an MoE router with per-batch load balancing (repeatable)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps={args.steps} must be >= 1")

    from hydra.errors import HydraException

    from ddptrain.config.schema import ConfigError, validate
    from ddptrain.data import DataError
    from ddptrain.distributed import destroy_distributed, env_world_size, is_rank_zero, setup_logging
    from ddptrain.models.build import ModelError

    setup_logging()
    try:
        cfg = compose_config(args.overrides)
        validate(cfg, env_world_size())
    except (ConfigError, HydraException) as error:
        print(f"config error: {str(error).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)
    try:
        report = verify(cfg, args.steps, args.device == "configured", args.tolerance, args.batch_dependent)
        if is_rank_zero():
            print(format_report(report), flush=True)
    except (DataError, ModelError, ValueError) as error:
        print(f"verify error: {error}", file=sys.stderr)
        sys.exit(2)
    finally:
        destroy_distributed()
    sys.exit(0 if report.agrees else 1)


if __name__ == "__main__":
    main()
