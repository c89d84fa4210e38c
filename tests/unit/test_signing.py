"""common.signing: a record's signature covers its topic, key and value, under one key."""

from __future__ import annotations

import pytest

from common.config import SharedSettings
from common.signing import HEADER, RecordSigner, signer


def test_a_signed_record_checks_and_any_change_breaks_it() -> None:
    key = RecordSigner("k1")
    headers = key.headers("marlaas.trajectories", b"job-1", b"value")
    assert key.problem("marlaas.trajectories", b"job-1", b"value", headers) is None
    for topic, record_key, value in [
        ("marlaas.adapters", b"job-1", b"value"),  # moved to another topic
        ("marlaas.trajectories", b"job-2", b"value"),  # to another job's key
        ("marlaas.trajectories", b"job-1", b"valuf"),  # altered
        # Shifting bytes between key and value is a change too (NUL-separated).
        ("marlaas.trajectories", b"job-1v", b"alue"),
    ]:
        problem = key.problem(topic, record_key, value, headers)
        assert problem is not None and problem.startswith("bad signature")
    assert RecordSigner("k2").problem("marlaas.trajectories", b"job-1", b"value", headers)
    unsigned = key.problem("marlaas.trajectories", b"job-1", b"value", [])
    assert unsigned is not None and unsigned.startswith(f"unsigned record (no {HEADER} header)")


def test_no_key_signs_nothing_and_the_key_is_never_printed() -> None:
    assert signer("") is None
    with pytest.raises(ValueError):
        RecordSigner("")
    settings = SharedSettings(bus_key="s3cret")  # type: ignore[arg-type]
    assert settings.signer is not None
    assert "s3cret" not in repr(settings) and "s3cret" not in str(settings.model_dump())
