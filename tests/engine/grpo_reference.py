"""The exact GRPO that the update is checked against, and the material of its tests.

`exact_grpo_loss` is written from the formulas, not from ddptrain's code: a plain forward of ONE
completion at a time (prompt + completion, no padding, no packing, full logits), the completion's
token log-probs at the temperature, the clipped surrogate, the k3 KL, then each loss aggregation's
own formula over the whole batch of completions. `random_rollouts` makes prompts with a chat
template and random completions of varied lengths, some truncated.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from ddptrain.engine.grpo import GRPOSettings
from ddptrain.rl.rollout import Rollout, load_rollouts, save_rollouts
from tests.helpers import import_optional

MAX_NEW_TOKENS = 9
PROMPTS = 8
GROUP_SIZE = 3

VARIANTS = {  # name -> GRPOSettings besides the aggregation, for the tests of the update
    "on-policy": dict(temperature=0.7),
    "2 updates, KL, clip-higher (small: some tokens clip), masked truncation": dict(
        updates_per_rollout=2, beta=0.1, epsilon=0.02, epsilon_high=0.03, mask_truncated=True),
}
LR = {"token_mean": 0.5, "sequence_mean": 0.5, "constant": 2.0, "token_sum": 0.02}
"""SGD rates that move the weights without blowing them up (token_sum's loss is ~ tokens x larger)."""


@dataclass
class Material:
    """A step's rollouts, replayed from the file they were saved to, and what made them."""

    path: Path
    """The rollouts as save_rollouts wrote them."""
    rollouts: list[Rollout]
    prompts: int
    vocab_size: int
    max_new_tokens: int
    initial: dict
    """tiny_llama(vocab_size)'s weights: the policy before the update."""


def grpo_material(directory: Path, prompts: int = PROMPTS, group_size: int = GROUP_SIZE) -> Material:
    """Chat prompts (tests/data/chats.py's tokenizer and template), random completions, saved and replayed."""
    from tests.data.chats import save_chat_tokenizer

    transformers = import_optional("transformers")
    tokenizer_dir = save_chat_tokenizer(Path(directory) / "tokenizer")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    rollouts = random_rollouts(chat_prompts(tokenizer_dir, prompts), group_size, len(tokenizer),
                               tokenizer.eos_token_id)
    path = Path(directory) / "rollouts.jsonl"
    save_rollouts(rollouts, path)
    replayed = load_rollouts(path)
    assert replayed == rollouts
    return Material(path, replayed, prompts, len(tokenizer), MAX_NEW_TOKENS,
                    {k: v.clone() for k, v in tiny_llama(len(tokenizer)).state_dict().items()})


def relative_update_difference(after: dict, expected_after: dict, before: dict) -> float:
    """max over tensors of max|(after - before) - (expected_after - before)| / max|expected_after - before|:
    how far an update is from the expected one, relative to the update's size (not the weights')."""
    worst, scale = 0.0, 0.0
    for key, expected in expected_after.items():
        delta = expected - before[key]
        worst = max(worst, float((after[key].to(delta.dtype) - expected).abs().max()))
        scale = max(scale, float(delta.abs().max()))
    assert scale > 0, "the update moved the weights"
    return worst / scale


def tiny_llama(vocab_size: int, seed: int = 0, dtype: torch.dtype = torch.float64, plain: bool = False):
    """A tiny random Llama as model=hf builds it: packed rows taken, the head-loss protocol given
    (`plain`: transformers' model alone, the same weights, for TRL)."""
    transformers = import_optional("transformers")
    from ddptrain.models import hf

    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    if plain:
        return model.to(dtype)
    hf._prepare_for_training(model)
    hf.use_packed_attention(model, "gather")
    assert hf.give_head_loss(model)
    return model.to(dtype)


def chat_prompts(tokenizer_dir, count: int, seed: int = 0) -> list[tuple[int, ...]]:
    """`count` prompts: a random user turn through the tokenizer's chat template, generation prompt added."""
    transformers = import_optional("transformers")
    from tests.data.chats import sentence

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    rng = random.Random(seed)
    return [tuple(tokenizer.apply_chat_template([{"role": "user", "content": sentence(rng, 1, 6)}],
                                                add_generation_prompt=True, tokenize=True, return_dict=False))
            for _ in range(count)]


def random_rollouts(prompts: list[tuple[int, ...]], group_size: int, vocab_size: int, eos: int,
                    max_new_tokens: int = MAX_NEW_TOKENS, seed: int = 0) -> list[Rollout]:
    """group_size random completions per prompt: lengths 1 .. max_new_tokens, ended by `eos` unless they
    reach max_new_tokens (truncated); random rewards, advantages their group-centred, scaled values."""
    rng = random.Random(seed)
    tokens = [t for t in range(vocab_size) if t != eos]  # never the end token inside: a completion ends at its first
    rollouts = []
    for index, prompt in enumerate(prompts):
        rewards = [rng.random() for _ in range(group_size)]
        mean = sum(rewards) / group_size
        std = (sum((r - mean) ** 2 for r in rewards) / (group_size - 1)) ** 0.5
        for sample, reward in enumerate(rewards):
            length = rng.randint(1, max_new_tokens)
            truncated = length == max_new_tokens and rng.random() < 0.7
            completion = [rng.choice(tokens) for _ in range(length - (0 if truncated else 1))]
            completion += [] if truncated else [eos]
            rollouts.append(Rollout(index, sample, tuple(prompt), tuple(completion), truncated, reward,
                                    (reward - mean) / (std + 1e-4)))
    return rollouts


def completion_logps(model, rollout: Rollout, temperature: float) -> torch.Tensor:
    """(len(completion),) log-probs of the completion's tokens: one plain forward of prompt + completion."""
    ids = torch.tensor([rollout.prompt_ids + rollout.completion_ids])
    output = model(ids[:, :-1])
    logits = (output if isinstance(output, torch.Tensor) else output.logits)[0] / temperature  # (L - 1, V)
    first = len(rollout.prompt_ids) - 1  # the position whose next token is the completion's first
    return logits[first:].log_softmax(-1).gather(-1, ids[0, first + 1:, None]).squeeze(-1)


def exact_grpo_loss(model, rollouts: list[Rollout], settings: GRPOSettings, old: list | None = None,
                    reference_model=None) -> dict:
    """The GRPO loss of `rollouts` (one optimizer step's) under `settings`, with its graph: {"loss", "kl",
    "clip_ratio"}. old: per rollout, its rollout-time log-probs (None: the detached current ones)."""
    eps_low, eps_high = settings.epsilon, settings.clip_high
    per_completion = []  # (loss sum, kl sum, clipped count, tokens) of each counted completion
    for i, rollout in enumerate(rollouts):
        logps = completion_logps(model, rollout, settings.temperature)
        if settings.mask_truncated and rollout.truncated:
            per_completion.append(None)
            continue
        previous = logps.detach() if old is None else old[i]
        ratio = torch.exp(logps - previous)
        advantage = rollout.advantage
        loss = -torch.minimum(ratio * advantage, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * advantage)
        clipped = ((ratio < 1 - eps_low) & (advantage < 0)) | ((ratio > 1 + eps_high) & (advantage > 0))
        kl = torch.zeros_like(loss)
        if settings.beta > 0:
            with torch.no_grad():
                ref = completion_logps(reference_model, rollout, settings.temperature)
            kl = torch.exp(ref - logps) - (ref - logps) - 1
            loss = loss + settings.beta * kl
        per_completion.append((loss.sum(), kl.sum(), clipped.double().sum(), len(loss)))
    counted = [c for c in per_completion if c is not None]
    tokens = sum(c[3] for c in counted)
    aggregation = settings.loss_aggregation
    result = {}
    for key, at in (("loss", 0), ("kl", 1), ("clip_ratio", 2)):
        if aggregation == "token_mean":  # DAPO: every token of the step, one denominator
            value = sum(c[at] for c in counted) / tokens
        elif aggregation == "sequence_mean":  # GRPO: each completion's token mean, then their mean
            value = sum(c[at] / c[3] for c in counted) / len(counted)
        elif aggregation == "constant":  # Dr. GRPO: all completions x max_new_tokens
            value = sum(c[at] for c in counted) / (len(rollouts) * settings.max_new_tokens)
        else:
            value = sum(c[at] for c in counted)
        result[key] = value
    return result


def exact_update(model, rollouts: list[Rollout], settings: GRPOSettings, parts: list[list[Rollout]],
                 reference_model=None, lr: float = 1.0) -> tuple[list[dict], dict]:
    """One SGD(lr) step per part of the rollouts (old log-probs taken before the first), as floats, and
    the weights after them."""
    with torch.no_grad():
        old = {(r.prompt_index, r.sample): completion_logps(model, r, settings.temperature) for r in rollouts}
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    results = []
    for part in parts:
        values = exact_grpo_loss(model, part, settings, None if settings.updates_per_rollout == 1 else
                                 [old[(r.prompt_index, r.sample)] for r in part], reference_model)
        values["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
        results.append({key: float(value.detach()) if isinstance(value, torch.Tensor) else float(value)
                        for key, value in values.items()})
    return results, {k: v.detach().clone() for k, v in model.state_dict().items()}
