"""Padding efficiency and throughput of fixed micro_size vs micro_tokens vs packing.

    python -m benchmarks.bench_data [--seq-len 256] [--steps 40] [--rounds 4]

On the default data (standard-library sources): padding efficiency
(valid target tokens / tokens the model processes) of each layout, then training throughput in
VALID tokens per second of each, interleaved rounds in one process, side by side. A figure, not a
test. micro_size and micro_tokens see the same examples; packing's examples are full rows cut
from the document stream, with attention masked per document.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import ddptrain
from ddptrain.data import load_stdlib
from ddptrain.data.batches import TrainBatches
from ddptrain.models import GPT, GPTConfig
from ddptrain.contract.targets import IGNORE_INDEX


def layouts(args) -> dict[str, dict]:
    return {
        f"micro_size={args.micro_size}": dict(micro_batch_size=args.micro_size),
        f"micro_tokens={args.micro_tokens}": dict(micro_batch_size=args.micro_size, micro_tokens=args.micro_tokens),
        f"pack, micro_size={args.micro_size}": dict(micro_batch_size=args.micro_size, pack=True),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--micro-size", type=int, default=8)
    parser.add_argument("--micro-tokens", type=int, default=None, help="default: micro_size x seq_len")
    parser.add_argument("--steps", type=int, default=200, help="steps measured for padding efficiency")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps-per-round", type=int, default=3)
    args = parser.parse_args()
    args.micro_tokens = args.micro_tokens or args.micro_size * args.seq_len
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    data = load_stdlib(args.seq_len, 5.0)
    examples = data.train
    plans = {name: TrainBatches(examples, args.global_batch, seed=1234, rank=0, world_size=1, seq_len=args.seq_len,
                                **options) for name, options in layouts(args).items()}

    print(f"benchmarks.bench_data: stdlib data, {len(examples)} examples, seq_len {args.seq_len}, "
          f"global batch {args.global_batch}, {args.steps} steps")
    efficiency = {}
    for name, batches in plans.items():
        valid = processed = 0
        for step in range(args.steps):
            valid += sum(int((targets != IGNORE_INDEX).sum()) for _, targets in batches.microbatches(step))
            processed += sum(rows * width for rows, width in batches.global_shapes(step))
        efficiency[name] = valid / processed

    info = ddptrain.init_distributed()
    config = GPTConfig(vocab_size=data.vocab_size, max_seq_len=args.seq_len)
    engines = {}
    for name in plans:
        torch.manual_seed(0)
        model = GPT(config)
        engines[name] = ddptrain.Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), device=info.device)
    rates: dict[str, list[float]] = {name: [] for name in plans}
    step_of = dict.fromkeys(plans, 0)
    for name in plans:  # warm-up
        engines[name].step(plans[name].microbatches(0))
        step_of[name] = 1
    for index in range(args.rounds):
        names = list(plans) if index % 2 == 0 else list(reversed(plans))
        for name in names:
            tokens, start = 0, time.perf_counter()
            for _ in range(args.steps_per_round):
                tokens += engines[name].step(plans[name].microbatches(step_of[name])).tokens
                step_of[name] += 1
            rates[name].append(tokens / (time.perf_counter() - start))

    print(f"{'layout':<30} {'padding efficiency':>19} {'valid tokens/s (median)':>24}")
    for name in plans:
        print(f"{name:<30} {efficiency[name]:>19.4f} {statistics.median(rates[name]):>24.0f}")
    print("targets: micro_tokens >= 0.95, pack >= 0.99")


if __name__ == "__main__":
    main()
