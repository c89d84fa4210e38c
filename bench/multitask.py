"""Multi-task speed-up: N jobs one after another vs the same N jobs at once, on one stack.

    .venv/bin/python bench/multitask.py --jobs 8 --steps 4   # or make bench-multitask

Both phases run on the same embedded stack and services (one rollout engine, one trainer),
after a one-step warm-up job, with the same job specs (the demo's arithmetic and calculator
jobs, cycled, job j's seed `--seed-base` + j; sampling seeded too, `rl.sampling.seed`, so
both phases draw the same tokens wherever their probabilities agree: closer to the same work
than two independent draws, not equal to it); only the job ids differ between phases.
`--draws` (default 3) repeats the pair with other seeds (+100 each), every other pair
concurrent first, and the headline ratios are over the summed times: one draw's work depends
on its seeds (which groups carry an advantage), and a shared host's speed drifts between
phases minutes apart (bench/README.md, "Multi-task speed-up"). Reported per
phase: wall time from the first submission to the last job's end, the rollout engine's busy
share and tokens/s over the phase (its cumulative Redis stats, before vs after), the
trainer's busy share (sum of its steps' wall time / phase wall time) and each job's reward
over its first and last steps. Then the ratios: speed-up, time saved, utilisation gain, and
`runs` in the cross-bench format (`multitenant.json`): n_jobs, sequential_s, marlaas_s,
time_ratio, util_* (mean busy share of the engine and the trainer), util_ratio and each job's
final reward (mean of its last steps) in both phases, keyed by its index and environment.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
from cpu_account import Snapshot, Timeline  # bench/cpu_account.py
from machine import machine_fields, result_path  # bench/machine.py
from rich.console import Console

from common.runtime.config import SharedSettings, load
from common.wire.lifecycle import REPLICA_COUNTERS, SERVICES, STATE_AFTER, TERMINAL_STATES
from common.wire.messages import EvalSettings, Event, JobSpec
from console.demo import REWARD_WINDOW, demo_jobs
from console.stack.local import LocalStack
from marlaas import Client
from marlaas.jobwatch import JobProgress, watch_jobs

console = Console()

PHASES = {"sequential": "seq", "concurrent": "conc"}
"""Each phase and the tag of its jobs' ids."""
DRAW_SEED_STRIDE = 100
"""Draw i's jobs take seeds `--seed-base` + 100 i + j: 100-107, 200-207, 300-307 by default."""
DRAW_SUMMARY = ("seed_base", "sequential_s", "marlaas_s", "time_ratio", "time_over_work_bound")
"""What the summary printed at the end shows of each draw."""


@dataclass
class Phase:
    name: str
    wall_s: float = 0.0
    rollout: dict[str, float] = field(default_factory=dict)
    trainer_busy_s: float = 0.0
    trainer_tokens: float = 0.0
    trainer_samples: float = 0.0
    trainer_thread_s: float = 0.0
    zero_advantage_samples: float = 0.0
    steps: list[dict[str, Any]] = field(default_factory=list)
    jobs: list[dict[str, Any]] = field(default_factory=list)
    cpu: dict[str, Any] = field(default_factory=dict)
    timeline: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        rollout_busy = self.rollout.get("busy_s", 0.0)
        rollout_up = self.rollout.get("uptime_s", 0.0)
        tokens = self.rollout.get("generated_tokens", 0.0)
        return {
            "wall_s": round(self.wall_s, 1),
            "rollout_busy_share": _share(rollout_busy, rollout_up),
            "rollout_tokens_per_s": _share(tokens, self.wall_s),
            "rollout_delta": {k: round(v, 3) for k, v in self.rollout.items()},
            "trainer_busy_share": _share(self.trainer_busy_s, self.wall_s),
            "trainer_busy_s": round(self.trainer_busy_s, 1),
            # Trained completion tokens; equal to the generated ones when nothing was dropped.
            "trainer_tokens": self.trainer_tokens,
            "trainer_tokens_per_wall_s": _share(self.trainer_tokens, self.wall_s),
            # Threads per pass, weighted by step time: above 1 where it borrowed the engine's core.
            "trainer_threads": _share(self.trainer_thread_s, self.trainer_busy_s),
            # Trajectories whose advantage was 0: the trainer leaves them out of its passes.
            "zero_advantage_share": _share(self.zero_advantage_samples, self.trainer_samples),
            "cpu": self.cpu,
            "work_bound_s": round(self.cpu.get("cpu_s", 0.0) / _cpus(), 1),
            # The phase's time with no step in the trainer: how long it waited for work.
            "trainer_idle_s": _idle_s(self.steps, self.wall_s),
            "jobs": self.jobs,
            "steps": sorted(self.steps, key=lambda step: step["at_s"]),
            # Per second: each core's busy share and each service's CPU (cores' worth).
            "timeline": self.timeline,
        }


