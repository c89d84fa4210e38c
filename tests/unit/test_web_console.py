"""api_svc/web/: the console's files and headers, its routes without a stack, and the charts
it is sent. The page in a real browser against a real stack: tests/integration/test_web_console.py.
"""

from __future__ import annotations

import json
import math
import re
import tomllib
from html.parser import HTMLParser
from pathlib import Path

import msgspec
import pytest
from fastapi.testclient import TestClient

from api_svc.server import create_app
from api_svc.web.curves import CONSOLE_SIZE, MAX_JOBS_CHARTED, SHOWN, charted, console_charts
from api_svc.web.page import CONTENT_SECURITY_POLICY, MEDIA_TYPES, STATIC, asset
from common.runtime.config import SharedSettings
from common.state.registry import JobRecord
from common.state.tenants import TenantLimits
from common.wire.jobspec import AdmittedJob
from common.wire.messages import EnvSettings, Event, JobSpec, RLSettings, job_event
from console.demo import demo_keys
from marlaas.report.numbers import build_report
from tests.fakes import memory_store

ROOT = Path(__file__).resolve().parents[2]
FILES = {name: (STATIC / name).read_text(encoding="utf-8") for name in MEDIA_TYPES}
PAGE, SCRIPT = FILES["console.html"], FILES["console.js"]


# --- the files ---------------------------------------------------------------------------


def test_every_file_under_static_is_served_and_installed_with_the_package() -> None:
    assert sorted(p.name for p in STATIC.iterdir()) == sorted(MEDIA_TYPES)
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert package_data["package-data"]["api_svc.web"] == ["static/*"]
    assert asset("console.css") == (
        (STATIC / "console.css").read_bytes(),
        MEDIA_TYPES["console.css"],
    )
    for name in ("../page.py", "__init__.py", "console.js.map", "", "%2e%2e/page.py"):
        assert asset(name) is None, name


class Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []
        self.inline_scripts = 0
        self.attributes: set[str] = set()
        self.inputs: list[dict[str, str | None]] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        self.attributes |= set(found)
        self.urls += [v for k, v in attrs if k in ("src", "href", "action") and v]
        self._in_script = tag == "script"
        if tag == "input":
            self.inputs.append(found)

    def handle_data(self, data: str) -> None:
        if self._in_script and data.strip():
            self.inline_scripts += 1

    def handle_endtag(self, tag: str) -> None:
        self._in_script = False


def test_the_page_loads_nothing_from_elsewhere_and_runs_under_its_policy() -> None:
    links = Links()
    links.feed(PAGE)
    assert links.urls, "the page links its style sheet and script"
    for url in links.urls:
        assert url.startswith(("/console/static/", "data:", "#")), url  # no CDN, no other host
    assert links.inline_scripts == 0  # `script-src 'self'` would refuse it
    assert "style" not in links.attributes  # `style-src 'self'` would refuse it
    assert not [a for a in links.attributes if a.startswith("on")]  # no inline handlers
    for text in (FILES["console.css"], SCRIPT):
        assert not re.search(r"@import|url\(\s*['\"]?(https?:)?//", text)
        # The one absolute URL anywhere: the SVG namespace, a name, never fetched.
        assert set(re.findall(r"https?://[^\s\"'`]+", text)) <= {"http://www.w3.org/2000/svg"}
    directives = dict(d.split(" ", 1) for d in CONTENT_SECURITY_POLICY.split("; "))
    assert directives["script-src"] == directives["style-src"] == "'self'"
    assert directives["default-src"] == "'none'" and directives["frame-ancestors"] == "'none'"
    assert "unsafe" not in CONTENT_SECURITY_POLICY


def test_the_key_is_asked_for_in_a_form_that_sends_nothing_and_kept_for_the_tab_only() -> None:
    links = Links()
    links.feed(PAGE)
    (key_input,) = links.inputs
    assert key_input["type"] == "password" and "name" not in key_input  # never a form field
    assert "form-action 'none'" in CONTENT_SECURITY_POLICY
    assert "sessionStorage" in SCRIPT and "localStorage" not in SCRIPT
    assert "document.cookie" not in SCRIPT
    assert 'credentials: "omit"' in SCRIPT and "Authorization: `Bearer ${key}`" in SCRIPT


def test_the_script_writes_what_the_server_sends_as_text_never_as_markup() -> None:
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in SCRIPT, sink
    assert "new Function" not in SCRIPT and 'setTimeout("' not in SCRIPT
    # The charts are the one markup: parsed into a document (scripts there never run) and
    # taken only when it is an SVG.
    assert SCRIPT.count("parseFromString(") == 1 and "namespaceURI !== SVG" in SCRIPT


# --- the routes ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def http() -> TestClient:
    """The app, not started: no broker or Redis behind it (the file routes need none)."""
    return TestClient(create_app(SharedSettings()))


