"""What every part of the Redis store shares: one client, and decoding its answers.

The store (common/store.py) is one class made of parts, one per concern, each in the module
that owns that concern with its Lua scripts beside it: adapter pointers (common/pointers.py),
the job registry (common/registry.py), the flow window (common/flow.py), evaluation tallies
(common/evals.py), de-dup sets (common/dedup.py) and what replicas report
(common/replicas.py). Every Redis key they use is named in common/keyspace.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from redis import asyncio as aioredis


class RedisPart:
    """A part of the store: methods over the one client the store was connected with.

    Scripts are registered on first use (`functools.cached_property` in each part)."""

    def __init__(self, client: aioredis.Redis) -> None:
        self._redis = client


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def texts(fields: Mapping[Any, Any]) -> dict[str, str]:
    """A hash's fields and values as text."""
    return {text(k): text(v) for k, v in fields.items()}
