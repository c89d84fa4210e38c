"""Environment code that may or may not await: awaited on a loop, or driven without one when
it never suspends (an environment whose code is all synchronous)."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar, cast

from env_svc.protocol.errors import AsyncEnvironmentError

R = TypeVar("R")


async def awaited(value: R | Awaitable[R]) -> R:
    """`value`, awaited when environment code returned an awaitable (it was `async def`)."""
    return await value if inspect.isawaitable(value) else value


def run_sync(work: Coroutine[Any, Any, R]) -> R:
    """The result of a coroutine that never suspends (an environment whose code is all
    synchronous), driven without an event loop. One that does suspend awaits something only
    a loop can give: `AsyncEnvironmentError`."""
    try:
        work.send(None)
    except StopIteration as done:
        return cast(R, done.value)
    work.close()
    raise AsyncEnvironmentError(
        "this environment awaits (an async respond, reset or reward): drive it with "
        "astep/areset/ascore on an event loop"
    )


def finish(work: Coroutine[Any, Any, R], *, awaits: bool) -> R:
    """An environment's coroutine from synchronous code (tests, `marlaas envs check`): driven
    without a loop, or on a loop of its own when the environment awaits."""
    return asyncio.run(work) if awaits else run_sync(work)


def is_async(fn: object) -> bool:
    """Whether calling `fn` gives a coroutine (an `async def` function or method, or an
    object whose `__call__` is one)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - a callable object's method
    )
