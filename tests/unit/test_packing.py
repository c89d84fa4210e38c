"""trainer_svc.packing: what each group computes once, and how rows fill packs."""

from __future__ import annotations

import itertools
import random

from trainer_svc.packing import (
    MIN_SHARED_PREFIX,
    Pack,
    PackRow,
    length_batches,
    plan_packs,
    shared_prefix_len,
)

PROMPT = list(range(100, 110))  # 10 tokens


def row(group: str, completion: list[int], prompt: list[int] = PROMPT) -> PackRow:
    return PackRow(group, prompt + completion, [0] * len(prompt) + [1] * len(completion))


def test_the_prefix_stops_one_token_before_the_first_loss_position() -> None:
    # Samples that also agree on their first sampled token still need that token's logits.
    rows = [row("g", [1, 2, 3]), row("g", [1, 5])]
    assert shared_prefix_len(rows) == len(PROMPT) - 1


def test_the_prefix_stops_where_samples_differ() -> None:
    other = [*PROMPT[:6], 999, *PROMPT[7:]]
    assert shared_prefix_len([row("g", [1]), row("g", [2], prompt=other)]) == 6


def test_short_or_lone_prefixes_are_not_shared() -> None:
    short = PROMPT[:MIN_SHARED_PREFIX]
    assert shared_prefix_len([row("g", [1], short), row("g", [2], short)]) == 0
    assert shared_prefix_len([row("g", [1])]) == 0


def test_packs_cover_every_row_once_within_the_budget() -> None:
    rows = [row("a", [1] * n) for n in (5, 2, 7, 3)] + [row("b", [2] * n) for n in (1, 4)]
    lengths = [len(r.token_ids) for r in rows]
    for budget in (1000, 40, 25):
        packs = plan_packs(rows, budget)
        assert sorted(i for p in packs for i in p.rows) == list(range(len(rows)))
        assert all(p.prefix_len == len(PROMPT) - 1 for p in packs)
        assert all(p.cost(lengths) <= budget for p in packs)
        for pack in packs:  # every row's prefix row is of its own group
            for index, prefix in zip(pack.rows, pack.prefix_of_row, strict=True):
                assert rows[pack.prefix_rows[prefix]].group == rows[index].group
    # All in one pack: two prefixes of 9, six rows padded to the longest suffix (1 + 7).
    (whole,) = plan_packs(rows, 1000)
    assert whole.cost(lengths) == 2 * 9 + 6 * 8 < sum(lengths)
    # Suffixes of 1 + (5, 2, 7, 3, 1, 4): worth one batch at the default overhead, padded to
    # 8 each; with none, a batch per length.
    assert whole.positions(lengths) == whole.cost(lengths)
    assert whole.padding(lengths) == 6 * 8 - (6 + 3 + 8 + 4 + 2 + 5)
    assert whole.positions(lengths, overhead=0) == 2 * 9 + (6 + 3 + 8 + 4 + 2 + 5)
    assert whole.padding(lengths, overhead=0) == 0


def test_without_sharing_packs_are_plain_batches_longest_first() -> None:
    rows = [row("a", [1] * n) for n in (5, 2, 7)]
    (pack,) = plan_packs(rows, 1000, share_prefixes=False)
    assert pack == Pack(prefix_len=0, rows=[2, 0, 1])


def _cost(lengths: list[int], batches: list[list[int]], overhead: int) -> int:
    return sum(len(b) * max(lengths[i] for i in b) + overhead for b in batches)


def test_length_batches_is_the_cheapest_split() -> None:
    """Against every split of every order, for small random inputs."""
    rng = random.Random(0)
    for _ in range(60):
        lengths = [rng.choice([3, 5, 20, 22, 60, 90]) for _ in range(rng.randint(1, 6))]
        overhead = rng.choice([0, 8, 32, 200])
        batches = length_batches(lengths, overhead)
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
        assert all(b for b in batches)
        best = min(
            _cost(lengths, _split(list(order), cuts), overhead)
            for order in itertools.permutations(range(len(lengths)))
            for cuts in itertools.product([False, True], repeat=len(lengths) - 1)
        )
        assert _cost(lengths, batches, overhead) == best


def _split(order: list[int], cuts: tuple[bool, ...]) -> list[list[int]]:
    batches = [[order[0]]]
    for index, cut in zip(order[1:], cuts, strict=True):
        if cut:
            batches.append([])
        batches[-1].append(index)
    return batches


def test_length_batches_at_the_extremes() -> None:
    assert length_batches([]) == []
    assert length_batches([4, 9, 4, 1], overhead=10**6) == [[1, 0, 2, 3]]
    assert length_batches([4, 9, 4, 1], overhead=0) == [[1], [0, 2], [3]]
