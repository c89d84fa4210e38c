"""Processes of a test's process tree, read from /proc."""

from __future__ import annotations

from pathlib import Path


def descendants_of(pid: int) -> list[int]:
    found = children_of(pid)
    for child in list(found):
        found += descendants_of(child)
    return found


def children_of(pid: int) -> list[int]:
    """Live (non-zombie) child processes of `pid`, from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        state, ppid = fields[0], int(fields[1])
        if ppid == pid and state != "Z":
            found.append(int(stat.parent.name))
    return found


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return b""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
