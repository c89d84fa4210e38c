"""Agentic jobs whose tools take real time: N jobs one after another vs all at once, one stack.

    .venv/bin/python bench/agentic.py --jobs 8 --steps 4 --latency-s 1   # or make bench-agentic
    .venv/bin/python bench/agentic.py --model tiny --jobs 2 --steps 2 --eval-tasks 4   # plumbing
    .venv/bin/python bench/agentic.py --resummarise bench/results/agentic-....json

The jobs are multi-turn tool-use episodes (a tool call, its result, the answer) of four
tenants, cycling over two environments:
- `http_lookup` (examples/envs/http_lookup.py): the model asks an inventory service for a
  product's stock; the service is a real HTTP server on the loopback, in a process of its own
  started here, that answers after `--latency-s` (0, 1, 3: a remote API or sandbox); the
  tool calls it with httpx. The calculator's turn format (the demo's calculator jobs).
- `code_tasks` (env_svc/envs/code_tasks.py): the model's Python runs in the sandbox
  (bubblewrap); left out, and said so in the result, where the sandbox cannot run here.
Job j is tenant j mod 4's, seeds `--seed-base` + j (tasks and sampling), evaluated greedily on
`--eval-tasks` held-out tasks (the same tasks for every job of one environment) before its
first step and after its last.

Phases, on one stack after a one-step warm-up: sequential (jobs alone, one after another),
then concurrent (all submitted at once). With `--alone-runs R` (the default past 8 jobs) the
sequential phase runs only the first R jobs of each environment alone, and a job not run
alone counts its environment's mean alone run (`sequential_from` says which).

Figures per phase (`sequential`, `concurrent`): wall time (first submission to the last job's
final evaluation; sequential: the sum of the alone runs, `sequential_measured_s` what was run);
the engine's compute share (`rollout_busy_share`: its CPU time over its cores' time up,
rollout_svc/compute.py) and the trainer's busy share (its steps' time over the wall), and their
mean (`utilisation`); beside them the engine's share of time with a request in it
(`rollout_request_share`) and its mean batch; the work bound (every core's CPU seconds over the
cores) and the wall over it; engine tokens/s; training steps/s. `time_ratio`: concurrent over
sequential wall time (below 1: sharing saves time); `util_ratio`: concurrent over sequential
utilisation. `finish_s`: min / median / max of the concurrent jobs' times from submission to
completion (their final evaluation follows). `accuracy`: each job's held-out accuracy at its
final version shared and alone (± SE), and whether the shared one is within one SE of the
alone one or better (the larger SE, at least one task: `within_one_se_or_better` counts
them; `accuracy_by_spec`: each distinct spec's shared jobs against its alone runs as two
samples, the shared mean within one SE of their difference or better, where a job without an
alone run of its own is otherwise judged against another seed's: `specs_within_one_se_or_better`
counts them). `idle`: where the cores idled (core-seconds), in the measured alone runs together and
in the concurrent phase: before the trainer's first step, after its last, and between by
which service waited for work (`agentic_figures.idle_profile`). The phases' `cpu` counts
the HTTP service under `bench` (a child of this process). `--model tiny` (random weights)
makes accuracies meaningless and never calls a tool; `--engine scripted` (bench/tool_engine.py)
writes a `lookup` call, then a wrong answer, at once: every `http_lookup` episode waits on the
service (a `code_tasks` one is told the tool is unknown), and sampling costs nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import msgspec
from agentic_figures import (
    Accuracy,
    Work,
    accuracy_checks,
    idle_profile,
    ratios,
    sequential_work,
    spec_checks,
    spread,
)
from machine import machine_fields, result_path  # bench/machine.py
from multitask import measure  # bench/multitask.py
from rich.console import Console
from slow_verifier import EXAMPLE_ENVS, use_example_env  # bench/slow_verifier.py

from common.runtime.config import SharedSettings, load
from common.wire.lifecycle import SERVICES
from common.wire.messages import EnvSettings, JobSpec
from console.demo import ARITHMETIC_BUDGETS, job_spec
from console.stack.children import free_port
from console.stack.local import LocalStack
from marlaas import Client

console = Console()
BENCH = Path(__file__).resolve().parent
TENANTS = ("acme", "globex", "initech", "umbrella")
ENVS = ("http_lookup", "code_tasks")
BUDGETS: dict[str, dict[str, Any]] = {
    # The demo's calculator jobs: room for a call, its result and the answer.
    "http_lookup": ARITHMETIC_BUDGETS | {"max_context_tokens": 512, "max_new_tokens": 48},
    # bench/learning.py's code jobs: a call with a line of code is ~60 tokens.
    "code_tasks": ARITHMETIC_BUDGETS | {"max_context_tokens": 768, "max_new_tokens": 96},
}
ALONE_RUNS_PAST_8 = 2
"""Alone runs of each environment when `--alone-runs` is not given and there are more than 8
jobs (32 jobs alone one after another would take hours)."""
SERVICE_START_S = 30.0


def agentic_jobs(args: argparse.Namespace, envs: tuple[str, ...], tag: str) -> list[JobSpec]:
    """`args.jobs` jobs: job j is tenant j mod 4's, on an environment that alternates so that
    each tenant has both; seeds `args.seed_base` + j; ids `<tag>-<j>-<env>`."""
    specs = []
    for index in range(args.jobs):
        env = envs[(index + index // len(TENANTS)) % len(envs)]
        seed = args.seed_base + index
        specs.append(
            job_spec(
                f"{tag}-{index}-{env}",
                TENANTS[index % len(TENANTS)],
                EnvSettings(name=env, seed=seed),
                base_model=args.base_model,
                sampling_seed=seed,
                eval_tasks=args.eval_tasks,
                **(BUDGETS[env] | {"max_steps": args.steps}),
            )
        )
    return specs


def job_key(job_id: str) -> str:
    """`<j>-<env>` of `<tag>-<j>-<env>`: the same job in every phase."""
    return "-".join(job_id.rsplit("-", 2)[-2:])


def alone_plan(specs: list[JobSpec], runs_per_env: int) -> list[JobSpec]:
    """The jobs run alone: every one (`runs_per_env` 0), else the first that many of each
    environment."""
    if runs_per_env == 0:
        return specs
    taken: dict[str, int] = {}
    plan = []
    for spec in specs:
        if taken.get(spec.env.name, 0) < runs_per_env:
            taken[spec.env.name] = taken.get(spec.env.name, 0) + 1
            plan.append(spec)
    return plan


def warmup_jobs(args: argparse.Namespace, envs: tuple[str, ...], tag: str) -> list[JobSpec]:
    """One one-step job per environment, not evaluated."""
    warm = argparse.Namespace(**vars(args) | {"jobs": len(envs), "steps": 1, "eval_tasks": 0})
    return agentic_jobs(warm, envs, tag)


@contextmanager
def lookup_service(latency_s: float) -> Iterator[str]:
    """The inventory service of `http_lookup` in a process of its own; its URL, set for the
    services the stack starts (they read it from their environment)."""
    from http_lookup import HEALTH_PATH, URL_VAR  # examples/envs/, on the path: main()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    script = EXAMPLE_ENVS / "http_lookup.py"
    argv = [sys.executable, str(script), "--port", str(port), "--latency-s", str(latency_s)]
    server = subprocess.Popen(argv)
    try:
        _wait_until_up(url + HEALTH_PATH, server)
        os.environ[URL_VAR] = url
        yield url
    finally:
        server.terminate()
        server.wait(10)


def _wait_until_up(url: str, server: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + SERVICE_START_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the inventory service exited ({server.returncode})")
        try:
            if httpx.get(url, timeout=1.0, trust_env=False).status_code == httpx.codes.OK:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the inventory service did not answer at {url}")


def sandbox_problem() -> str:
    """Why `code_tasks` cannot run here ("" when it can): its sandbox's own check."""
    from env_svc.sandbox.runner import SandboxUnavailableError, shared_sandbox

    try:
        shared_sandbox().check()
    except SandboxUnavailableError as exc:
        return str(exc)
    return ""


