"""Tokenizers: byte-level (default, any bytes), or a local Hugging Face tokenizer.json (optional)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np


class ByteTokenizer:
    """Token ids 0..255 are the bytes of the UTF-8 text."""

    vocab_size = 256
    needs_text = False  # takes raw bytes: nothing to decode, nothing undecodable
    name = "byte"
    tokenizer_class = None  # one class only: data=sft's transformers tokenizer picks one (ChatTokenizer)

    def encode(self, data: bytes | str) -> np.ndarray:
        if isinstance(data, str):
            data = data.encode("utf-8")
        return np.frombuffer(data, dtype=np.uint8)

    def encode_batch(self, texts: list[bytes | str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def fingerprint(self) -> str:
        return "byte"

    def library_versions(self) -> dict:
        """The libraries that tokenize (none), by version: the cache key's, not the resume fingerprint's."""
        return {}


class HFTokenizer:
    """A `tokenizers` tokenizer.json from a local file (the optional extra `ddptrain[hf]`)."""

    needs_text = True
    tokenizer_class = None

    def __init__(self, path: str | Path):
        try:
            import tokenizers
            from tokenizers import Tokenizer
        except ImportError:
            raise ValueError("data.tokenizer=<tokenizer.json> needs the optional extra: "
                             "pip install 'ddptrain[hf]' (tokenizers)") from None
        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise ValueError(f"data.tokenizer: {self.path} is not a file (expected 'byte' or a tokenizer.json)")
        self._tokenizer = Tokenizer.from_file(str(self.path))
        # A tokenizer.json may carry the truncation or padding it was saved with: a document is
        # tokenized whole (the examples are cut to seq_len later) and never padded (pad ids would
        # become targets). transformers' tokenizers switch both off the same way.
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.name = str(self.path)
        self._version = tokenizers.__version__

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.int64)
                for e in self._tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self._tokenizer.decode([int(i) for i in ids])

    def fingerprint(self) -> str:
        return "hf:" + hashlib.sha256(self.path.read_bytes()).hexdigest()

    def library_versions(self) -> dict:
        """{"tokenizers": version}: another release may cut the same text differently."""
        return {"tokenizers": self._version}


def load_tokenizer(spec: str | None) -> ByteTokenizer | HFTokenizer:
    """`byte` (or None), or the path of a Hugging Face tokenizer.json."""
    return ByteTokenizer() if spec in (None, "byte") else HFTokenizer(spec)
