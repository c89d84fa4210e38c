"""`Client`: what a program does with MARLaaS jobs, over Kafka and Redis only: submit,
command, read and follow events, read the latest episodes, sample, export, audit and report.

    async with Client(load(SharedSettings)) as client:
        await client.submit([load_job_file(path, base_model=...)])

The tenant API and the `marlaas` CLI are its users; the CLI's operator views (the status
board, experiment tracking) extend it in `console.operator_client`.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import cache, partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self, TypeVar

from common.bus.kafka import Producer
from common.files.artifacts import latest_checkpoint_version
from common.files.models import ModelNotFoundError, resolve_tokenizer
from common.runtime.config import SharedSettings
from common.state.audit import Audit, audit
from common.state.evals import evaluated
from common.state.registry import Job, JobRecord, UnknownJobError, job_id_of
from common.state.store import RedisStore
from common.state.usage import TenantUsage
from common.wire.chat import CHAT
from common.wire.lifecycle import COMMAND_EVENT, STATE_AFTER, TERMINAL_STATES
from common.wire.messages import Event, JobAction, JobCommand, JobSpec, Trajectory, new_id
from marlaas.chat import chat_completion, chat_request
from marlaas.episodes import Decode, EpisodeSample, episode_sample, load_decoder
from marlaas.eventfeed import AdapterFeed, EventFeed, ReaderPool, TrajectoryFeed
from marlaas.export import (
    ExportedAdapter,
    ExportError,
    best_version,
    export_adapter,
    held_out_results,
    local_base_model,
)

if TYPE_CHECKING:
    from marlaas.report.numbers import Report


class EnvironmentNotServedError(ValueError):
    """A job names an environment no env_svc replica of the deployment serves."""


def refuse_unserved(specs: Sequence[JobSpec], served: set[str] | None) -> None:
    """Refuse the first spec whose environment no live env_svc replica serves (`served`:
    `replicas.served_environments()`; None, no replica up to say: every spec passes, and
    env_svc checks it when it comes)."""
    if served is None:
        return
    for spec in specs:
        if spec.env.name not in served:
            raise EnvironmentNotServedError(
                f"job {spec.job_id!r}: unknown environment {spec.env.name!r}; the "
                f"deployment's env_svc serves {', '.join(sorted(served)) or 'none'}"
            )


CHAT_CALLS = 64
"""Chat calls waiting on rollout replicas at once (each holds a thread up to 5 minutes): their
own threads, so that tenants' long calls cannot fill asyncio's default pool (min(32, cores +
4) threads), which exports and reports share."""


@cache
def _chat_calls() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(CHAT_CALLS, thread_name_prefix="marlaas-chat")


T = TypeVar("T")

SERVED_FRESH_S = 10.0
"""How long a client trusts its last read of the environments env_svc serves."""
SENT_KEPT = 4096
"""Submitted ids a client remembers, so that following one needs no record yet."""


class JobStateError(ValueError):
    """A command that does not apply to the job's current state."""


class NoTokenizerError(RuntimeError):
    """The base model's tokenizer is not on this machine: episodes cannot be read as text."""


EPISODE_TAIL = 256
"""Records of a job's partition of marlaas.trajectories an episode read looks through, from
its end: the latest episodes, whatever the topic holds (jobs of others share a partition)."""


