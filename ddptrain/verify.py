"""`python -m ddptrain.verify [OVERRIDES]`: is the configured layout's update the one-process update?

    python -m ddptrain.verify batch.micro_size=2                      # accumulation, in one process
    torchrun --nproc_per_node=2 -m ddptrain.verify batch.micro_size=2  # and data parallel

It takes the same Hydra overrides as training, builds the configured data, model, strategy and
layout, and runs a few steps of it beside ONE process that sees each step's whole global batch at
once and minimises the same objective the plain way (one forward, sum of token losses / valid
tokens, backward, clip, optimizer and schedule step), both from the same weights, in fp64 on the
CPU (--device configured: the run's device and precision). Every step prints the relative
differences of the losses, of the gradient norms before clipping and the largest of the
parameters; the end, a verdict against the tolerance (fp64: 1e-9).

Before the steps it names the modules that make a layout compute something else than one big pass
(`equivalence_caveats`): batch-dependent ones (BatchNorm and kin, --batch-dependent) and stochastic
ones (dropout, turned off for the comparison, as the report says). `log_equivalence_caveats` gives
the trainer the same warnings at start-up. The report read line by line: docs/verify.md.
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
from hydra.errors import HydraException
from torch import nn

from ddptrain.config.choices import STRATEGIES
from ddptrain.config.compose import compose_config
from ddptrain.config.schema import ConfigError, TrainConfig
from ddptrain.data import DataError
from ddptrain.distributed import destroy_distributed, env_world_size, init_distributed, is_rank_zero, setup_logging
from ddptrain.engine.engine import AUTOCAST
from ddptrain.engine.equivalence import disable_dropout, equivalence_caveats, log_equivalence_caveats
from ddptrain.contract.targets import IGNORE_INDEX
from ddptrain.contract.outputs import logits_of
from ddptrain.models.spec import ModelError
from ddptrain.train import builder

log = logging.getLogger(__name__)

TOLERANCES = {"fp64": 1e-9, "fp32": 1e-4, "bf16": 3e-2, "fp16": 1e-2}
"""Largest relative difference (loss and parameters) that still counts as agreement, per precision
(fp16: 10 mantissa bits against bf16's 7, and a dynamic loss scale)."""

__all__ = ["verify", "Report", "StepComparison", "format_report", "main", "compose_config", "equivalence_caveats",
           "log_equivalence_caveats", "disable_dropout", "TOLERANCES"]

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
        return largest(value for s in self.steps
                       for value in (s.loss_difference, s.grad_norm_difference, s.parameter_difference))

    @property
    def agrees(self) -> bool:
        return self.worst <= self.tolerance  # NaN never agrees


def largest(values: Iterable[float]) -> float:
    """The largest of `values` (0 for none), NaN if any is NaN: Python's max() keeps or drops a NaN
    depending on where it stands (max(0.0, nan) is 0.0), which would let a NaN difference agree."""
    worst = 0.0
    for value in values:
        if math.isnan(value):
            return math.nan
        worst = max(worst, value)
    return worst


def relative_difference(mine: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """Largest over tensors of max|a - b| / max|b| (NaN if any tensor differs by NaN)."""
    def one(name: str, ref: torch.Tensor) -> float:
        scale = ref.detach().double().abs().max().clamp_min(1e-30)
        return float((mine[name].detach().double().cpu() - ref.detach().double().cpu()).abs().max() / scale)

    return largest(one(name, ref) for name, ref in reference.items())


def _relative(value: float, reference: float) -> float:
    if math.isnan(value) and math.isnan(reference):  # both skipped the step (no valid target)
        return 0.0
    return abs(value - reference) / max(abs(reference), 1e-30)


def _precision(cfg: TrainConfig, on_configured_device: bool) -> str:
    """fp64 on the CPU, or the run's precision where its strategy supports it (fp32 otherwise)."""
    wanted = cfg.trainer.precision if on_configured_device else "fp64"
    return wanted if wanted in STRATEGIES[cfg.strategy.name].precisions else "fp32"


def verify(cfg: TrainConfig, steps: int = 3, on_configured_device: bool = False, tolerance: float | None = None,
           extra_batch_dependent: Iterable[str] = ()) -> Report:
    """Run `steps` steps of the configured layout and of one process over the whole global batch.

    Call on every rank (inside torchrun, or after ddptrain.init_distributed); every rank returns the
    same report. `cfg` is a validated training config (see compose_config). The layout is built by
    the trainer's own builder; only the one-process reference is built here."""
    if cfg.objective.name != "token":  # its one-process reference is a token loss over one forward
        raise ValueError(f"objective={cfg.objective.name} is not verified yet (its layouts are compared by "
                         "tests/train/test_dpo.py); verify compares the token objective")
    dist_info = init_distributed(cfg.dist.timeout_s)
    device = dist_info.device if on_configured_device else torch.device("cpu")
    precision = _precision(cfg, on_configured_device)
    found: dict = {}

    def prepare(model: nn.Module) -> None:  # before the engine wraps the model: the same initial weights
        found["caveats"] = equivalence_caveats(model, extra_batch_dependent)
        found["dropout_disabled"] = disable_dropout(model)
        found["reference"] = copy.deepcopy(model)

    built = builder.build(cfg, dist_info, device=device, precision=precision, nonfinite="skip", prepare=prepare)
    reference = found["reference"]
    one_process = _OneProcess(reference, *builder.optimizer_and_schedule(cfg, reference), builder.objective_of(cfg),
                              cfg.trainer.grad_clip, precision, device)
    names = [name for name, _ in reference.named_parameters()]
    layout = f"strategy {cfg.strategy.name}, {builder.describe_layout(cfg, dist_info.world_size)}"
    report = Report(layout, precision, str(device), tolerance if tolerance is not None else TOLERANCES[precision],
                    found["caveats"], found["dropout_disabled"])
    batches = built.batches
    for step in range(steps):
        most = max(len(micro) for micro in batches.layout(step))  # strategies that talk every microbatch need it
        stats = built.engine.step(batches.microbatches(step), max_microbatches=most)
        reference_loss, reference_norm = one_process.step(*batches.examples.collate(batches.plan.global_batch(step)))
        weights = built.engine.model_state_dict()  # collective (sharded strategies gather)
        difference = relative_difference({n: weights[n] for n in names}, dict(reference.named_parameters()))
        report.steps.append(StepComparison(step + 1, stats.loss, reference_loss, stats.tokens,
                                           _relative(stats.loss, reference_loss),
                                           _relative(stats.grad_norm, reference_norm), difference))
    return report


class _OneProcess:
    """The objective the plain way, on one process: one forward over the whole global batch, under
    the same autocast as the engine (bf16, fp16) or in the weights' own dtype (fp32, fp64)."""

    def __init__(self, model, optimizer, scheduler, objective, grad_clip, precision: str, device):
        self.model = model.to(device=device, dtype=torch.float64 if precision == "fp64" else None)
        self.optimizer, self.scheduler, self.objective = optimizer, scheduler, objective
        self.grad_clip, self.precision, self.device = grad_clip, precision, device

    def step(self, inputs, targets: torch.Tensor) -> tuple[float, float]:
        """(loss, gradient norm before clipping) of one step; NaNs when the batch has no valid target."""
        targets = targets.to(self.device)
        tokens = int((targets != IGNORE_INDEX).sum())
        with torch.autocast(self.device.type, dtype=AUTOCAST.get(self.precision), enabled=self.precision in AUTOCAST):
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


# -- command line -------------------------------------------------------------------------------------------


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
    if args.tolerance is not None and not 0 <= args.tolerance < math.inf:
        parser.error(f"--tolerance={args.tolerance} must be a finite relative difference >= 0")

    setup_logging()
    try:
        cfg = compose_config(args.overrides)
        builder.validate_run(cfg, env_world_size())
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
