"""The report, parsed back: charts carry the events' exact numbers; table, CSV and JSON agree."""

from __future__ import annotations

import csv
import json
from html.parser import HTMLParser
from pathlib import Path

import msgspec
import pytest

from common.wire.lifecycle import RolloutReplicaStats
from common.wire.messages import EnvSettings, Event, EventKind, JobSpec, RLSettings, job_event
from marlaas.report.numbers import Report, build_report
from marlaas.report.page import write_report

T0 = 1_800_000_000.0
CHARTS = {"reward", "eval", "staleness", "throughput", "utilisation"} | {
    "entropy", "kl", "clip", "zero_advantage"
}  # fmt: skip
LEARNING_CHARTS = {
    "entropy": "entropy", "kl": "approx_kl", "clip": "clip_fraction",
    "zero_advantage": "zero_advantage_share",
}  # fmt: skip
"""The charts of why a run goes wrong (issue 26), by the step metric each plots."""
EVIL_JOB = 'evil"<job>&'


def event(
    job_id: str, kind: EventKind, seconds: float, *, reason: str = "", tenant: str = "acme"
) -> Event:
    return msgspec.structs.replace(
        job_event(job_id, kind, "env_svc", tenant=tenant, reason=reason), at=T0 + seconds
    )


def step(job_id: str, n: int, reward: float, seconds: float, staleness: int = 0) -> Event:
    metrics = {
        "mean_reward": reward,
        "staleness_max": float(staleness),
        "tokens": 800.0,
        "step_s": 4.0,
        "loss": 0.5 - n / 10,
        "entropy": 1.0 - n / 8,
        "approx_kl": 0.01 * n,
        "clip_fraction": 0.05 * n,
        "zero_advantage_share": 0.25,
    }
    sent = job_event(job_id, "step", "trainer_svc", tenant="acme", step=n, metrics=metrics)
    return msgspec.structs.replace(sent, at=T0 + seconds)


def evaluation(
    job_id: str, version: int, accuracy: float, seconds: float, reason: str = ""
) -> Event:
    metrics = {"eval_accuracy": accuracy, "eval_accuracy_stderr": 0.1, "eval_episodes": 32.0}
    sent = job_event(
        job_id, "eval", "env_svc", tenant="acme", step=version, metrics=metrics, reason=reason
    )
    return msgspec.structs.replace(sent, at=T0 + seconds)


def spec(job_id: str, env: str) -> JobSpec:
    return JobSpec(
        job_id=job_id,
        tenant="acme",
        base_model="m",
        env=EnvSettings(name=env),
        rl=RLSettings(max_steps=3),
    )


