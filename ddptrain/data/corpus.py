"""Real corpora: text, JSONL, pre-tokenized token files and Hugging Face datasets, preprocessed once.

`load_splits` expands the configured paths, fingerprints them, lets the ranks that share the
cache directory tokenize a shard each into the cache (`shards.py`, `cache.py`), then memory-maps
the entry and the index of its examples (`index.py`). Bad input is a `DataError` naming the file
(and line) at build time, or a counted, logged skip (documents shorter than 2 tokens, undecodable
bytes replaced).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from ddptrain.config.schema import DataConfig
from ddptrain.data import preference, sft
from ddptrain.data.cache import (BuildProgress, TokenWriter, build_or_wait, cache_key, default_cache_dir,
                                 file_stamp, open_tokens, relative_stamps)
from ddptrain.data.chat import ChatTokenizer
from ddptrain.data.dataset import DataSplits, TokenExamples, assign_splits
from ddptrain.data.index import IndexHome
from ddptrain.data.shards import (BuildTeam, Segment, Unit, merge_pieces, path_bytes, plan_shards, save_piece,
                                  segment_bytes, sharded_build)
from ddptrain.data.sources import (DataError, SplitNames, TextDecoder, expand_paths, hf_documents, is_blank,
                                   is_validation, jsonl_documents, text_documents, token_documents, token_file,
                                   warn_replaced)
from ddptrain.data.stdlib import load_stdlib
from ddptrain.data.tokenizer import ByteTokenizer, load_tokenizer

log = logging.getLogger(__name__)

_ENCODE_BATCH = 256  # documents per tokenizer call (HF tokenizers encode a batch in parallel)
_CHUNK = 1 << 24  # tokens per pass over a token file (bounded memory for any file size)


def load_splits(data_cfg: DataConfig, seq_len: int, local_rank: int | None = None, collective: bool = False):
    """DataSplits of a `text | jsonl | tokens | hf | sft | preference` source (see DataConfig), through the cache.

    Called by every rank of the node (or, `collective`, by every rank of the process group: then the
    ranks of every node that sees the same cache directory share the build; ddptrain/data/shards.py)."""
    if data_cfg.name == "stdlib":  # data.vocab_size as for every source (ddptrain.plan counts the model with it)
        tokenizer = load_tokenizer(data_cfg.tokenizer)
        splits = load_stdlib(seq_len, data_cfg.val_percent, data_cfg.max_docs, tokenizer)
        splits.vocab_size = _vocab_size(data_cfg, tokenizer, {})
        return splits
    whole = {"sft": sft, "preference": preference}.get(data_cfg.name)  # whole examples with a target mask
    is_whole = whole is not None
    if is_whole:
        tokenizer = ChatTokenizer(data_cfg.tokenizer, data_cfg.chat_template, f"data={data_cfg.name}")
    else:
        tokenizer = ByteTokenizer() if data_cfg.name == "tokens" else load_tokenizer(data_cfg.tokenizer)
    allow_dirs = data_cfg.name in ("hf", "sft", "preference")
    train_files = expand_paths(list(data_cfg.paths), "data.paths", allow_dirs)
    val_files = expand_paths(list(data_cfg.val_paths), "data.val_paths", allow_dirs) if data_cfg.val_paths else []
    index = Path(os.path.expanduser(data_cfg.index)) if data_cfg.index else None
    cache_dir = Path(os.path.expanduser(data_cfg.cache_dir)) if data_cfg.cache_dir else default_cache_dir()
    fingerprint = {
        "source": data_cfg.name, "train": [file_stamp(p) for p in train_files],
        "val": [file_stamp(p) for p in val_files], "tokenizer": tokenizer.fingerprint(),
        "tokenizer_class": tokenizer.tokenizer_class, "libraries": tokenizer.library_versions(),  # the key's only, not the resume fingerprint's (inputs below)
        "val_percent": None if val_files else data_cfg.val_percent, "max_docs": data_cfg.max_docs,
        "split_by": data_cfg.split_by, "field": data_cfg.field, "on_decode_error": data_cfg.on_decode_error,
        "dtype": data_cfg.dtype, "eod_token": data_cfg.eod_token, "index": file_stamp(index) if index else None,
        **(whole.fingerprint(data_cfg, seq_len) if is_whole else {}),
    }
    key = cache_key(fingerprint)
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    team = BuildTeam.discover(cache_dir, local_rank) if collective else BuildTeam.from_env(local_rank)

    def build(tmp: Path) -> dict:
        if data_cfg.name == "tokens":
            meta = _build_token_files(tmp, data_cfg, train_files, val_files, index)
        elif is_whole:
            meta = whole.build(tmp, data_cfg, tokenizer, train_files, val_files, cache_dir / "hf", seq_len,
                               _whole_files(data_cfg, train_files, val_files))
        else:
            meta = _build_documents(tmp, data_cfg, tokenizer, train_files, val_files, cache_dir / "hf")
        return {"fingerprint": fingerprint, **meta}

    def build_piece(out: Path, segments: list[Segment], check) -> dict:
        names, hf_cache = SplitNames(train_files), cache_dir / "hf"
        if is_whole:
            docs, is_val, stats = whole.tokenize(out, data_cfg, tokenizer, segments, names, bool(val_files), hf_cache,
                                                 seq_len, check)
        else:
            docs, is_val, stats = _tokenize_documents(out, data_cfg, tokenizer, segments, names, bool(val_files),
                                                      hf_cache, check)
        save_piece(out, docs, is_val, stats)
        return stats

    def merge(tmp: Path, pieces: list[Path]) -> dict:
        if is_whole:
            return {"fingerprint": fingerprint, **whole.merge(tmp, pieces, bool(val_files), seq_len)}
        merged = merge_pieces(tmp, pieces, ("tokens.npy",), (0,))
        meta = _finish_documents(tmp, merged["docs"], merged["is_val"], merged["counts"], merged["tokens"],
                                 bool(val_files))
        return {"fingerprint": fingerprint, **meta}

    started = time.perf_counter()
    if team.size > 1 and data_cfg.name != "tokens" and data_cfg.max_docs is None:
        # Every rank of the team tokenizes its shard (data.max_docs counts documents in order: one process).
        shards = plan_shards(_units(data_cfg, train_files, val_files), team.size)
        entry, meta, built = sharded_build(cache_dir, key, team, shards, build_piece, merge)
    else:
        entry, meta, built = build_or_wait(cache_dir, key, build, is_builder=team.index == 0,
                                           failed=team.failure_marker(cache_dir, key))
    vocab_size = _vocab_size(data_cfg, tokenizer, meta)
    splits = {}
    for split in ("train", "val"):
        if is_whole:
            splits[split] = whole.examples_of(entry, split, open_tokens(entry, meta[split]), meta)
            continue
        docs = np.load(entry / f"{split}.docs.npy", mmap_mode="r")
        home = IndexHome(entry, split, seq_len, team.index == 0, team.launch)
        splits[split] = TokenExamples.from_token_array(open_tokens(entry, meta[split]), docs[:, 0], docs[:, 1], seq_len,
                                                       home)
    log.info("data: %s cache entry %s in %.2fs (%s, %d train + %d validation documents, vocabulary %d)",
             "built" if built else "reused", entry, time.perf_counter() - started, data_cfg.name,
             splits["train"].documents, splits["val"].documents, vocab_size)
    if meta["short_documents"]:
        log.warning("data: skipped %d document(s) shorter than 2 tokens (no input/target pair), e.g. %s",
                    meta["short_documents"], meta["short_example"])
    warn_replaced(meta.get("replaced_documents", 0), meta.get("replaced_example"))
    if is_whole:
        whole.warn_skips(meta, seq_len)
    inputs = {"source": data_cfg.name, "train": relative_stamps(train_files), "val": relative_stamps(val_files),
              "tokenizer": tokenizer.fingerprint(), "tokenizer_class": tokenizer.tokenizer_class,
              "documents": splits["train"].documents, "targets": splits["train"].valid_targets(),
              "index": relative_stamps([index]) if index else None}
    return DataSplits(splits["train"], splits["val"], vocab_size, inputs)


def _vocab_size(data_cfg: Any, tokenizer, meta: dict) -> int:
    if data_cfg.name == "tokens":
        vocab_size = int(data_cfg.vocab_size)
        for path, max_id, position in meta["max_ids"]:  # checked on every load: vocab_size is not in the key
            if max_id >= vocab_size:
                raise DataError(f"{path}: token id {max_id} (at position {position}) is >= data.vocab_size={vocab_size}, "
                                "the model's vocabulary; raise data.vocab_size or check data.dtype")
        return vocab_size
    if data_cfg.vocab_size is not None and data_cfg.vocab_size < tokenizer.vocab_size:
        raise DataError(f"data.vocab_size={data_cfg.vocab_size} is smaller than the vocabulary of the tokenizer "
                        f"{tokenizer.name} ({tokenizer.vocab_size} ids)")
    return int(data_cfg.vocab_size or tokenizer.vocab_size)


def _units(data_cfg: Any, train_files: list[Path], val_files: list[Path]) -> list[Unit]:
    """What the sharded build cuts: JSONL files at line starts; a text file and a Hugging Face
    dataset (all its files: their rows are numbered together) whole."""
    def whole(files: list[Path]) -> bool:  # a dataset read as one: data=hf, or records not all in JSONL files
        if data_cfg.name in ("sft", "preference"):
            return not all(p.is_file() and p.suffix.lower() == ".jsonl" for p in files)
        return data_cfg.name == "hf"

    units = []
    for files, validation in ((train_files, False), (val_files, True)):
        if files and whole(files):
            units.append(Unit(tuple(str(p) for p in files), validation, sum(path_bytes(p) for p in files), False))
        else:
            units += [Unit((str(p),), validation, path_bytes(p), data_cfg.name != "text") for p in files]
    return units


def _whole_files(data_cfg: Any, train_files: list[Path], val_files: list[Path]) -> list[Segment]:
    """The one shard of a one-process build: every source whole."""
    return [segment for shard in plan_shards(_units(data_cfg, train_files, val_files), 1) for segment in shard]


def _tokenize_documents(out: Path, data_cfg: Any, tokenizer, segments: list[Segment], split_name: SplitNames,
                        has_val_files: bool, hf_cache: Path, check=None) -> tuple[np.ndarray, np.ndarray, dict]:
    """Tokenize the documents of `segments` into out/tokens.npy: ((D, 2) start and length, (D,) is
    validation, the counts that meta.json reports)."""
    vocab = tokenizer.vocab_size
    dtype = np.uint8 if vocab <= 1 << 8 else np.uint16 if vocab <= 1 << 16 else np.uint32
    writer = TokenWriter(out / "tokens.npy", dtype)
    docs, is_val = [], []
    stats = {"short_documents": 0, "short_example": None, "last_name": None}
    decoder = TextDecoder(data_cfg.on_decode_error)  # one count for JSONL lines and tokenizer input alike
    progress = BuildProgress(segment_bytes(segments), "B", f"preprocessing {data_cfg.name} with tokenizer "
                             f"{tokenizer.name}", check=check)
    try:
        batch: list[tuple[str, Any, bool]] = []
        for name, payload, validation in _documents(data_cfg, segments, has_val_files, split_name, hf_cache, progress,
                                                    decoder):
            batch.append((name, _as_input(tokenizer, name, payload, decoder), validation))
            if len(batch) == _ENCODE_BATCH:
                _write_batch(tokenizer, writer, batch, docs, is_val, stats, progress)
                batch = []
        _write_batch(tokenizer, writer, batch, docs, is_val, stats, progress)
    finally:
        writer.close()
        progress.close()
    stats.update(replaced_documents=decoder.replaced_documents, replaced_example=decoder.replaced_example)
    return np.asarray(docs, dtype=np.int64).reshape(-1, 2), np.asarray(is_val, dtype=bool), stats


def _finish_documents(tmp: Path, docs: np.ndarray, is_val: np.ndarray, stats: dict, tokens: int,
                      has_val_files: bool) -> dict:
    """Each split's documents and the meta of a text / JSONL / HF entry, from its documents in order."""
    splits = assign_splits([stats["last_name"]], docs, is_val, has_val_files)
    for split, array in splits.items():
        np.save(tmp / f"{split}.docs.npy", array)
    ref = {"tokens": {"npy": "tokens.npy"}}
    return {"train": ref, "val": ref, "tokens": tokens, "short_documents": stats["short_documents"],
            "short_example": stats["short_example"], "replaced_documents": stats["replaced_documents"],
            "replaced_example": stats["replaced_example"]}


