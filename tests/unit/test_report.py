"""The HTML report, parsed: charts carry the events' exact numbers; CSV and JSON agree."""

from __future__ import annotations

import csv
import json
from html.parser import HTMLParser
from pathlib import Path

import msgspec

from common.messages import EnvSettings, Event, JobSpec, RLSettings, job_event
from common.report import build_report, write_report

T0 = 1_800_000_000.0


def at(event: Event, seconds: float) -> Event:
    return msgspec.structs.replace(event, at=T0 + seconds)


def step(job_id: str, n: int, reward: float, seconds: float, staleness: int = 0) -> Event:
    metrics = {
        "mean_reward": reward,
        "staleness_max": float(staleness),
        "tokens": 800.0,
        "step_s": 4.0,
        "loss": 0.5 - n / 10,
    }
    return at(
        job_event(job_id, "step", "trainer_svc", tenant="acme", step=n, metrics=metrics), seconds
    )


def spec(job_id: str, env: str) -> JobSpec:
    return JobSpec(
        job_id=job_id,
        tenant="acme",
        base_model="m",
        env=EnvSettings(name=env),
        rl=RLSettings(max_steps=3),
    )


REWARDS = {"job-a": [0.125, 0.5, 0.75], "job-b": [0.25, 0.0]}
EVENTS = [
    at(job_event("job-a", "accepted", "env_svc", tenant="acme"), 0),
    *[
        step("job-a", i + 1, r, 10 * (i + 1), staleness=i % 2)
        for i, r in enumerate(REWARDS["job-a"])
    ],
    at(job_event("job-a", "dropped_stale", "trainer_svc", tenant="acme", reason="g3"), 25),
    at(job_event("job-a", "completed", "trainer_svc", tenant="acme", step=3), 31),
    at(job_event("job-b", "accepted", "env_svc", tenant="acme"), 2),
    *[step("job-b", i + 1, r, 12 * (i + 1)) for i, r in enumerate(REWARDS["job-b"])],
    at(
        job_event(
            "job-evil", "rejected", "env_svc", tenant="<b>x</b>", reason="<script>alert(1)</script>"
        ),
        3,
    ),
]
HISTORY = {
    "replica-1": [
        {"at": T0 + 5, "busy_s": 1.0, "uptime_s": 5.0, "generated_tokens": 100.0, "in_flight": 4},
        {"at": T0 + 10, "busy_s": 5.0, "uptime_s": 10.0, "generated_tokens": 600.0, "in_flight": 8},
        # restarted: counters begin again; no interval across the restart
        {"at": T0 + 15, "busy_s": 0.5, "uptime_s": 2.0, "generated_tokens": 10.0, "in_flight": 1},
        {"at": T0 + 20, "busy_s": 3.0, "uptime_s": 7.0, "generated_tokens": 210.0, "in_flight": 2},
    ]
}


class Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.charts: dict[str, dict[str, list[list[float]]]] = {}
        self.texts: dict[str, list[str]] = {}
        self.cells: list[tuple[str, str]] = []
        self.tags: set[str] = set()
        self._chart = ""
        self._field: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        self.tags.add(tag)
        if tag == "svg":
            self._chart = found.get("data-chart") or ""
            self.charts[self._chart] = {}
        if "data-series" in found:
            self.charts[self._chart][found["data-series"] or ""] = json.loads(
                found["data-values"] or ""
            )
        self._field = found.get("data-field")

    def handle_data(self, data: str) -> None:
        if self._chart:
            self.texts.setdefault(self._chart, []).append(data)
        if self._field is not None:
            self.cells.append((self._field, data))

    def handle_endtag(self, tag: str) -> None:
        if tag == "svg":
            self._chart = ""
        self._field = None


def written(tmp_path: Path, events: list[Event], history: dict | None = None) -> Page:  # type: ignore[type-arg]
    specs = {"job-a": spec("job-a", "arithmetic"), "job-b": spec("job-b", "calculator")}
    report = build_report(events, history, specs=specs, generated_at=T0 + 60)
    index = write_report(report, tmp_path)
    assert index == tmp_path / "index.html"
    page = Page()
    page.feed(index.read_text())
    return page


