"""A hostile tenant beside another tenant's job: what one tenant can take of what all share.

    .venv/bin/python bench/hostile_load.py                  # or make bench-hostile

One embedded stack (broker, Valkey, the three services, the tenant API), two tenants with
the operator's default limits: `victim` trains one job, `mallory` floods. Phases:

1. quiet: the victim's job alone; its step times (the wall time between consecutive `step`
   events, what the tenant sees) over `--quiet-steps`.
2. hostile: the victim's job again (same spec, new id) and, from its first step on, the flood:
   - `--submissions` (10,000) job submissions through the API with the longest names, the
     largest params, 16 stop strings of 256 characters, the largest evaluation set, and a
     share over the declared limits, `--concurrency` at a time; every job the API takes is
     cancelled at once (churn: each leaves a record behind);
   - `--kafka-specs` (2,000) job specs straight to Kafka, signed with the bus key (a leaked
     key, or a client of the operator's gone wrong): maximal, over quota, undecodable, nested
     past the limit, each followed by its cancellation;
   - `--reads` (1,000) event reads, exports and reports at once, with the tenant's key and
     without one.
   The victim polls its job through the API every second meanwhile.
3. settle: until env_svc has read every spec and the events stop.

Reported: the victim's time per step in the flood's window (its length over the steps made
in it, so a stall counts) over the quiet run's (target 1.5; the median gap between steps is
there too), each response code counted (5xx: target 0), what was refused and why, Redis' memory
before the hostile phase and after it (target: what stays once the keys that expire are
gone within 2x; both with and without them), and whether every service is still up with no
restart. The flood's client is its own process at `--attacker-nice` (10): on one host its
CPU is not the service's to pay, which a remote attacker's would not be; `--attacker-nice 0`
measures the same host shared evenly.

The model: the tiny random one (`--smollm2`: SmolLM2-135M); `--scripted-engine` runs rollout's
deterministic engine instead of vLLM (sampling then costs nothing, so the victim's steps
are as short, and as easily slowed, as they get).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import multiprocessing
import os
import shutil
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import msgspec
import redis.asyncio as aioredis
from cpu_account import Snapshot  # bench/cpu_account.py
from machine import machine_fields, result_path  # bench/machine.py
from rich.console import Console

from common.bus.kafka import Producer
from common.runtime.config import SharedSettings, load
from common.state.tenants import TenantLimits
from common.wire.lifecycle import SERVICES, STATE_AFTER, TERMINAL_STATES
from common.wire.messages import (
    MAX_EVAL_TASKS,
    MAX_PARAMS,
    MAX_PARAMS_BYTES,
    MAX_PARAMS_DEPTH,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    NAME_MAX_LEN,
    EnvSettings,
    EvalSettings,
    Event,
    JobCommand,
    JobSpec,
    LoraSettings,
    RLSettings,
    SamplingSettings,
    Topic,
    new_id,
)
from console.operator_client import consumer_groups
from console.stack.local import LocalStack
from console.stack.topics import group_lag
from marlaas import Client
from marlaas.jobwatch import JobProgress, watch_jobs

console = Console()
VICTIM, ATTACKER = "victim", "mallory"


def victim_spec(base_model: str, job_id: str, steps: int, seed: int) -> JobSpec:
    """The demo's arithmetic job, short completions: steps as short as the stack allows."""
    return JobSpec(
        job_id=job_id,
        tenant=VICTIM,
        base_model=base_model,
        env=EnvSettings(name="arithmetic", seed=seed),
        lora=LoraSettings(rank=8, alpha=16),
        rl=RLSettings(
            group_size=8,
            groups_per_step=2,
            max_steps=steps,
            max_staleness=1,
            learning_rate=1e-3,
            max_context_tokens=256,
            sampling=SamplingSettings(max_new_tokens=16, seed=seed),
        ),
        eval=EvalSettings(tasks=0),
        submitted_at=time.time(),
    )


