"""Byte-level tokenizer: every byte is a token, so any text (and any file) tokenizes offline."""

from __future__ import annotations

import numpy as np


class ByteTokenizer:
    """Token ids 0..255 are the bytes of the UTF-8 text."""

    vocab_size = 256

    def encode(self, data: bytes | str) -> np.ndarray:
        if isinstance(data, str):
            data = data.encode("utf-8")
        return np.frombuffer(data, dtype=np.uint8)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")