async def run_phases(
    args: argparse.Namespace, settings: SharedSettings, envs: tuple[str, ...]
) -> dict[str, Any]:
    """Warm-up, every alone run, then the concurrent phase, on one stack: each phase's JSON."""
    run_id = args.run_id
    concurrent = agentic_jobs(args, envs, f"conc-{run_id}")
    alone = alone_plan(agentic_jobs(args, envs, f"alone-{run_id}"), args.alone_runs)
    phases: dict[str, Any] = {"alone": {}}
    async with LocalStack(settings, services=SERVICES) as stack:
        phases["precision"] = stack.dtypes
        async with Client(stack.client_settings) as client:
            warm = warmup_jobs(args, envs, f"warm-{run_id}")
            await measure(client, stack, "warm-up", [warm], args.timeout_s)
            for spec in alone:
                name = f"alone {job_key(spec.job_id)}"
                measured = await measure(client, stack, name, [[spec]], args.timeout_s)
                phases["alone"][job_key(spec.job_id)] = measured.to_json()
            measured = await measure(client, stack, "concurrent", [concurrent], args.timeout_s)
            phases["concurrent"] = measured.to_json()
    phases["spec_of"] = {job_key(spec.job_id): spec.env.name for spec in concurrent}
    phases["specs"] = [msgspec.to_builtins(spec) for spec in concurrent]
    return phases


