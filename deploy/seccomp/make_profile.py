"""env_svc's seccomp profile (deploy/seccomp/env-sandbox.json), written from the kernel's
syscall tables (the host's headers: x86-64's and the generic one arm64 uses).

The code sandbox (env_svc/sandbox/) runs bubblewrap as env_svc's own unprivileged user (uid
1000 in the image), which needs a user namespace and, inside it, mount namespaces and mounts.
Docker's default seccomp profile refuses those calls to a container without CAP_SYS_ADMIN, so
the sandbox cannot start under it. The least privilege that works is this profile: Docker's
default rule, every call refused unless allowed (so a call newer than the tables is refused),
allowing what the default allows and, beyond it, only the calls bubblewrap needs (`SANDBOX`).
Refused still, as in Docker's default (its documentation's list of "significant syscalls
blocked"): kernel modules, kexec, BPF, perf events, ptrace and other processes' memory, the
kernel keyring, clock and time setting, swap, reboot, quotas, handles to files by number,
userfaultfd, and the rest of `BLOCKED`. Inside the sandbox bubblewrap also forbids nested
user namespaces (`--disable-userns`), so model-written code cannot use the calls allowed here
to reach the kernel's namespace code as root of a namespace of its own.

    python deploy/seccomp/make_profile.py            # rewrite the profile
    python deploy/seccomp/make_profile.py --check    # exit 1 if it is not what this writes

tests/unit/test_seccomp_profile.py checks the committed profile against this script; the
compose run (tests/compose/) runs hostile programs in the sandbox under it.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

PROFILE = Path(__file__).with_name("env-sandbox.json")
TABLES = (
    Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h"),
    Path("/usr/include/asm-generic/unistd.h"),
)
BLOCKED = frozenset(
    {
        "acct", "add_key", "bpf", "clock_adjtime", "clock_settime", "create_module",
        "delete_module", "finit_module", "fsconfig", "fsmount", "fsopen", "fspick",
        "get_kernel_syms", "get_mempolicy", "init_module", "ioperm", "iopl", "kcmp",
        "kexec_file_load", "kexec_load", "keyctl", "lookup_dcookie", "mbind", "move_mount",
        "move_pages", "name_to_handle_at", "nfsservctl", "open_by_handle_at", "open_tree",
        "perf_event_open", "personality", "process_madvise", "process_vm_readv",
        "process_vm_writev", "ptrace", "query_module", "quotactl", "quotactl_fd", "reboot",
        "request_key", "set_mempolicy", "set_mempolicy_home_node", "setns", "settimeofday",
        "stime", "swapoff", "swapon", "sysfs", "_sysctl", "umount", "uselib", "userfaultfd",
        "ustat", "vm86", "vm86old", "vhangup", "lsm_set_self_attr", "mount_setattr",
        "open_tree_attr", "fanotify_init", "syslog", "pidfd_getfd", "io_uring_setup",
        "io_uring_enter", "io_uring_register",
    }
)  # fmt: skip
"""Refused: Docker's documented list, the new mount API and the other calls its default
profile leaves to CAP_SYS_ADMIN (or CAP_SYSLOG, CAP_SYS_PTRACE), and io_uring (refused by
Docker's default since 25.0)."""
SANDBOX = frozenset({"clone", "clone3", "unshare", "mount", "umount2", "pivot_root"})
"""Allowed beyond Docker's default (which gives them only to CAP_SYS_ADMIN): bubblewrap's."""
_DEFINE = re.compile(r"^#define __NR(?:3264)?_(\w+)\s+\d+", re.MULTILINE)


def syscall_names(tables: tuple[Path, ...] = TABLES) -> set[str]:
    names: set[str] = set()
    for table in tables:
        names |= set(_DEFINE.findall(table.read_text()))
    return names - {"syscalls", "arch_specific_syscall"}


def profile(names: set[str]) -> dict[str, object]:
    assert SANDBOX <= names and not SANDBOX & BLOCKED
    return {
        "defaultAction": "SCMP_ACT_ERRNO",
        "defaultErrnoRet": 1,
        "archMap": [
            {
                "architecture": "SCMP_ARCH_X86_64",
                "subArchitectures": ["SCMP_ARCH_X86", "SCMP_ARCH_X32"],
            },
            {"architecture": "SCMP_ARCH_AARCH64", "subArchitectures": ["SCMP_ARCH_ARM"]},
        ],
        "syscalls": [{"names": sorted(names - BLOCKED), "action": "SCMP_ACT_ALLOW"}],
    }


def rendered() -> str:
    return json.dumps(profile(syscall_names()), indent=1) + "\n"


def main(argv: list[str]) -> int:
    if "--check" in argv:
        if PROFILE.read_text() != rendered():
            print(f"{PROFILE} is not what {__file__} writes: run it", file=sys.stderr)
            return 1
        return 0
    PROFILE.write_text(rendered())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
