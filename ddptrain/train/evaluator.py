"""The validation loss: the global mean over the valid targets of a fixed validation set, the same
number for any layout, on its own schedule (every trainer.eval_every steps, and after the last)."""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

from ddptrain.data.dataset import TokenExamples
from ddptrain.distributed import DistInfo, all_reduce_sum
from ddptrain.engine.engine import Engine
from ddptrain.engine.objective import IGNORE_INDEX, token_loss_sum

log = logging.getLogger(__name__)


class Evaluator:
    def __init__(self, val: TokenExamples, examples: int, micro_batch_size: int, every: int, last_step: int,
                 dist_info: DistInfo):
        self.val = val
        if examples > len(val):  # not refused: the default 64 exceeds a small corpus's split, and all of it is used
            log.warning("trainer.eval_examples=%d > the %d examples of the validation split: the validation loss is "
                        "over all %d of them; lower trainer.eval_examples or give a larger validation split",
                        examples, len(val), len(val))
        self.ids = np.arange(min(examples, len(val)))
        self.micro_batch_size = micro_batch_size
        self.every = every
        self.last_step = last_step
        self.dist = dist_info

    def should_run(self, step: int) -> bool:
        return bool(self.every and step % self.every == 0) or step == self.last_step

    @torch.no_grad()
    def run(self, engine: Engine) -> float:
        """Collective. Every rank runs the same number of forwards (ZeRO-3 gathers weights collectively)."""
        share = self.ids[self.dist.rank :: self.dist.world_size]
        micro, device = self.micro_batch_size, self.dist.device
        rounds = math.ceil(math.ceil(len(self.ids) / self.dist.world_size) / micro)
        sums = torch.zeros(2, dtype=torch.float64, device=device)  # (loss sum, valid targets)
        model = engine.model
        model.eval()
        for index in range(rounds):
            chunk = share[index * micro : (index + 1) * micro]
            if len(chunk):
                inputs, targets = self.val.collate(chunk)
            else:  # a filler: this rank's share is used up
                inputs = torch.zeros(1, 1, dtype=torch.long)
                targets = torch.full((1, 1), IGNORE_INDEX, dtype=torch.long)
            inputs, targets = inputs.to(device), targets.to(device)
            logits = engine.forward(inputs)
            sums[0] += token_loss_sum(logits, targets).double()
            sums[1] += (targets != IGNORE_INDEX).sum()
        model.train()
        all_reduce_sum(sums)
        return float(sums[0] / sums[1]) if sums[1] > 0 else float("nan")