def _build_documents(tmp: Path, data_cfg: Any, tokenizer, train_files: list[Path], val_files: list[Path],
                     hf_cache: Path) -> dict:
    """Tokenize text / JSONL / HF documents into one tokens.npy and per-split document offsets."""
    docs, is_val, stats = _tokenize_documents(tmp, data_cfg, tokenizer, _whole_files(data_cfg, train_files, val_files),
                                              SplitNames(train_files), bool(val_files), hf_cache)
    tokens = len(np.load(tmp / "tokens.npy", mmap_mode="r"))
    return _finish_documents(tmp, docs, is_val, stats, tokens, bool(val_files))


def _documents(data_cfg: DataConfig, segments: list[Segment], has_val_files: bool, split_name: SplitNames, hf_cache,
               progress, decoder: TextDecoder) -> Iterator[tuple[str, Any, bool]]:
    """(name, payload, is validation) of every document, up to data.max_docs of data.paths and as many
    of data.val_paths (as data=tokens counts them). Text that is empty or nothing but whitespace (a
    JSONL field, a Hugging Face row, a text file) is no document in any source: not trained on, not a
    too-short one, not counted by data.max_docs; the others keep their names (file:line, dataset#row)."""
    for validation, group in itertools.groupby(segments, key=lambda segment: segment.validation):
        count = 0
        stream = itertools.chain.from_iterable(_segment_documents(data_cfg, s, hf_cache, decoder) for s in group)
        for name, payload, read in stream:
            if payload is None or is_blank(payload):  # a blank JSONL line, a whitespace-only file, field or row
                progress.update(read)
                continue
            if data_cfg.max_docs is not None and count >= data_cfg.max_docs:
                break
            progress.update(read)
            count += 1
            yield name, payload, validation or (not has_val_files and is_validation(split_name(name),
                                                                                      data_cfg.val_percent))


