"""The embedded stack's service processes: started pointed at the stack (each with its own
Redis user), replicated, placed on cores, stopped; and the precision each will choose."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from common.runtime.config import (
    SERVICE_SETTINGS,
    RolloutSettings,
    SharedSettings,
    TrainerSettings,
    load,
)
from common.runtime.cores import engine_trainer_split, format_cores
from common.runtime.hardware import Hardware, Precision, engine_precision, trainer_precision
from console.stack.children import (
    ChildServer,
    free_port,
    spawn,
)

log = logging.getLogger(__name__)


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
    environ: Mapping[str, str] | None = None,
) -> list[ChildServer]:
    """Start service processes with logs under `<state dir>/logs/<module>.log`; a module
    named more than once runs as that many replicas (in one consumer group, logs
    `<module>-<n>.log`). The first rollout replica serves chat completions on `chat_port`.
    `redis_url`: one for all, or each module's own (its Redis user, common/security/access.py).
    `environ`: variables for every service beyond this process's (an operator's settings)."""
    placement = core_placement(modules, os.sched_getaffinity(0), os.environ)
    children, seen = [], dict.fromkeys(modules, 0)
    for module in modules:
        index, seen[module] = seen[module], seen[module] + 1
        name = module if modules.count(module) == 1 else f"{module}-{index}"
        log_path = settings.state_dir / "logs" / f"{name}.log"
        extra = dict(placement.get(module) or {}) | dict(environ or {})
        if module == "rollout_svc" and index == 0 and chat_port is not None:
            extra["ROLLOUT_API_PORT"] = str(chat_port)
        if module == "env_svc" and chat_port is not None:  # judged rewards ask the base model
            extra["MARLAAS_CHAT_URL"] = f"http://127.0.0.1:{chat_port}/v1"
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
    and the trainer on the other half (common/runtime/cores.py has the measurements), the engine's
    lent to the trainer while they idle (trainer_svc/compute.py), unless `environ` already
    says where either goes (or, `TRAINER_BORROW_CORES`, what is lent). Per module, the
    variables to add to its environment."""
    split = engine_trainer_split(cores)
    if split is None or not {"rollout_svc", "trainer_svc"} <= set(modules):
        return {}
    if {"VLLM_CPU_OMP_THREADS_BIND", "ROLLOUT_CPU_CORES", "TRAINER_CPU_CORES"} & environ.keys():
        return {}
    engine, trainer = split
    lent = environ.get("TRAINER_BORROW_CORES", format_cores(engine))
    trainer_env = {"TRAINER_CPU_CORES": format_cores(trainer)}
    if "TRAINER_BORROW_CORES" not in environ:  # set (even empty), the trainer reads it itself
        trainer_env["TRAINER_BORROW_CORES"] = lent
    log.info(
        "cores: rollout engine %s, trainer %s (borrowing %s while it idles)",
        format_cores(engine),
        format_cores(trainer),
        lent or "none",
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
