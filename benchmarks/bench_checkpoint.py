"""Checkpoint save and verify time against size, on 2 gloo ranks, beside a plain torch.save; and
the training stall per save with and without checkpoint.async_save.

    python -m benchmarks.bench_checkpoint [--mb 400] [--dir /tmp]

Each rank holds half of the state (as under ZeRO or FSDP, where every rank writes its shard).
Printed side by side, in seconds per GB of checkpoint:

- torch.save     every rank torch.saves its shard and fsyncs it (the floor: no checksums, no marker)
- before         ddptrain's previous scheme: after a barrier, rank 0 alone fsyncs and hashes every file
- ddptrain save  write_checkpoint: every rank fsyncs and hashes its share; rank 0 writes the marker
- verify before  rank 0 hashes every file serially (the previous resume check)
- verify now     agree_on_checkpoint: every rank hashes its share

Then a real Engine (ddp on the same 2 ranks, a GPT whose weights and AdamW state make about --mb)
trains and checkpoints, and each save's stall of the training loop is printed side by side:

- sync           write_checkpoint: the step waits for every file, digest and the marker
- async          start_checkpoint (the copy to host memory) + commit (digests of the files written in
                 the background, marker, rename) after the steps that ran meanwhile
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch


class _ShardStrategy:
    """Writes this rank's shard of the state, as a sharded strategy does."""

    def __init__(self, shard: dict):
        self.shard = shard

    def save(self, directory: Path) -> None:
        from ddptrain.distributed import get_rank
        from ddptrain.fsutil import save_torch

        directory.mkdir(parents=True, exist_ok=True)
        save_torch(self.shard, directory / f"shard_rank{get_rank()}.pt")


def _timed(fn) -> float:
    from ddptrain.distributed import barrier

    barrier()
    started = time.perf_counter()
    fn()
    barrier()
    return time.perf_counter() - started


