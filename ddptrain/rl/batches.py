"""A rank's rollouts -> the microbatches of a GRPO update: rows of prompt + completion, targets on the
completion tokens only, each completion's advantage beside them.

Every completion is one sequence: its prompt and completion tokens, the inputs all but the last
token, the targets the next tokens, -100 on the prompt's (a target that is a prompt token), on
padding, and on a truncated completion's tokens when mask_truncated. A microbatch holds whole groups
(a prompt with all its completions), in prompt order:

- micro_size: `micro_size` prompts (each with its group) per microbatch, one row per completion,
  padded at the end to the longest;
- micro_tokens: groups in prompt order while (rows x longest row) stays within micro_tokens padded
  positions (a group alone over the budget is a microbatch of its own);
- pack: the microbatch's completions (groups as above; under micro_tokens, while the sum of their
  positions stays within the budget) packed whole into rows of at most seq_len positions
  (best-fit decreasing, ddptrain/data/packing.py), each a document of its own: its own positions
  and attention segment.

Which microbatch or rank computes a completion changes only the order of float additions: the GRPO
objective (ddptrain/engine/grpo.py) divides by counts of the whole step.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby

import numpy as np
import torch

from ddptrain.contract.targets import IGNORE_INDEX
from ddptrain.data.global_batch import split_micro
from ddptrain.data.packing import lay_out_rows, pack_into_rows, packed_batch
from ddptrain.engine.grpo import CompletionTargets
from ddptrain.rl.rollout import Rollout


@dataclass(frozen=True)
class RolloutLayout:
    """How a rank cuts its rollouts into microbatches. From a TrainConfig `cfg` (objective=grpo):

        RolloutLayout(prompts=cfg.batch.global_size, micro_size=cfg.batch.micro_size,
                      micro_tokens=cfg.batch.micro_tokens, pack=bool(cfg.batch.pack), seq_len=cfg.batch.seq_len)
    """

    prompts: int
    """batch.global_size: the step's prompts over all ranks (prompt_index runs over 0 .. prompts - 1)."""
    micro_size: int = 1
    """batch.micro_size: prompts per microbatch, each with its whole group."""
    micro_tokens: int | None = None
    """batch.micro_tokens: instead of micro_size, at most this many padded positions per microbatch."""
    pack: bool = False
    """batch.pack: completions packed whole into rows of at most seq_len positions."""
    seq_len: int = 256
    """batch.seq_len: a packed row's positions (prompt + completion - 1 of the longest must fit)."""

    def __post_init__(self):
        for name in ("prompts", "micro_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)!r} must be >= 1")
        if self.micro_tokens is not None and self.micro_tokens < 1:
            raise ValueError(f"micro_tokens {self.micro_tokens!r} must be >= 1 (or None)")