def _segment_documents(data_cfg: DataConfig, segment: Segment, hf_cache: Path, decoder: TextDecoder):
    files = [Path(p) for p in segment.paths]
    if data_cfg.name == "text":
        return text_documents(files, data_cfg.split_by)
    if data_cfg.name == "jsonl":
        return jsonl_documents(files, data_cfg.field, decoder, segment.start, segment.end)
    return hf_documents(files, data_cfg.field, "validation" if segment.validation else "train", hf_cache)


def _as_input(tokenizer, name: str, payload, decoder: TextDecoder):
    """What the tokenizer takes: bytes for the byte tokenizer, text (decoded by the policy) otherwise."""
    if not tokenizer.needs_text or isinstance(payload, str):
        return payload
    return decoder.decode(name, payload)


def _write_batch(tokenizer, writer: TokenWriter, batch, docs, is_val, stats, progress: BuildProgress) -> None:
    if not batch:
        return
    written = tokens = 0
    for (name, _, validation), ids in zip(batch, tokenizer.encode_batch([b[1] for b in batch])):
        if len(ids) < 2:
            stats["short_documents"] += 1
            stats["short_example"] = stats["short_example"] or name
            continue
        docs.append((writer.append(ids), len(ids)))
        stats["last_name"] = name
        is_val.append(validation)
        written, tokens = written + 1, tokens + len(ids)
    progress.count(written, tokens)


