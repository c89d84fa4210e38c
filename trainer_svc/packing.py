"""Which trajectories go through the model together, and which prompt each group computes once.

All G samples of a group start with the same prompt (and a multi-turn group often with more),
but a plain batch pushes that prefix through the model G times: for the demo's arithmetic
job, 45 of each trajectory's 61 tokens. A `Pack` runs a shared prefix once per group, keeps
its keys and values (with their gradient), copies them to the group's rows, and runs only
the rows' own suffixes on top: the same logprobs and gradients as the plain batch, for
about 45 + 8 x 16 instead of 8 x 61 positions.

The shared prefix of a group is its rows' longest common prefix, cut one token before the
first loss position of any row: the position before a loss token yields that token's
logits, so it must be in the suffix. Groups are packed with others of the same prefix length
(no padding inside a prefix), rows longest first, within a token budget per pack. On top of
its prefixes a pack runs its rows' suffixes in batches of similar length (`length_batches`),
each padded only to its own longest.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

MIN_SHARED_PREFIX = 4
"""Shorter common prefixes are not worth a second forward pass."""
SUB_BATCH_OVERHEAD = 32
"""What one more pass over a pack's suffixes costs, in positions: a batch of fewer rows runs its
matmuls a little slower, and every layer is one more call."""


@dataclass(frozen=True)
class PackRow:
    """One trajectory as packing sees it."""

    group: Hashable
    """Rows of one group (same job and group id) may share a prefix."""
    token_ids: Sequence[int]
    loss_mask: Sequence[int]


@dataclass
class Pack:
    """Rows run through the model together, on top of prefixes computed once per group."""

    prefix_len: int
    """Tokens computed once per prefix row (0: no shared prefix, a plain batch)."""
    rows: list[int] = field(default_factory=list)
    """Indices of the step's rows in this pack."""
    prefix_rows: list[int] = field(default_factory=list)
    """One row per group in the pack whose first `prefix_len` tokens stand for the group's."""
    prefix_of_row: list[int] = field(default_factory=list)
    """For each of `rows`, its group's position in `prefix_rows`."""

    def cost(self, lengths: Sequence[int]) -> int:
        """Positions the pack puts through the model: prefixes + padded suffixes."""
        if not self.rows:
            return 0
        longest_suffix = max(lengths[i] for i in self.rows) - self.prefix_len
        return self.prefix_len * len(self.prefix_rows) + len(self.rows) * longest_suffix

    def positions(self, lengths: Sequence[int], overhead: int = SUB_BATCH_OVERHEAD) -> int:
        """Positions the pack's passes compute: prefixes + suffixes, in batches of similar
        length (`length_batches`), each padded to its longest."""
        suffixes = [lengths[i] - self.prefix_len for i in self.rows]
        batches = length_batches(suffixes, overhead)
        return self.prefix_len * len(self.prefix_rows) + sum(
            len(batch) * max(suffixes[i] for i in batch) for batch in batches
        )

    def padding(self, lengths: Sequence[int], overhead: int = SUB_BATCH_OVERHEAD) -> int:
        """Of `positions`, those that only pad a suffix to its batch's longest."""
        real = self.prefix_len * len(self.prefix_rows) + sum(
            lengths[i] - self.prefix_len for i in self.rows
        )
        return self.positions(lengths, overhead) - real


def length_batches(lengths: Sequence[int], overhead: int = SUB_BATCH_OVERHEAD) -> list[list[int]]:
    """Indices of `lengths` in batches, longest first, each batch padded to its own longest:
    the split with the fewest padded positions + `overhead` per batch.

    A multi-turn group's suffixes differ several-fold (an answer in one turn, or a tool call,
    its result and a second turn): padded to the longest together, a third of a calculator
    step's positions were padding (bench/README.md). Exact: with the rows sorted, the best
    split is contiguous, found by dynamic programming over where each batch ends."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    # best[j]: the least cost of the first j rows; cut[j]: where the last of its batches begins.
    best = [0] + [0] * len(order)
    cut = [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):
        best[end], cut[end] = min(
            (best[start] + (end - start) * lengths[order[start]] + overhead, start)
            for start in range(end)
        )
    batches: list[list[int]] = []
    end = len(order)
    while end > 0:
        batches.append(order[cut[end] : end])
        end = cut[end]
    return batches[::-1]


def shared_prefix_len(rows: Sequence[PackRow]) -> int:
    """Tokens all `rows` share that precede every row's first loss position but one."""
    if len(rows) < 2:
        return 0
    first, others = rows[0].token_ids, rows[1:]
    common = len(first)
    for row in others:
        common = min(common, len(row.token_ids))
        for index in range(common):
            if row.token_ids[index] != first[index]:
                common = index
                break
    first_loss = min(
        next((i for i, m in enumerate(row.loss_mask) if m), len(row.loss_mask)) for row in rows
    )
    shared = min(common, first_loss - 1)
    return shared if shared >= MIN_SHARED_PREFIX else 0


def plan_packs(
    rows: Sequence[PackRow], budget_tokens: int, *, share_prefixes: bool = True
) -> list[Pack]:
    """Packs covering every row once, each within `budget_tokens` positions where possible
    (a single row longer than the budget gets a pack of its own). `share_prefixes` False
    gives plain batches only."""
    lengths = [len(row.token_ids) for row in rows]
    groups: dict[Hashable, list[int]] = defaultdict(list)
    for index, row in enumerate(rows):
        groups[row.group].append(index)
    by_prefix: dict[int, list[list[int]]] = defaultdict(list)
    for members in groups.values():
        prefix_len = shared_prefix_len([rows[i] for i in members]) if share_prefixes else 0
        by_prefix[prefix_len].append(sorted(members, key=lambda i: -lengths[i]))
    packs: list[Pack] = []
    for prefix_len in sorted(by_prefix, reverse=True):
        # Longest groups first; within a group longest rows first, so a pack's first row
        # sets its padded suffix length.
        ordered = sorted(by_prefix[prefix_len], key=lambda members: -lengths[members[0]])
        if prefix_len == 0:  # nothing shared: one plain batch order, longest rows first
            ordered = [sorted((i for m in ordered for i in m), key=lambda i: -lengths[i])]
        current = Pack(prefix_len)
        for members in ordered:
            for index in members:
                if not _fits(current, index, members, lengths, budget_tokens):
                    packs.append(current)
                    current = Pack(prefix_len)
                _add(current, index, members)
        if current.rows:
            packs.append(current)
    return packs


def _fits(pack: Pack, index: int, members: list[int], lengths: Sequence[int], budget: int) -> bool:
    if not pack.rows:
        return True
    trial = Pack(pack.prefix_len, list(pack.rows), list(pack.prefix_rows), list(pack.prefix_of_row))
    _add(trial, index, members)
    return trial.cost(lengths) <= budget


def _add(pack: Pack, index: int, members: list[int]) -> None:
    # A group's rows may be split over packs: each pack computes the prefix it needs.
    if pack.prefix_len == 0:
        pack.rows.append(index)
        return
    leader = next((r for r in pack.prefix_rows if r in members), None)
    if leader is None:
        pack.prefix_rows.append(index)
        leader = index
    pack.rows.append(index)
    pack.prefix_of_row.append(pack.prefix_rows.index(leader))
