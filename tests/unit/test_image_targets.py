"""Each Dockerfile target starts its service with only what the target installs.

No Docker engine runs here: tests/image_targets.py reads each target's `pip install` lines,
closes them over the installed metadata, and runs the service's start-up check
(`--check`: settings, imports, tokenizer or model, no broker) in a process where every
other distribution is missing, as it is in the image. The rollout target installs vLLM's
GPU build, which cannot be installed on this machine: it is left out.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.image_targets import ROOT, allowed_distributions, guarded, requirement_lines

DOCKERFILE = (ROOT / "Dockerfile").read_text()

STARTS = {
    # compose's `topics` and `cli` services: topics, and job files read for `submit`.
    "base": "import console.stack.topics, marlaas.export, marlaas.report.numbers, runpy\n"
    "import common.state.audit\n"
    "from pathlib import Path\nfrom marlaas.jobfile import load_job_file\n"
    "from console.env_params import check_env_params\n"
    f"for f in Path({str(ROOT / 'examples' / 'jobs')!r}).glob('*.toml'): "
    "load_job_file(f, base_model='smollm2-135m-instruct', check_env=check_env_params)\n"
    "sys.argv = ['marlaas', 'topics', '--help']\n"
    "runpy.run_module('console.cli.main', run_name='__main__')",
    "api": "import runpy; sys.argv = ['api_svc', '--check']; "
    "runpy.run_module('api_svc', run_name='__main__')",
    "env": "import runpy; sys.argv = ['env_svc', '--check']; "
    "runpy.run_module('env_svc', run_name='__main__')",
    "trainer": "import runpy; sys.argv = ['trainer_svc', '--check']; "
    "runpy.run_module('trainer_svc', run_name='__main__')",
}


def start(
    dockerfile: str, target: str, tiny_dir: Path, tmp_path: Path
) -> subprocess.CompletedProcess[str]:
    allowed = allowed_distributions(requirement_lines(dockerfile, target))
    env = dict(os.environ) | {
        "MARLAAS_BASE_MODEL": str(tiny_dir),
        "MARLAAS_STATE_DIR": str(tmp_path),
        "TRAINER_DEVICE": "cpu",
        "PYTHONPATH": str(ROOT),
        "MARLAAS_DATA_DIR": str(ROOT / "examples" / "data"),  # the dataset example's file
    }
    return subprocess.run(
        [sys.executable, "-c", guarded(STARTS[target], allowed)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("target", sorted(STARTS))
def test_each_image_target_starts_its_service_with_only_what_it_installs(
    target: str, tiny_dir: Path, tmp_path: Path
) -> None:
    done = start(DOCKERFILE, target, tiny_dir, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    if target != "base":
        assert "start-up check passed" in done.stdout


def test_the_env_image_has_no_torch_and_the_guard_would_notice(tmp_path: Path) -> None:
    allowed = allowed_distributions(requirement_lines(DOCKERFILE, "env"))
    assert "torch" not in allowed and "transformers" in allowed
    done = subprocess.run(
        [sys.executable, "-c", guarded("import torch", allowed)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and "import of torch halted" in done.stderr


def test_the_env_image_before_its_extra_crash_looped(tiny_dir: Path, tmp_path: Path) -> None:
    """env_svc's image as it was defined until 2026-12 (the core package only): its
    start-up needs transformers, which that image lacked. The check catches it."""
    before = DOCKERFILE.replace('pip install "/src[env]"', "pip install /src")
    assert before != DOCKERFILE
    done = start(before, "env", tiny_dir, tmp_path)
    assert done.returncode != 0
    assert "import of transformers halted" in done.stderr
