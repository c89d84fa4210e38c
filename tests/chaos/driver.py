"""The chaos run: jobs of three tenants on two replicas of every service, killed at random.

    .venv/bin/python -m tests.chaos.driver [--seed 7] [--min-kills 100]   # or make chaos

On the real embedded stack (durable Tansu broker, Valkey; both supervised by the stack), with
the tiny model in the trainer and the deterministic scripted engine in rollout_svc, each round
submits 3 tenants x 6 jobs of the `chaos` environment (S in {0, 1, 3}, B in {1, 4},
G in {2, 8}; some with rewards that raise, return NaN or sleep). Three phases:

1. fault-free: one round with no faults, timing each tenant (submit to its last job's end);
2. fuzzed: one round in which only `acme` and `globex` get fuzzed records (random bytes, and
   valid messages with absurd values, on every topic) and random pause/resume/cancel;
   `initech` must finish within 1.5x its fault-free time;
3. chaos: rounds under every fault, seeded, every `interval_s`: kill -9 a random service
   replica and start it again; SIGSTOP a trainer replica past its consumer session timeout,
   then SIGCONT it; kill -9 Valkey or the broker (the stack restarts them with their data;
   every 25th fault does, Valkey and the broker in turn, so each run has both);
   pause, resume or cancel a job; fuzz any tenant. It goes on until every job has ended and
   at least `min_kills` replicas were killed.

Meanwhile it checks the flow-control invariant every second and hashes every adapter version
when it is first announced. The verifier then requires: every job not cancelled `completed`
(or `failed` with a reason); `marlaas audit` clean for every job (0 lost, 0 trained twice,
0 unexpected; each version exactly B groups); every announced adapter's bytes unchanged; the
invariant never broken; every dead letter one of the injected records; the unfuzzed tenant
within 1.5x. Writes `bench/results/chaos-<date>-<machine>.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import json
import random
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from common.bus.kafka import Producer
from common.files.artifacts import adapter_path
from common.files.models import tiny_model
from common.runtime.backoff import retry_transient
from common.runtime.config import SharedSettings
from common.state.flow import issue_limit
from common.state.registry import JobRecord
from common.wire.codec import decode, encode
from common.wire.lifecycle import SERVICES, TERMINAL_STATES
from common.wire.messages import (
    AdapterUpdate,
    DeadLetter,
    EnvSettings,
    EvalSettings,
    Event,
    JobAction,
    JobCommand,
    JobSpec,
    LoraSettings,
    RLSettings,
    SamplingSettings,
    Topic,
    Trajectory,
    new_id,
)
from console.stack.children import ChildServer, RestartPolicy, unless_stack_fails
from console.stack.local import LocalStack
from console.stack.services import start_service
from marlaas import Client
from marlaas.eventfeed import AdapterFeed, EventFeed, TopicFeed
from marlaas.jobwatch import submit_jobs

REPLICAS = 2
SESSION_TIMEOUT_S = 6.0  # consumer session timeout of every replica: fail-over in seconds
TENANTS = ("acme", "globex", "initech")
FUZZED_TENANTS = ("acme", "globex")  # in the fuzzed phase; `initech` is the one timed
MAX_SLOWDOWN = 1.5  # the unfuzzed tenant's time under fuzzing / its fault-free time
FAULTS = ("kill", "stop", "redis", "broker", "command", "fuzz")
SERVER_EVERY = 25  # besides random ones, every 25th fault restarts Valkey or the broker in turn
ROOT = Path(__file__).resolve().parents[2]


def missing_steps(events: Sequence[Event], records: Mapping[str, JobRecord | None]) -> list[str]:
    """A completed job whose history lacks a step event of a version it trained: its report
    would show fewer steps than it took (a version published but never announced)."""
    seen: dict[str, set[int]] = {}
    for event in events:
        if event.event == "step":
            seen.setdefault(event.job_id, set()).add(event.step)
    problems = []
    for job_id, record in records.items():
        if record is None or record.status != "completed":
            continue
        missing = set(range(1, record.spec.rl.max_steps + 1)) - seen.get(job_id, set())
        if missing:
            problems.append(f"{job_id}: no step event for versions {sorted(missing)}")
    return problems


class DeadLetterFeed(TopicFeed[DeadLetter]):
    topic = Topic.DLQ
    kind = DeadLetter


@dataclass
class Tally:
    kills: int = 0
    kills_by_service: dict[str, int] = field(default_factory=dict)
    stops: int = 0
    redis_restarts: int = 0
    broker_restarts: int = 0
    commands: int = 0
    fuzzed: list[bytes] = field(default_factory=list)
    invariant_breaks: list[str] = field(default_factory=list)
    crashes: list[str] = field(default_factory=list)
    """Replicas that exited without being killed: a bug, restarted so the run goes on."""
    adapter_hashes: dict[str, str] = field(default_factory=dict)
    tenant_s: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per phase, each tenant's time from submitting its round to its last job's end."""


