"""console.stack.children.Supervisor: the embedded stack restarts what crashes, within reason."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from console.stack import children
from console.stack.children import ChildServer, RestartPolicy, StackError, Supervisor, spawn

FAST = RestartPolicy(max_restarts=3, window_s=60, first_delay_s=0.01, max_delay_s=0.05)


def child(
    name: str, script: str, log_dir: Path, *, respawn_script: str | None = None
) -> ChildServer:
    server = spawn(name, ["sh", "-c", script], log_dir / f"{name}.log")
    if respawn_script is not None:
        server.respawn = lambda: child(name, respawn_script, log_dir, respawn_script=respawn_script)
    return server


async def test_a_crashed_service_is_restarted_and_counted(tmp_path: Path) -> None:
    children = [child("env_svc", "exit 137", tmp_path, respawn_script="sleep 30")]
    counted: list[str] = []

    async def count(name: str) -> None:
        counted.append(name)

    supervisor = Supervisor(children, FAST, on_restart=count, poll_s=0.01)
    task = asyncio.create_task(supervisor.run())
    try:
        for _ in range(200):
            if supervisor.restarts:
                break
            await asyncio.sleep(0.01)
        assert supervisor.restarts == {"env_svc": 1} and counted == ["env_svc"]
        assert children[0].process.poll() is None  # the replacement runs
        await asyncio.sleep(0.1)
        assert not task.done()
    finally:
        task.cancel()
        for server in children:
            server.stop()


async def test_a_service_that_keeps_failing_fast_is_given_up_with_its_log(tmp_path: Path) -> None:
    script = "echo 'ImportError: no module named nowhere'; exit 1"
    children = [child("trainer_svc", script, tmp_path, respawn_script=script)]
    supervisor = Supervisor(children, FAST, poll_s=0.01)
    with pytest.raises(StackError, match=r"trainer_svc exited \(code 1\) 4 times") as caught:
        await asyncio.wait_for(supervisor.run(), 10)
    assert "no module named nowhere" in str(caught.value)
    assert supervisor.restarts == {"trainer_svc": 3}


async def test_a_child_that_cannot_come_back_ends_the_stack(tmp_path: Path) -> None:
    children = [child("tansu", "exit 9", tmp_path)]  # the in-memory broker: no respawn
    with pytest.raises(StackError, match="tansu exited with code 9"):
        await asyncio.wait_for(Supervisor(children, FAST, poll_s=0.01).run(), 10)


def test_free_ports_lie_below_the_ephemeral_range_and_skip_a_held_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A port picked now and bound seconds later must not be one the kernel can give an
    outbound connection meanwhile (CI: rollout_svc's chat port taken by a client socket)."""
    low, _ = children._ephemeral_range()
    ports = {children.free_port() for _ in range(50)}
    assert all(children._LOWEST_PORT <= port < low for port in ports)
    with socket.socket() as held:
        held.bind(("127.0.0.1", min(ports)))
        picks = iter([min(ports), min(ports), max(ports)])
        monkeypatch.setattr(children.random, "randrange", lambda *_: next(picks))
        assert children.free_port() == max(ports)
