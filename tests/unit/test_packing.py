"""trainer_svc.packing: what each group computes once, and how rows fill packs."""

from __future__ import annotations

from trainer_svc.packing import MIN_SHARED_PREFIX, Pack, PackRow, plan_packs, shared_prefix_len

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


def test_without_sharing_packs_are_plain_batches_longest_first() -> None:
    rows = [row("a", [1] * n) for n in (5, 2, 7)]
    (pack,) = plan_packs(rows, 1000, share_prefixes=False)
    assert pack == Pack(prefix_len=0, rows=[2, 0, 1])
