"""The audit ledger: what happened to every group of a job, and whether it adds up.

Each effect on a group appends one entry to the job's Redis stream `ledger:{job}`, written by
the same Lua script as the effect itself, so the ledger cannot miss an effect or record one
that did not happen:

- `issued`  (env_svc's claim script): group index, the trained version it waits for
- `sent`    (env_svc, once the group's G first requests are on the bus; again on a re-send)
- `trained` (trainer_svc's publish script): version, fencing epoch, the group ids
- `dropped` (trainer_svc's drop script, once per group id): group id, drop kind

A Redis stream rather than a compacted Kafka topic: every effect it records is already a Redis
script, and a stream entry written inside that script is atomic with it; a Kafka record
would be a second write that a crash could separate from the effect.

`audit` checks the accounting (tests, `marlaas audit`, the chaos verifier): every issued
group ends exactly once (trained or dropped), no group is trained twice or trained and
dropped, nothing ends that was never issued, each version trained exactly B groups, versions
are 1..n, each once, and the pointer / checkpoint / last `AdapterUpdate` agree with the last
trained version.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from common.state.flow import group_index_of


@dataclass
class Audit:
    job_id: str
    status: str
    issued: int = 0
    trained_groups: int = 0
    dropped: int = 0
    versions: int = 0
    in_flight: list[int] = field(default_factory=list)
    """Issued groups with no final entry yet (lost, if the job completed)."""
    lost: list[int] = field(default_factory=list)
    double_trained: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, object]:
        return {**self.__dict__, "ok": self.ok}

    @classmethod
    def from_json(cls, fields: Mapping[str, Any]) -> Audit:
        """The audit `to_json` wrote (a job's summary, kept after its ledger expired)."""
        return cls(**{name: value for name, value in fields.items() if name != "ok"})


def audit(
    job_id: str,
    entries: Sequence[Mapping[str, str]],
    *,
    status: str,
    groups_per_step: int,
    pointer_version: int,
    checkpoint_version: int | None = None,
    announced_version: int | None = None,
) -> Audit:
    """Account for every group of one job from its ledger `entries` (oldest first).

    `checkpoint_version` / `announced_version`: the newest checkpoint and `AdapterUpdate`
    (None: not checked, e.g. the artifact store is not reachable from here); compared with
    the ledger once the job has ended.
    """
    report = Audit(job_id, status)
    tally = _Tally()
    for entry in entries:
        tally.add(report, entry, groups_per_step)
    report.issued = len(tally.issued)
    report.trained_groups = sum(tally.trained.values())
    report.versions = len(tally.versions)
    _account_groups(report, tally)
    _check_versions(report, tally.versions)
    # The pointer moves in the same script as its ledger entry; the checkpoint (saved just
    # before) and the announcement (sent just after) may differ by a step while it trains.
    finished = status not in ("pending", "running", "paused")
    last = max(tally.versions, default=0)
    for name, value in (
        ("the adapter pointer", pointer_version),
        ("the latest checkpoint", checkpoint_version if finished else None),
        ("the last AdapterUpdate", announced_version if finished else None),
    ):
        if value is not None and value != last:
            report.problems.append(f"{name} is at v{value}, the ledger's last version is v{last}")
    return report


@dataclass
class _Tally:
    """What a job's ledger entries add up to, per group index and per trained version."""

    issued: set[int] = field(default_factory=set)
    ends: Counter[int] = field(default_factory=Counter)
    """Final entries (trained or dropped) of each group index."""
    trained: Counter[int] = field(default_factory=Counter)
    versions: Counter[int] = field(default_factory=Counter)
    """`trained` entries of each version."""

    def add(self, report: Audit, entry: Mapping[str, str], groups_per_step: int) -> None:
        """Count one ledger entry; what cannot be counted goes to `report`."""
        kind = entry.get("kind")
        if kind == "issued":
            self.issued.add(int(entry["group"]))
        elif kind == "trained":
            version = int(entry["version"])
            groups = entry.get("groups", "").split()
            self.versions[version] += 1
            if len(groups) != groups_per_step:
                report.problems.append(
                    f"v{version} trained {len(groups)} groups, not B = {groups_per_step}"
                )
            for group_id in groups:
                index = _index_or_note(report, report.job_id, group_id, "trained")
                if index is not None:
                    self.trained[index] += 1
                    self.ends[index] += 1
        elif kind == "dropped":
            index = _index_or_note(report, report.job_id, entry["group"], "dropped")
            if index is not None:
                self.ends[index] += 1
                report.dropped += 1


def _account_groups(report: Audit, tally: _Tally) -> None:
    """Every issued group ends exactly once, and nothing ends that was never issued; a group
    not ended yet is in flight, or lost once the job completed."""
    job_id = report.job_id
    for index in sorted(tally.ends.keys() - tally.issued):
        report.unexpected.append(f"{job_id}/g{index} ended but was never issued")
    for index in sorted(tally.issued):
        if tally.ends[index] > 1:
            what = "trained twice" if tally.trained[index] > 1 else "trained and dropped"
            report.double_trained.append(f"{job_id}/g{index} {what}")
        elif tally.ends[index] == 0:
            report.in_flight.append(index)
    if report.status == "completed":
        report.lost, report.in_flight = report.in_flight, []
    report.problems += [
        f"lost: {job_id}/g{i} issued, never trained or dropped" for i in report.lost
    ]
    report.problems += report.double_trained + report.unexpected


def _check_versions(report: Audit, versions: Counter[int]) -> None:
    """The trained versions are 1..n, each trained once."""
    report.problems += [f"v{v} trained {n} times" for v, n in sorted(versions.items()) if n > 1]
    last = max(versions, default=0)
    if sorted(versions) != list(range(1, last + 1)):
        report.problems.append(f"trained versions {sorted(versions)} are not 1..{last}")


def _index_or_note(report: Audit, job_id: str, group_id: str, kind: str) -> int | None:
    index = group_index_of(job_id, group_id)
    if index is None:
        report.unexpected.append(f"{kind} {group_id!r}, which is not a group of {job_id}")
    return index
