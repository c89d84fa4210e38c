"""One logging format for every MARLaaS process, as text lines or JSON lines.

A line about a job carries the job id and its tenant as fields (`job_logger`), so one
tenant's or one job's lines can be found across the three services: text lines end with
`job=<id> tenant=<tenant>`, JSON lines have `"job"` and `"tenant"` keys.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Literal

LogFormat = Literal["text", "json"]

# LogRecord attribute -> field name in the output, in output order.
_CONTEXT_FIELDS = {"job_id": "job", "tenant": "tenant"}


def job_fields(job_id: str, tenant: str | None = None) -> dict[str, str]:
    """`extra=` for one log call about a job; an unknown tenant is left out."""
    fields = {"job_id": job_id}
    if tenant is not None:
        fields["tenant"] = tenant
    return fields


def job_logger(
    logger: logging.Logger, job_id: str, tenant: str | None = None
) -> logging.LoggerAdapter[logging.Logger]:
    """`logger`, with every line tagged with the job and its tenant."""
    return logging.LoggerAdapter(logger, job_fields(job_id, tenant))


def _context(record: logging.LogRecord) -> dict[str, str]:
    return {
        name: str(value)
        for attribute, name in _CONTEXT_FIELDS.items()
        if (value := getattr(record, attribute, None)) is not None
    }


def _text_value(value: str) -> str:
    # Job ids are free text: quote one that would not read back as a single key=value.
    if not value or any(c.isspace() or c in '"=' for c in value):
        return json.dumps(value)
    return value


class TextFormatter(logging.Formatter):
    """`HH:MM:SS LEVEL logger: message job=<id> tenant=<tenant>`; a traceback follows."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s", datefmt="%H:%M:%S")

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        context = _context(record)
        if not context:
            return line
        return line + " " + " ".join(f"{k}={_text_value(v)}" for k, v in context.items())


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (UTC ISO 8601), level, logger, message, job, tenant, exc."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **_context(record),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str)


FORMATTERS: Mapping[LogFormat, type[logging.Formatter]] = {
    "text": TextFormatter,
    "json": JsonFormatter,
}


def setup_logging(level: str = "INFO", log_format: LogFormat = "text") -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(FORMATTERS[log_format]())
    logging.basicConfig(level=level.upper(), handlers=[handler])
    # aiokafka.client logs each failed connection attempt at ERROR with the same text the
    # back-off in common.runtime.backoff already reports once per retry, with the address.
    logging.getLogger("aiokafka.client").setLevel(logging.CRITICAL)
    # aiokafka's INFO lines (coordinator discovery, subscriptions) come with every consumer a
    # status view or lag probe opens; the bus logs the assignments that matter itself.
    logging.getLogger("aiokafka").setLevel(logging.WARNING)
