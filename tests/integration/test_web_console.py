"""The web console in a real browser (Debian's chromium, headless, over the DevTools
protocol: tests/browser.py), against the real stack.

`marlaas up`'s stack of its own (broker, Valkey, the three services and the tenant API as
processes, each its own Redis user), with the deterministic engine of tests/agent_engine.py
(a model that has learnt the agentic examples, so episodes hold real tool calls). Its own,
not the session's: services of another deployment on the same Redis would issue groups for
its jobs. A tenant with two jobs (one calls an MCP server's tool and is judged, one is a
verifiers taskset) signs in with its key, and the page shows both jobs' curves and episode
samples; pause, resume and cancel are clicked; then another tenant's key sees none of it.
Screenshots go to $MARLAAS_TEST_ARTIFACTS, else tests/artifacts/ (kept out of git).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from common.files.models import tiny_model
from common.runtime.config import SharedSettings
from common.state.store import RedisStore
from common.state.tenants import TenantLimits
from common.wire.lifecycle import SERVICES
from common.wire.messages import EnvSettings, JobSpec, new_id
from console.demo import job_spec
from console.stack.local import LocalStack
from marlaas.api_client import TenantClient
from tests.agentic import operator_registrations
from tests.browser import Page, browser_page

pytestmark = pytest.mark.kafka

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("MARLAAS_TEST_ARTIFACTS") or ROOT / "tests" / "artifacts")
STEPS_SEEN = 2
"""Steps (and evaluated versions past the base) each job has before the page is checked."""


def console_job(name: str, env: EnvSettings, *, max_steps: int) -> JobSpec:
    return job_spec(
        f"web-{name}-{new_id()[:8]}",
        "",  # the API stamps the key's tenant
        env,
        lora_rank=4,
        eval_tasks=2,
        eval_every_steps=1,
        group_size=2,
        groups_per_step=2,
        max_steps=max_steps,
        max_staleness=1,
        max_context_tokens=512,
        max_new_tokens=48,
    )


async def add_tenant(redis_url: str, name: str) -> str:
    """`marlaas tenants add NAME`: the tenant's API key."""
    store = await RedisStore.connect(redis_url, timeout_s=10)
    try:
        await store.tenants.add(name, TenantLimits())
        return (await store.tenants.issue_key(name)).token
    finally:
        await store.close()


