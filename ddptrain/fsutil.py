"""Durable files (fsync, checksums, write errors that name the path and the cause), and local processes."""

from __future__ import annotations

import errno
import hashlib
import os
import pickle
import re
from pathlib import Path

import numpy as np
import torch


def fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class _WriteRecorder:
    """A file object for torch.save that keeps the OSError torch turns into an opaque RuntimeError."""

    def __init__(self, handle):
        self.handle = handle
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            return self.handle.write(data)
        except OSError as error:
            self.error = error
            raise

    def flush(self) -> None:
        self.handle.flush()


def save_torch(obj, path: Path) -> None:
    """torch.save, fsynced; a failed write raises OSError naming the path and the cause (ENOSPC...)."""
    try:
        with open(path, "wb") as handle:
            recorder = _WriteRecorder(handle)
            try:
                torch.save(obj, recorder)
            except RuntimeError as error:
                if recorder.error is not None:
                    raise OSError(recorder.error.errno, recorder.error.strerror, str(path)) from error
                raise
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as error:
        raise OSError(error.errno, error.strerror, str(path)) from error


class UnsafeFileError(ValueError):
    """A torch file holds a pickled object outside ddptrain's allowlist: refused, never run."""


def _numpy_globals() -> list:
    """What np.random.get_state() pickles to (an ndarray of uint32), under numpy 2's module names
    and numpy 1's (`numpy.core`), so RNG states written by either load."""
    reconstruct = np._core.multiarray._reconstruct
    return [reconstruct, (reconstruct, "numpy.core.multiarray._reconstruct"), np.ndarray, np.dtype,
            type(np.dtype(np.uint32))]


def load_torch(path: Path):
    """torch.load(weights_only=True) on the CPU, allowing besides tensors and plain containers only
    the numpy RNG state (rng_rank*.pt). Anything else pickled in the file (a class, a function: code
    that unpickling would run) raises UnsafeFileError naming the file and the object, before any of it runs."""
    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        found = re.search(r"GLOBAL ([\w.]+)", str(error))  # torch's wording varies; the name does not
        what = f"the global {found.group(1).rstrip('.')}" if found else str(error).splitlines()[0]
        raise UnsafeFileError(f"{path} holds a pickled object outside ddptrain's allowlist ({what}); it was refused "
                              "and none of it ran. Resume only from checkpoints you trust") from error


def describe_write_error(error: BaseException, directory: Path) -> str:
    """'No space left on device (ENOSPC): /path/file', for any error a write raised."""
    if isinstance(error, OSError) and error.errno is not None:
        name = errno.errorcode.get(error.errno, str(error.errno))
        return f"{error.strerror} ({name}): {error.filename or directory}"
    try:
        stat = os.statvfs(directory)
        if stat.f_bavail * stat.f_frsize < (1 << 20):  # a library hid the errno: a full disk explains it
            return f"No space left on device (ENOSPC): {directory} ({type(error).__name__}: {error})"
    except OSError:
        pass
    return f"{type(error).__name__}: {error} (writing {directory})"


def pid_is_running(pid: int) -> bool:
    """True when a process `pid` exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
