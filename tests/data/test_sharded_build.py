"""The sharded build (ddptrain/data/shards.py): every rank tokenizes its shard, rank 0 merges; the entry is
byte-identical to a one-process build on 1, 2 and 4 ranks; a damaged piece is rebuilt; a failing shard
stops every rank with its name. Real ranks: ddptrain.testing.run_distributed (gloo, spawned processes)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import pytest

from ddptrain.config import DataConfig
from ddptrain.data import DataError, load_splits
from ddptrain.data.shards import Unit, plan_shards
from ddptrain.testing import run_distributed
from tests.helpers import import_optional

SEQ_LEN = 16


def _corpus(root: Path, bad_line: int | None = None) -> list[Path]:
    """JSONL files of uneven sizes: blank lines, one-byte documents (too short), undecodable bytes."""
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for f, lines in enumerate((400, 37, 900, 3)):
        path = root / f"part{f}.jsonl"
        rows = []
        for i in range(lines):
            if i % 50 == 7:
                rows.append(b"  ")
            elif i % 61 == 5:
                rows.append(json.dumps({"text": "x"}).encode())
            elif i % 97 == 11:
                rows.append(b'{"text": "caf\xe9 ' + str(i).encode() + b'"}')
            else:
                rows.append(json.dumps({"text": f"file {f} line {i}: " + "lorem ipsum " * (i % 13 + 1)}).encode())
        if bad_line is not None and f == 2:
            rows[bad_line] = b'{"text": "broken" '
        path.write_bytes(b"\n".join(rows) + b"\n")
        paths.append(path)
    return paths


def _config(paths: list[Path], cache: Path, **settings) -> DataConfig:
    return DataConfig(name=settings.pop("name", "jsonl"), paths=[str(p) for p in paths], field="text",
                      cache_dir=str(cache), val_percent=10.0, **settings)


def _entry_digests(cache: Path) -> dict[str, str]:
    """sha256 of every file of the one entry in `cache`."""
    entries = [p for p in cache.iterdir() if p.is_dir() and "." not in p.name and p.name != "hf"]
    assert len(entries) == 1, sorted(p.name for p in cache.iterdir())
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(entries[0].iterdir()) if f.is_file()}


def _build(cfg: DataConfig) -> dict:
    """On every rank: load through the team (collective), return what the rank saw and logged."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("ddptrain").addHandler(handler)
    logging.getLogger("ddptrain").setLevel(logging.INFO)
    started = time.monotonic()
    try:
        data = load_splits(cfg, SEQ_LEN, collective=True)
        outcome = {"documents": data.train.documents + data.val.documents}
    except DataError as error:
        outcome = {"error": str(error)}
    return {**outcome, "seconds": time.monotonic() - started, "log": records}


def test_the_plan_cuts_jsonl_at_line_starts_into_equal_byte_shares(tmp_path):
    paths = _corpus(tmp_path / "c")
    units = [Unit((str(p),), False, p.stat().st_size, True) for p in paths]
    total = sum(u.size for u in units)
    for count in (1, 2, 3, 4, 7):
        shards = plan_shards(units, count)
        sizes = []
        for shard in shards:
            size = 0
            for segment in shard:
                data = Path(segment.paths[0]).read_bytes()
                end = len(data) if segment.end is None else segment.end
                assert segment.start == 0 or data[segment.start - 1 : segment.start] == b"\n"
                size += end - segment.start
            sizes.append(size)
        assert sum(sizes) == total
        assert max(abs(s - total / count) for s in sizes) < 200, (count, sizes)  # within one line of 1/N


