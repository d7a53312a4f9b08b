"""Real corpora: text, JSONL, token files and HF datasets; tokenizers; the preprocessing cache; bad input."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from omegaconf import OmegaConf

import ddptrain
from ddptrain.config import ConfigError, DataConfig, TrainConfig, validate
from ddptrain.data import DataError, load_splits
from ddptrain.data import cache as cache_module
from ddptrain.data import sources
from ddptrain.data.dataset import TokenExamples
from tests.helpers import REPO, TINY_RUN, import_optional, read_metrics, run_cli

SEQ_LEN = 16


def _load(tmp_path, name: str, paths, **settings):
    cfg = DataConfig(name=name, paths=[str(p) for p in paths], cache_dir=str(tmp_path / "cache"), **settings)
    return load_splits(cfg, SEQ_LEN, local_rank=0)


def _texts(tmp_path, count: int = 12, words: int = 30) -> list:
    paths = []
    for i in range(count):
        path = tmp_path / "corpus" / f"doc{i:02d}.txt"
        path.parent.mkdir(exist_ok=True)
        path.write_text(" ".join(f"w{i}x{j}" for j in range(words)))
        paths.append(path)
    return paths


def _docs(examples: TokenExamples) -> list[bytes]:
    """Each document's bytes, rebuilt from its examples (they overlap by one token)."""
    out: dict[int, list] = {}
    for start, length, doc in zip(examples.starts, examples.lengths, examples.doc_ids):
        piece = examples.tokens[start : start + length].tolist()
        out[int(doc)] = out[int(doc)] + piece[1:] if int(doc) in out else piece
    return [bytes(out[d]) for d in sorted(out)]


# -- sources ---------------------------------------------------------------------------------------

def test_text_files_are_documents_split_by_file_name(tmp_path):
    paths = _texts(tmp_path)
    data = _load(tmp_path, "text", [tmp_path / "corpus" / "*.txt"], val_percent=20.0)
    assert data.vocab_size == 256
    everything = {bytes(p.read_bytes()) for p in paths}
    train, val = _docs(data.train), _docs(data.val)
    assert set(train) | set(val) == everything and not set(train) & set(val)
    expected_val = {p.read_bytes() for p in paths if sources.is_validation(p.name, 20.0)}  # relative to corpus/
    assert set(val) == expected_val and 0 < len(val) < len(paths)
    assert data.train.lengths.max() == SEQ_LEN + 1


def test_text_paragraphs_are_documents(tmp_path):
    path = tmp_path / "book.txt"
    path.write_text("first paragraph here\nstill first\n\n  \nsecond one\n\n\nthird and last\n")
    data = _load(tmp_path, "text", [path], split_by="paragraph", val_percent=0.0)
    docs = sorted(_docs(data.train) + _docs(data.val))
    assert docs == sorted([b"first paragraph here\nstill first", b"second one", b"third and last"])


