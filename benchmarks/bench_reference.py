"""Per-rank memory of DPO's frozen reference under fsdp and zero3, a whole copy on every rank (as
before) vs sharded like the policy: `python -m benchmarks.bench_reference [--strategies fsdp,zero3]`.

For each strategy and world size, gloo ranks on the CPU each build the same GPT, wrap it with the
strategy (fsdp, or DeepSpeed ZeRO-3 with its default settings) and AdamW,
hold the full fine-tune's reference either way, and take two DPO steps on random pairs. Each way
runs in its own processes, so that a rank's peak resident set (VmHWM) is that way's own. Printed
per rank, side by side: the bytes of reference weights the rank holds (zero3: its partitions, and
any parameter DeepSpeed keeps whole once gathered, below stage3_param_persistence_threshold), its peak RSS, and its peak
RSS above what it held before the model was built (interpreter, torch, the process group).

Each rank first fixes glibc's mmap threshold at 1 MiB (`mallopt(M_MMAP_THRESHOLD)`; `--malloc-default`
leaves it alone): by default glibc raises the threshold after the first large free, so later
parameter all-gather buffers (a few MiB each, every unit in every forward) come from the heap and
stay in the resident set after they are freed, and RSS then measures the allocator's retention more
than what the tensors need (a 2-rank run read the sharded reference's rank 0 50 MiB above the
whole copy's that way).
"""

from __future__ import annotations

import argparse

import torch

WAYS = ("whole", "sharded")
PAIRS_PER_RANK = 2


def _pairs(vocab_size: int, seq_len: int, seed: int):
    """PAIRS_PER_RANK random pairs, one sequence per row, targets on the rows' second halves."""
    from ddptrain.contract.pairs import PairTargets
    from ddptrain.contract.targets import IGNORE_INDEX

    generator = torch.Generator().manual_seed(seed)
    rows = 2 * PAIRS_PER_RANK
    inputs = torch.randint(0, vocab_size, (rows, seq_len), generator=generator)
    tokens = torch.randint(0, vocab_size, (rows, seq_len), generator=generator)
    tokens[:, : seq_len // 2] = IGNORE_INDEX
    sequences = torch.arange(rows).unsqueeze(1).expand(rows, seq_len).clone()
    sequences[:, : seq_len // 2] = -1
    return inputs, PairTargets(tokens, sequences, rows)


def _fix_mmap_threshold() -> None:
    """Large allocations always mmap'd, so freed ones leave the resident set (glibc; elsewhere nothing)."""
    import ctypes
    import ctypes.util

    M_MMAP_THRESHOLD = -3
    try:
        ctypes.CDLL(ctypes.util.find_library("c")).mallopt(M_MMAP_THRESHOLD, 2**20)
    except (OSError, AttributeError):
        pass


def _measure(strategy: str, way: str, n_layer: int, n_embd: int, vocab_size: int, seq_len: int, malloc_default: bool) -> dict:
    import types

    import torch.distributed as dist

    from ddptrain.engine.engine import Engine
    from ddptrain.engine.preference import DPOObjective
    from ddptrain.models import GPT, GPTConfig
    from ddptrain.strategies.base import Strategy
    from ddptrain.train.metrics import peak_memory_bytes
    from ddptrain.train.reference import Reference, frozen_copy

    if not malloc_default:
        _fix_mmap_threshold()
    cpu = torch.device("cpu")
    baseline = peak_memory_bytes(cpu)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab_size, n_layer=n_layer, n_head=max(1, n_embd // 64), n_embd=n_embd,
                          max_seq_len=seq_len))
    frozen = Strategy.frozen_copy(model) if way == "whole" else frozen_copy(model, strategy)
    engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-4), strategy, precision="fp32",
                    objective=DPOObjective(0.1), device=cpu)
    if way == "whole":  # how the reference was held before: Strategy's default, whole on every rank
        engine.strategy.hold_frozen = types.MethodType(Strategy.hold_frozen, engine.strategy)
    reference = Reference(engine, model, frozen)
    for step in range(2):
        microbatch = _pairs(vocab_size, seq_len, seed=1000 * step + dist.get_rank())
        engine.step(reference.fill([microbatch], 1), max_microbatches=1).loss  # noqa: B018 (read: wait for it)
    params = list(reference.model.parameters())
    held = sum((engine.strategy.local_tensor(p).numel() + (p.data.numel() if hasattr(p, "ds_tensor") else 0))
               * p.element_size() for p in params)  # zero3: its partition, and its whole data where persisted
    whole = sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in params)
    return {"held": held, "whole": whole, "peak": peak_memory_bytes(cpu), "baseline": baseline}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default="fsdp", help="comma-separated: fsdp, zero3")
    parser.add_argument("--world-sizes", default="2,4", help="comma-separated numbers of ranks")
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--malloc-default", action="store_true", help="leave glibc's dynamic mmap threshold on")
    args = parser.parse_args(argv)
    from ddptrain.testing import run_distributed

    mib = 2**20
    strategies = args.strategies.split(",")
    print(f"benchmarks.bench_reference: {' and '.join(strategies)}, DPO full fine-tuning, GPT {args.n_layer} layers x "
          f"{args.n_embd} "
          f"(vocab {args.vocab_size}), fp32 AdamW, {PAIRS_PER_RANK} pairs of {args.seq_len} tokens per rank, "
          f"2 steps; MiB per rank{' (glibc malloc as it comes)' if args.malloc_default else ''}")
    print(f"{'ranks':>5} {'rank':>4} | {'reference held':>25} | {'peak RSS':>21} | {'peak above start':>21}")
    pair = f"{'whole':>10}{'sharded':>11}"
    print(f"{'':>5} {'':>4} | {'whole':>12}{'sharded':>13} | {pair} | {pair}")
    for strategy in strategies:
        if len(strategies) > 1:
            print(f"strategy={strategy}")
        for world_size in (int(size) for size in args.world_sizes.split(",")):
            ranks = {way: run_distributed(_measure, world_size, strategy, way, args.n_layer, args.n_embd,
                                          args.vocab_size, args.seq_len, args.malloc_default, timeout_s=900)
                     for way in WAYS}
            for rank in range(world_size):
                whole, sharded = ranks["whole"][rank], ranks["sharded"][rank]
                print(f"{world_size:>5} {rank:>4} | {whole['held'] / mib:>12.1f}{sharded['held'] / mib:>13.1f} | "
                      f"{whole['peak'] / mib:>10.0f}{sharded['peak'] / mib:>11.0f} | "
                      f"{(whole['peak'] - whole['baseline']) / mib:>10.0f}"
                      f"{(sharded['peak'] - sharded['baseline']) / mib:>11.0f}", flush=True)

if __name__ == "__main__":
    main()