def split_parts(rollouts: list[Rollout], prompts: int, parts: int) -> list[list[Rollout]]:
    """The rollouts of each of `parts` updates: part k holds the prompts i with i x parts // prompts == k
    (prompts in order, nearly equal parts of whole groups), so a part is the same set of completions
    on any world size. Each part's rollouts stay in their order."""
    if parts > prompts:
        raise ValueError(f"updates_per_rollout {parts} must be <= the step's prompts ({prompts}): each update "
                         "needs its own prompts")
    split: list[list[Rollout]] = [[] for _ in range(parts)]
    for rollout in rollouts:
        if not 0 <= rollout.prompt_index < prompts:
            raise ValueError(f"prompt_index {rollout.prompt_index} is outside the step's {prompts} prompts")
        split[rollout.prompt_index * parts // prompts].append(rollout)
    return split


class _Sequences:
    """Rollouts as the documents that data/packing.py's lay_out_rows reads (tokens, starts, lengths, targets)."""

    def __init__(self, rollouts: list[Rollout], mask_truncated: bool):
        pieces = [np.asarray(r.prompt_ids + r.completion_ids, dtype=np.int64) for r in rollouts]
        self.lengths = np.asarray([len(piece) for piece in pieces], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64)
        self.tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
        self.counted = np.asarray([0 if mask_truncated and r.truncated else len(r.completion_ids)
                                   for r in rollouts], dtype=np.int64)
        self.prompt_lengths = np.asarray([len(r.prompt_ids) for r in rollouts], dtype=np.int64)
        self.index = {int(start): i for i, start in enumerate(self.starts)}
        self.advantages = np.asarray([r.advantage for r in rollouts], dtype=np.float64)

    def example_targets_of(self, start: int, length: int, piece: np.ndarray) -> np.ndarray:
        """(length - 1,) targets: the next tokens where they are counted completion tokens, else -100."""
        i = self.index[start]
        targets = np.full(length - 1, IGNORE_INDEX, dtype=np.int64)
        if self.counted[i]:
            first = self.prompt_lengths[i] - 1  # the position whose target is the first completion token
            targets[first:] = piece[first + 1 :]
        return targets


def rollout_microbatches(rollouts: list[Rollout], layout: RolloutLayout,
                         mask_truncated: bool = False) -> list[tuple]:
    """This rank's microbatches (inputs, CompletionTargets) of `rollouts` (whole groups, any order)."""
    rollouts = sorted(rollouts, key=lambda r: (r.prompt_index, r.sample))
    groups = [list(group) for _, group in groupby(rollouts, key=lambda r: r.prompt_index)]
    sequences = _Sequences(rollouts, mask_truncated)
    positions = sequences.lengths - 1
    ids = np.arange(len(rollouts), dtype=np.int64)
    group_ids, at = [], 0
    for group in groups:
        group_ids.append(ids[at : at + len(group)])
        at += len(group)
    microbatches = []
    for members in _cut(group_ids, positions, layout):
        if layout.pack:
            rows = pack_into_rows(members, positions[members], layout.seq_len)
            microbatches.append(_collate(sequences, rows, packed=True))
        else:
            microbatches.append(_collate(sequences, [np.asarray([i]) for i in members], packed=False))
    return microbatches


def _cut(group_ids: list[np.ndarray], positions: np.ndarray, layout: RolloutLayout) -> list[np.ndarray]:
    """The completion ids of each microbatch: whole groups in order, micro_size prompts or a token budget."""
    if layout.micro_tokens is None:
        return [np.concatenate([group_ids[g] for g in chunk])
                for chunk in split_micro(np.arange(len(group_ids)), layout.micro_size)]
    cost = (lambda ids: int(positions[ids].sum())) if layout.pack else \
        (lambda ids: len(ids) * int(positions[ids].max()))  # packed: positions; else padded rows x longest
    micro: list[np.ndarray] = []
    for ids in group_ids:
        if micro and cost(np.concatenate([micro[-1], ids])) <= layout.micro_tokens:
            micro[-1] = np.concatenate([micro[-1], ids])
        else:
            micro.append(ids)
    return micro


def _collate(sequences: _Sequences, rows: list[np.ndarray], packed: bool) -> tuple:
    """(inputs, CompletionTargets) of rows of completions; completions numbered in row order."""
    width = max(int((sequences.lengths[row] - 1).sum()) for row in rows)
    inputs, targets, positions, segments = lay_out_rows(sequences, rows, width)
    order = np.concatenate(rows)
    first = np.cumsum([0] + [len(row) for row in rows[:-1]])  # the first completion number of each row
    completion = np.where(targets != IGNORE_INDEX, first[:, None] + segments, -1)
    completion_targets = CompletionTargets(
        torch.from_numpy(targets), torch.from_numpy(completion),
        torch.from_numpy(sequences.advantages[order].copy()),
        torch.from_numpy(sequences.counted[order].astype(np.float64)))
    return (packed_batch(inputs, positions, segments) if packed else torch.from_numpy(inputs)), completion_targets
