"""Document sources: each yields (name, bytes) pairs in a deterministic order."""

from __future__ import annotations

import sysconfig
import zlib
from pathlib import Path
from typing import Iterator

# Test suites and vendored tools are skipped: they hold megabytes of generated or binary-ish data.
_SKIPPED_STDLIB_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_documents(max_docs: int | None = None) -> Iterator[tuple[str, bytes]]:
    """The running interpreter's standard-library .py files, one document per file, sorted."""
    root = stdlib_root()
    paths = sorted(p for p in root.rglob("*.py") if not _SKIPPED_STDLIB_DIRS & set(p.relative_to(root).parts))
    if not paths:
        raise FileNotFoundError(f"no Python source files found under the standard library at {root}")
    for count, path in enumerate(paths):
        if max_docs is not None and count >= max_docs:
            return
        yield str(path.relative_to(root)), path.read_bytes()


def is_validation(name: str, val_percent: float) -> bool:
    """Deterministic split by a hash of the document's name: the same on every machine and rank."""
    return (zlib.crc32(name.encode("utf-8")) % 10_000) < val_percent * 100
