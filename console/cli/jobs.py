"""`marlaas submit | status | pause | resume | cancel | logs | export | report`."""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from common.runtime.config import SharedSettings, load
from common.state.audit import Audit
from common.wire.messages import JobAction, JobSpec
from console.cli.support import (
    console,
    fail,
    one_line_errors,
    operator_only,
    options,
    quiet_logging,
    run,
    say,
    tenant_client,
)
from console.env_params import check_env_params
from console.operator_client import OperatorClient
from console.status.board import StatusSnapshot
from console.status.live import live_view
from console.status.render import event_cells, render
from marlaas.api_client import TenantClient
from marlaas.export import refuse_occupied
from marlaas.jobfile import load_job_file
from marlaas.jobwatch import reported
from marlaas.merge import ADAPTER_SUBDIR, DTYPES, base_model_dir, check_dtype, write_merged


def _client() -> OperatorClient:
    quiet_logging()
    return OperatorClient(load(SharedSettings), connect_timeout_s=options.connect_timeout_s)


# --- submit ---------------------------------------------------------------------------


@one_line_errors
def submit(
    files: Annotated[list[Path], typer.Argument(help="Job files (TOML): examples/jobs/*.toml")],
    wait: Annotated[bool, typer.Option("--wait", help="Follow the jobs until they end.")] = False,
) -> None:
    """Validate job files, produce them to marlaas.jobs and print the job ids.

    Every file is checked before anything is sent: one bad file sends none.
    """
    settings = load(SharedSettings)
    specs = [
        load_job_file(
            path,
            base_model=settings.base_model,
            max_lora_rank=settings.max_lora_rank,
            lora_target_modules=settings.lora_target_modules,
            check_env=check_env_params,
        )
        for path in files
    ]
    if (api := tenant_client()) is not None:
        run(_submit_via_api(api, specs, wait))
    else:
        run(_submit(specs, wait))


async def _submit(specs: list[JobSpec], wait: bool) -> None:
    async with _client() as client:
        await client.submit(specs)
        for spec in specs:
            say(spec.job_id)
        if not wait:
            return
        snapshot = await _follow(client, specs, until_done=True)
    unfinished = [row for row in snapshot.jobs if row.state != "completed"]
    if unfinished:
        fail(
            "; ".join(
                f"job {r.progress.job_id} {r.state}: {r.progress.reason or '-'}" for r in unfinished
            )
        )


async def _submit_via_api(api: TenantClient, specs: list[JobSpec], wait: bool) -> None:
    async with api:
        await api.submit(specs)
        for spec in specs:
            say(spec.job_id)
        if not wait:
            return
        views = await _wait_for_end(api, [spec.job_id for spec in specs])
    unfinished = [v for v in views if v["status"] != "completed"]
    if unfinished:
        fail(
            "; ".join(f"job {v['job_id']} {v['status']}: {v['reason'] or '-'}" for v in unfinished)
        )


async def _wait_for_end(api: TenantClient, job_ids: list[str]) -> list[dict[str, Any]]:
    """Poll the jobs until every one has ended and a completed one's final evaluation is in;
    one line per change."""
    seen: dict[str, str] = {}
    while True:
        views = [await api.job(job_id) for job_id in job_ids]
        for view in views:
            if seen.get(view["job_id"]) != (line := _job_line(view)):
                seen[view["job_id"]] = line
                say(line)
        if all(_reported(v) for v in views):
            return views
        await asyncio.sleep(2.0)


def _reported(view: dict[str, Any]) -> bool:
    evaluated = {int(version) for version in view.get("evals") or {}}
    return reported(
        view["status"], view.get("final_eval_due", False), view.get("max_steps", 0), evaluated
    )


def _job_line(view: dict[str, Any]) -> str:
    reason = f"  {view['reason']}" if view.get("reason") else ""
    line = (
        f"{view['job_id']}  {view['tenant']}  {view.get('env') or '-'}  {view['status']}  "
        f"v{view.get('version', 0)}/{view.get('max_steps') or '?'}{reason}"
    )
    evals: dict[str, dict[str, float]] = view.get("evals") or {}
    if latest := max(evals, key=int, default=None):
        result = evals[latest]
        line += (
            f"  held-out v{latest} {result['eval_accuracy']:.3f}"
            f" ± {result.get('eval_accuracy_stderr', 0.0):.3f}"
        )
        if latest != "0" and "0" in evals:
            line += f" (base {evals['0']['eval_accuracy']:.3f})"
    return line