class Client:
    """One Redis connection, one Kafka producer (opened at the first send, or by
    `start_producer`) and at most `readers` pooled consumers for one-shot reads of the bus
    (events, reports, audits), each waited for up to `reader_wait_s` (ReadersBusy then);
    all held until the client closes. Following a job holds a consumer of its own."""

    def __init__(
        self,
        settings: SharedSettings,
        *,
        connect_timeout_s: float = 10.0,
        readers: int = 4,
        reader_wait_s: float = 30.0,
    ) -> None:
        self.settings = settings
        self.connect_timeout_s = connect_timeout_s
        self.readers = ReaderPool(
            settings.kafka_bootstrap,
            size=readers,
            wait_s=reader_wait_s,
            connect_timeout_s=connect_timeout_s,
        )
        self._store: RedisStore | None = None
        self._producer: Producer | None = None
        self._producer_started = asyncio.Lock()
        self._sent: dict[str, None] = {}
        """Ids this client submitted, newest last (at most SENT_KEPT): followed before
        env_svc has admitted them, their feed carries the accepted or rejected event."""
        self._served: tuple[float, set[str] | None] | None = None
        """When the environments env_svc serves were read, and what they were."""

    async def __aenter__(self) -> Self:
        self._store = await RedisStore.connect(
            self.settings.redis_url, timeout_s=self.connect_timeout_s
        )
        return self

    async def __aexit__(self, *_: object) -> None:
        try:
            if self._producer is not None:
                await self._producer.stop()
                self._producer = None
            await self.readers.close()
        finally:
            if self._store is not None:
                await self._store.close()
                self._store = None

    async def start_producer(self) -> Producer:
        """The client's producer, started now if it is not yet (the tenant API does at start,
        so a broker it cannot reach fails the start, not a tenant's first submission)."""
        async with self._producer_started:
            if self._producer is None:
                producer = Producer(
                    self.settings.kafka_bootstrap,
                    client_id="marlaas-client",
                    signing=self.settings.signer,
                )
                await producer.start(timeout_s=self.connect_timeout_s)
                self._producer = producer
            return self._producer

    @property
    def store(self) -> RedisStore:
        if self._store is None:
            raise RuntimeError("use `async with Client(...)`")
        return self._store

    # --- jobs -------------------------------------------------------------------------

    async def submit(self, specs: Sequence[JobSpec]) -> None:
        """Produce every spec to marlaas.jobs, each id bound to its tenant first; refuses ids
        that already exist or name an environment no env_svc replica serves (none is sent)."""
        statuses = await self.store.jobs.statuses([spec.job_id for spec in specs])
        for job_id, status in statuses.items():
            if status is not None:
                raise JobStateError(
                    f"job {job_id!r} already exists ({status}); "
                    "give the file another job_id or leave it out for a fresh one"
                )
        refuse_unserved(specs, await self.served_environments())
        for spec in specs:
            owner = (await self.store.jobs.claim_id(spec.job_id, None)).owner  # binds nothing
            if owner not in (None, spec.tenant):
                raise JobStateError(f"job id {spec.job_id!r} is taken by another tenant")
        await self._send(*specs)
        for spec in specs:  # bound to its tenant once sent (as the API binds): `status` shows
            await self.store.jobs.claim_id(spec.job_id, spec.tenant)  # it pending till admitted
        for spec in specs:
            self._sent[spec.job_id] = None
        while len(self._sent) > SENT_KEPT:
            del self._sent[next(iter(self._sent))]

    async def usage(self, tenant: str) -> TenantUsage:
        """The tenant's usage: its total and each of its jobs' (common/state/usage.py)."""
        jobs = await self.store.jobs.of_tenant(tenant)
        return TenantUsage(
            tenant, await self.store.usage.of_tenant(tenant), await self.store.usage.of_jobs(jobs)
        )

    async def served_environments(self) -> set[str] | None:
        """The environments the live env_svc replicas serve (None: none up to say), read
        from Redis at most every `SERVED_FRESH_S` (a read scans the keyspace)."""
        now = time.monotonic()
        if self._served is None or now - self._served[0] > SERVED_FRESH_S:
            self._served = (now, await self.store.replicas.served_environments())
        return self._served[1]

    async def job(self, job: Job) -> JobRecord:
        """The job's record (UnknownJobError: never registered); a record is its own."""
        if isinstance(job, JobRecord):
            return job
        if (record := await self.store.jobs.get(job)) is None:
            raise UnknownJobError(job)
        return record

    async def command(self, job: Job, action: JobAction, *, wait_s: float = 30.0) -> str:
        """Send pause/resume/cancel and wait until env_svc has applied it; returns the state."""
        record = await self.job(job)
        job_id = record.spec.job_id
        target = STATE_AFTER[COMMAND_EVENT[action]]
        if record.status in TERMINAL_STATES:
            raise JobStateError(f"job {job_id!r} is already {record.status}; nothing to {action}")
        if record.status == target:
            return target
        await self._send(
            JobCommand(command_id=new_id(), job_id=job_id, action=action, issued_at=time.time())
        )
        deadline = time.monotonic() + wait_s
        while (status := (await self.job(job_id)).status) != target:
            if status in TERMINAL_STATES:
                return status  # it ended meanwhile (completed, or cancelled by someone else)
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{action} of job {job_id!r} sent, but not applied within {wait_s:.0f}s "
                    "(is env_svc running?)"
                )
            await asyncio.sleep(0.2)
        return status

    # --- events -----------------------------------------------------------------------

    async def events(self, job: Job) -> list[Event]:
        """Every event of the job so far, oldest first."""
        async with self._feed({job_id_of(job)}, pooled=True) as feed:
            events = await feed.read_to_end(timeout_s=self.connect_timeout_s * 3)
        if not events:
            await self.job(job)  # UnknownJobError unless it is registered
        return events

    async def follow(
        self,
        job: Job,
        *,
        allowed: Callable[[], Awaitable[bool]] | None = None,
        check_every_s: float = 5.0,
    ) -> AsyncIterator[Event]:
        """The job's events so far, then each new one until the job has ended, a completed
        job's final evaluation included (a job this client has just submitted may be
        followed before it is admitted); or until `allowed()`, asked every `check_every_s`
        even while no event comes, says no (the tenant API: the key was revoked)."""
        if (
            isinstance(job, str)
            and job not in self._sent
            and await self.store.jobs.get(job) is None
        ):
            await self.events(job)  # raises UnknownJobError unless it has events
        job_id = job_id_of(job)
        async with self._feed({job_id}) as feed:
            ended, final, evals, checked = False, None, set[int](), time.monotonic()
            while not (ended and (final is None or final in evals) and feed.caught_up):
                if allowed is not None and time.monotonic() - checked >= check_every_s:
                    if not await allowed():
                        return
                    checked = time.monotonic()
                for event in await feed.poll(0.5):
                    yield event
                    if event.event == "eval":
                        evals.add(event.step)
                    elif STATE_AFTER.get(event.event) in TERMINAL_STATES:
                        ended, final = True, await self._final_eval(job_id, event)

    async def _final_eval(self, job_id: str, ended: Event) -> int | None:
        """The version whose `eval` event is still to come after the job's end: a completed
        job's final adapter (the version its `completed` event names), when its spec evaluates
        it."""
        if STATE_AFTER[ended.event] != "completed" or ended.step < 1:
            return None
        record = await self.store.jobs.get(job_id)
        return ended.step if record is not None and evaluated(record.spec, ended.step) else None

    # --- episodes ---------------------------------------------------------------------

    async def episodes(self, job: Job, *, limit: int) -> list[EpisodeSample]:
        """The job's latest finished episodes as text, newest first: at most `limit`, found
        among the last `EPISODE_TAIL` records of its partition (a pooled reader; only `limit`
        trajectories held at once). NoTokenizerError without the base model's tokenizer."""
        job_id = job_id_of(job)
        latest: list[Trajectory] = []
        async with TrajectoryFeed(
            self.settings.kafka_bootstrap,
            {job_id},
            connect_timeout_s=self.connect_timeout_s,
            signing=self.settings.signer,
            readers=self.readers,
            tail=EPISODE_TAIL,
        ) as feed:
            async for batch in feed.batches_to_end(timeout_s=self.connect_timeout_s * 3):
                latest = heapq.nlargest(limit, [*latest, *batch], key=lambda t: t.finished_at)
        if not latest:
            return []

        def readable() -> list[EpisodeSample]:  # loading a tokenizer takes a while: a thread
            decode = self._decoder()
            return [episode_sample(trajectory, decode) for trajectory in latest]

        return await asyncio.to_thread(readable)

    def _decoder(self) -> Decode:
        base_model, given = self.settings.base_model, self.settings.tokenizer_dir
        try:
            found = resolve_tokenizer(base_model, self.settings.cache_dir, given)
            return load_decoder(found)
        except (ModelNotFoundError, OSError, ValueError) as exc:
            raise NoTokenizerError(
                f"no tokenizer of the base model {base_model!r} here to read episodes: {exc}"
            ) from None

    # --- results ----------------------------------------------------------------------

    async def export(
        self, job: Job, out_dir: Path, *, version: int | None = None, best: bool = False
    ) -> ExportedAdapter:
        """The job's latest adapter, or `version`, or (`best`) the version with the best
        held-out accuracy (its `eval` events)."""
        record = await self.job(job)
        events = await self.events(record)
        if best:
            if version is not None:
                raise ExportError("give a version or ask for the best one, not both")
            found = best_version(events)
            if found is None:
                raise ExportError(
                    f"job {record.spec.job_id!r} has no evaluated adapter version yet "
                    "(its eval settings: `eval.every_steps`, the final version)"
                )
            version = found[0]
        base_model_path = await asyncio.to_thread(
            local_base_model, self.settings.base_model, self.settings.cache_dir
        )
        return await export_adapter(
            self.store,
            record,
            out_dir,
            base_model_path=base_model_path,
            version=version,
            held_out=held_out_results(events),
        )

    async def sample(
        self,
        job_id: str,
        prompt: str,
        *,
        version: int | None = None,
        max_tokens: int = 64,
        temperature: float = 0.0,
        as_tenant: bool = True,
        url: str = "",
    ) -> tuple[str, str]:
        """(the model that answered, its answer) to `prompt` from the job's adapter (the
        latest, or `version`), through a rollout replica's OpenAI-compatible chat endpoint
        (`url`, default `MARLAAS_CHAT_URL`); ChatFailed when it refuses or is unreachable.
        `as_tenant`: queued as the job's tenant's work (the tenants' fair queue), not in the
        endpoint's few shared slots."""
        model = job_id if version is None else f"{job_id}@v{version}"
        return await self._chat_call(
            url,
            lambda base_url, token: chat_completion(
                base_url,
                model,
                prompt,
                max_tokens=max_tokens,
                temperature=temperature,
                token=token,
                for_job=job_id if as_tenant else "",
            ),
        )

    async def chat(
        self, body: dict[str, Any], *, for_job: str, url: str = "", path: str = "chat/completions"
    ) -> dict[str, Any]:
        """A rollout replica's answer to an OpenAI chat completions `body` (`path`
        "completions": a text completion's; its `model` a job id or `<job>@v<N>`), made as
        `for_job`'s tenant's work: what the tenant API's OpenAI endpoints forward.
        ChatFailed when it refuses or is unreachable."""
        return await self._chat_call(
            url,
            lambda base_url, token: chat_request(
                base_url, body, token=token, for_job=for_job, path=path
            ),
        )

    async def _chat_call(self, url: str, call: Callable[[str, str | None], T]) -> T:
        """`call(endpoint URL, internal credential)` on the chat threads: `url`, else
        MARLAAS_CHAT_URL."""
        base_url = url or self.settings.chat_url
        if not base_url:
            raise ValueError("no chat completions URL (MARLAAS_CHAT_URL)")
        token = self.settings.internal_token(CHAT)
        return await asyncio.get_running_loop().run_in_executor(
            _chat_calls(), partial(call, base_url, token)
        )

    async def audit(self, job_id: str) -> Audit:
        """Account for every group of the job (common/state/audit.py): its ledger against the
        pointer, the latest checkpoint (when the artifact store is here) and the last
        AdapterUpdate on the broker."""
        return (await self.audits([job_id]))[job_id]

    async def audits(self, job_ids: Collection[str]) -> dict[str, Audit]:
        """`audit` of each job, reading `marlaas.adapters` once for all of them."""
        records = {job_id: await self.job(job_id) for job_id in job_ids}
        async with AdapterFeed(
            self.settings.kafka_bootstrap,
            set(job_ids),
            connect_timeout_s=self.connect_timeout_s,
            signing=self.settings.signer,
            readers=self.readers,
        ) as feed:
            updates = await feed.read_to_end(timeout_s=self.connect_timeout_s * 3)
        announced: dict[str, int] = {}
        for update in updates:
            announced[update.job_id] = max(announced.get(update.job_id, 0), update.version)
        audits = {}
        for job_id, record in records.items():
            ledger = await self.store.flow.ledger(job_id)
            if not ledger and (summary := await self.store.jobs.audit_summary(job_id)) is not None:
                audits[job_id] = Audit.from_json(summary)  # ended over a week ago: kept
                continue
            pointer = await self.store.adapters.get(job_id)
            checkpoint: int | None = None
            if (self.settings.artifacts / "checkpoints").is_dir():
                checkpoint = latest_checkpoint_version(self.settings.artifacts, job_id) or 0
            audits[job_id] = audit(
                job_id,
                ledger,
                status=record.status,
                groups_per_step=record.spec.rl.groups_per_step,
                pointer_version=pointer.version if pointer else 0,
                checkpoint_version=checkpoint,
                announced_version=announced.get(job_id, 0),
            )
        return audits

    async def report(self, jobs: Collection[Job], out_dir: Path) -> Path:
        """A self-contained HTML report (+ CSV/JSON) of the jobs, or of every job if none named."""
        from marlaas.report.page import write_report

        return write_report(await self.report_numbers(jobs), out_dir)

    async def report_numbers(self, jobs: Collection[Job]) -> Report:
        """The numbers of `report` (its jobs, steps, evaluations and the replicas' utilisation),
        for a page that draws them itself (the tenant API's web console)."""
        from marlaas.report.numbers import build_report

        job_ids = {job_id_of(job) for job in jobs}
        async with self._feed(job_ids or None, pooled=True) as feed:
            events = await feed.read_to_end(timeout_s=self.connect_timeout_s * 3)
        specs = {job.spec.job_id: job.spec for job in jobs if isinstance(job, JobRecord)}
        for job in jobs:
            if isinstance(job, str) and job not in {e.job_id for e in events}:
                await self.job(job)  # no events yet: it must at least be registered
        for job_id in job_ids or {e.job_id for e in events} | set(await self.store.jobs.ids()):
            if job_id not in specs and (record := await self.store.jobs.get(job_id)) is not None:
                specs[job_id] = record.spec
        return build_report(events, await self.store.replicas.stats_history(), specs=specs)

    # --- helpers ----------------------------------------------------------------------

    def _feed(self, job_ids: Collection[str] | None, *, pooled: bool = False) -> EventFeed:
        """A feed of the jobs' events: `pooled` for a read to the end (its consumer lent by
        `readers`), else with a consumer of its own (a follow may stay open for hours)."""
        return EventFeed(
            self.settings.kafka_bootstrap,
            job_ids,
            connect_timeout_s=self.connect_timeout_s,
            signing=self.settings.signer,
            readers=self.readers if pooled else None,
        )

    async def _send(self, *messages: JobSpec | JobCommand) -> None:
        producer = await self.start_producer()
        for message in messages:
            await producer.send(message)
