"""The CLI driving real services on the tiny model: submit --wait, control, export, report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from common.wire.messages import new_id
from console.cli.main import app
from console.stack.local import LocalStack
from tests.api_server import api_server
from tests.conftest import RunningServices, with_store
from tests.integration.test_readme_client import readme_program

pytestmark = pytest.mark.kafka

JOB_FILE = """
tenant = "cli-tenant"
base_model = "{base_model}"
{job_id}
[env]
name = "{env}"
seed = 5
[rl]
group_size = 4
groups_per_step = 1
max_steps = {max_steps}
max_staleness = 1
learning_rate = 1e-3
max_context_tokens = 128
[rl.sampling]
max_new_tokens = 8
"""


@pytest.fixture
def cli(
    monkeypatch: pytest.MonkeyPatch,
    local_stack: LocalStack,
    pipeline_services: RunningServices,
) -> CliRunner:
    monkeypatch.setenv("MARLAAS_KAFKA_BOOTSTRAP", local_stack.kafka_bootstrap)
    monkeypatch.setenv("MARLAAS_REDIS_URL", local_stack.redis_url)
    settings = pipeline_services.settings
    monkeypatch.setenv("MARLAAS_STATE_DIR", str(settings.state_dir))
    monkeypatch.setenv("MARLAAS_ARTIFACT_DIR", str(settings.artifacts))
    monkeypatch.setenv("MARLAAS_BASE_MODEL", settings.base_model)
    monkeypatch.setenv("MARLAAS_BUS_KEY", settings.bus_key.get_secret_value())
    return CliRunner()


def invoke(runner: CliRunner, *args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, ["--connect-timeout", "5", *args])
    assert "Traceback" not in result.output, result.output
    return result.exit_code, result.stdout, result.stderr


def job_file(
    tmp_path: Path, base_model: str, *, max_steps: int, job_id: str = "", env: str = "arithmetic"
) -> Path:
    path = tmp_path / f"job-{max_steps}.toml"
    path.write_text(
        JOB_FILE.format(
            base_model=base_model,
            max_steps=max_steps,
            env=env,
            job_id=f'job_id = "{job_id}"' if job_id else "",
        )
    )
    return path


def test_submit_wait_follows_a_job_to_completion_then_export_and_report(
    cli: CliRunner, pipeline_services: RunningServices, tmp_path: Path
) -> None:
    path = job_file(tmp_path, pipeline_services.settings.base_model, max_steps=2)
    code, out, err = invoke(cli, "submit", str(path), "--wait")
    assert code == 0, err
    job_id = out.split()[0]
    assert job_id.startswith("cli-tenant-job-2-")

    code, out, _ = invoke(cli, "status", job_id, "--json")
    (row,) = json.loads(out)["jobs"]
    assert (row["state"], row["step"], row["max_steps"], row["in_flight_episodes"]) == (
        "completed",
        2,
        2,
        0,
    )
    assert len(row["rewards"]) == 2

    out_dir = tmp_path / "exported"
    code, out, err = invoke(cli, "export", job_id, "--out", str(out_dir))
    assert code == 0, err
    assert f"adapter v2 -> {out_dir}" in out
    config = json.loads((out_dir / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == pipeline_services.settings.base_model
    assert (out_dir / "adapter_model.safetensors").stat().st_size > 0
    code, _, err = invoke(cli, "export", job_id, "--out", str(out_dir))
    assert code == 1 and err.startswith("error: ") and err.count("\n") == 1  # not empty
    # --best: the trained version with the best held-out accuracy; by default the final one
    # is the only trained version evaluated (the base, 0, has no adapter).
    assert sorted(int(v) for v in row["evals"]) == [0, 2]
    code, out, err = invoke(cli, "export", job_id, "--best", "--out", str(tmp_path / "best"))
    assert code == 0 and f"adapter v2 -> {tmp_path / 'best'}" in out, err
    # --merged: the base with the adapter merged (no PEFT to load it), the adapter beside it,
    # and a card with the job's held-out results.
    merged = tmp_path / "merged"
    code, out, err = invoke(cli, "export", job_id, "--merged", "--out", str(merged))
    assert code == 0 and "adapter v2 merged into" in out and str(merged) in out, err
    assert (merged / "model.safetensors").is_file() and (merged / "tokenizer.json").is_file()
    assert not (merged / "adapter_config.json").exists()
    assert (merged / "adapter" / "adapter_config.json").is_file()
    card = (merged / "README.md").read_text()
    assert "| v2 (this export) |" in card and "| base |" in card
    code, _, err = invoke(cli, "export", job_id, "--merged", "--dtype", "int4", "--out", "x")
    assert code == 1 and "--dtype must be one of" in err and not Path("x").exists()

    code, out, err = invoke(cli, "report", job_id, "--out", str(tmp_path / "report"))
    assert code == 0, err
    steps_csv = (tmp_path / "report" / "steps.csv").read_text().strip().splitlines()
    assert len(steps_csv) == 1 + 2  # header + one row per step

    # An environment no env_svc replica serves is refused before anything is sent.
    unknown = job_file(
        tmp_path, pipeline_services.settings.base_model, max_steps=1, env="no-such-env"
    )
    code, out, err = invoke(cli, "submit", str(unknown))
    assert code == 1 and out == "", out
    assert "unknown environment 'no-such-env'; the deployment's env_svc serves " in err

    code, out, err = invoke(cli, "audit", job_id, "--json")
    assert code == 0, out + err
    accounting = json.loads(out)
    assert accounting["ok"] and accounting["versions"] == 2 and accounting["lost"] == []
    assert accounting["trained_groups"] + accounting["dropped"] == accounting["issued"]


def sample_with_openai(api_url: str, key: str, job_id: str) -> None:
    import openai
    from openai.types.chat import ChatCompletionUserMessageParam

    client = openai.OpenAI(base_url=f"{api_url}/v1", api_key=key, max_retries=0)
    models = [model.id for model in client.models.list()]
    assert {job_id, f"{job_id}@v0", f"{job_id}@v2"} <= set(models), models
    ask: list[ChatCompletionUserMessageParam] = [{"role": "user", "content": "What is 2 + 2?"}]
    chunks = list(
        client.chat.completions.create(
            model=job_id,
            messages=ask,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert text and finishes in (["stop"], ["length"]), chunks
    usage = chunks[-1].usage
    assert usage is not None and 1 <= usage.completion_tokens <= 8
    whole = client.chat.completions.create(
        model=f"{job_id}@v1",
        messages=ask,
        max_tokens=8,
    )
    assert whole.choices[0].message.content and whole.model.endswith("@v1")
    pieces = list(
        client.completions.create(model=job_id, prompt="2 + 2 =", max_tokens=8, stream=True)
    )
    assert "".join(c.choices[0].text for c in pieces if c.choices)
    assert pieces[-1].choices[0].finish_reason in ("stop", "length")


def test_a_job_of_a_pip_installed_environment_runs_to_completion(
    cli: CliRunner,
    pipeline_services: RunningServices,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The README's "Write an environment" example, pip-installed where env_svc runs (the
    fixture) and here, where `submit` checks the job's params, trains like a built-in."""
    monkeypatch.syspath_prepend(str(pipeline_services.environments_site))
    try:
        code, out, _ = invoke(cli, "envs")
        assert code == 0 and "reverse_env:ReverseEnv" in out
        path = job_file(tmp_path, pipeline_services.settings.base_model, max_steps=2, env="reverse")
        code, out, err = invoke(cli, "submit", str(path), "--wait")
        assert code == 0, out + err
        job_id = out.split()[0]
        code, out, _ = invoke(cli, "status", job_id, "--json")
        (row,) = json.loads(out)["jobs"]
        assert (row["env"], row["state"], row["step"]) == ("reverse", "completed", 2)
        code, out, _ = invoke(cli, "audit", job_id)
        assert code == 0, out
    finally:
        sys.modules.pop("reverse_env", None)


