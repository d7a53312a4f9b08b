"""A launch's cost, with and without the garbage collector paused while the rank imports.

    python -m benchmarks.bench_startup [--rounds 8] [--nproc 1] [--steps 4]

`python -m ddptrain` pauses Python's cyclic garbage collector while it imports torch, DCP, dynamo
and Hydra, then freezes what they left (ddptrain/__main__.py `_start_collecting`). This runs the
same short training run (the test model, `--steps` steps) both ways, interleaved round by round,
and prints per launch the wall time and the CPU seconds of every process it started:

- ddptrain   `python -m ddptrain ...`, as users start it
- baseline   the very same module and arguments, run by `runpy` with `gc.disable` and `gc.freeze`
             made no-ops first: the collector runs through the imports, as before the pause

With `--nproc 2` both go through torchrun (`--no-python` for the baseline's command). The CPU
seconds are the figure to read on a shared machine: launches overlap nothing here, but the wall
time moves with whatever else runs.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

RUN = ["model.n_layer=1", "model.n_head=2", "model.n_embd=32", "data.max_docs=40", "trainer.log_every=1",
       "optim.warmup_steps=2", "trainer.eval_examples=8", "batch.global_size=4", "batch.micro_size=1",
       "batch.seq_len=64"]

BASELINE = ("import gc, runpy, sys; gc.disable = gc.freeze = lambda: None; sys.argv[0] = 'ddptrain'; "
            "runpy.run_module('ddptrain', run_name='__main__', alter_sys=True)")
"""`python -m ddptrain` with the collector left running through the imports."""


def _command(kind: str, nproc: int, args: list[str]) -> list[str]:
    python = [sys.executable, "-m", "ddptrain"] if kind == "ddptrain" else [sys.executable, "-c", BASELINE]
    if nproc == 1:
        return [*python, *args]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    if kind == "ddptrain":
        return [*torchrun, "-m", "ddptrain", *args]
    return [*torchrun, "--no-python", *python, *args]


def _launch(command: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the launch's processes)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command[:6])} ... failed:\n{done.stderr[-3000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_startup", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    kinds = ("ddptrain", "baseline")
    figures = {kind: [] for kind in kinds}
    root = tempfile.mkdtemp(prefix="bench_startup_")
    try:
        for round_ in range(args.rounds):
            for kind in kinds if round_ % 2 == 0 else kinds[::-1]:  # alternate which goes first
                run_dir = os.path.join(root, f"{kind}-{round_}")
                run = [*RUN, f"trainer.max_steps={args.steps}", f"run.dir={run_dir}"]
                figures[kind].append(_launch(_command(kind, args.nproc, run)))
                shutil.rmtree(run_dir, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"benchmarks.bench_startup: {args.nproc} rank(s), the test model, {args.steps} steps, "
          f"{args.rounds} rounds interleaved, 1 thread per rank")
    print(f"{'launch':<10} {'wall s (median)':>16} {'CPU s (median)':>15}   CPU s per round")
    for kind in kinds:
        walls, cpus = zip(*figures[kind])
        rounds = " ".join(f"{cpu:.2f}" for cpu in cpus)
        print(f"{kind:<10} {statistics.median(walls):>16.2f} {statistics.median(cpus):>15.2f}   {rounds}")
    ours, theirs = (statistics.median(cpu for _, cpu in figures[kind]) for kind in kinds)
    print(f"ddptrain / baseline CPU: {ours / theirs:.2f} ({theirs - ours:.2f} CPU s saved per launch)")

if __name__ == "__main__":
    main()
