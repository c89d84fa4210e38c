"""The README's "Write an environment" example as a real package: its module and its
pyproject.toml, taken from the README, installed with pip into a directory of its own."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_environment() -> tuple[str, str]:
    """The example's module source and its pyproject.toml, as the README shows them."""
    section = README.read_text().split("### Write an environment", 1)[1].split("\n### ", 1)[0]
    python, toml = re.findall(r"```(?:python|toml)\n(.*?)```", section, re.DOTALL)[:2]
    return python, toml


def install_readme_environment(work_dir: Path) -> Path:
    """`pip install` the example (no dependencies, no index: marlaas is what runs it) into
    `<work_dir>/site`, returned: a directory to put on a Python path."""
    python, toml = readme_environment()
    (package := work_dir / "reverse-env" / "reverse_env").mkdir(parents=True)
    (package / "__init__.py").write_text(python)
    (package.parent / "pyproject.toml").write_text(toml)
    site = work_dir / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-index",
            "--no-build-isolation",
            "--target",
            str(site),
            str(package.parent),
        ],
        check=True,
        capture_output=True,
    )
    return site
