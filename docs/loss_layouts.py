"""Makes docs/loss_layouts.png: the loss curves of three layouts lie on top of each other; the
naive per-microbatch-mean scheme does not.

    python docs/loss_layouts.py [--steps 60] [--out docs/loss_layouts.png] [--work runs/loss_layouts]

The three layouts are real CLI runs (`python -m ddptrain`, `torchrun` for 2 ranks) of the same
config with global batch 8: 1 rank x micro 8, 2 ranks x micro 2 (accumulation 2), 2 ranks x micro 1
(accumulation 4). The naive run is a DEMONSTRATION ONLY, not a ddptrain option: it builds the same
Trainer (same data, seed, init, optimizer, schedule, evaluation, metrics) in one process with micro
batch 1, and swaps Engine.step for a loop that backpropagates the mean of per-microbatch mean
losses, the scheme docs/architecture.md warns about. Its logged `loss` is still the global mean over valid
tokens of its batch, so all curves measure the same thing.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
COMMON = ["model.n_layer=2", "model.n_head=2", "model.n_embd=64", "data.max_docs=200", "batch.seq_len=256",
          "batch.global_size=8", "trainer.log_every=1", "trainer.eval_every=10", "trainer.eval_examples=32",
          "optim.warmup_steps=5", "optim.lr=3e-3", "checkpoint.resume=none"]
LAYOUTS = {"1x8": (1, 8), "2x2 (accum 2)": (2, 2), "2x1 (accum 4)": (2, 1)}


def run_layout(run_dir: Path, nproc: int, micro: int, steps: int) -> None:
    args = [*COMMON, f"trainer.max_steps={steps}", f"batch.micro_size={micro}", f"run.dir={run_dir}"]
    launcher = [sys.executable, "-m", "ddptrain"] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "ddptrain"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([*launcher, *args], cwd=REPO, env=env)
    steps_logged = len((run_dir / "metrics.jsonl").read_text().splitlines()) if (run_dir / "metrics.jsonl").exists() else 0
    if done.returncode != 0:
        if steps_logged != steps:
            raise SystemExit(f"{run_dir}: exit code {done.returncode} after {steps_logged} of {steps} steps")
        print(f"WARNING: {run_dir}: exit code {done.returncode} at teardown, after all {steps} steps were logged")


def run_naive(run_dir: Path, steps: int) -> None:
    """One process, micro batch 1 (8 microbatches), loss = mean over microbatches of their means."""
    from hydra import compose, initialize_config_dir

    from ddptrain.config import CONFIG_PATH
    from ddptrain.config import register_configs, validate
    from ddptrain.distributed import init_distributed, setup_logging
    from ddptrain.engine.engine import StepStats
    from ddptrain.contract.targets import IGNORE_INDEX
    from ddptrain.engine.objective import token_loss_sum
    from ddptrain.train.trainer import Trainer

    setup_logging()
    register_configs()
    with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
        cfg = compose("config", overrides=[*COMMON, f"trainer.max_steps={steps}", "batch.micro_size=1",
                                           f"run.dir={run_dir}"])
    validate(cfg, 1)
    trainer = Trainer(cfg, init_distributed()).build()
    engine, model, optimizer = trainer.engine, trainer.engine.model, trainer.optimizer

    def naive_step(microbatches) -> StepStats:
        started = time.perf_counter()
        losses, sums, counts = [], 0.0, 0
        for inputs, targets in microbatches:
            loss_sum = token_loss_sum(engine.forward(inputs), targets)
            valid = int((targets != IGNORE_INDEX).sum())
            sums, counts = sums + float(loss_sum), counts + valid
            losses.append(loss_sum / max(valid, 1))  # THE BUG: a short example weighs as much as a long one
        (torch.stack(losses).mean()).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.grad_clip)
        optimizer.step()
        engine.lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return StepStats(loss=sums / counts if counts else math.nan, tokens=counts, grad_norm=float(grad_norm),
                         forward_backward_s=time.perf_counter() - started)

    engine.step = naive_step
    try:
        trainer.fit()
    finally:
        trainer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default=str(REPO / "docs" / "loss_layouts.png"))
    parser.add_argument("--work", default=str(REPO / "runs" / "loss_layouts"))
    parser.add_argument("--plot-only", action="store_true", help="replot the runs already under --work")
    args = parser.parse_args()
    work = Path(args.work)
    runs = {name: work / f"layout_{nproc}x{micro}" for name, (nproc, micro) in LAYOUTS.items()}
    runs["naive per-microbatch mean (1x1, accum 8)"] = work / "naive_microbatch_mean"
    if not args.plot_only:
        for name, (nproc, micro) in LAYOUTS.items():
            run_layout(runs[name], nproc, micro, args.steps)
        run_naive(runs["naive per-microbatch mean (1x1, accum 8)"], args.steps)
    plot(runs, Path(args.out))


def plot(runs: dict[str, Path], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ddptrain.plot import read_run

    rows = {name: read_run(run) for name, run in runs.items()}
    reference = {row["step"]: row["loss"] for row in next(iter(rows.values()))}
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8), constrained_layout=True)
    styles = {0: dict(linewidth=4, alpha=0.5), 1: dict(linewidth=2), 2: dict(linewidth=1, linestyle="--")}
    for index, (name, metrics) in enumerate(rows.items()):
        is_naive = name.startswith("naive")
        style = dict(color="C3", linewidth=1.5) if is_naive else dict(color=f"C{index}", **styles[index])
        steps = [row["step"] for row in metrics]
        left.plot(steps, [row["loss"] for row in metrics], label=name, **style)
        diffs = [(row["step"], abs(row["loss"] - reference[row["step"]])) for row in metrics[1:]]
        if index:
            right.semilogy([d[0] for d in diffs], [max(d[1], 1e-12) for d in diffs], label=name, **style)
    left.set(title="training loss (global mean over valid tokens)", xlabel="optimizer step", ylabel="loss")
    right.set(title="|loss - loss of layout 1x8|", xlabel="optimizer step", ylabel="absolute difference (log)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle("Same global batch of 8 sequences: any layout gives the same curve (fp32 rounding only); "
                 "averaging per-microbatch means does not")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
