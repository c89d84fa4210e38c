"""The code sandbox: model-written code in namespaces, an empty filesystem view and rlimits."""

from env_svc.sandbox.runner import (
    Sandbox,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailableError,
)
from env_svc.sandbox.tool import python_tool

__all__ = ["Sandbox", "SandboxLimits", "SandboxResult", "SandboxUnavailableError", "python_tool"]
