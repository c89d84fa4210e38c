"""common.runtime.logs: job and tenant on every job line, as text fields or JSON keys."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from common.runtime.logs import FORMATTERS, LogFormat, job_fields, job_logger


@pytest.fixture
def captured() -> Iterator[tuple[logging.Logger, dict[LogFormat, io.StringIO]]]:
    """A logger writing through both formatters at once, one stream each."""
    logger = logging.getLogger(f"test-logs-{id(object())}")
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    streams: dict[LogFormat, io.StringIO] = {}
    for log_format, formatter in FORMATTERS.items():
        streams[log_format] = io.StringIO()
        handler = logging.StreamHandler(streams[log_format])
        handler.setFormatter(formatter())
        logger.addHandler(handler)
    yield logger, streams
    for added in list(logger.handlers):
        logger.removeHandler(added)


def lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def test_job_lines_carry_job_and_tenant(
    captured: tuple[logging.Logger, dict[LogFormat, io.StringIO]],
) -> None:
    logger, streams = captured
    job_logger(logger, "arith-1f2e", "acme").info("step %d/%d reward %.2f", 3, 10, 0.5)

    (text,) = lines(streams["text"])
    assert text.endswith(
        f" INFO    {logger.name}: step 3/10 reward 0.50 job=arith-1f2e tenant=acme"
    )
    (entry,) = map(json.loads, lines(streams["json"]))
    assert entry["message"] == "step 3/10 reward 0.50"
    assert (entry["job"], entry["tenant"]) == ("arith-1f2e", "acme")
    assert (entry["level"], entry["logger"]) == ("INFO", logger.name)
    assert entry["ts"].endswith("+00:00") and "T" in entry["ts"]


def test_lines_without_a_job_have_no_job_fields(
    captured: tuple[logging.Logger, dict[LogFormat, io.StringIO]],
) -> None:
    logger, streams = captured
    logger.warning("broker unreachable")
    job_logger(logger, "j-unknown").warning("command for an unknown job ignored")
    logger.info("one-off", extra=job_fields("j-2", "beta"))

    assert lines(streams["text"])[0].endswith(": broker unreachable")
    assert lines(streams["text"])[1].endswith(": command for an unknown job ignored job=j-unknown")
    assert lines(streams["text"])[2].endswith(": one-off job=j-2 tenant=beta")
    entries = [json.loads(line) for line in lines(streams["json"])]
    assert "job" not in entries[0] and "tenant" not in entries[0]
    assert entries[1]["job"] == "j-unknown" and "tenant" not in entries[1]
    assert (entries[2]["job"], entries[2]["tenant"]) == ("j-2", "beta")


def test_free_text_ids_stay_one_field_and_tracebacks_stay_readable(
    captured: tuple[logging.Logger, dict[LogFormat, io.StringIO]],
) -> None:
    logger, streams = captured
    try:
        raise ValueError("bad reward")
    except ValueError:
        job_logger(logger, "my job=1", "t").exception("episode failed")

    text = lines(streams["text"])
    assert text[0].endswith(': episode failed job="my job=1" tenant=t')
    assert text[1] == "Traceback (most recent call last):"
    assert text[-1] == "ValueError: bad reward"
    (entry,) = map(json.loads, lines(streams["json"]))  # the traceback stays in one JSON line
    assert entry["job"] == "my job=1"
    assert entry["exc"].endswith("ValueError: bad reward")
