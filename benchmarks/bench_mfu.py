"""MFU on a CPU, and where the rest goes: the default run's step and the real model's LoRA step.

    python -m benchmarks.bench_mfu                                   # default GPT, real model LoRA, real model full
    python -m benchmarks.bench_mfu --runs real-lora --threads 2 --steps 6

Each run is a fresh process without a process group (one rank's share of the step), built through
the training command's own builder, so the model, the layout and the FLOP count are the trainer's:

- `default`: nothing set (the built-in GPT and data, as `python -m ddptrain` runs them);
- `real-lora` / `real-full`: SmolLM2-135M-Instruct (tests/real_model.py), data=sft on WordNet
  prompt-completion pairs (tests/real_text.py), seq_len 256, 16 pairs per step (one rank's share of
  bench_peer --mode sft --real's 32 on 2 ranks), LoRA r=16 on every linear layer, or full.

Per step: the model FLOPs the trainer counts (`ModelFlops`: 4N for frozen weights, 6N for trained
ones, the chunked head on valid targets), the step's wall time, and MFU against the same
`probe_peak_flops` the trainer runs at start-up (at the run's threads), re-probed before every step
so that another job's load lowers the peak and the step alike; beside it the same by the step's
CPU time (process time, one thread: what the step would take with the core to itself). Then one profiled step splits the
time: the matmuls (aten::mm, addmm, bmm: their share of the step and the rate they reach against the
probe), attention, the rest (elementwise, norms, the optimizer, Python). MFU is about the product of
the matmuls' share and their rate: a figure, not a test.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch

from benchmarks.bench_memory_lora import run_worker

MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
ATTENTION = ("aten::_scaled_dot_product_flash_attention_for_cpu",
             "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
             "aten::_scaled_dot_product_attention_math", "aten::_softmax", "aten::_softmax_backward_data")
RUNS = {
    "default": [],
    "real-lora": ["model.lora.r=16"],
    "real-full": ["model.lora.r=0"],
}


def overrides_of(run: str, cache: str, seq_len: int, global_batch: int) -> list[str]:
    common = [f"run.dir={cache}/run-{run}", f"data.cache_dir={cache}", "trainer.precision=fp32"]
    if run == "default":
        return common
    from tests.real_model import smollm2_dir
    from tests.real_text import wordnet_records

    return [*common, "model=hf", f"model.path={smollm2_dir()}", "data=sft",
            f"data.paths=[{wordnet_records(2000, seed=1)}]", f"data.val_paths=[{wordnet_records(8, seed=2)}]",
            f"batch.seq_len={seq_len}", f"batch.global_size={global_batch}", *RUNS[run]]


def worker(args) -> None:
    from torch.profiler import ProfilerActivity, profile

    from ddptrain.config.compose import compose_config
    from ddptrain.distributed import DistInfo
    from ddptrain.train.builder import build
    from ddptrain.train.flops import ModelFlops, probe_peak_flops

    torch.set_num_threads(args.threads)
    cfg = compose_config(overrides_of(args.worker, args.cache, args.seq_len, args.global_batch) + args.extra.split())
    built = build(cfg, DistInfo(0, 1, 0, torch.device("cpu"), "gloo"))
    counted = ModelFlops.of_module(built.model, built.engine.chunked_head)
    mfus = []
    for step in range(args.steps):
        peak = probe_peak_flops(torch.device("cpu"), "fp32").flops_per_second
        microbatches = built.batches.microbatches(step)
        shapes = [tuple((inputs["idx"] if isinstance(inputs, dict) else inputs).shape) for inputs, _ in microbatches]
        profiled = step == args.steps - 1
        if profiled:
            profiler = profile(activities=[ProfilerActivity.CPU], with_flops=True)
            profiler.__enter__()
        started, started_cpu = time.perf_counter(), time.process_time()
        stats = built.engine.step(microbatches)
        seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - started_cpu
        valid = int(stats.tokens)
        flops = sum(counted.per_microbatch(rows, width) for rows, width in shapes) + counted.per_valid_target() * valid
        if profiled:
            profiler.__exit__(None, None, None)
            print(f"  step {step} (profiled, not in the median): {' '.join(f'{r}x{w}' for r, w in shapes)} | "
                  f"{seconds:.2f} s under the profiler", flush=True)
            breakdown(profiler.key_averages(), peak, flops)
            continue
        mfu, by_cpu = flops / seconds / peak, flops / max(cpu_seconds, 1e-9) / peak
        if step:  # the first step warms up (allocator, kernels)
            mfus.append((mfu, by_cpu))
        print(f"  step {step}: {' '.join(f'{r}x{w}' for r, w in shapes)} | {valid} valid targets | "
              f"{flops / 1e9:,.1f} GFLOP counted in {seconds:.2f} s = {flops / seconds / 1e9:,.1f} GFLOP/s | "
              f"probe {peak / 1e9:,.1f} GFLOP/s | MFU {mfu:.1%} | by CPU time ({cpu_seconds:.2f} s) {by_cpu:.1%}",
              flush=True)
    if mfus:
        middle = len(mfus) // 2
        print(f"  MFU median of steps 1..{args.steps - 2}: {sorted(m for m, _ in mfus)[middle]:.1%} "
              f"(by CPU time {sorted(c for _, c in mfus)[middle]:.1%})", flush=True)


def breakdown(events, peak: float, counted_flops: float) -> None:
    """The profiled step's self CPU time by kind of op, and the matmuls' own FLOP rate."""
    total = sum(event.self_cpu_time_total for event in events) / 1e6
    matmul_s = sum(event.self_cpu_time_total for event in events if event.key in MATMULS) / 1e6
    matmul_flops = sum(event.flops for event in events if event.key in MATMULS)
    attention_s = sum(event.self_cpu_time_total for event in events if event.key in ATTENTION) / 1e6
    rest = sorted((event for event in events if event.key not in MATMULS + ATTENTION),
                  key=lambda event: -event.self_cpu_time_total)[:6]
    rate = matmul_flops / matmul_s if matmul_s else 0.0
    print(f"  where the step's time goes (self CPU time, {total:.2f} s in ops):", flush=True)
    print(f"    matmuls    {matmul_s / total:6.1%}  {matmul_flops / 1e9:,.1f} GFLOP at {rate / 1e9:,.1f} GFLOP/s = "
          f"{rate / peak:.0%} of the probe's peak", flush=True)
    print(f"    attention  {attention_s / total:6.1%}", flush=True)
    print(f"    the rest   {1 - (matmul_s + attention_s) / total:6.1%}  (largest: "
          + ", ".join(f"{event.key} {event.self_cpu_time_total / 1e6 / total:.1%}" for event in rest) + ")", flush=True)
    print(f"    matmul FLOPs run / FLOPs counted: {matmul_flops / counted_flops:.2f}; share x rate = "
          f"{matmul_s / total * rate / peak:.1%}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="default,real-lora,real-full", help=f"comma-separated, of {', '.join(RUNS)}")
    parser.add_argument("--steps", type=int, default=5, help="steps per run: the first warms up, the last is profiled")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the probe uses the same)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--global-batch", type=int, default=16, help="real model: pairs per step (one rank's share)")
    parser.add_argument("--extra", default="", help="more overrides for every run, space-separated")
    parser.add_argument("--cache", default=None, help="data cache directory (default: a temporary one)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        return worker(args)
    runs = [run.strip() for run in args.runs.split(",") if run.strip()]
    unknown = [run for run in runs if run not in RUNS]
    if unknown or args.steps < 3:
        raise SystemExit(f"--runs {unknown} must be of {list(RUNS)}" if unknown else
                         f"--steps {args.steps}: at least 3 (a warm-up, a timed step and the profiled one)")
    with tempfile.TemporaryDirectory(prefix="bench_mfu_") as cache:
        print(f"benchmarks.bench_mfu: one rank's step in one process, {args.threads} thread(s), fp32, cpu; "
              f"MFU = FLOPs counted as the trainer counts them / step time / the probe's peak (re-probed each step)",
              flush=True)
        for run in runs:
            print(f"{run}:", flush=True)
            cmd = [sys.executable, "-m", "benchmarks.bench_mfu", "--worker", run, "--steps", str(args.steps),
                   "--threads", str(args.threads), "--seq-len", str(args.seq_len), "--global-batch",
                   str(args.global_batch), "--cache", args.cache or cache, "--extra", args.extra]
            run_worker(cmd, args.threads)


if __name__ == "__main__":
    main()
