"""Preference pairs for the data=preference and DPO tests: random prompts and completions of very
different lengths (1 to 30 words), standard (strings) or conversational (lists of messages)."""

from __future__ import annotations

import random

from tests.data.chats import sentence


def random_pairs(count: int, seed: int = 0, conversational: bool = False) -> list[dict]:
    rng = random.Random(seed)
    pairs = []
    for _ in range(count):
        prompt = sentence(rng, 1, 12)
        chosen, rejected = (sentence(rng, 1, 1 if rng.random() < 0.3 else 30) for _ in range(2))
        if conversational:
            pairs.append({"prompt": [{"role": "user", "content": prompt}],
                          "chosen": [{"role": "assistant", "content": chosen}],
                          "rejected": [{"role": "assistant", "content": rejected}]})
        else:
            pairs.append({"prompt": prompt, "chosen": " " + chosen, "rejected": " " + rejected})
    return pairs
