"""A job produced as JSON by a plain Kafka client, exactly as the README shows it, runs to
completion; one with a misspelt field is rejected with the field's path.

The producing process runs nothing of MARLaaS: only aiokafka, the README's bytes and key.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from common.wire.codec import decode
from common.wire.messages import JobSpec, Topic, new_id
from console.stack.local import LocalStack
from marlaas.jobwatch import JobProgress, watch_jobs
from tests.conftest import RunningServices
from tests.wire_samples import readme_json_job

pytestmark = pytest.mark.kafka

PLAIN_PRODUCER = """
import asyncio, sys
from aiokafka import AIOKafkaProducer

async def main(bootstrap, topic, key, value, signature):
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        await producer.send_and_wait(
            topic, value.encode(), key=key.encode(),
            headers=[("marlaas-sig", signature.encode())],
        )
    finally:
        await producer.stop()

asyncio.run(main(*sys.argv[1:]))
"""


def produce_plainly(bootstrap: str, key: str, value: str, signature: str) -> None:
    """Produce from a process that imports nothing of MARLaaS (and refuses to)."""
    guard = "import sys; sys.modules.update(common=None, console=None, env_svc=None)\n"
    subprocess.run(
        [
            sys.executable,
            "-c",
            guard + PLAIN_PRODUCER,
            bootstrap,
            Topic.JOBS.value,
            key,
            value,
            signature,
        ],
        check=True,
        timeout=120,
        cwd="/",
    )


def signed_by_the_readme(sign_line: str, value: str, bus_key: str) -> str:
    """The signature the README's shell line makes (printf | openssl), run as written."""
    done = subprocess.run(
        ["bash", "-c", f'{sign_line}\nprintf %s "$sig"'],
        env={"PATH": os.environ["PATH"], "value": value, "MARLAAS_BUS_KEY": bus_key},
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    return done.stdout


async def test_a_json_job_from_a_plain_kafka_client_runs_to_completion(
    pipeline_services: RunningServices, local_stack: LocalStack
) -> None:
    value, key, sign_line = readme_json_job()
    bus_key = pipeline_services.settings.bus_key.get_secret_value()
    signing = pipeline_services.settings.signer
    assert signing is not None  # the services drop unsigned records
    spec = decode(Topic.JOBS, value.encode())
    assert isinstance(spec, JobSpec) and spec.job_id == key and not spec.base_model
    typo = json.loads(value) | {"job_id": f"acme-typo-{new_id()[:6]}"}
    typo["rl"]["max_step"] = typo["rl"].pop("max_steps")
    signature = signed_by_the_readme(sign_line, value, bus_key)
    assert signature.encode() == signing.signature(Topic.JOBS, key.encode(), value.encode())
    produce_plainly(local_stack.kafka_bootstrap, key, value, signature)
    typo_value = json.dumps(typo)
    typo_signature = signing.signature(Topic.JOBS, typo["job_id"].encode(), typo_value.encode())
    produce_plainly(
        local_stack.kafka_bootstrap, typo["job_id"], typo_value, typo_signature.decode()
    )

    misspelt = JobSpec(job_id=typo["job_id"], tenant="acme", env=spec.env)
    progress = {s.job_id: JobProgress.of(s) for s in (spec, misspelt)}
    await watch_jobs(local_stack.kafka_bootstrap, progress, timeout_s=600)
    assert progress[key].status == "completed", progress[key]
    assert progress[key].steps == spec.rl.max_steps
    assert progress[misspelt.job_id].status == "rejected"
    assert "rl.max_step: unknown field" in progress[misspelt.job_id].reason
