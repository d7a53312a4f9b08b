"""Document sources: each yields (name, payload) pairs in a deterministic order.

The name is what an error message points at (a file name, file:line, a document index), and, its
leading path made relative to the sources' common directory (`SplitNames`), what the
train/validation split hashes. Payloads are bytes (the tokenizer decides how to read
them) or str (JSONL and Hugging Face fields are text already).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import sysconfig
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np

# Test suites and vendored tools are skipped: they hold megabytes of generated or binary-ish data.
_SKIPPED_STDLIB_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
_GLOB_CHARS = re.compile(r"[*?\[]")
_BLANK_LINES = re.compile(rb"\n[ \t\r\f\v]*\n")
_WHITESPACE = " \t\n\r\v\f"  # what bytes.strip() strips


log = logging.getLogger(__name__)


class DataError(ValueError):
    """Bad input data; the message names the file (and line) and the rule."""


@contextmanager
def still_listed(path: Path) -> Iterator[None]:
    """Reading a file that was listed (a glob, data.paths): if it is gone by now, a DataError names it."""
    try:
        yield
    except FileNotFoundError:
        raise DataError(f"{path}: the file vanished after it was listed (deleted or moved during preprocessing)") from None


class TextDecoder:
    """The data.on_decode_error policy for bytes that must become text (JSONL lines; documents for a
    tokenizer.json): `replace` substitutes U+FFFD and counts the document, `error` stops with a
    DataError naming the document and where the bad bytes start. One decoder serves a whole build,
    so its count covers every source."""

    def __init__(self, on_decode_error: str = "replace"):
        self.on_decode_error = on_decode_error
        self.replaced_documents = 0
        self.replaced_example: str | None = None

    def decode(self, name: str, data: bytes, position: str = "byte") -> str:
        """`data` as text; `position`: report a bad byte by its 0-based `byte` offset or 1-based `column`."""
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as error:
            if self.on_decode_error == "error":
                where = f"column {error.start + 1}" if position == "column" else f"byte {error.start}"
                raise DataError(f"{name}: bytes that are not UTF-8 at {where} "
                                "(data.on_decode_error=error; 'replace' substitutes U+FFFD)") from None
            self.replaced_documents += 1
            self.replaced_example = self.replaced_example or name
            return data.decode("utf-8", errors="replace")


def warn_replaced(count: int, example: str | None) -> None:
    """The warning for documents whose undecodable bytes were replaced (data.on_decode_error=replace)."""
    if count:
        log.warning("data: %d document(s) had bytes that are not UTF-8, replaced by U+FFFD "
                    "(data.on_decode_error=replace), e.g. %s", count, example)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_documents(max_docs: int | None = None) -> Iterator[tuple[str, bytes]]:
    """The running interpreter's standard-library .py files, one document per file, sorted."""
    root = stdlib_root()
    paths = []
    for directory, subdirectories, files in os.walk(root):  # pruned: not a walk through site-packages
        subdirectories[:] = [name for name in subdirectories if name not in _SKIPPED_STDLIB_DIRS]
        paths.extend(Path(directory, name) for name in files if name.endswith(".py"))
    paths.sort()
    if not paths:
        raise FileNotFoundError(f"no Python source files found under the standard library at {root}")
    for count, path in enumerate(paths):
        if max_docs is not None and count >= max_docs:
            return
        yield str(path.relative_to(root)), path.read_bytes()


def is_validation(name: str, val_percent: float) -> bool:
    """Deterministic split by a hash of the document's name: the same on every machine and rank."""
    return (zlib.crc32(name.encode("utf-8")) % 10_000) < val_percent * 100


def common_directory(paths: list[Path]) -> str:
    """The deepest directory holding every one of `paths` (a directory holds itself), absolute."""
    return os.path.commonpath([os.path.abspath(p if p.is_dir() else p.parent) for p in paths])


