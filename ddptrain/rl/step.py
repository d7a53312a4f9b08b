"""One GRPO step: generate -> score -> advantages -> the update (ddptrain/rl/update.py).

    generate    this rank's prompts of the step, rl.group_size seeded completions each, from the
                policy as it is now (the adapter on for LoRA; a gathered full copy for fsdp and zero3)
    score       reward.functions on the decoded completions, weighted; one collective says whether
                any rank failed (then every rank raises, naming the function and the prompt) or
                saw a NaN reward (then every rank skips the step, counted in nan_reward_steps)
    advantages  group-relative, rl.scale_rewards (ddptrain/rl/advantages.py)
    update      train_on_rollouts: rl.updates_per_rollout exact optimizer steps

The step's metrics (reward, reward/<function>, completion lengths, truncation, the time of each
phase, rollout tokens/s) are global: summed over the ranks in one all-reduce.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ddptrain.config.schema import TrainConfig
from ddptrain.data.prompts import Prompt
from ddptrain.distributed import first_failure
from ddptrain.engine.grpo import GRPOSettings
from ddptrain.engine.stats import StepStats
from ddptrain.rl.advantages import all_reduce_host, group_advantages
from ddptrain.rl.batches import RolloutLayout
from ddptrain.rl.rewards import RewardError, Rewards
from ddptrain.rl.rollout import Rollout
from ddptrain.rl.rollouts import Completion, Sampling, generate_completions
from ddptrain.rl.update import train_on_rollouts

log = logging.getLogger(__name__)


def grpo_settings(cfg: TrainConfig) -> GRPOSettings:
    """rl.* as the update reads it."""
    rl = cfg.rl
    return GRPOSettings(loss_aggregation=rl.loss_aggregation, epsilon=rl.epsilon, epsilon_high=rl.epsilon_high,
                        beta=rl.beta, mask_truncated=rl.mask_truncated, updates_per_rollout=rl.updates_per_rollout,
                        max_new_tokens=rl.max_new_tokens, temperature=rl.temperature)


def rollout_layout(cfg: TrainConfig) -> RolloutLayout:
    """batch.* as the update cuts rollouts into microbatches (prompts with their whole groups)."""
    batch = cfg.batch
    return RolloutLayout(prompts=batch.global_size, micro_size=batch.micro_size, micro_tokens=batch.micro_tokens,
                         pack=bool(batch.pack), seq_len=batch.seq_len)


@dataclass
class StepResult:
    """What the loop needs of a GRPO step."""

    stats: StepStats
    """The (last) update's statistics."""
    metrics: dict
    """The step's rollout metrics for metrics.jsonl."""
    shapes: list[tuple[int, int]] = field(default_factory=list)
    """(rows, width) for the throughput window: the rollouts' positions as one row (padding not counted)."""
    positions: int = 0
    """Input positions of every rank's rollouts (prompt + completion - 1 each)."""


