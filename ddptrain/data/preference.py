"""data=preference: TRL's preference pairs (prompt, chosen, rejected) as pairs of whole sequences.

Records come from JSONL files (`file:line`) or a local Hugging Face dataset (`dir#row`), as for
data=sft. `prompt`, `chosen` and `rejected` are three strings (standard) or three lists of messages
(conversational, rendered with the tokenizer's chat template, the prompt with the generation
prompt). Tokens are TRL DPOTrainer's: the prompt, and the prompt followed by each completion
(strings: EOS text appended to a completion that lacks it), tokenized apart; the completions start
where both stop agreeing with the prompt's tokens, so chosen and rejected share one prompt.

A pair is stored as two sequences, prompt + chosen then prompt + rejected, whose targets are the
completion tokens. A pair with a sequence longer than batch.seq_len + 1 tokens is dropped, cut at
its end (both sequences) or an error (data.truncation); a pair left without a target in either
completion is dropped; identical completions are dropped (nothing to prefer); each is counted.
`global_size` and `micro_size` count pairs, and a pair's two sequences always share a microbatch:
rows [chosen, rejected] per pair, or packed with their prompt as two documents of one row.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ddptrain.contract.pairs import PairTargets
from ddptrain.contract.targets import IGNORE_INDEX
from ddptrain.data.cache import BuildProgress, TokenWriter
from ddptrain.data.chat import ChatTokenizer
from ddptrain.data.dataset import TokenExamples, assign_splits
from ddptrain.data.packing import lay_out_rows, pack_into_rows, packed_batch
from ddptrain.data import sft
from ddptrain.data.sft import _messages
from ddptrain.data.shards import Segment, merge_pieces, segment_bytes
from ddptrain.data.sources import DataError, SplitNames, TextDecoder, is_validation

log = logging.getLogger(__name__)

FIELDS = ("prompt", "chosen", "rejected")

_SKIPS = {
    "identical": "pair(s) whose chosen and rejected completions are the same tokens (nothing to prefer)",
    "too_long": "pair(s) with a sequence longer than batch.seq_len + 1 = {span} tokens (data.truncation=drop)",
    "truncated": "pair(s) at batch.seq_len + 1 = {span} tokens (data.truncation=right)",
    "no_target": "pair(s) with a completion left without any target after truncation",
}


def fingerprint(data_cfg: Any, seq_len: int) -> dict:
    """The settings that change a preference cache entry (besides sources and tokenizer)."""
    return {"truncation": data_cfg.truncation, "seq_len": seq_len, "pairs": "prompt_chosen_rejected"}


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def encode_pair(name: str, record: dict, tokenizer: ChatTokenizer) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, chosen ids, rejected ids) of a record, tokenized as TRL's DPOTrainer tokenizes it."""
    for key in FIELDS:
        if key not in record:
            raise DataError(f"{name}: no field {key!r} (a preference pair needs 'prompt', 'chosen' and 'rejected'); "
                            f"the record has {sorted(record)}")
    prompt, chosen, rejected = (record[key] for key in FIELDS)
    kinds = {type(value).__name__ for value in (prompt, chosen, rejected)}
    if kinds == {"str"}:
        for key in ("chosen", "rejected"):
            if not record[key].strip():
                raise DataError(f"{name}: the {key} completion is empty: nothing to prefer")
        eos = tokenizer.tokenizer.eos_token
        chosen, rejected = (c if c.endswith(eos) else c + eos for c in (chosen, rejected))
        call = tokenizer.tokenizer
        prompt_ids = list(call(text=prompt)["input_ids"])
        chosen_full = list(call(text=prompt + chosen)["input_ids"])
        rejected_full = list(call(text=prompt + rejected)["input_ids"])
    elif kinds == {"list"}:
        prompt = _messages(name, prompt, "the prompt", tokenizer)
        chosen = _messages(name, chosen, "the chosen completion", tokenizer)
        rejected = _messages(name, rejected, "the rejected completion", tokenizer)
        prompt_ids = _render(tokenizer, name, prompt, add_generation_prompt=True)
        chosen_full = _render(tokenizer, name, prompt + chosen)
        rejected_full = _render(tokenizer, name, prompt + rejected)
    else:
        raise DataError(f"{name}: prompt, chosen and rejected are {type(prompt).__name__}, {type(chosen).__name__} "
                        f"and {type(rejected).__name__}: all three must be strings, or all three lists of messages")
    # TRL: the completion starts where the tokenized prompt and prompt + completion diverge.
    shared = min(_common_prefix(prompt_ids, chosen_full), _common_prefix(prompt_ids, rejected_full))
    if shared == 0:
        raise DataError(f"{name}: the prompt gives no token before the completions (an empty prompt, and a tokenizer "
                        "without BOS): the first completion token would have nothing to be predicted from")
    return prompt_ids[:shared], chosen_full[shared:], rejected_full[shared:]


def _render(tokenizer: ChatTokenizer, name: str, messages: list[dict], **kwargs) -> list[int]:
    if tokenizer.template is None:
        raise DataError(f"{name}: the tokenizer {tokenizer.path} has no chat template, needed for conversational "
                        "pairs; give data.chat_template=PATH")
    return list(tokenizer._apply(name, messages, tokenize=True, return_dict=True, **kwargs)["input_ids"])