def test_the_page_and_its_files_are_served_with_the_console_headers(http: TestClient) -> None:
    for path, name in (
        ("/console", "console.html"),
        ("/console/static/console.css", "console.css"),
        ("/console/static/console.js", "console.js"),
    ):
        answer = http.get(path)
        assert answer.status_code == 200 and answer.text == FILES[name], path
        assert answer.headers["content-type"] == MEDIA_TYPES[name]
        assert answer.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
        assert answer.headers["x-frame-options"] == "DENY"
        assert answer.headers["cache-control"] == "no-store"
        assert answer.headers["x-content-type-options"] == "nosniff"
    for path in ("/console/static/page.py", "/console/static/..%2fpage.py", "/console/static/"):
        assert http.get(path).status_code == 404, path


def test_the_charts_need_a_key_and_the_console_is_not_in_the_api_schema(http: TestClient) -> None:
    refused = http.get("/console/charts")
    assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
    assert http.get("/console/charts", headers={"Authorization": "Basic x"}).status_code == 401
    paths = create_app(SharedSettings()).openapi()["paths"]
    assert not [p for p in paths if p.startswith("/console")]
    assert "/v1/jobs/{job_id}/episodes" in paths


# --- the charts --------------------------------------------------------------------------

T0 = 1_700_000_000.0


def step(job_id: str, n: int, reward: float) -> Event:
    metrics = {"mean_reward": reward, "tokens": 100.0, "step_s": 2.0}
    sent = job_event(job_id, "step", "trainer_svc", tenant="acme", step=n, metrics=metrics)
    return msgspec.structs.replace(sent, at=T0 + 10 * n)


def evaluation(job_id: str, version: int, accuracy: float) -> Event:
    metrics = {"eval_accuracy": accuracy, "eval_accuracy_stderr": 0.1, "eval_episodes": 8.0}
    sent = job_event(job_id, "eval", "env_svc", tenant="acme", step=version, metrics=metrics)
    return msgspec.structs.replace(sent, at=T0 + 10 * version + 5)


def record(job_id: str, created_at: float) -> JobRecord:
    spec = JobSpec(
        job_id=job_id, tenant="acme", env=EnvSettings(name="arithmetic"), rl=RLSettings()
    )
    return JobRecord(AdmittedJob(spec, created_at), "running", "", created_at)


def series_of(svg: str) -> dict[str, list[list[float]]]:
    return {
        name: json.loads(values.replace("&quot;", '"'))
        for name, values in re.findall(r'data-series="([^"]+)"[^>]*data-values="([^"]*)"', svg)
    }


def test_the_console_gets_each_jobs_curves_at_its_card_size_and_json_safe_numbers() -> None:
    events = [step("job-a", 1, 0.25), step("job-a", 2, 0.75), step("job-b", 1, math.nan)]
    events += [evaluation("job-a", 0, 0.5), evaluation("job-a", 2, 0.875)]
    sent = console_charts(build_report(events), left_out=3)
    json.dumps(sent, allow_nan=False)  # strict JSON: the browser parses it
    assert list(sent["charts"]) == list(SHOWN) and sent["left_out"] == 3
    reward = sent["charts"]["reward"]
    assert f'width="{CONSOLE_SIZE.width}"' in reward
    assert series_of(reward) == {"job-a": [[1, 0.25], [2, 0.75]]}  # a NaN is not drawn
    assert series_of(sent["charts"]["eval"]) == {"job-a": [[0, 0.5], [2, 0.875]]}
    assert 'data-series="trainer"' in sent["charts"]["utilisation"]
    assert sent["jobs"]["job-a"] == {
        "state": "running",
        "steps": 2,
        "last_reward": 0.75,
        "best_reward": 0.75,
    }
    assert sent["jobs"]["job-b"]["last_reward"] is None  # NaN: null, not a JSON error


def test_a_tenant_without_jobs_gets_empty_charts_and_only_the_latest_jobs_are_charted() -> None:
    empty = console_charts(build_report([]))
    assert empty["jobs"] == {} and all("no data" in svg for svg in empty["charts"].values())
    records = [record(f"job-{n}", created_at=T0 + n) for n in range(MAX_JOBS_CHARTED + 3)]
    shown = charted(records[::-1][3:] + records[-3:])  # in any order
    assert [r.spec.job_id for r in shown] == [
        f"job-{n}" for n in range(MAX_JOBS_CHARTED + 2, 2, -1)
    ]


# --- the demo's way in ---------------------------------------------------------------------


async def test_the_demo_gives_each_of_its_tenants_a_key_that_signs_in_as_it() -> None:
    store = memory_store()
    try:
        keys = await demo_keys(store, ["acme", "globex"])
        assert [await store.tenants.authenticate(keys[t]) for t in ("acme", "globex")] == [
            "acme",
            "globex",
        ]
        assert await store.tenants.limits("acme") == TenantLimits()  # the demo's jobs fit
    finally:
        await store.close()
