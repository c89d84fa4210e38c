"""An error in the words a job's owner reads (a rejection, a failed episode or evaluation)."""

from __future__ import annotations

from common.state.tenants import QuotaError
from common.wire.jobspec import JobSpecError
from common.wire.messages import ContextTooLongError
from env_svc.episodes import EpisodeError
from env_svc.protocol import EnvSpecError


def reason(exc: BaseException) -> str:
    """Our own errors say what is wrong; anything else also names its type."""
    if isinstance(
        exc, JobSpecError | QuotaError | EnvSpecError | EpisodeError | ContextTooLongError
    ):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
