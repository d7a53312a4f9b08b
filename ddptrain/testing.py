"""run_distributed: run a function on N real gloo ranks (processes forked from a fork server that
imported torch once) and collect results.

The OLMo-core pattern (`run_distributed_test`): one helper picks a free port, starts the ranks,
sets the torchrun environment, initialises the group through ddptrain.init_distributed and
destroys it in `finally`. No private torch.testing._internal APIs.
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch.distributed.fsdp", "torch.distributed.checkpoint",
           "transformers.models.llama.modeling_llama", "ddptrain.engine.engine", "ddptrain.testing")
"""What the ranks' fork server imports once (missing ones skipped): each rank forks from it instead of
importing torch afresh, which was most of a short test's time. Nothing here touches a GPU (a process
that had would not fork usable children)."""


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results, env: dict) -> None:
    os.environ.clear()  # the caller's environment now, not the fork server's from when it started
    os.environ.update(env)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))  # torch was imported before env
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size)})
    from ddptrain.distributed import destroy_distributed, init_distributed

    try:
        init_distributed(timeout_s=120)
        results.put((rank, "ok", _to_bytes(fn(*args))))
    except BaseException:  # report every failure to the parent, which raises it
        results.put((rank, "error", traceback.format_exc()))
    finally:
        gc.collect()  # free DDP modules before the group goes (see ddptrain.__main__.train)
        destroy_distributed()


def run_distributed(fn: Callable, world_size: int = 2, *args: Any, env: dict | None = None,
                    timeout_s: float = 300) -> list[Any]:
    """Run `fn(*args)` on `world_size` gloo ranks; return the results ordered by rank.

    `fn` must be importable by name (a module-level function). A rank that raises makes this
    raise with that rank's traceback.
    """
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", **(env or {})}
    procs = [ctx.Process(target=_worker, args=(rank, world_size, port, fn, args, results, env))
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    # Read results before joining: a large result blocks its sender until someone reads the pipe.
    outcome: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    while len(outcome) < world_size and time.monotonic() < deadline:
        try:
            rank, status, value = results.get(timeout=1.0)
            outcome[rank] = (status, value)
        except queue.Empty:
            if all(not p.is_alive() for p in procs) and results.empty():
                break
    for proc in procs:
        proc.join(max(1.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()
    errors = [f"rank {r}:\n{v}" for r, (s, v) in sorted(outcome.items()) if s == "error"]
    missing = [r for r in range(world_size) if r not in outcome]
    if errors or missing:
        codes = {r: procs[r].exitcode for r in range(world_size)}
        raise RuntimeError("\n".join(errors) + (f"\nranks without a result: {missing}, exit codes {codes}" if missing else ""))
    return [_from_bytes(outcome[r][1]) for r in range(world_size)]


def _to_bytes(value: Any) -> bytes:
    # Plain bytes, not tensors: torch.multiprocessing would pass tensors through shared memory
    # that vanishes when the rank exits before the parent reads it.
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_single",
               "reduce_scatter_single", "broadcast")
"""The torch.distributed calls `record_collectives` counts (FSDP2 calls the `_single` ones)."""


@contextlib.contextmanager
def record_collectives():
    """Within the block, every call of COLLECTIVES (the library's own, DDP's and FSDP's included)
    appends {"name", "bytes", "group_size", "op"} to the list yielded: the payload is the full
    tensor (an all-gather's output, a reduce-scatter's input). Calls made inside another recorded
    call count once. One process's view: each rank records its own calls."""
    import torch.distributed as dist

    calls: list[dict] = []
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
    depth = [0]

    def wrap(name: str, original: Callable) -> Callable:
        def recorded(*args, **kwargs):
            if depth[0] == 0:
                tensor = _payload(name, args, kwargs)
                group = kwargs.get("group")
                calls.append({"name": name, "bytes": tensor.numel() * tensor.element_size(),
                              "group_size": dist.get_world_size(group), "op": _op(name, args, kwargs)})
            depth[0] += 1
            try:
                return original(*args, **kwargs)
            finally:
                depth[0] -= 1
        return recorded

    for name, original in originals.items():
        setattr(dist, name, wrap(name, original))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def _payload(name: str, args: tuple, kwargs: dict) -> torch.Tensor:
    if name.startswith("reduce_scatter"):
        return kwargs.get("input", args[1] if len(args) > 1 else None)
    if name.startswith("all_gather"):
        return kwargs.get("output_tensor", kwargs.get("output", args[0] if args else None))
    return kwargs.get("tensor", args[0] if args else None)


def _op(name: str, args: tuple, kwargs: dict) -> str:
    op = kwargs.get("op", args[1] if name == "all_reduce" and len(args) > 1 else None)
    return "" if name.startswith("all_gather") or name == "broadcast" else str(op or "SUM").rpartition(".")[2]
