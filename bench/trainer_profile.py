"""Where a batched multi-job trainer step spends its time, beside the same jobs in turn.

    .venv/bin/python bench/trainer_profile.py [--jobs 8]
    .venv/bin/python bench/trainer_profile.py --threads 1,2

torch.profiler over one step of `--jobs` jobs run one after another and over one
`train_steps` of the same jobs in shared passes (the trainer's precision on this machine,
shared prompts, the trainer bench's batch), after a warm-up of each. Writes both operator
tables, sorted by self CPU time, to `bench/results/trainer-batched-profile-<date>-<machine>.txt`.

`--threads`: one job's step at each of those thread counts instead (the median of 3 timed
steps, then one profiled), each operator's time at every count side by side: which part of a
step a borrowed core speeds up (docs/architecture.md, "the trainer's borrowed core"); and two
jobs' steps in turn and in one shared pass at each count, and (on 2 cores or more) in two
passes at once, one thread and core each: what a borrowed core would give as a second pass
instead of a second thread. Writes
`bench/results/trainer-threads-profile-<date>-<machine>.txt`.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
from collections.abc import Callable
from functools import partial

import torch
from machine import machine_fields, result_path, trainer_dtype  # bench/machine.py
from torch.profiler import ProfilerActivity, profile
from trainer import LORA, RL, batch, timed  # bench/trainer.py

from common.files.models import resolve_base_model
from common.wire.messages import Trajectory
from trainer_svc.policy import MultiAdapterPolicy


def table(step: Callable[[], object], rows: int) -> tuple[float, str]:
    step()  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    averages = prof.key_averages()
    total_us = sum(event.self_cpu_time_total for event in averages)
    return total_us / 1e6, averages.table(sort_by="self_cpu_time_total", row_limit=rows)


REPEATS = 3
"""Timed steps per figure of `--threads` (their median, after a warm-up)."""


def op_times(step: Callable[[], object]) -> dict[str, float]:
    """One profiled step's self CPU milliseconds by operator (on the calling thread: wall
    time of each operator); run after the step was warmed up."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return {event.key: event.self_cpu_time_total / 1e3 for event in prof.key_averages()}


def parallel_passes(
    policy: MultiAdapterPolicy, both: dict[str, tuple[list[Trajectory], list[float]]]
) -> str | None:
    """The two jobs' steps at once, each pass on its own thread and core with one OpenMP
    thread (None on fewer than 2 cores). The second job runs on a copy of the model: one
    model's adapter routing (peft's forward hooks) is not per thread."""
    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2:
        return None
    twin = MultiAdapterPolicy(policy.base_model_dir, compute_dtype=policy.compute_dtype)
    twin.add_job("other", LORA, RL, seed=1)

    def step(owner: MultiAdapterPolicy, job: str, core: int) -> None:
        os.sched_setaffinity(0, {core})  # this thread only
        torch.set_num_threads(1)
        owner.train_step(job, *both[job])

    def at_once() -> None:
        threads = [
            threading.Thread(target=step, args=(policy, "job", cores[0])),
            threading.Thread(target=step, args=(twin, "other", cores[1])),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    wall = timed(at_once, REPEATS, policy.device)
    return f"in parallel passes, 1 thread each on cores {cores[0]} and {cores[1]}: {wall:.3f}"


def thread_scaling(policy: MultiAdapterPolicy, threads: list[int], rows: int) -> str:
    """One job's step at each thread count: the step's wall and each operator's, side by side."""
    policy.add_job("job", LORA, RL, seed=0)
    trajectories = batch(policy.base_model.config.vocab_size, seed=0)
    advantages = [t.reward - 0.5 for t in trajectories]
    policy.add_job("other", LORA, RL, seed=1)
    both = {job: (trajectories, advantages) for job in ("job", "other")}
    walls, ops, pairs = [], [], []
    for count in threads:
        torch.set_num_threads(count)
        one = partial(policy.train_step, "job", trajectories, advantages)
        walls.append(timed(one, REPEATS, policy.device))
        ops.append(op_times(one))
        in_turn = timed(
            lambda: [policy.train_step(j, *both[j]) for j in both], REPEATS, policy.device
        )
        one_pass = timed(lambda: policy.train_steps(both), REPEATS, policy.device)
        pairs.append(f"{count} threads: in turn {in_turn:.3f}, in one pass {one_pass:.3f}")
    if parallel := parallel_passes(policy, both):
        pairs.append(parallel)
    first = ops[0]
    lines = [
        f"step wall s (median of {REPEATS}): "
        + ", ".join(f"{n} threads {w:.3f}" for n, w in zip(threads, walls, strict=True)),
        f"two jobs' steps, wall s (median of {REPEATS}): " + "; ".join(pairs),
        "operator self time, ms (" + " / ".join(f"{n} threads" for n in threads) + "), "
        f"and the speed-up at {threads[-1]} threads:",
    ]
    totals = [sum(by_op.values()) for by_op in ops]
    lines.append(f"{'all operators':60s}" + "".join(f"{t:10.1f}" for t in totals))
    for key in sorted(first, key=lambda k: -first[k])[:rows]:
        times = [by_op.get(key, 0.0) for by_op in ops]
        lines.append(
            f"{key[:60]:60s}" + "".join(f"{t:10.1f}" for t in times)
            + f"{times[0] / max(times[-1], 1e-9):8.2f}x"
        )  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--threads", default="", help="e.g. 1,2: one job's step per count")
    args = parser.parse_args()
    dtype = trainer_dtype()
    policy = MultiAdapterPolicy(resolve_base_model(args.model), compute_dtype=dtype)
    if args.threads:
        report = thread_scaling(policy, [int(n) for n in args.threads.split(",")], args.rows)
        out = result_path("trainer-threads-profile", ".txt")
        out.write_text(
            f"one job's step, {dtype}, shared prompts\n"
            f"machine: {json.dumps(machine_fields(trainer=dtype))}\n{report}\n"
        )
        print(f"{report}\nwritten to {out}")
        return
    job_ids = [f"job{i}" for i in range(args.jobs)]
    for index, job_id in enumerate(job_ids):
        policy.add_job(job_id, LORA, RL, seed=index)
    trajectories = batch(policy.base_model.config.vocab_size, seed=0)
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