SPECS = {"job-a": spec("job-a", "arithmetic"), "job-b": spec("job-b", "calculator")}
REWARDS = {"job-a": [0.125, 0.5, 0.75], "job-b": [0.25, 0.0]}
BELOW = "held-out accuracy 0.250 of v2 is below the base model's 0.750"
EVENTS = [
    event("job-a", "accepted", 0),
    *[
        step("job-a", i + 1, r, 10 * (i + 1), staleness=i % 2)
        for i, r in enumerate(REWARDS["job-a"])
    ],
    event("job-a", "dropped_stale", 25, reason="group g3: 2 versions behind"),
    event("job-a", "completed", 31),
    evaluation("job-a", 0, 0.25, 1),
    evaluation("job-a", 3, 0.5, 33),
    event("job-b", "accepted", 2),
    *[step("job-b", i + 1, r, 12 * (i + 1)) for i, r in enumerate(REWARDS["job-b"])],
    evaluation("job-b", 0, 0.75, 3),
    evaluation("job-b", 2, 0.25, 30, reason=BELOW),
    event(EVIL_JOB, "rejected", 3, reason="<script>alert(1)</script>", tenant="<b>x</b>"),
]
B_HOST, A_HOST = "rollout-b.corp.internal-4242", "rollout-a.corp.internal-77"
"""Replicas by their own names, `<host>-<pid>`; the report numbers them by first sample:
A_HOST (first at +0) is `replica 1`, B_HOST (+5) `replica 2`."""
SAMPLES: dict[str, list[dict[str, float]]] = {
    B_HOST: [
        {"at": T0 + 5, "busy_s": 1.0, "uptime_s": 5.0, "generated_tokens": 100.0, "in_flight": 4}
        | {"compute_s": 1.0, "compute_slots": 2, "request_s": 4.0},
        {"at": T0 + 10, "busy_s": 5.0, "uptime_s": 10.0, "generated_tokens": 600.0, "in_flight": 8}
        # 5 CPU seconds of 2 cores x 5 s; 20 request-seconds in 4 busy seconds
        | {"compute_s": 6.0, "compute_slots": 2, "request_s": 24.0},
        # restarted: its counters began again
        {"at": T0 + 15, "busy_s": 0.5, "uptime_s": 2.0, "generated_tokens": 10.0, "in_flight": 1}
        | {"compute_s": 0.4, "compute_slots": 2, "request_s": 1.0},
        {"at": T0 + 20, "busy_s": 3.0, "uptime_s": 7.0, "generated_tokens": 210.0, "in_flight": 2}
        | {"compute_s": 2.4, "compute_slots": 2, "request_s": 6.0},
    ],
    # A_HOST: a replica from before compute and batch were reported
    A_HOST: [
        {"at": T0 + 0, "busy_s": 0.5, "uptime_s": 1.0, "generated_tokens": 10.0},
        {"at": T0 + 2, "busy_s": 1.5, "uptime_s": 3.0, "generated_tokens": 110.0},
        # restarted within a long gap: counters grew past the old ones, but 40 s of uptime
        # is less than the 60 s since the last sample
        {"at": T0 + 62, "busy_s": 15.0, "uptime_s": 40.0, "generated_tokens": 3000.0},
        {"at": T0 + 72, "busy_s": 20.0, "uptime_s": 50.0, "generated_tokens": 3500.0},
        # busier than the interval (12 s in 10 s) is shown as 1; no token count: no rate
        {"at": T0 + 82, "busy_s": 32.0, "uptime_s": 60.0},
    ],
}
HISTORY = {
    replica: [RolloutReplicaStats.of(sample) for sample in samples]
    for replica, samples in SAMPLES.items()
}


class Page(HTMLParser):
    """What a reader of index.html can check: charts' series, table cells, texts, links."""

    def __init__(self) -> None:
        super().__init__()
        self.charts: dict[str, dict[str, list[list[float]]]] = {}
        self.chart_texts: dict[str, list[str]] = {}
        self.jobs: dict[str, dict[str, str]] = {}
        self.tags: set[str] = set()
        self.attribute_values: list[str] = []
        self._chart = ""
        self._job = ""
        self._field = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = {name: value or "" for name, value in attrs}
        self.tags.add(tag)
        self.attribute_values += found.values()
        if tag == "svg":
            self._chart = found["data-chart"]
            self.charts[self._chart] = {}
        if "data-series" in found:
            # series of one chart are told apart by source where it mixes trainer and rollout
            name = ":".join(filter(None, (found.get("data-source"), found["data-series"])))
            self.charts[self._chart][name] = json.loads(found["data-values"])
        if tag == "tr" and "data-job" in found:
            self._job = found["data-job"]
            self.jobs[self._job] = {}
        self._field = found.get("data-field", "")

    def handle_data(self, data: str) -> None:
        if self._chart:
            self.chart_texts.setdefault(self._chart, []).append(data)
        if self._field:
            self.jobs[self._job][self._field] = data

    def handle_endtag(self, tag: str) -> None:
        if tag == "svg":
            self._chart = ""
        self._field = ""


def parsed(index: Path) -> Page:
    page = Page()
    page.feed(index.read_text(encoding="utf-8"))
    return page


def written(
    tmp_path: Path,
    events: list[Event],
    history: dict[str, list[RolloutReplicaStats]] | None = HISTORY,
) -> Page:
    report = build_report(events, history, specs=SPECS, generated_at=T0 + 100)
    index = write_report(report, tmp_path)
    assert index == tmp_path / "index.html"
    return parsed(index)


def steps_of(job_id: str, metric: str, events: list[Event] = EVENTS) -> list[list[float]]:
    return [[e.step, e.metrics[metric]] for e in events if e.job_id == job_id and e.event == "step"]


