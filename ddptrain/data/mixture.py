"""The global batch of a weighted mixture: which source each of a step's examples comes from.

Proportions are in valid target tokens, the objective's own denominator. The plan walks the step's
`batch.global_size` slots in order and gives each to a source by the rule below, then takes that
source's next example from its own stream (ddptrain/data/order.py: epoch after epoch of the
source, each in its own seeded order). With p_s = w_s / sum(w) over the active sources, C_s the
valid targets a source gave so far, T = sum(C) and E the most valid targets of one example of any
source:

- a source is eligible when taking its next example (e_s targets) would not put it more than
  E * (1 - p_s) above its share: C_s + e_s - p_s (T + e_s) <= E (1 - p_s);
- among the eligible ones, the one whose deadline (C_s + E) / p_s (the total at which it would fall
  E below its share) comes first; ties go to the first source. (If none were eligible, the largest
  deficit p_s T - C_s; the property test never sees it.)

That is Tijdeman's earliest-deadline rule for the chairman assignment problem, carried to examples
of unequal sizes: every source's C_s stays within one example (E) of p_s T after every slot, so
after every step, whatever the layout, and rounding is carried forward (no per-step reset). A
plain largest-deficit rule drifts to about 1.6 E with four or more sources. The state after a step
is one (position, targets) pair per source: the checkpoint's cursor, the same on every world size.

A source whose stream reaches 1 + max_repeat passes is exhausted: on_exhausted=error stops the run
at that step, naming it; renormalize drops it, and the others continue in proportion among
themselves. A mixture of one source takes positions [t G, (t + 1) G) of that source's stream,
keyed as GlobalBatchPlan's: the same global batches as the plain source.
"""

from __future__ import annotations

import logging
import math
import threading
import zlib
from dataclasses import dataclass, field

import numpy as np

from ddptrain.data.order import LEGACY_ORDER, EpochStream
from ddptrain.data.sources import DataError

log = logging.getLogger(__name__)


class SourceExhausted(DataError):
    """A source ran past its max_repeat with on_exhausted=error."""


@dataclass
class MixSource:
    """One source of a mixture, as the plan sees it."""

    name: str
    weight: float
    targets: np.ndarray
    """(N,) valid targets of each of its examples (pieces, packed rows or conversations)."""
    offset: int = 0
    """Its first example's id in the mixture's combined examples."""
    max_repeat: int | None = None
    """Passes after the first (None: unlimited)."""
    on_exhausted: str = "error"

    @property
    def passes(self) -> float:
        return math.inf if self.max_repeat is None else 1 + self.max_repeat


@dataclass(frozen=True)
class MixState:
    """Where the mixture is after some steps: per source, examples taken (its stream position),
    valid targets taken, and whether it is still drawn from."""

    positions: tuple[int, ...]
    targets: tuple[int, ...]
    active: tuple[bool, ...]


@dataclass
class StepMix:
    """One step of the plan."""

    ids: np.ndarray
    """(G,) ids of the step's examples in the combined examples."""
    sources: np.ndarray
    """(G,) the source of each."""
    targets: np.ndarray
    """(K,) valid targets each source gives this step."""
    after: MixState
    dropped: list[str] = field(default_factory=list)
    """Sources exhausted in this step (on_exhausted=renormalize)."""