class SplitNames:
    """What `is_validation` hashes of a document's name: its leading source path made relative to
    the sources' common directory (`doc3.txt#2`, not `/home/me/corpus/doc3.txt#2`). A corpus spelled
    another way (relative or absolute, from another working directory) or moved whole keeps every
    document on its side of the split, as it keeps the resume fingerprint (cache.relative_stamps)."""

    def __init__(self, files: list[Path]):
        self._relative: dict[str, str] = {}
        if not files:
            return
        base = common_directory(files)
        relative = [os.path.relpath(os.path.abspath(p), base) for p in files]
        self._relative = {str(p): name for p, name in zip(files, relative)}
        if len(files) > 1:  # hf_records names the rows of several data files after the first
            self._relative[f"{files[0]} (+{len(files) - 1} files)"] = f"{relative[0]} (+{len(files) - 1} files)"

    def __call__(self, name: str) -> str:
        if name in self._relative:  # a whole file
            return self._relative[name]
        for separator in ("#", ":"):  # file#paragraph, dataset#row, file:line
            path, _, rest = name.rpartition(separator)
            if path in self._relative:
                return f"{self._relative[path]}{separator}{rest}"
        return name


def expand_paths(patterns: list[str], key: str = "data.paths", allow_dirs: bool = False) -> list[Path]:
    """Files named by `patterns` (paths or globs, `**` recursive), each glob sorted, in the given order."""
    files: list[Path] = []
    for pattern in patterns:
        pattern = os.path.expanduser(str(pattern))
        if _GLOB_CHARS.search(pattern):
            matches = sorted(Path(p) for p in glob.glob(pattern, recursive=True))
            matches = [p for p in matches if allow_dirs or not p.is_dir()]
            if not matches:
                raise DataError(f"{key}: the glob {pattern!r} matches no file")
            files.extend(matches)
        else:
            path = Path(pattern)
            if not path.exists():
                raise DataError(f"{key}: {pattern!r} does not exist")
            if path.is_dir() and not allow_dirs:
                raise DataError(f"{key}: {pattern!r} is a directory; name its files or a glob like '{pattern}/**/*.txt'")
            files.append(path)
    seen: set[Path] = set()
    return [p for p in files if not (p in seen or seen.add(p))]  # first occurrence wins


def read_bytes(path: Path) -> bytes:
    with still_listed(path):
        return path.read_bytes()


def is_blank(payload: str | bytes) -> bool:
    """Empty or nothing but ASCII whitespace: a text that holds no document. What bytes.strip() strips,
    for text too, so a document is kept or dropped alike whether a text file, a JSONL field or a Hugging
    Face row holds it (str.strip would also strip U+3000 and U+001C..U+001F, which bytes keep)."""
    return not (payload.strip(_WHITESPACE) if isinstance(payload, str) else payload.strip())


def text_documents(files: list[Path], split_by: str = "file") -> Iterator[tuple[str, bytes | None, int]]:
    """(name, bytes, bytes read): one document per file, or per blank-line-separated paragraph; None
    for a file of nothing but whitespace, which holds no document."""
    for path in files:
        data = read_bytes(path)
        if is_blank(data):
            yield str(path), None, len(data)
        elif split_by == "paragraph":
            pieces = [p.strip() for p in _BLANK_LINES.split(data)]
            pieces = [p for p in pieces if p]
            for index, piece in enumerate(pieces):
                yield f"{path}#{index}", piece, len(data) if index == len(pieces) - 1 else 0
        else:
            yield str(path), data, len(data)


MAX_LINE_BYTES = 16 << 20
"""The longest JSONL line read: one record of more is refused before it is parsed."""


