"""No secret reaches a log: `marlaas up` runs with every secret known beforehand (the bus key,
each Redis user's password, a Kafka SASL password), a tenant works through the tenant API with
its key (a job trained, its events, an export, a sample through the rollout chat endpoint, a
wrong key), a service and the CLI are refused at start for SASL without a username, and then
every log file of the run, and what `marlaas up` and the CLI printed, is searched for each
secret, and for its obvious encodings."""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr

from common.files.models import tiny_model
from common.runtime.config import SharedSettings
from common.security.access import new_passwords
from common.state.tenants import parse_api_key
from common.wire.chat import CHAT
from tests.leaks import encodings, leaks

pytestmark = pytest.mark.kafka

MARLAAS = str(Path(sys.executable).parent / "marlaas")

JOB = {
    "env": {"name": "arithmetic", "seed": 3},
    "rl": {
        "group_size": 2,
        "groups_per_step": 1,
        "max_steps": 1,
        "max_context_tokens": 128,
        "sampling": {"max_new_tokens": 8},
    },
}


def test_leaks_finds_a_secret_in_each_encoding() -> None:
    secret = "s3cr3t/with+odd=chars"
    for form in encodings(secret):
        assert leaks({"log": f"... {form} ..."}, {"the key": secret}) == ["the key in log"]
    assert leaks({"log": "nothing here"}, {"the key": secret}) == []


def cli_env(state_dir: Path, **extra: str) -> dict[str, str]:
    """This environment pointed at the stack of `state_dir` (its stack.env), plus `extra`."""
    other_stack = ("MARLAAS_KAFKA_", "MARLAAS_REDIS_URL", "MARLAAS_BUS_KEY", "MARLAAS_API_")
    ours = {k: v for k, v in os.environ.items() if not k.startswith(other_stack)}
    return ours | {"MARLAAS_STATE_DIR": str(state_dir), "MARLAAS_CONNECT_TIMEOUT_S": "30", **extra}


def marlaas(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [MARLAAS, *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )


@pytest.fixture
def known_secrets(tmp_path: Path) -> dict[str, str]:
    """The stack's secrets, written where `marlaas up` finds them (a state dir's bus key and
    Redis passwords), and a Kafka password in the environment (PLAINTEXT: read, unused)."""
    bus_key = base64.urlsafe_b64encode(os.urandom(32)).decode()
    passwords = new_passwords()
    for path, text in (
        (tmp_path / "bus-key", bus_key + "\n"),
        (tmp_path / "redis-passwords.json", json.dumps(passwords)),
    ):
        path.write_text(text)
        path.chmod(0o600)
    bus = SharedSettings(bus_key=SecretStr(bus_key))
    return {
        "the bus key": bus_key,
        "the chat endpoint's token": bus.internal_token(CHAT) or "",
        "the Kafka password": f"kafka-{os.urandom(12).hex()}",
        **{f"the Redis password of {user}": password for user, password in passwords.items()},
    }


@pytest.fixture
def stack(
    tmp_path: Path, known_secrets: dict[str, str]
) -> Iterator[tuple[subprocess.Popen[bytes], dict[str, str], str]]:
    """`marlaas up` on the tiny model, every process logging at DEBUG (its own output in
    `up.out`); its environment (for the CLI) and the tenant API's URL."""
    env = cli_env(
        tmp_path,
        MARLAAS_BASE_MODEL=str(tiny_model()),
        MARLAAS_KAFKA_PASSWORD=known_secrets["the Kafka password"],
        MARLAAS_LOG_LEVEL="DEBUG",
        ROLLOUT_KV_CACHE_GIB="0.5",
        ROLLOUT_MAX_MODEL_LEN="512",
    )
    with (tmp_path / "up.out").open("w") as out:
        up = subprocess.Popen([MARLAAS, "up"], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        env_file = tmp_path / "stack.env"
        while "# tenant API: " not in (env_file.read_text() if env_file.exists() else ""):
            assert up.poll() is None and time.monotonic() < deadline, "marlaas up did not start"
            time.sleep(0.5)
        api_url = env_file.read_text().split("# tenant API: ", 1)[1].split()[0]
        yield up, env, api_url
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            up.wait(timeout=120)


def test_no_log_of_a_run_holds_a_secret(
    stack: tuple[subprocess.Popen[bytes], dict[str, str], str],
    known_secrets: dict[str, str],
    tmp_path: Path,
) -> None:
    up, env, api_url = stack
    added = marlaas(env, "tenants", "add", "hushed")  # prints the key once: its purpose
    assert added.returncode == 0, added.stderr
    key = added.stdout.split("API key (shown once; give it to the tenant): ")[1].split()[0]
    parsed = parse_api_key(key)
    assert parsed is not None, key
    secrets = {**known_secrets, "the tenant's API key": key, "its secret": parsed.secret}

    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=api_url, headers=headers, timeout=60) as api:
        deadline = time.monotonic() + 60
        while True:  # the API process may still be starting
            try:
                api.get("/v1/jobs").raise_for_status()
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the tenant API never answered"
                time.sleep(1)
        submitted = api.post("/v1/jobs", json={**JOB, "base_model": str(tiny_model())})
        assert submitted.status_code == 202, submitted.text
        job_id = submitted.json()["job_id"]
        deadline = time.monotonic() + 600
        while (status := api.get(f"/v1/jobs/{job_id}").json()["status"]) != "completed":
            assert status not in ("failed", "rejected", "cancelled"), status
            assert time.monotonic() < deadline, f"job {job_id} still {status}"
            time.sleep(2)
        assert api.get(f"/v1/jobs/{job_id}/events").status_code == 200
        assert api.get(f"/v1/jobs/{job_id}/export").status_code == 200
        sampled = api.post(f"/v1/jobs/{job_id}/sample", json={"prompt": "1 + 1?", "max_tokens": 4})
        assert sampled.status_code == 200, sampled.text
        wrong = {"Authorization": f"Bearer {key[:-4]}xxxx"}
        assert api.get("/v1/jobs", headers=wrong).status_code == 401

    # SASL with a password and no username: refused at start, in one line naming the variables.
    sasl = env | {
        "MARLAAS_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
        "MARLAAS_KAFKA_PASSWORD": secrets["the Kafka password"],
        "ENV_SVC_METRICS_PORT": "0",
    }
    with (tmp_path / "logs" / "env_svc-sasl.log").open("w") as log:
        refused = subprocess.run(
            [sys.executable, "-m", "env_svc"], env=sasl, stdout=log, stderr=subprocess.STDOUT,
            timeout=300, check=False,
        )  # fmt: skip
    assert refused.returncode == 2
    status = marlaas(sasl, "status", "--once")
    assert status.returncode != 0 and "MARLAAS_KAFKA_USERNAME" in status.stderr, status.stderr
    up.send_signal(signal.SIGINT)  # what the services log as they stop counts too
    assert up.wait(timeout=120) == 0

    texts = {"marlaas status (SASL)": status.stdout + status.stderr}
    logs = [tmp_path / "up.out", *(tmp_path / "logs").rglob("*")]
    texts |= {
        str(p.relative_to(tmp_path)): p.read_text(errors="replace") for p in logs if p.is_file()
    }
    assert "MARLAAS_KAFKA_USERNAME" in texts[str(Path("logs") / "env_svc-sasl.log")]
    for service in ("env_svc", "rollout_svc", "trainer_svc", "api"):
        assert re.search(r"\S", texts[str(Path("logs") / f"{service}.log")]), service
    leaked = leaks(texts, secrets)  # names, never values: a test's output is a log too
    assert not leaked, leaked
