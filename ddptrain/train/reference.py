"""DPO's reference model: each sequence's log-probability under it, computed just before the step.

The objective (ddptrain/engine/preference.py) reads the reference log-probs from the microbatch's
PairTargets; this fills them in, without gradients, for every microbatch of the step:

- LoRA (model.lora.r > 0): the policy itself with its adapter disabled (peft's `disable_adapter`),
  called through the strategy's wrapper: the frozen base weights, no second copy in memory.
- full fine-tuning: a frozen copy of the initial weights, taken before the strategy wraps the
  policy and held as the strategy holds weights (`Strategy.frozen_copy`, `Strategy.hold_frozen`):
  whole on every rank under ddp, zero1 and zero2 (one more replica of the weights), sharded like
  the policy under fsdp (each rank holds its shards, gathered unit by unit in the reference's
  forward) and under zero3 (each rank holds its partitions, gathered module by module by the hooks
  of a DeepSpeed engine without optimizer); in both, a copy of the initial weights is a meta
  skeleton filled from the policy's own shards, so no rank holds it whole.

With objective.precompute_reference=true they are computed once before step 1 instead, for every
pair of both splits (spread over the ranks, summed), and kept in the data cache under a key of the
data's and the reference weights' fingerprints; the key joins the run's input fingerprint, so a
resume over another model is refused. An entry is verified on every load, as the data cache's are:
its checksum (`<entry>.sha256` beside it), its length (two per pair) and finite values; a damaged one
is recomputed, with a warning naming it, never trained against.

A full fine-tune's frozen copy is fingerprinted into the run's input fingerprint too
(`Reference.weights`, as `reference.weights`): it is rebuilt from model.path (or the seed) at every
launch, and a resume over other weights is refused by name (ddptrain/runs/fingerprint.py).

The log-probs are those of the engine's forward (its precision and autocast; with its chunked head,
the head on the valid targets only), in float64.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Sequence

import numpy as np

import torch
from torch import nn

from ddptrain.contract.outputs import HEAD_LOSS, logits_of, takes_head_loss
from ddptrain.contract.pairs import PairTargets
from ddptrain.data.cache import array_digest, default_cache_dir
from ddptrain.data.preference import PreferencePairs
from ddptrain.distributed import DistInfo, all_reduce_sum, any_rank, barrier
from ddptrain.engine.engine import AUTOCAST, Engine, filler_inputs
from ddptrain.engine.preference import PairHeadLoss, sequence_logps
from ddptrain.models.lora import is_adapted
from ddptrain.strategies import strategy_class
from ddptrain.strategies.base import Strategy


log = logging.getLogger(__name__)


def frozen_copy(model: nn.Module, strategy: str = "ddp") -> nn.Module:
    """A copy of `model`'s current weights that never trains (the full fine-tune's reference), as
    `strategy` takes it before it wraps the model (fsdp: a skeleton its shards are filled into)."""
    return strategy_class(strategy).frozen_copy(model)


class Reference:
    """Fills PairTargets.reference of microbatches: the adapter-disabled policy (`frozen` None) or a frozen copy.

    It calls the module itself, not the strategy's wrapper: DDP would broadcast buffers in a forward
    (a collective that ranks with different numbers of microbatches would not all reach)."""

    def __init__(self, engine: Engine, policy: nn.Module, frozen: nn.Module | None = None):
        if frozen is None and not is_adapted(policy):
            raise ValueError(f"{type(policy).__name__} has no LoRA adapter to disable: give a frozen copy of the "
                             "initial weights as the reference (full fine-tuning)")
        self.engine = engine
        dtype = torch.float64 if engine.precision == "fp64" else None
        self.model = policy if frozen is None else engine.strategy.hold_frozen(frozen, engine.device, dtype)
        self.disables_adapter = frozen is None
        self.uses_head_loss = engine.chunked_head and takes_head_loss(self.model)
        self._weights: str | None = None

    @property
    def weights(self) -> str | None:
        """sha256 of the frozen copy's weights (`weights_fingerprint`), computed once; None under LoRA,
        whose reference is the base that ModelSpec.base_weights fingerprints."""
        if self.disables_adapter:
            return None
        if self._weights is None:
            self._weights = weights_fingerprint(self.model, self.engine.strategy)
        return self._weights

    def drop_frozen_copy(self) -> None:
        """Free a full fine-tune's frozen copy once every pair's log-probs are precomputed: nothing
        calls it again (`fill` skips pairs that carry theirs), and the memory plan counts none."""
        if not self.disables_adapter:
            self.weights  # noqa: B018 - fingerprinted before the weights go: the run's input fingerprint reads it
            self.model = None

    @torch.no_grad()
    def logps(self, inputs, pairs: PairTargets) -> torch.Tensor:
        """(S,) float64: each sequence's summed target log-probs under the reference."""
        if self.model is None:
            raise RuntimeError("the reference's log-probs were precomputed and its frozen copy dropped, but a "
                               "microbatch carries none")
        precision, device = self.engine.precision, self.engine.device
        autocast = (torch.autocast(device.type, dtype=AUTOCAST[precision]) if precision in AUTOCAST
                    else contextlib.nullcontext())
        adapter = self.model.disable_adapter() if self.disables_adapter else contextlib.nullcontext()
        # With the engine's chunked head, the head runs on the valid targets only: no (B, T, V) logits.
        chunk = max(pairs.tokens.numel(), 1) if self.engine.strategy.gathers_per_module_call else \
            self.engine.head_chunk_tokens  # ZeRO-3 gathers per head call: one chunk, as the engine does
        keywords = {HEAD_LOSS: PairHeadLoss(pairs, None, chunk)} if self.uses_head_loss else {}
        with adapter, autocast:
            output = self.model(**inputs, **keywords) if isinstance(inputs, dict) else self.model(inputs, **keywords)
        return (output if keywords else sequence_logps(logits_of(output), pairs)).double()

    def fill(self, microbatches: Sequence[tuple], max_microbatches: int | None = None) -> list[tuple]:
        """The microbatches with their reference log-probs, computed on the engine's device. Where the
        strategy communicates in every forward (fsdp, zero3), a rank with fewer microbatches runs
        filler forwards up to `max_microbatches`, so that every rank joins every collective."""
        filled = []
        device = self.engine.device
        computed = False  # precomputed log-probs (on every rank alike): no forward, so no filler either
        for inputs, pairs in microbatches:
            if pairs.reference is None:
                pairs = pairs.with_reference(self.logps(_on(device, inputs), pairs.to(device)))
                computed = True
            filled.append((inputs, pairs))
        if self.engine.strategy.communicates_every_microbatch and max_microbatches and filled and computed:
            inputs, pairs = filled[0]
            for _ in range(max_microbatches - len(filled)):
                self.logps(_on(device, filler_inputs(inputs)), PairTargets.empty(pairs.to(device)))
        return filled


