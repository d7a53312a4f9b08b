"""The real-text fixture (tests/real_text.py): WordNet glosses as SFT records, sampled once and cached."""

from __future__ import annotations

import json

from tests.real_text import question, wordnet_glosses, wordnet_records


def test_wordnet_gives_each_synsets_first_lemma_and_its_gloss_without_examples():
    glosses = wordnet_glosses()
    assert len(glosses) > 100_000
    assert glosses[0] == ("entity", "that which is perceived or known or inferred to have its own distinct existence "
                                    "(living or nonliving)")
    assert ("able", "(usually followed by `to') having the necessary means or skill or know-how or authority to do "
                    "something") in glosses  # data.adj's `able(a)`, without its examples
    assert not any('; "' in gloss for _, gloss in glosses)


def test_records_are_a_fixed_sample_in_either_sft_format(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    pairs = [json.loads(line) for line in wordnet_records(20, seed=3).read_text().splitlines()]
    chats = [json.loads(line) for line in wordnet_records(20, seed=3, style="messages").read_text().splitlines()]
    assert len(pairs) == len(chats) == 20
    for pair, chat in zip(pairs, chats):
        user, assistant = chat["messages"]
        assert pair["prompt"] == user["content"] and pair["completion"] == assistant["content"]
        assert pair["prompt"].startswith("What does '") and pair["completion"]
    assert wordnet_records(20, seed=3).read_text() == wordnet_records(20, seed=3).read_text()
    assert question("dog") == "What does 'dog' mean?"
