"""Shared pieces of the tests: a tiny model, ragged microbatches, CLI runs, parameter comparison."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from ddptrain.models import GPT, GPTConfig
from ddptrain.engine.objective import IGNORE_INDEX

REPO = Path(__file__).resolve().parent.parent
VOCAB = 32
SEQ = 12


def tiny_gpt(dtype: torch.dtype = torch.float64, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, n_layer=1, n_head=2, n_embd=16)).to(dtype)


def microbatch(rows: int, valid_lengths: list[int], seed: int, width: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of `rows` rows whose first valid_lengths[i] targets are valid, the rest -100."""
    gen = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, VOCAB, (rows, width), generator=gen)
    targets = torch.randint(0, VOCAB, (rows, width), generator=gen)
    for row, length in enumerate(valid_lengths):
        targets[row, length:] = IGNORE_INDEX
    return inputs, targets


def relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest over tensors of max|a - b| / max|b|."""
    worst = 0.0
    for key in b:
        scale = b[key].abs().max().clamp_min(1e-30)
        worst = max(worst, float((a[key].double() - b[key].double()).abs().max() / scale))
    return worst


def run_cli(args: list[str], nproc: int = 1, cwd: Path | None = None, timeout: float = 300,
            env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m ddptrain ARGS` (nproc == 1) or `torchrun --standalone --nproc_per_node=N -m ddptrain ARGS`."""
    if nproc == 1:
        cmd = [sys.executable, "-m", "ddptrain", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", "ddptrain", *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **(env or {})}
    return subprocess.run(cmd, cwd=cwd or REPO, env=full_env, capture_output=True, text=True, timeout=timeout)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


TINY_RUN = ["model.n_layer=1", "model.n_head=2", "model.n_embd=32", "data.max_docs=40", "trainer.log_every=1",
            "optim.warmup_steps=2", "trainer.eval_examples=8"]
