"""Where a batched multi-job trainer step spends its time, beside the same jobs in turn.

    .venv/bin/python bench/trainer_profile.py [--jobs 8]

torch.profiler over one step of `--jobs` jobs run one after another and over one
`train_steps` of the same jobs in shared passes (bf16, shared prompts, the trainer bench's
batch), after a warm-up of each. Writes both operator tables, sorted by self CPU time, to
`bench/results/trainer-batched-profile-<date>-<machine>.txt`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
from machine import machine_fields, result_path, trainer_dtype  # bench/machine.py
from torch.profiler import ProfilerActivity, profile
from trainer import LORA, RL, batch  # bench/trainer.py

from common.models import resolve_base_model
from trainer_svc.policy import MultiAdapterPolicy


def table(step: Callable[[], object], rows: int) -> tuple[float, str]:
    step()  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    averages = prof.key_averages()
    total_us = sum(event.self_cpu_time_total for event in averages)
    return total_us / 1e6, averages.table(sort_by="self_cpu_time_total", row_limit=rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--rows", type=int, default=25)
    args = parser.parse_args()
    dtype = trainer_dtype()
    policy = MultiAdapterPolicy(resolve_base_model(args.model), compute_dtype=dtype)
    job_ids = [f"job{i}" for i in range(args.jobs)]
    for index, job_id in enumerate(job_ids):
        policy.add_job(job_id, LORA, RL, seed=index)
    trajectories = batch(policy._base.config.vocab_size, seed=0)
    advantages = [t.reward - 0.5 for t in trajectories]
    in_turn_s, in_turn = table(
        lambda: [policy.train_step(j, trajectories, advantages) for j in job_ids], args.rows
    )
    batches = {j: (trajectories, advantages) for j in job_ids}
    batched_s, batched = table(lambda: policy.train_steps(batches), args.rows)
    out = result_path("trainer-batched-profile", ".txt")
    out.write_text(
        f"{args.jobs} jobs, {dtype}, shared prompts, {torch.get_num_threads()} threads\n"
        f"machine: {json.dumps(machine_fields(trainer=dtype))}\n"
        f"self CPU time summed over operators: in turn {in_turn_s:.1f} s, "
        f"batched {batched_s:.1f} s\n\n"
        f"=== {args.jobs} jobs one after another ===\n{in_turn}\n\n"
        f"=== {args.jobs} jobs in one train_steps ===\n{batched}\n"
    )
    print(
        f"in turn {in_turn_s:.1f} s, batched {batched_s:.1f} s of operator time; written to {out}"
    )


if __name__ == "__main__":
    main()