def summarise(args: argparse.Namespace, phases: dict[str, Any]) -> dict[str, Any]:
    """The figures of both phases, their ratios, the finish times and the accuracy checks."""
    spec_of: dict[str, str] = phases["spec_of"]
    alone_work = {job: Work.of(phase) for job, phase in phases["alone"].items()}
    sequential = sequential_work(spec_of, alone_work).figures()
    concurrent = Work.of(phases["concurrent"]).figures()
    shared_jobs = {job_key(job["job_id"]): job for job in phases["concurrent"]["jobs"]}
    alone_acc = {
        job: acc
        for job, phase in phases["alone"].items()
        if (acc := Accuracy.final(phase["jobs"][0])) is not None
    }
    shared_acc = {
        job: acc
        for job, summary in shared_jobs.items()
        if (acc := Accuracy.final(summary)) is not None
    }
    checks = accuracy_checks(spec_of, alone_acc, shared_acc)
    by_spec = spec_checks(spec_of, alone_acc, shared_acc)
    decided = [
        row["within_one_se_or_better"]
        for row in checks
        if row["within_one_se_or_better"] is not None
    ]
    if args.alone_runs == 0:
        sequential_from = "each job alone"
    else:
        sequential_from = f"alone runs of {len(set(spec_of.values()))} distinct specs x "
        sequential_from += str(args.alone_runs)
    return {
        "sequential_from": sequential_from,
        "sequential_measured_s": round(sum(w.wall_s for w in alone_work.values()), 1),
        "sequential": sequential,
        "concurrent": concurrent,
        **ratios(sequential, concurrent),
        "finish_s": spread([job["wall_s"] for job in shared_jobs.values()]),
        "idle": {
            "alone_runs": idle_profile(phases["alone"].values()),
            "concurrent": idle_profile([phases["concurrent"]]),
        },
        "within_one_se_or_better": f"{sum(decided)} of {len(decided)}",
        "accuracy": checks,
        "specs_within_one_se_or_better": f"{sum(r['within_one_se_or_better'] for r in by_spec)}"
        f" of {len(by_spec)}",
        "accuracy_by_spec": by_spec,
    }


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    settings = load(SharedSettings).model_copy(update={"state_dir": args.run_dir / "state"})
    args.base_model = settings.base_model
    problem = sandbox_problem() if "code_tasks" in args.envs else ""
    envs = tuple(env for env in args.envs if env != "code_tasks" or not problem)
    if not envs:
        raise SystemExit(f"no environment left to run: code_tasks {problem}")
    with lookup_service(args.latency_s):
        phases = await run_phases(args, settings, envs)
    return {
        "run_id": args.run_id,
        "machine": machine_fields(**phases.pop("precision")),
        "base_model": settings.base_model,
        "model": args.model,
        "engine": os.environ.get("ROLLOUT_ENGINE", "vllm"),
        "latency_s": args.latency_s,
        "jobs": args.jobs,
        "steps_per_job": args.steps,
        "eval_tasks": args.eval_tasks,
        "seed_base": args.seed_base,
        "settings_from_env": {
            name: value
            for name, value in sorted(os.environ.items())
            if name.startswith(("TRAINER_", "ROLLOUT_", "ENV_"))
        },
        "tenants": sorted({TENANTS[j % len(TENANTS)] for j in range(args.jobs)}),
        "envs": list(envs),
        "code_tasks": f"left out: {problem}" if problem else str("code_tasks" in envs).lower(),
        **summarise(args, phases),
        "phases": {"alone": phases["alone"], "concurrent": phases["concurrent"]},
        "specs": phases["specs"],
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=8, help="N jobs (1, 8, 32)")
    parser.add_argument("--steps", type=int, default=4, help="training steps per job")
    parser.add_argument("--latency-s", type=float, default=1.0, help="the HTTP tool's latency")
    parser.add_argument("--eval-tasks", type=int, default=32, help="held-out tasks per eval")
    parser.add_argument("--envs", default=",".join(ENVS), help="of http_lookup,code_tasks")
    parser.add_argument(
        "--alone-runs",
        type=int,
        default=None,
        help=f"jobs of each environment run alone (0: every job; default 0 up to 8 jobs, "
        f"{ALONE_RUNS_PAST_8} past)",
    )
    parser.add_argument("--seed-base", type=int, default=100, help="job j's seeds: this + j")
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--engine", choices=("vllm", "scripted"), default="vllm")
    parser.add_argument("--timeout-s", type=float, default=3600, help="per phase")
    parser.add_argument("--out", type=Path, default=None, help="default: bench/results/...")
    args = parser.parse_args()
    args.envs = tuple(env for env in args.envs.split(",") if env)
    if unknown := set(args.envs) - set(ENVS):
        parser.error(f"--envs: unknown {sorted(unknown)}")
    if args.alone_runs is None:
        args.alone_runs = 0 if args.jobs <= 8 else ALONE_RUNS_PAST_8
    return args


