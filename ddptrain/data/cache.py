"""The preprocessing cache: token arrays built once per (source, tokenizer, settings), memory-mapped.

An entry is a directory `<cache_dir>/<key>/` with, per split, `<split>.tokens.npy` (the flat
tokens; absent when the split reads a single pre-tokenized source file in place) and
`<split>.docs.npy` ((D, 2) int64: start and length of every document), plus `meta.json`,
written last. The key is a SHA-256 of the fingerprint: every source file's resolved path, size
and modification time (sizes and mtimes only: hashing the content would cost as much as
tokenizing it), the tokenizer (for a tokenizer.json, a hash of its content), the versions of the
libraries that tokenize (`tokenizers`; transformers too for data=sft) and every setting that changes
the arrays. meta.json also holds each array file's size and sha256 (sampled blocks
beyond FULL_HASH_BYTES), verified on every load: a damaged entry is rebuilt, with a warning.

The ranks that share the cache directory build an entry together (ddptrain/data/shards.py: each
tokenizes its shard, one merges), or one of them builds it (`build_or_wait`) while the others
poll for the finished entry, not in a barrier: a long build would outlast the process group's
timeout. The build writes into a
temporary directory and renames it into place, so a reader never sees half an entry and two
nodes building the same entry on a shared filesystem cannot corrupt it. A failed build leaves a
marker with its message, so the waiting ranks fail with the same message instead of waiting.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

import numpy as np

from ddptrain.data.sources import DataError, common_directory
from ddptrain.distributed import env_local_world_size
from ddptrain.fsutil import fsync_file, pid_is_running, rename

log = logging.getLogger(__name__)

CACHE_VERSION = 7
"""2: the hash split reads names relative to the sources' directory (SplitNames); 3: a tokenizer.json's
saved truncation and padding are switched off (ddptrain.data.tokenizer.HFTokenizer); 4: blank JSONL
lines and whitespace-only text files are no documents (data.max_docs and the short count skip them); 5:
nor are empty or whitespace-only JSONL fields and Hugging Face rows (data=jsonl, data=hf); 6: data=sft's
assistant turns, split by prefixes, end at an end-of-turn marker that is an added token but not special
(the newline after it was a target: ChatTokenizer._end_of_turn); 7: data=sft refuses a message whose content
holds special-token text (it was encoded as the token: forged turns), so an entry built from such data is not
reused."""
_META = "meta.json"


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ddptrain"


def file_stamp(path: Path) -> list:
    """[resolved path, size, mtime in ns]: what the fingerprint knows of a source file."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        raise DataError(f"{path}: the file vanished after it was listed (deleted or moved)") from None
    if path.is_dir():  # a saved Hugging Face dataset: every file inside counts
        return [os.path.abspath(path), [file_stamp(p) for p in sorted(path.rglob("*")) if p.is_file()]]
    return [os.path.abspath(path), stat.st_size, stat.st_mtime_ns]


def relative_stamps(paths: list[Path]) -> dict:
    """{name relative to the files' common directory: [size, mtime in ns]} (a saved dataset
    directory: its files, each by its name under the common directory). No absolute path: a corpus
    moved whole keeps its stamps."""
    files = [(p, f) for p in paths for f in (sorted(p.rglob("*")) if p.is_dir() else [p]) if f.is_file()]
    if not files:
        return {}
    base = common_directory([p for p, _ in files])
    return {os.path.relpath(os.path.abspath(f), base): [f.stat().st_size, f.stat().st_mtime_ns] for _, f in files}


def cache_key(fingerprint: dict) -> str:
    text = json.dumps({"version": CACHE_VERSION, **fingerprint}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:24]


def _failure_marker(cache_dir: Path, key: str) -> Path:
    """Where this launch's local rank 0 says its build of `key` failed, for the ranks waiting beside it.

    Named after this host and launch attempt: the launcher's pid (the torchrun agent, which every local
    rank shares), its run id and restart count. The run id alone is the same for every launch of
    a plain torchrun (`none`), for elastic restarts and for Slurm requeues (`--rdzv-id=$SLURM_JOB_ID`):
    a marker of an earlier attempt must not fail this one."""
    attempt = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'single')}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return cache_dir / f"{key}.failed-{socket.gethostname()}-{os.getppid()}-{attempt}"