def _share(part: float | None, whole: float | None, digits: int = 4) -> float | None:
    """part / whole rounded; None when either is unknown or whole is not positive."""
    if part is None or whole is None or whole <= 0:
        return None
    return round(part / whole, digits)


def bench_jobs(
    base: list[JobSpec], count: int, steps: int, tag: str, seed_base: int = 100
) -> list[JobSpec]:
    """`count` jobs cycling through `base`, `steps` steps each, task and sampling seeds
    `seed_base` + i, ids tagged."""
    specs = []
    for index in range(count):
        template = base[index % len(base)]
        specs.append(
            msgspec.structs.replace(
                template,
                job_id=f"{tag}-{index}-{template.env.name}",
                env=msgspec.structs.replace(template.env, seed=seed_base + index),
                rl=msgspec.structs.replace(
                    template.rl,
                    max_steps=steps,
                    sampling=msgspec.structs.replace(template.rl.sampling, seed=seed_base + index),
                ),
                eval=EvalSettings(tasks=0),  # training throughput only
            )
        )
    return specs


async def rollout_totals(client: Client) -> dict[str, float]:
    """Cumulative counters summed over rollout replicas."""
    totals: dict[str, float] = {}
    for stats in (await client.store.replicas.stats()).values():
        for name, value in stats.as_map().items():
            if name in REPLICA_COUNTERS:
                totals[name] = totals.get(name, 0.0) + value
        if stats.uptime_s is not None and stats.compute_slots is not None:
            # the cores' time the engine could have computed: its compute share's whole
            totals["core_s"] = totals.get("core_s", 0.0) + stats.uptime_s * stats.compute_slots
    return totals


async def run_jobs(
    client: Client, bootstrap: str, specs: list[JobSpec], timeout_s: float
) -> tuple[dict[str, JobProgress], list[Event]]:
    """Submit `specs` at once and wait for all of them; their progress and step events."""
    now = time.time()  # a job's wall time counts from its submission, not from the script's start
    specs = [msgspec.structs.replace(spec, submitted_at=now) for spec in specs]
    jobs = {spec.job_id: JobProgress.of(spec) for spec in specs}
    steps: list[Event] = []

    def keep(event: Event) -> None:
        if event.event == "step":
            steps.append(event)
        if STATE_AFTER.get(event.event) in TERMINAL_STATES:
            console.print(f"  {event.job_id}: {event.event} {event.reason}")

    await client.submit(specs)
    await watch_jobs(bootstrap, jobs, timeout_s=timeout_s, on_event=keep)
    bad = [j for j, p in jobs.items() if p.status != "completed"]
    if bad:
        raise RuntimeError(f"jobs did not complete: {bad}")
    return jobs, steps


def start_py_spy(pid: int, out: Path) -> subprocess.Popen[bytes]:
    """Sample a process's Python stacks (and its native frames) until stopped, into `out`."""
    exe = shutil.which("py-spy")
    if exe is None:
        raise SystemExit("--py-spy needs py-spy on PATH (pip install py-spy)")
    argv = [exe, "record", "--pid", str(pid), "--rate", "20", "--format", "raw", "--nonblocking"]
    return subprocess.Popen([*argv, "--output", str(out)], stdout=subprocess.DEVNULL)


