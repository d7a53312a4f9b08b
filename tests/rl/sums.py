"""Two-digit sums: a verifiable task that SmolLM2-135M-Instruct solves sometimes (its greedy answers
are right about one time in eight), for the GRPO learning benchmark, the README's GRPO run and the
GPU check."""

from __future__ import annotations

import random


def sum_prompts(count: int, seed: int) -> list[dict]:
    """Two-digit sums as chat prompts with their answers (exact_match's `answer` field)."""
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        records.append({"prompt": [{"role": "user", "content": f"What is {a} + {b}? Reply with the number only."}],
                        "answer": str(a + b)})
    return records


def held_out_reward(model, tokenizer_file: str, records: list[dict], max_new_tokens: int = 16) -> float:
    """The mean exact_match reward of greedy completions of `records`, generated together (one
    continuous batch) by `model` as it is."""
    import torch

    from ddptrain.config.schema import RewardConfig
    from ddptrain.data.chat import ChatTokenizer
    from ddptrain.data.prompts import encode_prompt
    from ddptrain.generation.batch import generate_ids
    from ddptrain.generation.generator import SamplingParams
    from ddptrain.rl.rewards import Rewards

    chat = ChatTokenizer(tokenizer_file)
    greedy = SamplingParams(max_tokens=max_new_tokens, temperature=0)
    requests = [(encode_prompt("held-out", record["prompt"], chat), greedy) for record in records]
    with torch.no_grad():
        done = generate_ids(model.eval(), chat.tokenizer.backend_tokenizer, chat.stop_ids(), requests)
    texts = [chat.tokenizer.decode(list(d.token_ids), skip_special_tokens=True) for d in done]
    scores = Rewards(RewardConfig(functions=["exact_match"])).score(
        [r["prompt"] for r in records], texts, [{"answer": r["answer"]} for r in records], ["held-out"] * len(records))
    return sum(scores.total) / len(records)
