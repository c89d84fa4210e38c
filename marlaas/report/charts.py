"""Inline SVG line charts whose series carry their exact numbers (`data-values`).

Drawn for `marlaas.report.page`; styles are inline so a chart copied out of the page renders the
same. A series may have gaps (segments), and a missing value is left out, never drawn as 0.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

PALETTE = (
    "#1f77b4",
    "#d62728",
    "#2ca02c",
    "#ff7f0e",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#17becf",
    "#7f7f7f",
    "#bcbd22",
)

Point = tuple[float, float]


@dataclass(frozen=True)
class ChartSize:
    """A chart's width in pixels, its legend's (at the right of the plot) and its least
    height (more when the legend needs it). The report's page draws 760 wide; the tenant
    API's web console asks for the width its cards show a chart at, so its text keeps its
    size."""

    width: int = 760
    legend_width: int = 200
    min_height: int = 320


REPORT_SIZE = ChartSize()
"""The report page's charts."""


@dataclass
class Series:
    """One line of a chart; gaps between its segments are not drawn (a replica restart)."""

    name: str
    """Job id or replica name: the `data-series` attribute."""
    label: str
    """Legend text."""
    segments: list[list[Point]]
    source: str = ""
    """`trainer` or `rollout` where one chart mixes both (`data-source`)."""

    @property
    def points(self) -> list[Point]:
        return [point for segment in self.segments for point in segment]


def line_chart(
    chart: str,
    title: str,
    x_label: str,
    y_label: str,
    series: Sequence[Series],
    *,
    whole_x: bool = False,
    whole_y: bool = False,
    size: ChartSize = REPORT_SIZE,
) -> str:
    """An inline SVG line chart; each series' exact numbers ride along in `data-values`."""
    drawn = [s for s in series if s.points]
    legend_h = 18 * len(drawn) + 20
    width, height = size.width, max(size.min_height, legend_h + 78)
    box = _Box(left=64, top=34, width=width - 64 - size.legend_width, height=height - 34 - 44)
    parts = [
        f'<svg class="chart" data-chart="{chart}" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img">',
        f'<text x="{box.left}" y="20" class="title" font-size="14">{html.escape(title)}</text>',
    ]
    if not drawn:
        parts.append(
            f'<text x="{box.left + box.width / 2}" y="{box.top + box.height / 2}" '
            'class="nodata" text-anchor="middle" fill="#999">no data</text></svg>'
        )
        return "".join(parts)
    points = [p for s in drawn for p in s.points]
    box.x_lo, box.x_hi = _span([x for x, _ in points])
    box.y_lo, box.y_hi = _span([y for _, y in points], floor_zero=True)
    parts += _axes(box, x_label, y_label, whole_x=whole_x, whole_y=whole_y)
    for index, one in enumerate(drawn):
        colour = PALETTE[index % len(PALETTE)]
        parts += _series_marks(box, one, colour)
        parts.append(
            _legend_entry(box.left + box.width + 12, box.top + 14 + 18 * index, one, colour)
        )
    parts.append("</svg>")
    return "".join(parts)


@dataclass
class _Box:
    """The plot area in pixels, and the data range it shows."""

    left: float
    top: float
    width: float
    height: float
    x_lo: float = 0.0
    x_hi: float = 1.0
    y_lo: float = 0.0
    y_hi: float = 1.0

    def x(self, value: float) -> float:
        return self.left + (value - self.x_lo) / (self.x_hi - self.x_lo) * self.width

    def y(self, value: float) -> float:
        return self.top + self.height - (value - self.y_lo) / (self.y_hi - self.y_lo) * self.height


def is_number(value: object) -> bool:
    """A finite int or float: something a chart can place."""
    return isinstance(value, int | float) and math.isfinite(value)


def plottable(pairs: Iterable[tuple[float, float | None]]) -> list[Point]:
    """Only points that can be drawn: a missing metric is left out, never drawn as 0."""
    return [(x, y) for x, y in pairs if y is not None and is_number(x) and is_number(y)]