def build_or_wait(cache_dir: Path, key: str, build: Callable[[Path], dict], is_builder: bool,
                  poll_s: float = 0.5, failed: Path | None = None) -> tuple[Path, dict, bool]:
    """(entry dir, its meta, whether this call built it). `build(tmp_dir)` writes the arrays and returns meta;
    `failed`: the failure marker the builder writes and the others poll (default: this node's launch's)."""
    entry = cache_dir / key
    own_marker = failed is None  # this node's launch's: a marker left by an earlier launch of the same pid is stale
    failed = failed or _failure_marker(cache_dir, key)
    if (entry / _META).is_file():
        meta = _read_meta(entry)
        damage = damaged_file(entry, meta)
        if damage is None:
            return entry, meta, False
        if not is_builder:  # local rank 0 rebuilds it: wait for an entry that verifies
            return entry, _wait_for(entry, failed, poll_s, damaged=True), False
        aside = entry.with_name(f"{key}.bad-{os.getpid()}")
        os.replace(entry, aside)
        shutil.rmtree(aside, ignore_errors=True)
        log.warning("data: cache entry %s is damaged (%s): removed and rebuilt", entry, damage)
    if not is_builder:
        return entry, _wait_for(entry, failed, poll_s), False
    cache_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_builds(cache_dir)
    if own_marker:
        failed.unlink(missing_ok=True)  # a launcher pid reused by a later attempt
    tmp = cache_dir / f"{key}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        meta = build(tmp)
        meta["checksums"] = {path.name: array_digest(path) for path in sorted(tmp.iterdir()) if path.is_file()}
        (tmp / _META).write_text(json.dumps(meta, indent=1))
        for child in tmp.iterdir():
            fsync_file(child)
        try:
            rename(tmp, entry)
        except OSError:  # another node built the same entry first: keep theirs, identical by construction
            if not (entry / _META).is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
        failed.unlink(missing_ok=True)
        return entry, _read_meta(entry), True
    except BaseException as error:
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            if not failed.is_file():  # a rank of a sharded build said it first (ddptrain/data/shards.py)
                failed.write_text(f"{type(error).__name__}: {error}")
            if env_local_world_size() > 1:
                # torchrun stops every rank as soon as one exits: say it now, then give the
                # waiting ranks a few polls to read the marker and report the same error.
                log.error("preprocessing failed: %s", error)
                time.sleep(4 * poll_s)
        except OSError:
            pass
        raise


def remove_stale_builds(cache_dir: Path) -> list[Path]:
    """Delete the temporary directories of builds on this host whose process is gone (OOM-killed,
    SIGKILLed: no `except` ran to clean up), and the failure markers of launchers gone. Builds on
    other hosts are left alone."""
    host = socket.gethostname()
    removed = []
    for kind in ("tmp", "failed"):
        for path in cache_dir.glob(f"*.{kind}-{host}-*"):
            pid = path.name.rsplit(f".{kind}-", 1)[1][len(host) + 1:].split("-")[0]
            if pid.isdigit() and not pid_is_running(int(pid)):
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
                removed.append(path)
    if removed:
        log.info("data: removed %d temporary director(ies) of dead preprocessing runs, e.g. %s", len(removed), removed[0])
    return removed


def _wait_for(entry: Path, failed: Path, poll_s: float, damaged: bool = False) -> dict:
    """The meta of `entry` once it is there (`damaged`: once it verifies again, rebuilt by local rank 0)."""
    started = last_note = time.monotonic()
    while not (entry / _META).is_file() or (damaged and _damage_or_gone(entry)):
        if failed.is_file():
            raise DataError(f"preprocessing failed on the building rank: {failed.read_text()}")
        if time.monotonic() - last_note > 60:
            last_note = time.monotonic()
            log.info("waiting for the building rank to preprocess the data into %s (%.0fs so far)", entry,
                     last_note - started)
        time.sleep(poll_s)
    return _read_meta(entry)


def _read_meta(entry: Path) -> dict:
    return json.loads((entry / _META).read_text())


FULL_HASH_BYTES = 16 << 20
"""Array files up to this size are hashed whole on every load; larger ones by SAMPLED_BLOCKS blocks."""
SAMPLED_BLOCKS, BLOCK_BYTES = 256, 16 << 10


def array_digest(path: Path) -> str:
    """'<size>:<sha256>' of the file, or of its size and SAMPLED_BLOCKS evenly spaced blocks (the
    first and the last included) when it is larger than FULL_HASH_BYTES: a load must stay cheap
    (measured: docs/data.md), so a change between sampled blocks of a large file goes unseen."""
    size = path.stat().st_size
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        if size <= FULL_HASH_BYTES:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        else:
            stride = (size - BLOCK_BYTES) / (SAMPLED_BLOCKS - 1)
            for index in range(SAMPLED_BLOCKS):
                handle.seek(int(index * stride))
                digest.update(handle.read(BLOCK_BYTES))
    return f"{size}:{digest.hexdigest()}"


