"""One version of one job's adapter, as every service names it: `AdapterRef`, and where it lies
(`adapter_path`).

This module owns "the adapter of job J at version V". The trainer's save returns one
(trainer_svc/checkpoints.py) and publishes it; the `AdapterUpdate` message and the Redis pointer
(common/state/pointers.py) carry its fields flat and give it back as `.ref`; rollout_svc loads it
into vLLM under its `lora_name`; `marlaas export` copies its directory out. Stdlib and msgspec
only: `messages` and common/files/artifacts.py import it, so it imports neither.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

import msgspec


def adapter_path(uri: str) -> Path:
    """Local path of an artifact URI (`file:///...`, percent-encoded as `Path.as_uri` writes
    it, or a plain path)."""
    parsed = urlparse(uri)
    if parsed.scheme != "file":
        return Path(uri)
    if parsed.netloc not in ("", "localhost"):
        raise ValueError(f"artifact URI {uri!r} names host {parsed.netloc!r}; only local files")
    return Path(url2pathname(parsed.path))


class AdapterRef(msgspec.Struct, frozen=True):
    """Version `version` of job `job_id`'s adapter: a PEFT directory in the artifact store."""

    job_id: str
    version: int
    """1, 2, ...; 0 is the bare base model and needs no directory."""
    uri: str = ""
    """Where its directory lies: a `file://` URI (as the trainer publishes it) or a plain path."""
    step: int = 0
    """The training step that wrote it (the trainer publishes version n at step n)."""

    @property
    def lora_name(self) -> str:
        """Its name in vLLM's engine: `<job>@v<version>`."""
        return f"{self.job_id}@v{self.version}"

    @property
    def path(self) -> Path:
        """Its directory on this machine."""
        return adapter_path(self.uri)

    @property
    def key(self) -> tuple[str, int]:
        """(job, version): what tells versions apart, wherever each was read from."""
        return (self.job_id, self.version)
