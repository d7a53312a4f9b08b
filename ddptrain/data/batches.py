"""This rank's microbatches of every step: fixed-size, token-budget, and packed.

Every layout starts from the same global batch of the step (GlobalBatchPlan) and only decides
which rank and which microbatch computes each example, so the global objective, and the loss
curve, do not depend on the layout.

- micro_size (default): rank r takes a contiguous share of the global batch, cut into microbatches
  of `micro_size` sequences, each padded to its longest sequence.
- micro_tokens: ranks get nearly equal token counts (longest first, each to the rank with the
  fewest so far); each share is sorted by length and cut into microbatches of at most
  `micro_tokens` padded tokens (rows x longest). Packed rows, all of one length, are split by their
  attention work (the sum of their documents' squared lengths). Ranks may run different numbers of
  microbatches; where a strategy communicates in every microbatch the Engine adds fillers.
- pack: rows of seq_len tokens cut from all documents laid end to end (ddptrain/data/packing.py),
  each document keeping its own positions and segment; either layout above then applies to rows.
- pack, on conversations (data=sft): the step's global batch is packed, each conversation whole,
  into rows of at most seq_len positions (narrower where that gives every rank a row), split over
  ranks and cut into microbatches as above. A microbatch is then a list of rows, each an array of
  example ids.
- preference pairs (data=preference): the units are pairs, kept whole in every layout (two rows
  each, or two documents of one packed row; ddptrain/data/preference.py).
"""

from __future__ import annotations

import numpy as np

from ddptrain.data.dataset import TokenExamples
from ddptrain.data.packing import ConversationRows, PackedExamples
from ddptrain.data.preference import PairRows, PreferencePairs
from ddptrain.data.global_batch import GlobalBatchPlan, rank_share, split_micro
from ddptrain.data.order import LEGACY_ORDER
from ddptrain.data.sources import DataError


def balanced_shares(ids: np.ndarray, tokens: np.ndarray, world_size: int,
                    attention: np.ndarray | None = None) -> list[np.ndarray]:
    """Split `ids` over ranks with nearly equal token sums (LPT greedy; deterministic ties).

    `attention` (per example, e.g. the sum of its documents' squared lengths) breaks ties: among
    examples of equal length the costliest goes first, and among ranks of equal token load the one
    with the least attention work takes it. Packed rows all have seq_len tokens, so without it their
    split would ignore that a row of one long document costs far more attention than a row of many
    short ones, and the step would wait for the rank that drew the long ones.
    """
    work = np.zeros(len(ids), dtype=np.int64) if attention is None else np.asarray(attention, dtype=np.int64).reshape(-1)
    order = np.lexsort((np.arange(len(ids)), -work, -tokens))  # longest first, then costliest, then by position
    loads = np.zeros(world_size, dtype=np.int64)
    works = np.zeros(world_size, dtype=np.int64)
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for index in order:
        rank = int(np.lexsort((np.arange(world_size), works, loads))[0])  # least tokens, then least work
        shares[rank].append(int(ids[index]))
        loads[rank] += tokens[index]
        works[rank] += work[index]
    return [np.asarray(share, dtype=np.int64) for share in shares]


def budget_microbatches(ids: np.ndarray, tokens: np.ndarray, micro_tokens: int) -> list[np.ndarray]:
    """Longest first, grouped while (examples x longest example) <= micro_tokens padded tokens."""
    order = np.lexsort((np.arange(len(ids)), -tokens))
    micro: list[list[int]] = []
    longest = 0
    for index in order:
        if micro and (len(micro[-1]) + 1) * longest <= micro_tokens:
            micro[-1].append(int(ids[index]))  # sorted: this one is no longer than the first
        else:
            micro.append([int(ids[index])])
            longest = int(tokens[index])
    return [np.asarray(group, dtype=np.int64) for group in micro]


class _Positions:
    """`positions[ids]`: the input positions (L - 1) of those examples, read from their (memory-mapped)
    lengths when asked, never an array of the whole corpus."""

    def __init__(self, examples):
        self.examples = examples

    def __getitem__(self, ids) -> np.ndarray:
        lengths = np.asarray(self.examples.lengths[ids])  # packed rows may give one length for all
        return np.broadcast_to(lengths, np.shape(ids)) - 1