def test_pause_resume_cancel_are_applied_by_env_svc(
    cli: CliRunner, pipeline_services: RunningServices, local_stack: LocalStack, tmp_path: Path
) -> None:
    path = job_file(tmp_path, pipeline_services.settings.base_model, max_steps=200)
    code, out, _ = invoke(cli, "submit", str(path))
    job_id = out.split()[0]
    deadline = time.monotonic() + 120
    while with_store(local_stack.redis_url, lambda r: r.jobs.get(job_id)) is None:
        assert time.monotonic() < deadline, "env_svc never registered the job"
        time.sleep(0.5)

    code, out, err = invoke(cli, "pause", job_id)
    assert (code, out.strip()) == (0, f"job {job_id}: paused"), err
    issued = with_store(local_stack.redis_url, lambda r: r.flow.state(job_id)).issued_groups
    time.sleep(4)  # training goes on with what is in flight; no new group is issued
    assert with_store(local_stack.redis_url, lambda r: r.flow.state(job_id)).issued_groups == issued

    code, out, _ = invoke(cli, "resume", job_id)
    assert (code, out.strip()) == (0, f"job {job_id}: running")
    code, out, _ = invoke(cli, "cancel", job_id)
    assert (code, out.strip()) == (0, f"job {job_id}: cancelled")
    code, _, err = invoke(cli, "resume", job_id)
    assert code == 1
    assert err == f"error: job '{job_id}' is already cancelled; nothing to resume\n"

    code, out, _ = invoke(cli, "logs", job_id)
    kinds = [line.split()[3] for line in out.strip().splitlines()]
    assert kinds[0] == "accepted"
    assert [k for k in kinds if k in ("paused", "resumed", "cancelled")] == [
        "paused",
        "resumed",
        "cancelled",
    ]