def jsonl_records(files: list[Path], decoder: TextDecoder | None = None, start: int = 0,
                  end: int | None = None) -> Iterator[tuple[str, dict | None, int]]:
    """(file:line, the line's JSON object, bytes read) of every line; None for a blank line. `start`,
    `end`: only the lines that start in bytes [start, end) of each file (`start` a line start; a
    shard of a sharded build), numbered as in the whole file."""
    decoder = decoder or TextDecoder()
    for path in files:
        with still_listed(path):
            handle = path.open("rb")
        with handle:
            first = 1 + count_lines(handle, start) if start else 1
            handle.seek(start)
            position = start
            for number, raw in enumerate(iter(lambda: handle.readline(MAX_LINE_BYTES + 1), b""), start=first):
                if end is not None and position >= end:
                    break
                position += len(raw)
                name = f"{path}:{number}"
                if len(raw) > MAX_LINE_BYTES:  # refused before the rest of it is read, decoded or parsed
                    raise DataError(f"{name}: the line is longer than {MAX_LINE_BYTES >> 20} MiB, the limit of one "
                                    "JSONL record (far more than any context holds): split or drop that record")
                if not raw.strip():
                    yield name, None, len(raw)
                    continue
                line = decoder.decode(name, raw, position="column")
                try:
                    record = json.loads(line.rstrip("\r\n"))
                except json.JSONDecodeError as error:
                    raise DataError(f"{name}: invalid JSON: {error.msg} (column {error.colno})") from None
                if not isinstance(record, dict):
                    raise DataError(f"{name}: the line is a JSON {type(record).__name__}, not an object")
                yield name, record, len(raw)


def count_lines(handle, end: int) -> int:
    """Newlines in bytes [0, end) of an open binary file (memchr speed: far less than tokenizing them)."""
    handle.seek(0)
    lines = 0
    while end > handle.tell():
        block = handle.read(min(16 << 20, end - handle.tell()))
        if not block:
            break
        lines += block.count(b"\n")
    return lines


def jsonl_documents(files: list[Path], field: str, decoder: TextDecoder | None = None, start: int = 0,
                    end: int | None = None) -> Iterator[tuple[str, str | None, int]]:
    """(file:line, text, bytes read): one document per non-blank line, the string at `field`; None for
    a blank line, which is no record (the JSON Lines convention): no document, not counted."""
    for name, record, read in jsonl_records(files, decoder, start, end):
        if record is None:
            yield name, None, read
            continue
        if field not in record:
            raise DataError(f"{name}: no field {field!r} (data.field); the line has {sorted(record)}")
        value = record[field]
        if not isinstance(value, str):
            raise DataError(f"{name}: field {field!r} is {type(value).__name__}, not a string")
        yield name, value, read


