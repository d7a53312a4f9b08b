"""A rollout: one sampled completion of one prompt, with its reward and group-relative advantage."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Rollout:
    """One completion of one prompt of a step; a group is the rollouts sharing `prompt_index`."""

    prompt_index: int
    """The prompt's position in the step's global batch of prompts (0 .. batch.global_size - 1)."""
    sample: int
    """The completion's number within its group (0 .. rl.group_size - 1)."""
    prompt_ids: tuple[int, ...]
    """The prompt's token ids, as the policy saw them (chat template applied)."""
    completion_ids: tuple[int, ...]
    """The generated token ids, the end-of-sequence / stop token included when one ended it."""
    truncated: bool
    """True when generation stopped at rl.max_new_tokens without an end."""
    reward: float
    """The weighted total reward (NaN never reaches here: such a step is skipped)."""
    advantage: float
    """The group-relative advantage of this completion (rl.scale_rewards applied)."""


def save_rollouts(rollouts: list[Rollout], path: str | Path) -> None:
    """Write rollouts as JSON lines (the replay format of the exactness tests)."""
    with open(path, "w", encoding="utf-8") as f:
        for rollout in rollouts:
            f.write(json.dumps(asdict(rollout)) + "\n")


def load_rollouts(path: str | Path) -> list[Rollout]:
    """Read rollouts written by `save_rollouts`, in their order."""
    rollouts = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                record["prompt_ids"] = tuple(record["prompt_ids"])
                record["completion_ids"] = tuple(record["completion_ids"])
                rollouts.append(Rollout(**record))
    return rollouts