def test_charts_carry_the_exact_numbers_of_the_events(tmp_path: Path) -> None:
    page = written(tmp_path, EVENTS)
    assert set(page.charts) == CHARTS
    assert page.charts["reward"] == {job: steps_of(job, "mean_reward") for job in REWARDS}
    assert page.charts["staleness"] == {job: steps_of(job, "staleness_max") for job in REWARDS}
    assert page.charts["eval"] == {"job-a": [[0, 0.25], [3, 0.5]], "job-b": [[0, 0.75], [2, 0.25]]}
    for chart, metric in LEARNING_CHARTS.items():
        assert page.charts[chart] == {job: steps_of(job, metric) for job in REWARDS}, chart
    with (tmp_path / "evals.csv").open(encoding="utf-8") as evals_file:
        rows = list(csv.DictReader(evals_file))
    assert [(r["job_id"], r["version"], r["accuracy"]) for r in rows] == [
        ("job-a", "0", "0.25"),
        ("job-a", "3", "0.5"),
        ("job-b", "0", "0.75"),
        ("job-b", "2", "0.25"),
    ]
    # x: seconds since the report's first event or sample; 800 tokens in 4 s per step
    assert page.charts["throughput"] == {
        "trainer:job-a": [[10.0, 200.0], [20.0, 200.0], [30.0, 200.0]],
        "trainer:job-b": [[12.0, 200.0], [24.0, 200.0]],
        "rollout:replica 2": [[10.0, 100.0], [20.0, 40.0]],
        "rollout:replica 1": [[2.0, 50.0], [72.0, 50.0]],
    }
    assert page.charts["utilisation"] == {
        "rollout:replica 2 utilisation": [[10.0, 0.8], [20.0, 0.5]],
        "rollout:replica 2 compute_utilisation": [[10.0, 0.5], [20.0, 0.2]],
        "rollout:replica 1 utilisation": [[2.0, 0.5], [72.0, 0.5], [82.0, 1.0]],
        # replica 1 reported no compute time: no compute line
        # five steps of 4 s each in the first minute
        "trainer:trainer": [[60.0, 20 / 60]],
    }
    # axis labels, whole-number step ticks and a legend entry per series, all as SVG text
    assert {"step", "mean reward", "1", "2", "3", "job-a", "job-b"} <= set(
        page.chart_texts["reward"]
    )
    assert "1.5" not in page.chart_texts["reward"]
    legend = page.chart_texts["throughput"]
    assert {"trainer: job-a", "trainer: job-b", "rollout: replica 1", "rollout: replica 2"} <= set(
        legend
    )


def test_utilisation_rows_start_a_new_segment_at_each_restart() -> None:
    rows = build_report([], HISTORY).utilisation
    by_replica: dict[str, list[tuple[object, ...]]] = {}
    for r in rows:
        by_replica.setdefault(r.replica, []).append(
            (
                r.segment,
                r.at - T0,
                r.utilisation,
                r.tokens_per_s,
                r.in_flight,
                r.compute_utilisation,
                r.mean_batch,
            )
        )
    assert by_replica == {
        "replica 2": [(0, 10.0, 0.8, 100.0, 8, 0.5, 5.0), (1, 20.0, 0.5, 40.0, 2, 0.2, 2.0)],
        "replica 1": [
            (0, 2.0, 0.5, 50.0, None, None, None),
            (1, 72.0, 0.5, 50.0, None, None, None),
            (1, 82.0, 1.0, None, None, None, None),
        ],
    }
    assert all(r.elapsed_s == r.at - T0 for r in rows)


