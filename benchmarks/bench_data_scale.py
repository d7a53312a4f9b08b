"""The data side's start-up time, per-step host time and peak memory as the corpus grows.

    python -m benchmarks.bench_data_scale [--tokens 1e7,1e8,2e9] [--seq-len 32] [--baseline /work/main]

For each size, a flat uint16 token file (data=tokens, an end-of-document token about every 1,000
tokens: about 2 million documents at 2x10^9 tokens) is written into --dir (check `df -h` first:
2x10^9 tokens are 4 GB, plus about 1.5 GB of index at seq_len 32; everything is deleted at the end).
A fresh process per measurement (`--child`) imports ddptrain, notes its resident memory, then
loads the splits (the cache entry and the memory-mapped index: `load`), builds TrainBatches and
draws the microbatches of 10 steps (`steps`: the global batches' order included, the epoch
permutation until a bijection replaces it), and reports the time of each and its peak resident
memory (VmHWM) above the memory after its imports. `cold`: an empty cache (the entry and the index
are built); `warm`: the same cache again, the start-up every later run pays. With --baseline DIR,
the same child runs with DIR's ddptrain (an older checkout) on the sizes up to --baseline-max, side
by side. A figure, not a test: the machine's load moves it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
CHUNK = 1 << 26


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def child(args) -> None:
    from ddptrain.config import DataConfig
    from ddptrain.data import TrainBatches, load_splits

    baseline = _status("VmRSS")
    cfg = DataConfig(name="tokens", paths=[args.file], dtype="uint16", eod_token=0, vocab_size=50_000,
                     cache_dir=args.cache, val_percent=0.1)
    started = time.perf_counter()
    data = load_splits(cfg, args.seq_len, local_rank=0)
    loaded = time.perf_counter()
    load_peak = _status("VmHWM") - baseline
    batches = TrainBatches(data.train, 8, 8, 1234, 0, 1, pack=args.pack, seq_len=args.seq_len)
    batches.microbatches(0)
    first = time.perf_counter()
    for step in range(1, 10):
        batches.microbatches(step)
    done = time.perf_counter()
    print(json.dumps({"examples": len(data.train), "load_s": loaded - started, "first_step_s": first - loaded,
                      "step_ms": 1e3 * (done - first) / 9, "load_peak_mib": load_peak / 2**20,
                      "peak_mib": (_status("VmHWM") - baseline) / 2**20, "baseline_mib": baseline / 2**20}))


def write_tokens(path: Path, count: int) -> None:
    """Random ids, an end of document about every 1,000 tokens; one random block written again and
    again (drawing 2x10^9 random numbers would take longer than everything measured)."""
    rng = np.random.default_rng(0)
    block = rng.integers(1, 50_000, min(CHUNK, count), dtype=np.uint16)
    block[rng.random(len(block)) < 1e-3] = 0
    with path.open("wb") as handle:
        for at in range(0, count, CHUNK):
            handle.write(block[: min(CHUNK, count - at)].tobytes())


def run_child(code: Path, file: Path, cache: Path, seq_len: int, pack: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(Path(__file__).resolve()), "--child", "--file", str(file),
               "--cache", str(cache), "--seq-len", str(seq_len)] + (["--pack"] if pack else [])
    result = subprocess.run(command, env=env, capture_output=True, text=True, cwd=code)
    if result.returncode != 0:
        return {"error": result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "failed"}
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1e7,1e8,2e9")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--dir", default="/tmp/bench_data_scale")
    parser.add_argument("--baseline", default=None, help="an older checkout's root, run side by side")
    parser.add_argument("--baseline-max", type=float, default=1e8, help="largest size the baseline runs at")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--file", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    parser.add_argument("--pack", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    work = Path(args.dir)
    work.mkdir(parents=True, exist_ok=True)
    codes = {"this": REPO} | ({"baseline": Path(args.baseline)} if args.baseline else {})
    print(f"benchmarks.bench_data_scale: data=tokens (uint16, a document every ~1,000 tokens), seq_len "
          f"{args.seq_len}, global batch 8, one rank; {len(os.sched_getaffinity(0))} CPU cores")
    print(f"{'tokens':>8s} {'code':9s} {'pack':5s} {'cache':5s} {'examples':>10s} {'load s':>7s} {'load MiB':>9s} "
          f"{'1st step s':>10s} {'step ms':>8s} {'peak MiB':>9s}")
    try:
        for count in (int(float(t)) for t in args.tokens.split(",")):
            file = work / f"tokens-{count}.bin"
            started = time.perf_counter()
            write_tokens(file, count)
            print(f"# wrote {file} ({file.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - started:.0f}s",
                  flush=True)
            for name, code in codes.items():
                if name == "baseline" and count > args.baseline_max:
                    continue
                cache = work / f"cache-{name}"
                shutil.rmtree(cache, ignore_errors=True)
                for pack, state in ((False, "cold"), (False, "warm"), (True, "cold"), (True, "warm")):
                    r = run_child(code, file, cache, args.seq_len, pack)
                    if "error" in r:
                        print(f"{count:8.0e} {name:9s} {str(pack):5s} {state:5s} error: {r['error']}", flush=True)
                        continue
                    print(f"{count:8.0e} {name:9s} {str(pack):5s} {state:5s} {r['examples']:10d} {r['load_s']:7.2f} "
                          f"{r['load_peak_mib']:9.1f} {r['first_step_s']:10.2f} {r['step_ms']:8.2f} "
                          f"{r['peak_mib']:9.1f}", flush=True)
                shutil.rmtree(cache, ignore_errors=True)
            file.unlink()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