async def measure(
    client: Client,
    stack: LocalStack,
    name: str,
    batches: list[list[JobSpec]],
    timeout_s: float,
    py_spy: Path | None = None,
) -> Phase:
    """Run the batches one after another (each batch's jobs at once) and measure the whole:
    the engine's counters, the trainer's steps, and the CPU time of every core and process."""
    phase = Phase(name)
    roots = {child.name: child.process.pid for child in stack.children} | {"bench": os.getpid()}
    before = await rollout_totals(client)
    cpu_before = Snapshot.take(roots)
    trainer = roots.get("trainer_svc")
    spy = start_py_spy(trainer, py_spy / f"trainer-{name}.txt") if py_spy and trainer else None
    timeline = Timeline(roots)
    sampling = asyncio.create_task(timeline.run())
    started = time.time()
    for batch in batches:
        console.print(f"[bold]{name}[/]: {', '.join(spec.job_id for spec in batch)}")
        jobs, steps = await run_jobs(client, stack.kafka_bootstrap, batch, timeout_s)
        for event in {e.event_id: e for e in steps}.values():
            metrics = event.metrics
            # step_s is each job's share of a step it may have shared with others, so the
            # sum over jobs is the trainer's compute time (wall_step_s would count it twice).
            phase.trainer_busy_s += float(metrics.get("step_s", 0.0))
            phase.steps.append(
                {
                    "job": "-".join(event.job_id.rsplit("-", 2)[-2:]),
                    "step": event.step,
                    "at_s": round(event.at - started, 1),
                    **{
                        key: round(metrics[key], 3)
                        for key in (
                            "step_s",
                            "wall_step_s",
                            "threads",
                            "zero_advantage_share",
                            "staleness_mean",
                            "tokens",
                            "positions",
                            "padding_share",
                        )
                        if key in metrics
                    },
                }
            )
            phase.trainer_tokens += float(metrics.get("tokens", 0.0))
            phase.trainer_thread_s += float(metrics.get("step_s", 0.0)) * float(
                metrics.get("threads", 1.0)
            )
            samples = float(metrics.get("samples", 0.0))
            phase.trainer_samples += samples
            phase.zero_advantage_samples += samples * float(
                metrics.get("zero_advantage_share", 0.0)
            )
        phase.jobs += [job.summary(REWARD_WINDOW) for job in jobs.values()]
    phase.wall_s = time.time() - started
    phase.cpu = Snapshot.take(roots).since(cpu_before, phase.wall_s)
    sampling.cancel()
    phase.timeline = timeline.to_json()
    if spy is not None:
        spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        spy.wait(60)
    after = await rollout_totals(client)
    phase.rollout = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    console.print(f"{name}: {phase.wall_s:.0f} s")
    return phase


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    settings = load(SharedSettings)
    run_id = args.run_id
    settings = settings.model_copy(update={"state_dir": args.run_dir / "state"})
    base = demo_jobs(settings.base_model, run_id)
    if args.envs:
        base = [spec for spec in base if spec.env.name in args.envs.split(",")]
    warmup = bench_jobs(base, 1, 1, f"warm-{run_id}")
    draws: list[dict[str, Any]] = []
    async with LocalStack(settings, services=SERVICES) as stack:
        precisions = stack.dtypes
        async with Client(stack.client_settings) as client:
            await measure(client, stack, "warm-up", [warmup], args.timeout_s)
            for index in range(args.draws):
                seed_base = args.seed_base + DRAW_SEED_STRIDE * index
                tag = run_id if args.draws == 1 else f"{run_id}-d{index}"
                specs = {
                    name: bench_jobs(
                        base, args.jobs, args.steps, f"{PHASES[name]}-{tag}", seed_base
                    )
                    for name in PHASES
                }
                batches = {
                    "sequential": [[spec] for spec in specs["sequential"]],
                    "concurrent": [specs["concurrent"]],
                }
                phases: dict[str, Phase] = {}
                # Every other draw the other way round: a host that slows down (or speeds up)
                # over the run weighs on both phases alike.
                for name in list(PHASES)[:: 1 if index % 2 == 0 else -1]:
                    phases[name] = await measure(
                        client, stack, name, batches[name], args.timeout_s, args.py_spy
                    )
                draws.append(
                    _draw(seed_base, list(phases), phases["sequential"], phases["concurrent"])
                    | {"specs": [msgspec.to_builtins(spec) for spec in specs["concurrent"]]}
                )
    seq_s = sum(draw["sequential"]["wall_s"] for draw in draws)
    conc_s = sum(draw["concurrent"]["wall_s"] for draw in draws)
    work_s = sum(draw["concurrent"]["work_bound_s"] for draw in draws)
    return {
        "runs": [draw["run"] | {"model": settings.base_model} for draw in draws],
        "run_id": run_id,
        "machine": machine_fields(**precisions),
        "base_model": settings.base_model,
        "jobs": args.jobs,
        "steps_per_job": args.steps,
        "seed_base": args.seed_base,
        # Over every draw: the phases' summed wall times. Each draw is one sample of the work
        # (the jobs' rewards, so which groups carry an advantage, differ with the seeds and
        # with the timing), and the host's speed drifts between phases.
        "sequential_s": round(seq_s, 1),
        "concurrent_s": round(conc_s, 1),
        "time_ratio": _share(conc_s, seq_s),
        "speedup": _share(seq_s, conc_s),
        "time_saved": _share(seq_s - conc_s, seq_s),
        # The concurrent phases' own CPU time over the cores: their wall time were every core
        # busy throughout. time_over_work_bound is how far the run is from that.
        "work_bound_s": round(work_s, 1),
        "time_over_work_bound": _share(conc_s, work_s),
        "draws": draws,
    }


