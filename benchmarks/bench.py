"""Throughput of Engine.step against a minimal hand-written DDP loop doing the same work.

    python -m benchmarks.bench                    # spawns 2 gloo ranks on this machine
    torchrun --nproc_per_node=2 -m benchmarks.bench # or under torchrun (GPUs: NCCL)

Both sides train the same model from the same initial weights on the same microbatches (default
data, default GPT), with no_sync on non-final microbatches, the valid-token count all-reduced,
global-norm clipping, AdamW and the reported loss all-reduced. Rounds of each are interleaved
(ABBA order) so that machine noise hits both alike; the report is the median of the per-round
ratios. A figure, not a test: these machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import ddptrain
from ddptrain.data import TrainBatches, load_stdlib
from ddptrain.distributed import barrier, get_rank, get_world_size, is_distributed
from ddptrain.models import GPT, GPTConfig
from ddptrain.contract.targets import IGNORE_INDEX


def hand_written_step(ddp_model, optimizer, microbatches, device, grad_clip: float) -> float:
    """The loop one would write by hand: token sums / global count, DDP averaging x world size."""
    local = torch.stack([(y != IGNORE_INDEX).sum() for _, y in microbatches]).sum().to(device)
    work = dist.all_reduce(local, async_op=True) if is_distributed() else None
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for index, (inputs, targets) in enumerate(microbatches):
        inputs, targets = inputs.to(device), targets.to(device)
        is_last = index == len(microbatches) - 1
        context = ddp_model.no_sync() if (is_distributed() and not is_last) else contextlib.nullcontext()
        with context:
            logits = ddp_model(inputs)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=IGNORE_INDEX,
                                   reduction="sum")
            if index == 0 and work is not None:
                work.wait()
            (loss * get_world_size() / local).backward()  # DDP averages: undo it with x world size
            loss_sum += loss.detach().double()
    torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), grad_clip, foreach=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if is_distributed():
        dist.all_reduce(loss_sum)
    return float(loss_sum.item()) / int(local.item())


def _timed(run_steps, tokens_per_round: int, device) -> float:
    barrier()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    run_steps()
    if device.type == "cuda":
        torch.cuda.synchronize()
    barrier()
    return tokens_per_round / (time.perf_counter() - start)


def bench(args: argparse.Namespace) -> dict:
    info = ddptrain.init_distributed()
    device = info.device
    data = load_stdlib(args.seq_len, 5.0, args.max_docs)
    batches = TrainBatches(data.train, args.global_batch, args.micro_batch, 1234, info.rank, info.world_size)
    config = GPTConfig(vocab_size=data.vocab_size, max_seq_len=args.seq_len, n_layer=args.n_layer,
                       n_head=args.n_head, n_embd=args.n_embd)
    torch.manual_seed(0)
    ours_model = GPT(config)
    theirs_model = GPT(config)
    theirs_model.load_state_dict(ours_model.state_dict())
    engine = ddptrain.Engine(ours_model, torch.optim.AdamW(ours_model.parameters(), lr=1e-3), "ddp",
                             grad_clip=1.0, device=device)
    theirs_model.to(device)
    ddp = DistributedDataParallel(theirs_model, device_ids=[device.index] if device.type == "cuda" else None,
                                  gradient_as_bucket_view=True) if is_distributed() else theirs_model
    optimizer = torch.optim.AdamW(theirs_model.parameters(), lr=1e-3)

    step_of = {"ours": 0, "hand": 0}

    def ours():
        for _ in range(args.steps_per_round):
            engine.step(batches.microbatches(step_of["ours"]))
            step_of["ours"] += 1

    def hand():
        for _ in range(args.steps_per_round):
            hand_written_step(ddp, optimizer, batches.microbatches(step_of["hand"]), device, 1.0)
            step_of["hand"] += 1

    tokens_per_round = args.steps_per_round * args.global_batch * args.seq_len  # padded tokens processed
    ours(), hand()  # warm-up (DDP bucket rebuild, allocator)
    rates = {"ours": [], "hand": []}
    for index in range(args.rounds):
        order = [("ours", ours), ("hand", hand)] if index % 2 == 0 else [("hand", hand), ("ours", ours)]
        for name, run in order:
            rates[name].append(_timed(run, tokens_per_round, device))
    ratios = [o / h for o, h in zip(rates["ours"], rates["hand"])]
    return {"world_size": info.world_size, "device": str(device), "ours": rates["ours"], "hand": rates["hand"],
            "ratio_median": statistics.median(ratios), "ratios": ratios}


def _spawned(args_dict: dict) -> dict:
    return bench(argparse.Namespace(**args_dict))


def report(result: dict, args: argparse.Namespace) -> None:
    ours, hand = statistics.median(result["ours"]), statistics.median(result["hand"])
    print(f"benchmarks.bench: world {result['world_size']} on {result['device']}, GPT {args.n_layer}x{args.n_embd}, "
          f"global batch {args.global_batch} x seq {args.seq_len}, micro {args.micro_batch}, "
          f"{args.rounds} interleaved rounds of {args.steps_per_round} steps")
    print(f"{'round':>5} {'Engine.step tok/s':>18} {'hand-written tok/s':>19} {'ratio':>7}")
    for index, (o, h, r) in enumerate(zip(result["ours"], result["hand"], result["ratios"])):
        print(f"{index:>5} {o:>18.0f} {h:>19.0f} {r:>7.3f}")
    print(f"{'median':>5} {ours:>18.0f} {hand:>19.0f} {result['ratio_median']:>7.3f}   (target >= 0.97)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2, help="ranks to spawn when not under torchrun")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps-per-round", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--max-docs", type=int, default=200)
    args = parser.parse_args()
    if "RANK" in os.environ:  # under torchrun
        result = bench(args)
        if get_rank() == 0:
            report(result, args)
        ddptrain.distributed.destroy_distributed()
        return
    from ddptrain.testing import run_distributed

    result = run_distributed(_spawned, args.world_size, vars(args), timeout_s=3600)[0]
    report(result, args)


if __name__ == "__main__":
    main()
