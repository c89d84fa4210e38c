"""common.security.signing: a record's signature covers its topic, key and value, under one key."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.runtime.config import SharedSettings
from common.security.signing import HEADER, RecordSigner, signer


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


def test_a_record_re_split_across_key_and_value_does_not_verify() -> None:
    """`topic NUL key NUL value`: moving the value's head into the key behind a NUL gives the
    same signed bytes, so a key holding a NUL is refused (issue 24)."""
    key = RecordSigner("k1")
    headers = key.headers("marlaas.jobs", b"job-1", b"head\0tail")
    assert key.problem("marlaas.jobs", b"job-1", b"head\0tail", headers) is None
    resplit = key.problem("marlaas.jobs", b"job-1\0head", b"tail", headers)
    assert resplit is not None and "NUL" in resplit
    with pytest.raises(ValueError, match="NUL"):
        key.signature("marlaas.jobs", b"job-1\0head", b"tail")


def test_a_service_refuses_to_start_without_a_bus_key(tmp_path: Path) -> None:
    environment = {
        "PATH": os.environ["PATH"],
        "MARLAAS_STATE_DIR": str(tmp_path),  # no embedded stack's stack.env to read a key from
        "PYTHONPATH": str(Path(__file__).parents[2]),
    }
    for service in ("env_svc", "trainer_svc", "rollout_svc", "api_svc"):
        done = subprocess.run(
            [sys.executable, "-m", service], env=environment, capture_output=True, text=True
        )
        assert done.returncode == 2, (service, done.stderr[-500:])
        assert f"{service}: MARLAAS_BUS_KEY is empty" in done.stderr
        assert "MARLAAS_INSECURE_BUS=1" in done.stderr
    open_bus = SharedSettings(insecure_bus=True)  # type: ignore[arg-type]
    open_bus.require_bus_key()  # explicitly open: allowed