def damaged_file(entry: Path, meta: dict) -> str | None:
    """What is wrong with a cache entry's files (missing, or not matching the checksums in its
    meta.json), or None. An entry written before checksums is taken as it is."""
    for name, expected in meta.get("checksums", {}).items():
        file = entry / name
        if not file.is_file():
            return f"{name} is missing"
        found = array_digest(file)
        if found != expected:
            size, expected_size = found.split(":")[0], expected.split(":")[0]
            return (f"{name} is {size} bytes ({expected_size} when it was built)" if size != expected_size else
                    f"{name} does not match its checksum")
    return None


def _damage_or_gone(entry: Path) -> bool:
    try:
        return damaged_file(entry, _read_meta(entry)) is not None
    except (OSError, ValueError):
        return True


class TokenWriter:
    """Appends token arrays to a .npy file without holding them in memory.

    The .npy header is written for the final shape when the writer closes; it is padded to a
    fixed 128 bytes up front, which any shape of a 1-D array fits.
    """

    HEADER = 128

    def __init__(self, path: Path, dtype: np.dtype):
        self.path, self.dtype, self.count = path, np.dtype(dtype), 0
        self._file = open(path, "wb")
        self._file.write(b"\0" * self.HEADER)

    def append(self, tokens: np.ndarray) -> int:
        """Write `tokens`; return the offset (in tokens) where they start."""
        offset = self.count
        self._file.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        self.count += len(tokens)
        return offset

    def close(self) -> None:
        header = "{'descr': %r, 'fortran_order': False, 'shape': (%d,), }" % (self.dtype.str, self.count)
        header = header.ljust(self.HEADER - 10 - 1) + "\n"
        self._file.seek(0)
        self._file.write(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode("latin1"))
        self._file.close()


def open_tokens(entry: Path, split_meta: dict) -> np.ndarray:
    """A split's token array, memory-mapped read-only (the cache's .npy, or the source file in place)."""
    source = split_meta["tokens"]
    if "npy" in source:
        return np.load(entry / source["npy"], mmap_mode="r")
    path = Path(source["file"])
    if not path.is_file():
        raise DataError(f"{path}: the token file vanished after preprocessing")
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=source["dtype"])
    return np.memmap(path, dtype=source["dtype"], mode="r")


class BuildProgress:
    """tqdm on a terminal (when installed), else a log line every `every_s` seconds, also while one
    record takes long (a heartbeat thread says how far it got): preprocessing is never silent. The
    line says the documents and tokens so far, tokens/s and the ETA of `total`. `check()`, called
    on updates, stops the build by raising (another rank of a sharded build failed)."""

    def __init__(self, total: int, unit: str, description: str, every_s: float = 10.0,
                 check: Callable[[], None] | None = None):
        self.total, self.unit, self.description, self.every_s = total, unit, description, every_s
        self.done = self.documents = self.tokens = 0
        self.check = check
        self._started = self._last = time.monotonic()
        self._bar = None
        self._stop = threading.Event()
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm
                self._bar = tqdm(total=total, unit=unit, unit_scale=True, desc=description, leave=False)
            except ImportError:
                pass
        if self._bar is None:
            threading.Thread(target=self._heartbeat, name="ddptrain-preprocess-progress", daemon=True).start()

    def update(self, amount: int) -> None:
        self.done += amount
        if self.check is not None:
            self.check()
        if self._bar is not None:
            self._bar.update(amount)
        elif time.monotonic() - self._last >= self.every_s:
            self._log()

    def count(self, documents: int, tokens: int) -> None:
        """Documents and tokens written so far, for the line's rates."""
        self.documents += documents
        self.tokens += tokens
        if self._bar is not None:
            self._bar.set_postfix(documents=self.documents, tokens=self.tokens, refresh=False)

    def _log(self) -> None:
        self._last = time.monotonic()
        elapsed = self._last - self._started
        percent = 100.0 * self.done / self.total if self.total else 100.0
        eta = elapsed * (self.total - self.done) / self.done if self.done else float("nan")
        log.info("%s: %.1f%% (%d / %d %s), %d documents, %d tokens (%.0f tokens/s), %.0fs, ETA %.0fs",
                 self.description, percent, self.done, self.total, self.unit, self.documents, self.tokens,
                 self.tokens / max(elapsed, 1e-9), elapsed, eta)

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.every_s / 4):
            if time.monotonic() - self._last >= self.every_s:
                self._log()

    def close(self) -> None:
        self._stop.set()
        if self._bar is not None:
            self._bar.close()
