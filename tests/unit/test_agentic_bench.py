"""bench/agentic.py: its jobs, the sequential phase put together from alone runs, the ratios and
accuracy checks; and its HTTP tool (examples/envs/http_lookup.py) against the real service."""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path += [str(ROOT / "bench"), str(ROOT / "examples" / "envs")]  # after the packages

from agentic import ENVS, TENANTS, agentic_jobs, alone_plan, job_key, lookup_service  # noqa: E402
from agentic_figures import (  # noqa: E402
    Accuracy,
    Work,
    accuracy_checks,
    idle_profile,
    ratios,
    sequential_work,
    spec_checks,
)
from http_lookup import URL_VAR, HttpLookupEnv, stock_of  # noqa: E402

from env_svc.tools import format_call  # noqa: E402


def jobs(count: int) -> argparse.Namespace:
    return argparse.Namespace(
        jobs=count, steps=3, eval_tasks=8, seed_base=100, base_model="m", latency_s=1.0
    )


def test_every_tenant_gets_both_environments_from_eight_jobs() -> None:
    specs = agentic_jobs(jobs(8), ENVS, "conc-x")
    pairs = {(spec.tenant, spec.env.name) for spec in specs}
    assert pairs == {(tenant, env) for tenant in TENANTS for env in ENVS}
    assert [spec.env.seed for spec in specs] == list(range(100, 108))
    assert [job_key(spec.job_id) for spec in specs][:2] == ["0-http_lookup", "1-code_tasks"]
    assert {spec.rl.max_steps for spec in specs} == {3}


def test_alone_runs_are_every_job_or_the_first_of_each_environment() -> None:
    specs = agentic_jobs(jobs(32), ENVS, "alone-x")
    assert alone_plan(specs, 0) == specs
    picked = [job_key(spec.job_id) for spec in alone_plan(specs, 2)]
    assert picked == ["0-http_lookup", "1-code_tasks", "2-http_lookup", "3-code_tasks"]


def test_a_job_not_run_alone_counts_its_specs_mean_alone_run() -> None:
    alone = {
        "0-a": Work(wall_s=10, rollout_compute_s=4, rollout_core_s=10, trainer_busy_s=2, steps=3),
        "1-a": Work(wall_s=20, rollout_compute_s=8, rollout_core_s=20, trainer_busy_s=6, steps=3),
        "2-b": Work(wall_s=5, rollout_compute_s=5, rollout_core_s=5, trainer_busy_s=1, steps=3),
    }
    spec_of = {"0-a": "a", "1-a": "a", "2-b": "b", "3-a": "a", "4-b": "b"}
    total = sequential_work(spec_of, alone)
    assert total.wall_s == 10 + 20 + 5 + 15 + 5
    assert total.steps == 15
    figures = total.figures()
    assert figures["rollout_busy_share"] == round((4 + 8 + 5 + 6 + 5) / 55, 4)
    assert figures["trainer_busy_share"] == round((2 + 6 + 1 + 4 + 1) / 55, 4)


def test_ratios_are_concurrent_over_sequential() -> None:
    sequential = Work(wall_s=100, rollout_compute_s=40, rollout_core_s=100, trainer_busy_s=20)
    concurrent = Work(wall_s=50, rollout_compute_s=40, rollout_core_s=50, trainer_busy_s=20)
    found = ratios(sequential.figures(), concurrent.figures())
    assert (found["time_ratio"], found["util_ratio"]) == (0.5, round(0.6 / 0.3, 4))
    assert found["targets"]["time_ratio"] == {"target": 0.15, "met": False, "over_target": 3.33}
    assert found["targets"]["util_ratio"]["of_target"] == round(2.0 / 4.3, 2)
    busy = Work(wall_s=50, cpu_s=80)  # 40 s of work on this machine's cores
    floor = ratios(sequential.figures(), busy.figures())["time_ratio_floor"]
    assert floor == round(80 / len(os.sched_getaffinity(0)) / 100, 4)


def test_the_engine_is_busy_computing_not_while_a_request_waits_in_it() -> None:
    # a request in the engine all the time, at a mean batch of 1.5, computing 1 core of 2
    work = Work(
        wall_s=100,
        rollout_busy_s=100,
        rollout_uptime_s=100,
        rollout_request_s=150,
        rollout_compute_s=100,
        rollout_core_s=200,
    )
    figures = work.figures()
    assert figures["rollout_busy_share"] == 0.5 and figures["rollout_request_share"] == 1.0
    assert figures["mean_batch"] == 1.5


def phase_of(
    samples: list[tuple[float, float, float, float]], steps: list[tuple[float, float]]
) -> dict[str, Any]:
    """A phase's timeline of 1 s samples (core 0, core 1, engine, trainer busy) and its steps
    (ended at, wall seconds)."""
    return {
        "timeline": {
            "at_s": [float(i + 1) for i in range(len(samples))],
            "core_busy_share": {"0": [s[0] for s in samples], "1": [s[1] for s in samples]},
            "process_cpu_share": {
                "rollout_svc": [s[2] for s in samples],
                "trainer_svc": [s[3] for s in samples],
            },
        },
        "steps": [{"at_s": at, "wall_step_s": wall} for at, wall in steps],
    }


