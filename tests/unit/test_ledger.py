"""common.state.audit: the accounting of a job's groups from its audit ledger."""

from __future__ import annotations

import pytest

from common.state.audit import audit
from common.state.flow import group_index_of

JOB = "acme-job"


def issued(*indices: int) -> list[dict[str, str]]:
    return [{"kind": "issued", "group": str(i), "version": "0"} for i in indices]


def trained(version: int, *indices: int) -> dict[str, str]:
    groups = " ".join(f"{JOB}/g{i}" for i in indices)
    return {"kind": "trained", "version": str(version), "epoch": "1", "groups": groups}


def dropped(index: int) -> dict[str, str]:
    return {"kind": "dropped", "group": f"{JOB}/g{index}", "reason": "dropped_stale"}


CLEAN = [*issued(0, 1, 2), trained(1, 0, 1), dropped(2), *issued(3, 4), trained(2, 3, 4)]


def test_a_clean_ledger_accounts_for_every_group() -> None:
    report = audit(
        JOB,
        CLEAN,
        status="completed",
        groups_per_step=2,
        pointer_version=2,
        checkpoint_version=2,
        announced_version=2,
    )
    assert report.ok, report.problems
    assert (report.issued, report.trained_groups, report.dropped, report.versions) == (5, 4, 1, 2)


@pytest.mark.parametrize(
    ("entries", "status", "problem"),
    [
        ([*CLEAN, *issued(5)], "completed", f"lost: {JOB}/g5 issued, never trained or dropped"),
        ([*CLEAN, trained(3, 0, 1)], "completed", f"{JOB}/g0 trained twice"),
        ([*CLEAN, dropped(0)], "completed", f"{JOB}/g0 trained and dropped"),
        ([*CLEAN, dropped(9)], "completed", f"{JOB}/g9 ended but was never issued"),
        ([*CLEAN, *issued(5, 6), trained(2, 5, 6)], "running", "v2 trained 2 times"),
        ([*issued(0, 1), trained(1, 0)], "running", "v1 trained 1 groups, not B = 2"),
        ([*issued(0, 1, 2, 3), trained(2, 0, 1)], "running", "are not 1..2"),
        (CLEAN, "completed", "the latest checkpoint is at v3"),
    ],
)
def test_what_the_audit_catches(entries: list[dict[str, str]], status: str, problem: str) -> None:
    report = audit(
        JOB,
        entries,
        status=status,
        groups_per_step=2,
        pointer_version=max(
            (int(e["version"]) for e in entries if e["kind"] == "trained"), default=0
        ),
        checkpoint_version=3 if entries is CLEAN else None,
    )
    assert not report.ok
    assert any(problem in p for p in report.problems), report.problems


def test_groups_in_flight_are_not_lost_while_the_job_runs() -> None:
    report = audit(
        JOB,
        [*CLEAN, *issued(5)],
        status="running",
        groups_per_step=2,
        pointer_version=2,
        checkpoint_version=3,
        announced_version=1,
    )
    assert report.ok and report.in_flight == [5] and report.lost == []


def test_group_ids_belong_to_their_job() -> None:
    assert group_index_of(JOB, f"{JOB}/g12") == 12 and group_index_of(JOB, f"{JOB}/g0") == 0
    for not_ours in ("other/g1", f"{JOB}/gx", f"{JOB}/g05", f"{JOB}/g", f"{JOB}/g\u0661", "g1"):
        assert group_index_of(JOB, not_ours) is None, not_ours
