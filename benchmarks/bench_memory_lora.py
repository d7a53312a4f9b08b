"""Where rank 0's memory goes under LoRA on the real model: one rank's step, per layout, side by side.

    python -m benchmarks.bench_memory_lora                       # the former default (8 packed rows) beside today's (1)
    python -m benchmarks.bench_memory_lora --layouts "batch.micro_size=8;batch.micro_size=1;batch.pack=false batch.micro_size=4"

Each layout runs in a fresh process (one thread, no process group): SmolLM2-135M-Instruct with LoRA
r=16 on every linear layer (tests/real_model.py), data=sft on WordNet prompt-completion pairs
(tests/real_text.py), seq_len 256, a global batch of 16 pairs: one rank's share of bench_peer --mode
sft --real's 32 on 2 ranks. Built through the training command's own builder, then --steps
optimizer steps. Per step it prints the microbatches' (rows, width), the process's peak resident
set (VmHWM), its resident set after the step, that resident set after glibc's malloc_trim(0) (what
is live: the rest is freed memory that malloc keeps) and the step's CPU seconds (process time: less
sensitive than wall time to other jobs on a shared machine, not insensitive). A figure, not a test.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import time

import torch


def status() -> dict[str, int]:
    """MiB of /proc/self/status's VmHWM, VmRSS, RssAnon and RssFile (Linux)."""
    out = {}
    with open("/proc/self/status") as lines:
        for line in lines:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) // 1024
    return out


def worker(args) -> None:
    from ddptrain.config.compose import compose_config
    from ddptrain.distributed import DistInfo
    from ddptrain.train.builder import build
    from tests.real_model import smollm2_dir
    from tests.real_text import wordnet_records

    torch.set_num_threads(1)
    overrides = ["model=hf", f"model.path={smollm2_dir()}", "data=sft",
                 f"data.paths=[{wordnet_records(2000, seed=1)}]", f"data.val_paths=[{wordnet_records(8, seed=2)}]",
                 f"data.cache_dir={args.cache}", f"batch.seq_len={args.seq_len}", f"batch.global_size={args.global_batch}",
                 "trainer.precision=fp32", f"run.dir={args.cache}/run", f"model.lora.r={args.lora_r}",
                 *args.worker.split()]
    cfg = compose_config(overrides)
    built = build(cfg, DistInfo(0, 1, 0, torch.device("cpu"), "gloo"))
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc_trim(0)
    print(f"  built: rss {status()['VmRSS']:,} MiB", flush=True)
    for step in range(args.steps):
        microbatches = built.batches.microbatches(step)
        shapes = [tuple((inputs["idx"] if isinstance(inputs, dict) else inputs).shape) for inputs, _ in microbatches]
        profiled = args.profile and step == args.steps - 1
        if profiled:
            from torch.profiler import ProfilerActivity, profile

            profiler = profile(activities=[ProfilerActivity.CPU])
            profiler.__enter__()
        started = time.process_time()
        built.engine.step(microbatches)
        seconds = time.process_time() - started
        if profiled:
            profiler.__exit__(None, None, None)
            print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile), flush=True)
        after = status()
        libc.malloc_trim(0)
        print(f"  step {step}: {' '.join(f'{r}x{w}' for r, w in shapes)} ({sum(r * w for r, w in shapes)} positions) | "
              f"peak {after['VmHWM']:,} MiB | after {after['VmRSS']:,} | live {status()['VmRSS']:,} | "
              f"cpu {seconds:.1f}s", flush=True)


def run_worker(cmd: list[str], threads: int = 1) -> None:
    """Runs a benchmark's worker command in a fresh process (`threads` torch threads, offline, this
    checkout first on the path) and prints what it printed; its stderr's tail if it fails. Under the
    tests (DDPTRAIN_TEST_ZYGOTE names their fork server, tests/zygote.py) a `python -m` worker is forked
    from that server, torch already imported: the tests check the report's shape."""
    if os.environ.get("DDPTRAIN_TEST_ZYGOTE") and cmd[:1] == [sys.executable]:
        from tests.zygote import launch_command

        cmd = launch_command(cmd[1:])
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.getcwd()}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    print(done.stdout, end="", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default="batch.micro_size=8;batch.micro_size=1",
                        help="';'-separated layouts, each space-separated overrides (default: data=sft's former "
                             "default, 8 packed rows per microbatch, beside today's, one row per microbatch)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--global-batch", type=int, default=16, help="pairs per step (one rank's share)")
    parser.add_argument("--lora-r", type=int, default=16, help="0: full fine-tuning")
    parser.add_argument("--cache", default=None, help="data cache directory (default: a temporary one)")
    parser.add_argument("--profile", type=int, default=0,
                        help="print torch.profiler's table of the last step's ops by self CPU time, this many rows")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        return worker(args)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bench_memory_lora_") as cache:
        print(f"benchmarks.bench_memory_lora: SmolLM2-135M-Instruct, {'LoRA r=%d' % args.lora_r if args.lora_r else 'full'}"
              f", WordNet pairs, seq_len {args.seq_len}, {args.global_batch} pairs per step (one rank), 1 thread, "
              f"fp32; MiB of the process's resident set", flush=True)
        for layout in args.layouts.split(";"):
            print(f"{layout.strip() or '(defaults)'}:", flush=True)
            cmd = [sys.executable, "-m", "benchmarks.bench_memory_lora", "--worker", layout.strip(), "--steps",
                   str(args.steps), "--seq-len", str(args.seq_len), "--global-batch", str(args.global_batch),
                   "--lora-r", str(args.lora_r), "--cache", args.cache or cache, "--profile", str(args.profile)]
            run_worker(cmd)


if __name__ == "__main__":
    main()