def test_the_operator_adds_a_tenant_who_then_works_through_the_api_only(
    cli: CliRunner, pipeline_services: RunningServices, local_stack: LocalStack, tmp_path: Path
) -> None:
    """README, "Tenants": `marlaas tenants add` prints a key; with MARLAAS_API_URL and that
    key the same CLI submits, watches, exports and samples through the tenant API, and
    refuses the operator's commands."""
    tenant = f"cli-api-{new_id()[:6]}"
    code, out, err = invoke(cli, "tenants", "add", tenant, "--max-steps", "5")
    assert code == 0, err
    assert f"tenant {tenant}: max_concurrent_jobs=4" in out and "max_steps=5" in out
    key = out.split("API key (shown once; give it to the tenant): ")[1].split()[0]
    code, out, _ = invoke(cli, "tenants", "list")
    assert f"{tenant}  active  keys=" in out

    settings = pipeline_services.settings.model_copy(
        update={
            "kafka_bootstrap": local_stack.kafka_bootstrap,
            "redis_url": local_stack.redis_url_for("api"),
        }
    )
    with api_server(settings) as url:
        api = ["--api-url", url, "--api-key", key]
        path = job_file(tmp_path, settings.base_model, max_steps=2)
        path.write_text(path.read_text().replace('tenant = "cli-tenant"', f'tenant = "{tenant}"'))
        code, out, err = invoke(cli, *api, "submit", str(path), "--wait")
        assert code == 0, out + err
        job_id = out.split()[0]
        assert f"{job_id}  {tenant}  arithmetic  completed  v2/2" in out
        # --wait ends once the final evaluation is in, and says it (it ended at "completed").
        final = out.strip().splitlines()[-1]
        assert "completed  v2/2  held-out v2 " in final and " (base " in final, out
        code, out, _ = invoke(cli, *api, "status")
        assert f"{job_id}  {tenant}  arithmetic  completed  v2/2" in out
        # The official OpenAI client with the tenant's key: its models, a streamed and a
        # whole chat completion from its adapter (the README's example).
        sample_with_openai(url, key, job_id)
        program = readme_program("Sampling with an OpenAI client")
        (tmp_path / "openai_example.py").write_text(program)
        env = os.environ | {"MARLAAS_API_URL": url, "MARLAAS_API_KEY": key, "JOB": job_id}
        done = subprocess.run(
            [sys.executable, "openai_example.py"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"'{job_id}@v2'" in done.stdout.splitlines()[0]
        code, out, _ = invoke(cli, *api, "logs", job_id)
        assert "accepted" in out and "completed" in out
        code, out, err = invoke(cli, *api, "export", job_id, "--out", str(tmp_path / "a"))
        assert code == 0 and f"adapter v2 -> {tmp_path / 'a'}" in out, err
        assert (tmp_path / "a" / "adapter_model.safetensors").stat().st_size > 0
        code, _, err = invoke(cli, *api, "audit", job_id)
        assert code == 1 and "needs the operator's Kafka and Redis access" in err
        code, _, err = invoke(cli, *api, "pause", "someone-elses-job")
        assert code == 1 and f"no job 'someone-elses-job' of tenant '{tenant}'" in err
        over = path.read_text().replace("max_steps = 2", "max_steps = 6")
        (tmp_path / "over.toml").write_text(over.replace('job_id = "', 'job_id = "x'))
        code, _, err = invoke(cli, *api, "submit", str(tmp_path / "over.toml"))
        assert code == 1 and "quota max_steps: rl.max_steps 6 exceeds the limit 5" in err

    code, _, err = invoke(cli, "tenants", "revoke-key", "mlk-no-such-key")
    assert code == 1 and err == (
        "error: no API key 'mlk-no-such-key' (`marlaas tenants list` shows each tenant's key ids)\n"
    )
    code, out, _ = invoke(cli, "tenants", "revoke", tenant)
    assert code == 0 and f"tenant {tenant} revoked (1 keys)" in out
