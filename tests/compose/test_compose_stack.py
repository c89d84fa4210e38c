"""`docker compose up` for real (marker `compose`, `make test-compose`): the README's
"Production: compose" run command for command on this machine, which reaches no container
registry (deploy/airgap/: Tansu for Apache Kafka, Debian's redis-server for Redis).

From nothing (no engine running, no images) to: the stack up with two replicas of every
service, a tenant with a key, two jobs through the tenant API and one produced as JSON by a
plain Kafka client, one trainer and one rollout container killed mid-run, every job complete
with a clean `marlaas audit`, an adapter exported to the host (CLI) and over HTTP (API), a
rolling upgrade of env_svc alone with a job running, and a teardown that leaves nothing
behind. Writes bench/results/compose-<date>-<machine>.json: the time of each part and the
build cache's size.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.compose.stack import (
    ROOT,
    Stack,
    Tenant,
    assigned,
    handled_in,
    key_in,
    partitions_in,
    wait_for,
)
from tests.leaks import leaks

# From nothing: engine, base images, builds (minutes), then the scenario (tens of minutes).
pytestmark = [pytest.mark.compose, pytest.mark.timeout(3600)]

SERVICES = ("env_svc", "rollout_svc", "trainer_svc")
REPLICAS = {service: 2 for service in SERVICES}
SCALE = [arg for s, n in REPLICAS.items() for arg in ("--scale", f"{s}={n}")]
DONE = {"completed"}
STEPS = 30
"""Long enough that the kills land mid-run: a step takes seconds here, and a cold stack's
jobs start apart (in one run a job had finished 12 steps before another had trained one)."""
PARTITIONS = 12
"""compose.yaml's MARLAAS_TOPIC_PARTITIONS."""
TRAJECTORIES = "marlaas.trajectories"
SERVED_TOPIC = {
    "env_svc": "marlaas.rollouts",
    "rollout_svc": "marlaas.prompts",
    "trainer_svc": TRAJECTORIES,
}
"""What each service's replicas handle: results to score, prompts, episodes to train on."""


def job(seed: int, max_steps: int, **fields: Any) -> dict[str, Any]:
    """A small arithmetic job (plumbing, not learning: a few steps of two samples)."""
    return {
        "env": {"name": "arithmetic", "seed": seed},
        "rl": {
            "group_size": 2,
            "groups_per_step": 1,
            "max_steps": max_steps,
            "max_context_tokens": 128,
            "sampling": {"max_new_tokens": 8},
        },
        **fields,
    }


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = Stack("marlaas-test", tmp_path_factory.mktemp("compose") / "compose.env")
    started = time.monotonic()
    try:
        output = stack.script("up.sh", *SCALE)
        stack.timings["up_s"] = time.monotonic() - started
        stack.timings["compose_up_s"] = float(output.rsplit("stack up in ", 1)[1].split()[0])
        yield stack
    finally:
        if os.environ.get("MARLAAS_COMPOSE_KEEP") != "1":
            down = time.monotonic()
            stack.script("down.sh")
            stack.timings["down_s"] = time.monotonic() - down


def record_result(stack: Stack, extra: dict[str, Any]) -> Path:
    sys.path.insert(0, str(ROOT / "bench"))  # the bench scripts' own module of result names
    from machine import machine_fields, result_path

    cache = stack.docker("system", "df", "--format", "{{json .}}")
    path = result_path("compose")
    path.write_text(
        json.dumps(
            {
                "what": "make test-compose: the compose stack from nothing, scaled, with kills "
                "and a rolling upgrade (tests/compose/test_compose_stack.py)",
                "machine": machine_fields(),
                "timings_s": {k: round(v, 1) for k, v in stack.timings.items()},
                "docker_system_df": [json.loads(line) for line in cache.splitlines() if line],
                **extra,
            },
            indent=2,
        )
        + "\n"
    )
    return path


