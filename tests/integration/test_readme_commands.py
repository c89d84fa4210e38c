"""README shell blocks run as written (issue 45, item 7; the ledger of every block is
tests/readme_blocks.py): in bash, from the repository's root, with `.venv/bin` first on the
PATH (as after the README's `source .venv/bin/activate`) and the stack found the README's way,
through `MARLAAS_STATE_DIR`'s `stack.env`. Only what the README leaves to the reader is
filled in: `<key id>`, the id of the key the block itself issued."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from common.runtime.config import SharedSettings
from console.stack.local import LocalStack
from tests.readme_blocks import README, block_starting, commands

pytestmark = pytest.mark.kafka

ROOT = README.parent


def shell(command: str, state_dir: Path) -> subprocess.CompletedProcess[str]:
    environ = dict(os.environ)
    environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{environ.get('PATH', '')}"
    environ["MARLAAS_STATE_DIR"] = str(state_dir)
    for name in ("MARLAAS_KAFKA_BOOTSTRAP", "MARLAAS_REDIS_URL", "MARLAAS_API_URL"):
        environ.pop(name, None)  # found through stack.env, as the README says
    return subprocess.run(
        ["bash", "-c", command], cwd=ROOT, env=environ, capture_output=True, text=True, timeout=300
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