def test_jsonl_lines_are_documents_of_the_field(tmp_path):
    path = tmp_path / "a.jsonl"
    rows = [{"text": f"line {i} " * (i + 1), "id": i} for i in range(20)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")  # a blank line is skipped
    data = _load(tmp_path, "jsonl", [path], field="text", val_percent=10.0)
    docs = _docs(data.train) + _docs(data.val)
    assert sorted(docs) == sorted(r["text"].encode() for r in rows)
    expected_val = {r["text"] for i, r in enumerate(rows) if sources.is_validation(f"a.jsonl:{i + 1}", 10.0)}
    assert {d.decode() for d in _docs(data.val)} == expected_val and expected_val


def test_blank_jsonl_lines_and_whitespace_only_text_files_are_no_documents(tmp_path, caplog):
    """A blank line is no JSON Lines record: not a document, not a too-short one, and not one of
    data.max_docs; the other lines keep their names (file:line), so their split is the one of the hash.
    A text file of nothing but whitespace holds no document either (per file or per paragraph)."""
    rows = [{"text": f"row {i} " * 3} for i in range(40)]
    blanks = ["", "   ", "\t", "\r"]
    lines, numbers = [], []  # the file's lines, and the line number of each row
    for i, row in enumerate(rows):
        lines.append(json.dumps(row))
        numbers.append(len(lines))
        if i % 3 == 0:
            lines.append(blanks[i % len(blanks)])
    path = _write(tmp_path, "a.jsonl", ("\n".join(lines) + "\n").encode())
    with caplog.at_level(logging.WARNING, logger="ddptrain"):
        data = _load(tmp_path, "jsonl", [path], field="text", val_percent=20.0, max_docs=30)
    assert data.train.documents + data.val.documents == 30, "data.max_docs counts documents, not blank lines"
    assert sorted(_docs(data.train) + _docs(data.val)) == sorted(r["text"].encode() for r in rows[:30])
    expected_val = {rows[i]["text"].encode() for i in range(30) if sources.is_validation(f"a.jsonl:{numbers[i]}", 20.0)}
    assert set(_docs(data.val)) == expected_val and expected_val
    assert "shorter than 2 tokens" not in caplog.text
    caplog.clear()
    texts = [_write(tmp_path, "blank.txt", b"  \n\n \t\n"), _write(tmp_path, "book.txt", b"one here\n\ntwo here\n"),
             _write(tmp_path, "empty.txt", b""), _write(tmp_path, "note.txt", b"three")]
    with caplog.at_level(logging.WARNING, logger="ddptrain"):
        per_file = _load(tmp_path, "text", texts, val_percent=0.0)
        per_paragraph = _load(tmp_path, "text", texts, split_by="paragraph", val_percent=0.0)
    assert sorted(_docs(per_file.train) + _docs(per_file.val)) == [b"one here\n\ntwo here\n", b"three"]
    assert sorted(_docs(per_paragraph.train) + _docs(per_paragraph.val)) == [b"one here", b"three", b"two here"]
    assert "shorter than 2 tokens" not in caplog.text


def test_the_split_is_the_same_however_the_corpus_is_spelled_or_wherever_it_is_moved(tmp_path, monkeypatch):
    """The hash split reads names relative to the sources' directory: relative paths from one working
    directory, absolute ones, and a copy of the corpus elsewhere all put the same documents in validation."""
    corpus = tmp_path / "runs" / "corpus"
    corpus.mkdir(parents=True)
    for book in range(3):
        (corpus / f"book{book}.txt").write_text("".join(f"book {book} paragraph {i} " * 3 + "\n\n" for i in range(40)))
    (corpus / "rows.jsonl").write_text("".join(json.dumps({"text": f"row {i} " * 4}) + "\n" for i in range(60)))
    moved = tmp_path / "elsewhere" / "mounted"
    moved.parent.mkdir()
    shutil.copytree(corpus, moved)
    monkeypatch.chdir(tmp_path / "runs")
    spellings = {"relative": "corpus", "absolute": str(corpus), "moved": str(moved)}
    for name, pattern, settings in [("text", "*.txt", {"split_by": "paragraph"}), ("jsonl", "*.jsonl", {"field": "text"})]:
        vals = {}
        for spelling, root in spellings.items():
            cfg = DataConfig(name=name, paths=[f"{root}/{pattern}"], cache_dir=str(tmp_path / f"cache-{spelling}"),
                             val_percent=20.0, **settings)
            vals[spelling] = sorted(_docs(load_splits(cfg, SEQ_LEN, local_rank=0).val))
        assert 1 < len(vals["relative"]) and vals["absolute"] == vals["relative"] and vals["moved"] == vals["relative"]


def test_token_files_are_cut_at_the_end_of_document_token(tmp_path):
    eod = 999
    docs = [np.arange(1, n + 1, dtype=np.uint16) for n in (5, 40, 1, 7)] * 5
    stream = np.concatenate([np.append(d, eod) for d in docs]).astype(np.uint16)
    stream.tofile(tmp_path / "train.bin")
    data = _load(tmp_path, "tokens", [tmp_path / "train.bin"], eod_token=eod, vocab_size=1000, val_percent=20.0)
    assert data.vocab_size == 1000
    lengths = sorted(int(d) for d in np.bincount(data.train.doc_ids, weights=data.train.lengths - 1)) + \
        sorted(int(d) for d in np.bincount(data.val.doc_ids, weights=data.val.lengths - 1))
    # a document of n tokens plus its EOD gives n targets; [1] + EOD is 2 tokens: 1 target
    assert sorted(lengths) == sorted([5, 40, 1, 7] * 5)
    assert isinstance(data.train.tokens, np.memmap), "one token file is read in place, not copied"
    first = data.train.starts[0]
    assert data.train.tokens[first + data.train.lengths[0] - 1] in range(1, 1000)


def test_token_files_with_an_index_and_separate_validation_file(tmp_path):
    tokens = np.arange(100, dtype=np.uint32) % 50
    tokens.tofile(tmp_path / "train.bin")
    np.save(tmp_path / "index.npy", np.array([0, 10, 30, 31, 100]))
    (np.arange(20, dtype=np.uint32) % 50).tofile(tmp_path / "val.bin")
    data = _load(tmp_path, "tokens", [tmp_path / "train.bin"], index=str(tmp_path / "index.npy"), dtype="uint32",
                 vocab_size=50, val_paths=[str(tmp_path / "val.bin")])
    assert data.train.documents == 3 and data.train.skipped_documents == 0  # [30, 31) has 1 token: skipped at build
    assert data.val.documents == 1 and data.val.valid_targets() == 19


def test_from_token_array_cuts_like_from_documents():
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 256, size=int(n)).astype(np.uint8) for n in rng.integers(1, 60, size=80)]
    reference = TokenExamples.from_documents(docs, seq_len=8)
    lengths = np.array([len(d) for d in docs])
    starts = np.cumsum(lengths) - lengths
    fast = TokenExamples.from_token_array(np.concatenate(docs), starts, lengths, seq_len=8)
    for name in ("starts", "lengths", "doc_ids"):
        assert np.array_equal(getattr(fast, name), getattr(reference, name)), name
    assert (fast.documents, fast.skipped_documents) == (reference.documents, reference.skipped_documents)
    ids = np.arange(0, len(fast), 7)
    assert all(a.equal(b) for a, b in zip(fast.collate(ids), reference.collate(ids)))
    assert (np.diff(reference.doc_ids) >= 0).all() and reference.doc_ids[-1] == reference.documents - 1


