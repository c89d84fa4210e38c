"""README shell blocks run as written (issue 45, item 7; the ledger of every block is
tests/readme_blocks.py): in bash, from the repository's root, with `.venv/bin` first on the
PATH (as after the README's `source .venv/bin/activate`) and the stack found the README's way,
through `MARLAAS_STATE_DIR`'s `stack.env`. Only what the README leaves to the reader is
filled in: `<key id>`, the id of the key the block itself issued."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.runtime.config import SharedSettings
from common.wire.lifecycle import SERVICES, TERMINAL_STATES
from console.stack.local import LocalStack
from marlaas import Client
from tests.agentic import operator_registrations
from tests.readme_blocks import README, block_starting, commands

pytestmark = pytest.mark.kafka

ROOT = README.parent


def shell(command: str, state_dir: Path, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    environ = dict(os.environ)
    environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{environ.get('PATH', '')}"
    environ["MARLAAS_STATE_DIR"] = str(state_dir)
    for name in ("MARLAAS_KAFKA_BOOTSTRAP", "MARLAAS_REDIS_URL", "MARLAAS_API_URL"):
        environ.pop(name, None)  # found through stack.env, as the README says
    return subprocess.run(
        ["bash", "-c", command], cwd=cwd, env=environ, capture_output=True, text=True, timeout=300
    )


async def test_the_operators_tenants_block_runs_as_written(tmp_path: Path) -> None:
    settings = SharedSettings(state_dir=tmp_path / "stack", connect_timeout_s=60)
    said: list[str] = []
    async with LocalStack(settings, use_existing_from_env=False):  # broker and Redis
        key_id = ""
        for command in commands(block_starting("marlaas tenants add acme")):
            done = shell(command.replace("<key id>", key_id), settings.state_dir)
            assert done.returncode == 0, (command, done.stdout, done.stderr)
            said.append(done.stdout)
            if command.startswith("marlaas tenants key acme"):
                key_id = re.findall(r"mlk_([0-9a-f]+)_", done.stdout)[0]
    added, listed, changed, issued, revoked = said
    assert "max_steps=1000" in added and "API key (shown once" in added
    assert listed.startswith("acme  active") and "max_lora_rank=16" in listed
    assert "max_steps=200" in changed and "max_lora_rank=16" in changed  # the others kept
    assert f"mlk_{key_id}_" in issued
    assert f"key {key_id} of tenant acme revoked" in revoked


def test_the_base_model_line_runs_as_written() -> None:
    (command,) = commands(block_starting('.venv/bin/python -c "from common.files.models'))
    done = subprocess.run(
        ["bash", "-c", command], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    model = Path(done.stdout.strip().splitlines()[-1])
    assert (model / "config.json").is_file() and list(model.glob("*.safetensors")), model


PLACEHOLDER_JOB = "acme-arithmetic-1a2b3c"


async def test_the_operators_and_the_tenants_job_commands_run_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The operator's block (`marlaas submit examples/jobs/*.toml` and every command after
    it), then the tenant's block through the API with a key the operator issued, on a SmolLM2
    stack of their own (the session's services, in the same consumer groups, would take some
    of its records), each in a folder of its own that holds the repository's `examples` (and
    `.venv`): the outputs land there. The README's job id is the arithmetic job's as `submit`
    printed it, its API URL the stack's and its key the issued one; before `export` and
    `pause` the test waits for the job's first adapter, as a reader would. (Run first, the
    tenant's block paused a job `submit --wait` had seen to its end: the README now pauses and
    resumes before `logs --follow`.)"""
    for name, value in operator_registrations().items():  # the verifiers example's taskset
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("ROLLOUT_KV_CACHE_GIB", "0.5")
    monkeypatch.setenv("ROLLOUT_MAX_MODEL_LEN", "1024")
    # The example jobs name the README's base model, SmolLM2 (a deployment serving another
    # rejects them).
    settings = SharedSettings(state_dir=tmp_path / "stack", connect_timeout_s=60)
    work = tmp_path / "work"
    work.mkdir()
    for name in ("examples", ".venv"):
        (work / name).symlink_to(ROOT / name)
    block = commands(block_starting("source .venv/bin/activate"))
    async with LocalStack(settings, use_existing_from_env=False, services=SERVICES) as stack:
        submitted = shell(block[1], settings.state_dir, cwd=work)
        assert submitted.returncode == 0, submitted.stderr
        job_id = re.findall(r"acme-arithmetic-[0-9a-f]+", submitted.stdout)[0]
        async with Client(stack.client_settings) as client:
            await published(client, job_id)
            for command in block[2:]:
                done = shell(command.replace(PLACEHOLDER_JOB, job_id), settings.state_dir, cwd=work)
                assert done.returncode == 0, (command, done.stdout, done.stderr)
            for spec in re.findall(r"[a-z]+-[a-z_]+-[0-9a-f]{6,}", submitted.stdout):
                if (await client.job(spec)).status not in TERMINAL_STATES:
                    await client.command(spec, "cancel")
        # Then the tenant's block through the API, as acme with a key the operator issued.
        added = shell("marlaas tenants add acme", settings.state_dir, cwd=work)
        key = re.findall(r"mlk_\S+", added.stdout)[0]
        tenant_work = tmp_path / "tenant"
        tenant_work.mkdir()
        (tenant_work / "examples").symlink_to(ROOT / "examples")
        tenant_job = ""
        for command in commands(block_starting("export MARLAAS_API_URL=")):
            command = command.replace("http://marlaas.example:8080", stack.api_url)
            command = command.replace("mlk_...", key).replace(PLACEHOLDER_JOB, tenant_job)
            if command.startswith("export "):
                exported = command
                continue
            if command.startswith("marlaas pause"):  # a reader pauses a job that trains
                async with Client(stack.client_settings) as client:
                    await published(client, tenant_job)
            done = shell(f"{exported}; {command}", settings.state_dir, cwd=tenant_work)
            assert done.returncode == 0, (command, done.stdout, done.stderr)
            if command.startswith("marlaas submit"):
                tenant_job = re.findall(r"acme-arithmetic-[0-9a-f]+", done.stdout)[0]
    assert (tenant_work / "adapters" / "arith" / "adapter_config.json").is_file()
    assert "tokens" in (tenant_work / "usage.csv").read_text().splitlines()[0]
    assert (work / "adapters" / "arith" / "adapter_config.json").is_file()
    assert list((work / "models" / "arith").glob("*.safetensors"))
    assert (work / "report" / "index.html").is_file()
    assert (work / "track" / "track.json").is_file()