class MixturePlan:
    """Deterministic global batches over a weighted mixture (the same interface as GlobalBatchPlan)."""

    def __init__(self, sources: list[MixSource], global_batch_size: int, seed: int, order: str = "bijection"):
        if not sources:
            raise ValueError("a mixture needs at least one source")
        self.sources = sources
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.bound = max(1, max(int(source.targets.max()) for source in sources))  # E: one example
        self._order = order
        self._streams = self._make_streams(order)
        initial = MixState(tuple(0 for _ in sources), tuple(0 for _ in sources),
                           tuple(source.weight > 0 for source in sources))
        self._initial = initial
        self._base = (0, initial)  # (step, state): the resumed cursor, or the start
        self._done: dict[int, StepMix] = {}  # step -> its mix, the few computed last
        self._lock = threading.Lock()  # the prefetching thread and the training thread both ask

    def _make_streams(self, order: str) -> list[EpochStream]:
        one = len(self.sources) == 1  # keyed as GlobalBatchPlan: a mixture of one is the plain source
        return [EpochStream(len(source.targets), [self.seed] if one else [self.seed, zlib.crc32(source.name.encode())],
                            order) for source in self.sources]

    @property
    def order(self) -> str:
        return self._order

    def use_order(self, order: str) -> None:
        if order != self._order:
            self._order, self._streams = order, self._make_streams(order)
            self._done = {}

    # -- the plan ------------------------------------------------------------------------------

    def global_batch(self, step: int) -> np.ndarray:
        return self.step(step).ids

    def samples_seen(self, step: int) -> int:
        return step * self.global_batch_size

    def state_after(self, step: int) -> MixState:
        return self._base[1] if step == self._base[0] else self.step(step - 1).after

    def step(self, step: int) -> StepMix:
        """The mix of `step` (0-based), from the nearest state known before it."""
        with self._lock:
            if step in self._done:
                return self._done[step]
            base_step, state = self._base if step >= self._base[0] else (0, self._initial)
            known = [s for s in self._done if base_step <= s < step]
            if known:
                base_step, state = max(known) + 1, self._done[max(known)].after
            for at in range(base_step, step + 1):
                mix = self._plan(at, state)
                state = mix.after
                self._done[at] = mix
            for old in sorted(self._done)[:-4]:  # the prefetcher asks for step + 1 while step trains
                del self._done[old]
            return self._done[step]

    def _plan(self, step: int, state: MixState) -> StepMix:
        sources, size, bound = self.sources, self.global_batch_size, self.bound
        positions, taken, active = list(state.positions), list(state.targets), list(state.active)
        ahead = [self._ahead(k, positions[k]) for k in range(len(sources))]  # the next ids of each stream
        used = [0] * len(sources)
        ids = np.empty(size, dtype=np.int64)
        chosen = np.empty(size, dtype=np.int64)
        dropped: list[str] = []
        for slot in range(size):
            for k, source in enumerate(sources):
                if active[k] and used[k] == len(ahead[k]):
                    self._exhausted(step, k, positions[k] + used[k])
                    active[k] = False
                    dropped.append(source.name)
            k = self._choose(taken, active, [int(sources[k].targets[ahead[k][used[k]]]) if active[k] else 0
                                             for k in range(len(sources))], bound)
            local = int(ahead[k][used[k]])
            ids[slot], chosen[slot] = sources[k].offset + local, k
            used[k] += 1
            taken[k] += int(sources[k].targets[local])
        step_targets = np.asarray(taken, dtype=np.int64) - np.asarray(state.targets, dtype=np.int64)
        after = MixState(tuple(p + u for p, u in zip(positions, used)), tuple(taken), tuple(active))
        return StepMix(ids, chosen, step_targets, after, dropped)

    def _ahead(self, k: int, position: int) -> np.ndarray:
        """Source k's ids at the next positions of its stream, at most a global batch, within its passes."""
        source = self.sources[k]
        left = source.passes * len(source.targets) - position
        count = int(min(self.global_batch_size, left))
        return self._streams[k].ids(position, count) if count > 0 else np.zeros(0, dtype=np.int64)

    def _choose(self, taken: list[int], active: list[bool], next_targets: list[int], bound: int) -> int:
        live = [k for k, is_active in enumerate(active) if is_active]
        if not live:
            raise DataError("every source of the mixture is exhausted (data.sources.*.max_repeat): no example is left")
        weight = sum(self.sources[k].weight for k in live)
        total = sum(taken[k] for k in live)
        best, best_deadline = None, math.inf
        for k in live:
            share = self.sources[k].weight / weight
            over = taken[k] + next_targets[k] - share * (total + next_targets[k])
            if over <= bound * (1 - share) + 1e-9 * bound:
                deadline = (taken[k] + bound) / share
                if deadline < best_deadline:
                    best, best_deadline = k, deadline
        if best is None:  # not seen in the property test; the largest deficit keeps the plan going
            best = max(live, key=lambda k: (self.sources[k].weight / weight * total - taken[k], -k))
        return best

    def _exhausted(self, step: int, k: int, position: int) -> None:
        source = self.sources[k]
        read = f"its {len(source.targets)} examples were read {position // len(source.targets)} times"
        if source.on_exhausted == "error":
            raise SourceExhausted(
                f"step {step + 1}: data.sources.{source.name} is exhausted: {read} (max_repeat={source.max_repeat}) "
                f"and on_exhausted=error; raise data.sources.{source.name}.max_repeat, or set "
                f"data.sources.{source.name}.on_exhausted=renormalize to go on without it")
        log.warning("step %d: data.sources.%s is exhausted (%s, max_repeat=%s): dropped; the other sources go on in "
                    "proportion to their weights (on_exhausted=renormalize)", step + 1, source.name, read,
                    source.max_repeat)

    # -- figures and cursor --------------------------------------------------------------------

    def figures(self, step: int, loss_sums: list[float]) -> dict:
        """mix/<source>/targets (this step), share (cumulative), epoch (passes read, fractional) and
        exhausted, after `step` steps (step >= 1); loss/<source>, its summed token losses over its
        valid targets this step (`loss_sums`: the engine's per-source sums; one source: the loss)."""
        mix, after = self.step(step - 1), self.state_after(step)
        total = sum(after.targets)
        figures = {}
        for k, source in enumerate(self.sources):
            if len(self.sources) == 1:
                figures[f"loss/{source.name}"] = loss_sums[0]
            else:
                figures[f"loss/{source.name}"] = loss_sums[k] / mix.targets[k] if mix.targets[k] else math.nan
            figures[f"mix/{source.name}/targets"] = int(mix.targets[k])
            figures[f"mix/{source.name}/share"] = after.targets[k] / total if total else 0.0
            figures[f"mix/{source.name}/epoch"] = after.positions[k] / len(source.targets)
            figures[f"mix/{source.name}/exhausted"] = int(not after.active[k] and source.weight > 0)
        return figures

    def state_dict(self, step: int) -> dict:
        state = self.state_after(step)
        return {"samples_seen": self.samples_seen(step), "seed": self.seed,
                "global_batch_size": self.global_batch_size, "order": self.order,
                "sources": {source.name: {"position": state.positions[k], "targets": state.targets[k],
                                          "active": state.active[k], "weight": source.weight}
                            for k, source in enumerate(self.sources)}}

    def load_state_dict(self, state: dict, step: int) -> None:
        """Continue from a checkpoint's per-source cursors at `step`; a changed weight is said and applied."""
        self.use_order(state.get("order", LEGACY_ORDER))
        saved = state.get("sources")
        if saved is None:
            raise DataError("the checkpoint's data cursor holds no per-source positions: it was not written by a "
                            "data=mixture run, so a mixture cannot continue it")
        names = [source.name for source in self.sources]
        if sorted(saved) != sorted(names):
            raise DataError(f"the checkpoint's mixture has the sources {', '.join(sorted(saved))} and this run "
                            f"{', '.join(sorted(names))}: the sources of a mixture must not change on resume")
        changed = [f"{s.name} {saved[s.name]['weight']:g} -> {s.weight:g}" for s in self.sources
                   if saved[s.name].get("weight") is not None and saved[s.name]["weight"] != s.weight]
        if changed:
            log.warning("mixture weights changed on resume (%s): the mix continues from each source's cursor with "
                        "the new weights", ", ".join(changed))
        resumed = MixState(tuple(int(saved[n]["position"]) for n in names), tuple(int(saved[n]["targets"]) for n in names),
                           tuple(bool(saved[n]["active"]) and s.weight > 0 for n, s in zip(names, self.sources)))
        with self._lock:
            self._base, self._done = (step, resumed), {}
