"""Learning you can trust: the same jobs alone and sharing the stack, on several seeds; and one
job against TRL's GRPOTrainer for the same minutes.

    .venv/bin/python bench/learning.py                      # both parts, seeds 0 1 2
    .venv/bin/python bench/learning.py --parts jobs --seeds 0 1 2
    .venv/bin/python bench/learning.py --parts peer --out <the jobs part's file>   # adds to it
    .venv/bin/python bench/learning.py --parts jobs --jobs acme-words,globex-words \
        --modes alone --resample-uniform 6       # some jobs, one mode, dynamic sampling on
    .venv/bin/python bench/learning.py --parts jobs --modes shared --eval-tasks 32 \
        --jobs acme-arith,acme-calc,globex-arith,globex-calc --rl lr_schedule=linear
                                                 # the demo's four jobs, another RLSettings field

**jobs**: eight jobs of three tenants (arithmetic, tool-use calculator and a dataset job of
word problems, `examples/data/acme/word_problems.jsonl`, each in the demo's budgets, 12 steps)
run on one embedded stack per seed, (a) alone, one after another, then (b) all eight at once.
A seed picks each job's training stream and the evaluation tasks; alone and shared run the
same specs (only the job ids differ), so each seed is a paired comparison. Each job is
evaluated greedily on `--eval-tasks` held-out tasks before training (the base model) and after
its last step. Reported per job and seed: base and final held-out accuracy with their standard
errors, the best evaluated version, steps, reward first/last steps and the job's wall time;
per seed the shared phase's wall time and the sum of the alone runs'. Then, per job and mode,
the mean over seeds and its spread, and the checks of issue 26:
- `beats_base`: mean final - mean base > 2 x the standard error of that difference, taken as
  the larger of the binomial one (from each evaluation's own standard error) and the one the
  seeds' spread of the per-seed differences gives;
- `sharing_costs_nothing`: mean shared final >= mean alone final - 1 standard error of their
  difference (both binomial and seed spread, the larger);
- `shared_faster`: each seed's shared wall time < the sum of its alone runs.

**peer**: bench/peer.py's task (one-digit sums) trained by TRL's GRPOTrainer for `--peer-steps`
steps (its own venv, `bench/peer_trl.py`), then by one MARLaaS job on a fresh stack, stopped
once it has run as long as TRL's training did. The MARLaaS adapter taken is the last version
published within TRL's wall time (from submission; TRL's from `train()`, both after start-up).
The base model, TRL's adapter and MARLaaS's are then evaluated by one evaluator, in TRL's venv
(transformers, greedy, float32, the environment's own scoring) on the same held-out tasks.

Writes `bench/results/learning-<date>-<machine>.json` after every phase (a run cut short keeps
what it measured).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import statistics
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
from machine import machine_fields, result_path  # bench/machine.py
from multitask import run_jobs  # bench/multitask.py
from rich.console import Console

from common.runtime.config import SharedSettings, load
from common.wire.lifecycle import SERVICES
from common.wire.messages import (
    EnvSettings,
    EvalSettings,
    Event,
    JobSpec,
    RLSettings,
    SamplingSettings,
)
from console.demo import REWARD_WINDOW, demo_jobs
from console.stack.local import LocalStack
from marlaas import Client
from marlaas.export import best_of
from marlaas.jobwatch import JobProgress

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORD_PROBLEMS = REPO / "examples" / "data" / "acme" / "word_problems.jsonl"
TENANTS = ("acme", "globex", "initech")
KINDS = ("arith", "calc", "words")
EXTRA_KINDS = ("-code", "-math")
"""Jobs run only when `--jobs` names them (e.g. acme-code): the sandboxed `code_tasks`, and the
word problems as a Hugging Face parquet file with a chat `messages` column, checked by
`math-verify` (`<tenant>-math`)."""
WORD_PROBLEMS_PARQUET = "word_problems.parquet"
MODES = ("alone", "shared")

console = Console()


# --- the jobs -------------------------------------------------------------------------------


def job_specs(
    base_model: str,
    seed: int,
    *,
    steps: int,
    eval_tasks: int,
    resample_uniform: int = 0,
    rl: dict[str, Any] | None = None,
) -> dict[str, JobSpec]:
    """The eight jobs of one seed, by name (`<tenant>-<kind>`): the demo's arithmetic and
    calculator jobs and a word-problem dataset job, three to a tenant (two for the third);
    `resample_uniform`: each job's `rl.resample_uniform_groups` (dynamic sampling); `rl`:
    other `RLSettings` fields set on every job (e.g. `lr_schedule`)."""
    demo = {spec.job_id.split("-")[1]: spec for spec in demo_jobs(base_model, "x", seed)}
    arith, calc = demo["arith"], demo["calc"]
    words = msgspec.structs.replace(
        arith,
        env=EnvSettings(
            name="dataset",
            params={
                "path": WORD_PROBLEMS.name,
                "eval_fraction": 0.25,
                "prompt_suffix": " Answer with just the number.",
            },
        ),
        rl=msgspec.structs.replace(arith.rl, sampling=SamplingSettings(max_new_tokens=32)),
    )
    # A call with a line of code is ~60 tokens: room for it and a short answer.
    code = msgspec.structs.replace(
        calc,
        env=EnvSettings(name="code_tasks"),
        rl=msgspec.structs.replace(
            calc.rl, max_context_tokens=768, sampling=SamplingSettings(max_new_tokens=96)
        ),
    )
    math = msgspec.structs.replace(
        words,
        env=EnvSettings(
            name="dataset",
            params={
                "path": WORD_PROBLEMS_PARQUET,
                "messages_field": "messages",
                "match": "math",
                "eval_fraction": 0.25,
                "prompt_suffix": " Answer with just the number.",
            },
        ),
    )
    templates = {"arith": arith, "calc": calc, "words": words, "code": code, "math": math}
    every = [(TENANTS[i // 3], KINDS[i % 3]) for i in range(8)]
    every += [(t, "code") for t in TENANTS] + [(t, "math") for t in TENANTS]
    specs = {}
    for index, (tenant, kind) in enumerate(every):
        template = templates[kind]
        specs[f"{tenant}-{kind}"] = msgspec.structs.replace(
            template,
            job_id=f"{tenant}-{kind}",
            tenant=tenant,
            env=msgspec.structs.replace(template.env, seed=1000 * seed + index),
            rl=msgspec.convert(
                msgspec.to_builtins(template.rl)
                | {"max_steps": steps, "resample_uniform_groups": resample_uniform}
                | (rl or {}),
                RLSettings,
            ),
            eval=EvalSettings(tasks=eval_tasks, seed=seed),
        )
    return specs


def with_ids(specs: dict[str, JobSpec], tag: str) -> dict[str, JobSpec]:
    return {
        name: msgspec.structs.replace(spec, job_id=f"{name}-{tag}") for name, spec in specs.items()
    }


STEP_SIGNALS = ("mean_reward", "entropy", "approx_kl", "fresh_kl", "zero_advantage_share")
"""Kept for every step of every job: a run that goes wrong can be read step by step."""
STEP_COUNTS = ("resampled_groups",)


def step_series(steps: Sequence[Event], job_id: str) -> list[dict[str, float]]:
    """The job's steps in order, each with its `STEP_SIGNALS` (redelivered events once)."""
    own = {e.step: e.metrics for e in steps if e.job_id == job_id and e.event == "step"}
    return [
        {"step": step}
        | {k: round(own[step][k], 5) for k in STEP_SIGNALS if k in own[step]}
        | {k: int(own[step][k]) for k in STEP_COUNTS if k in own[step]}
        for step in sorted(own)
    ]


