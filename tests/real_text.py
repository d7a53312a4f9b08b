"""Real text for the slow tests and the benchmarks: WordNet 3.0's glosses as chats and
prompt-completion pairs ("What does 'X' mean?" -> the gloss), written once per machine into the
cache beside the real model's (tests/real_model.py).

WordNet comes from Debian's `wordnet-base` (/usr/share/wordnet/data.*: about 117k synsets); the
README's test command installs it with apt-get. Where it is missing the calling test is skipped
and says why. The pairs are a fixed sample (the seed and the count name the file), so two runs,
and the benchmark's contenders, read the same records."""

from __future__ import annotations

import json
import os
import random
import re
import tempfile
from pathlib import Path

import pytest

from tests.real_model import cache_root

WORDNET = Path("/usr/share/wordnet")
PARTS_OF_SPEECH = ("noun", "verb", "adj", "adv")


def wordnet_glosses() -> list[tuple[str, str]]:
    """(word, gloss) of every synset's first lemma, the gloss without its example sentences, in
    file order. Skips the calling test when WordNet is not installed."""
    files = [WORDNET / f"data.{part}" for part in PARTS_OF_SPEECH]
    if not all(path.is_file() for path in files):
        pytest.skip(f"WordNet is not installed ({WORDNET}/data.*): apt-get install -y wordnet-base")
    glosses = []
    for path in files:
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("  "):  # the license header
                continue
            fields, _, gloss = line.partition(" | ")
            word = re.sub(r"\(.*\)$", "", fields.split(" ")[4]).replace("_", " ")  # adj markers: able(a)
            definition = gloss.split('; "')[0].strip().rstrip(";").strip()
            if word and definition:
                glosses.append((word, definition))
    return glosses


def question(word: str) -> str:
    return f"What does '{word}' mean?"


def wordnet_records(count: int, seed: int = 0, style: str = "prompt_completion") -> Path:
    """A JSONL file of `count` records sampled with `seed`: {"prompt", "completion"} pairs, or
    {"messages": [user, assistant]} chats with `style="messages"`; built once into the cache."""
    if style not in ("prompt_completion", "messages"):
        raise ValueError(f"style={style!r} is not prompt_completion or messages")
    target = cache_root() / f"wordnet-{style}-{count}-seed{seed}.jsonl"
    if target.is_file():
        return target
    glosses = wordnet_glosses()
    picked = random.Random(seed).sample(glosses, count)
    if style == "messages":
        records = [{"messages": [{"role": "user", "content": question(word)},
                                 {"role": "assistant", "content": gloss}]} for word, gloss in picked]
    else:
        records = [{"prompt": question(word), "completion": gloss} for word, gloss in picked]
    target.parent.mkdir(parents=True, exist_ok=True)
    # Written beside and renamed into place: a reader never sees half a file (pytest-xdist workers).
    handle, staging = tempfile.mkstemp(prefix=f".{target.name}-", dir=target.parent)
    with os.fdopen(handle, "w", encoding="utf-8") as out:
        out.writelines(json.dumps(record) + "\n" for record in records)
    os.chmod(staging, 0o644)
    os.replace(staging, target)
    return target