async def published(client: Client, job_id: str, timeout_s: float = 240.0) -> None:
    """Until the job has published an adapter (what `export` takes)."""
    deadline = time.monotonic() + timeout_s
    while (await client.store.adapters.get(job_id)) is None:
        assert time.monotonic() < deadline, f"{job_id} published nothing in {timeout_s:g} s"
        await asyncio.sleep(1.0)


def test_the_stack_block_runs_as_written(tmp_path: Path) -> None:
    """`marlaas up` and `marlaas up --infra-only` each until "Ready.", then Ctrl-C (it must
    stop with no child left: exit 0); `marlaas topics create` while the second one is up."""
    environ = dict(os.environ, MARLAAS_STATE_DIR=str(tmp_path / "stack"))
    for name in ("MARLAAS_KAFKA_BOOTSTRAP", "MARLAAS_REDIS_URL", "MARLAAS_API_URL"):
        environ.pop(name, None)
    up, infra, topics = commands(block_starting(".venv/bin/marlaas up"))
    assert ".venv/bin/marlaas up --infra-only" in infra
    for command in (up, infra):
        stack = subprocess.Popen(
            ["bash", "-c", f"exec {command.split('#')[0]}"],
            cwd=ROOT,
            env=environ,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        said = []
        try:
            assert stack.stdout is not None
            for line in stack.stdout:
                said.append(line)
                if line.startswith("Ready."):
                    break
            else:
                raise AssertionError("".join(said))
            if command == infra:
                made = subprocess.run(
                    ["bash", "-c", topics], cwd=ROOT, env=environ, capture_output=True, text=True
                )
                assert made.returncode == 0, made.stderr
                assert "marlaas.jobs: 12 partitions" in made.stdout, made.stdout
        finally:
            stack.send_signal(signal.SIGINT)
            rest, _ = stack.communicate(timeout=120)
        assert stack.returncode == 0, "".join(said) + rest
        assert "no child process left" in rest