def _axes(box: _Box, x_label: str, y_label: str, *, whole_x: bool, whole_y: bool) -> list[str]:
    # Styles inline, not only in the page's CSS: the SVG stays right when copied out alone.
    parts = [
        f'<rect x="{box.left}" y="{box.top}" width="{box.width}" height="{box.height}" '
        'fill="none" stroke="#bbb"/>'
    ]
    for value, label in _ticks(box.y_lo, box.y_hi, whole=whole_y):
        y = box.y(value)
        parts.append(
            f'<line x1="{box.left}" x2="{box.left + box.width}" y1="{y:.1f}" y2="{y:.1f}" '
            f'stroke="#eee"/><text x="{box.left - 6}" y="{y + 4:.1f}" text-anchor="end" '
            f'font-size="11">{label}</text>'
        )
    for value, label in _ticks(box.x_lo, box.x_hi, whole=whole_x):
        parts.append(
            f'<text x="{box.x(value):.1f}" y="{box.top + box.height + 16}" '
            f'text-anchor="middle" font-size="11">{label}</text>'
        )
    middle_y = box.top + box.height / 2
    parts.append(
        f'<text x="{box.left + box.width / 2}" y="{box.top + box.height + 36}" '
        f'text-anchor="middle" class="axis" font-size="12">{html.escape(x_label)}</text>'
        f'<text x="14" y="{middle_y}" text-anchor="middle" class="axis" font-size="12" '
        f'transform="rotate(-90 14 {middle_y})">{html.escape(y_label)}</text>'
    )
    return parts


def _series_marks(box: _Box, series: Series, colour: str) -> list[str]:
    path = " ".join(
        "M " + " L ".join(f"{box.x(x):.1f},{box.y(y):.1f}" for x, y in segment)
        for segment in series.segments
        if segment
    )
    values = json.dumps([[x, y] for x, y in series.points], allow_nan=False)
    source = f' data-source="{series.source}"' if series.source else ""
    parts = [
        f'<path data-series="{html.escape(series.name)}"{source} '
        f'data-values="{html.escape(values)}" d="{path}" fill="none" stroke="{colour}" '
        'stroke-width="2"/>'
    ]
    # Dots too: a series of one point has no line to show.
    parts += [
        f'<circle cx="{box.x(x):.1f}" cy="{box.y(y):.1f}" r="2.5" fill="{colour}"/>'
        for x, y in series.points
    ]
    return parts


def _legend_entry(x: float, y: float, series: Series, colour: str) -> str:
    return (
        f'<rect x="{x}" y="{y - 9}" width="10" height="10" fill="{colour}"/>'
        f'<text x="{x + 16}" y="{y}" class="legend" font-size="11">'
        f"{html.escape(_short(series.label))}</text>"
    )


def _span(values: Sequence[float], *, floor_zero: bool = False) -> tuple[float, float]:
    lo, hi = min(values), max(values)
    if floor_zero and lo > 0:
        lo = 0.0
    if math.isclose(lo, hi):
        lo, hi = lo - 0.5, hi + 0.5
    return lo, hi


def _ticks(lo: float, hi: float, count: int = 6, *, whole: bool = False) -> list[tuple[float, str]]:
    """Round tick values (1, 2 or 5 times a power of ten apart) within [lo, hi], labelled.

    `whole`: at least 1 apart, for axes of counts such as step numbers (no step 1.5).
    """
    raw = (hi - lo) / max(count - 1, 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    if whole:
        step = max(step, 1)
    decimals = max(0, -math.floor(math.log10(step)))
    first = math.ceil(lo / step - 1e-9) * step
    values = [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]
    return [(v, f"{v:.{decimals}f}") for v in values]


def _short(name: str, limit: int = 26) -> str:
    return name if len(name) <= limit else name[: limit - 1] + "…"