class GRPOStep:
    """Rollouts and the update of every step of an objective=grpo run."""

    def __init__(self, cfg: TrainConfig, engine, policy: torch.nn.Module, tokenizer, rewards: Rewards, layout,
                 reference=None, generation_copy: torch.nn.Module | None = None):
        self.cfg, self.engine, self.policy, self.tokenizer = cfg, engine, policy, tokenizer
        self.rewards, self.layout, self.reference = rewards, layout, reference
        self.generation_copy = generation_copy
        """fsdp, zero3: an unsharded copy of the policy that takes its full weights before each rollout phase."""
        self.settings = grpo_settings(cfg)
        rl = cfg.rl
        self.sampling = Sampling(rl.group_size, rl.max_new_tokens, rl.temperature, rl.top_p, tuple(rl.stop))
        self.eos_token_ids = tokenizer.stop_ids()
        self.nan_reward_steps = 0

    def state_dict(self) -> dict:
        return {"nan_reward_steps": self.nan_reward_steps}

    def load_state_dict(self, state: dict | None) -> None:
        self.nan_reward_steps = (state or {}).get("nan_reward_steps", 0)

    def _rollout_policy(self) -> torch.nn.Module:
        """The module that generates: the policy itself, or (sharded strategies) the copy holding its
        full weights now (`model_state_dict` is a collective there: every rank calls it)."""
        if self.generation_copy is None:
            return self.policy
        full = self.engine.model_state_dict()
        missing, unexpected = self.generation_copy.load_state_dict(full, strict=False)
        # A tied weight (an output head sharing the embedding) is one tensor under two names: the state
        # dict may hold one of them. Anything else missing would leave the copy generating stale weights.
        tied = {name for name, _ in self.generation_copy.named_parameters(remove_duplicate=False)} - \
            {name for name, _ in self.generation_copy.named_parameters()}
        stale = [name for name in missing if name not in tied]
        if unexpected or stale:
            raise RuntimeError(f"the policy's full weights do not fit its generation copy: missing {stale[:3]}, "
                               f"unexpected {unexpected[:3]}")
        return self.generation_copy

    def step(self, step: int, prompts: list[tuple[int, Prompt]]) -> StepResult:
        """Step `step` (0-based: the optimizer steps done before it) on this rank's prompts."""
        started = time.perf_counter()
        completions = generate_completions(self._rollout_policy(), self.tokenizer.tokenizer.backend_tokenizer,
                                           self.eos_token_ids, prompts, self.sampling, self.cfg.run.seed, step)
        generated = time.perf_counter()
        texts = [self.tokenizer.tokenizer.decode(list(c.generated.token_ids), skip_special_tokens=True)
                 for c in completions]
        scores, error = None, None
        try:
            scores = self._score(completions, texts)
        except RewardError as caught:
            error = caught
        failure = first_failure(error)
        if failure is not None:
            if error is not None:
                raise error
            raise RewardError(f"rank {failure[0]}: {failure[1]}")
        totals = scores.total
        has_nan = torch.tensor([float(any(math.isnan(r) for r in totals))], dtype=torch.float64)
        all_reduce_host(has_nan)
        scored = time.perf_counter()
        metrics = self._metrics(completions, scores)
        if has_nan.item():
            return self._skip(step, metrics, completions, totals)
        advantages, reward_stats = group_advantages(totals, self.sampling.group_size, self.cfg.rl.scale_rewards)
        metrics.update(reward_stats)
        rollouts = [Rollout(c.prompt_index, c.sample, c.prompt.ids, c.generated.token_ids, c.generated.truncated,
                            reward, advantage)
                    for c, reward, advantage in zip(completions, totals, advantages)]
        trained = time.perf_counter()
        updates = train_on_rollouts(self.engine, rollouts, self.settings, self.layout, self.reference)
        finished = time.perf_counter()
        metrics.update(generate_s=generated - started, score_s=scored - generated, train_s=finished - trained,
                       rollout_tokens_per_second=metrics["completion_tokens"] / max(generated - started, 1e-9),
                       nan_reward_steps=self.nan_reward_steps)
        positions = metrics["rollout_positions"]  # input positions of every rank's rollouts, as the window counts them
        return StepResult(updates[-1], metrics, [(1, positions)], positions)

    def _score(self, completions: list[Completion], texts: list[str]):
        prompts = [c.prompt.prompt for c in completions]
        answers = [[{"role": "assistant", "content": text}] if c.prompt.is_conversational else text
                   for c, text in zip(completions, texts)]
        return self.rewards.score(prompts, answers, [c.prompt.fields for c in completions],
                                  [c.prompt.name for c in completions])

    def _metrics(self, completions: list[Completion], scores) -> dict:
        """The step's global rollout metrics: one all-reduce of sums, one of maxima."""
        lengths = [len(c.generated.token_ids) for c in completions]
        names = self.rewards.names
        sums = [len(completions), sum(lengths), sum(c.generated.truncated for c in completions),
                sum(len(c.prompt.ids) + len(c.generated.token_ids) - 1 for c in completions)]
        for name in names:
            values = [v for v in scores.per_function[name] if not math.isnan(v)]
            sums += [sum(values), len(values)]
        totals = torch.tensor(sums, dtype=torch.float64)
        longest = torch.tensor([max(lengths, default=0)], dtype=torch.float64)
        all_reduce_host(totals)
        all_reduce_host(longest, dist.ReduceOp.MAX)
        count, length_sum, truncated, positions, *per_function = totals.tolist()
        metrics = {"completion_length": length_sum / count, "completion_length_max": int(longest.item()),
                   "truncated_fraction": truncated / count, "completion_tokens": int(length_sum),
                   "rollout_positions": int(positions)}
        for i, name in enumerate(names):
            total, n = per_function[2 * i], per_function[2 * i + 1]
            metrics[f"reward/{name}"] = total / n if n else math.nan
        return metrics

    def _skip(self, step: int, metrics: dict, completions: list[Completion], totals: list[float]) -> StepResult:
        """A NaN reward on any rank: no update on any rank; the LR schedule still steps, as for
        every skipped step, and the step is counted."""
        self.nan_reward_steps += 1
        bad = [c.prompt.name for c, r in zip(completions, totals) if math.isnan(r)]
        log.warning("step %d skipped: a reward function returned NaN%s; %d step(s) skipped for NaN rewards so far",
                    step + 1, f" (here for prompt {bad[0]})" if bad else " on another rank", self.nan_reward_steps)
        if self.engine.lr_scheduler is not None:
            self.engine.lr_scheduler.step()
        metrics.update(reward=math.nan, nan_reward_steps=self.nan_reward_steps)
        return StepResult(StepStats(), metrics)


def generation_copy_of(model: torch.nn.Module) -> torch.nn.Module:
    """An unsharded copy of the policy for sharded strategies' rollouts, made before the strategy wraps it."""
    return copy.deepcopy(model)