def test_the_summary_table_matches_the_events(tmp_path: Path) -> None:
    jobs = written(tmp_path, EVENTS).jobs
    assert list(jobs) == ["job-a", "job-b", EVIL_JOB]  # spec'd jobs first
    assert jobs["job-a"] | {"wall_s": "31"} == {
        "job_id": "job-a",
        "tenant": "acme",
        "env": "arithmetic",
        "state": "completed",
        "steps": "3",
        "max_steps": "3",
        "first_reward": "0.125",
        "last_reward": "0.750",
        "best_reward": "0.750",
        "max_staleness": "1.0",
        "dropped_groups": "1",
        "wall_s": "31",
        "reason": "-",
        "best_version": "v3 (0.500)",  # what `export --best` writes
        "below_base": "-",
    }
    assert (jobs["job-b"]["state"], jobs["job-b"]["steps"]) == ("running", "2")
    assert jobs["job-b"]["below_base"] == BELOW  # said where a reader looks
    assert (jobs["job-b"]["best_reward"], jobs["job-b"]["last_reward"]) == ("0.250", "0.000")
    evil = jobs[EVIL_JOB]
    assert (evil["state"], evil["env"], evil["steps"], evil["best_reward"]) == (
        "rejected",
        "-",
        "0",
        "-",
    )
    assert (evil["tenant"], evil["reason"]) == ("<b>x</b>", "<script>alert(1)</script>")


def test_user_text_is_escaped_and_nothing_is_fetched(tmp_path: Path) -> None:
    page = written(tmp_path, EVENTS)
    text = (tmp_path / "index.html").read_text(encoding="utf-8")
    assert "<script" not in text and "<b>" not in text and "<job>" not in text
    assert page.tags <= {
        "html",
        "head",
        "meta",
        "title",
        "style",
        "body",
        "h1",
        "p",
        "a",
        "table",
        "thead",
        "tbody",
        "tr",
        "th",
        "td",
        "svg",
        "text",
        "rect",
        "line",
        "path",
        "circle",
    }
    assert "http" not in text and "url(" not in text and "@import" not in text
    assert not [v for v in page.attribute_values if "//" in v]
    assert {"steps.csv", "utilisation.csv", "report.json"} <= set(page.attribute_values)


def test_redelivered_events_count_once(tmp_path: Path) -> None:
    redelivered = [*EVENTS, *EVENTS[1:5]]  # three steps and the dropped group, same event ids
    page = written(tmp_path, redelivered)
    assert page.charts["reward"]["job-a"] == steps_of("job-a", "mean_reward")
    assert (page.jobs["job-a"]["steps"], page.jobs["job-a"]["dropped_groups"]) == ("3", "1")
    with (tmp_path / "steps.csv").open(encoding="utf-8") as steps_file:
        assert len(list(csv.DictReader(steps_file))) == 5


def test_a_step_trained_again_keeps_its_later_numbers() -> None:
    retrained = step("job-b", 2, 0.375, 26)  # a new event id for a step number already seen
    report = build_report([*EVENTS, retrained], specs=SPECS)
    assert [(r.step, r.mean_reward) for r in report.steps if r.job_id == "job-b"] == [
        (1, 0.25),
        (2, 0.375),
    ]
    job_b = next(j for j in report.jobs if j.job_id == "job-b")
    assert (job_b.steps, job_b.last_reward, job_b.best_reward) == (2, 0.375, 0.375)


def test_csv_and_json_hold_the_same_numbers(tmp_path: Path) -> None:
    written(tmp_path, EVENTS)
    with (tmp_path / "steps.csv").open(encoding="utf-8") as steps_file:
        steps = list(csv.DictReader(steps_file))
    sent = sorted((e for e in EVENTS if e.event == "step"), key=lambda e: (e.job_id, e.step))
    assert [(r["job_id"], r["tenant"], int(r["step"]), float(r["at"])) for r in steps] == [
        (e.job_id, e.tenant, e.step, e.at) for e in sent
    ]
    for row, e in zip(steps, sent, strict=True):
        assert {k: float(row[k]) for k in e.metrics} == e.metrics
    # elapsed since the job's own first event (job-b was accepted at +2)
    assert [float(r["elapsed_s"]) for r in steps] == [10.0, 20.0, 30.0, 10.0, 22.0]
    assert {r["trainer_tokens_per_s"] for r in steps} == {"200.0"}
    assert {r["samples"] for r in steps} == {""}  # not in the events: left empty, not 0

    with (tmp_path / "utilisation.csv").open(encoding="utf-8") as util_file:
        util = list(csv.DictReader(util_file))
    assert [(r["replica"], r["segment"], r["utilisation"]) for r in util] == [
        ("replica 1", "0", "0.5"),
        ("replica 1", "1", "0.5"),
        ("replica 1", "1", "1.0"),
        ("replica 2", "0", "0.8"),
        ("replica 2", "1", "0.5"),
    ]
    assert all(float(r["tokens_per_s"]) >= 0 for r in util if r["tokens_per_s"])

    data = json.loads((tmp_path / "report.json").read_text(encoding="utf-8"))
    assert (data["title"], data["generated_at"], data["started_at"]) == (
        "MARLaaS report",
        T0 + 100,
        T0,
    )
    assert [[s["step"], s["mean_reward"]] for s in data["steps"] if s["job_id"] == "job-a"] == (
        steps_of("job-a", "mean_reward")
    )
    assert data["steps"][0]["samples"] is None
    assert {
        j["job_id"]: (j["steps"], j["best_reward"], j["dropped_groups"]) for j in data["jobs"]
    } == {
        "job-a": (3, 0.75, 1),
        "job-b": (2, 0.25, 0),
        EVIL_JOB: (0, None, 0),
    }
    assert len(data["utilisation"]) == 5