@pytest.mark.slow
@pytest.mark.parametrize("name", ["jsonl", "hf_tokenizer"])
def test_the_sharded_build_is_byte_identical_to_one_process_on_1_2_and_4_ranks(tmp_path, name):
    paths = _corpus(tmp_path / "c")
    settings = {}
    if name == "hf_tokenizer":  # a real BPE tokenizer.json (trained here): its thread pool is shared out
        tokenizers = import_optional("tokenizers")
        tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
        tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
        tokenizer.train_from_iterator([p.read_text(errors="replace") for p in paths],
                                      tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"]))
        tokenizer.save(str(tmp_path / "tokenizer.json"))
        settings["tokenizer"] = str(tmp_path / "tokenizer.json")
    one = load_splits(_config(paths, tmp_path / "one", **settings), SEQ_LEN, local_rank=0)
    expected = _entry_digests(tmp_path / "one")
    assert set(expected) == {"meta.json", "tokens.npy", "train.docs.npy", "val.docs.npy"}
    meta = json.loads((next((tmp_path / "one").iterdir()) / "meta.json").read_text())
    assert meta["replaced_documents"] and (meta["short_documents"] or name != "jsonl"), "the merged counts"
    for world_size in (1, 2, 4):
        cache = tmp_path / f"ranks{world_size}"
        results = run_distributed(_build, world_size, _config(paths, cache, **settings))
        assert [r["documents"] for r in results] == [one.train.documents + one.val.documents] * world_size
        assert _entry_digests(cache) == expected, world_size
        assert [p.name for p in cache.iterdir() if not p.name.startswith(".")] == [next(iter(
            (tmp_path / "one").iterdir())).name], "the same key; no piece or marker left behind"
        shares = [line for line in results[0]["log"] if line.startswith("data: shard ")]
        assert len(shares) == (world_size if world_size > 1 else 0), results[0]["log"]


@pytest.mark.slow
def test_a_failing_shard_stops_every_rank_with_its_name_and_a_damaged_piece_is_rebuilt(tmp_path):
    paths = _corpus(tmp_path / "c", bad_line=850)  # near the end of the largest file: the last shard's
    cfg = _config(paths, tmp_path / "cache")
    results = run_distributed(_build, 2, cfg, timeout_s=120)
    for rank, result in enumerate(results):
        assert "error" in result, result
        assert f"shard 1 ({paths[2]} bytes " in result["error"], (rank, result["error"])
        assert f"{paths[2]}:851: invalid JSON" in result["error"], (rank, result["error"])
        assert result["seconds"] < 60, "the ranks stopped on the marker, not on a timeout"
    pieces = [p for p in (tmp_path / "cache").iterdir() if ".pieces-" in p.name]
    assert len(pieces) == 1 and (pieces[0] / "0" / "done.json").is_file(), "rank 0 finished its piece"
    # A crash leaves the finished pieces for the next attempt; a damaged one must not be trusted.
    tokens = pieces[0] / "0" / "tokens.npy"
    data = bytearray(tokens.read_bytes())
    data[200:210] = b"\x07" * 10
    tokens.write_bytes(bytes(data))
    # The bad line fixed with the same size and mtime: the same cache key, so the pieces are looked at.
    stamp = paths[2].stat()
    fixed = paths[2].read_bytes().replace(b'{"text": "broken" ', b'{"text": "fixed!"}')
    paths[2].write_bytes(fixed)
    os.utime(paths[2], ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    results = run_distributed(_build, 2, cfg, timeout_s=120)
    assert all("error" not in r for r in results), results
    assert any("piece of shard 0" in line and "does not match its checksum" in line and "rebuilt" in line
               for line in results[0]["log"]), results[0]["log"]
    load_splits(_config(paths, tmp_path / "one"), SEQ_LEN, local_rank=0)
    assert _entry_digests(tmp_path / "cache") == _entry_digests(tmp_path / "one")
    assert not [p for p in (tmp_path / "cache").iterdir() if ".pieces-" in p.name or ".failed-" in p.name]


@pytest.mark.slow
def test_text_files_and_node_local_teams_share_the_build(tmp_path):
    """Text files are never cut (a file is a document, or its paragraphs are numbered from its start):
    whole files go to the shard of their middle byte. Without a process group (collective=False) the
    node's ranks (LOCAL_RANK / LOCAL_WORLD_SIZE) share the build."""
    root = tmp_path / "t"
    root.mkdir()
    paths = []
    for i in range(9):
        path = root / f"doc{i}.txt"
        path.write_text("\n\n".join(f"paragraph {j} of {i}: " + "words " * (i + j) for j in range(20 + 5 * i)))
        paths.append(path)
    cfg = _config(paths, tmp_path / "one", name="text", split_by="paragraph")
    load_splits(cfg, SEQ_LEN, local_rank=0)
    cfg.cache_dir = str(tmp_path / "two")
    run_distributed(_build_node_local, 3, cfg)
    assert _entry_digests(tmp_path / "two") == _entry_digests(tmp_path / "one")


def _build_node_local(cfg: DataConfig) -> int:
    return load_splits(cfg, SEQ_LEN).train.documents


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sft", "preference"])
def test_sharded_conversations_and_pairs_are_byte_identical_to_one_process(tmp_path, name):
    """data=sft and data=preference: whole examples with a target mask (mask.npy beside the tokens), skips
    counted per kind with their first example, pairs' two start columns moved by the merge."""
    from tests.data.chats import random_chats, save_chat_tokenizer, write_jsonl
    from tests.data.pairs import random_pairs

    tokenizer = save_chat_tokenizer(tmp_path / "tok")
    records = random_chats(160) if name == "sft" else random_pairs(160)
    paths = [Path(write_jsonl(tmp_path / f"r{k}.jsonl", part)) for k, part in
             enumerate((records[:100], records[100:110], records[110:]))]
    cfg = DataConfig(name=name, paths=[str(p) for p in paths], tokenizer=str(Path(tokenizer) / "tokenizer.json"),
                     cache_dir=str(tmp_path / "one"), val_percent=10.0, truncation="drop")
    load_splits(cfg, 40, local_rank=0)
    meta = json.loads((next((tmp_path / "one").iterdir()) / "meta.json").read_text())
    assert meta["skips"]["too_long"], "some records are dropped: the merged counts are exercised"
    cfg.cache_dir = str(tmp_path / "two")
    run_distributed(_build_at, 2, cfg, 40)
    assert _entry_digests(tmp_path / "two") == _entry_digests(tmp_path / "one")


def _build_at(cfg: DataConfig, seq_len: int) -> int:
    return len(load_splits(cfg, seq_len, collective=True).train)


@pytest.mark.slow
def test_a_hugging_face_dataset_goes_whole_to_one_shard(tmp_path):
    """data=hf numbers the rows of all its files together: the dataset is one unit, built by the rank
    whose shard holds its middle byte; the other rank's piece is empty, and the entry the same."""
    import_optional("datasets")
    paths = [tmp_path / f"rows{k}.jsonl" for k in range(2)]
    for k, path in enumerate(paths):  # datasets reads UTF-8 only
        path.write_text("".join(json.dumps({"text": f"file {k} row {i}: " + "words " * (i % 9)}) + "\n"
                                for i in range(300 * (k + 1))))
    cfg = _config(paths, tmp_path / "one", name="hf")
    load_splits(cfg, SEQ_LEN, local_rank=0)
    cfg.cache_dir = str(tmp_path / "two")
    run_distributed(_build, 2, cfg)
    assert _entry_digests(tmp_path / "two") == _entry_digests(tmp_path / "one")
