"""The `marlaas` CLI against a real broker and Redis, with a job's history written directly.

Events and registry entries are produced here as the services would write them, so the
numbers each command shows can be checked exactly. The commands that need running services
(pause applied by env_svc, `submit --wait`, `export` of a trained adapter) are in
test_cli_services.py.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer
from typer.testing import CliRunner

from common.bus.kafka import Producer
from common.runtime.hardware import CpuInfo, Hardware, trainer_precision
from common.runtime.service import runtime_fields
from common.state.store import RedisStore
from common.wire.codec import decode
from common.wire.lifecycle import RolloutReplicaStats
from common.wire.messages import (
    EnvSettings,
    JobCommand,
    JobSpec,
    Message,
    RLSettings,
    Topic,
    job_event,
    new_id,
)
from console.cli.main import app
from console.stack.children import free_port
from console.stack.local import LocalStack
from tests.conftest import with_store
from tests.track_readers import (
    mlflow_run,
    tensorboard_hparams,
    tensorboard_scalars,
    trackio_run,
    wandb_offline_run,
)

pytestmark = pytest.mark.kafka

EXAMPLES = Path(__file__).parents[2] / "examples" / "jobs"
G, B = 4, 2
REWARDS = [0.25, 0.5, 0.375]


@pytest.fixture
def redis_url(local_stack: LocalStack) -> str:
    """Redis database 1: jobs written here are invisible to services another test may run
    (they use database 0), so nothing but this test changes their counters or states."""
    return local_stack.redis_url.rsplit("/", 1)[0] + "/1"


@pytest.fixture
def cli(
    monkeypatch: pytest.MonkeyPatch, kafka_bootstrap: str, redis_url: str, tmp_path: Path
) -> Iterator[CliRunner]:
    monkeypatch.setenv("MARLAAS_KAFKA_BOOTSTRAP", kafka_bootstrap)
    monkeypatch.setenv("MARLAAS_REDIS_URL", redis_url)
    monkeypatch.setenv("MARLAAS_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("MARLAAS_BASE_MODEL", raising=False)
    yield CliRunner()


def invoke(runner: CliRunner, *args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, ["--connect-timeout", "2", *args])
    assert "Traceback" not in result.output, result.output
    return result.exit_code, result.stdout, result.stderr


def spec(job_id: str, tenant: str = "acme", max_steps: int = 5) -> JobSpec:
    return JobSpec(
        job_id=job_id,
        tenant=tenant,
        base_model="smollm2-135m-instruct",
        env=EnvSettings(name="arithmetic"),
        rl=RLSettings(group_size=G, groups_per_step=B, max_steps=max_steps),
        submitted_at=1.0,
    )


def history(kafka_bootstrap: str, redis_url: str, *, status: str = "running") -> JobSpec:
    """A job 3 steps into 5, as env_svc and trainer_svc would have recorded it."""
    job = spec(f"cli-{new_id()[:8]}")

    async def write(registry: RedisStore) -> None:
        await registry.jobs.register(job, status=status)  # type: ignore[arg-type]
        # 3 versions trained (the pointer), 9 groups issued, 1 of them dropped.
        await registry.adapters.publish(job.job_id, len(REWARDS), "/artifacts/none", len(REWARDS))
        for _ in range(9):
            assert await registry.flow.try_issue_group(
                job.job_id, max_staleness=9, groups_per_step=B, max_groups=100
            )
        await registry.flow.record_dropped_group(job.job_id, f"{job.job_id}/g0", invalid=False)
        producer = Producer(kafka_bootstrap, client_id="test-history")
        await producer.start()
        events = [job_event(job.job_id, "accepted", "env_svc", tenant=job.tenant)]
        for step, reward in enumerate(REWARDS, start=1):
            metrics = {
                "mean_reward": reward,
                "staleness_max": float(step % 2),
                "loss": 0.1,
                "tokens": 640.0,
                "step_s": 2.0,
            }
            events.append(
                job_event(
                    job.job_id, "step", "trainer_svc", tenant=job.tenant, step=step, metrics=metrics
                )
            )
        events.append(
            job_event(
                job.job_id,
                "dropped_stale",
                "trainer_svc",
                tenant=job.tenant,
                reason="group g7: 3 versions behind",
            )
        )
        if status in ("completed", "cancelled", "failed"):
            events.append(job_event(job.job_id, status, "trainer_svc", tenant=job.tenant))  # type: ignore[arg-type]
        for event in events:
            await producer.send(event)
        await producer.send(events[1])  # a redelivered step event is counted once
        await producer.stop()

    with_store(redis_url, write)
    return job


def topic_messages(kafka_bootstrap: str, topic: Topic) -> list[Message]:
    async def read() -> list[Message]:
        consumer = AIOKafkaConsumer(
            topic.value,
            bootstrap_servers=kafka_bootstrap,
            auto_offset_reset="earliest",
            enable_auto_commit=False,
        )
        await consumer.start()
        try:
            batches = await consumer.getmany(timeout_ms=3000)
            return [decode(topic, r.value) for rs in batches.values() for r in rs]
        finally:
            await consumer.stop()

    return asyncio.run(read())


# --- submit ---------------------------------------------------------------------------


def test_submit_sends_each_example_and_prints_its_id(
    cli: CliRunner, kafka_bootstrap: str, redis_url: str
) -> None:
    files = sorted(EXAMPLES.glob("*.toml"))
    code, out, _ = invoke(cli, "submit", *map(str, files))
    assert code == 0
    job_ids = out.split()
    assert len(job_ids) == len(files)
    sent = {
        m.job_id: m for m in topic_messages(kafka_bootstrap, Topic.JOBS) if isinstance(m, JobSpec)
    }
    for job_id, path in zip(job_ids, files, strict=True):
        assert sent[job_id].env.name == path.stem

    async def owners(store: RedisStore) -> list[str | None]:
        return [(await store.jobs.claim_id(job_id, None)).owner for job_id in job_ids]

    # Bound to its tenant before it was sent, as the API binds: `status` finds it.
    assert with_store(redis_url, owners) == [sent[job_id].tenant for job_id in job_ids]


def test_a_job_sent_but_not_yet_admitted_shows_as_pending(cli: CliRunner, redis_url: str) -> None:
    """It showed as "unknown job" until env_svc registered it (none runs here)."""
    job_id = f"waiting-{new_id()[:8]}"
    with_store(redis_url, lambda r: r.jobs.claim_id(job_id, "acme"))  # what submit binds
    code, out, err = invoke(cli, "status", job_id, "--json")
    assert code == 0, err
    (row,) = json.loads(out)["jobs"]
    assert (row["job_id"], row["tenant"], row["state"]) == (job_id, "acme", "pending")


def test_one_bad_file_sends_nothing(cli: CliRunner, kafka_bootstrap: str, tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    job_id = f"never-sent-{new_id()[:8]}"
    good.write_text(f'job_id = "{job_id}"\n' + (EXAMPLES / "arithmetic.toml").read_text())
    bad = tmp_path / "bad.toml"
    bad.write_text(
        (EXAMPLES / "arithmetic.toml").read_text().replace("group_size = 8", "group_size = 1")
    )
    code, out, err = invoke(cli, "submit", str(good), str(bad))
    assert code == 1 and out == ""
    assert err.strip() == f"error: {bad}: rl.group_size: must be in [2, 256], got 1"
    assert job_id not in {
        m.job_id for m in topic_messages(kafka_bootstrap, Topic.JOBS) if isinstance(m, JobSpec)
    }


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file"),
        ("tenant = 'a'\n[env\n", "invalid TOML: "),
        (
            "tenant = 'a'\n[env]\nname = 'arithmetic'\n[rl]\ngroup_size = 1\n",
            "rl.group_size: must be in [2, 256], got 1",
        ),
    ],
)
def test_submit_errors_are_one_line(
    cli: CliRunner, tmp_path: Path, content: str | None, message: str
) -> None:
    path = tmp_path / "job.toml"
    if content is not None:
        path.write_text(content)
    code, out, err = invoke(cli, "submit", str(path))
    assert code == 1 and out == ""
    assert err.startswith(f"error: {path}: ") and message in err
    assert err.count("\n") == 1


def test_submit_refuses_an_existing_job_id(
    cli: CliRunner, kafka_bootstrap: str, redis_url: str, tmp_path: Path
) -> None:
    job = history(kafka_bootstrap, redis_url)
    path = tmp_path / "again.toml"
    path.write_text(f'job_id = "{job.job_id}"\n' + (EXAMPLES / "arithmetic.toml").read_text())
    code, _, err = invoke(cli, "submit", str(path))
    assert code == 1
    assert f"job '{job.job_id}' already exists (running)" in err


# --- status / logs --------------------------------------------------------------------


def test_status_json_has_the_numbers_of_the_events_and_redis(
    cli: CliRunner, kafka_bootstrap: str, redis_url: str
) -> None:
    job = history(kafka_bootstrap, redis_url)
    code, out, _ = invoke(cli, "status", job.job_id, "--json")
    assert code == 0
    (row,) = json.loads(out)["jobs"]
    assert row["job_id"] == job.job_id and row["tenant"] == "acme" and row["env"] == "arithmetic"
    assert row["state"] == "running"
    assert (row["step"], row["max_steps"]) == (3, 5)
    assert row["rewards"] == REWARDS
    assert (row["latest_reward"], row["best_reward"]) == (REWARDS[-1], max(REWARDS))
    assert (row["staleness"], row["max_staleness_seen"], row["dropped_groups"]) == (1, 1, 1)
    # issued 9 groups, 1 dropped, 3 steps of B=2 trained: 2 groups of G=4 still in flight
    assert row["in_flight_episodes"] == (9 - 1 - 3 * B) * G
    assert row["eta_s"] is not None and row["eta_s"] >= 0
    services = {s["service"]: s for s in json.loads(out)["services"]}
    assert set(services) == {"env_svc", "rollout_svc", "trainer_svc"}


def test_status_shows_each_rollout_replica_as_it_reported(
    cli: CliRunner, kafka_bootstrap: str, redis_url: str
) -> None:
    replica = f"status-{new_id()[:8]}"
    stats = {
        "busy_s": 40.0,
        "uptime_s": 50.0,
        "utilisation": 0.8,
        "recent_utilisation": 0.5,
        "compute_utilisation": 0.25,
        "recent_compute_utilisation": 0.125,
        "mean_batch": 6.5,
        "generated_tokens": 3000.0,
        "tokens_per_s": 72.5,
        "in_flight": 12.0,
    }
    with_store(
        redis_url,
        lambda r: r.replicas.put_stats(replica, RolloutReplicaStats.of(stats), ttl_s=60),
    )
    code, out, _ = invoke(cli, "status", "--json")
    assert code == 0
    (seen,) = [r for r in json.loads(out)["rollout_replicas"] if r["name"] == replica]
    assert seen == {
        "name": replica,
        "utilisation": 0.8,
        "recent_utilisation": 0.5,
        "compute_utilisation": 0.25,
        "recent_compute_utilisation": 0.125,
        "mean_batch": 6.5,
        "tokens_per_s": 72.5,
        "in_flight": 12,
    }
    code, out, _ = invoke(cli, "status", "--once")
    line = next(ln for ln in out.splitlines() if replica in ln)
    # computing now / since start, (a request in the engine now / since start), batch, tok/s
    assert "12% now / 25% (50% now / 80%)" in line and "6.5" in line and "72.5" in line


def test_status_shows_what_each_service_computes_in_and_on(cli: CliRunner, redis_url: str) -> None:
    replica = f"status-{new_id()[:8]}"
    cpu = CpuInfo("AMD EPYC 7B13", "avx2", "avx2", "", 1)
    precision = trainer_precision("auto", "cpu", Hardware(cpu))
    fields = runtime_fields(Hardware(cpu), precision)
    with_store(
        redis_url, lambda r: r.replicas.put_runtime("trainer_svc", replica, fields, ttl_s=60)
    )
    code, out, _ = invoke(cli, "status", "--json")
    assert code == 0
    (seen,) = [r for r in json.loads(out)["runtimes"] if r["replica"] == replica]
    assert seen["service"] == "trainer_svc" and seen["precision"] == "float32"
    assert seen["why"] == "auto: the AVX2 CPU has no native bf16"
    assert seen["machine_class"] == "cpu-avx2"
    code, out, _ = invoke(cli, "status", "--once")
    line = next(ln for ln in out.splitlines() if ln.lstrip("│ ").startswith("trainer_svc"))
    assert "float32 on AMD EPYC 7B13, 1 core, AVX2" in line


def test_status_table_shows_every_job_including_rejected_ones(
    cli: CliRunner, kafka_bootstrap: str, redis_url: str
) -> None:
    job = history(kafka_bootstrap, redis_url)
    rejected = f"cli-rejected-{new_id()[:6]}"

    async def reject() -> None:
        producer = Producer(kafka_bootstrap, client_id="test")
        await producer.start()
        reason = "rl.group_size: must be in [2, 256], got 1"
        await producer.send(
            job_event(rejected, "rejected", "env_svc", tenant="globex", reason=reason)
        )
        await producer.stop()

    asyncio.run(reject())
    code, out, _ = invoke(cli, "status", "--once")
    assert code == 0
    line = next(ln for ln in out.splitlines() if job.job_id[:10] in ln)
    assert "3/5" in line and "0.375" in line and "0.500" in line and "running" in line
    assert rejected[:10] in out and "rejected" in out


def test_logs_prints_each_event_once_with_its_metrics(
    cli: CliRunner, kafka_bootstrap: str, redis_url: str
) -> None:
    job = history(kafka_bootstrap, redis_url)
    code, out, _ = invoke(cli, "logs", job.job_id)
    assert code == 0
    lines = out.strip().splitlines()
    assert [ln.split()[3] for ln in lines] == ["accepted", "step", "step", "step", "dropped_stale"]
    steps = [ln for ln in lines if " step " in ln]
    assert [float(re.search(r"mean_reward=(\S+)", ln).group(1)) for ln in steps] == REWARDS  # type: ignore[union-attr]
    assert "group g7: 3 versions behind" in lines[-1]


def test_logs_follow_returns_once_the_job_has_ended(
    cli: CliRunner, kafka_bootstrap: str, redis_url: str
) -> None:
    job = history(kafka_bootstrap, redis_url, status="completed")
    code, out, _ = invoke(cli, "logs", job.job_id, "--follow")
    assert code == 0
    assert [ln.split()[3] for ln in out.strip().splitlines()][-2:] == ["dropped_stale", "completed"]


@pytest.mark.parametrize("command", ["status", "logs", "pause", "resume", "cancel", "export"])
def test_an_unknown_job_is_one_line_and_exit_1(cli: CliRunner, command: str) -> None:
    args = [command, "no-such-job"] + (["--out", "x"] if command == "export" else [])
    code, _, err = invoke(cli, *args)
    assert code == 1
    assert err == "error: unknown job 'no-such-job'\n"


# --- control --------------------------------------------------------------------------


def test_pause_sends_a_command_and_says_when_nobody_applies_it(
    cli: CliRunner, kafka_bootstrap: str, redis_url: str
) -> None:
    job = history(kafka_bootstrap, redis_url)
    code, _, err = invoke(cli, "pause", job.job_id, "--timeout", "1")
    assert code == 1
    assert "pause of job" in err and "not applied within 1s (is env_svc running?)" in err
    commands = [
        m
        for m in topic_messages(kafka_bootstrap, Topic.JOBS)
        if isinstance(m, JobCommand) and m.job_id == job.job_id
    ]
    assert [c.action for c in commands] == ["pause"]


def test_a_finished_job_cannot_be_paused(
    cli: CliRunner, kafka_bootstrap: str, redis_url: str
) -> None:
    job = history(kafka_bootstrap, redis_url, status="completed")
    code, _, err = invoke(cli, "pause", job.job_id)
    assert code == 1
    assert err == f"error: job '{job.job_id}' is already completed; nothing to pause\n"


# --- unreachable servers --------------------------------------------------------------


def test_unreachable_kafka_names_its_address(
    cli: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    address = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("MARLAAS_KAFKA_BOOTSTRAP", address)
    code, _, err = invoke(cli, "submit", str(EXAMPLES / "arithmetic.toml"))
    assert code == 1
    assert err.startswith(f"error: Kafka at {address} unreachable after 2s")
    assert err.count("\n") == 1


def test_unreachable_redis_names_its_address(
    cli: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    monkeypatch.setenv("MARLAAS_REDIS_URL", url)
    code, _, err = invoke(cli, "status")
    assert code == 1
    assert err.startswith(f"error: Redis at {url} unreachable after 2s")
    assert err.count("\n") == 1


# --- report ---------------------------------------------------------------------------


class _Charts(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.series: dict[tuple[str, str], list[list[float]]] = {}
        self._chart = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "svg" and found.get("data-chart"):
            self._chart = found["data-chart"] or ""
        if "data-series" in found and "data-values" in found:
            self.series[(self._chart, found["data-series"] or "")] = json.loads(
                found["data-values"] or "[]"
            )


def test_report_plots_the_rewards_of_the_events(
    cli: CliRunner, kafka_bootstrap: str, redis_url: str, tmp_path: Path
) -> None:
    job = history(kafka_bootstrap, redis_url)

    async def rollout_stats(registry: RedisStore) -> None:
        for second in (5.0, 10.0):
            stats = {
                "busy_s": second / 2,
                "uptime_s": second,
                "utilisation": 0.5,
                "generated_tokens": 100 * second,
                "in_flight": 3.0,
            }
            await registry.replicas.put_stats(
                f"cli-test-{job.job_id}", RolloutReplicaStats.of(stats), ttl_s=60
            )

    with_store(redis_url, rollout_stats)
    code, out, _ = invoke(cli, "report", job.job_id, "--out", str(tmp_path / "report"))
    assert code == 0 and "index.html" in out
    html = (tmp_path / "report" / "index.html").read_text()
    charts = _Charts()
    charts.feed(html)
    assert [y for _, y in charts.series[("reward", job.job_id)]] == REWARDS
    assert [x for x, _ in charts.series[("reward", job.job_id)]] == [1, 2, 3]
    # Every replica numbered, none by its own name (a host name, for a tenant's eyes).
    replicas = [name for chart, name in charts.series if chart == "utilisation"]
    replicas.remove("trainer")  # its step seconds per second, from the events
    assert replicas and all(name.startswith("replica ") for name in replicas), replicas
    assert f"cli-test-{job.job_id}" not in html
    assert (tmp_path / "report" / "steps.csv").read_text().count(job.job_id) == len(REWARDS)


# --- track ----------------------------------------------------------------------------


def test_track_writes_each_job_to_every_sink_once(
    cli: CliRunner,
    kafka_bootstrap: str,
    redis_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    job = history(kafka_bootstrap, redis_url, status="completed")
    out = tmp_path / "track"
    code, said, _ = invoke(cli, "track", job.job_id, "--out", str(out))
    assert code == 0 and "track: 8 new events" in said, said  # 3 steps + the end, 2 sinks
    log_dir = out / "tensorboard" / job.job_id
    assert tensorboard_scalars(log_dir, "train/mean_reward") == list(enumerate(REWARDS, 1))
    assert tensorboard_hparams(log_dir)["rl.group_size"] == G
    run, metrics = mlflow_run(f"sqlite:///{(out / 'mlflow.db').resolve()}", job.job_id)
    assert metrics["train/mean_reward"] == list(enumerate(REWARDS, 1))
    assert run.info.status == "FINISHED" and run.data.tags["marlaas.tenant"] == job.tenant
    # W&B (offline: files, nothing sent) and trackio too, per deployment: theirs is new.
    monkeypatch.setenv("MARLAAS_TRACK_TO", "wandb,trackio")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    for variable in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(variable, str(tmp_path / "wandb-home"))
    code, said, _ = invoke(cli, "track", job.job_id, "--out", str(out))
    assert code == 0 and "track: 8 new events" in said, said
    assert f"wandb sync {out / 'wandb'}" in said, said
    wandb = wandb_offline_run(out, job.job_id)
    assert wandb.points("train/mean_reward") == list(enumerate(REWARDS, 1))
    assert wandb.summary["state"] == "completed" and wandb.tags[0] == job.tenant
    _, trackio_metrics = trackio_run(out / "trackio", job.job_id)
    assert trackio_metrics["train/mean_reward"] == list(enumerate(REWARDS, 1))
    # Again, to all four, and following: nothing new, and it returns as the job has ended.
    every_sink = "tensorboard,mlflow,wandb,trackio"
    code, said, _ = invoke(
        cli, "track", job.job_id, "--out", str(out), "--follow", "--to", every_sink
    )
    assert code == 0 and "track: 0 new events" in said, said


def test_track_of_an_unknown_job_writes_nothing(cli: CliRunner, tmp_path: Path) -> None:
    code, _, err = invoke(cli, "track", "no-such-job", "--out", str(tmp_path / "track"))
    assert code == 1 and "no-such-job" in err
    assert not (tmp_path / "track" / "track.json").exists()
