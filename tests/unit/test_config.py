"""common.runtime.config: prefixes per service, the stack's connection file, env vars winning."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from common.runtime.config import (
    EnvServiceSettings,
    KafkaAuthSettings,
    RolloutSettings,
    SettingsError,
    SharedSettings,
    TrainerSettings,
    default_cache_dir,
    load,
    stack_env_file,
)


@pytest.fixture
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in ("MARLAAS_KAFKA_BOOTSTRAP", "MARLAAS_REDIS_URL", "MARLAAS_ARTIFACT_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MARLAAS_STATE_DIR", str(tmp_path))
    return tmp_path


def test_defaults_point_at_loopback_and_state_dir(state_dir: Path) -> None:
    settings = load(SharedSettings)
    assert settings.kafka_bootstrap == "127.0.0.1:9092"
    assert settings.state_dir == state_dir
    assert settings.artifacts == state_dir / "artifacts"
    assert settings.topic_partitions == 12
    # /metrics and /healthz answer whoever reaches them: loopback, naming no tenant.
    assert settings.metrics_host == "127.0.0.1" and not settings.metrics_tenant_labels


def test_stack_env_file_is_the_fallback_and_env_vars_win(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stack_env_file(state_dir).write_text(
        "MARLAAS_KAFKA_BOOTSTRAP=127.0.0.1:40001\nMARLAAS_REDIS_URL=redis://127.0.0.1:40002/0\n"
    )
    settings = load(SharedSettings)
    assert settings.kafka_bootstrap == "127.0.0.1:40001"
    assert settings.redis_url == "redis://127.0.0.1:40002/0"
    monkeypatch.setenv("MARLAAS_KAFKA_BOOTSTRAP", "kafka:9092")
    assert load(SharedSettings).kafka_bootstrap == "kafka:9092"


def test_each_service_reads_its_own_prefix(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROLLOUT_MAX_IN_FLIGHT", "32")
    monkeypatch.setenv("TRAINER_MAX_IN_FLIGHT", "99")  # another service's prefix: ignored
    monkeypatch.setenv("TRAINER_CONSUMER_GROUP", "trainers-b")
    assert load(RolloutSettings).max_in_flight == 32
    assert load(TrainerSettings).consumer_group == "trainers-b"


def test_cache_dir_follows_marlaas_cache(state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MARLAAS_CACHE", "/tmp/elsewhere")
    assert default_cache_dir() == Path("/tmp/elsewhere")
    assert load(SharedSettings).cache_dir == Path("/tmp/elsewhere")


def test_invalid_values_are_refused_with_the_field_name(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MARLAAS_TOPIC_PARTITIONS", "0")
    with pytest.raises(SettingsError, match=r"^MARLAAS_TOPIC_PARTITIONS='0': must be greater"):
        load(SharedSettings)


def test_a_refused_setting_never_quotes_a_secret(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SASL without a username is refused by a check across variables, whose input is every
    variable given, the password among them: the line is the check's message alone."""
    password = "kafka-password-0f1e2d3c"
    monkeypatch.setenv("MARLAAS_KAFKA_SECURITY_PROTOCOL", "SASL_PLAINTEXT")
    monkeypatch.setenv("MARLAAS_KAFKA_PASSWORD", password)
    monkeypatch.delenv("MARLAAS_KAFKA_USERNAME", raising=False)
    with pytest.raises(SettingsError) as refused:
        load(KafkaAuthSettings)
    assert str(refused.value) == (
        "MARLAAS_KAFKA_SECURITY_PROTOCOL=SASL_PLAINTEXT needs MARLAAS_KAFKA_USERNAME and "
        "MARLAAS_KAFKA_PASSWORD"
    )

    class Keyed(BaseSettings):
        model_config = SettingsConfigDict(env_prefix="TEST_")
        key: SecretStr = Field(min_length=32)

    monkeypatch.setenv("TEST_KEY", "a-short-secret")
    with pytest.raises(SettingsError) as refused:
        load(Keyed)
    assert str(refused.value).startswith("TEST_KEY: ") and "a-short-secret" not in str(
        refused.value
    )


def test_each_service_has_its_own_metrics_port(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert [
        load(EnvServiceSettings).metrics_port,
        load(RolloutSettings).metrics_port,
        load(TrainerSettings).metrics_port,
    ] == [9101, 9102, 9103]
    monkeypatch.setenv("ROLLOUT_METRICS_PORT", "0")  # 0: a free port, chosen at start
    assert load(RolloutSettings).metrics_port == 0
    assert load(TrainerSettings).metrics_port == 9103
    monkeypatch.setenv("TRAINER_METRICS_PORT", "70000")
    with pytest.raises(SettingsError, match=r"^TRAINER_METRICS_PORT='70000': must be less"):
        load(TrainerSettings)


def test_log_format_is_text_or_json(state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert load(SharedSettings).log_format == "text"
    monkeypatch.setenv("MARLAAS_LOG_FORMAT", "json")
    assert load(SharedSettings).log_format == "json"
    monkeypatch.setenv("MARLAAS_LOG_FORMAT", "xml")
    with pytest.raises(SettingsError, match=r"^MARLAAS_LOG_FORMAT='xml': must be 'text' or 'json'"):
        load(SharedSettings)
