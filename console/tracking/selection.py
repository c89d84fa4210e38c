"""Which sinks `marlaas track` writes: the deployment's choice (`MARLAAS_TRACK_TO`), changed
per run by `--to` and the per-sink flags; and opening them under one output directory."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from console.tracking.mlflow_sink import MlflowSink
from console.tracking.runs import Sink
from console.tracking.tensorboard_sink import TensorBoardSink
from console.tracking.trackio_sink import TrackioSink
from console.tracking.wandb_sink import WandbSink

SINK_NAMES = ("tensorboard", "mlflow", "wandb", "trackio")


def sink_names(text: str) -> list[str]:
    """`"wandb, trackio"` as sink names, in `SINK_NAMES`' order; ValueError for a name that is
    none of them."""
    names = {name.strip().lower() for name in text.split(",") if name.strip()}
    if unknown := sorted(names - set(SINK_NAMES)):
        raise ValueError(
            f"unknown tracking sink {unknown[0]!r}: choose from {', '.join(SINK_NAMES)}"
        )
    return [name for name in SINK_NAMES if name in names]


def _sink_list(text: str) -> str:
    sink_names(text)
    return text


class TrackSettings(BaseSettings):
    """`marlaas track`'s defaults, per deployment."""

    model_config = SettingsConfigDict(env_prefix="MARLAAS_TRACK_", extra="ignore")

    to: Annotated[str, AfterValidator(_sink_list)] = "tensorboard,mlflow"
    """The sinks written when `--to` names none, comma-separated: tensorboard, mlflow, wandb,
    trackio."""
    wandb_mode: str = Field("offline", validation_alias="WANDB_MODE")
    """W&B's own variable: `offline` (files for `wandb sync`, nothing sent) or `online` (runs
    sent to W&B as they are written; needs WANDB_API_KEY). Checked when W&B is written."""


def chosen_sinks(to: str, default: str, *, tensorboard: bool | None, mlflow: str) -> list[str]:
    """The sinks of `--to` (else `default`, the deployment's), with TensorBoard added or left
    out by `--tensorboard`/`--no-tensorboard`, MLflow added by `--mlflow URI` or left out
    by `--mlflow off`; ValueError when none is left."""
    names = set(sink_names(to or default))
    if tensorboard is True:
        names.add("tensorboard")
    elif tensorboard is False:
        names.discard("tensorboard")
    if mlflow == "off":
        names.discard("mlflow")
    elif mlflow:
        names.add("mlflow")
    if not names:
        raise ValueError("nothing to write: no tracking sink left (--to, --mlflow off, ...)")
    return [name for name in SINK_NAMES if name in names]


def open_sinks(names: Sequence[str], out: Path, *, mlflow_uri: str, wandb_mode: str) -> list[Sink]:
    """The named sinks, writing under `out`: `tensorboard/`, `wandb/`, `trackio/` (and the
    MLflow store at `mlflow_uri`); TrackingUnavailableError when a sink's package is
    missing."""
    openers: dict[str, Callable[[], Sink]] = {
        "tensorboard": lambda: TensorBoardSink(out / "tensorboard"),
        "mlflow": lambda: MlflowSink(mlflow_uri),
        "wandb": lambda: WandbSink(out, wandb_mode),
        "trackio": lambda: TrackioSink(out / "trackio"),
    }
    out.mkdir(parents=True, exist_ok=True)
    return [openers[name]() for name in names]