class _Skips:
    def __init__(self):
        self.counts = {kind: 0 for kind in _SKIPS}
        self.first: dict[str, str] = {}

    def add(self, kind: str, name: str) -> None:
        self.counts[kind] += 1
        self.first.setdefault(kind, name)


def _sequences(name: str, encoded, truncation: str, span: int, skips: _Skips):
    """The pair's two (ids, mask) sequences after the truncation policy; None when the pair is skipped."""
    prompt, chosen, rejected = encoded
    if chosen == rejected:
        skips.add("identical", name)
        return None
    pair = [(np.asarray(prompt + c, dtype=np.int64), np.r_[np.zeros(len(prompt)), np.ones(len(c))].astype(np.uint8))
            for c in (chosen, rejected)]
    longest = max(len(ids) for ids, _ in pair)
    if longest > span:
        if truncation == "error":
            raise DataError(f"{name}: the pair has a sequence of {longest} tokens, more than batch.seq_len + 1 = "
                            f"{span} (data.truncation=error; 'drop' skips the pair, 'right' cuts both ends)")
        if truncation == "drop":
            skips.add("too_long", name)
            return None
        pair = [(ids[:span], mask[:span]) for ids, mask in pair]
        skips.add("truncated", name)
    if any(not mask[1:].any() for _, mask in pair):
        skips.add("no_target", name)
        return None
    return pair


def tokenize(out: Path, data_cfg: Any, tokenizer: ChatTokenizer, segments: list[Segment], split_name: SplitNames,
             has_val_files: bool, hf_cache: Path, seq_len: int, check=None) -> tuple[np.ndarray, np.ndarray, dict]:
    """Tokenize the pairs of `segments` into out/tokens.npy and out/mask.npy: ((P, 6) each pair's chosen then
    rejected (start, length, targets); (P,) is validation; the counts that meta.json reports)."""
    vocab = tokenizer.vocab_size
    dtype = np.uint8 if vocab <= 1 << 8 else np.uint16 if vocab <= 1 << 16 else np.uint32
    tokens, mask = TokenWriter(out / "tokens.npy", dtype), TokenWriter(out / "mask.npy", np.uint8)
    docs, is_val = [], []
    skips, read_pairs = _Skips(), 0
    last_name = None
    decoder = TextDecoder(data_cfg.on_decode_error)
    progress = BuildProgress(segment_bytes(segments), "B",
                             f"preprocessing preference pairs with tokenizer {tokenizer.name}", check=check)
    try:
        for validation, group in sft.group_records(segments, hf_cache, decoder):
            count = 0
            for name, record, read in group:
                if data_cfg.max_docs is not None and count >= data_cfg.max_docs:
                    break
                count += 1
                read_pairs += 1
                progress.update(read)
                pair = _sequences(name, encode_pair(name, record, tokenizer), data_cfg.truncation, seq_len + 1, skips)
                if pair is None:
                    continue
                row = []
                for ids, marks in pair:
                    row += [tokens.append(ids), len(ids), int(marks[1:].sum())]
                    mask.append(marks)
                docs.append(row)
                last_name = name
                progress.count(1, row[1] + row[4])
                is_val.append(validation or (not has_val_files and is_validation(split_name(name),
                                                                                   data_cfg.val_percent)))
    finally:
        tokens.close()
        mask.close()
        progress.close()
    counts = {"skips": skips.counts, "skip_examples": skips.first, "replaced_documents": decoder.replaced_documents,
              "replaced_example": decoder.replaced_example, "last_name": last_name, "read": read_pairs}
    return np.asarray(docs, dtype=np.int64).reshape(-1, 6), np.asarray(is_val, dtype=bool), counts


def finish(tmp: Path, docs: np.ndarray, is_val: np.ndarray, counts: dict, tokens: int, has_val_files: bool,
           seq_len: int) -> dict:
    """Each split's sequences (a pair's two in turn) and the meta of a preference entry, from its pairs in order."""
    skipped = sft.skipped_in_words(counts["skips"], counts["skip_examples"], _SKIPS, seq_len + 1)
    splits = assign_splits([counts["last_name"]], docs, is_val, has_val_files, usable="preference pair with targets",
                           skipped=f"read {counts['read']} pair(s){': ' + skipped if skipped else ''}")
    for split, array in splits.items():
        np.save(tmp / f"{split}.docs.npy", array.reshape(-1, 3))
    ref = {"tokens": {"npy": "tokens.npy"}}
    return {"train": ref, "val": ref, "tokens": tokens, "skips": counts["skips"],
            "skip_examples": counts["skip_examples"],
            "short_documents": 0, "short_example": None, "replaced_documents": counts["replaced_documents"],
            "replaced_example": counts["replaced_example"]}