def chaos_jobs(round_: int, rng: random.Random, max_steps: int) -> list[JobSpec]:
    """3 tenants x 6 jobs covering S x B x G; every third job's rewards are flaky."""
    jobs = []
    for tenant in TENANTS:
        for index in range(6):
            S, B, G = (0, 1, 3)[index % 3], (1, 4)[index % 2], (2, 8)[(index // 2) % 2]
            fail = "flaky" if index % 3 == 2 else ""
            jobs.append(
                JobSpec(
                    job_id=f"{tenant}-r{round_}-j{index}-{new_id()[:6]}",
                    tenant=tenant,
                    base_model=str(tiny_model()),
                    env=EnvSettings(
                        name="chaos",
                        seed=rng.randrange(1000),
                        params={"fail": fail, "hang_s": 0.2} if fail else {},
                    ),
                    rl=RLSettings(
                        group_size=G,
                        groups_per_step=B,
                        max_steps=max_steps,
                        max_staleness=S,
                        max_context_tokens=128,
                        sampling=SamplingSettings(max_new_tokens=8),
                    ),
                    lora=LoraSettings(rank=4),
                    eval=EvalSettings(tasks=0),  # the verifier accounts for training groups
                )
            )
    return jobs


class Chaos:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.tally = Tally()
        self.settings = SharedSettings(
            state_dir=args.run_dir / "state",
            base_model=str(tiny_model()),
            connect_timeout_s=60,
            broker_storage="s3",  # so the broker can be restarted with its data
        )
        self.replicas: dict[str, ChildServer] = {}
        self.stack: LocalStack | None = None
        self.client: Client | None = None
        self.jobs: dict[str, JobSpec] = {}
        self.cancelled: set[str] = set()

    # --- processes --------------------------------------------------------------------

    def _start(self, name: str) -> None:
        assert self.stack is not None
        module = name.split("#")[0]
        env = {
            "ROLLOUT_ENGINE": "tests.chaos.scripted_engine:ScriptedEngine",
            "MARLAAS_ENVIRONMENTS": "chaos=tests.chaos_env:ChaosEnv",
            "ENV_SVC_CLAIM_TIMEOUT_S": "10",
            "ENV_SVC_CLAIM_SWEEP_S": "2",
            "ENV_SVC_ENV_CALL_TIMEOUT_S": "5",
            "TRAINER_SWEEP_INTERVAL_S": "2",
            "TRAINER_GROUP_TIMEOUT_S": "30",
            "MARLAAS_CONSUMER_SESSION_TIMEOUT_S": str(SESSION_TIMEOUT_S),
            "PYTHONPATH": str(ROOT),
            "MARLAAS_LOG_LEVEL": "INFO",
        }
        self.replicas[name] = start_service(
            module,
            self.stack.settings,
            self.stack.kafka_bootstrap,
            self.stack.redis_url,
            self.settings.state_dir / "logs" / f"{name.replace('#', '-')}.log",
            env,
        )

    def _kill(self, name: str) -> None:
        child = self.replicas[name]
        child.process.kill()
        child.process.wait()
        child.close_log()
        self.tally.kills += 1
        module = name.split("#")[0]
        self.tally.kills_by_service[module] = self.tally.kills_by_service.get(module, 0) + 1
        self._start(name)

    async def _stop_a_while(self, name: str) -> None:
        child = self.replicas[name]
        child.process.send_signal(signal.SIGSTOP)
        self.tally.stops += 1
        await asyncio.sleep(SESSION_TIMEOUT_S + 5)
        if child.process.poll() is None:
            child.process.send_signal(signal.SIGCONT)

    async def _kill_server(self, server: str) -> None:
        assert self.stack is not None
        (child,) = [c for c in self.stack.children if c.name == server]
        child.process.kill()
        if server == "valkey":
            self.tally.redis_restarts += 1
        else:
            self.tally.broker_restarts += 1

    # --- faults -----------------------------------------------------------------------

    async def fault_loop(
        self, done: asyncio.Event, kinds: tuple[str, ...], tenants: tuple[str, ...]
    ) -> None:
        """Inject one fault of `kinds` every ~`interval_s`; commands and fuzzed records only
        touch the jobs of `tenants`."""
        weights = {"kill": 70, "stop": 5, "redis": 3, "broker": 1, "command": 11, "fuzz": 10}
        stopped: set[asyncio.Task[None]] = set()
        servers = itertools.cycle(k for k in ("redis", "broker") if k in kinds)
        for count in itertools.count(1):
            await asyncio.sleep(self.args.interval_s * self.rng.uniform(0.5, 1.5))
            if done.is_set():
                break
            (kind,) = self.rng.choices(kinds, [weights[k] for k in kinds])
            if count % SERVER_EVERY == 0:
                kind = next(servers, kind)
            targets = sorted(j for j, spec in self.jobs.items() if spec.tenant in tenants)
            try:
                if kind == "kill":
                    self._kill(self.rng.choice(sorted(self.replicas)))
                elif kind == "stop":
                    trainer = f"trainer_svc#{self.rng.randrange(REPLICAS)}"
                    task = asyncio.create_task(self._stop_a_while(trainer))
                    stopped.add(task)
                    task.add_done_callback(stopped.discard)
                elif kind in ("redis", "broker"):
                    await self._kill_server("valkey" if kind == "redis" else "tansu")
                elif kind == "command":
                    await self._command(self.rng.choice(targets))
                else:
                    await self._fuzz(self.rng.choice(targets))
            except Exception as exc:  # a fault that could not be injected is not a failure
                print(f"fault not injected: {exc!r}", file=sys.stderr)
        await asyncio.gather(*stopped, return_exceptions=True)

    async def _command(self, job_id: str) -> None:
        assert self.client is not None
        if job_id in self.cancelled:
            return
        actions: list[JobAction] = ["pause", "pause", "resume", "resume", "resume", "cancel"]
        action = self.rng.choice(actions)
        if action == "cancel":
            if len(self.cancelled) >= len(self.jobs) // 9:
                action = "resume"  # keep most jobs running to the end
            else:
                self.cancelled.add(job_id)
        await self._send_command(job_id, action)
        self.tally.commands += 1
        if action == "pause":  # resumed a little later, so the job still ends
            asyncio.get_running_loop().call_later(
                3, lambda: asyncio.ensure_future(self._resume(job_id))
            )

    async def _resume(self, job_id: str) -> None:
        if job_id not in self.cancelled:
            await self._send_command(job_id, "resume")

    async def _send_command(self, job_id: str, action: JobAction) -> None:
        assert self.stack is not None
        command = JobCommand(job_id=job_id, action=action, command_id=new_id())
        await submit_jobs(
            self.stack.kafka_bootstrap, [command], timeout_s=30, signing=self.stack.settings.signer
        )

    async def _fuzz(self, job_id: str) -> None:
        assert self.stack is not None
        # Signed: a buggy producer that holds the bus key, so the checks behind the signature
        # (decoding, the trainer's, rollout's) are what the garbage meets.
        producer = Producer(
            self.stack.kafka_bootstrap, client_id="chaos-fuzz", signing=self.stack.settings.signer
        )
        await producer.start(timeout_s=30)
        try:
            records: list[tuple[Topic, bytes]] = [
                (self.rng.choice(list(Topic)), self.rng.randbytes(self.rng.randrange(1, 300))),
                (
                    Topic.TRAJECTORIES,
                    encode(
                        Trajectory(
                            episode_id=f"{job_id}/999999/0",
                            job_id=job_id,
                            group_id=f"{job_id}/g999999",
                            sample_index=10**6,
                            group_size=10**6,
                            token_ids=[10**9] * 3,
                            loss_mask=[5, 5],
                            behaviour_logprobs=[1e300],
                            reward=1e308,
                        )
                    ),
                ),
                (
                    Topic.ADAPTERS,
                    encode(
                        AdapterUpdate(
                            job_id=f"nojob-{new_id()[:6]}",
                            version=10**9,
                            uri="file:///etc",
                            step=-5,
                        )
                    ),
                ),
            ]
            for topic, value in records:
                if topic is Topic.DLQ:
                    continue  # the DLQ is the verifier's to read
                await producer.send_raw(topic.value, value, key=job_id.encode())
                self.tally.fuzzed.append(value)
        finally:
            await producer.stop()

    # --- watching ---------------------------------------------------------------------

    async def watch_invariant(self, done: asyncio.Event) -> None:
        assert self.client is not None
        store = self.client.store
        while not done.is_set():
            for job_id, spec in list(self.jobs.items()):
                try:
                    flow = await store.flow.state(job_id)
                except Exception:
                    continue  # Redis restarting
                rl = spec.rl
                limit = min(
                    issue_limit(flow.trained_version, rl.max_staleness, rl.groups_per_step),
                    rl.max_steps * rl.groups_per_step,
                )
                if flow.live_groups > limit:
                    live, version = flow.live_groups, flow.trained_version
                    self.tally.invariant_breaks.append(
                        f"{job_id}: {live} live groups > {limit} at v{version}"
                    )
            await asyncio.sleep(1.0)

    async def watch_replicas(self, done: asyncio.Event) -> None:
        while not done.is_set():
            for name, child in list(self.replicas.items()):
                if (code := child.process.poll()) is not None:
                    child.close_log()
                    # The log tail goes with it: a replica that exits by itself is a bug to
                    # diagnose, and the state dir of a chaos run is gone by the next session.
                    tail = child.log_tail(40)
                    self.tally.crashes.append(f"{name} exited by itself ({code}):\n{tail}")
                    print(f"replica {name} exited by itself ({code}):\n{tail}", file=sys.stderr)
                    self._start(name)
            await asyncio.sleep(1.0)

    async def watch_adapters(self, done: asyncio.Event) -> None:
        assert self.stack is not None
        async with AdapterFeed(self.stack.kafka_bootstrap) as feed:  # later rounds' jobs too
            while not done.is_set():
                for update in await feed.poll(0.5):
                    key = f"{update.job_id}@v{update.version}"
                    path = adapter_path(update.uri)
                    if update.job_id in self.jobs and key not in self.tally.adapter_hashes:
                        self.tally.adapter_hashes[key] = f"{update.uri} {tree_hash(path)}"

    async def ended(self, job_ids: set[str]) -> set[str]:
        """Those of `job_ids` in a terminal state (none while Valkey is restarting)."""
        assert self.client is not None
        found = set()
        try:
            for job_id in job_ids:
                record = await self.client.store.jobs.get(job_id)
                if record is not None and record.status in TERMINAL_STATES:
                    found.add(job_id)
        except Exception as exc:  # Valkey restarting: ask again later
            print(f"status not read: {exc!r}", file=sys.stderr)
        return found

    async def round_(self, index: int, phase: str, deadline: float) -> bool:
        """Submit round `index` and wait for all its jobs to end (False: the deadline came
        first); records each tenant's time under `phase`."""
        client = self.client
        assert client is not None
        specs = chaos_jobs(index, self.rng, self.args.max_steps)
        self.jobs.update({s.job_id: s for s in specs})
        started = time.monotonic()
        await retry_transient("submitting a round", lambda: client.submit(specs))
        pending, ended_at = {s.job_id for s in specs}, dict[str, float]()
        while pending and time.monotonic() < deadline:
            await asyncio.sleep(2)
            for job_id in await self.ended(pending):
                ended_at[job_id] = time.monotonic() - started
            pending -= set(ended_at)
        if not pending:
            times = self.tally.tenant_s.setdefault(phase, {})
            for tenant in TENANTS:
                times[tenant] = round(
                    max(ended_at[s.job_id] for s in specs if s.tenant == tenant), 1
                )
        return not pending

    # --- the run ----------------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        started = time.time()
        # Restarting what the run kills is the point: never give up on a child here.
        policy = RestartPolicy(max_restarts=10_000, first_delay_s=0.2, max_delay_s=1.0)
        async with LocalStack(
            self.settings, use_existing_from_env=False, restart_policy=policy
        ) as stack:
            self.stack = stack
            for module in SERVICES:
                for index in range(REPLICAS):
                    self._start(f"{module}#{index}")
            async with Client(stack.client_settings, connect_timeout_s=30) as client:
                self.client = client
                result = await unless_stack_fails(self._drive(), stack.watch())
            for child in self.replicas.values():
                child.stop(timeout_s=30)
        result["wall_s"] = round(time.time() - started, 1)
        return result

    async def _drive(self) -> dict[str, Any]:
        deadline = time.monotonic() + self.args.timeout_s
        done = asyncio.Event()
        watchers = [
            asyncio.create_task(self.watch_invariant(done)),
            asyncio.create_task(self.watch_adapters(done)),
            asyncio.create_task(self.watch_replicas(done)),
        ]
        try:
            await self._phases(deadline)
        finally:
            done.set()
            await asyncio.gather(*watchers, return_exceptions=True)
        # Valkey or the broker may still be coming back from the last fault.
        return await retry_transient("verifying the run", self._verify)

    async def _phases(self, deadline: float) -> None:
        phases: list[tuple[str, tuple[str, ...], tuple[str, ...]]] = [
            ("fault-free", (), TENANTS),
            ("fuzzed", ("command", "fuzz"), FUZZED_TENANTS),
            ("chaos", FAULTS, TENANTS),
        ]
        index = 0
        for phase, kinds, tenants in phases:
            print(f"phase {phase}: round {index}", file=sys.stderr, flush=True)
            done = asyncio.Event()
            faults = asyncio.create_task(self.fault_loop(done, kinds, tenants)) if kinds else None
            try:
                while await self.round_(index, phase, deadline):
                    index += 1
                    if phase != "chaos" or self.tally.kills >= self.args.min_kills:
                        break
                    print(
                        f"phase chaos: round {index}, {self.tally.kills} kills",
                        file=sys.stderr,
                        flush=True,
                    )
            finally:
                done.set()
                if faults is not None:
                    await faults
            if time.monotonic() >= deadline:
                return

    async def _verify(self) -> dict[str, Any]:
        assert self.client is not None and self.stack is not None
        problems = [*self.tally.invariant_breaks, *self.tally.crashes]
        lost = double = unexpected = 0
        statuses: dict[str, int] = {}
        audits = await self.client.audits(sorted(self.jobs))  # marlaas.adapters read once
        for job_id in sorted(self.jobs):
            record = await self.client.store.jobs.get(job_id)
            status = record.status if record else "missing"
            statuses[status] = statuses.get(status, 0) + 1
            if job_id not in self.cancelled and status not in ("completed", "failed"):
                problems.append(f"{job_id} ended {status}")
            if status == "failed" and record is not None and not record.reason:
                problems.append(f"{job_id} failed without a reason")
            report = audits[job_id]
            lost += len(report.lost)
            double += len(report.double_trained)
            unexpected += len(report.unexpected)
            problems += [f"{job_id}: {p}" for p in report.problems]
        for key, seen in self.tally.adapter_hashes.items():
            uri, digest = seen.split(" ")
            if tree_hash(adapter_path(uri)) != digest:
                problems.append(f"adapter {key} changed after it was announced")
        async with EventFeed(self.stack.kafka_bootstrap) as events:
            problems += missing_steps(
                await events.read_to_end(timeout_s=120),
                {job_id: (await self.client.store.jobs.get(job_id)) for job_id in self.jobs},
            )
        async with DeadLetterFeed(self.stack.kafka_bootstrap) as feed:
            letters = await feed.read_to_end(timeout_s=120)
        injected = set(self.tally.fuzzed)
        strays = [
            f"{letter.source_topic}@{letter.source_offset} ({letter.service}): {letter.error}"
            for letter in letters
            if letter.raw_value not in injected and not _is_injected(letter, injected)
        ]
        problems += [f"dead letter not injected: {s}" for s in strays]
        times = self.tally.tenant_s
        slowdown = None
        if "fault-free" in times and "fuzzed" in times:
            slowdown = round(times["fuzzed"]["initech"] / times["fault-free"]["initech"], 2)
            if slowdown > MAX_SLOWDOWN:
                problems.append(f"initech (not fuzzed) took {slowdown}x its fault-free time")
        else:
            problems.append(f"phases not finished: {sorted(times)}")
        if not (self.tally.redis_restarts and self.tally.broker_restarts):
            problems.append("the run restarted neither Valkey nor the broker, or not both")
        return {
            "seed": self.args.seed,
            "kills": self.tally.kills,
            "kills_by_service": self.tally.kills_by_service,
            "stops": self.tally.stops,
            "crashes": len(self.tally.crashes),
            "redis_restarts": self.tally.redis_restarts,
            "broker_restarts": self.tally.broker_restarts,
            "commands": self.tally.commands,
            "fuzzed_records": len(self.tally.fuzzed),
            "jobs": len(self.jobs),
            "job_statuses": statuses,
            "lost_groups": lost,
            "double_trained": double,
            "unexpected": unexpected,
            "dlq": len(letters),
            "adapters_checked": len(self.tally.adapter_hashes),
            "tenant_s": times,
            "unfuzzed_slowdown": slowdown,
            "session_timeout_s": SESSION_TIMEOUT_S,
            "interval_s": self.args.interval_s,
            "max_steps": self.args.max_steps,
            "problems": problems[:200],
            "verifier": "pass" if not problems else "fail",
        }


def _is_injected(letter: DeadLetter, injected: set[bytes]) -> bool:
    """A dead letter about an injected record, re-encoded on its way (same message)."""
    try:
        message = decode(Topic(letter.source_topic), letter.raw_value)
    except Exception:
        return False
    return encode(message) in injected


def tree_hash(path: Path) -> str:
    digest = hashlib.sha256()
    if path.is_dir():
        for file in sorted(p for p in path.rglob("*") if p.is_file()):
            digest.update(file.name.encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--min-kills", type=int, default=100)
    parser.add_argument("--interval-s", type=float, default=5.0)
    parser.add_argument("--max-steps", type=int, default=6)
    parser.add_argument("--timeout-s", type=float, default=3000)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    run_id = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    args.run_dir = Path("runs").resolve() / f"chaos-{run_id}"
    result = asyncio.run(Chaos(args).run())
    sys.path.insert(0, str(ROOT / "bench"))  # its scripts' own module of result names
    from machine import machine_fields, result_path, trainer_dtype

    # The engine is the scripted stand-in: only the trainer's precision depends on the CPU.
    result["machine"] = machine_fields(trainer=trainer_dtype())
    out = args.out or result_path("chaos", date=run_id[:8])
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "problems"}, indent=2))
    for problem in result["problems"][:30]:
        print("problem:", problem)
    raise SystemExit(0 if result["verifier"] == "pass" else 1)


if __name__ == "__main__":
    main()
