"""`marlaas envs` (the environments installed here) and `marlaas envs check NAME`."""

from __future__ import annotations

import json

import typer
from rich.table import Table

from console.cli.support import console, one_line_errors, say

envs_app = typer.Typer(
    help="Environments installed here (built-in, entry points, MARLAAS_ENVIRONMENTS).",
    invoke_without_command=True,
)


@envs_app.callback()
@one_line_errors
def envs_list(context: typer.Context) -> None:
    """List the installed environments with their params and defaults."""
    if context.invoked_subcommand is not None:
        return
    from env_svc.checker import describe
    from env_svc.protocol import available_environments, environment_class

    table = Table(title="environments", title_justify="left")
    for column in ("name", "class", "max turns", "params (defaults)"):
        table.add_column(column, overflow="fold")
    for name in available_environments():
        try:
            env_class = environment_class(name)
        except Exception as exc:  # one broken plug-in does not hide the others
            table.add_row(name, f"failed to load: {exc}", "", "")
            continue
        described = describe(env_class)
        params = ", ".join(f"{k}={v!r}" for k, v in described["params"].items())
        table.add_row(name, described["class"], _max_turns(env_class), params or "-")
    console.print(table)


@envs_app.command("check")
@one_line_errors
def envs_check(
    name: str = typer.Argument(..., help="An installed environment's name."),
    params: str = typer.Option("{}", help="Its params as JSON, e.g. '{\"max_operand\": 99}'."),
    tasks: int = typer.Option(8, min=1, max=1000, help="Tasks to draw and episodes to play."),
    seed: int = typer.Option(0, help="Seeds the task streams and the replies tried."),
) -> None:
    """Try an environment as env_svc will: build it, draw training and evaluation tasks,
    play episodes with replies a model may write, round-trip every state through bytes,
    check rewards and time each step. Exit 1 when anything fails."""
    from env_svc.checker import check_environment

    try:
        parsed = json.loads(params)
    except json.JSONDecodeError as exc:
        raise typer.BadParameter(f"--params is not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise typer.BadParameter("--params must be a JSON object")
    report = check_environment(name, parsed, tasks=tasks, seed=seed)
    table = Table(title=f"envs check {name}", title_justify="left")
    for column in ("check", "", "detail"):
        table.add_column(column, overflow="fold")
    for finding in report.findings:
        mark = "[green]ok[/]" if finding.ok else "[red]FAIL[/]"
        table.add_row(finding.check, mark, finding.detail)
    console.print(table)
    failed = sum(not f.ok for f in report.findings)
    say(f"{name}: " + ("every check passed" if not failed else f"{failed} check(s) failed"))
    if failed:
        raise typer.Exit(1)


def _max_turns(env_class: type) -> str:
    try:
        return str(env_class().max_turns)
    except Exception:  # needs params to be built
        return "?"


def register(app: typer.Typer) -> None:
    app.add_typer(envs_app, name="envs")
