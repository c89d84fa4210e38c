"""Fixtures shared by every test directory."""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest
from pydantic import SecretStr

from common.runtime.config import SharedSettings
from common.state.store import RedisStore
from console.stack.children import ChildServer
from console.stack.local import LocalStack
from tests.agentic import operator_registrations
from tests.readme_env import install_readme_environment

EXAMPLE_DATA = Path(__file__).parents[1] / "examples" / "data"


@pytest.fixture(scope="session", autouse=True)
def example_data_dir() -> Iterator[Path]:
    """The data directory the README's example uses (examples/data: tenant acme's folder
    holds the dataset example's file), for the tests that load every example job."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MARLAAS_DATA_DIR", str(EXAMPLE_DATA))
        yield EXAMPLE_DATA


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a safetensors directory, converted from the packaged GGUF.

    Deliberately the real default cache (`$MARLAAS_CACHE` or `~/.cache/marlaas`), not a tmp
    dir: the conversion takes ~30-60 s, so repeated local runs and CI (which caches that dir)
    convert once per machine instead of once per test session.
    """
    from common.files.models import resolve_base_model

    return resolve_base_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def local_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """A real Tansu broker and Valkey server on free loopback ports, for the whole session.

    Started through the same `LocalStack` as `marlaas up`, so Valkey has its ACL users
    (`redis_url` is the operator's, `local_stack.redis_url_for(principal)` another's); when
    MARLAAS_KAFKA_BOOTSTRAP / MARLAAS_REDIS_URL are set, the tests run against those servers
    instead.
    """
    settings = SharedSettings(state_dir=tmp_path_factory.mktemp("stack"), connect_timeout_s=60)
    stack = LocalStack(settings)
    asyncio.run(stack.start())
    yield stack
    stack.stop()


@pytest.fixture
def kafka_bootstrap(local_stack: LocalStack) -> str:
    return local_stack.kafka_bootstrap


@pytest.fixture
def redis_url(local_stack: LocalStack) -> str:
    return local_stack.redis_url


T = TypeVar("T")


def with_store(redis_url: str, work: Callable[[RedisStore], Awaitable[T]]) -> T:
    """Run `work` against a fresh registry connection, from a synchronous test."""

    async def run() -> T:
        registry = await RedisStore.connect(redis_url, timeout_s=10)
        try:
            return await work(registry)
        finally:
            await registry.close()

    return asyncio.run(run())


@dataclass
class RunningServices:
    settings: SharedSettings
    children: list[ChildServer]
    environments_site: Path
    """Where the README's example environment is installed (on the services' Python path)."""


@pytest.fixture(scope="session")
def pipeline_services(
    local_stack: LocalStack, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServices]:
    """env_svc, rollout_svc (vLLM CPU) and trainer_svc as processes on the tiny model.

    Session-scoped: starting vLLM takes tens of seconds, and jobs of different tests are
    independent (unique job ids), as tenants' jobs are in production.
    """
    from common.files.models import tiny_model
    from common.wire.lifecycle import SERVICES
    from console.stack.children import free_port
    from console.stack.services import start_services, stop_services

    state_dir = tmp_path_factory.mktemp("services")
    chat_port = free_port()  # the first rollout replica serves chat, as `marlaas up` has it
    # Signing on, as `marlaas up` runs them: a test that produces to their topics itself
    # signs with `settings.signer`, and a record without the key is dead-lettered.
    settings = SharedSettings(
        state_dir=state_dir,
        artifact_dir=state_dir / "artifacts",
        base_model=str(tiny_model()),
        bus_key=SecretStr(f"test-bus-key-{secrets.token_hex(8)}"),
        chat_url=f"http://127.0.0.1:{chat_port}/v1",
    )
    os.environ.update(ROLLOUT_KV_CACHE_GIB="0.5", ROLLOUT_MAX_MODEL_LEN="512")
    # The README's third-party environment, pip-installed where env_svc finds it, as a user
    # installs theirs (tests/integration/test_cli_services.py runs a job of it).
    site = install_readme_environment(tmp_path_factory.mktemp("readme-env"))
    paths = [os.environ.get("PYTHONPATH", ""), str(site)]
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    # Each as its own Redis user, as `marlaas up` starts them (common/security/access.py).
    redis_urls: dict[str, str] = {s: local_stack.redis_url_for(s) for s in SERVICES}
    # The operator registered the example MCP server and agentic environments (tests/agentic.py),
    # and asked for per-job series on /metrics (tests/integration/test_pipeline.py reads them).
    children = start_services(
        SERVICES,
        settings,
        local_stack.kafka_bootstrap,
        redis_urls,
        environ=operator_registrations() | {"MARLAAS_METRICS_TENANT_LABELS": "1"},
        chat_port=chat_port,
    )
    yield RunningServices(settings, children, site)
    stop_services(children)
    for child in children:
        print(f"--- {child.name} (exit {child.process.returncode}) ---\n{child.log_tail(40)}")