async def wait_for_job(
    client: TenantClient, job_id: str, *, done: Any, what: str, timeout_s: float = 300.0
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while not done(view := await client.job(job_id)):
        assert time.monotonic() < deadline, f"{job_id}: waited {timeout_s:.0f}s for {what}: {view}"
        await asyncio.sleep(1.0)
    return view


async def answering(url: str, timeout_s: float = 120.0) -> str:
    """`url` once the tenant API answers there (the stack starts it as a process)."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=url, timeout=5) as http:
        while True:
            try:
                if (await http.get("/openapi.json")).status_code == 200:
                    return url
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"the tenant API at {url} did not answer"
            await asyncio.sleep(0.5)


def trained_and_evaluated(view: dict[str, Any]) -> bool:
    return view["version"] >= STEPS_SEEN and len(view["evals"]) >= STEPS_SEEN


async def sign_in(page: Page, key: str, tenant: str) -> None:
    await page.wait_for("!document.getElementById('sign-in-view').hidden", what="the key form")
    await page.type_into("#key-input", key)
    await page.click("#sign-in-form button[type=submit]")
    await page.wait_for(
        f"document.getElementById('tenant-name').textContent === 'tenant {tenant}' "
        "&& Number(document.body.dataset.refreshes) >= 1",
        what=f"{tenant}'s jobs",
    )


def series(chart: str, job_id: str) -> str:
    """The points the page's `chart` draws for `job_id` (data-values: [[x, y], ...])."""
    path = f'[data-chart-card="{chart}"] svg path[data-series="{job_id}"]'
    return f"JSON.parse(document.querySelector({json.dumps(path)})?.dataset.values ?? '[]')"


def state_shown(job_id: str) -> str:
    cell = f'tr[data-job="{job_id}"] [data-field="state"]'
    return f"document.querySelector({json.dumps(cell)})?.textContent"


async def test_a_tenant_watches_and_steers_two_jobs_in_the_browser_and_another_sees_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in operator_registrations().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("ROLLOUT_ENGINE", "tests.agent_engine:AgentEngine")
    settings = SharedSettings(
        state_dir=tmp_path / "stack", base_model=str(tiny_model()), connect_timeout_s=60
    )
    tenant, other = f"web-{new_id()[:6]}", f"other-{new_id()[:6]}"
    units = console_job(
        "units",
        EnvSettings(name="unit_conversion", params={"judge_weight": 0.5}),
        max_steps=500,  # still running when pause is clicked: cancelled at the end
    )
    arith = console_job(
        "arith", EnvSettings(name="verifiers", params={"taskset": "mini-arith"}), max_steps=3
    )
    started = time.monotonic()
    async with LocalStack(settings, use_existing_from_env=False, services=SERVICES) as stack:
        key = await add_tenant(stack.redis_url, tenant)
        other_key = await add_tenant(stack.redis_url, other)
        url = await answering(stack.api_url)
        async with TenantClient(url, key) as client:
            await client.submit([units, arith])
            for job in (units, arith):
                await wait_for_job(
                    client,
                    job.job_id,
                    done=trained_and_evaluated,
                    what=f"{STEPS_SEEN} steps and evaluations",
                )
            async with browser_page(tmp_path / "chromium") as page:
                await page.navigate(f"{url}/console")
                await sign_in(page, key, tenant)
                await check_the_tenants_page(page, client, key, units, arith)
                await steer(page, client, units)
                await check_another_tenant_sees_none(
                    page, url, other_key, other, [units.job_id, arith.job_id]
                )
                assert page.errors == [], page.errors  # no CSP refusal, no script error
    print(f"web console test: {time.monotonic() - started:.0f} s, the stack's start included")


async def check_the_tenants_page(
    page: Page, client: TenantClient, key: str, units: JobSpec, arith: JobSpec
) -> None:
    # The key is in the tab's session storage, never in the address.
    assert await page.evaluate("sessionStorage.getItem('marlaas.console.key')") == key
    assert key not in await page.evaluate("location.href")
    for job in (units, arith):
        await page.wait_for(
            f"{series('reward', job.job_id)}.length >= {STEPS_SEEN}", what=f"{job.job_id} rewards"
        )
        rewards = await page.evaluate(series("reward", job.job_id))
        assert [step for step, _ in rewards][:STEPS_SEEN] == list(range(1, STEPS_SEEN + 1))
        accuracy = await page.evaluate(series("eval", job.job_id))
        assert [version for version, _ in accuracy][:STEPS_SEEN] == list(range(STEPS_SEEN))
        assert {value for _, value in accuracy} == {1.0}  # the engine has learnt both tasks
        shown = await page.evaluate(
            f"""[...document.querySelectorAll('tr[data-job="{job.job_id}"] td.num')]"""
            ".map(cell => cell.textContent)"
        )
        assert float(shown[0]) > 0 and shown[1].startswith("1.000 · v"), shown  # last reward
    busy = await page.evaluate(
        """[...document.querySelectorAll('[data-chart-card="utilisation"] svg path')]"""
        ".map(path => JSON.parse(path.dataset.values).length)"
    )
    assert busy and max(busy) >= 1, busy  # the trainer's busy share at least

    # The tool-using job's episodes: the call the model wrote, what the tool gave back, and
    # the reward's components.
    await page.click(f'tr[data-job="{units.job_id}"] td')
    await page.wait_for(
        f"""!!document.querySelector('#samples article[data-episode^="{units.job_id}/"]')""",
        what="the units job's episodes",
    )
    episode = await page.evaluate(
        """(() => {
            const card = document.querySelector('#samples article.episode');
            return {
                sources: [...card.querySelectorAll('.turn')].map(t => t.dataset.source),
                labels: [...card.querySelectorAll('.turn-label')].map(l => l.textContent),
                tools: [...card.querySelectorAll('.tool-call')].map(t => t.dataset.tool),
                chips: [...card.querySelectorAll('.chip')].map(c => c.dataset.component),
                reward: card.querySelector('[data-field="reward"]').textContent,
                result: card.querySelector('.turn-environment pre')?.textContent ?? '',
            };
        })()"""
    )
    assert episode["sources"] == ["prompt", "model", "environment", "model"], episode
    assert episode["labels"][2] == "Tool result" and episode["tools"] == ["units.convert"]
    assert {"correct", "judged", "tools.calls", "tools.errors"} <= set(episode["chips"]), episode
    assert episode["reward"] == "reward 1.400", episode  # correct 1 + 0.5 x judged 0.8
    assert any(c.isdigit() for c in episode["result"]), episode  # the converted value
    samples = await client.episodes(units.job_id, limit=3)
    assert await page.evaluate("document.querySelectorAll('#samples article').length") >= 1
    assert samples and samples[0]["turns"][1]["tool_calls"][0]["name"] == "units.convert"

    await page.evaluate("window.scrollTo(0, 0)")
    await page.screenshot(ARTIFACTS / "web-console.png")
    await page.screenshot(ARTIFACTS / "web-console-full.png", full_page=True)

    await page.click(f'tr[data-job="{arith.job_id}"] td')
    await page.wait_for(
        f"""!!document.querySelector('#samples article[data-episode^="{arith.job_id}/"]')""",
        what="the taskset job's episodes",
    )
    chips = await page.evaluate(
        "[...document.querySelectorAll('#samples article .chip')].map(c => c.textContent)"
    )
    assert "correct 1.000" in chips and "reply_words 1.000" in chips, chips


async def steer(page: Page, client: TenantClient, units: JobSpec) -> None:
    """Pause, resume and cancel the running job with the page's buttons; the API agrees."""
    for action, state in (("pause", "paused"), ("resume", "running")):
        await page.click(f'tr[data-job="{units.job_id}"] button[data-action="{action}"]')
        await wait_for_job(
            client, units.job_id, done=lambda v, s=state: v["status"] == s, what=state, timeout_s=60
        )
        await page.wait_for(f"{state_shown(units.job_id)} === '{state}'", what=f"'{state}' shown")
    assert page.dialogs == []
    await page.click(f'tr[data-job="{units.job_id}"] button[data-action="cancel"]')
    await wait_for_job(
        client, units.job_id, done=lambda v: v["status"] == "cancelled", what="cancelled"
    )
    await page.wait_for(f"{state_shown(units.job_id)} === 'cancelled'", what="'cancelled' shown")
    assert len(page.dialogs) == 1 and units.job_id in page.dialogs[0]  # asked first
    assert await page.evaluate(  # nothing left to do to an ended job
        f"""document.querySelectorAll('tr[data-job="{units.job_id}"] [data-action]')"""
        ".length === 1"  # its export
    )


async def check_another_tenant_sees_none(
    page: Page, url: str, key: str, tenant: str, job_ids: list[str]
) -> None:
    await page.click("#sign-out")
    await sign_in(page, key, tenant)
    await page.wait_for(
        "!document.getElementById('jobs-empty').hidden && "
        "!!document.querySelector('[data-chart-card=\"reward\"] svg')",
        what="an empty job list",
    )
    assert await page.evaluate("document.querySelectorAll('tr[data-job]').length") == 0
    assert await page.evaluate("document.querySelectorAll('svg path[data-series]').length") == 0
    text = await page.evaluate("document.documentElement.outerHTML")
    assert not [job_id for job_id in job_ids if job_id in text]
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as http:
        charts = await http.get("/console/charts")
        assert charts.status_code == 200 and not [j for j in job_ids if j in charts.text]
        for job_id in job_ids:
            refused = await http.get(f"/v1/jobs/{job_id}/episodes")
            assert refused.status_code == 404, refused.text