# --- status ---------------------------------------------------------------------------


@one_line_errors
def status(
    job: Annotated[
        str | None, typer.Argument(help="One job (adds its recent events); default: every job.")
    ] = None,
    once: Annotated[
        bool, typer.Option("--once", help="Print once and exit (default off a terminal).")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the numbers as JSON.")] = False,
    interval_s: Annotated[
        float, typer.Option("--interval", help="Seconds between refreshes.")
    ] = 2.0,
) -> None:
    """Every job's progress, reward, staleness and ETA; the services' lag and utilisation.

    Live (refreshing until Ctrl-C) on a terminal. Reads marlaas.events and Redis only. With
    an API key: the tenant's jobs, their state and trained version.
    """
    if (api := tenant_client()) is not None:
        run(_status_via_api(api, job, as_json))
        return
    run(_status(job, once or as_json or not console.is_terminal, as_json, interval_s))


async def _status_via_api(api: TenantClient, job: str | None, as_json: bool) -> None:
    async with api:
        views = [await api.job(job)] if job else await api.jobs()
    if as_json:
        say(json.dumps(views, indent=2))
        return
    for view in views:
        say(_job_line(view))


async def _status(job: str | None, once: bool, as_json: bool, interval_s: float) -> None:
    async with _client() as client:
        job_ids = [job] if job else None
        if once:
            async with client.status_board(job_ids) as board:
                snapshot = await board.snapshot()
            if as_json:
                console.print_json(json.dumps(snapshot.to_json()))
            else:
                console.print(render(snapshot, detail=job is not None))
            return
        await _follow(client, job_ids, until_done=False, interval_s=interval_s)


async def _follow(
    client: OperatorClient,
    jobs: list[str] | list[JobSpec] | None,
    *,
    until_done: bool,
    interval_s: float = 2.0,
) -> StatusSnapshot:
    job_ids = None if jobs is None else [j if isinstance(j, str) else j.job_id for j in jobs]
    async with client.status_board(job_ids) as board:
        board.expect([j for j in jobs or [] if isinstance(j, JobSpec)])
        return await live_view(board, console, until_done=until_done, interval_s=interval_s)


# --- control --------------------------------------------------------------------------


def _control(action: JobAction, help_text: str) -> Callable[..., None]:
    @one_line_errors
    def command(
        job: Annotated[str, typer.Argument(help="The job id.")],
        wait_s: Annotated[
            float, typer.Option("--timeout", help="Seconds to wait for env_svc to apply it.")
        ] = 30.0,
    ) -> None:
        state = run(_command(job, action, wait_s))
        say(f"job {job}: {state}")

    command.__doc__ = help_text
    return command


async def _command(job: str, action: JobAction, wait_s: float) -> str:
    async with tenant_client() or _client() as client:
        return await client.command(job, action, wait_s=wait_s)


# --- logs -----------------------------------------------------------------------------


@one_line_errors
def logs(
    job: Annotated[str, typer.Argument(help="The job id.")],
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing until the job ends.")
    ] = False,
) -> None:
    """The job's events (accepted, steps with their metrics, drops, pauses, the end)."""
    run(_logs(job, follow))


async def _logs(job: str, follow: bool) -> None:
    async with tenant_client() or _client() as client:
        if follow:
            async for event in client.follow(job):
                say("  ".join(event_cells(event)))
        else:
            for event in await client.events(job):
                say("  ".join(event_cells(event)))


# --- export / report ------------------------------------------------------------------


