"""Cache entries verify themselves: meta.json holds a checksum of every array, checked on load; a
damaged entry (same size but other bytes, or truncated) is rebuilt with a warning naming it, never
used."""

from __future__ import annotations

import time

import numpy as np

from ddptrain.data import cache


def _build(tmp):
    np.save(tmp / "tokens.npy", np.arange(1000, dtype=np.uint16))
    return {"tokens": 1000}


def test_a_damaged_cache_entry_is_rebuilt_with_a_warning_naming_it(tmp_path, caplog):
    entry, meta, built = cache.build_or_wait(tmp_path, "key", _build, is_builder=True)
    assert built and "tokens.npy" in meta["checksums"]
    tokens = entry / "tokens.npy"
    data = bytearray(tokens.read_bytes())
    data[-10:] = b"\xff" * 10  # same size, other tokens
    tokens.write_bytes(bytes(data))
    with caplog.at_level("WARNING", logger="ddptrain"):
        _, _, built = cache.build_or_wait(tmp_path, "key", _build, is_builder=True)
    assert built and "tokens.npy does not match its checksum" in caplog.text and str(entry) in caplog.text
    assert (np.load(tokens) == np.arange(1000)).all()
    tokens.write_bytes(tokens.read_bytes()[:500])  # truncated: "mmap length is greater than file size" before
    caplog.clear()
    with caplog.at_level("WARNING", logger="ddptrain"):
        _, _, built = cache.build_or_wait(tmp_path, "key", _build, is_builder=True)
    assert built and "tokens.npy is 500 bytes (2128 when it was built)" in caplog.text
    _, _, built = cache.build_or_wait(tmp_path, "key", _build, is_builder=True)
    assert not built, "an entry that verifies is reused"


def test_large_arrays_are_hashed_by_sampled_blocks_and_the_check_is_cheap(tmp_path, monkeypatch):
    path = tmp_path / "big.npy"
    path.write_bytes(np.random.default_rng(0).integers(0, 255, 8 << 20, dtype=np.uint8).tobytes())
    started = time.perf_counter()
    full = cache.array_digest(path)
    full_s = time.perf_counter() - started
    monkeypatch.setattr(cache, "FULL_HASH_BYTES", 1 << 20)
    started = time.perf_counter()
    sampled = cache.array_digest(path)
    sampled_s = time.perf_counter() - started
    assert full != sampled and sampled.startswith(f"{8 << 20}:")
    print(f"8 MiB: full hash {1e3 * full_s:.1f} ms, {cache.SAMPLED_BLOCKS} sampled blocks {1e3 * sampled_s:.1f} ms")