def test_charts_carry_the_exact_numbers_of_the_events(tmp_path: Path) -> None:
    events = [*EVENTS, EVENTS[1], EVENTS[2]]  # redelivered step events count once
    page = written(tmp_path, events, HISTORY)
    assert set(page.charts) == {"reward", "staleness", "throughput", "utilisation"}
    for job_id, rewards in REWARDS.items():
        assert page.charts["reward"][job_id] == [[i + 1, r] for i, r in enumerate(rewards)]
    assert page.charts["staleness"]["job-a"] == [[1, 0.0], [2, 1.0], [3, 0.0]]
    assert page.charts["throughput"]["trainer job-a"] == [
        [10.0, 200.0],
        [20.0, 200.0],
        [30.0, 200.0],
    ]
    # utilisation over intervals: (5-1)/(10-5) = 0.8, then after the restart (3-0.5)/(7-2) = 0.5
    assert page.charts["utilisation"]["replica-1"] == [[10.0, 0.8], [20.0, 0.5]]
    assert page.charts["throughput"]["rollout replica-1"] == [[10.0, 100.0], [20.0, 40.0]]


def test_the_summary_table_matches_the_events(tmp_path: Path) -> None:
    page = written(tmp_path, EVENTS, HISTORY)
    rows: list[dict[str, str]] = []
    for name, value in page.cells:
        if name == "job_id":
            rows.append({})
        rows[-1][name] = value
    by_job = {row["job_id"]: row for row in rows}
    assert by_job["job-a"]["state"] == "completed" and by_job["job-a"]["env"] == "arithmetic"
    assert (by_job["job-a"]["steps"], by_job["job-a"]["best_reward"]) == ("3", "0.750")
    assert (by_job["job-a"]["first_reward"], by_job["job-a"]["dropped_groups"]) == ("0.125", "1")
    assert by_job["job-b"]["state"] == "running" and by_job["job-b"]["last_reward"] == "0.000"
    assert by_job["job-evil"]["state"] == "rejected"
    assert by_job["job-evil"]["reason"] == "<script>alert(1)</script>"  # shown as text


def test_user_text_is_escaped_and_nothing_is_fetched(tmp_path: Path) -> None:
    page = written(tmp_path, EVENTS, HISTORY)
    text = (tmp_path / "index.html").read_text()
    assert "script" not in page.tags and "<script>" not in text and "<b>x</b>" not in text
    assert "http://" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "https://" not in text and "<link" not in text and "src=" not in text


def test_csv_and_json_hold_the_same_numbers(tmp_path: Path) -> None:
    written(tmp_path, [*EVENTS, EVENTS[1]], HISTORY)
    with (tmp_path / "steps.csv").open() as steps_file:
        steps = list(csv.DictReader(steps_file))
    assert [(r["job_id"], int(r["step"]), float(r["mean_reward"])) for r in steps] == [
        (job_id, i + 1, reward)
        for job_id, rewards in sorted(REWARDS.items())
        for i, reward in enumerate(rewards)
    ]
    assert float(steps[0]["trainer_tokens_per_s"]) == 200.0 and steps[0]["samples"] == ""
    with (tmp_path / "utilisation.csv").open() as util_file:
        assert [float(r["utilisation"]) for r in csv.DictReader(util_file)] == [0.8, 0.5]
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["generated_at"] == T0 + 60
    assert [s["mean_reward"] for s in data["steps"] if s["job_id"] == "job-a"] == REWARDS["job-a"]
    assert {j["job_id"]: j["dropped_groups"] for j in data["jobs"]}["job-a"] == 1


def test_no_events_still_make_a_report_with_empty_charts(tmp_path: Path) -> None:
    report = build_report([], None)
    page = Page()
    page.feed(write_report(report, tmp_path).read_text())
    assert set(page.charts) == {"reward", "staleness", "throughput", "utilisation"}
    assert all(series == {} for series in page.charts.values())
    assert all("no data" in page.texts[chart] for chart in page.charts)
    assert (tmp_path / "steps.csv").read_text().startswith("job_id,tenant,step,")
