"""An async tool that waits 1 s: hundreds of episodes at once on one env_svc replica.

    .venv/bin/python bench/async_tools.py          # or make bench-async-tools

Jobs run `remote_lookup` (examples/envs/remote_lookup.py): each episode's first turn calls an
`async def` tool that answers after `--wait-s` (1 s), its second turn answers. The rollout
engine is a deterministic stand-in that writes the call and the answer at once
(bench/tool_engine.py), so the engine costs nothing and what is measured is env_svc; the
trainer trains the tiny model. One embedded stack, one replica of each service, env_svc with
its default settings (records in flight, workers). Two phases, one after another: a job whose
steps take `--few` episodes, then one whose steps take `--episodes` (200): G x B episodes
issued at once, each waiting on the tool at the same time. Reported per phase: wall time,
wall time per step, and env_svc's records in flight (its gauge, sampled every 0.25 s: the
concurrency reached). The headline `many_over_few` is the ratio of the phases' time per step
(1.0: 200 episodes' waits overlap completely; 200 / few: one at a time).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
from machine import machine_fields, result_path  # bench/machine.py
from rich.console import Console
from slow_verifier import phase, use_example_env  # bench/slow_verifier.py

from common.files.models import tiny_model
from common.runtime.config import EnvServiceSettings, SharedSettings, load
from common.wire.lifecycle import SERVICES
from common.wire.messages import EnvSettings, JobSpec
from console.demo import job_spec
from console.stack.local import LocalStack
from marlaas import Client

console = Console()
BENCH = Path(__file__).resolve().parent


def lookup_job(job_id: str, episodes: int, steps: int, wait_s: float) -> JobSpec:
    """A job whose every step is `episodes` episodes (groups of 8, or one group when fewer)."""
    group_size = min(episodes, 8)
    return job_spec(
        job_id,
        "acme",
        EnvSettings(name="remote_lookup", params={"wait_s": wait_s}),
        group_size=group_size,
        groups_per_step=episodes // group_size,
        max_steps=steps,
        max_staleness=0,
        max_context_tokens=512,
        max_new_tokens=32,
    )


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    settings = SharedSettings(state_dir=args.run_dir / "state", base_model=str(tiny_model()))
    env_settings = load(EnvServiceSettings)
    phases: dict[str, dict[str, Any]] = {}
    async with LocalStack(settings, services=SERVICES) as stack:
        async with Client(stack.client_settings) as client:
            warm = lookup_job(f"warm-{args.run_id}", 2, 1, 0.0)
            await phase(client, stack, "warm-up", [warm], args.timeout_s)
            for name, episodes in (("few", args.few), ("many", args.episodes)):
                job = lookup_job(f"{name}-{args.run_id}", episodes, args.steps, args.wait_s)
                phases[name] = await phase(client, stack, name, [job], args.timeout_s)
                phases[name]["episodes_per_step"] = episodes
                phases[name]["wall_s_per_step"] = round(phases[name]["wall_s"] / args.steps, 2)
    few, many = phases["few"], phases["many"]
    return {
        "run_id": args.run_id,
        "machine": machine_fields(),
        "engine": "bench/tool_engine.py (scripted: a tool call, then an answer, at once)",
        "base_model": "tiny (common.files.models.tiny_model)",
        "env_svc": {
            "records_in_flight": env_settings.records_in_flight,
            "env_workers": env_settings.env_workers,
            "replicas": 1,
        },
        "tool_wait_s": args.wait_s,
        "steps_per_job": args.steps,
        "episodes_per_step": args.episodes,
        "peak_records_in_flight": many["env_records_in_flight"].get("peak"),
        "many_over_few": round(many["wall_s_per_step"] / few["wall_s_per_step"], 3),
        "phases": phases,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=200, help="episodes per step, at once")
    parser.add_argument("--few", type=int, default=2, help="episodes per step, the baseline")
    parser.add_argument("--steps", type=int, default=3, help="training steps per job")
    parser.add_argument("--wait-s", type=float, default=1.0, help="the tool's answer time")
    parser.add_argument("--timeout-s", type=float, default=1800, help="per phase")
    args = parser.parse_args()
    args.run_id = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    args.run_dir = Path("runs").resolve() / f"async-tools-{args.run_id}"
    use_example_env("remote_lookup=remote_lookup:RemoteLookupEnv", BENCH, BENCH.parent)
    os.environ["ROLLOUT_ENGINE"] = "tool_engine:ToolCallingEngine"  # read by rollout_svc
    result = asyncio.run(bench(args))
    out = result_path(f"async-tools-{args.episodes}", date=args.run_id[:8])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(msgspec.json.format(msgspec.json.encode(result), indent=2).decode() + "\n")
    shutil.rmtree(args.run_dir / "state" / "artifacts", ignore_errors=True)
    summary = ("peak_records_in_flight", "many_over_few")
    console.print_json(data={k: result[k] for k in summary} | {"out": str(out)})


if __name__ == "__main__":
    main()
