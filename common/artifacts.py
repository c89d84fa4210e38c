"""The artifact store's format, and the one way to write into it atomically.

An adapter version is a standard PEFT LoRA directory (`adapter_config.json` +
`adapter_model.safetensors` with `base_model.model.…lora_A.weight` keys): trainer_svc writes
`<artifacts>/adapters/<job>/v<n>/`, rollout_svc loads it into vLLM by URI, and `marlaas export`
copies it out (console/export.py). Layout: docs/architecture.md, "Where state lives".

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
from urllib.parse import urlparse
from urllib.request import url2pathname

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

LATEST = "latest"
"""`checkpoints/<job>/latest`: the name of the job's newest complete checkpoint."""
VERSION_DIR = re.compile(r"v(\d+)(?:\.e(\d+))?")
"""An adapter or checkpoint directory: `v<version>.e<fencing epoch>` (`v<n>`: epoch 0)."""

STAGING_INFIX = ".staging-"
"""Marks a directory or file still being written (`.<name>.staging-<random>`)."""


def adapter_path(uri: str) -> Path:
    """Local path of an artifact URI (`file:///...`, percent-encoded as `Path.as_uri` writes
    it, or a plain path)."""
    parsed = urlparse(uri)
    if parsed.scheme != "file":
        return Path(uri)
    if parsed.netloc not in ("", "localhost"):
        raise ValueError(f"artifact URI {uri!r} names host {parsed.netloc!r}; only local files")
    return Path(url2pathname(parsed.path))


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
    non-empty directory. Modes end up 0755 / 0644: other services (other users, in compose)
    read the artifacts and nothing in them is secret.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}{STAGING_INFIX}"))
    replaced = staging.with_name(staging.name + "-replaced")
    try:
        yield staging
        for path in [staging, *staging.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        if target.exists():
            os.replace(target, replaced)
        os.replace(staging, target)
    finally:
        for leftover in (staging, replaced):
            shutil.rmtree(leftover, ignore_errors=True)


def atomic_write_text(target: Path, text: str) -> None:
    """Replace the file `target` with `text` in one rename."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}{STAGING_INFIX}")
    try:
        with os.fdopen(fd, "w") as file:
            file.write(text)
        os.chmod(staging, 0o644)
        os.replace(staging, target)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise
