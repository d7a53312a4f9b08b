"""Durable files (fsync, checksums, write errors that name the path and the cause), and local processes."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import pickle
import re
import shutil
import sys
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


def _fsync_contents(path: Path) -> None:
    """fsync a file's data, or a directory's entries and those of every directory below it (the
    files in it are fsynced by whoever wrote them): a file's fsync does not make its name in its
    directory durable (man 2 fsync)."""
    if not path.is_dir():
        fsync_file(path)
        return
    for directory in [path, *(child for child in path.rglob("*") if child.is_dir() and not child.is_symlink())]:
        fsync_dir(directory)


def make_dirs(path: Path) -> None:
    """mkdir -p, each directory it creates made durable in its parent (a rename into it then is too)."""
    created = [directory for directory in [path, *path.parents] if not directory.exists()]
    path.mkdir(parents=True, exist_ok=True)
    for directory in reversed(created):
        fsync_dir(directory.parent)


def rename(src: Path, dst: Path) -> None:
    """os.replace(src, dst) that survives a crash: what `src` holds is fsynced before the rename (see
    `_fsync_contents`), and the directories that hold the two names after it, so a crash finds the
    old state or the new one, never the new name over lost entries nor an old name come back. Every
    rename that publishes data, or moves it out of a reader's sight, goes through here (or
    `replace_dir`)."""
    _fsync_contents(src)
    os.replace(src, dst)
    fsync_dir(dst.parent)
    if Path(src).parent.resolve() != Path(dst).parent.resolve():
        fsync_dir(src.parent)


def move(src: Path, dst: Path) -> None:
    """`rename`, or where `dst` is on another filesystem (EXDEV: run.dir/previous/ a link to other
    storage, say) shutil.move's copy and delete, in the order that survives a crash: the copy, its
    files and directories fsynced, its name made durable, and only then the original removed. A copy
    that fails is removed again (the original is untouched): a `dst` that did not exist before and
    does after an error is a complete copy, and only the original's removal failed."""
    src, dst = Path(src), Path(dst)
    try:
        rename(src, dst)
        return
    except OSError as error:
        if error.errno != errno.EXDEV:
            raise
    is_tree = src.is_dir() and not src.is_symlink()
    dst_existed = os.path.lexists(dst)
    try:
        if is_tree:
            shutil.copytree(src, dst, symlinks=True)
        else:
            shutil.copy2(src, dst, follow_symlinks=False)
        for path in [dst, *(dst.rglob("*") if is_tree else [])]:
            if path.is_symlink():  # a link is copied as one; what it points to is not ours to sync
                continue
            if path.is_dir():
                fsync_dir(path)
            else:
                fsync_file(path)
        fsync_dir(dst.parent)
    except BaseException:
        if not dst_existed:  # a partial copy of ours is no copy: only the original, intact, is left
            if dst.is_dir() and not dst.is_symlink():
                shutil.rmtree(dst, ignore_errors=True)
            else:
                dst.unlink(missing_ok=True)
        raise
    if is_tree:
        shutil.rmtree(src)
    else:
        src.unlink()
    fsync_dir(src.parent)


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap the two existing paths `a` and `b` in one atomic step: renameat2(RENAME_EXCHANGE) (Linux
    3.15, glibc 2.28; man 2 rename). False, with nothing changed, where the kernel, the C library or
    the filesystem cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def replace_dir(new: Path, target: Path, aside: Path) -> None:
    """Put the directory `new` under the name `target`, and the directory that held that name (if
    any) under `aside`, replacing an earlier one there. On Linux the swap is one atomic exchange, so
    a reader, or a crash, finds the old or the new directory at `target`, never none; elsewhere it
    is two renames, with a moment between them where `target` is absent. Durable like `rename`."""
    _fsync_contents(new)
    if not target.exists():
        os.replace(new, target)
    else:
        if aside.exists():
            shutil.rmtree(aside)
        if _exchange(new, target):
            os.replace(new, aside)  # `new` names the old directory now
        else:
            os.replace(target, aside)
            os.replace(new, target)
    fsync_dir(target.parent)


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
