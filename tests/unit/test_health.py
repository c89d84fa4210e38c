"""common.runtime.health and run_service's endpoints: /healthz, /readyz, /metrics over real
sockets."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Coroutine
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from common.runtime.config import EnvServiceSettings, RolloutSettings, TrainerSettings
from common.runtime.health import HealthServer
from common.runtime.metrics import (
    ENDED_JOB,
    TRAINER_GROUPS_DROPPED,
    TRAINER_STEP_SECONDS,
    TRAINER_STEPS,
    TRAINER_TOKENS_PER_SECOND,
    consumer_metrics,
    forget_job,
)
from common.runtime.service import Service, run_service
from common.wire.messages import new_id
from tests.unit.test_compose import COMPOSE_FILE


async def get(port: int, path: str, method: str = "GET") -> tuple[int, str, bytes]:
    """(status, content type, body) of one request, as a scraper or probe sends it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: test\r\nAccept: */*\r\n\r\n".encode())
    await writer.drain()
    response = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    await writer.wait_closed()
    head, _, body = response.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in header_lines)
    # HEAD: the length GET would send, and no body.
    assert (method == "HEAD" and body == b"") or int(headers["Content-Length"]) == len(body)
    return int(status_line.split()[1]), headers["Content-Type"], body


class Flags:
    def __init__(self) -> None:
        self.checks = {"kafka": True, "redis": False}

    async def readiness(self) -> dict[str, bool]:
        return dict(self.checks)


async def test_liveness_readiness_metrics_and_unknown_paths() -> None:
    flags = Flags()
    consumer_metrics("health-test", "marlaas.events").processed.inc(3)
    async with HealthServer(flags.readiness, host="127.0.0.1", port=0) as server:
        assert server.port > 0 and server.url == f"http://127.0.0.1:{server.port}"
        assert await get(server.port, "/healthz") == (200, "text/plain; charset=utf-8", b"ok\n")

        status, content_type, body = await get(server.port, "/readyz")
        assert (status, content_type) == (503, "application/json")
        assert json.loads(body) == {"ready": False, "checks": {"kafka": True, "redis": False}}
        flags.checks["redis"] = True
        status, _, body = await get(server.port, "/readyz?verbose=1")  # query strings ignored
        assert status == 200
        assert json.loads(body) == {"ready": True, "checks": {"kafka": True, "redis": True}}

        status, content_type, body = await get(server.port, "/metrics")
        assert status == 200 and content_type.startswith("text/plain; version=")
        series = 'service="health-test",topic="marlaas.events"'
        assert f"marlaas_messages_processed_total{{{series}}} 3.0".encode() in body.splitlines()
        # Declared series are exported before anything happened.
        assert f"marlaas_dead_letters_total{{{series}}} 0.0".encode() in body.splitlines()
        assert b"_created" not in body

        assert (await get(server.port, "/nope"))[0] == 404
        assert (await get(server.port, "/metrics", method="POST"))[0] == 405
        assert await get(server.port, "/healthz", method="HEAD") == (
            200,
            "text/plain; charset=utf-8",
            b"",
        )
        port = server.port
    with pytest.raises(OSError):
        await get(port, "/healthz")


async def test_failing_or_empty_readiness_is_not_ready() -> None:
    async def broken() -> dict[str, bool]:
        raise ConnectionError("redis went away")

    async def nothing() -> dict[str, bool]:
        return {}

    for readiness in (broken, nothing):
        async with HealthServer(readiness, host="127.0.0.1", port=0) as server:
            status, _, body = await get(server.port, "/readyz")
            assert status == 503
            assert json.loads(body)["checks"] == {"readiness_checks": False}
            assert (await get(server.port, "/healthz"))[0] == 200


async def test_garbage_request_is_closed_and_the_server_goes_on() -> None:
    async with HealthServer(Flags().readiness, host="127.0.0.1", port=0) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"\x16\x03\x01 not http\r\n\r\n")
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 10) == b""
        writer.close()
        assert (await get(server.port, "/healthz"))[0] == 200


def samples(body: bytes) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    }


async def test_metrics_name_no_job_or_tenant_unless_the_operator_asks() -> None:
    """Off (the default), a scrape learns no job id and no tenant: per-job counters and
    histograms are summed over jobs, per-job gauges and vLLM's adapter list left out."""
    registry = CollectorRegistry()
    trainer = (
        TRAINER_STEPS,
        TRAINER_STEP_SECONDS,
        TRAINER_TOKENS_PER_SECOND,
        TRAINER_GROUPS_DROPPED,
    )
    for metric in trainer:
        registry.register(metric)
    lora_info = Gauge(
        "vllm:lora_requests_info", "Running stats on lora requests.",
        ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=registry,
    )  # fmt: skip
    lora_info.labels("8", "", "secret-job-a@v3,secret-job-b@v1").set(1.0)
    # The trainer's metrics are the process's: other tests' jobs count in them too.
    steps_before = _count(TRAINER_STEP_SECONDS, "marlaas_trainer_step_seconds_count")
    trained_before = _total(TRAINER_STEPS, "marlaas_trainer_steps_total")
    dropped_before = _total(TRAINER_GROUPS_DROPPED, "marlaas_trainer_groups_dropped_total")
    for job_id, tenant, steps in (("secret-job-a", "acme", 3), ("secret-job-b", "globex", 2)):
        TRAINER_STEPS.labels(job_id, tenant).inc(steps)
        TRAINER_STEP_SECONDS.observe(0.4)
        TRAINER_TOKENS_PER_SECOND.labels(job_id).set(100.0)
        TRAINER_GROUPS_DROPPED.labels(job_id, "dropped_stale").inc()
    readiness = Flags().readiness
    try:
        async with HealthServer(readiness, host="127.0.0.1", registry=registry) as server:
            body = (await get(server.port, "/metrics"))[2]
        for named in (b"secret-job", b"acme", b"globex", b"job_id", b"tenant", b"lora"):
            assert named not in body, named
        summed = samples(body)
        assert summed[("marlaas_trainer_steps_total", frozenset())] == trained_before + 5
        assert summed[("marlaas_trainer_step_seconds_count", frozenset())] == steps_before + 2
        dropped = [v for (name, _), v in summed.items() if name.endswith("dropped_total")]
        assert sum(dropped) == dropped_before + 2
        assert not [name for name, _ in summed if name.startswith("marlaas_trainer_tokens")]

        async with HealthServer(
            readiness, host="127.0.0.1", registry=registry, tenant_labels=True
        ) as server:
            per_job = samples((await get(server.port, "/metrics"))[2])
        job_a = frozenset({("job_id", "secret-job-a"), ("tenant", "acme")})
        assert per_job[("marlaas_trainer_steps_total", job_a)] == 3
        tokens = frozenset({("job_id", "secret-job-b")})
        assert per_job[("marlaas_trainer_tokens_per_second", tokens)] == 100
        assert any(name == "vllm:lora_requests_info" for name, _ in per_job)
    finally:
        for job_id, tenant in (("secret-job-a", "acme"), ("secret-job-b", "globex")):
            TRAINER_STEPS.remove(job_id, tenant)
            TRAINER_TOKENS_PER_SECOND.remove(job_id)
            TRAINER_GROUPS_DROPPED.remove(job_id, "dropped_stale")


class SlowService(Service):
    """Starts when told to; its only task ends when told to (which stops the service)."""

    name = "slow_svc"

    def __init__(self) -> None:
        self.may_start = asyncio.Event()
        self.may_end = asyncio.Event()
        self.kafka = False
        self.stopped = False

    async def start(self) -> None:
        await self.may_start.wait()
        self.kafka = True

    def tasks(self) -> dict[str, Coroutine[Any, Any, None]]:
        return {"slow-work": self.may_end.wait()}  # type: ignore[dict-item]

    def request_stop(self) -> None:
        pass

    async def stop(self) -> None:
        self.stopped = True

    async def readiness(self) -> dict[str, bool]:
        return {"kafka": self.kafka}


async def wait_for_port(caplog: pytest.LogCaptureFixture) -> int:
    for _ in range(100):
        for record in caplog.records:
            found = re.fullmatch(
                r"slow_svc: metrics and health on http://127\.0\.0\.1:(\d+)", record.getMessage()
            )
            if found:
                return int(found.group(1))
        await asyncio.sleep(0.05)
    raise AssertionError("run_service never logged its metrics address")


async def test_run_service_answers_health_during_start_and_readiness_after(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", logger="common.runtime.service")
    service = SlowService()
    run = asyncio.create_task(run_service(service, metrics_port=0))
    port = await wait_for_port(caplog)

    # Still in start(): alive, not ready, and the body says why.
    assert (await get(port, "/healthz"))[0] == 200
    status, _, body = await get(port, "/readyz")
    assert status == 503
    assert json.loads(body)["checks"] == {"serving": False, "kafka": False}

    service.may_start.set()
    for _ in range(100):
        if (await get(port, "/readyz"))[0] == 200:
            break
        await asyncio.sleep(0.05)
    assert json.loads((await get(port, "/readyz"))[2])["checks"] == {
        "serving": True,
        "kafka": True,
    }

    service.may_end.set()  # a task that returns stops the service with exit code 1
    assert await asyncio.wait_for(run, 30) == 1
    assert service.stopped
    with pytest.raises(OSError):  # the endpoint goes with the service
        await get(port, "/healthz")


def test_compose_healthchecks_probe_each_services_readyz_on_its_port() -> None:
    compose = yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))
    ports = {
        "env_svc": EnvServiceSettings().metrics_port,
        "rollout_svc": RolloutSettings().metrics_port,
        "trainer_svc": TrainerSettings().metrics_port,
    }
    assert len(set(ports.values())) == 3
    for name, port in ports.items():
        service = compose["services"][name]
        # Besides: the rollout replicas' chat completions (rollout_svc/chat_api.py).
        api = [service["environment"]["ROLLOUT_API_PORT"]] if name == "rollout_svc" else []
        assert service["expose"] == [str(port), *api]
        assert f"http://127.0.0.1:{port}/readyz" in " ".join(service["healthcheck"]["test"])
        # Exposed ports listen on the container's address, not the default loopback only.
        assert service["environment"]["MARLAAS_METRICS_HOST"] == "0.0.0.0"


def _count(metric: Collector, name: str, **labels: str) -> float:
    """The value of `metric`'s sample `name` with `labels` (0 when it has none)."""
    found = [
        sample.value
        for family in metric.collect()
        for sample in family.samples
        if sample.name == name and sample.labels == labels
    ]
    return sum(found)


def _total(metric: Collector, name: str) -> float:
    """The sum of `metric`'s samples `name` over every label."""
    return sum(s.value for f in metric.collect() for s in f.samples if s.name == name)


def test_a_job_the_trainer_lets_go_of_leaves_no_series_and_the_sums_stay() -> None:
    """The trainer's per-job series go with the job (they piled up with every job ever
    trained); its counts move to the `(ended)` series, so a sum over jobs never goes down."""
    job_id, tenant = f"ends-{new_id()[:6]}", f"t-{new_id()[:6]}"
    TRAINER_STEPS.labels(job_id, tenant).inc(4)
    TRAINER_GROUPS_DROPPED.labels(job_id, "dropped_stale").inc(2)
    TRAINER_TOKENS_PER_SECOND.labels(job_id).set(50.0)
    ended_drops = _count(
        TRAINER_GROUPS_DROPPED, "marlaas_trainer_groups_dropped_total",
        job_id=ENDED_JOB, kind="dropped_stale",
    )  # fmt: skip
    forget_job(job_id)
    named = [
        sample
        for metric in (TRAINER_STEPS, TRAINER_GROUPS_DROPPED, TRAINER_TOKENS_PER_SECOND)
        for family in metric.collect()
        for sample in family.samples
        if sample.labels.get("job_id") == job_id
    ]
    assert named == []
    steps = _count(TRAINER_STEPS, "marlaas_trainer_steps_total", job_id=ENDED_JOB, tenant=tenant)
    assert steps == 4
    drops = _count(
        TRAINER_GROUPS_DROPPED, "marlaas_trainer_groups_dropped_total",
        job_id=ENDED_JOB, kind="dropped_stale",
    )  # fmt: skip
    assert drops == ended_drops + 2
    TRAINER_STEPS.remove(ENDED_JOB, tenant)
