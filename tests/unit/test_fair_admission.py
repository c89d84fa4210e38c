"""Fair rollout admission (issue 14): one tenant's backlog cannot sit ahead of another's.

The rule itself (`rollout_svc/admission.py`), then rollout_svc's handler on the in-memory bus
and store with an engine that lets each request out when the test says, so every admission
is decided by the service and none by timing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec
import pytest

from common.runtime.config import RolloutSettings, SharedSettings
from common.wire.adapters import AdapterRef
from common.wire.messages import GenerationRequest, GenerationResult, JobSpec, Topic, result_for
from rollout_svc.admission import FairQueue, water_fill
from rollout_svc.intake import READ_AHEAD_PER_SLOT
from rollout_svc.service import RolloutService
from tests.fakes import Inbox, MemoryBackend, memory_backend
from tests.handler_kit import GatedEngine, job_spec, request_for

# --- the rule ----------------------------------------------------------------------------


def drain(queue: FairQueue[str]) -> list[str]:
    return [queue.pop() for _ in range(len(queue))]


def test_tenants_take_turns_whatever_their_backlog() -> None:
    queue: FairQueue[str] = FairQueue()
    for index in range(6):
        queue.put("acme", "a1", f"acme-{index}")
    queue.put("globex", "g1", "globex-0")
    queue.put("globex", "g1", "globex-1")
    queue.put("", "unregistered", "nobody-0")  # a tenant of its own
    assert len(queue) == 9
    assert queue.waiting() == {"acme": 6, "globex": 2, "": 1}
    assert drain(queue) == [
        "acme-0",
        "globex-0",
        "nobody-0",
        "acme-1",
        "globex-1",
        "acme-2",
        "acme-3",
        "acme-4",
        "acme-5",
    ]
    assert len(queue) == 0 and queue.waiting() == {}


def test_a_tenants_jobs_take_turns_by_backlog_and_each_job_is_first_in_first_out() -> None:
    queue: FairQueue[str] = FairQueue()
    for job in ("a1", "a2", "a3"):
        for index in range(2):
            queue.put("acme", job, f"{job}-{index}")
    queue.put("globex", "g1", "g1-0")
    # Tenants alternate item by item; within acme, a job's turn takes its whole backlog, so
    # a1's step is admitted whole before a2's begins.
    assert drain(queue) == ["a1-0", "g1-0", "a1-1", "a2-0", "a2-1", "a3-0", "a3-1"]


def test_a_jobs_turn_takes_what_waited_when_it_began_and_no_more() -> None:
    queue: FairQueue[str] = FairQueue()
    for index in range(2):
        queue.put("acme", "a1", f"a1-{index}")
    queue.put("acme", "a2", "a2-0")
    assert queue.pop() == "a1-0"  # a1's turn: its two waiting items
    queue.put("acme", "a1", "a1-2")  # arrives during the turn: waits for a1's next one
    assert drain(queue) == ["a1-1", "a2-0", "a1-2"]


def test_within_a_job_the_oldest_group_goes_first() -> None:
    """An episode's second turn of group 5 arrives after group 6's first turns: it goes first,
    so the older group completes before it outruns the staleness bound."""
    queue: FairQueue[str] = FairQueue()
    for sample in range(2):
        queue.put("acme", "a1", f"g6-t0-{sample}", rank=6)
    queue.put("acme", "a1", "g5-t1-0", rank=5)
    queue.put("acme", "a1", "eval-v1", rank=None)  # with the newest group waiting, after it
    queue.put("acme", "a1", "g5-t1-1", rank=5)
    assert drain(queue) == ["g5-t1-0", "g5-t1-1", "g6-t0-0", "g6-t0-1", "eval-v1"]
    queue.put("acme", "a1", "eval-v2")  # nothing waits: rank 0
    queue.put("acme", "a1", "g7-t0-0", rank=7)
    assert drain(queue) == ["eval-v2", "g7-t0-0"]


def test_a_tenant_that_ran_out_rejoins_at_the_back() -> None:
    queue: FairQueue[str] = FairQueue()
    queue.put("acme", "a1", "acme-0")
    queue.put("globex", "g1", "globex-0")
    assert queue.pop() == "acme-0"  # acme leaves the turn
    queue.put("initech", "i1", "initech-0")
    queue.put("acme", "a1", "acme-1")  # behind initech, who was waiting
    assert drain(queue) == ["globex-0", "initech-0", "acme-1"]


def test_shares_are_max_min_fair_over_the_tenants_demands() -> None:
    assert water_fill({"acme": 400, "globex": 8}, 16) == {"globex": 8, "acme": 8}
    assert water_fill({"acme": 400, "globex": 8}, 64) == {"globex": 8, "acme": 56}
    assert water_fill({"a": 30, "b": 30, "c": 3}, 64) == {"c": 3, "a": 30, "b": 30}
    assert water_fill({"a": 100, "b": 100, "c": 100}, 64) == {"a": 22, "b": 21, "c": 21}
    assert water_fill({}, 64) == {}


def test_an_empty_queue_has_nothing_to_pop() -> None:
    with pytest.raises(IndexError):
        FairQueue[str]().pop()


# --- rollout_svc -------------------------------------------------------------------------


class TurnstileEngine(GatedEngine):
    """Records the order in which requests enter; each stays until the test lets it out."""

    def __init__(self) -> None:
        super().__init__()
        self.entered: list[GenerationRequest] = []
        self._entry = asyncio.Event()
        self._exits: dict[str, asyncio.Event] = {}

    async def generate(
        self, request: GenerationRequest, adapter: AdapterRef | None = None
    ) -> GenerationResult:
        exit_ = self._exits[request.request_id] = asyncio.Event()
        self.entered.append(request)
        self._entry.set()
        self.in_flight += 1
        await exit_.wait()
        self.in_flight -= 1
        return result_for(
            request,
            completion_token_ids=[7],
            logprobs=[-0.5],
            adapter_version=0,
            finish_reason="stop",
        )

    def let_out(self, request: GenerationRequest) -> None:
        self._exits[request.request_id].set()

    async def until_entered(self, count: int) -> None:
        """Until `count` requests have entered (a hang guard, not a measure)."""

        async def wait() -> None:
            while len(self.entered) < count:
                self._entry.clear()
                await self._entry.wait()

        await asyncio.wait_for(wait(), 10)


def service_with(backend: MemoryBackend, engine: TurnstileEngine, slots: int) -> RolloutService:
    return RolloutService(
        SharedSettings(),
        RolloutSettings(max_in_flight=slots),
        engine,
        producer=backend.producer,
        store=backend.store,
    )


def spec_of(name: str, tenant: str) -> JobSpec:
    spec = job_spec(name, group_size=2, groups_per_step=1, max_staleness=0, max_steps=1)
    return msgspec.structs.replace(spec, tenant=tenant)


async def registered(backend: MemoryBackend, *specs: JobSpec) -> None:
    for spec in specs:
        assert await backend.store.jobs.register(spec)


async def read(prompts: Inbox, service: RolloutService, requests: list[GenerationRequest]) -> None:
    """Hand `requests` to the service as the poll loop would, in order; each handler must
    return without any request leaving the engine (the timeout only guards against a hang)."""

    async def each() -> None:
        for request in requests:
            await prompts.hand(service.on_request, request)

    await asyncio.wait_for(each(), 10)


async def stopped(service: RolloutService, engine: TurnstileEngine) -> None:
    """Stop the replica, letting out every request in the engine; nothing more enters."""
    service.request_stop()
    for request in engine.entered:
        engine.let_out(request)
    await asyncio.wait_for(service.stop(), 10)


async def test_a_tenants_backlog_does_not_sit_ahead_of_another_tenants_requests() -> None:
    """acme floods marlaas.prompts with 10 jobs x 40 requests, then globex sends 8. In arrival
    order (the replica before issue 14) globex's first request entered the engine 401st, and
    the poll loop could not even read it while acme's backlog held every slot. Now every slot
    that frees goes to globex until it has none waiting (acme holds more than its share)."""
    slots = 32  # a read-ahead of 16 x 32 = 512 holds everything below
    async with memory_backend() as backend:
        acme = [spec_of(f"acme{index}", "acme") for index in range(10)]
        globex = spec_of("globex", "globex")
        await registered(backend, *acme, globex)
        tenant_of = {spec.job_id: spec.tenant for spec in (*acme, globex)}
        engine = TurnstileEngine()
        service = service_with(backend, engine, slots)
        prompts = Inbox(Topic.PROMPTS)
        arrivals = [request_for(spec.job_id, index, 0) for spec in acme for index in range(40)]
        arrivals += [request_for(globex.job_id, index, 0) for index in range(8)]
        await read(prompts, service, arrivals)  # all 408: 32 in the engine, 376 waiting
        await engine.until_entered(slots)
        for admitted in range(slots, slots + 24):  # free one slot at a time, oldest first
            engine.let_out(engine.entered[admitted - slots])
            await engine.until_entered(admitted + 1)
        tenants = [tenant_of[request.job_id] for request in engine.entered]
        assert tenants[:slots] == ["acme"] * slots  # acme was alone when they were read
        # Every freed slot goes to globex while it waits; then, globex wanting no more than
        # its 8, the rest are acme's again (no slot is kept from a tenant that can use it).
        assert tenants[slots:] == ["globex"] * 8 + ["acme"] * 16
        # Within acme's turns its jobs take turns by backlog, each job in its own order:
        # acme0's eight waiting requests, then acme1's.
        acme_after_fill = [r for r in engine.entered[slots:] if tenant_of[r.job_id] == "acme"]
        assert [r.job_id for r in acme_after_fill] == [acme[0].job_id] * 8 + [acme[1].job_id] * 8
        assert [r.request_id for r in acme_after_fill if r.job_id == acme[0].job_id] == [
            f"{acme[0].job_id}/{index}/0/t0" for index in range(32, 40)
        ]
        # Results go out and commits move as before: only past what was sent.
        assert prompts.committable == 24
        assert await backend.sent(Topic.ROLLOUTS, globex.job_id, expect=0) == []
        await stopped(service, engine)
        assert len(await backend.sent(Topic.ROLLOUTS, globex.job_id, expect=8)) == 8
        assert prompts.committable == 48  # acme0's 40 and acme1's 0..7 sent, its 8 never started


async def test_the_tenant_a_request_carries_is_the_one_admission_uses() -> None:
    """Schema 4: env_svc puts the job's tenant on the request, and rollout_svc queues it under
    that tenant without reading the job record. Here the registry says all three jobs are
    tenant "one"'s; the requests say a1 and a2 are acme's and g1 globex's."""
    async with memory_backend() as backend:
        specs = {name: spec_of(name, "one") for name in ("a1", "a2", "g1")}
        await registered(backend, *specs.values())
        engine = TurnstileEngine()
        service = service_with(backend, engine, 1)
        carried = [
            msgspec.structs.replace(request_for(specs[name].job_id, index, 0), tenant=tenant)
            for name, tenant in {"a1": "acme", "a2": "acme", "g1": "globex"}.items()
            for index in range(2)
        ]
        await read(Inbox(Topic.PROMPTS), service, carried)
        await engine.until_entered(1)
        assert service.slots.tenant_in_engine == {"acme": 1}
        assert service.slots.waiting.waiting() == {"acme": 3, "globex": 2}
        # An older writer's request (no tenant) is queued under its job's registry tenant.
        old = spec_of("o1", "one")
        await registered(backend, old)
        await read(Inbox(Topic.PROMPTS), service, [request_for(old.job_id, 0, 0)])
        assert service.slots.waiting.waiting() == {"acme": 3, "globex": 2, "one": 1}
        await stopped(service, engine)