# --- the flood's bodies -------------------------------------------------------------------


def _name(prefix: str, index: int, length: int = NAME_MAX_LEN) -> str:
    head = f"{prefix}{index:06d}"
    return head + "x" * (length - len(head))


def _params(index: int) -> dict[str, str]:
    """MAX_PARAMS keys of the longest names, as large as MAX_PARAMS_BYTES allows."""
    value = "v" * (MAX_PARAMS_BYTES // MAX_PARAMS - NAME_MAX_LEN - 16)
    return {_name(f"k{k:02d}-", index): value for k in range(MAX_PARAMS)}


def _nested(depth: int) -> Any:
    value: Any = "deep"
    for _ in range(depth):
        value = {"d": value}
    return value


def submission(index: int) -> dict[str, Any]:
    """A job body of one of five kinds, by index: maximal within the limits (taken, then
    cancelled), the largest evaluation (past the quota), the largest params (refused by the
    environment), and two past the declared limits (a name too long, a list too long)."""
    stop = ["s" * MAX_STOP_CHARS] * MAX_STOP_STRINGS
    body: dict[str, Any] = {
        "job_id": _name("m", index),
        "env": {"name": "arithmetic", "seed": index},
        "lora": {"rank": 16, "alpha": 32},
        "rl": {
            "group_size": 8,
            "groups_per_step": 2,
            "max_steps": 1000,
            "max_staleness": 1,
            "max_context_tokens": 1024,
            "sampling": {"max_new_tokens": 512, "stop": stop},
        },
        "eval": {"tasks": 0},
    }
    match index % 5:
        case 1:
            body["eval"] = {"tasks": MAX_EVAL_TASKS}  # with the job's samples: past the quota
        case 2:
            body["env"]["params"] = _params(index)  # arithmetic knows none of them
        case 3:
            body["job_id"] = _name("m", index, NAME_MAX_LEN + 1)
        case 4:
            body["rl"]["sampling"]["stop"] = [*stop, "one too many"]
    return body


def kafka_spec(index: int, base_model: str) -> tuple[bytes, bytes]:
    """(key, value) of a spec straight to the jobs topic: maximal (over the tenant's quota
    once four run), the largest evaluation, params nested past the limit, or not a spec."""
    body = submission(index) | {
        "kind": "job_spec",
        "tenant": ATTACKER,
        "base_model": base_model,
        "job_id": _name("k", index),
        "submitted_at": time.time(),
    }
    match index % 4:
        case 1:
            body["eval"] = {"tasks": MAX_EVAL_TASKS}
        case 2:
            body["env"]["params"] = {"p": _nested(MAX_PARAMS_DEPTH + 1)}
        case 3:
            body["rl"]["group_sizf"] = 8  # a misspelt field: does not decode
        case _:
            body["rl"]["sampling"]["stop"] = body["rl"]["sampling"]["stop"][:MAX_STOP_STRINGS]
    return body["job_id"].encode(), json.dumps(body).encode()


# --- the attacker (its own process) -------------------------------------------------------


class Tally:
    """Responses by code and by route, and the reasons of the refusals (first of each)."""

    def __init__(self) -> None:
        self.codes: collections.Counter[str] = collections.Counter()
        self.reasons: dict[str, str] = {}
        self.errors: collections.Counter[str] = collections.Counter()

    def add(self, route: str, response: httpx.Response | BaseException) -> None:
        if isinstance(response, BaseException):
            self.errors[f"{route} {type(response).__name__}"] += 1
            return
        code = response.status_code
        self.codes[f"{route} {code}"] += 1
        if code >= 400 and f"{route} {code}" not in self.reasons:
            try:
                self.reasons[f"{route} {code}"] = str(response.json().get("error", ""))[:300]
            except ValueError:
                self.reasons[f"{route} {code}"] = response.text[:300]

    def to_json(self) -> dict[str, Any]:
        return {
            "codes": dict(sorted(self.codes.items())),
            "first_reason": dict(sorted(self.reasons.items())),
            "client_errors": dict(self.errors),
            "5xx": sum(n for k, n in self.codes.items() if k.rsplit(" ", 1)[1].startswith("5")),
        }


async def _flood_api(api_url: str, key: str, own_job: str, args: dict[str, Any]) -> Tally:
    tally = Tally()
    auth = {"authorization": f"Bearer {key}"}
    limits = httpx.Limits(max_connections=args["reads"] + args["concurrency"])
    async with httpx.AsyncClient(base_url=api_url, timeout=120.0, limits=limits) as http:

        async def submit(index: int) -> None:
            try:
                response = await http.post("/v1/jobs", json=submission(index), headers=auth)
            except httpx.HTTPError as exc:
                tally.add("POST /v1/jobs", exc)
                return
            tally.add("POST /v1/jobs", response)
            if response.status_code == 202:  # taken: cancelled at once (churn)
                await cancel(response.json()["job_id"])

        async def cancel(job_id: str) -> None:
            # Until it is done: 409 while env_svc has not registered it (or never will: it
            # rejected it), 429 past the rate.
            refused = 0
            for _ in range(120):
                try:
                    answer = await http.post(f"/v1/jobs/{job_id}/cancel", headers=auth)
                except httpx.HTTPError as exc:
                    tally.add("POST cancel", exc)
                    return
                tally.add("POST cancel", answer)
                refused += answer.status_code == 409
                if answer.status_code not in (409, 429) or refused >= 10:
                    return
                await asyncio.sleep(max(0.2, float(answer.headers.get("retry-after", "1"))))

        gate = asyncio.Semaphore(args["concurrency"])

        async def gated(index: int) -> None:
            async with gate:
                await submit(index)

        async def read(index: int) -> None:
            route, headers = [
                (f"/v1/jobs/{own_job}/events", auth),
                (f"/v1/jobs/{own_job}/export", auth),
                (f"/v1/report?job={own_job}", auth),
                (f"/v1/jobs/{own_job}/events", {}),  # no key: the anonymous rate
            ][index % 4]
            name = f"GET {route.split('?')[0].replace(own_job, '{job}')}" + (
                "" if headers else " anon"
            )
            try:
                tally.add(name, await http.get(route, headers=headers))
            except httpx.HTTPError as exc:
                tally.add(name, exc)

        reads = [asyncio.create_task(read(i)) for i in range(args["reads"])]
        await asyncio.gather(*(gated(i) for i in range(args["submissions"])))
        await asyncio.gather(*reads)
    return tally


async def _flood_kafka(settings: SharedSettings, count: int, base_model: str) -> int:
    producer = Producer(
        settings.kafka_bootstrap, client_id="marlaas-hostile-bench", signing=settings.signer
    )
    await producer.start()
    try:
        for index in range(count):
            key, value = kafka_spec(index, base_model)
            await producer.send_raw(Topic.JOBS, value, key=key)
            # Behind it on its partition, its cancellation: churn, as through the API.
            await producer.send(
                JobCommand(command_id=new_id(), job_id=key.decode(), action="cancel")
            )
    finally:
        await producer.stop()
    return count


def attacker(
    settings: SharedSettings, api_url: str, key: str, own_job: str, args: dict[str, Any], out: str
) -> None:
    """The flood, in a process of its own at `args["nice"]`; its tally written to `out`."""
    os.nice(args["nice"])

    async def run() -> dict[str, Any]:
        started = time.time()
        api, sent = await asyncio.gather(
            _flood_api(api_url, key, own_job, args),
            _flood_kafka(settings, args["kafka_specs"], args["base_model"]),
        )
        return {
            "started": started,
            "ended": time.time(),
            "api": api.to_json(),
            "kafka_specs_sent": sent,
            "cpu_s": round(sum(os.times()[:2]), 1),
        }

    Path(out).write_text(json.dumps(asyncio.run(run())))


# --- the victim's side --------------------------------------------------------------------


async def step_times(
    bootstrap: str, spec: JobSpec, stop: asyncio.Event, timeout_s: float
) -> list[float]:
    """The `at` of each of the job's step events until it ends (`stop` cancels it)."""
    steps: dict[int, float] = {}

    def keep(event: Event) -> None:
        if event.event == "step":
            steps.setdefault(event.step, event.at)
        if STATE_AFTER.get(event.event) in TERMINAL_STATES and event.event != "cancelled":
            console.print(f"  {event.job_id}: {event.event} {event.reason}")

    watch = asyncio.create_task(
        watch_jobs(
            bootstrap, {spec.job_id: JobProgress.of(spec)}, timeout_s=timeout_s, on_event=keep
        )
    )
    waiter = asyncio.create_task(stop.wait())
    await asyncio.wait({watch, waiter}, return_when=asyncio.FIRST_COMPLETED)
    await asyncio.sleep(1.0)  # the last events in
    watch.cancel()
    waiter.cancel()
    return [steps[s] for s in sorted(steps)]


def intervals(times: list[float], start: float = 0.0, end: float = float("inf")) -> list[float]:
    """Gaps between consecutive step times, both inside [start, end]."""
    inside = [t for t in times if start <= t <= end]
    return [b - a for a, b in itertools.pairwise(inside)]


def time_per_step(times: list[float], start: float, end: float) -> float:
    """The window's length over the steps made in it: a stall counts, however long, where a
    median of the gaps between steps would leave it out. (With `max_staleness` 1 the steps
    come in pairs, one gap long and one short: their median means nothing.)"""
    made = sum(start < t <= end for t in times)
    return (end - start) / made if made else float("inf")


async def poll_own_job(api_url: str, key: str, job_id: str, stop: asyncio.Event) -> Tally:
    """The victim reading its job through the API, once a second."""
    tally = Tally()
    async with httpx.AsyncClient(base_url=api_url, timeout=30.0) as http:
        while not stop.is_set():
            try:
                tally.add("GET /v1/jobs/{job}", await http.get(
                    f"/v1/jobs/{job_id}", headers={"authorization": f"Bearer {key}"}
                ))  # fmt: skip
            except httpx.HTTPError as exc:
                tally.add("GET /v1/jobs/{job}", exc)
            await asyncio.sleep(1.0)
    return tally


async def redis_memory(url: str) -> dict[str, int]:
    """Valkey's used memory, its keys, and what the keys that expire hold (MEMORY USAGE)."""
    client = aioredis.from_url(url)
    try:
        used = int((await client.info("memory"))["used_memory"])
        keys = expiring = expiring_bytes = 0
        async for key in client.scan_iter(count=1000):
            keys += 1
            if await client.ttl(key) > 0:
                expiring += 1
                expiring_bytes += int(await client.memory_usage(key) or 0)
        return {
            "used_memory": used,
            "keys": keys,
            "expiring_keys": expiring,
            "expiring_bytes": expiring_bytes,
            "staying_memory": used - expiring_bytes,
        }
    finally:
        await client.aclose()


async def wait_until_jobs_read(bootstrap: str, timeout_s: float) -> float:
    """Until env_svc has committed every spec on the jobs topic; how long that took."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        lags = await group_lag(bootstrap, consumer_groups()["env_svc"], [Topic.JOBS])
        if sum(lag.lag for lag in lags) == 0:
            break
        await asyncio.sleep(2.0)
    return round(time.monotonic() - started, 1)


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    settings = load(SharedSettings).model_copy(update={"state_dir": args.run_dir / "state"})
    run_id = args.run_id
    async with LocalStack(settings, services=SERVICES) as stack:
        precisions = stack.dtypes
        async with Client(stack.client_settings) as client:
            tenants = client.store.tenants
            keys = {}
            for tenant in (VICTIM, ATTACKER):
                await tenants.add(tenant, TenantLimits())  # the operator's defaults
                keys[tenant] = (await tenants.issue_key(tenant)).token

            console.print("[bold]quiet[/]: the victim's job alone")
            quiet_spec = victim_spec(settings.base_model, f"quiet-{run_id}", args.quiet_steps, 7)
            roots = {child.name: child.process.pid for child in stack.children}
            cpu_before, quiet_started = Snapshot.take(roots), time.time()
            await client.submit([quiet_spec])
            quiet_times = await step_times(
                stack.kafka_bootstrap, quiet_spec, asyncio.Event(), args.timeout_s
            )
            quiet = intervals(quiet_times[1:])  # the first step carries the job's start-up
            quiet_per_step = time_per_step(quiet_times, quiet_times[1], quiet_times[-1])
            quiet_cpu = Snapshot.take(roots).since(cpu_before, time.time() - quiet_started)
            await wait_until_jobs_read(stack.kafka_bootstrap, 60)
            before = await redis_memory(stack.redis_url)

            console.print("[bold]hostile[/]: the victim's job again, and the flood")
            spec = victim_spec(settings.base_model, f"hostile-{run_id}", 1000, 7)
            # The attacker's own job, for its reads (an export needs an adapter: one step).
            own = msgspec.structs.replace(
                victim_spec(settings.base_model, f"{ATTACKER}-own-{run_id}", 1, 8),
                tenant=ATTACKER,
            )
            await client.submit([own])
            await step_times(stack.kafka_bootstrap, own, asyncio.Event(), args.timeout_s)
            done = asyncio.Event()
            watching = asyncio.create_task(
                step_times(stack.kafka_bootstrap, spec, done, args.timeout_s)
            )
            await client.submit([spec])
            while await client.store.adapters.get(spec.job_id) is None:  # noqa: ASYNC110 - Redis, polled
                await asyncio.sleep(0.5)  # its first step: the flood meets a job that trains
            polling = asyncio.create_task(
                poll_own_job(stack.api_url, keys[VICTIM], spec.job_id, done)
            )
            tally_file = args.run_dir / "attacker.json"
            flood = multiprocessing.get_context("spawn").Process(
                target=attacker,
                args=(
                    stack.client_settings,
                    stack.api_url,
                    keys[ATTACKER],
                    own.job_id,
                    {
                        "nice": args.attacker_nice,
                        "submissions": args.submissions,
                        "concurrency": args.concurrency,
                        "reads": args.reads,
                        "kafka_specs": args.kafka_specs,
                        "base_model": settings.base_model,
                    },
                    str(tally_file),
                ),
            )
            cpu_before = Snapshot.take(roots)
            flood.start()
            await asyncio.to_thread(flood.join)
            attack = json.loads(tally_file.read_text())
            flood_cpu = Snapshot.take(roots).since(cpu_before, attack["ended"] - attack["started"])
            console.print(f"flood over in {attack['ended'] - attack['started']:.0f} s")
            settle_s = await wait_until_jobs_read(stack.kafka_bootstrap, args.timeout_s)
            await asyncio.sleep(5.0)  # a few more victim steps after the flood
            await client.command(spec.job_id, "cancel")
            done.set()
            hostile_times = await watching
            victim_api = await polling
            hostile = intervals(hostile_times, attack["started"], attack["ended"])
            hostile_per_step = time_per_step(hostile_times, attack["started"], attack["ended"])
            await asyncio.sleep(5.0)  # the cancellations' last writes
            after = await redis_memory(stack.redis_url)
            alive = {child.name: child.process.poll() is None for child in stack.children}
            restarts = dict(stack.supervisor.restarts)
            records = [
                await client.store.jobs.get(job_id)
                for job_id in await client.store.jobs.of_tenant(ATTACKER)
            ]
            states = collections.Counter(r.status for r in records if r is not None)
    quiet_median = statistics.median(quiet)
    hostile_median = statistics.median(hostile) if hostile else float("inf")
    return {
        "run_id": run_id,
        "machine": machine_fields(**precisions),
        "base_model": settings.base_model,
        "engine": os.environ.get("ROLLOUT_ENGINE", "vllm"),
        "attacker_nice": args.attacker_nice,
        "victim": {
            "quiet_step_s": [round(s, 3) for s in quiet],
            "hostile_step_s": [round(s, 3) for s in hostile],
            "quiet_s_per_step": round(quiet_per_step, 3),
            "hostile_s_per_step": round(hostile_per_step, 3),
            "hostile_over_quiet": round(hostile_per_step / quiet_per_step, 3),
            "quiet_median_gap_s": round(quiet_median, 3),
            "hostile_median_gap_s": round(hostile_median, 3),
            "api": victim_api.to_json(),
        },
        # CPU seconds of each service (and the cores' busy share) over the quiet run and over
        # the flood: where the victim's lost time went on a host whose cores all share.
        "cpu": {"quiet": quiet_cpu, "flood": flood_cpu},
        "flood": {
            "submissions": args.submissions,
            "concurrency": args.concurrency,
            "reads": args.reads,
            "kafka_specs": args.kafka_specs,
            "wall_s": round(attack["ended"] - attack["started"], 1),
            "attacker_cpu_s": attack["cpu_s"],
            "api": attack["api"],
            "env_svc_settle_s": settle_s,
            "attacker_jobs_by_status": dict(states),
        },
        "redis": {
            "before": before,
            "after": after,
            "after_over_before": round(after["used_memory"] / before["used_memory"], 3),
            "staying_after_over_before": round(
                after["staying_memory"] / before["staying_memory"], 3
            ),
        },
        "services_alive": alive,
        "restarts": restarts,
        "5xx": attack["api"]["5xx"] + victim_api.to_json()["5xx"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--submissions", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=32, help="submissions at once")
    parser.add_argument("--reads", type=int, default=1_000, help="reads at once")
    parser.add_argument("--kafka-specs", type=int, default=2_000)
    parser.add_argument("--quiet-steps", type=int, default=20)
    parser.add_argument("--attacker-nice", type=int, default=10)
    parser.add_argument("--timeout-s", type=float, default=1800)
    parser.add_argument("--tag", default="", help="added to the result's file name")
    parser.add_argument("--smollm2", action="store_true", help="SmolLM2-135M, not the tiny model")
    parser.add_argument("--scripted-engine", action="store_true", help="a deterministic engine")
    args = parser.parse_args()
    if args.scripted_engine:  # read by rollout_svc (the repository on its path)
        os.environ["ROLLOUT_ENGINE"] = "tests.chaos.scripted_engine:ScriptedEngine"
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(
                None, [str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH")]
            )
        )
        args.tag = "-".join(filter(None, ["scripted", args.tag]))
    if not args.smollm2:
        from common.files.models import tiny_model

        os.environ["MARLAAS_BASE_MODEL"] = str(tiny_model())  # read by the stack and services
        args.tag = "-".join(filter(None, ["tiny", args.tag]))
    args.run_id = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    args.run_dir = Path("runs").resolve() / f"hostile-load-{args.run_id}"
    args.run_dir.mkdir(parents=True)
    result = asyncio.run(bench(args))
    suffix = f"-{args.tag}" if args.tag else ""
    out = result_path(f"hostile-load{suffix}", date=args.run_id[:8])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(msgspec.json.format(msgspec.json.encode(result), indent=2).decode() + "\n")
    shutil.rmtree(args.run_dir / "state" / "artifacts", ignore_errors=True)
    summary = {
        "hostile_over_quiet": result["victim"]["hostile_over_quiet"],
        "staying_after_over_before": result["redis"]["staying_after_over_before"],
        "5xx": result["5xx"],
        "services_alive": all(result["services_alive"].values()),
        "restarts": result["restarts"],
    }
    console.print_json(data=summary | {"out": str(out)})


if __name__ == "__main__":
    main()