def job_numbers(progress: JobProgress, steps: Sequence[Event] = ()) -> dict[str, Any]:
    """What a job's run is reported as: held-out accuracy of the base and the final version
    with each one's standard error, the best version, steps, rewards, wall time, and each
    step's learning signals (`step_series`, from the job's `steps` events)."""
    summary = progress.summary(REWARD_WINDOW)
    evals = summary["evals"]
    assert isinstance(evals, dict)
    versions = sorted(int(v) for v in evals)
    final = versions[-1] if versions and versions[-1] > 0 else None
    best = best_of({v: evals[str(v)]["eval_accuracy"] for v in versions})
    return {
        "job_id": progress.job_id,
        "status": progress.status,
        "steps": progress.steps,
        "wall_s": round(progress.wall_s, 1),
        "base": evals.get("0", {}).get("eval_accuracy"),
        "base_se": evals.get("0", {}).get("eval_accuracy_stderr"),
        "final": None if final is None else evals[str(final)]["eval_accuracy"],
        "final_se": None if final is None else evals[str(final)]["eval_accuracy_stderr"],
        "final_version": final,
        "best_version": None if best is None else best[0],
        "best": None if best is None else best[1],
        "below_base": summary["below_base"],
        "reward_start": summary["reward_start"],
        "reward_end": summary["reward_end"],
        "rewards": summary["rewards"],
        "learning": summary["learning"],
        "step_signals": step_series(steps, progress.job_id),
    }


