"""A mixture's bookkeeping per step (host time) beside the step time of the default run.

    python -m benchmarks.bench_mixture [--sources 5] [--examples 1000000000] [--steps 50]

Bookkeeping: what data=mixture adds to a step on the host, for `--sources` sources of `--examples`
examples each (pieces of random sizes up to seq_len; the plan never touches more than a global batch
of them): the plan of the step (each slot's source by earliest deadline, each source's next ids
from its seeded bijection), the per-source figures, and the source of every position of this rank's
microbatches. Step: the default run's configuration (the built-in GPT, batch.global_size x
batch.seq_len of the defaults, one rank, this machine's device) through Engine.step, and the plain
GlobalBatchPlan's host time beside it. A figure, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

import ddptrain
from ddptrain.config.schema import BatchConfig
from ddptrain.data.global_batch import GlobalBatchPlan
from ddptrain.data.mixed import SourceLabels
from ddptrain.data.mixture import MixSource, MixturePlan
from ddptrain.models import GPT, GPTConfig


class _Sizes:
    """Valid targets of `n` examples, computed at the ids asked (an index of 10^9 examples would not fit here)."""

    def __init__(self, n: int, seq_len: int, seed: int):
        self.n, self.seq_len, self.seed = n, seq_len, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, ids):
        ids = np.asarray(ids, dtype=np.uint64)
        return (((ids * np.uint64(0x9E3779B97F4A7C15) + np.uint64(self.seed)) >> np.uint64(40))
                % np.uint64(self.seq_len) + np.uint64(1)).astype(np.int64)

    def max(self) -> int:
        return self.seq_len


def main() -> None:
    defaults = BatchConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sources", type=int, default=5)
    parser.add_argument("--examples", type=int, default=10**9, help="examples per source")
    parser.add_argument("--global-batch", type=int, default=defaults.global_size)
    parser.add_argument("--micro-size", type=int, default=defaults.micro_size)
    parser.add_argument("--seq-len", type=int, default=defaults.seq_len)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--train-steps", type=int, default=5)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    weights = rng.random(args.sources) + 0.1
    sources = [MixSource(f"s{k}", float(weights[k]), _Sizes(args.examples, args.seq_len, k), k * args.examples)
               for k in range(args.sources)]
    plan = MixturePlan(sources, args.global_batch, seed=1)
    labels = SourceLabels([source.offset for source in sources], np.full(1, args.seq_len + 1))
    plain = GlobalBatchPlan(args.examples * args.sources, args.global_batch, seed=1)
    targets = torch.zeros(args.micro_size, args.seq_len, dtype=torch.long)

    mixture_s, plain_s = [], []
    for step in range(args.steps):
        started = time.perf_counter()
        ids = plan.global_batch(step)
        plan.figures(step + 1, [0.0] * args.sources)
        for first in range(0, len(ids), args.micro_size):
            labels(ids[first : first + args.micro_size], targets)
        mixture_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        plain.global_batch(step)
        plain_s.append(time.perf_counter() - started)

    info = ddptrain.init_distributed()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, max_seq_len=args.seq_len))
    engine = ddptrain.Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), device=info.device)
    tokens = torch.randint(0, 256, (args.global_batch, args.seq_len + 1))
    micro = [(tokens[i : i + args.micro_size, :-1], tokens[i : i + args.micro_size, 1:])
             for i in range(0, args.global_batch, args.micro_size)]
    engine.step(micro)  # warm-up
    step_s = []
    for _ in range(args.train_steps):
        started = time.perf_counter()
        engine.step(micro).loss  # noqa: B018 - waits for the device
        step_s.append(time.perf_counter() - started)

    bookkeeping, step = statistics.median(mixture_s), statistics.median(step_s)
    print(f"benchmarks.bench_mixture: {args.sources} sources x {args.examples:,} examples, global batch "
          f"{args.global_batch}, seq_len {args.seq_len}, micro {args.micro_size}, on {info.device.type}")
    print(f"{'per step (median)':<44} {'ms':>10}")
    print(f"{'mixture bookkeeping (plan, figures, labels)':<44} {1e3 * bookkeeping:>10.3f}")
    print(f"{'plain plan (GlobalBatchPlan, bijection)':<44} {1e3 * statistics.median(plain_s):>10.3f}")
    print(f"{'default run step (Engine.step)':<44} {1e3 * step:>10.3f}")
    print(f"bookkeeping / step: {bookkeeping / step:.2%} (target < 1%)")


if __name__ == "__main__":
    main()
