"""env_svc's seccomp profile in compose (deploy/seccomp/env-sandbox.json): what the code
sandbox needs beyond Docker's default rule is allowed, and nothing else that the default
refuses. The compose run (tests/compose/) runs the sandbox's hostile programs under it."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "deploy" / "seccomp" / "env-sandbox.json"
MAKER = runpy.run_path(str(ROOT / "deploy" / "seccomp" / "make_profile.py"))


def allowed() -> set[str]:
    profile = json.loads(PROFILE.read_text())
    assert profile["defaultAction"] == "SCMP_ACT_ERRNO"  # a call not listed is refused
    (rule,) = profile["syscalls"]
    assert rule["action"] == "SCMP_ACT_ALLOW" and "args" not in rule
    return set(rule["names"])


def test_the_sandbox_s_calls_are_allowed_and_the_dangerous_ones_refused() -> None:
    names = allowed()
    assert MAKER["SANDBOX"] <= names  # bubblewrap: a user namespace, mounts, pivot_root
    refused = {"ptrace", "bpf", "keyctl", "kexec_load", "init_module", "perf_event_open"}
    refused |= {"setns", "process_vm_readv", "userfaultfd", "io_uring_setup", "reboot"}
    assert not refused & names
    assert not MAKER["BLOCKED"] & names
    for everyday in ("read", "write", "openat", "mmap", "futex", "epoll_wait", "socket"):
        assert everyday in names, everyday


def test_the_profile_is_what_its_script_writes_from_the_syscall_tables() -> None:
    """Regenerated from this machine's kernel headers: the same calls (newer headers may add
    some; none may go missing, and a blocked one never appears)."""
    regenerated = MAKER["profile"](MAKER["syscall_names"]())["syscalls"][0]["names"]
    assert allowed() <= set(regenerated)


def test_compose_gives_env_svc_that_profile_and_nothing_broader() -> None:
    service = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["env_svc"]
    assert service["security_opt"] == ["seccomp=./deploy/seccomp/env-sandbox.json"]
    assert "cap_add" not in service and "privileged" not in service
