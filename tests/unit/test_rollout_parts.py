"""rollout_svc's parts alone: the engine's slots (admission by share, the in-engine count,
a stopped job's work), the jobs seen (tenants, idle ones forgotten), the stats report's rates,
the engine's settings and one turn's result from vLLM's output."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any

import pytest

from common.wire.adapters import AdapterRef
from rollout_svc.compute import EngineCompute
from rollout_svc.engine_settings import EngineSettings
from rollout_svc.jobs import IDLE_JOB_S, JobsSeen
from rollout_svc.sampling import finish_reason, queue_seconds, result_of
from rollout_svc.slots import EngineSlots
from rollout_svc.stats import StatsReport
from tests.handler_kit import request_for


class Held:
    """Admitted work that stays in its slot until released."""

    def __init__(self) -> None:
        self.entered: list[str] = []
        self.gates: dict[str, asyncio.Event] = {}

    def work(self, name: str) -> Any:
        async def serve() -> None:
            self.entered.append(name)
            await self.gates.setdefault(name, asyncio.Event()).wait()

        return serve

    def release(self, name: str) -> None:
        self.gates.setdefault(name, asyncio.Event()).set()


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_slots_admit_up_to_their_count_and_then_by_tenant_share() -> None:
    slots = EngineSlots(4, 0.0, closed=lambda: False, clock=lambda: 0.0)
    held = Held()
    for index in range(6):
        slots.queue("acme", "a1", held.work(f"a{index}"), rank=index)
    slots.queue("globex", "g1", held.work("g0"), rank=0)
    await settle()
    assert held.entered == ["a0", "a1", "a2", "a3"] and slots.in_engine == 4
    assert slots.shares() == {"globex": 1, "acme": 3}
    held.release("a0")  # the freed slot goes to globex: acme holds more than its share
    await settle()
    assert held.entered[4:] == ["g0"]
    assert slots.tenant_in_engine == {"acme": 3, "globex": 1}
    assert slots.job_ids() == {"a1", "g1"}
    assert slots.cancel("a1") == 3
    await settle()
    assert slots.tenant_in_engine["acme"] == 2 and held.entered[5:] == ["a4", "a5"]
    for name in held.entered:
        held.release(name)
    await settle()
    assert slots.in_engine == 0 and not slots.generations


async def test_closed_slots_admit_nothing() -> None:
    slots = EngineSlots(2, 0.0, closed=lambda: True, clock=lambda: 0.0)
    slots.queue("acme", "a1", Held().work("a0"), rank=None)
    await settle()
    assert slots.in_engine == 0 and len(slots.waiting) == 1


async def test_a_tenant_keeps_its_peak_claim_for_the_grace_period() -> None:
    now = [0.0]
    slots = EngineSlots(4, 10.0, closed=lambda: False, clock=lambda: now[0])
    held = Held()
    slots.queue("globex", "g1", held.work("g0"), rank=0)
    slots.queue("globex", "g1", held.work("g1"), rank=1)
    await settle()
    held.release("g0")
    held.release("g1")
    await settle()
    assert slots.shares() == {"globex": 2}  # between two steps: its claim stays
    now[0] = 11.0
    assert slots.shares() == {}


async def test_jobs_seen_take_the_carried_tenant_and_forget_idle_jobs() -> None:
    jobs = JobsSeen(lambda: None)
    request = request_for("j1", 0, 0)
    jobs.took(SimpleNamespace(job_id="j1", tenant="acme"))  # type: ignore[arg-type]
    jobs.took(request)  # no tenant carried: the known one stays
    assert await jobs.tenant_of("j1") == "acme"
    assert await jobs.tenant_of("unknown") == ""  # no registry: asked again next time
    at = jobs.used_at["j1"]
    assert jobs.forget_idle(at + IDLE_JOB_S + 1, waiting={"j1"}) == []
    assert jobs.forget_idle(at + IDLE_JOB_S + 1, waiting=set()) == ["j1"]
    assert "j1" not in jobs.tenants and "j1" not in jobs.used_at


class _Compute:
    slots = 2

    def __init__(self) -> None:
        self.cpu_s: float | None = 5.0  # before the replica started: not counted

    def seconds(self) -> float | None:
        return self.cpu_s


def test_stats_report_the_last_intervals_rates_and_the_uptime() -> None:
    engine = SimpleNamespace(
        busy_seconds=0.0,
        request_seconds=0.0,
        generated_tokens=0,
        prompt_tokens=30,
        cached_prompt_tokens=10,
        preemptions=1,
        in_flight=2,
    )
    compute = _Compute()
    report = StatsReport(engine, "r0", 1024, lambda: 100.0, compute)  # type: ignore[arg-type]
    report.sample(100.0)
    engine.busy_seconds, engine.request_seconds, engine.generated_tokens = 2.0, 16.0, 40
    compute.cpu_s = 7.0  # 2 CPU seconds in 4 s on 2 cores
    stats = report.sample(104.0)
    assert stats.recent_utilisation == 0.5 and stats.tokens_per_s == 10.0
    assert stats.uptime_s == 4.0 and stats.utilisation == 0.5
    assert stats.recent_compute_utilisation == 0.25 and stats.compute_utilisation == 0.25
    assert stats.mean_batch == 8.0  # 16 request-seconds over 2 busy seconds
    assert (stats.compute_s, stats.compute_slots) == (2.0, 2.0)
    assert (stats.in_flight, stats.max_model_len, stats.prompt_tokens) == (2.0, 1024.0, 30.0)
    stats = report.sample(109.0)  # idle: no batch to speak of
    assert stats.mean_batch is None and stats.recent_compute_utilisation == 0.0
    compute.cpu_s = None  # a GPU: no compute share from CPU time
    stats = report.sample(114.0)
    assert stats.compute_utilisation is None and stats.recent_compute_utilisation is None


def test_engine_compute_counts_its_child_processes_cpu_time_even_after_they_exit() -> None:
    compute = EngineCompute(in_process=False, on_gpu=False)
    before = compute.seconds()
    assert before is not None and compute.slots == len(os.sched_getaffinity(0))
    burn = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass"
    child = subprocess.Popen([sys.executable, "-c", burn + "\ntime.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while (compute.seconds() or 0.0) - before < 0.25 and time.monotonic() < deadline:
            time.sleep(0.05)
        counted = compute.seconds()
        assert counted is not None and counted - before >= 0.25  # /proc counts in clock ticks
    finally:
        child.kill()
        child.wait()
    assert (compute.seconds() or 0.0) >= counted  # the exited child's time stays counted
    assert EngineCompute(on_gpu=True).seconds() is None


def test_an_engine_in_process_counts_this_process_cpu_time() -> None:
    compute = EngineCompute(in_process=True, on_gpu=False)
    before = compute.seconds() or 0.0
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    assert (compute.seconds() or 0.0) - before >= 0.15  # /proc counts in clock ticks


def test_engine_settings_take_only_a_rank_vllm_accepts() -> None:
    assert EngineSettings("m", max_lora_rank=8).max_lora_rank == 8
    with pytest.raises(ValueError, match="max_lora_rank"):
        EngineSettings("m", max_lora_rank=12)


def test_a_turns_result_carries_each_sampled_tokens_logprob_and_the_queue_time() -> None:
    completion = SimpleNamespace(
        token_ids=[5, 6],
        logprobs=[{5: SimpleNamespace(logprob=-0.5)}, {6: SimpleNamespace(logprob=-1.5)}],
        finish_reason="length",
    )
    metrics = SimpleNamespace(queued_ts=10.0, scheduled_ts=10.25)
    final: Any = SimpleNamespace(outputs=[completion], metrics=metrics)
    assert queue_seconds(final) == 0.25
    result = result_of(request_for("j", 0, 0), final, AdapterRef("j", 3, "/a").version, 1.0)
    assert result.completion_token_ids == [5, 6] and result.logprobs == [-0.5, -1.5]
    assert (result.adapter_version, result.finish_reason) == (3, "length")
    assert (result.queue_s, result.generate_s) == (0.25, 0.75)
    completion.logprobs = [{5: SimpleNamespace(logprob=-0.5)}, {7: SimpleNamespace(logprob=-1)}]
    with pytest.raises(RuntimeError, match="left out"):
        result_of(request_for("j", 0, 0), final, 3, 1.0)
    assert [finish_reason(r) for r in ("stop", "length", "abort", None)] == [
        "stop",
        "length",
        "abort",
        "abort",
    ]