# -- tokenizers and optional sources ---------------------------------------------------------------

def _hf_tokenizer(tmp_path, texts) -> str:
    tokenizers = import_optional("tokenizers")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(texts, tokenizers.trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]"]))
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    return str(path)


def test_hf_tokenizer_sets_the_vocabulary_and_undecodable_bytes_follow_the_policy(tmp_path, caplog):
    paths = _texts(tmp_path)
    spec = _hf_tokenizer(tmp_path, [p.read_text() for p in paths])
    paths[3].write_bytes(b"w3x1 w3x2 \xff\xfe w3x3 w3x4")
    with pytest.raises(DataError, match=rf"{paths[3]}: bytes that are not UTF-8 at byte 10 .*on_decode_error=error"):
        _load(tmp_path, "text", paths, tokenizer=spec, on_decode_error="error")
    with caplog.at_level(logging.WARNING, logger="ddptrain"):
        data = _load(tmp_path, "text", paths, tokenizer=spec)
    assert 100 <= data.vocab_size <= 120 and data.train.tokens.dtype == np.uint8
    assert int(max(data.train.tokens.max(), data.val.tokens.max())) < data.vocab_size
    assert f"1 document(s) had bytes that are not UTF-8, replaced by U+FFFD (data.on_decode_error=replace), " \
           f"e.g. {paths[3]}" in caplog.text


