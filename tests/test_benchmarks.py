"""The benchmarks in benchmarks/ still run (tiny sizes): they print figures, the tests check only the shape."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.helpers import REPO, import_deepspeed

pytestmark = pytest.mark.slow


def _run(module: str, *args: str) -> str:
    result = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True,
                            timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def test_engine_throughput_benchmark_runs_on_two_ranks():
    out = _run("benchmarks.bench", "--rounds", "2", "--steps-per-round", "1", "--max-docs", "20", "--seq-len", "32",
               "--global-batch", "4", "--micro-batch", "1", "--n-layer", "1", "--n-head", "2", "--n-embd", "32")
    assert out.startswith("benchmarks.bench: world 2 on cpu, GPT 1x32"), out
    assert "median" in out and "(target >= 0.97)" in out, out


def test_padding_benchmark_compares_the_three_layouts():
    out = _run("benchmarks.bench_data", "--seq-len", "32", "--global-batch", "4", "--micro-size", "2", "--steps", "2",
               "--rounds", "1", "--steps-per-round", "1")
    assert out.startswith("benchmarks.bench_data: stdlib data"), out
    for layout in ("micro_size=2", "micro_tokens=64", "pack, micro_size=2"):
        assert f"\n{layout} " in out, out


def test_memory_benchmark_compares_ddp_and_zero1():
    import_deepspeed()
    out = _run("benchmarks.bench_memory", "--n-layer", "1", "--n-embd", "32", "--seq-len", "16", "--strategies",
               "ddp,zero1")
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("strategy"))
    columns = ["strategy", "rank", *re.split(r"\s{2,}", header.strip())[1:]]  # "opt state", then its "vs ddp"
    rows = [line.split() for line in lines if line.startswith(("ddp ", "zero1 "))]
    assert [row[:2] for row in rows] == [["ddp", "0"], ["zero1", "0"], ["ddp", "1"], ["zero1", "1"]], out
    ratio = columns.index("opt state") + 1
    assert float(rows[1][ratio]) == pytest.approx(0.5, abs=0.05), "zero1 holds about half of ddp's optimizer state"
