"""`marlaas up` and friends as a user runs them: real processes, real signals."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.files.models import tiny_model
from common.runtime.config import stack_env_file
from common.state.store import RedisStore
from common.wire.messages import Topic
from console.stack.children import free_port
from console.stack.local import LocalStack
from console.stack.topics import ensure_topics
from tests.processes import alive, children_of, cmdline, descendants_of

pytestmark = pytest.mark.kafka

MARLAAS = str(Path(sys.executable).parent / "marlaas")


def cli_env(state_dir: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("MARLAAS_KAFKA_BOOTSTRAP", "MARLAAS_REDIS_URL")
    }
    env.update({"MARLAAS_STATE_DIR": str(state_dir), "MARLAAS_CONNECT_TIMEOUT_S": "30", **extra})
    return env


def read_env_file(path: Path) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
    return {key: value for key, value in pairs}


@pytest.fixture
def marlaas_up(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    tmp_path.chmod(0o755)  # an operator's directory, as mkdir under a usual umask makes it
    process = subprocess.Popen(
        [MARLAAS, "up", "--infra-only"],
        env=cli_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    env_file = tmp_path / "stack.env"
    deadline = time.monotonic() + 60
    while not env_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"marlaas up did not come up:\n{process.communicate()[0]}")
        time.sleep(0.2)
    yield process, env_file
    if process.poll() is None:
        process.kill()
        process.wait()


def test_up_starts_broker_and_redis_and_ctrl_c_leaves_nothing_behind(
    marlaas_up: tuple[subprocess.Popen[str], Path], tmp_path: Path
) -> None:
    process, env_file = marlaas_up
    settings = read_env_file(env_file)
    children = children_of(process.pid)
    assert len(children) == 2  # tansu + valkey

    async def check() -> dict[str, int]:
        registry = await RedisStore.connect(settings["MARLAAS_REDIS_URL"], timeout_s=10)
        await registry.adapters.publish("probe", 1, "file:///probe", 1)
        await registry.close()
        return await ensure_topics(settings["MARLAAS_KAFKA_BOOTSTRAP"], 12)

    assert asyncio.run(check()) == {topic.value: 12 for topic in Topic}
    assert (tmp_path / "valkey").is_dir()  # Redis data lives under the state dir
    assert stat.S_IMODE(tmp_path.stat().st_mode) == 0o700  # secrets, logs: the operator's
    # What the stack and its children write is theirs alone (umask 077), not only the top.
    shared = {
        str(path.relative_to(tmp_path)): oct(stat.S_IMODE(path.stat().st_mode))
        for path in tmp_path.rglob("*")
        if not path.is_symlink() and path.stat().st_mode & 0o077
    }
    assert shared == {}

    second = subprocess.run(
        [MARLAAS, "up", "--infra-only"],
        env=cli_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert second.returncode == 1
    assert "already runs" in second.stderr and "Traceback" not in second.stdout + second.stderr

    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=30)
    assert process.returncode == 0, output
    assert "Stack stopped" in output
    assert not [pid for pid in children if alive(pid)]
    assert not env_file.exists()


def test_up_uses_existing_servers_and_starts_nothing(
    local_stack: LocalStack, tmp_path: Path
) -> None:
    env = cli_env(
        tmp_path,
        MARLAAS_KAFKA_BOOTSTRAP=local_stack.kafka_bootstrap,
        MARLAAS_REDIS_URL=local_stack.redis_url,
    )
    process = subprocess.Popen(
        [MARLAAS, "up", "--infra-only"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        env_file = tmp_path / "stack.env"
        deadline = time.monotonic() + 60
        while not env_file.exists() and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.2)
        settings = read_env_file(env_file)
        assert settings["MARLAAS_KAFKA_BOOTSTRAP"] == local_stack.kafka_bootstrap
        assert settings["MARLAAS_REDIS_URL"] == local_stack.redis_url
        assert children_of(process.pid) == []
    finally:
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=30)
    assert process.returncode == 0, output


def test_cli_reports_an_unreachable_broker_in_one_line(tmp_path: Path) -> None:
    address = f"127.0.0.1:{free_port()}"
    result = subprocess.run(
        [MARLAAS, "topics", "create"],
        env=cli_env(tmp_path, MARLAAS_KAFKA_BOOTSTRAP=address, MARLAAS_CONNECT_TIMEOUT_S="1"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert result.stderr.startswith(f"error: Kafka at {address} unreachable")
    assert "Traceback" not in result.stdout + result.stderr


def test_topics_create_against_a_running_broker(local_stack: LocalStack, tmp_path: Path) -> None:
    result = subprocess.run(
        [MARLAAS, "topics", "create"],
        env=cli_env(tmp_path, MARLAAS_KAFKA_BOOTSTRAP=local_stack.kafka_bootstrap),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "marlaas.trajectories: 12 partitions" in result.stdout


def test_up_restarts_a_killed_service_and_ctrl_c_leaves_no_process_behind(
    tmp_path: Path,
) -> None:
    """A kill -9'd service comes back (counted for `status`); then services, and the vLLM
    engine process under rollout_svc, all go with Ctrl-C."""
    env = cli_env(tmp_path, MARLAAS_BASE_MODEL=str(tiny_model()), ROLLOUT_KV_CACHE_GIB="0.5")
    process = subprocess.Popen(
        [MARLAAS, "up"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        rollout_log = tmp_path / "logs" / "rollout_svc.log"
        deadline = time.monotonic() + 180
        while "partitions assigned" not in (
            rollout_log.read_text() if rollout_log.exists() else ""
        ):
            assert process.poll() is None and time.monotonic() < deadline, "rollout never ready"
            time.sleep(0.5)
        tree = descendants_of(process.pid)
        names = {Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ") for pid in tree}
        assert (
            sum(
                b"-m env_svc" in n or b"-m rollout_svc" in n or b"-m trainer_svc" in n
                for n in names
            )
            == 3
        )
        assert len(tree) > 5  # tansu, valkey, 3 services, and vLLM's engine process(es)

        (trainer,) = [pid for pid in children_of(process.pid) if b"-m trainer_svc" in cmdline(pid)]
        os.kill(trainer, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not [p for p in children_of(process.pid) if b"-m trainer_svc" in cmdline(p)]:
            assert process.poll() is None and time.monotonic() < deadline, "not restarted"
            time.sleep(0.2)
        lines = stack_env_file(tmp_path).read_text().splitlines()
        redis_url = dict(line.split("=", 1) for line in lines if not line.startswith("#"))[
            "MARLAAS_REDIS_URL"
        ]

        async def restarts() -> dict[str, int]:
            store = await RedisStore.connect(redis_url, timeout_s=10)
            try:
                return await store.replicas.restarts()
            finally:
                await store.close()

        assert asyncio.run(restarts()) == {"trainer_svc": 1}
        tree = descendants_of(process.pid)
    finally:
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, output
    assert not [pid for pid in tree if alive(pid)]
    # The table names the machine and what each model-running service computes in.
    assert "hardware" in output and "cores" in output
    assert "rollout_svc precision" in output and "trainer_svc precision" in output


def test_up_refuses_a_bad_dtype_in_one_line_before_starting_anything(tmp_path: Path) -> None:
    result = subprocess.run(
        [MARLAAS, "up"],
        env=cli_env(tmp_path, ROLLOUT_DTYPE="half"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "error: ROLLOUT_DTYPE='half': must be 'auto', 'float32', 'bfloat16' or 'float16'"
    )
    assert not (tmp_path / "logs").exists()


def test_the_durable_broker_keeps_topics_messages_and_offsets_through_kill_9_and_restart(
    tmp_path: Path,
) -> None:
    """Tansu on the local S3 server (`MARLAAS_BROKER_STORAGE=s3`): a kill -9'd broker is
    restarted by the stack with its data, and a new stack on the same state dir finds it all
    again."""
    from aiokafka import AIOKafkaConsumer

    from common.bus.kafka import Producer
    from common.runtime.config import SharedSettings
    from common.wire.messages import Event, new_id
    from marlaas.eventfeed import EventFeed

    settings = SharedSettings(state_dir=tmp_path, connect_timeout_s=60, broker_storage="s3")
    job_id, group = f"durable-{new_id()[:8]}", f"durable-{new_id()[:8]}"

    async def produce(bootstrap: str, steps: range) -> None:
        producer = Producer(bootstrap, client_id="durable-test")
        await producer.start(timeout_s=30)
        for step in steps:
            await producer.send(
                Event(event_id=new_id(), job_id=job_id, event="step", service="t", step=step)
            )
        await producer.stop()

    async def consume_and_commit(bootstrap: str, count: int) -> list[int]:
        consumer = AIOKafkaConsumer(
            Topic.EVENTS.value,
            bootstrap_servers=bootstrap,
            group_id=group,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
        )
        await consumer.start()
        steps: list[int] = []
        try:
            deadline = time.monotonic() + 60
            while len(steps) < count and time.monotonic() < deadline:
                for records in (await consumer.getmany(timeout_ms=500)).values():
                    for record in records:
                        steps.append(record.offset)
                await consumer.commit()
        finally:
            await consumer.stop()
        return steps

    async def steps_of_job(bootstrap: str) -> list[int]:
        async with EventFeed(bootstrap, {job_id}) as feed:
            return sorted(e.step for e in await feed.read_to_end(timeout_s=60))

    async def first_life() -> None:
        async with LocalStack(settings, use_existing_from_env=False) as stack:
            await produce(stack.kafka_bootstrap, range(3))
            assert len(await consume_and_commit(stack.kafka_bootstrap, 3)) >= 3
            (broker,) = [c for c in stack.children if c.name == "tansu"]
            broker.process.kill()  # kill -9: the supervisor brings it back with its data
            deadline = time.monotonic() + 60
            while stack.supervisor.restarts.get("tansu", 0) < 1:
                assert time.monotonic() < deadline, "broker not restarted"
                await asyncio.sleep(0.2)
            # One record a batch: Tansu's s3 engine reports such a partition's end late, and
            # a reader must not stop there.
            await produce(stack.kafka_bootstrap, range(3, 25))
            assert await steps_of_job(stack.kafka_bootstrap) == list(range(25))

    async def second_life() -> None:
        async with LocalStack(settings, use_existing_from_env=False) as stack:
            assert await steps_of_job(stack.kafka_bootstrap) == list(range(25))
            # The group resumes after what it committed in the first life: 22 new records.
            assert len(await consume_and_commit(stack.kafka_bootstrap, 22)) == 22

    asyncio.run(first_life())
    asyncio.run(second_life())