def build(tmp: Path, data_cfg: Any, tokenizer: ChatTokenizer, train_files: list[Path], val_files: list[Path],
          hf_cache: Path, seq_len: int, segments: list[Segment]) -> dict:
    """Tokenize every pair into tokens.npy and mask.npy; per split, (start, length, targets) of each pair's
    chosen then rejected sequence (2 rows per pair)."""
    docs, is_val, counts = tokenize(tmp, data_cfg, tokenizer, segments, SplitNames(train_files), bool(val_files),
                                    hf_cache, seq_len)
    return finish(tmp, docs, is_val, counts, len(np.load(tmp / "tokens.npy", mmap_mode="r")), bool(val_files),
                  seq_len)


def merge(tmp: Path, pieces: list[Path], has_val_files: bool, seq_len: int) -> dict:
    """The entry of pieces built by `tokenize` on the ranks of a sharded build, as `build` writes it."""
    merged = merge_pieces(tmp, pieces, ("tokens.npy", "mask.npy"), (0, 3))
    return finish(tmp, merged["docs"], merged["is_val"], merged["counts"], merged["tokens"], has_val_files, seq_len)


def warn_skips(meta: dict, seq_len: int) -> None:
    """The warnings of a build's counted skips, in this format's words."""
    sft.warn_skips(meta, seq_len, _SKIPS)


def examples_of(entry: Path, split: str, tokens: np.ndarray, meta: dict) -> "PreferencePairs":
    """A split's pairs: its sequences read as data=sft reads its examples (the docs file holds the
    pairs' two sequences in turn)."""
    return PreferencePairs(sft.examples_of(entry, split, tokens, meta))


class PreferencePairs:
    """A split's pairs: sequence 2k of `sequences` is pair k's prompt + chosen, 2k + 1 its prompt + rejected.

    `lengths - 1` is what a pair occupies unpadded in a microbatch of rows, two rows of its longer
    sequence's positions: what token budgets limit and ranks balance."""

    is_conversations = True  # whole, never cut into pieces

    def __init__(self, sequences: TokenExamples):
        self.sequences = sequences
        positions = (sequences.lengths - 1).reshape(-1, 2)
        self.lengths = 2 * positions.max(axis=1) + 1
        self.positions = positions.sum(axis=1)  # both sequences laid end to end (packing)
        self.documents = len(self)
        self.skipped_documents = sequences.skipped_documents
        self.reference: np.ndarray | None = None  # (2P,) precomputed reference log-probs, when there are

    def __len__(self) -> int:
        return len(self.sequences) // 2

    def targets_per_example(self) -> np.ndarray:
        return self.sequences.targets_per_example().reshape(-1, 2).sum(axis=1)

    def valid_targets(self) -> int:
        return self.sequences.valid_targets()

    def collate(self, pair_ids: np.ndarray) -> tuple[torch.Tensor, PairTargets]:
        """Rows chosen, rejected of each pair in turn, padded at the end to the longest."""
        seq_ids = np.stack([2 * np.asarray(pair_ids), 2 * np.asarray(pair_ids) + 1], axis=1).reshape(-1)
        inputs, targets = self.sequences.collate(seq_ids)
        sequences = torch.arange(len(seq_ids)).unsqueeze(1).expand_as(targets).clone()
        sequences[targets == IGNORE_INDEX] = -1
        return inputs, PairTargets(targets, sequences, len(seq_ids), self._reference_of(seq_ids))

    def _reference_of(self, seq_ids: list | np.ndarray) -> torch.Tensor | None:
        return None if self.reference is None else torch.from_numpy(self.reference[np.asarray(seq_ids)])

    def collate_packed(self, rows: list[np.ndarray]) -> tuple[dict[str, torch.Tensor], PairTargets]:
        """Rows of whole pairs, each sequence a document of its own (own positions and attention segment)."""
        documents = [np.stack([2 * row, 2 * row + 1], axis=1).reshape(-1) for row in rows]  # chosen, rejected
        width = max(int(self.positions[row].sum()) for row in rows)
        inputs, targets, positions, segments = lay_out_rows(self.sequences, documents, width)
        # Sequence ids over the whole microbatch, in the order of `documents`: a row's first id is the
        # count of the rows before it; positions without a target belong to none (-1).
        first = np.cumsum([0] + [len(row) for row in documents[:-1]])
        sequences = np.where(targets != IGNORE_INDEX, first[:, None] + segments, -1)
        order = np.concatenate(documents)
        return packed_batch(inputs, positions, segments), PairTargets(
            torch.from_numpy(targets), torch.from_numpy(sequences), len(order), self._reference_of(order))


class PairRows:
    """Whole pairs packed into rows of at most 2 x seq_len positions (a row holds at least one pair,
    whose sequences have at most seq_len positions each), best-fit decreasing."""

    def __init__(self, pairs: PreferencePairs, seq_len: int):
        self.pairs = pairs
        self.capacity = 2 * seq_len

    def pack(self, ids: np.ndarray, min_rows: int = 1) -> list[np.ndarray]:
        """As ConversationRows.pack: rows narrower where that gives every rank a row."""
        return pack_into_rows(ids, self.pairs.positions[ids], self.capacity, min_rows)

    def width(self, row: np.ndarray) -> int:
        return int(self.pairs.positions[row].sum())

    def collate(self, rows: list[np.ndarray]):
        return self.pairs.collate_packed(rows)