def token_file(path: Path, dtype: str) -> np.ndarray:
    """A flat token file as nanoGPT writes it (`arr.tofile`), memory-mapped read-only."""
    itemsize = np.dtype(dtype).itemsize
    with still_listed(path):
        size = path.stat().st_size
    if size % itemsize:
        raise DataError(f"{path}: {size} bytes is not a whole number of {dtype} tokens (data.dtype={dtype})")
    if size == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def token_documents(tokens: np.ndarray, path: Path, eod_token: int | None, index: Path | None,
                    chunk: int = 1 << 24) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(starts, lengths) of the documents of one token file, in pieces of at most `chunk` documents.

    With `eod_token`, a document ends with (and includes) each end-of-document token, as nanoGPT's
    prepare scripts append one per document; with `index`, a .npy of document start offsets (or
    of boundaries ending with the file's length); with neither, the whole file is one document.
    The file is scanned `chunk` tokens at a time, so memory stays bounded whatever it holds (a
    file of nothing but end-of-document tokens is a billion one-token documents).
    """
    total = len(tokens)
    if total == 0:
        return
    if index is not None:
        starts = _index_offsets(index, path, total)
        yield starts, np.diff(np.append(starts, total))
    elif eod_token is not None:
        begin = 0  # start of the document not yet ended
        for at in range(0, total, chunk):
            ends = np.flatnonzero(np.asarray(tokens[at : at + chunk]) == eod_token).astype(np.int64) + (at + 1)
            if len(ends):
                bounds = np.concatenate([[begin], ends])
                yield bounds[:-1], np.diff(bounds)
                begin = int(ends[-1])
        if begin < total:
            yield np.array([begin], dtype=np.int64), np.array([total - begin], dtype=np.int64)
    else:
        yield np.zeros(1, dtype=np.int64), np.array([total], dtype=np.int64)


def _index_offsets(index: Path, path: Path, total: int) -> np.ndarray:
    try:
        offsets = np.load(index).astype(np.int64).ravel()
    except FileNotFoundError:
        raise DataError(f"data.index: {index} does not exist") from None
    except ValueError as error:
        raise DataError(f"data.index: {index} is not a .npy array of offsets ({error})") from None
    if len(offsets) and offsets[-1] == total:
        offsets = offsets[:-1]
    if len(offsets) == 0 or offsets[0] != 0 or (np.diff(offsets) <= 0).any() or offsets[-1] >= total:
        raise DataError(f"data.index: {index} must hold increasing document starts from 0 below the "
                        f"{total} tokens of {path}")
    return offsets


def hf_records(paths: list[Path], split: str, cache_dir: Path) -> tuple[str, Iterator[tuple[str, dict]], list[str]]:
    """(where, (where#row, row) of every row, the column names) of a local Hugging Face `datasets`
    dataset: data files, or a `save_to_disk` directory (its `split`)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only, never the Hub
    try:
        import datasets
    except ImportError:
        raise DataError("data=hf and data=sft on a dataset need the optional extra: pip install 'ddptrain[hf]' "
                        "(datasets)") from None
    if len(paths) == 1 and paths[0].is_dir():
        try:
            dataset = datasets.load_from_disk(str(paths[0]))
        except FileNotFoundError as error:  # a directory, but not what save_to_disk writes
            raise DataError(f"data.paths: {paths[0]} is a directory but not a Hugging Face dataset saved with "
                            f"save_to_disk (no dataset_info.json / state.json, or dataset_dict.json: {error}); give "
                            "that directory, or data files (.jsonl, .csv, .parquet, .txt)") from None
        if isinstance(dataset, datasets.DatasetDict):
            if split not in dataset:
                raise DataError(f"{paths[0]}: the saved dataset has splits {sorted(dataset)}, not {split!r}")
            dataset = dataset[split]
        where = str(paths[0])
    else:
        builders = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
        kinds = {builders.get("".join(p.suffixes[-1:]).lower()) for p in paths}
        if None in kinds or len(kinds) != 1:
            raise DataError(f"data.paths: {[str(p) for p in paths]} must all be .json/.jsonl, .csv, .parquet or .txt "
                            "files (or one save_to_disk directory)")
        try:
            dataset = datasets.load_dataset(kinds.pop(), data_files=[str(p) for p in paths], split="train",
                                            cache_dir=str(cache_dir))
        except datasets.exceptions.DatasetGenerationError as error:  # "An error occurred...": the cause says what
            cause = error.__cause__ or error.__context__ or error
            raise DataError(f"data.paths: {[str(p) for p in paths]}: datasets could not read them: "
                            f"{type(cause).__name__}: {cause}") from None
        where = str(paths[0]) if len(paths) == 1 else f"{paths[0]} (+{len(paths) - 1} files)"

    def rows(columns: list[str]) -> Iterator[tuple[str, dict]]:
        row = 0
        for batch in dataset.select_columns(columns).iter(batch_size=1024):
            for values in zip(*(batch[column] for column in columns)):
                yield f"{where}#{row}", dict(zip(columns, values))
                row += 1

    return where, rows, list(dataset.column_names)


def hf_documents(paths: list[Path], field: str, split: str, cache_dir: Path) -> Iterator[tuple[str, str, int]]:
    """Rows of a local Hugging Face `datasets` dataset: data files, or a `save_to_disk` directory."""
    where, rows, columns = hf_records(paths, split, cache_dir)
    if field not in columns:
        raise DataError(f"{where}: no column {field!r} (data.field); the dataset has {columns}")
    for name, record in rows([field]):
        value = record[field]
        if not isinstance(value, str):
            raise DataError(f"{name.replace('#', ': row ')}: column {field!r} is {type(value).__name__}, not a string")
        yield name, value, 1
