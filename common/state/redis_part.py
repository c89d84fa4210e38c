"""What every part of the Redis store shares: one client, its Lua scripts, and decoding its
answers.

The store (`store`) holds one part per concern as an attribute, each in the module of
common/state/ that owns that concern with its Lua scripts beside it: adapter pointers
(`pointers`), the job registry (`registry`), the flow window (`flow`), evaluation tallies
(`evals`), de-dup sets (`dedup`), what replicas report (`replicas`) and tenants (`tenants`).
Every Redis key they use is named in `keyspace`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # only named in annotations: what imports a part's rules needs no Redis
    from redis import asyncio as aioredis
    from redis.commands.core import AsyncScript


class RedisPart:
    """A part of the store: methods over the one client the store was connected with."""

    def __init__(self, client: aioredis.Redis) -> None:
        self._redis = client


class Lua:
    """A part's Lua script, declared beside its source (`_set_status = Lua(SET_STATUS)`) and
    registered on the part's client at first use (redis-py then runs EVALSHA, loading the
    script on NOSCRIPT)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self._slot = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self._slot = f"_lua{name}"

    def __get__(self, part: RedisPart, owner: type | None = None) -> AsyncScript:
        script: AsyncScript | None = part.__dict__.get(self._slot)
        if script is None:
            script = part.__dict__[self._slot] = part._redis.register_script(self.source)
        return script


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def texts(fields: Mapping[Any, Any]) -> dict[str, str]:
    """A hash's fields and values as text."""
    return {text(k): text(v) for k, v in fields.items()}
