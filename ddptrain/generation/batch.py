"""Many prompts generated at once, synchronously, as token ids: the RL rollouts' entry point.

The requests share one continuous batch (the server's decoding loop), each sampled by its own
seeded generator, so a request's tokens do not depend on the others beside it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch

from ddptrain.generation.generator import Generator, SamplingParams


KV_CACHE_MB = 256.0
"""The paged KV cache's bound for a batch of rollouts (MiB); the memory plan's rollout line says it."""


@dataclass(frozen=True)
class Generated:
    """One request's continuation."""

    token_ids: tuple[int, ...]
    """The generated ids, the end-of-sequence token (or the one completing a stop string) included."""
    truncated: bool
    """True when max_tokens ended it, without an end-of-sequence token or stop string."""


def generate_ids(model: torch.nn.Module, tokenizer, eos_token_ids, requests: list[tuple[list[int], SamplingParams]],
                 *, max_active: int = 32, kv_cache_mb: float = KV_CACHE_MB) -> list[Generated]:
    """Continue every (prompt ids, params) of `requests` with `model` as it is now, in their order."""
    if not requests:
        return []
    generator = Generator(model, tokenizer=tokenizer, eos_token_ids=eos_token_ids, max_active=max_active,
                          max_queue=len(requests), kv_cache_mb=kv_cache_mb)
    return asyncio.run(_generate(generator, requests))


async def _generate(generator: Generator, requests) -> list[Generated]:
    generator.start()
    try:
        # stream=False: the manager reports a request once, when done (unless stop strings are watched)
        completions = [generator.submit(list(ids), params, stream=False) for ids, params in requests]
        results = await asyncio.gather(*(completion.token_ids() for completion in completions))
    finally:
        generator.close()
    return [Generated(tuple(tokens), truncated) for tokens, truncated in results]