def _build_token_files(tmp: Path, data_cfg: Any, train_files: list[Path], val_files: list[Path],
                       index: Path | None) -> dict:
    """Document offsets of pre-tokenized files; the tokens stay in place when a split has one file."""
    if index is not None and len(train_files) != 1:
        raise DataError(f"data.index describes one token file, but data.paths names {len(train_files)}")
    groups = {"train": train_files, "val": val_files} if val_files else {"all": train_files}
    total = sum(p.stat().st_size for files in groups.values() for p in files) // np.dtype(data_cfg.dtype).itemsize
    progress = BuildProgress(total, "tok", f"indexing token files ({data_cfg.dtype})")
    meta: dict = {"max_ids": [], "short_documents": 0, "short_example": None}
    per_group = {}
    try:
        for group, files in groups.items():
            kept = _KeptDocuments(data_cfg.max_docs)
            offset = 0
            writer = TokenWriter(tmp / f"{group}.tokens.npy", data_cfg.dtype) if len(files) > 1 else None
            for path in files:
                tokens = token_file(path, data_cfg.dtype)
                file_index = index if group != "val" else None
                for starts, lengths in token_documents(tokens, path, data_cfg.eod_token, file_index, _CHUNK):
                    short = kept.add(starts + offset, lengths)
                    if short is not None and meta["short_example"] is None:
                        meta["short_example"] = f"document {short} of {[str(p) for p in files]}"
                offset += len(tokens)
                max_id, position = 0, 0
                for at in range(0, len(tokens), _CHUNK):
                    chunk = np.asarray(tokens[at : at + _CHUNK])
                    if writer is not None:
                        writer.append(chunk)
                    where = int(chunk.argmax())
                    if chunk[where] > max_id or at == 0:
                        max_id, position = int(chunk[where]), at + where
                    progress.update(len(chunk))
                meta["max_ids"].append([str(path), max_id, position])
            if writer is not None:
                writer.close()
                ref = {"npy": f"{group}.tokens.npy"}
            else:
                ref = {"file": str(files[0].resolve()), "dtype": data_cfg.dtype}
            meta["short_documents"] += kept.short
            per_group[group] = (ref, *kept.arrays())
    finally:
        progress.close()
    docs, is_val, refs = [], [], {}
    for group, (ref, ids, spans) in per_group.items():
        refs[group] = ref
        docs.append(spans)
        is_val.append(np.full(len(ids), group == "val") if group != "all" else
                      np.fromiter((is_validation(str(i), data_cfg.val_percent) for i in ids), bool, len(ids)))
    names = [str(int(per_group[group][1][-1])) if len(per_group[group][1]) else "" for group in per_group]
    if "all" in refs:
        refs = {"train": refs["all"], "val": refs["all"]}
        splits = assign_splits(names, docs[0], is_val[0], False)
    else:
        train, val = docs
        if not len(train):
            raise DataError("the corpus is empty: no document of at least 2 tokens in data.paths")
        if not len(val):
            raise DataError("data.val_paths produced no document of at least 2 tokens")
        splits = {"train": train, "val": val}
    for split, array in splits.items():
        np.save(tmp / f"{split}.docs.npy", array)
    return {"train": {"tokens": refs["train"]}, "val": {"tokens": refs["val"]}, **meta}


