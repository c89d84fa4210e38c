"""The artifact store's format, and the one way to write into it atomically.

An adapter version is a standard PEFT LoRA directory (`adapter_config.json` +
`adapter_model.safetensors` with `base_model.model.…lora_A.weight` keys): trainer_svc writes
`<artifacts>/adapters/<job>/v<n>/`, rollout_svc loads it into vLLM by URI, and `marlaas export`
copies it out (marlaas/export.py). Layout: docs/architecture.md, "Where state lives".

Every directory or file that another process reads is written with `atomic_dir` /
`atomic_write_text`: readers see the old contents or the new, never half of either, and a
crash leaves the old contents in place. Nothing here imports torch.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

from common.wire.adapters import AdapterRef, adapter_path

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

LATEST = "latest"
"""`checkpoints/<job>/latest`: the name of the job's newest complete checkpoint."""
VERSION_DIR = re.compile(r"v(\d+)(?:\.e(\d+))?")
"""An adapter or checkpoint directory: `v<version>.e<fencing epoch>` (`v<n>`: epoch 0)."""

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600
"""Modes of everything in the artifact store: the service user's alone."""
PRIVATE_UMASK = 0o077
"""The services' umask, and that of what `marlaas up` starts: whatever else they write (the
model cache, Redis' and the broker's data, logs) is theirs alone too."""

STAGING_INFIX = ".staging-"
"""Marks a directory or file still being written (`.<name>.staging-<random>`)."""


def adapter_dir(artifacts: Path, job_id: str) -> Path:
    """Where the job's adapter versions lie: `<artifacts>/adapters/<job>`."""
    return Path(artifacts) / "adapters" / job_id


def foreign_adapter_uri(artifacts: Path, job_id: str, uri: str) -> str | None:
    """Why `uri` cannot be one of the job's adapter versions (None: it can): an adapter
    update may only name a directory of the artifact store under that job's own, so a forged
    or corrupt one cannot make a rollout replica load another job's adapter or any path."""
    try:
        path = adapter_path(uri).resolve()
    except ValueError as exc:
        return str(exc)
    own = adapter_dir(artifacts, job_id).resolve()
    if path.parent != own or VERSION_DIR.fullmatch(path.name) is None:
        return f"{uri!r} is not a version directory under {own}"
    return None


class PublishedVersions(Protocol):
    async def published_uri(self, job_id: str, version: int) -> str | None: ...


async def unpublished(
    pointers: PublishedVersions, adapter: AdapterRef, *, artifacts: Path | None = None
) -> str | None:
    """Why an announced adapter version is not to be acted on (None: it is the trainer's): its
    URI must be the one the trainer published for that version in Redis, which only the
    trainer's credentials can write (common/security/access.py), and, for a reader that loads
    it (`artifacts` given), lie under the job's own adapter directory."""
    if (
        artifacts is not None
        and (foreign := foreign_adapter_uri(artifacts, adapter.job_id, adapter.uri)) is not None
    ):
        return foreign
    published = await pointers.published_uri(adapter.job_id, adapter.version)
    if published is None or adapter_path(published) != adapter.path:
        return (
            f"v{adapter.version} of job {adapter.job_id!r} was published as {published!r}, "
            f"not {adapter.uri!r}"
        )
    return None


def version_dir_name(version: int, epoch: int) -> str:
    return f"v{version}.e{epoch}" if epoch else f"v{version}"


def epoch_of(name: str) -> int:
    match = VERSION_DIR.fullmatch(name)
    return int(match[2]) if match is not None and match[2] else 0


def latest_checkpoint_version(artifacts: Path, job_id: str) -> int | None:
    """The version `checkpoints/<job>/latest` names (None: no checkpoint yet); torch-free,
    for the console (trainer_svc/checkpoints.py reads and writes checkpoints)."""
    try:
        name = (Path(artifacts) / "checkpoints" / job_id / LATEST).read_text().strip()
    except FileNotFoundError:
        return None
    match = VERSION_DIR.fullmatch(name)
    if match is None:
        raise ValueError(f"checkpoints/{job_id}/latest holds {name!r}, not v<n>[.e<epoch>]")
    return int(match[1])


def staging_leftovers(target: Path) -> list[Path]:
    """Staging directories of `target` left by a writer that crashed."""
    return sorted(target.parent.glob(f".{target.name}{STAGING_INFIX}*"))


@contextmanager
def atomic_dir(target: Path) -> Iterator[Path]:
    """Yield an empty staging directory beside `target` that replaces `target` once complete.

    The staging directory is renamed into place only when the block ends without an error;
    an existing `target` (a directory) is moved aside first, since rename() cannot replace a
    non-empty directory. Modes end up 0700 / 0600: a tenant's adapters are its own. Every
    service runs as the one service user (uid 1000 in the images), which alone reads them;
    tenants get theirs only through the API's export, which checks ownership.
    """
    target.parent.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}{STAGING_INFIX}"))
    replaced = staging.with_name(staging.name + "-replaced")
    try:
        yield staging
        for path in [staging, *staging.rglob("*")]:
            path.chmod(PRIVATE_DIR if path.is_dir() else PRIVATE_FILE)
        if target.exists():
            os.replace(target, replaced)
        os.replace(staging, target)
    finally:
        for leftover in (staging, replaced):
            shutil.rmtree(leftover, ignore_errors=True)


def atomic_write_text(target: Path, text: str) -> None:
    """Replace the file `target` with `text` in one rename."""
    target.parent.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR)
    fd, staging = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}{STAGING_INFIX}")
    try:
        with os.fdopen(fd, "w") as file:
            file.write(text)
        os.chmod(staging, PRIVATE_FILE)
        os.replace(staging, target)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise
