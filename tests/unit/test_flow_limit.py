"""The staleness bound's arithmetic: issued_groups < (trained_version + S + 1) * B."""

from __future__ import annotations

import itertools

import pytest

from common.state.flow import issue_limit


@pytest.mark.parametrize(
    ("trained_version", "max_staleness", "groups_per_step", "limit"),
    [
        (0, 0, 4, 4),  # on-policy: one step's worth of groups, then wait
        (1, 0, 4, 8),
        (0, 1, 4, 8),  # one version of run-ahead
        (3, 2, 2, 12),
        (0, 0, 1, 1),
    ],
)
def test_issue_limit(
    trained_version: int, max_staleness: int, groups_per_step: int, limit: int
) -> None:
    assert issue_limit(trained_version, max_staleness, groups_per_step) == limit


def test_each_trained_version_releases_exactly_one_step_of_groups() -> None:
    for staleness in range(4):
        limits = [issue_limit(v, staleness, 3) for v in range(6)]
        assert [b - a for a, b in itertools.pairwise(limits)] == [3] * 5
