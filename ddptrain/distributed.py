"""Process group, device and rank helpers that also work in a world of one.

Every helper here is safe to call without torchrun: `get_rank()` is 0, `barrier()` does nothing
(the OLMo-core pattern), so the same code runs on a laptop, in tests and on a cluster.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import signal
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    """Where this process stands: rank, world, local rank, device and backend."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def env_world_size() -> int:
    """World size promised by the launcher (torchrun's WORLD_SIZE), before any group exists."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def env_local_world_size() -> int:
    """Ranks on this node (torchrun's LOCAL_WORLD_SIZE); the whole world where the launcher does not say."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", str(env_world_size())))


def env_node_count() -> int:
    """Nodes in the launch: torchrun's GROUP_WORLD_SIZE (agents, one per node), else WORLD_SIZE over
    LOCAL_WORLD_SIZE; 1 outside a launcher."""
    if "GROUP_WORLD_SIZE" in os.environ:
        return int(os.environ["GROUP_WORLD_SIZE"])
    return max(1, env_world_size() // max(1, env_local_world_size()))


def replicate_degree(replicate: int | str, world_size: int) -> int:
    """The replicas of an HSDP mesh: `replicate` itself, or the number of nodes for "auto"; a
    ValueError naming the numbers when it does not divide the world."""
    degree = env_node_count() if replicate == "auto" else replicate
    if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1 or world_size % degree:
        raise ValueError(f"strategy.replicate={replicate!r} ({degree} replicas) must be a positive divisor of the "
                         f"world size {world_size} (a mesh of replicas x shards), or auto (the number of nodes)")
    return degree


def device_mesh(device_type: str, replicate: int = 1):
    """The world as a device mesh: 1-D ("shard") when `replicate` is 1, else 2-D ("replicate",
    "shard"), R replicas x world/R shards; consecutive ranks (one node's) share a replica."""
    world = get_world_size()
    if replicate == 1:
        return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
    return init_device_mesh(device_type, (replicate, world // replicate), mesh_dim_names=("replicate", "shard"))


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_rank_zero() -> bool:
    return get_rank() == 0


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def pick_device(local_rank: int) -> torch.device:
    """CUDA device of this LOCAL_RANK when there is a GPU, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    # The backend follows the device (torchtitan does the same through this map): nccl for CUDA,
    # gloo for CPU. Nothing here hard-codes nccl, which is what makes the CPU tests real.
    return dist.Backend.default_device_backend_map[device.type]


def init_distributed(timeout_s: float = 600.0) -> DistInfo:
    """Join the process group that torchrun (or Slurm via torchrun) describes, or a world of one.

    Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT from the environment. Calling
    it again returns the existing group's description.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = backend_for(device)
    wants_group = env_world_size() > 1 or "MASTER_ADDR" in os.environ
    if wants_group and not is_distributed():
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(
            backend=backend,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
            **_restart_safe_store(timeout),
        )
    return DistInfo(get_rank(), get_world_size(), local_rank, device, backend)


_ATTEMPT_KEY = "ddptrain/attempt_store"
"""Rank 0's entry in the agent's store ("PORT ATTEMPT_ID"), and the id in the store it started."""


def _restart_safe_store(timeout: datetime.timedelta) -> dict:
    """Under torchrun's shared agent store, a store of this attempt only; otherwise the default env://.

    torchrun's agent keeps one TCPStore across worker restarts (TORCHELASTIC_USE_AGENT_STORE=True),
    so a restarted group could read the dead attempt's gloo addresses and wait on them until the
    timeout (after `--max-restarts=1`, for one). Keys must therefore be private to the attempt, and
    no environment variable names the attempt: TORCHELASTIC_RESTART_COUNT counts only failures (a
    restart because a node joined keeps it), and differs between nodes (a joining node starts at 0);
    the agent's rendezvous round never reaches the workers, and MASTER_PORT is the shared store's,
    the same in every round. So rank 0 starts a fresh TCPStore on a free port and publishes its port
    with a random attempt id in the agent's store; the other ranks take the published store that
    answers with that id. An entry left by a dead attempt points at a closed port (its rank 0 is
    gone: torchrun starts no worker before every agent has stopped the old ones) or at a store that
    holds another id, so they retry until this attempt's rank 0 has written its entry. Under
    `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` (the elastic recipe in docs/slurm-and-docker.md) rank 0
    hosts a new store at a new MASTER_PORT in every attempt: the default env:// init is right there.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    host = os.environ["MASTER_ADDR"]
    agent = dist.TCPStore(host, int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    if env_rank() == 0:
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        attempt = uuid.uuid4().hex
        store.set(_ATTEMPT_KEY, attempt)
        agent.set(_ATTEMPT_KEY, f"{store.port} {attempt}")
    else:
        store = _published_attempt_store(agent, host, timeout)
    return {"store": store, "rank": env_rank(), "world_size": env_world_size()}


def _published_attempt_store(agent: dist.Store, host: str, timeout: datetime.timedelta) -> dist.Store:
    """The store that this attempt's rank 0 published in the agent's store (see _restart_safe_store)."""
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        port, attempt = agent.get(_ATTEMPT_KEY).decode().split()
        if _accepts_connections(host, int(port)):  # else a dead attempt's: TCPStore would retry it noisily
            try:
                store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=2))
                if store.get(_ATTEMPT_KEY).decode() == attempt:
                    store.set_timeout(timeout)
                    return store
            except (dist.DistError, RuntimeError):
                pass  # not this attempt's store after all (another process took the port)
        if time.monotonic() > deadline:
            raise dist.DistStoreError(f"rank {env_rank()}: no store of this attempt answered at {host} within "
                                      f"{timeout.total_seconds():g}s (the agent store's {_ATTEMPT_KEY} is "
                                      f"{port} {attempt})")
        time.sleep(0.2)


def _accepts_connections(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
        return True
    except OSError:
        return False


def destroy_distributed(wait_for_peers: bool = False) -> None:
    """Destroy every process group (the background one included). `wait_for_peers`: a barrier first,
    so that no rank tears down its connections while another still uses them (only where every
    rank gets here alike: after a failure a peer may never come)."""
    if is_distributed():
        if wait_for_peers:
            try:
                dist.barrier()
            except RuntimeError:  # a peer died after finishing: nothing left to wait for
                pass
        _BACKGROUND_GROUP.clear()
        dist.destroy_process_group()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` in place over ranks (a no-op in a world of one) and return it."""
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when `flag` is true on some rank (one tiny MAX all-reduce)."""
    if not is_distributed():
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def all_ranks(flag: bool, device: torch.device) -> bool:
    """True on every rank when `flag` is true on every rank (one tiny all-reduce)."""
    return not any_rank(not flag, device)


_BACKGROUND_GROUP: list = []


def background_group():
    """A gloo process group of its own, for collectives in a background thread (checkpoint writes)
    that must never interleave with the training group's; None without a process group. Made at
    the first call (collective then: every rank calls it at the same point)."""
    if not is_distributed():
        return None
    if not _BACKGROUND_GROUP:
        _BACKGROUND_GROUP.append(dist.new_group(backend="gloo"))
    return _BACKGROUND_GROUP[0]


def first_failure(error: BaseException | None) -> tuple[int, str] | None:
    """(rank, message) of the lowest rank that passed an error, the same on every rank; None if none did.

    Collective. A rank-local error before a collective would leave the other ranks waiting for
    it until the timeout: every rank calls this at the same point instead, so all fail at once."""
    mine = None if error is None else f"{type(error).__name__}: {error}"
    if not is_distributed():
        return (0, mine) if mine is not None else None
    gathered: list = [None] * get_world_size()
    dist.all_gather_object(gathered, mine)
    for rank, message in enumerate(gathered):
        if message is not None:
            return rank, message
    return None


def raise_on_every_rank(error: BaseException | None, error_type: type[Exception] = RuntimeError) -> None:
    """Collective: re-raise `error` where it happened, and an `error_type` naming it on every other rank."""
    failure = first_failure(error)
    if failure is None:
        return
    if error is not None:
        raise error
    rank, message = failure
    raise error_type(f"rank {rank} failed: {message}")


def set_parent_death_signal(signum: int = signal.SIGTERM) -> None:
    """Under a launcher (torchrun), ask the kernel to send `signum` when the launcher dies, so that
    workers never outlive it (Linux prctl PR_SET_PDEATHSIG; elsewhere nothing happens)."""
    if not sys.platform.startswith("linux"):
        return
    launcher = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signum), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        return
    # The launcher died before the call (we were re-parented to init): the signal would never
    # come. In a container torchrun itself may be PID 1, so PID 1 alone proves nothing.
    if os.getppid() != launcher or (launcher == 1 and not _runs_torchrun(1)):
        os.kill(os.getpid(), signum)


def _runs_torchrun(pid: int) -> bool:
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return True  # cannot tell: do not kill ourselves on a guess
    return any(name in command for name in (b"torchrun", b"torch.distributed.run", b"torch/distributed/run"))


def _log_rank() -> int:
    """The rank a log line belongs to: the group's, or the launcher's (RANK) before the group exists."""
    return get_rank() if is_distributed() else env_rank()


class Rank0Filter(logging.Filter):
    """Lets every record through on rank 0, and only warnings and errors on the other ranks."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _log_rank() == 0 or record.levelno >= logging.WARNING


def setup_logging(level: int = logging.INFO) -> None:
    """Console logging for the ddptrain logger tree, filtered to rank 0 in this one place."""
    root = logging.getLogger("ddptrain")
    if any(getattr(h, "_ddptrain", False) for h in root.handlers):
        return
    handler = logging.StreamHandler()
    handler._ddptrain = True  # type: ignore[attr-defined]
    handler.addFilter(Rank0Filter())
    handler.setFormatter(_RankFormatter())
    root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False


class _RankFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = self.formatTime(record, "%H:%M:%S")
        return f"[{stamp} rank{_log_rank()} {record.levelname.lower()}] {record.getMessage()}"