async def test_an_older_groups_later_turn_enters_before_younger_groups_first_turns() -> None:
    """Group 5's second turn comes back after groups 6 and 7 were issued; it takes the next
    free slot. In arrival order it entered last, and with a staleness bound group 5 was
    dropped once 6 and 7 had trained the job on."""
    async with memory_backend() as backend:
        spec = spec_of("turns", "acme")
        await registered(backend, spec)
        engine = TurnstileEngine()
        service = service_with(backend, engine, slots=1)
        second_turn = msgspec.structs.replace(
            request_for(spec.job_id, 5, 0), request_id=f"{spec.job_id}/5/0/t1", turn=1
        )
        arrivals = [request_for(spec.job_id, index, 0) for index in (4, 6, 7)] + [second_turn]
        await read(Inbox(Topic.PROMPTS), service, arrivals)
        for entered in range(1, len(arrivals)):
            await engine.until_entered(entered)
            engine.let_out(engine.entered[-1])
        await engine.until_entered(len(arrivals))
        assert [r.request_id.removeprefix(spec.job_id) for r in engine.entered] == [
            "/4/0/t0",
            "/5/0/t1",
            "/6/0/t0",
            "/7/0/t0",
        ]
        await stopped(service, engine)


async def test_the_poll_loop_waits_while_the_read_ahead_is_full() -> None:
    async with memory_backend() as backend:
        spec = spec_of("flood", "acme")
        await registered(backend, spec)
        engine = TurnstileEngine()
        service = service_with(backend, engine, slots=1)
        prompts = Inbox(Topic.PROMPTS)
        full = [request_for(spec.job_id, index, 0) for index in range(1 + READ_AHEAD_PER_SLOT)]
        await read(prompts, service, full)  # one in the engine, a full read-ahead waiting
        reading = asyncio.create_task(
            prompts.hand(service.on_request, request_for(spec.job_id, 99, 0))
        )
        await engine.until_entered(1)
        await asyncio.sleep(0)  # a handler that did not wait would be done by now
        assert not reading.done() and len(service.slots.waiting) == READ_AHEAD_PER_SLOT

        engine.let_out(engine.entered[0])  # a slot frees: one request in, one more read
        await asyncio.wait_for(reading, 10)
        await engine.until_entered(2)
        assert len(service.slots.waiting) == READ_AHEAD_PER_SLOT
        assert prompts.committable == 1
        await stopped(service, engine)


