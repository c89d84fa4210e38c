"""Every `marlaas` command's --help, as a new user reads it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import typer
from typer.testing import CliRunner

from console.cli.main import app


def command_paths(command: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every command's words, groups too (typer builds its own vendored click's)."""
    yield path
    for name, sub in getattr(command, "commands", {}).items():
        yield from command_paths(sub, (*path, name))


def test_no_flag_is_shown_as_taking_a_value() -> None:
    """typer 0.29 showed `--best <bool>`, `--help <bool>`: every flag as taking a value."""
    paths = list(command_paths(typer.main.get_command(app)))
    assert ("export",) in paths and ("tenants", "revoke-key") in paths
    runner = CliRunner()
    for path in paths:
        result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "120"})
        assert result.exit_code == 0, (path, result.output)
        assert "--help" in result.output and "<bool>" not in result.output, path