def _on(device: torch.device, inputs):
    if isinstance(inputs, dict):
        return {key: value.to(device) for key, value in inputs.items()}
    return inputs.to(device)


def weights_fingerprint(model: nn.Module, strategy: Strategy) -> str:
    """sha256 of the reference's weights, held as `strategy` holds them: every parameter but a LoRA
    adapter's (disabled in the reference). Collective where they are sharded (fsdp, zero3)."""
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters()):
        if "lora_" not in name:
            whole = strategy.whole_tensor(param)
            digest.update(name.encode() + whole.cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def precompute(reference: Reference, splits: dict[str, PreferencePairs], data_inputs: dict, micro_pairs: int,
               dist_info: DistInfo, cache_dir: str | None) -> str:
    """Set each split's `reference` log-probs, from the cache or computed once (pairs spread over the ranks,
    the rest of the vector zeros, summed); returns the cache key. Collective."""
    weights = reference.weights or weights_fingerprint(reference.model, reference.engine.strategy)
    key = hashlib.sha256(json.dumps({"data": data_inputs, "weights": weights,
                                     "precision": reference.engine.precision,
                                     "splits": {name: len(pairs) for name, pairs in splits.items()}},
                                    sort_keys=True, default=str).encode()).hexdigest()[:24]
    directory = (Path(os.path.expanduser(cache_dir)) if cache_dir else default_cache_dir()) / "reference"
    for name, pairs in splits.items():
        path = directory / f"{key}.{name}.npy"
        values, damage = load_cached(path, 2 * len(pairs))
        if damage is not None and dist_info.local_rank == 0:  # once per node: its ranks read the same file
            log.warning("reference: cache entry %s is damaged (%s): recomputed", path, damage)
        if not any_rank(values is None, reference.engine.device):  # every rank reuses it, or every rank computes
            pairs.reference = values
            log.info("reference: log-probs of %d %s pairs reused from %s", len(pairs), name, path)
            continue
        values = torch.zeros(2 * len(pairs), dtype=torch.float64, device=reference.engine.device)
        ids = np.arange(dist_info.rank, len(pairs), dist_info.world_size)
        rounds = -(-len(pairs) // (dist_info.world_size * micro_pairs))  # the same on every rank
        for index in range(rounds):
            chunk = ids[index * micro_pairs : (index + 1) * micro_pairs]
            batch = [pairs.collate(chunk if len(chunk) else ids[:1] if len(ids) else np.arange(1))]
            [(_, filled)] = reference.fill(batch)
            if len(chunk):
                seq_ids = torch.from_numpy(np.stack([2 * chunk, 2 * chunk + 1], axis=1).reshape(-1))
                values[seq_ids.to(values.device)] = filled.reference.to(values.device)
        all_reduce_sum(values)
        pairs.reference = values.cpu().numpy()
        if dist_info.rank == 0:
            save_cached(path, pairs.reference)
        log.info("reference: log-probs of %d %s pairs computed before step 1 into %s", len(pairs), name, path)
    barrier()
    return key


def _checksum_file(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def save_cached(path: Path, values: np.ndarray) -> None:
    """`values` into `path` (.npy) and its checksum beside it (`<path>.sha256`: data.cache.array_digest),
    each written aside and renamed into place; an entry whose two files disagree is recomputed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.stem}.tmp-{os.getpid()}.npy")
    np.save(tmp, values)
    checksum = _checksum_file(tmp)
    checksum.write_text(array_digest(tmp) + "\n")
    os.replace(tmp, path)
    os.replace(checksum, _checksum_file(path))


def load_cached(path: Path, length: int) -> tuple[np.ndarray | None, str | None]:
    """(the log-probs, None) when `path` holds `length` finite float64 values that match the checksum
    saved beside them; (None, what is wrong) when it does not; (None, None) when there is no entry.
    Never trusted blindly: flipped bits, a truncated or replaced file would be trained against."""
    if not path.is_file():
        return None, None
    checksum = _checksum_file(path)
    try:
        expected = checksum.read_text().strip()
    except OSError:
        return None, f"no readable checksum {checksum.name} beside it"
    found = array_digest(path)
    if found != expected:
        size, expected_size = found.split(":")[0], expected.split(":")[0]
        return None, (f"{size} bytes where {expected_size} were written" if size != expected_size else
                      f"it does not match its checksum {checksum.name}")
    try:
        values = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as error:
        return None, f"not a .npy array: {error}"
    if values.dtype != np.float64 or values.shape != (length,):
        return None, (f"{values.dtype} values of shape {values.shape}, where the split's pairs need ({length},) "
                      "float64 (two sequences per pair)")
    bad = np.flatnonzero(~np.isfinite(values))
    if len(bad):
        return None, f"{len(bad)} value(s) not finite, the first at sequence {bad[0]}"
    return values, None
