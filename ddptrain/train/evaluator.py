"""The validation loss: the global mean over the valid targets of a fixed validation set, the same
number for any layout, on its own schedule (every trainer.eval_every steps, and after the last): a
component of the loop (train/components.py) that leaves the loss on the step's `val_loss`.

Its microbatches are cut like the training's: batch.micro_size rows, or under batch.micro_tokens
at most that many padded positions each, or under packing at most the positions of a training
microbatch (config/layout.py: eval_micro_tokens), so an eval forward never exceeds what the run's
microbatches (and its memory plan) hold."""

from __future__ import annotations

import logging

import numpy as np
import torch

from ddptrain.config.layout import eval_micro_tokens
from ddptrain.config.schema import TrainConfig
from ddptrain.data.batches import budget_microbatches
from ddptrain.data.dataset import TokenExamples
from ddptrain.data.global_batch import split_micro
from ddptrain.distributed import DistInfo, all_reduce_sum
from ddptrain.engine.engine import Engine
from ddptrain.contract.targets import IGNORE_INDEX
from ddptrain.contract.pairs import PairTargets
from ddptrain.engine.chunked import valid_positions_of
from ddptrain.engine.objective import Objective
from ddptrain.train.components import StepEnd
from ddptrain.train.reference import Reference

CROSS_ENTROPY = Objective()
"""The validation loss is the plain mean cross-entropy, whatever the training objective adds."""

log = logging.getLogger(__name__)


class Evaluator:
    def __init__(self, val: TokenExamples, examples: int, micro_batch_size: int, every: int, last_step: int,
                 dist_info: DistInfo, micro_tokens: int | None = None, engine: Engine | None = None,
                 reference: Reference | None = None, sources: list[tuple[str, int, int]] | None = None):
        """`sources`: a mixture's (name, first id, examples) in `val`: up to `examples` of each are evaluated,
        each source's microbatches its own, and val_loss/<source> is its mean beside the total's."""
        self.val = val
        self.source_losses: dict[str, float] = {}  # val_loss/<source> of the last run (a mixture's)
        self.engine = engine  # what `on_step_end` evaluates
        self.reference = reference  # preference pairs: the loss is the engine's objective (DPO), over pairs
        if examples > len(val):  # not refused: the default 64 exceeds a small corpus's split, and all of it is used
            log.warning("trainer.eval_examples=%d > the %d examples of the validation split: the validation loss is "
                        "over all %d of them; lower trainer.eval_examples or give a larger validation split",
                        examples, len(val), len(val))
        self.sources = [(name, np.arange(first, first + min(examples, size))) for name, first, size in sources or []]
        self.ids = np.concatenate([ids for _, ids in self.sources]) if sources else np.arange(min(examples, len(val)))
        self.micro_batch_size = micro_batch_size
        self.micro_tokens = micro_tokens
        self.every = every
        self.last_step = last_step
        self.dist = dist_info
        groups = [ids for _, ids in self.sources] or [self.ids]
        ranks = [[] for _ in range(dist_info.world_size)]
        self.groups = []  # (the source of each of this rank's microbatches)
        for group, ids in enumerate(groups):  # a microbatch holds one source's examples
            for rank, micro in enumerate(self._rank_microbatches(ids)):
                ranks[rank] += micro
                if rank == dist_info.rank:
                    self.groups += [group] * len(micro)
        self.microbatches = ranks[dist_info.rank]
        self.rounds = max(map(len, ranks))  # the same on every rank: the longest list, fillers pad the others

    @classmethod
    def from_config(cls, val: TokenExamples, cfg: TrainConfig, dist_info: DistInfo, engine: Engine,
                    reference: Reference | None = None) -> "Evaluator":
        """trainer.eval_examples of `val`, every trainer.eval_every steps and the last, in the run's microbatches."""
        sources = getattr(val, "mixture_sources", None)  # data=mixture: (name, first id, examples) of each source
        return cls(val, cfg.trainer.eval_examples, cfg.batch.micro_size, cfg.trainer.eval_every, cfg.trainer.max_steps,
                   dist_info, micro_tokens=eval_micro_tokens(cfg.batch, pairs=reference is not None), engine=engine,
                   reference=reference,
                   sources=sources if sources and len(sources) > 1 else None)

    def _rank_microbatches(self, ids: np.ndarray) -> list[list[np.ndarray]]:
        """Every rank's microbatches of its strided share: micro_batch_size rows each, or the training's
        token budget (longest first, rows x longest <= micro_tokens padded positions)."""
        shares = [ids[rank :: self.dist.world_size] for rank in range(self.dist.world_size)]
        if self.micro_tokens is None:
            return [split_micro(share, self.micro_batch_size) for share in shares]
        positions = self.val.lengths - 1  # (N,) input positions of each example, what collate pads to
        return [budget_microbatches(share, positions[share], self.micro_tokens) for share in shares]

    def should_run(self, step: int) -> bool:
        return bool(self.every and step % self.every == 0) or step == self.last_step

    def reads(self, end: StepEnd) -> bool:
        return self.should_run(end.step)  # the metrics line of an eval step holds the step's numbers

    def on_step_end(self, end: StepEnd) -> None:
        if self.should_run(end.step):
            end.val_loss = self.run(self.engine)
            end.evals.update(self.source_losses)

    def on_fit_end(self, step: int) -> None:
        pass

    @torch.no_grad()
    def run(self, engine: Engine) -> float:
        """Collective. Every rank runs the same number of forwards (ZeRO-3 gathers weights collectively)."""
        device = self.dist.device
        sums = torch.zeros(max(len(self.sources), 1), 2, dtype=torch.float64, device=device)  # (loss sum, targets)
        model = engine.model
        model.eval()
        for index in range(self.rounds):
            group = sums[self.groups[index]] if index < len(self.microbatches) else sums[0]
            if index < len(self.microbatches):
                inputs, targets = self.val.collate(self.microbatches[index])
            else:  # a filler: this rank's share is used up
                inputs = torch.zeros(1, 1, dtype=torch.long)
                targets = torch.full((1, 1), IGNORE_INDEX, dtype=torch.long)
                if self.reference is not None:  # a reference forward where real pairs take one (not precomputed):
                    # where the strategy gathers in every forward (fsdp, zero3), every rank must join each one
                    precomputed = torch.zeros(0, dtype=torch.float64) if self.val.reference is not None else None
                    targets = PairTargets(targets, torch.full((1, 1), -1), 0, precomputed)
            if self.reference is not None:  # pairs: the mean DPO loss over the validation pairs
                [(inputs, targets)] = self.reference.fill([(inputs, targets)])
                inputs, targets = inputs.to(device), targets.to(device)
                group[0] += engine.token_sum(inputs, targets)[0]
                group[1] += targets.pairs
                continue
            positions = valid_positions_of(targets)  # on the host: no device sync
            inputs, targets = inputs.to(device), targets.to(device)
            group[0] += engine.token_sum(inputs, targets, CROSS_ENTROPY, positions).double()
            group[1] += (targets != IGNORE_INDEX).sum()
        model.train()
        all_reduce_sum(sums)
        self.source_losses = {f"val_loss/{name}": _mean(*sums[k].tolist()) for k, (name, _) in enumerate(self.sources)}
        return _mean(*sums.sum(0).tolist())


def _mean(loss_sum: float, count: float) -> float:
    return loss_sum / count if count > 0 else float("nan")
