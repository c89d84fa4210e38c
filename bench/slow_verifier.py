"""A reward that waits on a remote verifier: one job alone vs four at once, one env_svc replica.

    .venv/bin/python bench/slow_verifier.py                 # or make bench-slow-verifier
    .venv/bin/python bench/slow_verifier.py --records-in-flight 1 --env-workers 4   # as before

The jobs run `remote_verifier` (examples/envs/remote_verifier.py): arithmetic whose reward is a
plain synchronous function that blocks `--wait-s` (1 s) per episode, as a call to a remote
verifier would. One embedded stack with one replica of each service; phases one after another:
one job alone, `--jobs` (4) jobs at once, the one job alone again (a host whose speed drifts
weighs on both sides). The headline `together_over_alone` is the together phase's wall time
over the mean of the two alone phases (issue 41: within 1.5; 3.3 when env_svc handled one
record at a time). Each phase also records the rollout engine's busy share and env_svc's
records in flight (its `marlaas_consumer_records_in_flight` gauge, sampled every 0.25 s).
`--records-in-flight 1 --env-workers 4` runs env_svc as it was before records were handled
at once, for the same measurement side by side.

Where the time goes besides the wait: on SmolLM2-135M and 2 CPU cores the four jobs' compute
alone takes about 2.3x one job's time (the work bound), which no env_svc setting can move.
`--tiny` runs the tiny random model instead; vLLM's per-token overhead on its one core then
still bounds the four jobs (the phases' `cpu`: rollout_svc's CPU seconds). `--scripted-engine`
also replaces the engine by the chaos run's deterministic one (tests/chaos/scripted_engine.py,
answers at once): sampling then costs next to nothing, as on an accelerator, and the ratio
measures what the jobs' waits cost when they share one env_svc replica. Broker, Redis,
env_svc, rollout_svc and the trainer (on the tiny model) stay the real ones.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import msgspec
from machine import machine_fields, result_path  # bench/machine.py
from multitask import Phase, measure  # bench/multitask.py
from rich.console import Console

from common.runtime.config import EnvServiceSettings, SharedSettings, load
from common.wire.lifecycle import SERVICES
from common.wire.messages import EnvSettings, JobSpec
from console.demo import ARITHMETIC_BUDGETS, job_spec
from console.stack.local import LocalStack
from marlaas import Client

console = Console()
EXAMPLE_ENVS = Path(__file__).resolve().parent.parent / "examples" / "envs"
GAUGE = "marlaas_consumer_records_in_flight"


def verifier_jobs(
    base_model: str, tag: str, count: int, steps: int, wait_s: float, seed: int
) -> list[JobSpec]:
    """`count` jobs of the demo's arithmetic settings on `remote_verifier`, seeds `seed` + i."""
    return [
        job_spec(
            f"{tag}-{index}",
            f"tenant{index % 2}",
            EnvSettings(
                name="remote_verifier", params={"verify_wait_s": wait_s}, seed=seed + index
            ),
            base_model=base_model,
            sampling_seed=seed + index,
            **(ARITHMETIC_BUDGETS | {"max_steps": steps}),
        )
        for index in range(count)
    ]


def use_example_env(registration: str, *paths: Path) -> None:
    """Register an environment of examples/envs/ (`name=module:Class`) for the services the
    stack starts (child processes: they read it from their environment) and for this one;
    `paths` go on their Python path too."""
    os.environ["MARLAAS_ENVIRONMENTS"] = registration
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(EXAMPLE_ENVS), *map(str, paths), os.environ.get("PYTHONPATH")])
    )
    sys.path.insert(0, str(EXAMPLE_ENVS))


class InFlightSampler:
    """Samples env_svc's records-in-flight gauge from its /metrics while a phase runs."""

    def __init__(self, metrics_url: str) -> None:
        self.url = f"{metrics_url}/metrics"
        self.samples: list[float] = []

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=2.0) as http:
            while True:
                try:
                    text = (await http.get(self.url)).text
                except httpx.HTTPError:
                    text = ""
                for line in text.splitlines():
                    if line.startswith(GAUGE + "{"):
                        self.samples.append(float(line.rsplit(" ", 1)[1]))
                await asyncio.sleep(0.25)

    def summary(self) -> dict[str, float]:
        if not self.samples:
            return {}
        busy = [s for s in self.samples if s > 0]
        return {
            "peak": max(self.samples),
            "mean_while_busy": round(statistics.fmean(busy), 1) if busy else 0.0,
            "samples": len(self.samples),
        }


