"""The CLI where no stack answers: it says where the address came from and what to run."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from console.cli.main import app


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def no_stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MARLAAS_STATE_DIR", str(tmp_path))
    for variable in ("MARLAAS_REDIS_URL", "MARLAAS_KAFKA_BOOTSTRAP", "MARLAAS_API_URL"):
        monkeypatch.delenv(variable, raising=False)
    return tmp_path


def status(*env: tuple[str, str]) -> str:
    result = CliRunner().invoke(app, ["--connect-timeout", "1", "status"], env=dict(env))
    assert result.exit_code == 1, result.output
    return " ".join(result.output.split())


def test_with_no_stack_the_error_names_the_state_dir_and_what_to_run(no_stack: Path) -> None:
    redis = f"redis://127.0.0.1:{closed_port()}/0"
    kafka = f"127.0.0.1:{closed_port()}"
    said = status(("MARLAAS_REDIS_URL", redis), ("MARLAAS_KAFKA_BOOTSTRAP", kafka))
    assert "unreachable" in said and ("MARLAAS_REDIS_URL names it" in said or "KAFKA" in said)

    (no_stack / "stack.env").write_text(
        f"MARLAAS_REDIS_URL={redis}\nMARLAAS_KAFKA_BOOTSTRAP={kafka}\n"
    )
    said = status()
    assert f"read from {no_stack / 'stack.env'}: is the stack `marlaas up` started still" in said

    (no_stack / "stack.env").unlink()
    if any(port_open(port) for port in (6379, 9092)):
        pytest.skip("something listens at the default addresses here")
    said = status()
    assert f"no stack found: no stack.env in {no_stack} (MARLAAS_STATE_DIR)" in said
    assert "start one with `marlaas up`" in said


def test_global_options_work_after_the_subcommand_too() -> None:
    """`marlaas status --connect-timeout 5` was refused: click takes a group's options before
    the subcommand only."""
    from console.cli.main import hoist_global_options

    assert hoist_global_options(["status", "--connect-timeout", "5", "--once"]) == [
        "--connect-timeout",
        "5",
        "status",
        "--once",
    ]
    assert hoist_global_options(["--api-url=http://a", "export", "j", "--api-key", "k"]) == [
        "--api-url=http://a",
        "--api-key",
        "k",
        "export",
        "j",
    ]
    kept = ["sample", "j", "--", "--api-key", "k"]
    assert hoist_global_options(kept) == kept
    assert hoist_global_options(["status", "--api-key"]) == ["status", "--api-key"]


def test_the_marlaas_command_takes_the_connect_timeout_after_the_subcommand(
    no_stack: Path,
) -> None:
    import os
    import subprocess
    import sys

    main = "from console.cli.main import main; main()"
    env = os.environ | {"MARLAAS_REDIS_URL": f"redis://127.0.0.1:{closed_port()}/0"}
    run = subprocess.run(
        [sys.executable, "-c", main, "status", "--connect-timeout", "1", "--once"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert "unreachable after 1s" in run.stderr and "MARLAAS_REDIS_URL names it" in run.stderr