async def test_a_stop_leaves_the_waiting_requests_uncommitted() -> None:
    """The requests in the engine finish and are committed; those still waiting are not
    started and keep their offsets held, so the partition's next owner reads them again."""
    async with memory_backend() as backend:
        acme, globex = spec_of("acme", "acme"), spec_of("globex", "globex")
        await registered(backend, acme, globex)
        engine = TurnstileEngine()
        service = service_with(backend, engine, slots=1)
        prompts = Inbox(Topic.PROMPTS)
        await read(
            prompts,
            service,
            [
                request_for(spec.job_id, index, 0)
                for index in range(READ_AHEAD_PER_SLOT // 2)
                for spec in (acme, globex)
            ]
            + [request_for(acme.job_id, 99, 0)],
        )
        assert len(service.slots.waiting) == READ_AHEAD_PER_SLOT
        # The read-ahead is full: the next record holds the poll loop until a stop lets it go.
        reading = asyncio.create_task(
            prompts.hand(service.on_request, request_for(globex.job_id, 99, 0))
        )
        await engine.until_entered(1)
        await asyncio.sleep(0)
        assert not reading.done()

        service.request_stop()
        await asyncio.wait_for(reading, 10)
        engine.let_out(engine.entered[0])
        await asyncio.wait_for(service.stop(), 10)

        assert [r.request_id for r in engine.entered] == [f"{acme.job_id}/0/0/t0"]
        assert prompts.committable == 1  # offsets 1..17 stay held: read again after a restart
        assert prompts.tracker.held == 1 + READ_AHEAD_PER_SLOT
        assert len(await backend.sent(Topic.ROLLOUTS, acme.job_id, expect=1)) == 1
        assert await backend.sent(Topic.ROLLOUTS, globex.job_id, expect=0) == []


# --- a whole job's time, in engine rounds ----------------------------------------------------


class RoundEngine(GatedEngine):
    """Every request in the engine finishes at the next round (a batched decode step); the
    test counts rounds, a clock no other process on the machine can slow down."""

    def __init__(self, on_done: Callable[[GenerationRequest], None]) -> None:
        super().__init__()
        self._round: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._on_done = on_done

    async def generate(
        self, request: GenerationRequest, adapter: AdapterRef | None = None
    ) -> GenerationResult:
        self.in_flight += 1
        await asyncio.shield(self._round)
        self.in_flight -= 1
        self._on_done(request)
        return result_for(
            request,
            completion_token_ids=[7],
            logprobs=[-0.5],
            adapter_version=0,
            finish_reason="stop",
        )

    async def next_round(self) -> None:
        finished, self._round = self._round, asyncio.get_running_loop().create_future()
        finished.set_result(None)
        for _ in range(20):  # let the results go out, the slots free and new requests in
            await asyncio.sleep(0)


async def rounds_until_done(*, with_flood: bool) -> int:
    """Rounds until globex's job (4 steps of G x B = 8 episodes, a step's episodes issued
    when the previous step's are back, as flow control with S = 0 does) has all its results,
    alone or beside acme's 10 jobs, each keeping its quota-sized window of 16 open requests
    full (a finished request is replaced at once: acme's jobs never run out of work)."""
    slots, steps, per_step, acme_window = 16, 4, 8, 16
    async with memory_backend() as backend:
        globex = spec_of("globex-job", "globex")
        acme = [spec_of(f"acme-job{index}", "acme") for index in range(10 if with_flood else 0)]
        await registered(backend, globex, *acme)
        prompts = Inbox(Topic.PROMPTS)
        issued = dict.fromkeys([globex.job_id, *(spec.job_id for spec in acme)], 0)
        pending: list[GenerationRequest] = []
        open_in_step = per_step

        def issue(job_id: str) -> None:
            pending.append(request_for(job_id, issued[job_id], 0))
            issued[job_id] += 1

        def on_done(request: GenerationRequest) -> None:
            nonlocal open_in_step
            if request.job_id != globex.job_id:
                issue(request.job_id)  # acme's window stays full
                return
            open_in_step -= 1
            if open_in_step == 0 and issued[globex.job_id] < steps * per_step:
                open_in_step = per_step
                for _ in range(per_step):
                    issue(globex.job_id)

        engine = RoundEngine(on_done)
        service = service_with(backend, engine, slots)  # type: ignore[arg-type]
        for spec in acme:  # acme's backlog is read first
            for _ in range(acme_window):
                issue(spec.job_id)
        for _ in range(per_step):
            issue(globex.job_id)
        rounds = 0
        while True:
            batch, pending[:] = list(pending), []
            await read(prompts, service, batch)
            if open_in_step == 0 or rounds > 1000:
                break
            await engine.next_round()
            rounds += 1
        service.request_stop()
        await engine.next_round()
        await asyncio.wait_for(service.stop(), 10)
        return rounds


async def test_a_tenants_job_finishes_in_its_time_alone_beside_another_tenants_flood() -> None:
    """Issue 14's fairness check: acme runs 10 jobs at its quota's edge, globex one; globex's
    job takes at most 1.5x the engine rounds it takes alone. Measured: 5 rounds against 4. In
    arrival order it took 42 (each step's 8 requests queued behind acme's 160); with tenants
    taking turns but no share cap, 8 (acme refilled every freed slot while globex was
    between two steps)."""
    alone = await rounds_until_done(with_flood=False)
    beside = await rounds_until_done(with_flood=True)
    assert alone == 4  # one round per step: its 8 requests fit the engine's 16 slots
    assert beside <= 1.5 * alone, (alone, beside)


async def test_a_judges_request_waits_its_tenants_turn_in_a_rollout_slot() -> None:
    """A chat request made for a job (a judged reward's, env_svc/judge.py) is queued as that
    job's tenant's beside the rollouts, not in the endpoint's own slots: with acme's backlog
    holding the one slot, globex's judge goes in next, before acme's waiting requests."""
    async with memory_backend() as backend:
        acme, globex = spec_of("a1", "acme"), spec_of("g1", "globex")
        await registered(backend, acme, globex)
        engine = TurnstileEngine()
        service = service_with(backend, engine, 1)
        await read(
            Inbox(Topic.PROMPTS), service, [request_for(acme.job_id, i, 0) for i in range(3)]
        )
        await engine.until_entered(1)
        judged = msgspec.structs.replace(request_for("base", 99, 0), request_id="chat-judge")
        answer = asyncio.create_task(service.sample_for_chat(judged, "", None, globex.job_id))
        try:
            async with asyncio.timeout(10):  # a hang guard, not a measure
                while "globex" not in service.slots.waiting.waiting():  # noqa: ASYNC110 - no event to wait on: the queue is plain bookkeeping
                    await asyncio.sleep(0.01)
            assert service.slots.waiting.waiting() == {"acme": 2, "globex": 1}
            engine.let_out(engine.entered[0])
            await engine.until_entered(2)
            assert engine.entered[1].request_id == "chat-judge"  # globex's turn before acme's
            assert service.slots.tenant_in_engine == {"acme": 0, "globex": 1}
            engine.let_out(engine.entered[1])
            result = await asyncio.wait_for(answer, 10)
            assert result.completion_token_ids == [7]
        finally:
            await stopped(service, engine)


async def test_a_cancelled_jobs_work_stops_and_its_requests_are_released_unserved() -> None:
    """acme is cancelled with one generation in the engine and three requests waiting: the
    generation is stopped, the waiting requests leave unserved as their turns come, every
    offset becomes committable, and no result of acme is sent; globex is served as before.
    Before, a cancelled job's requests all went through the engine, whose results nobody
    reads: a tenant submitting and cancelling jobs in a loop filled the engine."""
    async with memory_backend() as backend:
        acme, globex = spec_of("acme", "acme"), spec_of("globex", "globex")
        await registered(backend, acme, globex)
        engine = TurnstileEngine()
        service = service_with(backend, engine, slots=2)
        prompts = Inbox(Topic.PROMPTS)
        requests = [request_for(globex.job_id, 0, 0)]
        requests += [request_for(acme.job_id, index, 0) for index in range(4)]
        await read(prompts, service, requests)
        await engine.until_entered(2)  # globex's and acme's first (fair shares)
        assert await service.drop_stopped() == 0  # nothing has ended
        assert await backend.store.jobs.set_status(acme.job_id, "cancelled")
        assert await service.drop_stopped() == 1
        engine.let_out(requests[0])
        await asyncio.wait_for(all_committable_after(prompts, len(requests)), 10)
        assert [r.job_id for r in engine.entered] == [globex.job_id, acme.job_id]
        assert await backend.sent(Topic.ROLLOUTS, acme.job_id, expect=0) == []
        assert len(await backend.sent(Topic.ROLLOUTS, globex.job_id, expect=1)) == 1
        # Requests of the job read later are released at once.
        late = request_for(acme.job_id, 9, 0)
        await prompts.hand(service.on_request, late)
        await asyncio.wait_for(all_committable_after(prompts, len(requests) + 1), 10)
        assert len(engine.entered) == 2
        # A completed job is not stopped: its final version is still evaluated (a request of
        # it is served as any other).
        assert await backend.store.jobs.set_status(globex.job_id, "completed")
        after_completion = request_for(globex.job_id, 1, 0)
        await prompts.hand(service.on_request, after_completion)
        await engine.until_entered(3)
        assert await service.drop_stopped() == 0
        engine.let_out(after_completion)
        await asyncio.wait_for(all_committable_after(prompts, len(requests) + 2), 10)
        assert len(await backend.sent(Topic.ROLLOUTS, globex.job_id, expect=2)) == 2
        await stopped(service, engine)


async def all_committable_after(prompts: Inbox, count: int) -> None:
    while prompts.committable != count:  # noqa: ASYNC110 - the tracker has no event to await
        await asyncio.sleep(0.01)
