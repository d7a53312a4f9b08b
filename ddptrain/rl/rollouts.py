"""A step's rollouts: this rank's prompts -> rl.group_size seeded completions each, from the live policy.

Completion `sample` of the prompt at position `prompt_index` of step t's global batch is sampled
by its own generator, seeded from (run.seed, t, prompt_index, sample) alone. The generator
(ddptrain/generation/) draws each request's tokens with that request's own torch.Generator, so a
completion does not depend on the rank that generates it, nor on the requests beside it in the
continuous batch; only on the policy's weights, which every rank holds the same. A resumed run
generates the same completions for the same step.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from ddptrain.data.prompts import Prompt
from ddptrain.generation.batch import Generated, generate_ids
from ddptrain.generation.generator import MAX_SEED, SamplingParams


def rollout_seed(run_seed: int, step: int, prompt_index: int, sample: int) -> int:
    """The sampling seed of one completion: a hash of the four numbers (no two collide in practice,
    and neighbouring steps or prompts draw unrelated streams)."""
    digest = hashlib.sha256(f"ddptrain-rollout:{run_seed}:{step}:{prompt_index}:{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & MAX_SEED


@dataclass(frozen=True)
class Sampling:
    """rl.* as generation reads it."""

    group_size: int
    max_new_tokens: int
    temperature: float
    top_p: float
    stop: tuple[str, ...]


@dataclass(frozen=True)
class Completion:
    """One generated completion of one prompt, before it is scored."""

    prompt_index: int
    sample: int
    prompt: Prompt
    generated: Generated


def generate_completions(policy: torch.nn.Module, tokenizer, eos_token_ids, prompts: list[tuple[int, Prompt]],
                         sampling: Sampling, run_seed: int, step: int, max_active: int = 32) -> list[Completion]:
    """Every completion of this rank's prompts (whole groups, prompt after prompt, samples in order),
    generated together in one continuous batch with the policy in eval mode and without gradients."""
    requests, keys = [], []
    for prompt_index, prompt in prompts:
        for sample in range(sampling.group_size):
            params = SamplingParams(max_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                                    top_p=sampling.top_p, stop=sampling.stop,
                                    seed=rollout_seed(run_seed, step, prompt_index, sample))
            requests.append((list(prompt.ids), params))
            keys.append((prompt_index, sample, prompt))
    was_training = policy.training
    policy.eval()  # no dropout in the rollouts
    try:
        with torch.no_grad():
            generated = generate_ids(policy, tokenizer, eos_token_ids, requests, max_active=max_active)
    finally:
        policy.train(was_training)
    return [Completion(index, sample, prompt, out) for (index, sample, prompt), out in zip(keys, generated)]