@one_line_errors
def export(
    job: Annotated[str, typer.Argument(help="The job id.")],
    out: Annotated[Path, typer.Option("--out", help="Directory to write (empty or new).")],
    version: Annotated[
        int | None, typer.Option("--version", help="An earlier version still on disk.")
    ] = None,
    best: Annotated[
        bool,
        typer.Option("--best", help="The version with the best held-out accuracy (its evals)."),
    ] = False,
    merged: Annotated[
        bool,
        typer.Option(
            "--merged",
            help="Write the base model with the adapter merged (safetensors, Hugging Face "
            "layout; loads with no PEFT), the adapter in adapter/.",
        ),
    ] = False,
    dtype: Annotated[
        str, typer.Option("--dtype", help=f"Merged weights' dtype: {', '.join(DTYPES)}.")
    ] = "auto",
    base: Annotated[
        Path | None,
        typer.Option("--base", help="A local copy of the base model to merge into."),
    ] = None,
) -> None:
    """Write the job's latest adapter as a standard PEFT directory (transformers+peft, vLLM),
    or with --merged the base model with it merged in."""
    if not merged:
        got = run(_export(job, out, version, best))
        say(f"job {job} adapter v{got} -> {out}")
        return
    check_dtype(dtype, "--dtype")  # both before the adapter is fetched
    refuse_occupied(out)
    with tempfile.TemporaryDirectory(prefix="marlaas-export-") as scratch:
        adapter = Path(scratch) / ADAPTER_SUBDIR
        got = run(_export(job, adapter, version, best))
        base_dir = base_model_dir(adapter, base, load(SharedSettings).cache_dir)
        written = write_merged(adapter, base_dir, out, dtype)
    say(f"job {job} adapter v{got} merged into {base_dir.name} ({written.dtype}) -> {out}")


async def _export(job: str, out: Path, version: int | None, best: bool) -> int:
    """The job's adapter into `out` through the tenant API when one is named, else from the
    stack's store; its version."""
    if (api := tenant_client()) is not None:
        async with api:
            return await api.export(job, out, version=version, best=best)
    async with _client() as client:
        exported = await client.export(job, out, version=version, best=best)
    return exported.version


@one_line_errors
def report(
    out: Annotated[Path, typer.Option("--out", help="Directory for index.html, CSV, JSON.")],
    jobs: Annotated[
        list[str] | None, typer.Argument(help="Jobs to include; default: every job.")
    ] = None,
) -> None:
    """A self-contained HTML report: reward, staleness, throughput and utilisation over time."""
    started = time.monotonic()
    index = run(_report(jobs or [], out))
    say(f"report: {index} ({time.monotonic() - started:.1f}s)")


async def _report(jobs: list[str], out: Path) -> Path:
    async with tenant_client() or _client() as client:
        return await client.report(jobs, out)


@one_line_errors
def audit(
    job: Annotated[str, typer.Argument(help="The job id.")],
    as_json: Annotated[bool, typer.Option("--json", help="The accounting as JSON.")] = False,
) -> None:
    """Account for every group of a job: issued, trained, dropped, in flight; exits 1 if any
    was lost, trained twice or is unexpected, or pointer, checkpoint and announcement differ."""
    operator_only("audit")
    result = run(_audit(job))
    if as_json:
        say(json.dumps(result.to_json(), indent=2))
    else:
        say(
            f"job {result.job_id} ({result.status}): {result.issued} groups issued, "
            f"{result.trained_groups} trained in {result.versions} versions, "
            f"{result.dropped} dropped, {len(result.in_flight)} in flight, "
            f"{len(result.lost)} lost, {len(result.double_trained)} trained twice, "
            f"{len(result.unexpected)} unexpected"
        )
        for problem in result.problems:
            say(f"  problem: {problem}")
    if not result.ok:
        raise typer.Exit(1)


async def _audit(job: str) -> Audit:
    async with _client() as client:
        return await client.audit(job)


def register(app: typer.Typer) -> None:
    app.command()(submit)
    app.command()(status)
    controls: list[tuple[JobAction, str]] = [
        ("pause", "Pause a job: no new groups are issued; those in flight finish."),
        ("resume", "Resume a paused job."),
        ("cancel", "Cancel a job for good; its adapters stay exportable."),
    ]
    for action, text in controls:
        app.command(action)(_control(action, text))
    app.command()(logs)
    app.command()(export)
    app.command()(report)
    app.command()(audit)
