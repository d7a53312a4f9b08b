"""Checkpoint save and verify time against size, on 2 gloo ranks, beside a plain torch.save.

    python -m benchmarks.bench_checkpoint [--mb 400] [--dir /tmp]

Each rank holds half of the state (as under ZeRO or FSDP, where every rank writes its shard).
Printed side by side, in seconds per GB of checkpoint:

- torch.save     every rank torch.saves its shard and fsyncs it (the floor: no checksums, no marker)
- before         ddptrain's previous scheme: after a barrier, rank 0 alone fsyncs and hashes every file
- ddptrain save  write_checkpoint: every rank fsyncs and hashes its share; rank 0 writes the marker
- verify before  rank 0 hashes every file serially (the previous resume check)
- verify now     agree_on_checkpoint: every rank hashes its share
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
    from ddptrain.train import checkpoint as ckpt
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
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gigabytes = sum(figures.pop("bytes")) / len(figures["torch.save"]) / 1e9
    print(f"checkpoint of {gigabytes:.3f} GB on 2 ranks, {args.rounds} rounds (median seconds, seconds per GB):")
    for name, seconds in figures.items():
        median = sorted(seconds)[len(seconds) // 2]
        print(f"  {name:<14} {median:8.3f} s   {median / gigabytes:8.3f} s/GB")


if __name__ == "__main__":
    main()
