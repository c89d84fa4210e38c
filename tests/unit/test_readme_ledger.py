"""Every shell block of the README is run as written by a test, or has its reason not to be
(tests/readme_blocks.py): a command added to the README cannot go untried unnoticed."""

from __future__ import annotations

from tests.readme_blocks import (
    NOT_ON_ONE_MACHINE,
    NOT_YET_RUN,
    RUN_AS_WRITTEN,
    commands,
    sh_blocks,
)


def test_every_readme_shell_block_is_run_or_has_its_reason() -> None:
    ledger = {**RUN_AS_WRITTEN, **NOT_ON_ONE_MACHINE, **NOT_YET_RUN}
    assert len(ledger) == len(RUN_AS_WRITTEN) + len(NOT_ON_ONE_MACHINE) + len(NOT_YET_RUN)
    firsts = [commands(block)[0] for block in sh_blocks() if commands(block)]
    unaccounted = [first for first in firsts if not any(first.startswith(k) for k in ledger)]
    assert not unaccounted, f"README shell blocks no test runs and no reason names: {unaccounted}"
    stale = [k for k in ledger if not any(first.startswith(k) for first in firsts)]
    assert not stale, f"ledger entries for blocks the README no longer has: {stale}"


def test_blocks_are_split_into_commands_as_a_shell_reads_them() -> None:
    block = "a --x 1 \\\n    --y 2   # note\n# a comment\n\nb\n"
    assert commands(block) == ["a --x 1  --y 2   # note", "b"]
    assert sh_blocks("x\n```sh\nls\n```\n```python\nprint()\n```\n") == ["ls\n"]