async def run_seed(
    stack: LocalStack,
    specs: dict[str, JobSpec],
    seed: int,
    timeout_s: float,
    modes: Sequence[str] = MODES,
) -> list[dict[str, Any]]:
    """Alone (one job at a time), then shared (all at once): one record per mode."""
    records: list[dict[str, Any]] = []
    async with Client(stack.client_settings) as client:
        if "alone" in modes:
            alone: dict[str, dict[str, Any]] = {}
            started = time.time()
            for name, spec in with_ids(specs, f"s{seed}-alone").items():
                console.print(f"[bold]seed {seed} alone[/]: {spec.job_id}")
                jobs, steps = await run_jobs(client, stack.kafka_bootstrap, [spec], timeout_s)
                alone[name] = job_numbers(jobs[spec.job_id], steps)
                _say(name, alone[name])
            records.append(
                {
                    "seed": seed,
                    "mode": "alone",
                    "wall_s": round(time.time() - started, 1),
                    "sum_of_jobs_wall_s": round(sum(j["wall_s"] for j in alone.values()), 1),
                    "jobs": alone,
                }
            )
        if "shared" in modes:
            shared_specs = with_ids(specs, f"s{seed}-shared")
            console.print(f"[bold]seed {seed} shared[/]: {len(shared_specs)} jobs at once")
            started = time.time()
            jobs, steps = await run_jobs(
                client, stack.kafka_bootstrap, list(shared_specs.values()), timeout_s
            )
            shared_wall = time.time() - started
            shared = {
                name: job_numbers(jobs[spec.job_id], steps) for name, spec in shared_specs.items()
            }
            for name, numbers in shared.items():
                _say(name, numbers)
            records.append(
                {"seed": seed, "mode": "shared", "wall_s": round(shared_wall, 1), "jobs": shared}
            )
    return records


def _say(name: str, numbers: dict[str, Any]) -> None:
    console.print(
        f"  {name}: base {numbers['base']} -> final {numbers['final']} "
        f"(best {numbers['best']} at v{numbers['best_version']}), "
        f"reward {numbers['reward_start']} -> {numbers['reward_end']}, {numbers['wall_s']} s"
    )


# --- statistics -----------------------------------------------------------------------------


