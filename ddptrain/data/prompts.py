"""data=prompts: the prompts of objective=grpo, and which of them each step and rank takes.

A record holds a `prompt` (data.prompt_field): a string, tokenized as it is (the tokenizer's own
special tokens, e.g. BOS, included, as TRL does for standard prompts), or a list of messages,
rendered with the chat template and its generation prompt. Its other fields are kept as they are
and given to the reward functions by name (an answer to compare with, a test to run). Prompts are
few and small next to a pretraining corpus: they are read into memory at start-up, not cached.

The global batch of step t is batch.global_size prompts of the same plan as any other data
(ddptrain/data/global_batch.py): (seed, t, prompts, global size) only. Rank r takes a contiguous
share of whole prompts, and generates every completion of each (a group never spans ranks).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ddptrain.data.cache import default_cache_dir
from ddptrain.data.chat import ChatTokenizer
from ddptrain.data.global_batch import GlobalBatchPlan
from ddptrain.data.sft import _messages, records
from ddptrain.data.sources import DataError, TextDecoder, expand_paths


@dataclass(frozen=True)
class Prompt:
    """One prompt record, tokenized."""

    name: str
    """Where it comes from: file:line, or dataset#row."""
    prompt: Any
    """The record's prompt as it is (a string or a list of messages): what reward functions receive."""
    ids: tuple[int, ...]
    """Its token ids as the policy sees them (chat template and generation prompt applied)."""
    fields: dict = field(default_factory=dict)
    """The record's other fields, passed to the reward functions by name."""

    @property
    def is_conversational(self) -> bool:
        return isinstance(self.prompt, list)


@dataclass
class PromptSet:
    """Every training prompt, in file order."""

    prompts: list[Prompt]
    tokenizer: ChatTokenizer
    fingerprint: dict

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, index: int) -> Prompt:
        return self.prompts[index]

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size


def load_prompts(data_cfg: Any, seq_len: int, max_new_tokens: int) -> PromptSet:
    """The prompts of data.paths; a prompt of more than seq_len - max_new_tokens tokens (no room left
    for its completion) is a DataError naming it, as is a record without a prompt."""
    tokenizer = ChatTokenizer(data_cfg.tokenizer, data_cfg.chat_template)
    files = expand_paths(list(data_cfg.paths), allow_dirs=True)
    cache_dir = Path(os.path.expanduser(data_cfg.cache_dir)) if data_cfg.cache_dir else default_cache_dir()
    longest = seq_len - max_new_tokens
    prompts, digest = [], hashlib.sha256(tokenizer.fingerprint().encode())
    for name, record, _ in records(files, "train", cache_dir / "hf", TextDecoder(data_cfg.on_decode_error)):
        key = data_cfg.prompt_field
        if key not in record:
            raise DataError(f"{name}: no field {key!r} (data.prompt_field); the record has {sorted(record)}")
        prompt = record[key]
        ids = encode_prompt(name, prompt, tokenizer)
        if len(ids) > longest:
            raise DataError(f"{name}: the prompt is {len(ids)} tokens, longer than batch.seq_len={seq_len} - "
                            f"rl.max_new_tokens={max_new_tokens} = {longest} leaves for it: raise batch.seq_len, "
                            "lower rl.max_new_tokens, or shorten the prompt")
        fields = {k: v for k, v in record.items() if k != key}
        prompts.append(Prompt(name, prompt, tuple(ids), fields))
        digest.update(json.dumps([ids, fields], sort_keys=True, default=str).encode())
    if not prompts:
        raise DataError(f"data.paths {[str(f) for f in files]} hold no prompt record")
    return PromptSet(prompts, tokenizer, {"prompts": len(prompts), "sha256": digest.hexdigest()})


def encode_prompt(name: str, prompt: Any, tokenizer: ChatTokenizer) -> list[int]:
    """A record's prompt as the policy sees it: a string tokenized as it is, messages rendered with the
    chat template and its generation prompt."""
    if isinstance(prompt, str):
        if not prompt:
            raise DataError(f"{name}: the prompt is empty: the policy needs at least one token to continue")
        return list(tokenizer.tokenizer(prompt)["input_ids"])
    if isinstance(prompt, list):
        messages = _messages(name, prompt, "the prompt", tokenizer)
        if tokenizer.template is None:
            raise DataError(f"{name}: the prompt is a list of messages, but the tokenizer {tokenizer.path} has no chat "
                            "template to render it; give data.chat_template=PATH")
        text = tokenizer._apply(name, messages, add_generation_prompt=True)
        return tokenizer.encode(text)
    raise DataError(f"{name}: the prompt is {type(prompt).__name__}: a string or a list of messages is expected")


class PromptBatches:
    """This rank's prompts of every step: a contiguous share of the step's global batch of prompts."""

    def __init__(self, prompts: PromptSet, global_batch_size: int, seed: int, rank: int, world_size: int):
        self.examples = prompts
        self.plan = GlobalBatchPlan(len(prompts), global_batch_size, seed)
        self.rank, self.world_size = rank, world_size

    def rank_prompts(self, step: int, rank: int) -> list[tuple[int, Prompt]]:
        """(index in the step's global batch, prompt) of `rank`'s share of step `step`."""
        ids = self.plan.global_batch(step)
        per_rank = len(ids) // self.world_size
        return [(int(i), self.examples[int(ids[i])]) for i in range(rank * per_rank, (rank + 1) * per_rank)]

    def microbatches(self, step: int) -> list[tuple[int, Prompt]]:
        """This rank's prompts of `step` (what the loop's prefetcher hands the step)."""
        return self.rank_prompts(step, self.rank)

    def state_dict(self, step: int) -> dict:
        return self.plan.state_dict(step)  # the cursor, with the order its epochs are drawn in

    def load_state_dict(self, state: dict, step: int, requested_order: str = "auto") -> None:
        """Continue from a checkpoint's cursor at `step`, in the order it records."""
        self.plan.load_state_dict(state, step)

    def prompt_ids(self, step: int) -> np.ndarray:
        """The dataset index of every prompt of the step's global batch."""
        return self.plan.global_batch(step)
