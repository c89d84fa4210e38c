"""The README's shell blocks as commands, and what the tests do with each block: run it as
written (tests/integration/test_readme_commands.py), or why not on one machine, or that no
test runs it yet (issue 45: every one-machine command should run in a test as written).
tests/unit/test_readme_ledger.py fails when a block is in neither list, so a command added to
the README is either run or its reason written down."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).parents[1] / "README.md"
_BLOCK = re.compile(r"```(?:sh|bash|shell)\n(.*?)```", re.S)


def sh_blocks(text: str | None = None) -> list[str]:
    return _BLOCK.findall(README.read_text() if text is None else text)


def commands(block: str) -> list[str]:
    """The block's commands: continuation lines joined, blank and comment-only lines left out
    (a trailing comment stays: bash ignores it, as a reader's shell does)."""
    joined = re.sub(r"\\\n\s*", " ", block)
    lines = joined.splitlines()
    return [line for line in lines if line.strip() and not line.lstrip().startswith("#")]


def block_starting(first: str) -> str:
    """The one block whose first command starts with `first`."""
    found = [b for b in sh_blocks() if commands(b) and commands(b)[0].startswith(first)]
    assert len(found) == 1, f"{len(found)} README blocks start with {first!r}"
    return found[0]


RUN_AS_WRITTEN: dict[str, str] = {
    "marlaas tenants add acme": "test_readme_commands: the operator's tenants block",
    '.venv/bin/python -c "from common.files.models import resolve_base_model': (
        "test_readme_commands: the base model resolved"
    ),
    "source .venv/bin/activate": "test_readme_commands: the operator's job commands, on SmolLM2",
    "export MARLAAS_API_URL=": "test_readme_commands: the tenant's commands through the API",
    ".venv/bin/marlaas up": "test_readme_commands: up, up --infra-only and topics create",
}
"""Blocks (by their first command) a test runs as the README shows them."""

NOT_ON_ONE_MACHINE: dict[str, str] = {
    "make demo": "the two commands themselves: CI runs `make test` (.ci/run); `make demo` by hand",
    "export MARLAAS_KAFKA_BOOTSTRAP=kafka:9092": "servers of a deployment (compose's names)",
    'value=\'{"kind": "job_spec"': "kcat with SCRAM: compose's Kafka (Tansu has no SCRAM users)",
    "python3 -m venv .venv": "installing: the Makefile's venv target runs the same steps",
    "make compose-up": "compose (`make test-compose` runs the compose stack, not this block)",
}
"""Blocks no one-machine test runs, and why."""

NOT_YET_RUN: dict[str, str] = {}
"""Blocks for one machine that no test runs as written yet (issue 45, item 7)."""
