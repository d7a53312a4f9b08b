"""The next step's microbatches, collated in a background thread while this step trains.

Collating is numpy and small tensor work on the host; on a GPU it would otherwise leave the device
idle at every step boundary. On CUDA the tensors are pinned, so the Engine's non_blocking copies
overlap with compute. `data_wait_s` in the metrics is what is left: time the step still waited.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch


def _pin(value):
    if isinstance(value, dict):
        return {key: tensor.pin_memory() for key, tensor in value.items()}
    return value.pin_memory()


class Prefetcher:
    def __init__(self, batches, last_step: int, pin_memory: bool = False):
        self.batches = batches
        self.last_step = last_step
        self.pin_memory = pin_memory
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddptrain-collate")
        self._next: tuple[int, Future] | None = None

    def _collate(self, step: int) -> list:
        microbatches = self.batches.microbatches(step)
        if self.pin_memory:
            microbatches = [(_pin(inputs), _pin(targets)) for inputs, targets in microbatches]
        return microbatches

    def get(self, step: int) -> tuple[list, float]:
        """(microbatches of `step`, seconds waited for them); starts collating `step + 1`."""
        waited = time.perf_counter()
        if self._next is not None and self._next[0] == step:
            microbatches = self._next[1].result()
        else:
            microbatches = self._collate(step)
        data_wait_s = time.perf_counter() - waited
        self._next = (step + 1, self._pool.submit(self._collate, step + 1)) if step + 1 < self.last_step else None
        return microbatches, data_wait_s

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def pin_memory_available(device: torch.device) -> bool:
    return device.type == "cuda"
