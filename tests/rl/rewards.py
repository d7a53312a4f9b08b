"""Reward functions for the GRPO tests, named by `reward.functions=[tests.rl.rewards:NAME]`."""

from __future__ import annotations

import math


def _text(completion) -> str:
    return completion[0]["content"] if isinstance(completion, list) else completion


def word_count(prompts, completions, **fields) -> list[float]:
    """A reward that differs between a tiny random model's completions: their words / 4."""
    return [len(_text(c).split()) / 4 for c in completions]


def likes_the(prompts, completions, **fields) -> list[float | None]:
    """1 per 'the' in the completion; None (does not apply) for prompts whose `kind` is 'skip'."""
    return [None if kind == "skip" else float(_text(c).split().count("the"))
            for c, kind in zip(completions, fields["kind"])]


def raises(prompts, completions, **fields):
    raise ValueError("no score for you")


def wrong_length(prompts, completions, **fields):
    return [0.0] * (len(completions) - 1)


def nan_on_first_step(prompts, completions, **fields):
    """NaN for every completion of a prompt whose id is 0 (the first step's batch holds it), else word_count."""
    return [math.nan if pid == 0 else len(_text(c).split()) / 4 for c, pid in zip(completions, fields["pid"])]
