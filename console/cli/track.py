"""`marlaas track [JOB...]`: jobs' settings, step metrics and evaluations to TensorBoard,
MLflow, Weights & Biases and trackio (console/tracking/)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from common.runtime.config import SharedSettings, load
from console.cli.support import one_line_errors, operator_only, options, quiet_logging, run, say
from console.operator_client import OperatorClient
from console.tracking import PROJECT, Tracker, TrackSettings, chosen_sinks, open_sinks


@one_line_errors
def track(
    jobs: Annotated[
        list[str] | None, typer.Argument(help="Jobs to track; default: every job.")
    ] = None,
    out: Annotated[
        Path,
        typer.Option("--out", help="Directory for the logs, W&B and trackio files, the cursor."),
    ] = Path("track"),
    to: Annotated[
        str,
        typer.Option(
            "--to",
            help="Sinks, comma-separated: tensorboard, mlflow, wandb, trackio "
            "(default: $MARLAAS_TRACK_TO, else tensorboard,mlflow).",
        ),
    ] = "",
    tensorboard: Annotated[
        bool | None,
        typer.Option(
            "--tensorboard/--no-tensorboard", help="Add TensorBoard to the sinks, or leave it out."
        ),
    ] = None,
    mlflow: Annotated[
        str,
        typer.Option(
            "--mlflow",
            help="MLflow tracking URI, adding MLflow (default: sqlite:///<out>/mlflow.db); "
            "'off': leave MLflow out.",
        ),
    ] = "",
    wandb_mode: Annotated[
        str,
        typer.Option(
            "--wandb-mode",
            help="W&B 'offline' (files for `wandb sync`) or 'online' "
            "(default: $WANDB_MODE, else offline).",
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
    """Each job as a run in TensorBoard and MLflow (or W&B and trackio: --to): settings,
    training and eval metrics, tenant as a tag. Run again, it writes only what is new."""
    operator_only("track")
    settings = load(TrackSettings)
    names = chosen_sinks(to, settings.to, tensorboard=tensorboard, mlflow=mlflow)
    mlflow_uri = (
        mlflow if mlflow not in ("", "off") else f"sqlite:///{(out / 'mlflow.db').resolve()}"
    )
    wandb_mode = wandb_mode or settings.wandb_mode
    tracker = Tracker(out, open_sinks(names, out, mlflow_uri=mlflow_uri, wandb_mode=wandb_mode))
    try:
        written = run(_track(jobs or [], tracker, follow))
    finally:
        tracker.close()
    say(f"track: {written} new events")
    views = {
        "tensorboard": f"tensorboard --logdir {out / 'tensorboard'}",
        "mlflow": f"mlflow ui --backend-store-uri {mlflow_uri}",
        "wandb": f"wandb sync {out / 'wandb'}"
        if wandb_mode == "offline"
        else f"W&B project {PROJECT}",
        "trackio": f"TRACKIO_DIR={out / 'trackio'} trackio show --project {PROJECT}",
    }
    for name in names:
        say(f"  {views[name]}")


async def _track(jobs: list[str], tracker: Tracker, follow: bool) -> int:
    quiet_logging()
    async with OperatorClient(
        load(SharedSettings), connect_timeout_s=options.connect_timeout_s
    ) as client:
        return await client.track(jobs, tracker, follow=follow)


def register(app: typer.Typer) -> None:
    app.command()(track)