def resummarise(path: Path) -> None:
    """The figures of a saved result computed again from its raw phases (after the figures'
    arithmetic changed); the phases themselves are kept as measured."""
    result = msgspec.json.decode(path.read_bytes())
    phases = result["phases"] | {
        "spec_of": {job_key(spec["job_id"]): spec["env"]["name"] for spec in result["specs"]}
    }
    kept = result["sequential_from"]
    alone_runs = 0 if kept == "each job alone" else ALONE_RUNS_PAST_8
    result |= summarise(argparse.Namespace(alone_runs=alone_runs), phases)
    result["sequential_from"] = kept
    result.pop("within_one_se", None)  # the old name of within_one_se_or_better
    path.write_text(msgspec.json.format(msgspec.json.encode(result), indent=2).decode() + "\n")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--resummarise":
        resummarise(Path(sys.argv[2]))
        return
    args = parse_args()
    tag = "" if args.model == "smollm2" else f"-{args.model}"
    if args.model == "tiny":
        from common.files.models import tiny_model

        os.environ["MARLAAS_BASE_MODEL"] = str(tiny_model())  # read by the stack and services
    if args.engine == "scripted":  # read by rollout_svc; bench/ and the repository on its path
        os.environ["ROLLOUT_ENGINE"] = "tool_engine:ToolCallingEngine"
        tag += "-scripted"
    use_example_env("http_lookup=http_lookup:HttpLookupEnv", BENCH, BENCH.parent)
    args.run_id = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    args.run_dir = Path("runs").resolve() / f"agentic-{args.run_id}"
    result = asyncio.run(bench(args))
    what = f"agentic-{args.jobs}x{args.steps}-lat{args.latency_s:g}{tag}"
    out = args.out or result_path(what, date=args.run_id[:8])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(msgspec.json.format(msgspec.json.encode(result), indent=2).decode() + "\n")
    shutil.rmtree(args.run_dir / "state" / "artifacts", ignore_errors=True)
    summary = (
        "sequential_from",
        "time_ratio",
        "util_ratio",
        "finish_s",
        "within_one_se_or_better",
        "specs_within_one_se_or_better",
    )
    phase_walls = {name: result[name]["wall_s"] for name in ("sequential", "concurrent")}
    console.print_json(data={k: result[k] for k in summary} | phase_walls | {"out": str(out)})


if __name__ == "__main__":
    main()