def difference(
    a: list[float], a_se: list[float], b: list[float], b_se: list[float]
) -> dict[str, float]:
    """Mean of the paired differences a - b over seeds, and its standard error: the larger of
    the binomial one and the seeds' spread of the differences over sqrt(n)."""
    n = len(a)
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    binomial = math.sqrt(sum(x * x + y * y for x, y in zip(a_se, b_se, strict=True))) / n
    spread = statistics.stdev(diffs) / math.sqrt(n) if n > 1 else 0.0
    return {
        "mean": round(statistics.fmean(diffs), 4),
        "se": round(max(binomial, spread), 4),
        "se_binomial": round(binomial, 4),
        "se_seeds": round(spread, 4),
    }


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per job and mode: the means over seeds and issue 26's checks; per seed: the walls."""
    by_mode: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for run in runs:
        for name, numbers in run["jobs"].items():
            by_mode.setdefault(name, {}).setdefault(run["mode"], []).append(numbers)
    jobs: dict[str, Any] = {}
    for name, modes in by_mode.items():
        entry: dict[str, Any] = {}
        for mode, seeds in modes.items():
            done = [s for s in seeds if s["final"] is not None]
            if not done:
                continue
            base, base_se = [s["base"] for s in done], [s["base_se"] for s in done]
            final, final_se = [s["final"] for s in done], [s["final_se"] for s in done]
            gain = difference(final, final_se, base, base_se)
            entry[mode] = {
                "seeds": len(done),
                "base_mean": round(statistics.fmean(base), 4),
                "final_mean": round(statistics.fmean(final), 4),
                "final_sd_over_seeds": round(statistics.stdev(final), 4) if len(final) > 1 else 0.0,
                "best_mean": round(statistics.fmean(s["best"] for s in done), 4),
                "steps": [s["steps"] for s in done],
                "wall_s_mean": round(statistics.fmean(s["wall_s"] for s in done), 1),
                "gain": gain,
                "beats_base": gain["mean"] > 2 * gain["se"],
            }
        if "alone" in entry and "shared" in entry:
            pairs = [
                (a, s)
                for a, s in zip(modes["alone"], modes["shared"], strict=False)
                if a["final"] is not None and s["final"] is not None
            ]
            cost = difference(
                [s["final"] for _, s in pairs],
                [s["final_se"] for _, s in pairs],
                [a["final"] for a, _ in pairs],
                [a["final_se"] for a, _ in pairs],
            )
            entry["shared_minus_alone"] = cost
            entry["sharing_costs_nothing"] = cost["mean"] >= -cost["se"]
        jobs[name] = entry
    walls: dict[str, dict[str, float]] = {}
    for run in runs:
        walls.setdefault(str(run["seed"]), {})[run["mode"]] = run.get(
            "sum_of_jobs_wall_s", run["wall_s"]
        )
    shared_faster = {
        seed: w["shared"] < w["alone"] for seed, w in walls.items() if {"alone", "shared"} <= set(w)
    }
    return {
        "jobs": jobs,
        "walls_s": walls,
        "checks": {
            "beats_base": {
                f"{name}/{mode}": e[mode]["beats_base"]
                for name, e in jobs.items()
                for mode in ("alone", "shared")
                if mode in e
            },
            "sharing_costs_nothing": {
                name: e["sharing_costs_nothing"]
                for name, e in jobs.items()
                if "sharing_costs_nothing" in e
            },
            "shared_faster": shared_faster,
        },
    }


# --- the peer at equal time -----------------------------------------------------------------


def peer_seed(seed: int, args: argparse.Namespace) -> dict[str, Any]:
    from peer import run_marlaas, settings_of, trl_script  # bench/peer.py

    from common.files.models import resolve_base_model

    settings = load(SharedSettings)
    model_dir = resolve_base_model(settings.base_model, settings.cache_dir)
    config = settings_of(argparse.Namespace(steps=args.peer_steps, learning_rate=1e-3), model_dir)
    config["seed"] = seed
    work = args.run_dir / f"peer-s{seed}"
    work.mkdir(parents=True, exist_ok=True)
    trl_dir, ours_dir = work / "trl-adapter", work / "marlaas-adapter"
    console.print(f"[bold]peer seed {seed}[/]: TRL, {args.peer_steps} steps")
    trl = trl_script(json.dumps({**config, "out_dir": str(trl_dir), "save": True}))
    trl_wall = sum(trl["step_s"])
    console.print(f"  TRL trained {trl_wall:.0f} s; MARLaaS for as long")
    # As many steps as it can make in TRL's time (it is cancelled there).
    ours = asyncio.run(
        run_marlaas(
            {**config, "steps": 10 * config["steps"]},
            work,
            f"{args.run_id}-s{seed}",
            wall_s=trl_wall,
            export_to=ours_dir / "adapter",
        )
    )
    evaluated = trl_script(
        "--eval",
        json.dumps(
            {
                **config,
                "eval_seed": seed,
                "eval_tasks": args.eval_tasks,
                "adapters": {
                    "base": None,
                    "trl": str(trl_dir),
                    "marlaas": str(ours_dir / "adapter"),
                },
            }
        ),
    )
    console.print(f"  held-out accuracy: {evaluated['accuracy']}")
    return {
        "seed": seed,
        "trl_wall_s": round(trl_wall, 1),
        "trl_steps": len(trl["step_s"]),
        "trl_rewards": trl["rewards"],
        "trl_dtype": trl["dtype"],
        "trl_version": trl["trl"],
        "marlaas_version": ours["version"],
        "marlaas_steps_within": ours["steps_within"],
        "marlaas_step_at_s": {str(s): round(at, 2) for s, at in ours["step_at_s"].items()},
        "marlaas_rewards": ours["rewards"],
        "marlaas_precision": ours["precision"],
        "accuracy": evaluated["accuracy"],
        "accuracy_se": evaluated["accuracy_se"],
        "eval_tasks": evaluated["tasks"],
    }


