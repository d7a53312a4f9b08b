"""`python -m ddptrain.plan [--world-size N] [--device-memory 80GiB] [--bandwidth 50GB/s] [OVERRIDES]`:
what one rank holds and sends under each strategy, before paying for a run.

    python -m ddptrain.plan --world-size 16 --ranks-per-node 8 --device-memory 80GiB \\
        --bandwidth 400GB/s --inter-node-bandwidth 50GB/s model.n_layer=12 model.n_embd=768

It takes the training overrides, builds the model from its config on the meta device (nothing is
allocated, no weight file read) and prints per strategy (ddp, zero1/2/3, fsdp, HSDP) the weights,
gradients, optimizer state, the activations of one microbatch, other buffers and the total per
rank, each marked measured or computed; then each strategy's collectives per optimizer step with
bytes on the wire (ring factors) and, given bandwidths, the time; with a device memory, what fits
and the pick. How each figure is made: ddptrain/train/memory_plan.py.
"""

from __future__ import annotations

import argparse
import sys

from hydra.errors import HydraException

from ddptrain.config.compose import compose_config
from ddptrain.config.schema import ConfigError
from ddptrain.data import DataError
from ddptrain.distributed import env_world_size
from ddptrain.models.spec import ModelError
from ddptrain.train.builder import resolve_layout, validate_run
from ddptrain.train.memory_plan import format_plan, parse_bytes, plan_for_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddptrain.plan", description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=None, help="ranks (default: WORLD_SIZE, else 1)")
    parser.add_argument("--ranks-per-node", type=int, default=None, help="ranks per node (default: min(world, 8))")
    parser.add_argument("--device-memory", type=parse_bytes, default=None, help="per device, e.g. 80GiB "
                        "(default: the CUDA device's, if any)")
    parser.add_argument("--bandwidth", type=parse_bytes, default=None, help="per rank inside a node, e.g. 50GB/s")
    parser.add_argument("--inter-node-bandwidth", type=parse_bytes, default=None,
                        help="per rank across nodes (default: --bandwidth)")
    args, overrides = parser.parse_known_args(argv)
    world_size = args.world_size if args.world_size is not None else env_world_size()
    problem = _layout_problem(world_size, args.ranks_per_node)
    if problem:
        print(f"config error: {problem}", file=sys.stderr)
        return 2
    try:
        cfg = compose_config(overrides)
        validate_run(cfg, world_size)
        resolve_layout(cfg)  # the plan is of the layout the run would take
    except (ConfigError, HydraException) as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    memory = args.device_memory or _device_memory()
    try:
        plans, counts, layout = plan_for_config(cfg, world_size, args.ranks_per_node)
    except (ModelError, DataError) as error:  # a model.path or tokenizer that is not there: the user's to fix
        print(f"{'model' if isinstance(error, ModelError) else 'data'} error: {error}", file=sys.stderr)
        return 2
    print(format_plan(plans, counts, layout, memory, args.bandwidth, args.inter_node_bandwidth))
    return 0


def _layout_problem(world_size: int, ranks_per_node: int | None) -> str | None:
    """What is wrong with --world-size and --ranks-per-node, named with the rule (None: nothing)."""
    for flag, value in (("--world-size", world_size), ("--ranks-per-node", ranks_per_node)):
        if value is not None and value < 1:
            return f"{flag}={value} must be an integer >= 1"
    if ranks_per_node is not None and ranks_per_node < world_size and world_size % ranks_per_node:  # more: one node
        return (f"--ranks-per-node={ranks_per_node} must divide --world-size={world_size}: every node runs as many "
                "ranks")
    return None


def _device_memory() -> float | None:
    import torch

    return float(torch.cuda.get_device_properties(0).total_memory) if torch.cuda.is_available() else None


if __name__ == "__main__":
    sys.exit(main())