class _KeptDocuments:
    """The documents of at least 2 tokens (an input/target pair), gathered piece by piece.

    Only these are kept, as int64 (start, length) pairs with their document number (which the
    validation split hashes); shorter ones are only counted. Memory is O(kept documents)."""

    def __init__(self, max_docs: int | None):
        self.max_docs = max_docs
        self.seen = 0  # documents numbered so far
        self.short = 0
        self._ids: list[np.ndarray] = []
        self._spans: list[np.ndarray] = []

    def add(self, starts: np.ndarray, lengths: np.ndarray) -> int | None:
        """Keep a piece's usable documents; returns the number of its first short one, if any."""
        ids = np.arange(self.seen, self.seen + len(starts), dtype=np.int64)
        self.seen += len(starts)
        if self.max_docs is not None:
            inside = ids < self.max_docs
            ids, starts, lengths = ids[inside], starts[inside], lengths[inside]
        usable = lengths >= 2
        self.short += int((~usable).sum())
        first_short = int(ids[~usable][0]) if not usable.all() else None
        self._ids.append(ids[usable])
        self._spans.append(np.stack([starts[usable], lengths[usable]], axis=1).astype(np.int64))
        return first_short

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(document numbers (D,), (D, 2) start and length)."""
        if not self._ids:
            return np.zeros(0, dtype=np.int64), np.zeros((0, 2), dtype=np.int64)
        return np.concatenate(self._ids), np.concatenate(self._spans)

