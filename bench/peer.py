"""One MARLaaS job beside TRL's GRPOTrainer on the same settings, one after the other.

    make bench-peer            # creates bench/.venv-trl (TRL in its own venv), then runs this
    .venv/bin/python bench/peer.py [--steps 20]

Same model (SmolLM2-135M-Instruct), task (the `arithmetic` environment: 1-digit addition,
its own reward functions and seeded tasks, in the same order), G = 8, 16 completions per
step, at most 16 new tokens at temperature 1, LoRA r = 8 / alpha 16 on q/k/v/o, the same
learning rate, no KL term. TRL runs first in its own venv (`bench/peer_trl.py`, its
defaults otherwise: generation with transformers, gradient checkpointing; weights in float32
and bf16 autocast only where the CPU runs bf16 natively, as for MARLaaS); then the MARLaaS job
runs on a fresh embedded stack (rollout engine, env_svc, trainer), timed from its step
events. Each side's s/step is the whole pipeline's pace from its first step's end to its
last's, over the steps in between (generation, rewards and training all counted, start-up
not); `step_ratio` is MARLaaS's over TRL's. Also reported: the medians after `--warm-up`
steps, each one's reward per step, and the machine with each side's precision.

Writes `bench/results/peer-<date>-<machine>.json`:
`{"machine", "runs": [{"peer", "model", "peer_step_s", "marlaas_step_s", "step_ratio",
"peer_rewards", "marlaas_rewards", ...}]}`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import subprocess
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
from machine import machine_fields, result_path, trainer_dtype  # bench/machine.py

from common.files.models import resolve_base_model
from common.runtime.config import SharedSettings, load
from common.wire.lifecycle import SERVICES
from common.wire.messages import (
    EnvSettings,
    EvalSettings,
    Event,
    JobSpec,
    LoraSettings,
    RLSettings,
    SamplingSettings,
)
from console.stack.local import LocalStack
from marlaas import Client

HERE = Path(__file__).resolve().parent
TRL_PYTHON = HERE / ".venv-trl" / "bin" / "python"
ENV_PARAMS = {"operations": ["+"], "min_operand": 1, "max_operand": 9}


def settings_of(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    return {
        "model_dir": str(model_dir),
        "env": "arithmetic",
        "env_params": ENV_PARAMS,
        "seed": 1,
        "steps": args.steps,
        "group_size": 8,
        "completions_per_step": 16,
        "max_new_tokens": 16,
        "temperature": 1.0,
        # Each side computes in the precision that is fast on this CPU (common/runtime/hardware.py).
        "bf16": trainer_dtype() == "bfloat16",
        "learning_rate": args.learning_rate,
        "lora_rank": 8,
        "lora_alpha": 16,
        "lora_targets": ["q_proj", "k_proj", "v_proj", "o_proj"],
    }


def run_trl(config: dict[str, Any]) -> dict[str, Any]:
    """TRL's run of `config`, its output directory a temporary one."""
    with tempfile.TemporaryDirectory(prefix="marlaas-peer-trl-") as out_dir:
        return trl_script(json.dumps({**config, "out_dir": out_dir}))


