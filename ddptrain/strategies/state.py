"""The strategy-neutral checkpoint layout that every strategy writes and every strategy reads.

A checkpoint's `state/` directory is one torch.distributed.checkpoint (DCP) directory holding the
full-model view of the run, keyed by parameter name, never by rank or partition:

    {"model":     {name: tensor, ...},                    every weight and buffer (state_dict names)
     "optimizer": {"state": {name: {"step": ..., "exp_avg": ..., ...}},
                   "param_groups": [{"lr": ..., ..., "params": [name, ...]}, ...]}}

This is exactly what torch's `get_state_dict(model, optimizer)` returns (flattened by DCP), so ddp
and fsdp save and load it through torch's own API, and DCP reshards: a tensor saved whole by ddp is
read as shards by fsdp on any world size, and the other way. DeepSpeed's ZeRO keeps its fp32
master weights and optimizer state in flat partitions; its strategy maps them to and from these
names (deepspeed.utils.safe_get/set_full_fp32_param and _optimizer_state), so a ZeRO run writes
the same layout and reads what ddp or fsdp wrote, on any world size (see docs/strategies.md).

`read_full` reads a directory whole into plain tensors, on every rank or in one process without a
process group, from DCP's own metadata: nothing needs to know which strategy wrote it.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from ddptrain.distributed import background_group

METADATA = ".metadata"
"""DCP's index file: its presence marks a neutral state directory."""


def is_neutral(directory: Path) -> bool:
    return (Path(directory) / METADATA).is_file()


def _one_process(alone: bool) -> None:
    """Before a DCP call made with no_dist=True on purpose (one process, or one rank reading alone):
    silence DCP's warning that it assumes "the intent is to save/load in a single process", which is
    the intent. The filter is process-wide, since an async save warns later from DCP's own thread,
    and names only that message of DCP's modules; every other warning still shows."""
    if alone:
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                                category=UserWarning, module=r"torch\.distributed\.checkpoint\.")


def save(state: dict, directory: Path) -> None:
    """Collective: write `state` ({"model": ..., "optimizer": ...}) as a DCP directory. Plain tensors
    that every rank holds are written once (DCP deduplicates them); DTensors each rank its shards;
    a key that only some ranks hold (ZeRO: each rank its share, see `balanced_owners`) by them."""
    alone = not dist.is_initialized()
    _one_process(alone)
    dcp.save(state, checkpoint_id=str(directory), no_dist=alone)


def save_async(state: dict, directory: Path):
    """Collective: `save` in DCP's background thread, over a gloo group of its own (so that its
    collectives never interleave with training's). Returns once the state is staged in host
    memory, with a future that is done when every file is written and fsynced."""
    group = background_group()
    _one_process(group is None)
    return dcp.async_save(state, checkpoint_id=str(directory), process_group=group, no_dist=group is None)


def load_into(state: dict, directory: Path, collective: bool | None = None) -> None:
    """Fill `state`'s tensors in place from `directory` (DTensors get their shards). Collective
    (every rank calls it) when a process group exists, unless `collective` is False."""
    collective = dist.is_initialized() if collective is None else collective
    _one_process(not collective)
    dcp.load(state, checkpoint_id=str(directory), no_dist=not collective)


def read_full(directory: Path, section: str | None = None, collective: bool | None = None) -> dict:
    """The whole directory (or only its `section`, "model" or "optimizer") as nested dicts of plain
    CPU tensors, as it was saved. Collective when a process group exists (every rank reads the
    full tensors), unless `collective` is False: then in this process alone."""
    entries = contents(directory)
    return read_paths(directory, {path: entry for path, entry in entries.items()
                                  if section is None or path[0] == section}, collective)


def contents(directory: Path) -> dict[tuple, Any]:
    """What the directory holds, read from DCP's metadata alone: each item's path in the saved
    nesting (("model", name), ("optimizer", "state", name, "exp_avg"), ...) and its DCP entry
    (a tensor's `.size` and `.properties.dtype`, or an object's)."""
    metadata = dcp.FileSystemReader(str(directory)).read_metadata()
    paths = metadata.planner_data or {}
    return {tuple(paths.get(key, (key,))): entry for key, entry in metadata.state_dict_metadata.items()}


def read_paths(directory: Path, entries: dict[tuple, Any], collective: bool | None = None) -> dict:
    """Only the items `entries` names (some of `contents(directory)`), as nested dicts of plain CPU
    tensors: a strategy reads a large checkpoint a part at a time. Collective as `read_full`."""
    template: dict = {}
    for path, entry in entries.items():
        if isinstance(entry, TensorStorageMetadata):
            value: Any = torch.empty(entry.size, dtype=entry.properties.dtype)
        elif isinstance(entry, BytesStorageMetadata):
            value = None  # DCP puts the saved object here
        else:
            continue
        _set_path(template, path, value)
    load_into(template, directory, collective)
    return template


def _set_path(tree: dict, path: tuple, value: Any) -> None:
    """Put `value` at `path` (str keys: dicts, int keys: lists) of `tree`, creating what is missing."""
    node: Any = tree
    for here, below in zip(path[:-1], path[1:]):
        empty = [] if isinstance(below, int) else {}
        if isinstance(node, list):
            while len(node) <= here:
                node.append(None)
            if node[here] is None:
                node[here] = empty
            node = node[here]
        else:
            node = node.setdefault(here, empty)
    last = path[-1]
    if isinstance(node, list):
        while len(node) <= last:
            node.append(None)
    node[last] = value


def balanced_owners(sizes: dict, world_size: int) -> dict:
    """Which rank holds and writes each item of a checkpoint, for a strategy whose tensors are full
    only while gathered (ZeRO's partitions): the largest first, each to the rank holding the fewest
    elements so far (the lower rank on a tie). `sizes` maps an item to its element count; every rank
    computes the same owners from the same sizes in the same order."""
    load = [0] * world_size
    owners = {}
    for key in sorted(sizes, key=lambda item: -sizes[item]):  # stable: equal sizes keep their order
        rank = min(range(world_size), key=load.__getitem__)
        owners[key] = rank
        load[rank] += sizes[key]
    return owners


def zero_step_counts(states) -> None:
    """Set the scalar entries (step counts) of each per-parameter optimizer state in `states` to 0.

    An optimizer's state made before its first step (torch's get_state_dict, ZeRO's linking) comes
    from one step at learning rate 0 over zero gradients: it changes no weight, but counts a step,
    which would change the next update's bias correction. With the count at 0 the state is that of a
    fresh optimizer."""
    for state in states:
        for value in state.values():
            if torch.is_tensor(value) and value.dim() == 0:
                value.zero_()


def trainable_names(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Parameter name -> parameter for every parameter that trains, tied ones under their first name
    (the name torch's get_state_dict keys optimizer state by)."""
    return {name: param for name, param in module.named_parameters() if param.requires_grad}
