"""What every `marlaas` command shares: consoles, the connect timeout, one-line errors."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, NoReturn, ParamSpec, TypeVar

import typer
from aiokafka.errors import KafkaError
from redis.exceptions import RedisError
from rich.console import Console

from common.runtime.backoff import ServerUnreachable
from common.state.registry import UnknownJobError
from common.state.tenants import UnknownKeyError, UnknownTenantError
from console.stack.children import StackError
from console.tracking import TrackingUnavailableError
from marlaas.api_client import ApiClientSettings, ApiError, TenantClient

PIPED_WIDTH = 200
"""Columns of output that does not go to a terminal (a pipe, a log file): read by people
and scripts alike, so tables are not cropped to rich's default of 80."""


def _flags_take_no_value() -> None:
    """typer 0.29's rich help shows a flag as taking a value (`--best <bool>`), where its plain
    help shows none: a flag takes none in both."""
    from typer.core import TyperOption

    shown = TyperOption.display_type_rich

    def display_type_rich(self: TyperOption, ctx: Any) -> str | None:
        return None if self.is_flag else shown(self, ctx)

    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


_flags_take_no_value()

console = Console()
if not console.is_terminal:
    console = Console(width=PIPED_WIDTH)
err_console = Console(stderr=True)

USER_ERRORS: tuple[type[Exception], ...] = (
    ServerUnreachable,
    StackError,
    UnknownJobError,
    KafkaError,
    RedisError,
    ValueError,
    OSError,
    TrackingUnavailableError,
    ApiError,
    UnknownTenantError,
    UnknownKeyError,
)
"""Errors a user can cause or fix: printed as one line, never as a traceback."""


@dataclass
class Options:
    connect_timeout_s: float = 10.0
    """How long a command waits for an unreachable broker or Redis before giving up."""
    api_url: str = ""
    api_key: str = ""
    """The tenant API and key (`--api-url`, `--api-key`; else MARLAAS_API_URL / _KEY)."""


options = Options()


def tenant_client() -> TenantClient | None:
    """The tenant API client when an API URL is given; None: operator mode (Kafka, Redis)."""
    from common.runtime.config import load

    settings = load(ApiClientSettings)
    url, key = options.api_url or settings.api_url, options.api_key or settings.api_key
    return TenantClient(url, key) if url else None


def operator_only(command: str) -> None:
    """Refuse an operator command in tenant mode, saying why."""
    if options.api_url or load_api_url():
        raise ValueError(
            f"`marlaas {command}` needs the operator's Kafka and Redis access; with an API key "
            "use submit, status, logs, pause, resume, cancel, export, report and sample"
        )


def load_api_url() -> str:
    from common.runtime.config import load

    return load(ApiClientSettings).api_url


P = ParamSpec("P")
T = TypeVar("T")


def one_line_errors(command: Callable[P, T]) -> Callable[P, T]:
    """Turn a user error into `error: <text>` on stderr and exit code 1."""

    @functools.wraps(command)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return command(*args, **kwargs)
        except USER_ERRORS as exc:
            fail(_one_line(exc))
        except KeyboardInterrupt:
            raise typer.Exit(130) from None

    return wrapper


def say(line: str) -> None:
    """One line of output as it is: never wrapped (scripts split it), colour-highlighted or
    read as markup (job ids, paths and model text may hold brackets)."""
    console.print(line, highlight=False, soft_wrap=True, markup=False)


def fail(message: str) -> NoReturn:
    err_console.print(f"[red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(1)


def quiet_logging() -> None:
    """Only errors: retries are logged as warnings for services; a command reports its end."""
    from common.runtime.logs import setup_logging

    setup_logging("ERROR")
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coroutine)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, ServerUnreachable):
        return f"{text}; {_address_source(exc.what)}"
    if isinstance(exc, KafkaError):
        return f"Kafka: {text}"
    if isinstance(exc, RedisError):
        return f"Redis: {text}"
    return text


_ADDRESS_VARIABLES = {"Kafka": "MARLAAS_KAFKA_BOOTSTRAP", "Redis": "MARLAAS_REDIS_URL"}


def _address_source(what: str) -> str:
    """Where the unreachable address came from, and what to run: a user without a stack
    read "Redis at 127.0.0.1:6379 unreachable" and had to guess."""
    from common.runtime.config import stack_env_file

    variable = _ADDRESS_VARIABLES.get(what, "")
    if variable in os.environ:
        return f"{variable} names it"
    env_file = stack_env_file()
    if env_file.is_file():
        return f"read from {env_file}: is the stack `marlaas up` started still running?"
    return (
        f"no stack found: no {env_file.name} in {env_file.parent} (MARLAAS_STATE_DIR); start "
        f"one with `marlaas up`, or name yours with {' and '.join(_ADDRESS_VARIABLES.values())}"
    )
