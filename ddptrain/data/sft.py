"""data=sft: TRL's dataset formats as whole examples with a target mask, preprocessed once.

Records come from JSONL files (`file:line`) or a local Hugging Face dataset (`dir#row`, read as
data=hf reads it). Each is a conversation, `{"messages": [{"role", "content"}, ...]}`, or a
prompt-completion pair, `{"prompt", "completion"}` (two strings, or two lists of messages); the
format is told by the fields (data.format=auto) or forced. ddptrain/data/chat.py turns a record
into token ids and a mask of its targets: assistant messages (every one, or the last with
data.train_on=last_assistant) or the completion, each with its end-of-turn token.

A conversation is one example, never cut into pieces: one longer than batch.seq_len + 1 tokens
is dropped (counted, the first one named), cut at its end (data.truncation=right), or an error;
an example left without any target is dropped and counted. Bad records stop preprocessing with
`file:line` and the rule (the table in docs/data.md). The cache entry holds tokens.npy, mask.npy
(uint8, beside the tokens) and per split (start, length, valid targets) of every example.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from ddptrain.data.cache import BuildProgress, TokenWriter
from ddptrain.data.shards import Segment, merge_pieces, segment_bytes
from ddptrain.data.chat import ChatTokenizer
from ddptrain.data.dataset import TokenExamples, assign_splits
from ddptrain.data.sources import DataError, SplitNames, TextDecoder, hf_records, is_validation, jsonl_records

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
"""The roles a message may have (TRL's conversational format)."""

_SKIPS = {
    "no_assistant": "conversation(s) without an assistant message (nothing to train on)",
    "too_long": "example(s) longer than batch.seq_len + 1 = {span} tokens (data.truncation=drop)",
    "truncated": "example(s) at batch.seq_len + 1 = {span} tokens (data.truncation=right)",
    "no_target": "example(s) with no target left after truncation",
}


def fingerprint(data_cfg: Any, seq_len: int) -> dict:
    """The settings that change an sft cache entry (besides sources and tokenizer)."""
    return {"format": data_cfg.format, "messages_field": data_cfg.messages_field, "prompt_field": data_cfg.prompt_field,
            "completion_field": data_cfg.completion_field, "train_on": data_cfg.train_on,
            "truncation": data_cfg.truncation, "seq_len": seq_len}


def records(files: list[Path], split: str, hf_cache: Path, decoder: TextDecoder, start: int = 0,
            end: int | None = None) -> Iterator[tuple[str, dict, int]]:
    """(name, record, bytes read): JSONL lines (blank ones skipped; those starting in bytes [start, end)),
    or the rows of an HF dataset."""
    directories = [p for p in files if p.is_dir()]
    if directories and len(directories) < len(files):  # datasets would read them as data files, and fail
        raise DataError(f"data.paths: {directories[0]} is a directory, matched beside files; data=sft reads .jsonl "
                        "files or Hugging Face dataset directories, not both: name the files (or a glob only they "
                        "match)")
    if all(p.is_file() and p.suffix.lower() == ".jsonl" for p in files):
        for name, record, read in jsonl_records(files, decoder, start, end):
            if record is not None:
                yield name, record, read
        return
    _, rows, columns = hf_records(files, split, hf_cache)
    for name, record in rows(columns):
        yield name, {key: value for key, value in record.items() if value is not None}, 1


def _field(name: str, record: dict, key: str, setting: str):
    if key not in record:
        raise DataError(f"{name}: no field {key!r} ({setting}); the record has {sorted(record)}")
    return record[key]


def _messages(name: str, value, what: str, tokenizer: ChatTokenizer) -> list[dict]:
    """A checked list of messages: objects with a known role and string content without special-token text."""
    if not isinstance(value, list) or not value:
        kind = "an empty list" if isinstance(value, list) else type(value).__name__
        raise DataError(f"{name}: {what} is {kind}, not a list of messages")
    checked = []
    for number, message in enumerate(value, start=1):
        if not isinstance(message, dict):
            raise DataError(f"{name}: message {number} is {type(message).__name__}, not an object with 'role' and "
                            "'content'")
        message = {key: item for key, item in message.items() if item is not None}
        for key in ("role", "content"):
            if key not in message:
                raise DataError(f"{name}: message {number} has no {key!r} (every message needs 'role' and 'content')")
        if message["role"] not in ROLES:
            raise DataError(f"{name}: message {number} has role {message['role']!r}, which is not one of "
                            f"{', '.join(ROLES)}")
        if not isinstance(message["content"], str):
            raise DataError(f"{name}: message {number} has 'content' of type {type(message['content']).__name__}, "
                            "not a string")
        special = tokenizer.special_text_in(message["content"])
        if special is not None:
            raise DataError(f"{name}: message {number} ({message['role']}) of {what} holds {special!r}, the text of a "
                            f"special token of the tokenizer {tokenizer.path}, which reads it as that token, not as "
                            "text (a turn ended or opened inside the message, trained as if the data said so); "
                            "message content may not contain the tokenizer's special-token text; remove it from the "
                            f"data, or write it apart (like {special[:1] + ' ' + special[1:]!r})")
        checked.append(message)
    return checked


def encode_record(name: str, record: dict, data_cfg: Any, tokenizer: ChatTokenizer) -> tuple[list[int], list[int]] | None:
    """(ids, mask) of one record; None for a conversation without an assistant message (skipped)."""
    form = data_cfg.format
    if form == "auto":
        if data_cfg.messages_field in record:
            form = "messages"
        elif data_cfg.prompt_field in record and data_cfg.completion_field in record:
            form = "prompt_completion"
        else:
            raise DataError(f"{name}: neither a conversation (field {data_cfg.messages_field!r}, data.messages_field) "
                            f"nor a prompt-completion pair (fields {data_cfg.prompt_field!r} and "
                            f"{data_cfg.completion_field!r}); the record has {sorted(record)}")
    last = data_cfg.train_on == "last_assistant"
    if form == "messages":
        messages = _messages(name, _field(name, record, data_cfg.messages_field, "data.messages_field"),
                             f"field {data_cfg.messages_field!r}", tokenizer)
        assistant = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
        if not assistant:
            return None
        return tokenizer.conversation(name, messages, assistant[-1] if last else 0)
    prompt = _field(name, record, data_cfg.prompt_field, "data.prompt_field")
    completion = _field(name, record, data_cfg.completion_field, "data.completion_field")
    if isinstance(prompt, str) and isinstance(completion, str):
        if not completion.strip():
            raise DataError(f"{name}: the completion is empty (field {data_cfg.completion_field!r}): nothing to train on")
        return tokenizer.prompt_completion(prompt, completion)
    if isinstance(prompt, list) and isinstance(completion, list):
        prompt = _messages(name, prompt, f"the prompt (field {data_cfg.prompt_field!r})", tokenizer)
        if not completion:
            raise DataError(f"{name}: the completion is empty (field {data_cfg.completion_field!r}): nothing to train on")
        completion = _messages(name, completion, f"the completion (field {data_cfg.completion_field!r})",
                               tokenizer)
        assistant = [len(prompt) + k for k, m in enumerate(completion) if m["role"] == "assistant"]
        if not assistant:
            raise DataError(f"{name}: the completion has no assistant message (roles "
                            f"{', '.join(m['role'] for m in completion)}): nothing to train on")
        return tokenizer.conversation(name, prompt + completion, assistant[-1] if last else len(prompt))
    raise DataError(f"{name}: the prompt is {type(prompt).__name__} and the completion {type(completion).__name__}: "
                    "both must be strings, or both lists of messages")


class _Skips:
    """Counted skips, each with the first example it happened to."""

    def __init__(self):
        self.counts = {kind: 0 for kind in _SKIPS}
        self.first: dict[str, str] = {}

    def add(self, kind: str, name: str) -> None:
        self.counts[kind] += 1
        self.first.setdefault(kind, name)


def group_records(segments: list[Segment], hf_cache: Path,
                  decoder: TextDecoder) -> Iterator[tuple[bool, Iterator[tuple[str, dict, int]]]]:
    """(is validation, its records) of each group of `segments` (data.paths, then data.val_paths)."""
    for validation, group in itertools.groupby(segments, key=lambda segment: segment.validation):
        split = "validation" if validation else "train"
        yield validation, itertools.chain.from_iterable(
            records([Path(p) for p in s.paths], split, hf_cache, decoder, s.start, s.end) for s in group)


def tokenize(out: Path, data_cfg: Any, tokenizer: ChatTokenizer, segments: list[Segment], split_name: SplitNames,
             has_val_files: bool, hf_cache: Path, seq_len: int, check=None) -> tuple[np.ndarray, np.ndarray, dict]:
    """Render and tokenize the records of `segments` into out/tokens.npy and out/mask.npy: ((D, 3) start,
    length, targets; (D,) is validation; the counts that meta.json reports)."""
    vocab = tokenizer.vocab_size
    dtype = np.uint8 if vocab <= 1 << 8 else np.uint16 if vocab <= 1 << 16 else np.uint32
    tokens, mask = TokenWriter(out / "tokens.npy", dtype), TokenWriter(out / "mask.npy", np.uint8)
    docs, is_val = [], []
    skips = _Skips()
    last_name = None
    span = seq_len + 1
    decoder = TextDecoder(data_cfg.on_decode_error)
    progress = BuildProgress(segment_bytes(segments), "B", f"preprocessing sft with tokenizer {tokenizer.name}",
                             check=check)
    try:
        for validation, group in group_records(segments, hf_cache, decoder):
            count = 0  # data.max_docs of each: data.val_paths are not crowded out by data.paths
            for name, record, read in group:
                if data_cfg.max_docs is not None and count >= data_cfg.max_docs:
                    break
                count += 1
                progress.update(read)
                encoded = encode_record(name, record, data_cfg, tokenizer)
                if encoded is None:
                    skips.add("no_assistant", name)
                    continue
                ids, marks = np.asarray(encoded[0], dtype=np.int64), np.asarray(encoded[1], dtype=np.uint8)
                if len(ids) > span:
                    if data_cfg.truncation == "error":
                        raise DataError(f"{name}: the example has {len(ids)} tokens, more than batch.seq_len + 1 = "
                                        f"{span} (data.truncation=error; 'drop' skips it, 'right' cuts its end)")
                    if data_cfg.truncation == "drop":
                        skips.add("too_long", name)
                        continue
                    ids, marks = ids[:span], marks[:span]
                    skips.add("truncated", name)
                targets = int(marks[1:].sum())  # token 0 has nothing before it to be predicted from
                if not targets:
                    skips.add("no_target", name)
                    continue
                docs.append((tokens.append(ids), len(ids), targets))
                mask.append(marks)
                last_name = name
                progress.count(1, len(ids))
                is_val.append(validation or (not has_val_files and is_validation(split_name(name),
                                                                                   data_cfg.val_percent)))
    finally:
        tokens.close()
        mask.close()
        progress.close()
    counts = {"skips": skips.counts, "skip_examples": skips.first, "replaced_documents": decoder.replaced_documents,
              "replaced_example": decoder.replaced_example, "last_name": last_name}
    return np.asarray(docs, dtype=np.int64).reshape(-1, 3), np.asarray(is_val, dtype=bool), counts


def finish(tmp: Path, docs: np.ndarray, is_val: np.ndarray, counts: dict, tokens: int, has_val_files: bool,
           seq_len: int) -> dict:
    """Each split's examples and the meta of an sft entry, from its examples in order."""
    why = skipped_in_words(counts["skips"], counts["skip_examples"], _SKIPS, seq_len + 1)
    splits = assign_splits([counts["last_name"]], docs, is_val, has_val_files, usable="example with a target",
                           skipped=why)
    for split, array in splits.items():
        np.save(tmp / f"{split}.docs.npy", array)
    ref = {"tokens": {"npy": "tokens.npy"}}
    return {"train": ref, "val": ref, "tokens": tokens, "skips": counts["skips"],
            "skip_examples": counts["skip_examples"],
            "short_documents": 0, "short_example": None, "replaced_documents": counts["replaced_documents"],
            "replaced_example": counts["replaced_example"]}


def build(tmp: Path, data_cfg: Any, tokenizer: ChatTokenizer, train_files: list[Path], val_files: list[Path],
          hf_cache: Path, seq_len: int, segments: list[Segment]) -> dict:
    """Render and tokenize every record into tokens.npy and mask.npy, and each split's (start, length, targets)."""
    docs, is_val, counts = tokenize(tmp, data_cfg, tokenizer, segments, SplitNames(train_files), bool(val_files),
                                    hf_cache, seq_len)
    return finish(tmp, docs, is_val, counts, len(np.load(tmp / "tokens.npy", mmap_mode="r")), bool(val_files), seq_len)


def merge(tmp: Path, pieces: list[Path], has_val_files: bool, seq_len: int) -> dict:
    """The entry of pieces built by `tokenize` on the ranks of a sharded build, as `build` writes it."""
    merged = merge_pieces(tmp, pieces, ("tokens.npy", "mask.npy"), (0,))
    return finish(tmp, merged["docs"], merged["is_val"], merged["counts"], merged["tokens"], has_val_files, seq_len)


def skipped_in_words(counts: dict[str, int], first: dict[str, str], reasons: dict[str, str], span: int) -> str:
    """What preprocessing left out, per reason with its count and first example (cut ones are kept)."""
    return "; ".join(f"skipped {count} {reasons[kind].format(span=span)}, e.g. {first[kind]}"
                     for kind, count in counts.items() if count and kind != "truncated")


def warn_skips(meta: dict, seq_len: int, reasons: dict[str, str] = _SKIPS) -> None:
    """The warnings of a build's counted skips (every load of the entry says them again); `reasons`:
    each kind of skip in words (data=preference has its own)."""
    for kind, count in meta["skips"].items():
        if count:
            log.warning("data: %s %d %s, e.g. %s", "cut" if kind == "truncated" else "skipped", count,
                        reasons[kind].format(span=seq_len + 1), meta["skip_examples"][kind])


def examples_of(entry: Path, split: str, tokens: np.ndarray, meta: dict) -> TokenExamples:
    """A split's whole examples, with the mask memory-mapped beside the tokens."""
    skipped = sum(count for kind, count in meta["skips"].items() if kind != "truncated")
    mask = np.load(entry / "mask.npy", mmap_mode="r")
    return TokenExamples.whole(tokens, mask, np.load(entry / f"{split}.docs.npy"), skipped)
