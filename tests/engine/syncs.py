"""Counters of host synchronisations, for the tests of the step and of attention.

`host_syncs` counts every call of a Tensor method that would wait for a GPU (`.item()`, `float()`,
`.tolist()`, `.cpu()`, ...) made directly from a frame of the ddptrain package: on CPU nothing waits,
so what it measures is ddptrain's own code. `device_syncs` (CUDA only) counts every host
synchronisation of the main thread, wherever it is made.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import traceback
import warnings
from pathlib import Path

import torch

import ddptrain

PACKAGE = str(Path(ddptrain.__file__).resolve().parent)
SYNCING = ("item", "__float__", "__int__", "__bool__", "tolist", "cpu", "numpy", "__index__")
SYNC_WARNING = "synchronizing CUDA operation"  # torch.cuda.set_sync_debug_mode("warn")'s message


@contextlib.contextmanager
def host_syncs(where=lambda: None):
    """Records (file:line, method, where()) of every Tensor method that would wait for a GPU, called
    directly from ddptrain's own code (on CPU nothing waits: this finds ddptrain's reads, not torch's)."""
    calls: list[tuple[str, str, object]] = []
    originals = {name: getattr(torch.Tensor, name) for name in SYNCING}

    def wrap(name, original):
        def counted(self, *args, **kwargs):
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(PACKAGE):
                calls.append((f"{Path(caller.f_code.co_filename).name}:{caller.f_lineno}", name, where()))
            return original(self, *args, **kwargs)
        return counted

    for name, original in originals.items():
        setattr(torch.Tensor, name, wrap(name, original))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def _innermost_package_frame(stack: traceback.StackSummary) -> str:
    ours = [frame for frame in stack if frame.filename.startswith(PACKAGE)]
    return f"{Path(ours[-1].filename).name}:{ours[-1].lineno}" if ours else "(no ddptrain frame)"


@contextlib.contextmanager
def device_syncs(where=lambda: None):
    """On CUDA: records (innermost ddptrain file:line, what synced, where()) of every host
    synchronisation of this (the main) thread, from any caller, torch included:

    - each warning of torch.cuda.set_sync_debug_mode("warn"): blocking host-device copies, stream
      and device syncs, and the syncs inside torch ops (nonzero, masked indexing, ...);
    - each call of a SYNCING Tensor method on a tensor that is not on the CPU.

    A sync inside a counted Tensor method counts once. torch.distributed's waits are not covered
    (the documented limit of the debug mode); threads other than this one (the batch prefetcher)
    do not hold up the step's queue from the host and are left out."""
    calls: list[tuple[str, str, object]] = []
    main = threading.get_ident()
    inside = threading.local()
    originals = {name: getattr(torch.Tensor, name) for name in SYNCING}

    def record(via: str, stack: traceback.StackSummary) -> None:
        if threading.get_ident() == main:
            calls.append((_innermost_package_frame(stack), via, where()))

    def wrap(name, original):
        def counted(self, *args, **kwargs):
            if self.device.type == "cpu" or getattr(inside, "depth", 0):
                return original(self, *args, **kwargs)
            caller = sys._getframe(1)
            record(f"Tensor.{name} at {Path(caller.f_code.co_filename).name}:{caller.f_lineno}",
                   traceback.extract_stack(caller))
            inside.depth = 1
            try:
                return original(self, *args, **kwargs)
            finally:
                inside.depth = 0
        return counted

    def show(message, category, filename, lineno, file=None, line=None):
        if SYNC_WARNING not in str(message):
            return shown(message, category, filename, lineno, file, line)
        if not getattr(inside, "depth", 0):
            record(f"sync-debug warning at {Path(filename).name}:{lineno}", traceback.extract_stack()[:-1])

    previous_mode = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():  # restores the filters and showwarning
        shown = warnings.showwarning
        warnings.filterwarnings("always", message=f".*{SYNC_WARNING}")  # every call, not once per line
        warnings.showwarning = show
        for name, original in originals.items():
            setattr(torch.Tensor, name, wrap(name, original))
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield calls
        finally:
            torch.cuda.set_sync_debug_mode(previous_mode)
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)