def summarise_peer(seeds: list[dict[str, Any]]) -> dict[str, Any]:
    acc = {who: [s["accuracy"][who] for s in seeds] for who in ("base", "trl", "marlaas")}
    se = {who: [s["accuracy_se"][who] for s in seeds] for who in ("base", "trl", "marlaas")}
    lead = difference(acc["marlaas"], se["marlaas"], acc["trl"], se["trl"])
    return {
        "mean": {who: round(statistics.fmean(values), 4) for who, values in acc.items()},
        "marlaas_minus_trl": lead,
        "marlaas_at_least_trl": lead["mean"] >= 0,
    }


# --- the run --------------------------------------------------------------------------------


def data_dir(run_dir: Path) -> Path:
    """A data directory with the word problems in every tenant's folder: the JSONL file, and
    the same rows as a Hugging Face parquet file in chat format (a `messages` list, the answer
    apart), as a practitioner's dataset is. (A system prompt asking for a number at the end cut
    SmolLM2's base accuracy to 0.02 and left 12 steps nothing to learn from: seed 0, 0.02 ->
    0.08; the words job's suffix keeps it near the JSONL job's.)"""
    import datasets

    rows = [json.loads(line) for line in WORD_PROBLEMS.read_text().splitlines() if line]
    chat = datasets.Dataset.from_list(
        [
            {
                "messages": [{"role": "user", "content": row["question"]}],
                "answer": row["answer"],
            }
            for row in rows
        ]
    )
    root = run_dir / "data"
    for tenant in TENANTS:
        (root / tenant).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(WORD_PROBLEMS, root / tenant / WORD_PROBLEMS.name)
        chat.to_parquet(str(root / tenant / WORD_PROBLEMS_PARQUET))
    return root


async def jobs_part(args: argparse.Namespace, result: dict[str, Any], out: Path) -> None:
    os.environ["MARLAAS_DATA_DIR"] = str(data_dir(args.run_dir))
    settings = load(SharedSettings).model_copy(update={"state_dir": args.run_dir / "state"})
    # One stack for every seed (job ids name the seed and the mode).
    async with LocalStack(settings, services=SERVICES) as stack:
        result["machine"]["precision"] = stack.dtypes
        for seed in args.seeds:
            specs = job_specs(
                settings.base_model,
                seed,
                steps=args.steps,
                eval_tasks=args.eval_tasks,
                resample_uniform=args.resample_uniform,
                rl=args.rl,
            )
            chosen = args.jobs or [name for name in specs if not name.endswith(EXTRA_KINDS)]
            specs = {name: spec for name, spec in specs.items() if name in chosen}
            result["specs"][str(seed)] = {n: msgspec.to_builtins(s) for n, s in specs.items()}
            result["runs"] += await run_seed(stack, specs, seed, args.timeout_s, args.modes)
            result["summary"] = summarise(result["runs"])
            write(out, result)