def test_idle_cores_are_placed_before_between_and_after_the_trainers_steps() -> None:
    generating = (1.0, 0.1, 1.0, 0.05)  # the engine alone: the trainer waits for groups
    training = (0.4, 0.8, 0.05, 1.2)  # the trainer borrowing the idle engine's core
    both = (1.0, 0.9, 1.0, 0.9)
    evaluating = (1.0, 0.0, 1.0, 0.0)
    samples = [generating] * 2 + [training] * 2 + [generating, both] + [evaluating] * 2
    alone = phase_of(samples, steps=[(4.0, 2.0), (6.0, 1.0)])
    found = idle_profile([alone])
    assert found is not None
    assert found["before_first_step"] == {"idle_core_s": 1.8, "wall_s": 2.0}
    assert found["engine_waiting"] == {"idle_core_s": 1.6, "wall_s": 2.0}
    assert found["trainer_waiting"] == {"idle_core_s": 0.9, "wall_s": 1.0}
    assert found["both_computing"] == {"idle_core_s": 0.1, "wall_s": 1.0}
    assert found["after_last_step"] == {"idle_core_s": 2.0, "wall_s": 2.0}
    assert found["idle_core_s"] == 6.4 and found["idle_share"] == round(6.4 / 16, 4)
    twice = idle_profile([alone, alone])
    assert twice is not None and twice["idle_core_s"] == 12.8
    assert twice["idle_share"] == found["idle_share"]
    assert idle_profile([{"timeline": {}, "steps": []}]) is None


def test_accuracy_is_checked_against_the_jobs_own_alone_run_else_its_specs() -> None:
    spec_of = {"0-a": "a", "1-a": "a", "2-b": "b"}
    alone = {"0-a": Accuracy(0.8, 0.05), "2-b": Accuracy(0.5, 0.1)}
    shared = {"0-a": Accuracy(0.75, 0.08), "1-a": Accuracy(0.85, 0.05), "2-b": Accuracy(0.75, 0.1)}
    rows = {row["job"]: row for row in accuracy_checks(spec_of, alone, shared)}
    assert rows["0-a"]["within_one_se_or_better"] is True  # 0.05 below, the larger SE 0.08
    alone_of_1a = {"value": 0.8, "stderr": 0.05, "tasks": 0}  # not run alone: its spec's
    assert rows["1-a"]["alone"] == alone_of_1a
    assert rows["1-a"]["within_one_se_or_better"] is True
    assert rows["2-b"]["within_one_se_or_better"] is True  # 0.25 better
    rows = {row["job"]: row for row in accuracy_checks(spec_of, shared, alone)}  # swapped
    assert rows["2-b"]["within_one_se_or_better"] is False  # 0.25 worse, SE 0.1


def test_one_task_of_difference_is_within_the_margin_where_the_se_reads_zero() -> None:
    perfect, one_miss = Accuracy(1.0, 0.0, 32), Accuracy(31 / 32, 0.0307, 32)
    assert one_miss.within_one_se_or_better(perfect)  # 1/32 below, SE 0.0307 < 1/32
    assert not Accuracy(30 / 32, 0.0428, 32).within_one_se_or_better(perfect)


def test_a_specs_shared_jobs_are_judged_against_its_alone_runs_as_two_samples() -> None:
    """Two alone runs of `code` ended at 0.0 and 0.25 (a lucky seed), its four shared jobs at
    0.0 and 0.25 twice each: as samples they match. A spec whose shared jobs all fall well
    short of its alone run fails."""
    spec_of = {"a0": "code", "a1": "code", "s0": "code", "s1": "code", "s2": "code", "s3": "code"}
    spec_of |= {"b0": "words", "t0": "words", "t1": "words"}
    alone = {"a0": Accuracy(0.0, 0.0, 8), "a1": Accuracy(0.25, 0.153, 8)}
    alone |= {"b0": Accuracy(1.0, 0.0, 8)}
    shared = {f"s{i}": Accuracy(0.25 * (i % 2), 0.1, 8) for i in range(4)}
    shared |= {"t0": Accuracy(0.5, 0.18, 8), "t1": Accuracy(0.625, 0.17, 8)}
    rows = {row["spec"]: row for row in spec_checks(spec_of, alone, shared)}
    assert rows["code"]["within_one_se_or_better"] is True
    assert (rows["code"]["alone_runs"], rows["code"]["shared_jobs"]) == (2, 4)
    assert rows["words"]["within_one_se_or_better"] is False
    assert rows["words"]["shared_mean"] == pytest.approx(0.5625)


def test_the_final_accuracy_is_the_last_evaluated_versions() -> None:
    summary = {
        "evals": {
            "0": {"eval_accuracy": 0.25, "eval_accuracy_stderr": 0.1},
            "4": {"eval_accuracy": 0.75, "eval_accuracy_stderr": 0.08},
        }
    }
    assert Accuracy.final(summary) == Accuracy(0.75, 0.08)
    assert Accuracy.final({"evals": {"0": {"eval_accuracy": 0.5}}}) is None


@pytest.fixture
def lookup_latency_s(monkeypatch: pytest.MonkeyPatch) -> Iterator[float]:
    """The inventory service on the loopback as the bench starts it, answering after 0.3 s."""
    monkeypatch.setenv(URL_VAR, "")  # undone after the test; lookup_service sets it
    with lookup_service(0.3):
        yield 0.3


def test_the_lookup_tool_asks_the_service_and_a_right_answer_scores(
    lookup_latency_s: float,
) -> None:
    env = HttpLookupEnv()
    task = env.sample_task(random.Random(3))

    async def episode() -> tuple[float, list[str], float | None]:
        state, _ = await env.areset(task)
        started = time.monotonic()
        called = await env.astep(state, format_call("lookup", {"key": task.key}))
        waited = time.monotonic() - started
        answered = await env.astep(called.state, str(task.answer))
        assert answered.reward is not None
        return (
            waited,
            [m["content"] for m in called.messages],
            answered.reward.components["correct"],
        )

    waited, replies, correct = asyncio.run(episode())
    assert replies == [str(stock_of(task.key))]
    assert task.answer == stock_of(task.key)
    assert waited >= lookup_latency_s
    assert correct == 1.0
