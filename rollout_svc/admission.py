"""Which waiting rollout request gets the next engine slot: a fair queue over tenants.

The rule (docs/architecture.md, "Rollout admission"): the next slot goes to the next tenant in
turn that has a request waiting; within that tenant, to its job in turn; within that job, to
the request of its oldest group (then the oldest request). An episode's later turns come back
after the job has issued younger groups; taken in arrival order they waited behind those
groups' first turns, the younger groups completed first and trained the job on, and the older
group, started on an earlier version, outran the staleness bound and was dropped, its samples
wasted and the job's last step waiting for a replacement (bench/README.md, "Multi-task
speed-up"). A tenant with ten jobs, or a job with a long backlog, gets one turn per
round like every other tenant, so its backlog cannot sit ahead of another tenant's requests.
Within a tenant a job keeps its turn until what it had waiting when the turn began is taken:
a step's requests go into the engine together and its batch completes in one wave, instead
of every job of the tenant holding a few slots and none completing a step before the last
wave (the trainer, which waits for whole steps, then idled through the first round:
bench/README.md, "Multi-task speed-up"). Flow control bounds a job's backlog (G x B x
(S + 1) open episodes), and so the wait of the tenant's next job. A tenant (or job) whose
last request leaves drops out of the turn and rejoins at the back with its next one. A
tenant may be passed over while it holds its share of the slots (`pop(eligible)`: the
fair-share cap of the engine's slots, rollout_svc/slots.py). Pure bookkeeping: no I/O, no
waiting.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class FairQueue(Generic[T]):
    """Items by tenant and job, taken round-robin over tenants, then over a tenant's jobs by
    backlog (a job's turn takes what it had waiting when the turn began), within a job by
    rank, then first in first out."""

    def __init__(self) -> None:
        # Turn order is insertion order: the front tenant (job) is the next served, and one
        # whose turn is over moves to the back.
        self._tenants: OrderedDict[str, OrderedDict[str, list[tuple[int, int, T]]]] = OrderedDict()
        """Each job's items as a heap of (rank, arrival, item)."""
        self._arrivals = 0
        self._turn_left: dict[tuple[str, str], int] = {}
        """Items the job in its tenant's turn may still take in this turn."""
        self._size = 0

    def put(self, tenant: str, job_id: str, item: T, rank: int | None = None) -> None:
        """Queue `item`; within its job, lower ranks leave first (a group's index). None: the
        highest rank its job has waiting, so it leaves after what waits now (0 if nothing)."""
        jobs = self._tenants.setdefault(tenant, OrderedDict())
        items = jobs.setdefault(job_id, [])
        if rank is None:
            rank = max((waiting[0] for waiting in items), default=0)
        self._arrivals += 1
        heapq.heappush(items, (rank, self._arrivals, item))
        self._size += 1

    def pop(self, eligible: Callable[[str], bool] | None = None) -> T:
        """The next item by the rule, of the first tenant in turn that is `eligible` (default:
        any); IndexError when nothing waits, LookupError when no waiting tenant is eligible."""
        if not self._tenants:
            raise IndexError("pop from an empty FairQueue")
        tenant = next((t for t in self._tenants if eligible is None or eligible(t)), None)
        if tenant is None:
            raise LookupError("no waiting tenant is eligible")
        jobs = self._tenants[tenant]
        job_id, items = next(iter(jobs.items()))
        turn_left = self._turn_left.pop((tenant, job_id), len(items)) - 1
        _, _, item = heapq.heappop(items)
        self._size -= 1
        if not items:
            del jobs[job_id]
        elif turn_left > 0:
            self._turn_left[tenant, job_id] = turn_left
        else:
            jobs.move_to_end(job_id)
        if jobs:
            self._tenants.move_to_end(tenant)
        else:
            del self._tenants[tenant]
        return item

    def __len__(self) -> int:
        return self._size

    def job_ids(self) -> set[str]:
        """The jobs with an item waiting."""
        return {job for jobs in self._tenants.values() for job in jobs}

    def waiting_of(self, tenant: str) -> int:
        """Items waiting of one tenant."""
        return sum(len(items) for items in self._tenants.get(tenant, {}).values())

    def waiting(self) -> dict[str, int]:
        """Items waiting per tenant."""
        return {
            tenant: sum(len(items) for items in jobs.values())
            for tenant, jobs in self._tenants.items()
        }


def water_fill(demands: dict[str, int], slots: int) -> dict[str, int]:
    """Max-min fair shares of `slots` among tenants wanting `demands`: a tenant wanting less
    than an equal split gets what it wants, and what it leaves is split among the others, so
    no slot is kept from a tenant that could use it unless another tenant wants it."""
    shares: dict[str, int] = {}
    left = slots
    ordered = sorted(demands.items(), key=lambda item: item[1])
    for index, (tenant, demand) in enumerate(ordered):
        shares[tenant] = min(demand, -(-left // (len(ordered) - index)))
        left -= shares[tenant]
    return shares
