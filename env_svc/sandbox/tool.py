"""The `python` tool: model-written code run in the sandbox, its output as the tool message."""

from __future__ import annotations

from env_svc.sandbox.runner import Sandbox, SandboxLimits, shared_sandbox
from env_svc.tools.tool import Tool

SLACK_S = 5.0
"""The tool's own limit over the sandbox's wall clock: the sandbox stops the code first, and
says why."""


def python_tool(limits: SandboxLimits | None = None, sandbox: Sandbox | None = None) -> Tool:
    """A tool that runs code in `sandbox` (default: this process's) under `limits` (default:
    the sandbox's), checked usable now: code is never run unisolated."""
    sandbox = sandbox or shared_sandbox()
    sandbox.check()
    limits = limits or sandbox.limits

    async def python(code: str) -> str:
        """Run Python 3 code and get what it prints (no network, no files kept, time and
        memory limits)."""
        return (await sandbox.run_python(code, limits)).text()

    return Tool.of(python, timeout_s=limits.wall_s + SLACK_S)