def _draw(seed_base: int, order: list[str], seq_phase: Phase, conc_phase: Phase) -> dict[str, Any]:
    """One draw's two phases and their ratios; `run` in the cross-bench format."""
    seq, conc = seq_phase.to_json(), conc_phase.to_json()
    util = {"sequential": _mean_busy(seq), "concurrent": _mean_busy(conc)}
    final_rewards = {
        name: {job["job_id"].split("-", 2)[-1]: job["reward_end"] for job in phase["jobs"]}
        for name, phase in (("sequential", seq), ("concurrent", conc))
    }
    return {
        "seed_base": seed_base,
        "order": order,
        "run": {
            "n_jobs": len(conc["jobs"]),
            "seed_base": seed_base,
            "sequential_s": seq["wall_s"],
            "marlaas_s": conc["wall_s"],
            "time_ratio": _share(conc["wall_s"], seq["wall_s"]),
            "time_over_work_bound": _share(conc["wall_s"], conc["work_bound_s"]),
            "util_sequential": util["sequential"],
            "util_marlaas": util["concurrent"],
            "util_ratio": _share(util["concurrent"], util["sequential"]),
            "reward_sequential": final_rewards["sequential"],
            "reward_marlaas": final_rewards["concurrent"],
        },
        "sequential": seq,
        "concurrent": conc,
        "speedup": _share(seq["wall_s"], conc["wall_s"]),
        "rollout_busy_gain": _share(conc["rollout_busy_share"], seq["rollout_busy_share"], 3),
        "trainer_busy_gain": _share(conc["trainer_busy_share"], seq["trainer_busy_share"], 3),
    }


def _idle_s(steps: list[dict[str, Any]], wall_s: float) -> float | None:
    """The time from 0 to `wall_s` covered by no step (each step from `at_s - wall_step_s`
    to `at_s`); None when the steps do not say their wall time."""
    spans = sorted(
        (step["at_s"] - step["wall_step_s"], step["at_s"])
        for step in steps
        if "wall_step_s" in step
    )
    if len(spans) < len(steps) or not spans:
        return None
    idle, reached = 0.0, 0.0
    for start, end in spans:
        idle += max(0.0, start - reached)
        reached = max(reached, end)
    return round(idle + max(0.0, wall_s - reached), 1)


def _mean_busy(phase: dict[str, Any]) -> float | None:
    """Mean busy share of the two compute stages (rollout engine, trainer) over a phase."""
    shares = [phase["rollout_busy_share"], phase["trainer_busy_share"]]
    if any(share is None for share in shares):
        return None
    return round(sum(shares) / len(shares), 4)


def _cpus() -> int:
    return len(os.sched_getaffinity(0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=4, help="N jobs in each phase")
    parser.add_argument("--steps", type=int, default=6, help="training steps per job")
    parser.add_argument("--envs", default="", help="only these demo environments, e.g. arithmetic")
    parser.add_argument("--timeout-s", type=float, default=3600, help="per batch of jobs")
    parser.add_argument(
        "--seed-base",
        type=int,
        default=100,
        help="job i's task and sampling seed: this + i, in both phases (another draw)",
    )
    parser.add_argument(
        "--draws",
        type=int,
        default=3,
        help="draws of the work (seed sets 100 apart), each run both ways, every other one "
        "concurrent first; the ratios are over their summed times",
    )
    parser.add_argument(
        "--keep-artifacts",
        action="store_true",
        help="keep the jobs' adapters and checkpoints under runs/ (removed at the end otherwise)",
    )
    parser.add_argument(
        "--py-spy",
        type=Path,
        default=None,
        help="write py-spy samples of the trainer per phase into this folder",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="default results/multitask-<jobs>x<steps>-<date>-<machine>.json",
    )
    args = parser.parse_args()
    args.run_id = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    args.run_dir = Path("runs").resolve() / f"multitask-{args.run_id}"
    if args.py_spy:
        args.py_spy.mkdir(parents=True, exist_ok=True)
    result = asyncio.run(bench(args))
    out = args.out or result_path(
        f"multitask-{args.jobs}x{args.steps}", date=args.run_id.split("-")[0]
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    if not args.keep_artifacts:
        # Every version of every job's adapter and its checkpoints: ~0.5 GB per pair of phases
        # at 8x4, kept under runs/ otherwise (19 GB of them once filled this machine's disk).
        shutil.rmtree(args.run_dir / "state" / "artifacts", ignore_errors=True)
    summary = ("time_ratio", "speedup", "time_saved", "time_over_work_bound")
    console.print_json(
        json.dumps(
            {k: result[k] for k in summary}
            | {
                "draws": [
                    {k: draw["run"][k] for k in DRAW_SUMMARY} | {"order": draw["order"]}
                    for draw in result["draws"]
                ]
            }
        )
    )


if __name__ == "__main__":
    main()
