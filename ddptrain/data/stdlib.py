"""The default data: the running interpreter's standard-library sources, tokenized in memory (no cache)."""

from __future__ import annotations

from ddptrain.data.dataset import DataSplits, TokenExamples
from ddptrain.data.sources import TextDecoder, is_validation, stdlib_documents, warn_replaced
from ddptrain.data.tokenizer import ByteTokenizer


def load_stdlib(seq_len: int, val_percent: float, max_docs: int | None = None, tokenizer=None) -> DataSplits:
    """Standard-library sources as byte tokens (or `tokenizer`), split by a hash of the file name."""
    tokenizer = tokenizer or ByteTokenizer()
    decoder = TextDecoder("replace")
    train_docs, val_docs = [], []
    for name, data in stdlib_documents(max_docs):
        if tokenizer.needs_text:
            data = decoder.decode(name, data)
        (val_docs if is_validation(name, val_percent) else train_docs).append(tokenizer.encode(data))
    warn_replaced(decoder.replaced_documents, decoder.replaced_example)
    if not val_docs:  # tiny corpora (max_docs) still get a validation set
        val_docs.append(train_docs.pop())
    train = TokenExamples.from_documents(train_docs, seq_len)
    inputs = {"source": "stdlib", "tokenizer": tokenizer.fingerprint(), "documents": len(train_docs),
              "tokens": sum(len(doc) for doc in train_docs),  # Python's own sources: another Python, another corpus
              "targets": train.valid_targets()}
    return DataSplits(train, TokenExamples.from_documents(val_docs, seq_len), tokenizer.vocab_size, inputs)