def _ranks(root: str, megabytes: int, rounds: int) -> dict:
    from ddptrain.runs import store as ckpt
    from ddptrain.distributed import barrier, get_rank, get_world_size, is_rank_zero
    from ddptrain.fsutil import fsync_file, save_torch, sha256_file

    rank, world = get_rank(), get_world_size()
    numel = megabytes * (1 << 20) // 4 // world
    shard = {f"layer{i}": torch.randn(numel // 8) for i in range(8)}
    figures: dict[str, list[float]] = {k: [] for k in ("torch.save", "before", "ddptrain save", "verify before",
                                                       "verify now")}
    for index in range(rounds):
        base = Path(root) / f"round{index}"
        plain = base / "plain"
        if is_rank_zero():
            plain.mkdir(parents=True)
        barrier()
        figures["torch.save"].append(_timed(lambda: save_torch(shard, plain / f"shard_rank{rank}.pt")))

        before = base / "before"

        def old_scheme():
            if is_rank_zero():
                before.mkdir(parents=True)
            barrier()
            torch.save(shard, before / f"shard_rank{rank}.pt")  # the old save: no fsync per rank
            barrier()
            if is_rank_zero():
                sums = {}
                for path in sorted(before.iterdir()):
                    fsync_file(path)
                    sums[path.name] = sha256_file(path)
                (before / "COMPLETE.json").write_text(json.dumps(sums))

        figures["before"].append(_timed(old_scheme))
        figures["ddptrain save"].append(_timed(lambda: ckpt.write_checkpoint(
            base / "run", 1, {"step": 1}, save_state=_ShardStrategy(shard).save)))
        path = ckpt.checkpoint_dir(base / "run") / ckpt.step_name(1)
        figures["verify before"].append(_timed(lambda: ckpt.verify(path) if is_rank_zero() else None))
        figures["verify now"].append(_timed(lambda: ckpt.agree_on_checkpoint(base / "run", "auto")))
        barrier()
        if is_rank_zero():
            size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
            figures.setdefault("bytes", []).append(size)
            shutil.rmtree(base)
        barrier()
    return figures


def _stall(root: str, megabytes: int, rounds: int) -> dict:
    """Seconds the loop stands still per save, sync and async, on a real Engine (ddp)."""
    from ddptrain.distributed import all_ranks, barrier, get_rank, is_rank_zero
    from ddptrain.engine.engine import Engine
    from ddptrain.models.gpt import GPT, GPTConfig
    from ddptrain.runs import store as ckpt
    from ddptrain.train.optim import build_optimizer

    vocab, width = 8192, 64
    while 3 * 4 * (vocab * (width + 64) + 12 * (width + 64) ** 2) <= megabytes * (1 << 20):
        width += 64  # weights + AdamW's two moments, fp32: about `megabytes` in all
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab, max_seq_len=64, n_layer=1, n_head=2, n_embd=width))
    engine = Engine(model, build_optimizer(model, "adamw", 1e-3, 0.1, (0.9, 0.95)), "ddp", device=torch.device("cpu"))
    generator = torch.Generator().manual_seed(get_rank())

    def step():
        tokens = torch.randint(0, vocab, (2, 65), generator=generator)
        engine.step([(tokens[:, :-1], tokens[:, 1:])])

    step()
    figures: dict[str, list[float]] = {"sync": [], "async": [], "async start": [], "async commit": [],
                                       "steps during write": []}
    for index in range(rounds):
        run = Path(root) / f"stall{index}"
        figures["sync"].append(_timed(lambda: ckpt.write_checkpoint(run, 1, {"step": 1}, save_state=engine.save)))
        barrier()
        started = time.perf_counter()
        pending = ckpt.start_checkpoint(run, 2, {"step": 2}, lambda d: engine.save(d, background=True))
        start = time.perf_counter() - started
        steps = 0
        while not all_ranks(pending.done(), torch.device("cpu")):
            step()
            steps += 1
        started = time.perf_counter()
        pending.commit()
        commit = time.perf_counter() - started
        figures["async start"].append(start)
        figures["async commit"].append(commit)
        figures["async"].append(start + commit)
        figures["steps during write"].append(steps)
        if is_rank_zero():
            figures.setdefault("bytes", []).append(sum(p.stat().st_size for p in (run / "checkpoints").rglob("*")
                                                       if p.is_file()))
            shutil.rmtree(run)
        barrier()
    return figures


def main() -> None:
    from ddptrain.testing import run_distributed

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=400, help="total checkpoint payload in MB, split over 2 ranks")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="bench_checkpoint_", dir=args.dir)
    try:
        figures = run_distributed(_ranks, 2, root, args.mb, args.rounds, timeout_s=1800)[0]
        stalls = run_distributed(_stall, 2, root, args.mb, args.rounds, timeout_s=1800)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gigabytes = sum(figures.pop("bytes")) / len(figures["torch.save"]) / 1e9
    print(f"checkpoint of {gigabytes:.3f} GB on 2 ranks, {args.rounds} rounds (median seconds, seconds per GB):")
    for name, seconds in figures.items():
        median = sorted(seconds)[len(seconds) // 2]
        print(f"  {name:<14} {median:8.3f} s   {median / gigabytes:8.3f} s/GB")
    size = sum(stalls.pop("bytes")) / len(stalls["sync"]) / 1e9
    steps = stalls.pop("steps during write")
    print(f"training stall per save, a {size / 2:.3f} GB checkpoint of a ddp Engine on 2 ranks (median seconds; "
          "two checkpoints per round, one each way):")
    print(f"  {'sync':<14} {'async':>8} {'start':>8} {'commit':>8}   steps trained while writing")
    median = {name: sorted(values)[len(values) // 2] for name, values in stalls.items()}
    print(f"  {median['sync']:<14.3f} {median['async']:>8.3f} {median['async start']:>8.3f} "
          f"{median['async commit']:>8.3f}   {sorted(steps)[len(steps) // 2]}")


if __name__ == "__main__":
    main()