def test_the_compose_stack_runs_scales_survives_kills_and_upgrades(stack: Stack) -> None:
    t0 = time.monotonic()
    wait_for(
        "every service healthy",
        lambda: stack.all_healthy(("api", *SERVICES), REPLICAS),
        timeout_s=1200,
        explain=lambda: stack.diagnosis([], ("api", *SERVICES, "kafka")),
    )
    stack.timings["healthy_s"] = time.monotonic() - t0

    # A tenant and its key (shown once), as the operator.
    added = stack.cli("tenants", "add", "acme")
    key = re.search(r"API key \(shown once[^)]*\): (\S+)", added)
    assert key, added
    tenant = Tenant(f"http://127.0.0.1:{stack.api_port}", key.group(1))

    # Two jobs through the API with the tenant's key; one produced as JSON by a plain client.
    t0 = time.monotonic()
    # Job ids chosen so that each trainer replica owns one of them (a job's episodes go to
    # the partition of its id, and the trainer holding that partition trains it).
    owners = {n: assigned(stack.logs(n), TRAJECTORIES) for n in stack.containers("trainer_svc")}
    assert all(owners.values()) and len(owners) == 2, owners
    first, second = owners.values()
    ids = [key_in(first, "acme-a", PARTITIONS), key_in(second, "acme-b", PARTITIONS)]
    api_jobs = [tenant.submit(job(n + 1, STEPS, job_id=i)) for n, i in enumerate(ids)]
    json_job = key_in(first, "acme-json", PARTITIONS)
    stack.produce_json_job(
        {"kind": "job_spec", "job_id": json_job, "tenant": "acme", **job(3, max_steps=STEPS)}
    )
    jobs = [*api_jobs, json_job]

    def states() -> dict[str, dict[str, Any]]:
        return stack.job_states(jobs)

    def explain() -> str:  # the broker too: Tansu's answers are a suspect in a stall
        return stack.diagnosis([*jobs, *upgraded], (*SERVICES, "kafka"))

    upgraded: list[str] = []  # the job of the rolling upgrade, once submitted

    # The code sandbox where env_svc runs, while the jobs do: every hostile program
    # (env_svc/sandbox/probes.py) contained in an env_svc container, as its uid 1000 under the
    # seccomp profile compose gives it (deploy/seccomp/), and the replica goes on serving.
    t_probes = time.monotonic()
    probed = stack.docker(
        "exec", stack.containers("env_svc")[0], "python", "-m", "env_svc.sandbox.probes",
        timeout_s=600,
    )  # fmt: skip
    assert re.search(r"(\d+) of \1 hostile programs contained", probed), probed
    stack.timings["sandbox_probes_s"] = time.monotonic() - t_probes

    # Mid-run: once every job has trained a version, kill a trainer and a rollout replica.
    wait_for(
        "every job trained a first version",
        lambda: all(s.get("step", 0) >= 1 for s in states().values()),
        timeout_s=900,
        explain=explain,
    )
    stack.timings["first_versions_s"] = time.monotonic() - t0
    # Both replicas of each scaled service took part (a replica's /metrics: the records it
    # handled); the killed ones are read before they go.
    for service, topic in SERVED_TOPIC.items():
        served = {n: stack.processed(n, service, topic) for n in stack.containers(service)}
        assert len(served) == 2 and all(served.values()), (service, topic, served)
    killed = [next(iter(owners)), stack.containers("rollout_svc")[0]]
    assert not any(s.get("state") in DONE for s in states().values()), "killed after the end"
    for name in killed:
        stack.docker("kill", name)
    wait_for(
        "every job completed after the kills",
        lambda: all(s.get("state") in DONE for s in states().values()),
        timeout_s=1500,
        explain=explain,
    )
    stack.timings["jobs_done_s"] = time.monotonic() - t0
    for job_id in api_jobs:
        assert tenant.job(job_id)["status"] == "completed"
    for job_id in jobs:
        audit = stack.cli("audit", job_id, check=False)
        assert "0 lost, 0 trained twice, 0 unexpected" in audit and "problem" not in audit, audit

    # Each replica's log shows its partitions; the survivors' also the records they handled
    # (one activity line a minute, common/bus/kafka.py).
    logs = {n: stack.logs(n) for s in SERVICES for n in stack.containers(s, running=False)}
    for name, text in logs.items():
        assert any("[" in p for p in partitions_in(text)), f"{name} was assigned no partition"
    for service, topic in SERVED_TOPIC.items():
        for name in stack.containers(service):
            assert handled_in(logs[name], topic) > 0, (name, topic)

    # Exports: the CLI writes one to the host; the API returns one as a tarball.
    exports = ROOT / "exports"
    shutil.rmtree(exports / json_job, ignore_errors=True)
    stack.cli("export", json_job, "--out", f"/exports/{json_job}")
    assert json.loads((exports / json_job / "adapter_config.json").read_text())["r"] > 0
    shutil.rmtree(exports / json_job)  # the checkout's ./exports, as the README's CLI uses it
    body, version = tenant.export(api_jobs[0])
    with tarfile.open(fileobj=io.BytesIO(body)) as tar:
        names = tar.getnames()
    assert version >= 1 and any(n.endswith("adapter_model.safetensors") for n in names), names

    # No secret in any container's log, killed ones too: no value of the secrets file, nor
    # the tenant's key, in any obvious encoding (named, never shown, when found).
    lines = stack.env_file.read_text().splitlines()
    secrets = dict(line.split("=", 1) for line in lines if line.startswith("MARLAAS_"))
    secrets["the tenant's API key"] = tenant.key
    every_log = {name: stack.logs(name) for name in stack.containers(running=False)}
    leaked = leaks(every_log, secrets)  # names only: a failure's output is a log too
    assert not leaked, leaked

    # A rolling upgrade: env_svc rebuilt with another revision, then recreated alone while a
    # job is mid-run; the other services' containers are untouched and the job completes.
    others = {s: stack.containers(s) for s in ("api", "rollout_svc", "trainer_svc")}
    t0 = time.monotonic()
    stack.compose("build", "--build-arg", "MARLAAS_REVISION=upgrade-1", "env_svc")
    stack.timings["upgrade_build_s"] = time.monotonic() - t0
    upgraded_job = tenant.submit(job(4, STEPS))
    upgraded.append(upgraded_job)
    wait_for("the job to upgrade under started", lambda: tenant.job(upgraded_job)["version"] >= 1,
             timeout_s=600, explain=explain)  # fmt: skip
    t0 = time.monotonic()
    stack.compose("up", "-d", "--no-deps", "--scale", "env_svc=2", "env_svc")
    stack.timings["upgrade_recreate_s"] = time.monotonic() - t0
    at_upgrade = tenant.job(upgraded_job)
    assert at_upgrade["status"] != "completed" and at_upgrade["version"] < STEPS, at_upgrade
    revisions = {
        n: stack.inspect(n)["Config"]["Labels"].get("org.opencontainers.image.revision")
        for n in stack.containers("env_svc")
    }
    assert set(revisions.values()) == {"upgrade-1"} and len(revisions) == 2, revisions
    assert {s: stack.containers(s) for s in others} == others
    wait_for("the job completed across the upgrade",
             lambda: tenant.job(upgraded_job)["status"] == "completed", timeout_s=900,
             explain=explain)  # fmt: skip
    audit = stack.cli("audit", upgraded_job, check=False)
    assert "0 lost, 0 trained twice, 0 unexpected" in audit and "problem" not in audit, audit

    stats = stack.docker("stats", "--no-stream", "--format", "{{json .}}")
    record_result(
        stack,
        {
            "jobs": [*jobs, upgraded_job],
            "killed": killed,
            "container_memory": [json.loads(line) for line in stats.splitlines() if line],
        },
    )


def test_teardown_leaves_nothing_behind(stack: Stack) -> None:
    """Runs after the scenario: `make compose-down` removes every container, network and
    volume of the project (images and the build cache stay, by design)."""
    stack.script("down.sh")
    assert stack.leftovers() == {"container": [], "network": [], "volume": []}