def test_a_diverged_step_is_null_in_json_and_left_off_the_charts(tmp_path: Path) -> None:
    nan = float("nan")
    diverged = job_event(
        "job-c", "step", "trainer_svc", step=1, metrics={"loss": nan, "mean_reward": nan}
    )
    page = written(tmp_path, [diverged], history=None)
    data = json.loads(
        (tmp_path / "report.json").read_text(encoding="utf-8"),
        parse_constant=lambda name: pytest.fail(f"{name} is not JSON"),
    )
    assert (data["steps"][0]["loss"], data["steps"][0]["mean_reward"]) == (None, None)
    job_c = next(job for job in data["jobs"] if job["job_id"] == "job-c")
    assert (job_c["state"], job_c["steps"], job_c["best_reward"]) == ("running", 1, None)
    assert page.charts["reward"] == {} and "no data" in page.chart_texts["reward"]


@pytest.mark.parametrize(
    ("kinds", "state", "reason"),
    [
        ([], "pending", ""),
        (["accepted"], "running", ""),
        (["accepted", "paused"], "paused", ""),
        (["accepted", "paused", "resumed"], "running", ""),
        (["accepted", "cancelled"], "cancelled", ""),
        (["accepted", "failed"], "failed", "why-failed"),
        # a pause stamped just after the trainer's completion does not reopen the job
        (["accepted", "completed", "paused"], "completed", ""),
    ],
)
def test_final_state_is_that_of_the_last_lifecycle_event(
    kinds: list[EventKind], state: str, reason: str
) -> None:
    events = [event("job-a", k, i, reason=f"why-{k}") for i, k in enumerate(kinds)]
    report = build_report(events, specs={"job-a": SPECS["job-a"]})
    assert (report.jobs[0].state, report.jobs[0].reason) == (state, reason)


def test_the_report_names_no_host_of_the_servers(tmp_path: Path) -> None:
    """A tenant gets the report (the API's): the rollout replicas are numbered, not named by
    their hosts, and the time is UTC, not the server's zone."""
    written(tmp_path, EVENTS)
    for path in tmp_path.iterdir():
        text = path.read_text(encoding="utf-8")
        assert "corp.internal" not in text, path.name
    assert "UTC" in (tmp_path / "index.html").read_text(encoding="utf-8")


def test_no_events_still_make_a_report_with_empty_charts(tmp_path: Path) -> None:
    report = build_report([], None, generated_at=T0)
    assert report == Report("MARLaaS report", T0, None)
    page = parsed(write_report(report, tmp_path / "new" / "dir"))
    assert set(page.charts) == CHARTS
    assert all(series == {} for series in page.charts.values())
    assert all("no data" in page.chart_texts[chart] for chart in CHARTS)
    assert page.jobs == {}
    out = tmp_path / "new" / "dir"
    assert (
        (out / "steps.csv")
        .read_text(encoding="utf-8")
        .startswith("job_id,tenant,step,at,elapsed_s,")
    )
    assert (out / "utilisation.csv").read_text(encoding="utf-8").startswith("replica,segment,at,")
    assert json.loads((out / "report.json").read_text(encoding="utf-8"))["jobs"] == []