def trl_script(*args: str) -> dict[str, Any]:
    """`bench/peer_trl.py ARGS` in TRL's venv: the JSON object it prints last."""
    if not TRL_PYTHON.exists():
        raise SystemExit(f"{TRL_PYTHON} is missing: run `make bench-peer` (it creates the venv)")
    completed = subprocess.run(
        [str(TRL_PYTHON), str(HERE / "peer_trl.py"), *args],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    result: dict[str, Any] = json.loads(completed.stdout.strip().splitlines()[-1])
    return result


def marlaas_job(config: dict[str, Any], base_model: str, run_id: str) -> JobSpec:
    return JobSpec(
        job_id=f"peer-{run_id}",
        tenant="bench",
        base_model=base_model,
        env=EnvSettings(name=config["env"], params=config["env_params"], seed=config["seed"]),
        lora=LoraSettings(
            rank=config["lora_rank"],
            alpha=config["lora_alpha"],
            target_modules=config["lora_targets"],
        ),
        rl=RLSettings(
            group_size=config["group_size"],
            groups_per_step=config["completions_per_step"] // config["group_size"],
            max_steps=config["steps"],
            max_staleness=1,
            learning_rate=config["learning_rate"],
            std_normalize=True,  # TRL's default scale_rewards="group"
            max_context_tokens=256,
            sampling=SamplingSettings(
                temperature=config["temperature"], max_new_tokens=config["max_new_tokens"]
            ),
        ),
        eval=EvalSettings(tasks=0),  # TRL's run evaluates nothing either
        submitted_at=time.time(),
    )


async def run_marlaas(
    config: dict[str, Any],
    run_dir: Path,
    run_id: str,
    *,
    wall_s: float | None = None,
    export_to: Path | None = None,
) -> dict[str, Any]:
    """One MARLaaS job on the peer task on a fresh embedded stack: when each step ended (when
    the trainer sent its event, in seconds since submission) and its mean reward. With
    `wall_s` the job is cancelled once it has run that long, and the last version published
    within it is exported to `export_to` (bench/learning.py's equal-time part); without, it
    must complete its steps."""
    from marlaas.jobwatch import JobProgress, watch_jobs

    settings = load(SharedSettings).model_copy(update={"state_dir": run_dir / "state"})
    spec = marlaas_job(config, settings.base_model, run_id)
    step_at: dict[int, float] = {}
    rewards: dict[int, float] = {}

    def keep(event: Event) -> None:  # watched only after `submitted` is set, below
        if event.event == "step":
            step_at.setdefault(event.step, event.at - submitted)
            rewards.setdefault(event.step, float(event.metrics.get("mean_reward", float("nan"))))

    result: dict[str, Any] = {}
    async with LocalStack(settings, services=SERVICES) as stack:
        async with Client(stack.client_settings) as client:
            jobs = {spec.job_id: JobProgress.of(spec)}
            submitted = time.time()
            await client.submit([msgspec.structs.replace(spec, submitted_at=submitted)])
            watching = asyncio.create_task(
                watch_jobs(stack.kafka_bootstrap, jobs, timeout_s=3600, on_event=keep)
            )
            if wall_s is not None:
                await asyncio.wait([watching], timeout=wall_s - (time.time() - submitted))
                if not watching.done():
                    await client.command(spec.job_id, "cancel")
            await watching
            if wall_s is not None:
                within = [step for step, at in step_at.items() if at <= wall_s]
                if not within:
                    raise RuntimeError(f"MARLaaS made no step within {wall_s:.0f} s")
                result = {"version": max(within), "steps_within": len(within)}
                if export_to is not None:
                    await client.export(spec.job_id, export_to, version=result["version"])
        precision = stack.dtypes
    if wall_s is None and jobs[spec.job_id].status != "completed":
        raise RuntimeError(f"MARLaaS job ended {jobs[spec.job_id].status}")
    steps = sorted(step_at)
    return {
        **result,
        "step_at_s": {step: step_at[step] for step in steps},
        "rewards": [rewards[step] for step in steps],
        "precision": precision,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warm-up", type=int, default=3, help="steps left out of the median")
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    settings = load(SharedSettings)
    config = settings_of(args, resolve_base_model(settings.base_model, settings.cache_dir))
    run_id = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")

    trl = run_trl(config)
    print(f"TRL: {statistics.median(trl['step_s'][args.warm_up :]):.2f} s/step", flush=True)
    marlaas = asyncio.run(run_marlaas(config, Path("runs").resolve() / f"peer-{run_id}", run_id))
    ends = [0.0, *marlaas["step_at_s"].values()]
    marlaas["step_s"] = [b - a for a, b in itertools.pairwise(ends)]
    peer_s, ours_s = first_to_last_step_s(trl["step_s"]), first_to_last_step_s(marlaas["step_s"])
    run = {
        "peer": f"trl {trl['trl']} GRPOTrainer",
        "model": settings.base_model,
        "peer_step_s": peer_s,
        "marlaas_step_s": ours_s,
        "step_ratio": ours_s / peer_s,
        "peer_median_step_s": statistics.median(trl["step_s"][args.warm_up :]),
        "marlaas_median_step_s": statistics.median(marlaas["step_s"][args.warm_up :]),
        "peer_rewards": trl["rewards"],
        "marlaas_rewards": marlaas["rewards"],
        "peer_all_step_s": trl["step_s"],
        "marlaas_all_step_s": marlaas["step_s"],
        "peer_transformers": trl["transformers"],
    }
    print(
        f"MARLaaS {ours_s:.2f} s/step vs TRL {peer_s:.2f}: ratio {run['step_ratio']:.2f}; "
        f"reward first/last 5: TRL {_ends(trl['rewards'])}, MARLaaS {_ends(marlaas['rewards'])}"
    )
    machine = machine_fields(
        marlaas_trainer=marlaas["precision"]["trainer_svc"],
        marlaas_engine=marlaas["precision"]["rollout_svc"],
        trl=trl["dtype"],
    )
    result = {"bench": "peer", "machine": machine, "settings": config, "runs": [run]}
    out = args.out or result_path("peer")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written to {out}")


def first_to_last_step_s(step_s: list[float]) -> float:
    """Seconds per step from the end of the first step to the end of the last (`step_s`: each
    step's duration, the first one counted from the start)."""
    if len(step_s) < 2:
        raise ValueError("needs at least 2 steps")
    return sum(step_s[1:]) / (len(step_s) - 1)


def _ends(rewards: list[float], window: int = 5) -> str:
    if len(rewards) < 2 * window:
        return "n/a"
    return f"{statistics.mean(rewards[:window]):.2f} -> {statistics.mean(rewards[-window:]):.2f}"


if __name__ == "__main__":
    main()