class TrainBatches:
    """This rank's microbatches of every step, plus the global cursor for checkpoints."""

    def __init__(self, examples: TokenExamples, global_batch_size: int, micro_batch_size: int,
                 seed: int, rank: int, world_size: int, micro_tokens: int | None = None,
                 pack: bool = False, seq_len: int | None = None, order: str = "bijection", plan=None, labels=None):
        """`plan`: the global batches (a MixturePlan); default GlobalBatchPlan over `examples` in `order`.
        `labels(ids, targets)`: a mixture's targets with the source of each position (SourceLabels)."""
        self.labels = labels
        self.conversation_rows = None
        if pack:
            if seq_len is None:
                raise ValueError("packing needs seq_len, the length of a packed row")
            if isinstance(examples, PreferencePairs):  # whole pairs, each sequence a document
                self.conversation_rows = PairRows(examples, seq_len)
            elif isinstance(examples, PackedExamples):  # a mixture's sources come packed, each on its own
                pass
            elif examples.is_conversations:  # packed per step: the same sample as unpacked
                self.conversation_rows = ConversationRows(examples, seq_len)
            else:
                examples = PackedExamples.from_examples(examples, seq_len)
        self.examples = examples
        self.plan = plan if plan is not None else GlobalBatchPlan(len(examples), global_batch_size, seed, order)
        self.micro_batch_size = micro_batch_size
        self.micro_tokens = micro_tokens
        self.pack = pack
        self.seq_len = seq_len
        self.rank = rank
        self.world_size = world_size
        # Input positions of each example (L - 1): what a budget limits and what ranks balance (compute and
        # memory), masked-out targets included; the objective counts only valid targets (the Engine).
        self._positions = _Positions(examples)
        # Packed rows under a token budget: each row's attention work (its documents' squared lengths),
        # which ranks balance second. The micro_size layout splits by position and never reads it.
        self._attention = (examples.attention_work() if isinstance(examples, PackedExamples)
                           and micro_tokens is not None else None)
        # ((step, per-rank microbatches), ...): the two steps computed last, newest first. An immutable
        # tuple swapped in one assignment, so the prefetching thread and the training thread can
        # share it without a lock (a lost update only costs a recomputation of the same layout).
        self._layouts: tuple[tuple[int, list[list[np.ndarray]]], ...] = ()

    # -- layout --------------------------------------------------------------------------------

    def layout(self, step: int) -> list[list[np.ndarray]]:
        """Example ids of each microbatch of every rank at `step`, computed once per step: the cache
        keeps the two steps computed last, because the prefetching thread asks for step + 1 while the
        training thread still asks for this step."""
        cached = self._layouts
        for cached_step, ranks in cached:
            if cached_step == step:
                return ranks
        global_ids = self.plan.global_batch(step)
        if self.conversation_rows is not None:
            ranks = self._conversation_layout(global_ids)
        elif self.micro_tokens is None:
            ranks = [split_micro(rank_share(global_ids, rank, self.world_size), self.micro_batch_size)
                     for rank in range(self.world_size)]
        else:
            attention = None if self._attention is None else self._attention[global_ids]
            shares = balanced_shares(global_ids, self._positions[global_ids], self.world_size, attention)
            ranks = [budget_microbatches(share, self._positions[share], self.micro_tokens) for share in shares]
        self._layouts = ((step, ranks),) + cached[:1]
        return ranks

    def _conversation_layout(self, global_ids: np.ndarray) -> list[list[list[np.ndarray]]]:
        rows = self.conversation_rows.pack(global_ids, min_rows=self.world_size)
        widths = np.asarray([self.conversation_rows.width(row) for row in rows], dtype=np.int64)
        shares = balanced_shares(np.arange(len(rows), dtype=np.int64), widths, self.world_size)
        if self.micro_tokens is None:
            groups = [split_micro(share, self.micro_batch_size) for share in shares]
        else:
            groups = [budget_microbatches(share, widths[share], self.micro_tokens) for share in shares]
        return [[[rows[i] for i in group] for group in rank] for rank in groups]

    def rank_microbatches(self, step: int, rank: int) -> list[np.ndarray]:
        """Example ids of each microbatch of `rank` at `step`."""
        return self.layout(step)[rank]

    def microbatch_ids(self, step: int) -> list[np.ndarray]:
        """Example ids of each of this rank's microbatches."""
        return self.rank_microbatches(step, self.rank)

    def global_shapes(self, step: int) -> list[tuple[int, int]]:
        """(rows, padded width) of every microbatch of every rank: what the devices compute."""
        if self.conversation_rows is not None:
            width = self.conversation_rows.width
            return [(len(rows), max(width(row) for row in rows)) for micro in self.layout(step) for rows in micro]
        return [(len(ids), int(self._positions[ids].max())) for micro in self.layout(step) for ids in micro]

    def global_positions(self, step: int) -> int:
        """Input positions that hold a token in the step's microbatches of every rank: its examples'
        (or packed rows') own lengths, masked targets included, padding not."""
        return int(self._positions[self.plan.global_batch(step)].sum())

    def microbatches(self, step: int) -> list:
        collate = self.examples.collate if self.conversation_rows is None else self.conversation_rows.collate
        if self.labels is None:
            return [collate(ids) for ids in self.microbatch_ids(step)]
        return [(inputs, self.labels(ids, targets))
                for ids, (inputs, targets) in ((ids, collate(ids)) for ids in self.microbatch_ids(step))]

    def state_dict(self, step: int) -> dict:
        """The data cursor after `step` steps: global (samples seen; a mixture's per-source positions) and
        the epochs' order."""
        return self.plan.state_dict(step)

    def load_state_dict(self, state: dict, step: int, requested_order: str = "auto") -> None:
        """Continue from a checkpoint's cursor at `step` (its order; a mixture's per-source positions).
        `requested_order` (data.order) must be auto or the cursor's: a run keeps its epochs' order."""
        saved = state.get("order", LEGACY_ORDER)
        if requested_order not in ("auto", saved):
            raise DataError(f"data.order={requested_order}, but the checkpoint's run draws its epochs in the {saved} "
                            f"order; resume with data.order=auto (or {saved}), or start a new run")
        self.plan.load_state_dict(state, step)
        self._layouts = ()
