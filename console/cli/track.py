"""`marlaas track [JOB...]`: jobs' settings, step metrics and evaluations to TensorBoard and
MLflow (console/tracking.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from common.runtime.config import SharedSettings, load
from console.cli.support import one_line_errors, operator_only, options, quiet_logging, run, say
from console.operator_client import OperatorClient
from console.tracking import MlflowSink, Sink, TensorBoardSink, Tracker


@one_line_errors
def track(
    jobs: Annotated[
        list[str] | None, typer.Argument(help="Jobs to track; default: every job.")
    ] = None,
    out: Annotated[
        Path, typer.Option("--out", help="Directory for TensorBoard's logs and the cursor.")
    ] = Path("track"),
    tensorboard: Annotated[
        bool, typer.Option("--tensorboard/--no-tensorboard", help="Write TensorBoard logs.")
    ] = True,
    mlflow: Annotated[
        str,
        typer.Option(
            "--mlflow",
            help="MLflow tracking URI (default: sqlite:///<out>/mlflow.db); 'off': none.",
        ),
    ] = "",
    follow: Annotated[
        bool,
        typer.Option(
            "--follow",
            "-f",
            help="Keep writing as events come: until the named jobs end, or Ctrl-C.",
        ),
    ] = False,
) -> None:
    """Each job as a run in TensorBoard and MLflow: settings, training and eval metrics,
    tenant as a tag. Run again, it writes only what is new."""
    operator_only("track")
    sinks: list[Sink] = []
    if tensorboard:
        sinks.append(TensorBoardSink(out / "tensorboard"))
    mlflow_uri = mlflow or f"sqlite:///{(out / 'mlflow.db').resolve()}"
    if mlflow != "off":
        out.mkdir(parents=True, exist_ok=True)
        sinks.append(MlflowSink(mlflow_uri))
    if not sinks:
        raise ValueError("nothing to write: both --no-tensorboard and --mlflow off")
    tracker = Tracker(out, sinks)
    try:
        written = run(_track(jobs or [], tracker, follow))
    finally:
        tracker.close()
    say(f"track: {written} new events")
    if tensorboard:
        say(f"  tensorboard --logdir {out / 'tensorboard'}")
    if mlflow != "off":
        say(f"  mlflow ui --backend-store-uri {mlflow_uri}")


async def _track(jobs: list[str], tracker: Tracker, follow: bool) -> int:
    quiet_logging()
    async with OperatorClient(
        load(SharedSettings), connect_timeout_s=options.connect_timeout_s
    ) as client:
        return await client.track(jobs, tracker, follow=follow)


def register(app: typer.Typer) -> None:
    app.command()(track)