def test_a_tokenizer_saved_with_truncation_or_padding_still_tokenizes_documents_whole(tmp_path):
    """A tokenizer.json keeps the truncation and padding it was saved with; ddptrain switches them off, or
    every document would be cut to 8 tokens, or padded with pad ids that become targets."""
    rows = [{"text": " ".join(f"w{i}x{j}" for j in range(60))} for i in range(12)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    plain = _load(tmp_path, "jsonl", [path], field="text", tokenizer=_hf_tokenizer(tmp_path, [r["text"] for r in rows]))
    tokenizers = import_optional("tokenizers")
    for setting in ("truncation", "padding"):
        saved = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
        saved.enable_truncation(max_length=8) if setting == "truncation" else saved.enable_padding(length=400)
        saved.save(str(tmp_path / f"{setting}.json"))
        data = _load(tmp_path, "jsonl", [path], field="text", tokenizer=str(tmp_path / f"{setting}.json"))
        assert sorted(map(bytes, _docs(data.train))) == sorted(map(bytes, _docs(plain.train))), setting
        assert data.train.lengths.sum() == plain.train.lengths.sum(), setting


def test_a_tokenizers_release_gets_its_own_cache_entry_and_the_run_still_resumes(tmp_path, monkeypatch):
    """Another `tokenizers` release may cut the same text differently: its cache key differs, so the
    corpus is tokenized again, not read from the entry the old release built. The resume fingerprint
    holds no version (a library upgrade still resumes). The release stands in as its version string."""
    tokenizers = import_optional("tokenizers")
    rows = [{"text": " ".join(f"w{i}x{j}" for j in range(20))} for i in range(12)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = _hf_tokenizer(tmp_path, [r["text"] for r in rows])

    def entries():
        return {p.name for p in (tmp_path / "cache").iterdir() if p.is_dir()}

    first = _load(tmp_path, "jsonl", [path], field="text", tokenizer=spec)
    _load(tmp_path, "jsonl", [path], field="text", tokenizer=spec)
    assert len(entries()) == 1, "the same release reuses the entry"
    monkeypatch.setattr(tokenizers, "__version__", tokenizers.__version__ + ".next")
    upgraded = _load(tmp_path, "jsonl", [path], field="text", tokenizer=spec)
    assert len(entries()) == 2, "another release builds its own entry"
    assert upgraded.fingerprint == first.fingerprint


def test_a_malformed_file_for_datasets_is_a_data_error_naming_it_and_the_cause(tmp_path):
    import_optional("datasets")
    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": "fine"}\n{"text": oops}\n')
    with pytest.raises(DataError, match=rf"data.paths: \['{path}'\]: datasets could not read them: ArrowInvalid: JSON"):
        _load(tmp_path, "hf", [path], field="text")


def test_hf_datasets_from_local_files_and_a_saved_directory(tmp_path):
    datasets = import_optional("datasets")
    rows = [{"body": f"row {i} " * 5} for i in range(30)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = _load(tmp_path, "hf", [path], field="body", val_percent=10.0)
    assert sorted(_docs(data.train) + _docs(data.val)) == sorted(r["body"].encode() for r in rows)
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(rows).save_to_disk(str(saved))
    again = _load(tmp_path, "hf", [saved], field="body", val_percent=10.0)
    assert sorted(_docs(again.train) + _docs(again.val)) == sorted(r["body"].encode() for r in rows)
    with pytest.raises(DataError, match=r"no column 'text' \(data.field\); the dataset has \['body'\]"):
        _load(tmp_path, "hf", [saved], field="text")


def test_empty_and_whitespace_only_hf_rows_and_jsonl_fields_are_no_documents(tmp_path, caplog):
    """As a whitespace-only text file: a Hugging Face row (a saved dataset, or a blank line of a .txt
    through datasets) or a JSONL field of nothing but whitespace is no document: not trained on, not a
    too-short one, not one of data.max_docs; the other rows keep their names (where#row), so their split
    is the one of the hash. U+3000 is no ASCII whitespace: kept, as a text file holding it is."""
    datasets = import_optional("datasets")
    blanks = ["", "   ", "\n\t", "\r\n"]
    texts, numbers = [], []  # every row, and the row number of each real one
    for i in range(30):
        texts.append(f"row {i} " * 3 if i != 7 else "\u3000\u3000")
        numbers.append(len(texts) - 1)
        if i % 3 == 0:
            texts.append(blanks[i % len(blanks)])
    real = [texts[n] for n in numbers]
    saved = tmp_path / "saved"
    datasets.Dataset.from_list([{"text": t} for t in texts]).save_to_disk(str(saved))
    jsonl = _write(tmp_path, "rows.jsonl", "".join(json.dumps({"text": t}) + "\n" for t in texts).encode())
    lines = _write(tmp_path, "lines.txt", "".join(t.strip("\r\n") + "\n" for t in texts).encode())
    with caplog.at_level(logging.WARNING, logger="ddptrain"):
        from_disk = _load(tmp_path, "hf", [saved], field="text", val_percent=20.0, max_docs=25)
        from_jsonl = _load(tmp_path, "jsonl", [jsonl], field="text", val_percent=20.0, max_docs=25)
        from_lines = _load(tmp_path, "hf", [lines], field="text", val_percent=0.0)
    for data in (from_disk, from_jsonl):
        assert data.train.documents + data.val.documents == 25, "data.max_docs counts documents, not blank rows"
        assert sorted(_docs(data.train) + _docs(data.val)) == sorted(t.encode() for t in real[:25])
    split_name = sources.SplitNames([saved])  # the row's number counts the blank rows before it
    expected_val = {texts[n].encode() for n in numbers[:25] if sources.is_validation(split_name(f"{saved}#{n}"), 20.0)}
    assert set(_docs(from_disk.val)) == expected_val and expected_val
    assert sorted(_docs(from_lines.train) + _docs(from_lines.val)) == sorted(t.encode() for t in real)
    assert "shorter than 2 tokens" not in caplog.text


# -- the cache -------------------------------------------------------------------------------------

def test_cache_is_reused_without_reading_the_corpus_and_rebuilt_when_a_source_changes(tmp_path, caplog,
                                                                                       monkeypatch):
    """A reuse reads no document of the corpus (what makes it cheap; the times are in docs/data.md,
    a figure, never a test: a time ratio fails on a loaded machine)."""
    from ddptrain.data import corpus

    path = tmp_path / "big.jsonl"
    with path.open("w") as handle:
        for i in range(3_000):
            handle.write(json.dumps({"text": f"document {i}: " + "lorem ipsum dolor sit amet " * 4}) + "\n")
    caplog.set_level(logging.INFO, logger="ddptrain")
    documents_read, read = [], corpus._documents

    def counted(*args, **kwargs):
        for document in read(*args, **kwargs):
            documents_read[-1] += 1
            yield document

    monkeypatch.setattr(corpus, "_documents", counted)
    for _ in range(3):
        documents_read.append(0)
        data = _load(tmp_path, "jsonl", [path])
    entries = [p for p in (tmp_path / "cache").iterdir()]
    assert len(entries) == 1 and (entries[0] / "meta.json").is_file()
    assert caplog.text.count("data: built cache entry") == 1 and caplog.text.count("data: reused cache entry") == 2
    assert documents_read == [3_000, 0, 0]
    assert len(data.train) > 2_800
    with path.open("a") as handle:  # a changed source (size and mtime) gets a new entry
        handle.write(json.dumps({"text": "one more document"}) + "\n")
    grown = _load(tmp_path, "jsonl", [path])
    assert caplog.text.count("data: built cache entry") == 2
    assert grown.train.documents + grown.val.documents == data.train.documents + data.val.documents + 1
    stamp = path.stat()
    os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 10**9))  # same size, new mtime: rebuilt too
    _load(tmp_path, "jsonl", [path])
    assert caplog.text.count("data: built cache entry") == 3
    assert not [p for p in (tmp_path / "cache").iterdir() if ".tmp-" in p.name], "no temporary build left behind"


def test_waiting_ranks_get_the_entry_or_the_builders_error(tmp_path):
    def slow_build(tmp):
        time.sleep(0.5)
        np.save(tmp / "x.npy", np.arange(3))
        return {"ok": 1}

    results = {}
    waiter = threading.Thread(target=lambda: results.setdefault(
        "waiter", cache_module.build_or_wait(tmp_path, "k1", slow_build, is_builder=False, poll_s=0.05)))
    waiter.start()
    time.sleep(0.1)
    built = cache_module.build_or_wait(tmp_path, "k1", slow_build, is_builder=True)
    waiter.join(timeout=120)  # a hang guard: the build sleeps 0.5 s
    meta = results["waiter"][1]
    assert built[2] is True and meta.pop("checksums").keys() == {"x.npy"} and meta == {"ok": 1}
    assert results["waiter"][2] is False

    def failing_build(tmp):
        raise DataError("corpus.jsonl:3: invalid JSON")

    with pytest.raises(DataError, match="invalid JSON"):
        cache_module.build_or_wait(tmp_path, "k2", failing_build, is_builder=True)
    with pytest.raises(DataError, match="preprocessing failed on the building rank: DataError: corpus.jsonl:3: invalid JSON"):
        cache_module.build_or_wait(tmp_path, "k2", failing_build, is_builder=False, poll_s=0.05)


_FAILED_LAUNCH = """
import sys
from pathlib import Path
from ddptrain.data import cache
def interrupted(tmp):
    raise KeyboardInterrupt
try:
    cache.build_or_wait(Path(sys.argv[1]), "k3", interrupted, is_builder=True)
except KeyboardInterrupt:
    print("interrupted")
"""


@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_a_failure_marker_of_an_earlier_launch_does_not_fail_the_next_one(tmp_path, monkeypatch):
    """A plain torchrun's run id is `none` on every launch (and a Slurm requeue keeps its job id): the
    marker of a build interrupted in an earlier launch (another launcher process) or an earlier elastic
    attempt must not fail the ranks waiting for this launch's build."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    earlier = subprocess.run([sys.executable, "-c", _FAILED_LAUNCH, str(tmp_path)], capture_output=True, text=True,
                             cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert "interrupted" in earlier.stdout, earlier.stderr[-3000:]
    assert [p for p in tmp_path.iterdir() if ".failed-" in p.name], "the earlier launch left its marker"

    def build(tmp):
        time.sleep(0.5)
        np.save(tmp / "x.npy", np.arange(3))
        return {"ok": 1}

    for restart in ("0", "1"):  # this launch; then an elastic restart after a failure of its own
        if restart == "1":
            with pytest.raises(KeyboardInterrupt):
                cache_module.build_or_wait(tmp_path, "k4", _interrupted, is_builder=True)
            monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restart)
        key = "k3" if restart == "0" else "k4"
        results = {}
        waiter = threading.Thread(target=lambda: results.setdefault("waiter", _outcome(
            lambda: cache_module.build_or_wait(tmp_path, key, build, is_builder=False, poll_s=0.05))))
        waiter.start()
        time.sleep(0.2)
        cache_module.build_or_wait(tmp_path, key, build, is_builder=True)
        waiter.join(timeout=120)  # a hang guard: the build sleeps 0.5 s
        outcome = results["waiter"]  # (entry, meta, built), or (None, the waiter's error)
        assert isinstance(outcome[1], dict) and outcome[1]["ok"] == 1, outcome


def _interrupted(tmp):
    raise KeyboardInterrupt


def _outcome(call):
    try:
        return call()
    except Exception as error:  # the waiter's error, for the assertion to show
        return None, repr(error)


# -- bad input -------------------------------------------------------------------------------------

def _write(tmp_path, name: str, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_empty_corpus_is_a_clear_error(tmp_path):
    empty = [_write(tmp_path, f"e{i}.txt", b"" if i else b"x") for i in range(3)]
    with pytest.raises(DataError, match="the corpus is empty: no document of at least 2 tokens in data.paths"):
        _load(tmp_path, "text", empty)


def test_missing_paths_and_globs_are_named(tmp_path):
    with pytest.raises(DataError, match=rf"data.paths: '{tmp_path}/nope.txt' does not exist"):
        _load(tmp_path, "text", [tmp_path / "nope.txt"])
    with pytest.raises(DataError, match=rf"data.paths: the glob '{tmp_path}/\*.md' matches no file"):
        _load(tmp_path, "text", [tmp_path / "*.md"])


def test_a_file_that_vanished_after_the_glob_is_named(tmp_path, monkeypatch):
    real = _write(tmp_path, "real.txt", b"some text here")
    ghost = tmp_path / "ghost.txt"
    monkeypatch.setattr(sources.glob, "glob", lambda pattern, recursive=False: [str(real), str(ghost)])
    with pytest.raises(DataError, match=rf"{ghost}: the file vanished after it was listed"):
        _load(tmp_path, "text", [tmp_path / "*.txt"])


@pytest.mark.parametrize("line, message", [
    (b'{"body": "no text field"}', r"no field 'text' \(data.field\); the line has \['body'\]"),
    (b'{"text": "unterminated', r"invalid JSON: Unterminated string starting at \(column 10\)"),
    (b'{"text": 42}', r"field 'text' is int, not a string"),
    (b'{"text": "bad \xff byte"}', r"bytes that are not UTF-8 at column 15 \(data.on_decode_error=error"),
])
def test_bad_jsonl_lines_name_the_file_and_line(tmp_path, line, message):
    path = _write(tmp_path, "c.jsonl", b'{"text": "fine line one"}\n{"text": "fine line two"}\n' + line + b"\n")
    with pytest.raises(DataError, match=rf"{path}:3: {message}"):
        _load(tmp_path, "jsonl", [path], on_decode_error="error")


def test_undecodable_jsonl_bytes_are_replaced_counted_and_warned_by_default(tmp_path, caplog):
    path = _write(tmp_path, "c.jsonl", b'{"text": "fine line one"}\n{"text": "bad \xff byte"}\n'
                                       b'{"text": "fine line three"}\n{"text": "\xfe also bad"}\n')
    with caplog.at_level(logging.WARNING, logger="ddptrain"):
        data = _load(tmp_path, "jsonl", [path], val_percent=0.0)
    assert "bad \ufffd byte".encode() in _docs(data.train) + _docs(data.val)
    assert f"2 document(s) had bytes that are not UTF-8, replaced by U+FFFD (data.on_decode_error=replace), " \
           f"e.g. {path}:2" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ddptrain"):  # the count lives in the cache entry
        _load(tmp_path, "jsonl", [path], val_percent=0.0)
    assert "2 document(s) had bytes that are not UTF-8" in caplog.text


def test_token_ids_beyond_the_vocabulary_are_named(tmp_path):
    tokens = np.array([1, 2, 3, 0, 4, 5, 70, 6, 0], dtype=np.uint16)
    tokens.tofile(tmp_path / "t.bin")
    with pytest.raises(DataError, match=rf"{tmp_path}/t.bin: token id 70 \(at position 6\) is >= "
                                        r"data.vocab_size=64, the model's vocabulary"):
        _load(tmp_path, "tokens", [tmp_path / "t.bin"], eod_token=0, vocab_size=64)
    _write(tmp_path, "odd.bin", b"\x01\x00\x02")
    with pytest.raises(DataError, match=r"odd.bin: 3 bytes is not a whole number of uint16 tokens"):
        _load(tmp_path, "tokens", [tmp_path / "odd.bin"], vocab_size=64)


def test_documents_shorter_than_two_tokens_are_counted_and_logged(tmp_path, caplog):
    paths = [_write(tmp_path, f"d{i}.txt", b"x" if i % 3 == 0 else b"longer text %d" % i) for i in range(9)]
    with caplog.at_level(logging.WARNING, logger="ddptrain"):
        data = _load(tmp_path, "text", paths, val_percent=0.0)
    assert data.train.documents + data.val.documents == 6
    assert f"skipped 3 document(s) shorter than 2 tokens (no input/target pair), e.g. {paths[0]}" in caplog.text


BAD_DATA_CONFIGS = [
    ({"name": "text"}, "data.paths is empty: data=text needs files or globs"),
    ({"name": "tokens", "paths": ["t.bin"]}, "data.vocab_size is required for data=tokens"),
    ({"name": "tokens", "paths": ["t.bin"], "vocab_size": 100, "eod_token": 100},
     "data.eod_token=100 must be in [0, data.vocab_size=100)"),
    ({"name": "tokens", "paths": ["t.bin"], "vocab_size": 70000}, "does not fit data.dtype=uint16"),
    ({"name": "text", "paths": ["a"], "split_by": "line"}, "data.split_by='line' is not one of file, paragraph"),
    ({"name": "jsonl", "paths": ["a"], "eod_token": 3}, "apply to data=tokens only"),
]


@pytest.mark.parametrize("data, message", BAD_DATA_CONFIGS, ids=[m[:30] for _, m in BAD_DATA_CONFIGS])
def test_bad_data_config_is_rejected_before_training(data, message):
    cfg = OmegaConf.structured(TrainConfig)
    cfg.data = OmegaConf.merge(cfg.data, data)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        validate(cfg, 1)


# -- end to end through the CLI --------------------------------------------------------------------

CLI_RUN = [*TINY_RUN, "batch.seq_len=32", "batch.global_size=4", "batch.micro_size=2", "trainer.max_steps=3"]


def _jsonl_corpus(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": f"record {i}: " + "abc def " * (i % 9 + 2)}) + "\n" for i in range(60)))
    return ["data=jsonl", f"data.paths=[{path}]"]


def _token_corpus(tmp_path):
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(1, 300, size=int(n)), 0) for n in rng.integers(5, 80, size=60)]
    np.concatenate(docs).astype(np.uint16).tofile(tmp_path / "train.bin")
    return ["data=tokens", f"data.paths=[{tmp_path}/train.bin]", "data.eod_token=0", "data.vocab_size=320"]


def _hf_corpus(tmp_path):
    import_optional("datasets")
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"text": f"row {i} " * (i % 7 + 3)}) + "\n" for i in range(60)))
    return ["data=hf", f"data.paths=[{path}]"]


@pytest.mark.slow
@pytest.mark.parametrize("corpus", [_jsonl_corpus, _token_corpus, _hf_corpus], ids=["jsonl", "tokens", "hf"])
def test_each_source_trains_through_the_cli(tmp_path, corpus):
    run_dir = tmp_path / "run"
    result = run_cli([*CLI_RUN, *corpus(tmp_path), f"data.cache_dir={tmp_path / 'cache'}", f"run.dir={run_dir}"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3]
    assert "data: built cache entry" in result.stderr


@pytest.mark.slow
def test_a_token_run_stops_generation_at_the_end_of_document_token_it_trained_on(tmp_path):
    from ddptrain.export import export

    transformers = import_optional("transformers")
    run_dir = tmp_path / "run"  # every document of _token_corpus ends with (and trains on) its eod token 0
    result = run_cli([*CLI_RUN, *_token_corpus(tmp_path), f"data.cache_dir={tmp_path / 'cache'}", f"run.dir={run_dir}"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((run_dir / "final" / "generation_config.json").read_text())["eos_token_id"] == 0
    assert ddptrain.load_model(run_dir).eos_token_id == 0
    assert transformers.GenerationConfig.from_pretrained(export(run_dir, tmp_path / "out")).eos_token_id == 0


@pytest.mark.slow
def test_text_on_two_ranks_builds_once_then_reuses_the_cache(tmp_path):
    _texts(tmp_path, count=30, words=40)
    cache = tmp_path / "cache"
    args = [*CLI_RUN, "data=text", f"data.paths=[{tmp_path}/corpus/*.txt]", f"data.cache_dir={cache}"]
    first = run_cli([*args, f"run.dir={tmp_path / 'run1'}"], nproc=2)
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stderr.count("data: built cache entry") == 1, "local rank 0 builds, rank 1 waits (and is quiet)"
    assert len(list(cache.iterdir())) == 1
    second = run_cli([*args, f"run.dir={tmp_path / 'run2'}"], nproc=2)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "data: reused cache entry" in second.stderr and "built cache entry" not in second.stderr
    losses = [[m["loss"] for m in read_metrics(tmp_path / run)] for run in ("run1", "run2")]
    assert losses[0] == losses[1]


@pytest.mark.slow
def test_bad_input_fails_on_every_rank_before_training(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "a fine first line"}\n{"txt": "oops"}\n')
    run_dir = tmp_path / "run"
    result = run_cli([*CLI_RUN, "data=jsonl", f"data.paths=[{path}]", f"data.cache_dir={tmp_path / 'cache'}",
                      f"run.dir={run_dir}"], nproc=2, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert output.count(f"{path}:2: no field 'text' (data.field)") >= 2, output[-3000:]
    assert not (run_dir / "metrics.jsonl").exists()


def test_max_docs_counts_data_paths_and_data_val_paths_each(tmp_path):
    """data.max_docs=N keeps N documents of data.paths and N of data.val_paths (as data=tokens does):
    the training files no longer use up the count before the validation files are read."""
    from tests.data.chats import random_chats, save_chat_tokenizer, write_jsonl

    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"text": f"train {i} " * 4}) + "\n" for i in range(50)))
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps({"text": f"held out {i} " * 4}) + "\n" for i in range(10)))
    cfg = DataConfig(name="jsonl", paths=[str(train)], val_paths=[str(val)], field="text", max_docs=20,
                     cache_dir=str(tmp_path / "cache"))
    data = load_splits(cfg, SEQ_LEN, local_rank=0)
    assert (data.train.documents, data.val.documents) == (20, 10)
    chats = write_jsonl(tmp_path / "c.jsonl", random_chats(30))
    held_out = write_jsonl(tmp_path / "v.jsonl", random_chats(6, 1))
    sft = DataConfig(name="sft", paths=[chats], val_paths=[held_out], max_docs=12, cache_dir=str(tmp_path / "cache"),
                     tokenizer=str(save_chat_tokenizer(tmp_path / "tok") / "tokenizer.json"))
    data = load_splits(sft, 128, local_rank=0)
    assert (data.train.documents, data.val.documents) == (12, 6)