def table(result: dict[str, Any]) -> str:
    """The summary as a Markdown table: per job and mode, mean base -> mean final held-out
    accuracy, the gain and its standard error, and the checks."""
    summary = result.get("summary", {})
    lines = [
        "| job | mode | seeds | base | final | gain ± SE | beats base (> 2 SE) "
        "| shared - alone ± SE |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, entry in summary.get("jobs", {}).items():
        for mode in ("alone", "shared"):
            if mode not in entry:
                continue
            numbers, cost = entry[mode], entry.get("shared_minus_alone")
            gain = numbers["gain"]
            lines.append(
                f"| {name} | {mode} | {numbers['seeds']} | {numbers['base_mean']:.3f} | "
                f"{numbers['final_mean']:.3f} | {gain['mean']:+.3f} ± {gain['se']:.3f} | "
                f"{'yes' if numbers['beats_base'] else 'no'} | "
                + (f"{cost['mean']:+.3f} ± {cost['se']:.3f}" if mode == "shared" and cost else "")
                + " |"
            )
    walls = summary.get("walls_s", {})
    lines += ["", "| seed | sum of alone runs (s) | shared (s) |", "|---|---|---|"]
    lines += [f"| {seed} | {w.get('alone')} | {w.get('shared')} |" for seed, w in walls.items()]
    if peer := result.get("peer", {}).get("summary"):
        lead = peer["marlaas_minus_trl"]
        lines += [
            "",
            f"Equal time, held-out accuracy (mean over {len(result['peer']['seeds'])} seeds): "
            f"base {peer['mean']['base']:.3f}, TRL {peer['mean']['trl']:.3f}, "
            f"MARLaaS {peer['mean']['marlaas']:.3f} (MARLaaS - TRL {lead['mean']:+.3f} ± "
            f"{lead['se']:.3f})",
        ]
    return "\n".join(lines)


def write(out: Path, result: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"written to {out}")


def _setting(text: str) -> tuple[str, Any]:
    """`--rl NAME=VALUE`: VALUE read as JSON (numbers, true), else as text (`linear`)."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="jobs,peer", help="jobs, peer or both")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=12, help="training steps per job")
    parser.add_argument("--eval-tasks", type=int, default=64, help="held-out tasks per eval")
    parser.add_argument("--peer-steps", type=int, default=20, help="TRL's steps")
    parser.add_argument("--timeout-s", type=float, default=3600, help="per batch of jobs")
    parser.add_argument("--out", type=Path, default=None, help="default results/learning-...")
    parser.add_argument(
        "--jobs", type=lambda v: v.split(","), default=None, help="only these, e.g. acme-words"
    )
    parser.add_argument(
        "--modes", type=lambda v: v.split(","), default=list(MODES), help="alone, shared or both"
    )
    parser.add_argument(
        "--resample-uniform", type=int, default=0, help="each job's rl.resample_uniform_groups"
    )
    parser.add_argument(
        "--rl",
        type=_setting,
        action="append",
        default=[],
        help="NAME=VALUE: an RLSettings field on every job (VALUE as JSON, else text), repeatable",
    )
    parser.add_argument("--table", type=Path, default=None, help="print a result's summary")
    args = parser.parse_args()
    args.rl = dict(args.rl)
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return
    args.run_id = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    args.run_dir = Path("runs").resolve() / f"learning-{args.run_id}"
    out = args.out or result_path("learning", date=args.run_id.split("-")[0])
    result: dict[str, Any] = (
        json.loads(out.read_text())
        if out.exists()
        else {"bench": "learning", "machine": machine_fields(), "runs": [], "specs": {}}
    )
    result.setdefault("settings", {}).update(
        {
            "steps": args.steps,
            "eval_tasks": args.eval_tasks,
            "peer_steps": args.peer_steps,
            "resample_uniform_groups": args.resample_uniform,
            "rl": args.rl,
        }
    )
    parts = set(args.parts.split(","))
    if "jobs" in parts:
        asyncio.run(jobs_part(args, result, out))
    if "peer" in parts:
        result.setdefault("peer", {"seeds": []})
        for seed in args.seeds:
            result["peer"]["seeds"].append(peer_seed(seed, args))
            result["peer"]["summary"] = summarise_peer(result["peer"]["seeds"])
            write(out, result)
    console.print_json(
        json.dumps(
            {
                "checks": result.get("summary", {}).get("checks"),
                "peer": result.get("peer", {}).get("summary"),
            }
        )
    )


if __name__ == "__main__":
    main()
