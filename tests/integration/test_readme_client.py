"""The README's Python client example, run as written against real services on the tiny
model: submit a job file, follow it to its end, sample its adapter, export it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from console.stack.local import LocalStack
from tests.conftest import RunningServices

pytestmark = pytest.mark.kafka

ROOT = Path(__file__).resolve().parents[2]


def readme_program(section: str) -> str:
    """The first Python block of the README's `section`, as the README shows it."""
    text = (ROOT / "README.md").read_text().split(f"### {section}", 1)[1]
    return text.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_readme_client_example_runs_as_written(
    pipeline_services: RunningServices, local_stack: LocalStack, tmp_path: Path
) -> None:
    program = readme_program("Python client")
    assert "from marlaas import Client" in program and "asyncio.run(main())" in program
    (tmp_path / "client.py").write_text(program)
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # the job file it names, relative
    settings = pipeline_services.settings
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "MARLAAS_KAFKA_BOOTSTRAP": local_stack.kafka_bootstrap,
        "MARLAAS_REDIS_URL": local_stack.redis_url,
        "MARLAAS_STATE_DIR": str(settings.state_dir),
        "MARLAAS_ARTIFACT_DIR": str(settings.artifacts),
        "MARLAAS_BASE_MODEL": settings.base_model,
        "MARLAAS_BUS_KEY": settings.bus_key.get_secret_value(),
        "MARLAAS_CHAT_URL": settings.chat_url,
    }
    done = subprocess.run(
        [sys.executable, "client.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    events = [line.split()[0] for line in lines if line.split()[:1] != []]
    assert "accepted" in events and "completed" in events, done.stdout
    job_id = next(p.name for p in (tmp_path / "adapters").iterdir())
    assert job_id.startswith("acme-arithmetic-")
    # print(model, answer): the job's adapter answered, not the base model
    assert re.search(rf"^{job_id}(@v\d+)? ", done.stdout, re.MULTILINE), done.stdout
    version, base = lines[-1].split()
    assert int(version) >= 1 and base == settings.base_model
    assert (tmp_path / "adapters" / job_id / "adapter_model.safetensors").stat().st_size > 0
