"""GRPO learns on a real model: SmolLM2-135M-Instruct (tests/real_model.py) on two-digit sums with
the exact_match reward, a task it solves sometimes. The held-out prompts' mean reward (greedy
decoding, before and after) rises within a few minutes of CPU (benchmarks/bench_grpo_learning.py
prints the curve)."""

from __future__ import annotations

import random

import pytest

from tests.data.chats import write_jsonl
from tests.helpers import import_optional, read_metrics, run_cli

torch = import_optional("torch")


def sum_prompts(count: int, seed: int) -> list[dict]:
    """Two-digit sums as chat prompts with their answers."""
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        records.append({"prompt": [{"role": "user", "content": f"What is {a} + {b}? Reply with the number only."}],
                        "answer": str(a + b)})
    return records


def held_out_reward(model, tokenizer_dir, records: list[dict], max_new_tokens: int = 8) -> float:
    """The mean exact_match reward of greedy completions of `records` (one continuous batch)."""
    from ddptrain.config.schema import RewardConfig
    from ddptrain.data.chat import ChatTokenizer
    from ddptrain.data.prompts import encode_prompt
    from ddptrain.generation.batch import generate_ids
    from ddptrain.generation.generator import SamplingParams
    from ddptrain.rl.rewards import Rewards

    chat = ChatTokenizer(str(tokenizer_dir / "tokenizer.json"))
    requests = [(encode_prompt("held-out", r["prompt"], chat), SamplingParams(max_tokens=max_new_tokens, temperature=0))
                for r in records]
    with torch.no_grad():
        done = generate_ids(model.eval(), chat.tokenizer.backend_tokenizer, chat.stop_ids(), requests)
    texts = [chat.tokenizer.decode(list(d.token_ids), skip_special_tokens=True) for d in done]
    scores = Rewards(RewardConfig(functions=["exact_match"])).score(
        [r["prompt"] for r in records], texts, [{"answer": r["answer"]} for r in records], ["held-out"] * len(records))
    return sum(scores.total) / len(records)


def grpo_learning_args(model_dir, prompts, run_dir, steps: int) -> list[str]:
    return ["model=hf", f"model.path={model_dir}", "model.lora.r=16", "data=prompts", "objective=grpo",
            f"data.paths=[{prompts}]", "reward.functions=[exact_match]", "rl.group_size=8", "rl.max_new_tokens=8",
            "rl.temperature=1.0", "batch.global_size=4", "batch.micro_size=4", "batch.seq_len=96",
            f"trainer.max_steps={steps}", "trainer.log_every=1", "optim.lr=2e-4", "optim.warmup_steps=0",
            "optim.schedule=constant", "logger.progress=lines", f"run.dir={run_dir}"]


@pytest.mark.slow
def test_grpo_raises_the_held_out_reward_of_the_real_model_on_sums(tmp_path):
    from tests.real_model import smollm2_dir

    import ddptrain

    model_dir = smollm2_dir()
    transformers = import_optional("transformers")
    prompts = write_jsonl(tmp_path / "sums.jsonl", sum_prompts(64, seed=0))
    held_out = sum_prompts(48, seed=1)
    before = held_out_reward(transformers.AutoModelForCausalLM.from_pretrained(model_dir), model_dir, held_out)
    run_dir = tmp_path / "run"
    result = run_cli(grpo_learning_args(model_dir, prompts, run_dir, steps=12), nproc=2, timeout=1200)
    assert result.returncode == 0, result.stderr[-4000:]
    after = held_out_reward(ddptrain.load_model(run_dir), model_dir, held_out)
    curve = [round(m["reward"], 3) for m in read_metrics(run_dir)]
    assert 0 < before < 1, before  # it solves the task sometimes
    assert after > before, (before, after, curve)