async def phase(
    client: Client, stack: LocalStack, name: str, specs: list[JobSpec], timeout_s: float
) -> dict[str, Any]:
    env_svc = next(child for child in stack.children if child.name == "env_svc")
    assert env_svc.metrics_url, "env_svc exposes no /metrics"
    sampler = InFlightSampler(env_svc.metrics_url)
    sampling = asyncio.create_task(sampler.run())
    try:
        measured: Phase = await measure(client, stack, name, [specs], timeout_s)
    finally:
        sampling.cancel()
    result = measured.to_json()
    return {
        "jobs": len(specs),
        "wall_s": result["wall_s"],
        "rollout_busy_share": result["rollout_busy_share"],
        "trainer_busy_share": result["trainer_busy_share"],
        "env_records_in_flight": sampler.summary(),
        "job_summaries": result["jobs"],
        "cpu": result["cpu"],
    }


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    settings = load(SharedSettings).model_copy(update={"state_dir": args.run_dir / "state"})
    env_settings = load(EnvServiceSettings)  # as the env_svc child reads them
    run_id = args.run_id
    phases: dict[str, dict[str, Any]] = {}
    async with LocalStack(settings, services=SERVICES) as stack:
        precisions = stack.dtypes
        async with Client(stack.client_settings) as client:
            warm = verifier_jobs(settings.base_model, f"warm-{run_id}", 1, 1, 0.0, 1)
            await measure(client, stack, "warm-up", [warm], args.timeout_s)
            plan = [
                ("alone-1", 1, args.seed),
                ("together", args.jobs, args.seed),
                ("alone-2", 1, args.seed),
            ]
            for name, count, seed in plan:
                specs = verifier_jobs(
                    settings.base_model, f"{name}-{run_id}", count, args.steps, args.wait_s, seed
                )
                phases[name] = await phase(client, stack, name, specs, args.timeout_s)
    alone_s = statistics.fmean(phases[n]["wall_s"] for n in ("alone-1", "alone-2"))
    return {
        "run_id": run_id,
        "machine": machine_fields(**precisions),
        "base_model": settings.base_model,
        "engine": os.environ.get("ROLLOUT_ENGINE", "vllm"),
        "env_svc": {
            "records_in_flight": env_settings.records_in_flight,
            "env_workers": env_settings.env_workers,
            "replicas": 1,
        },
        "verify_wait_s": args.wait_s,
        "jobs": args.jobs,
        "steps_per_job": args.steps,
        "alone_s": round(alone_s, 1),
        "together_s": phases["together"]["wall_s"],
        "together_over_alone": round(phases["together"]["wall_s"] / alone_s, 3),
        "phases": phases,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=4, help="jobs in the together phase")
    parser.add_argument("--steps", type=int, default=6, help="training steps per job")
    parser.add_argument("--wait-s", type=float, default=1.0, help="the verifier's answer time")
    parser.add_argument("--seed", type=int, default=100, help="job i's task and sampling seed")
    parser.add_argument("--records-in-flight", type=int, default=None, help="ENV_SVC_ setting")
    parser.add_argument("--env-workers", type=int, default=None, help="ENV_SVC_ setting")
    parser.add_argument("--timeout-s", type=float, default=3600, help="per phase")
    parser.add_argument("--tag", default="", help="added to the result's file name")
    parser.add_argument("--tiny", action="store_true", help="the tiny random model, not SmolLM2")
    parser.add_argument(
        "--scripted-engine", action="store_true", help="a deterministic engine (with --tiny)"
    )
    args = parser.parse_args()
    if args.scripted_engine:  # read by rollout_svc (the repository on its path: below)
        os.environ["ROLLOUT_ENGINE"] = "tests.chaos.scripted_engine:ScriptedEngine"
        args.tiny = True
        args.tag = "-".join(filter(None, ["scripted", args.tag]))
    if args.tiny:
        from common.files.models import tiny_model

        os.environ["MARLAAS_BASE_MODEL"] = str(tiny_model())  # read by the stack and services
        args.tag = "-".join(filter(None, ["tiny", args.tag]))
    args.run_id = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    args.run_dir = Path("runs").resolve() / f"slow-verifier-{args.run_id}"
    repository = [EXAMPLE_ENVS.parent.parent] if args.scripted_engine else []
    use_example_env("remote_verifier=remote_verifier:RemoteVerifierEnv", *repository)
    for name, value in (
        ("ENV_SVC_RECORDS_IN_FLIGHT", args.records_in_flight),
        ("ENV_SVC_ENV_WORKERS", args.env_workers),
    ):
        if value is not None:
            os.environ[name] = str(value)
    result = asyncio.run(bench(args))
    suffix = f"-{args.tag}" if args.tag else ""
    out = result_path(f"slow-verifier-{args.jobs}x{args.steps}{suffix}", date=args.run_id[:8])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(msgspec.json.format(msgspec.json.encode(result), indent=2).decode() + "\n")
    shutil.rmtree(args.run_dir / "state" / "artifacts", ignore_errors=True)
    summary = {k: result[k] for k in ("alone_s", "together_s", "together_over_alone")}
    console.print_json(data=summary | {"out": str(out)})


if __name__ == "__main__":
    main()
