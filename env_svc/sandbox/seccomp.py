"""The sandbox's own seccomp filter, applied to model-written code by bubblewrap (`--seccomp
FD`) once the namespaces are set up.

The code needs none of the kernel's namespace, mount, tracing, keyring, BPF, io_uring or module
calls; they are where kernel privilege escalations are found, and a user namespace would let
the code reach them as root of a namespace of its own. So they are refused with EPERM: `clone`
and `unshare` with any namespace flag, and the calls of `BLOCKED`. `clone3` gets ENOSYS, as
under Docker's default profile (its flags are behind a pointer a filter cannot read): the C
library falls back to `clone`. A call of another ABI (32-bit, x32) ends the process. Anything
else is allowed: the namespaces, rlimits and the empty filesystem view do the rest
(env_svc/sandbox/runner.py).

A classic BPF program assembled here, per architecture (x86-64 and arm64, whose syscall numbers
are fixed by the kernel's ABI), so no libseccomp binding is needed;
tests/unit/test_sandbox_seccomp.py checks the numbers against the kernel's headers where they
are installed, and tests/unit/test_sandbox.py tries the calls from inside.
"""

from __future__ import annotations

import errno
import platform
import struct
from dataclasses import dataclass

BLOCKED = (
    "ptrace", "process_vm_readv", "process_vm_writev", "bpf", "perf_event_open", "keyctl",
    "add_key", "request_key", "userfaultfd", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "mount", "umount2", "pivot_root", "setns", "fsopen", "fsconfig",
    "fsmount", "fspick", "move_mount", "open_tree", "mount_setattr", "kexec_load",
    "kexec_file_load", "init_module", "finit_module", "delete_module", "open_by_handle_at",
    "name_to_handle_at", "acct", "swapon", "swapoff", "reboot", "syslog", "quotactl",
    "lookup_dcookie",
)  # fmt: skip
NAMESPACE_FLAGS = (
    0x00020000  # CLONE_NEWNS
    | 0x02000000  # CLONE_NEWCGROUP
    | 0x04000000  # CLONE_NEWUTS
    | 0x08000000  # CLONE_NEWIPC
    | 0x10000000  # CLONE_NEWUSER
    | 0x20000000  # CLONE_NEWPID
    | 0x40000000  # CLONE_NEWNET
)

# Calls added since Linux 5.1 have one number on every architecture.
_COMMON = {"clone3": 435, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427}
_COMMON |= {"open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431}
_COMMON |= {"fsmount": 432, "fspick": 433, "mount_setattr": 442}


@dataclass(frozen=True, slots=True)
class Arch:
    audit: int
    """AUDIT_ARCH_* of the native ABI."""
    numbers: dict[str, int]
    other_abi_from: int | None = None
    """Syscall numbers from here on belong to another ABI of the same arch (x32)."""


# The calls whose numbers differ by architecture: (x86-64, arm64).
_BY_ARCH = {
    "clone": (56, 220), "unshare": (272, 97), "ptrace": (101, 117), "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271), "bpf": (321, 280), "perf_event_open": (298, 241),
    "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218),
    "userfaultfd": (323, 282), "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41),
    "setns": (308, 268), "kexec_load": (246, 104), "kexec_file_load": (320, 294),
    "init_module": (175, 105), "finit_module": (313, 273), "delete_module": (176, 106),
    "open_by_handle_at": (304, 265), "name_to_handle_at": (303, 264), "acct": (163, 89),
    "swapon": (167, 224), "swapoff": (168, 225), "reboot": (169, 142), "syslog": (103, 116),
    "quotactl": (179, 60), "lookup_dcookie": (212, 18),
}  # fmt: skip
ARCHES = {
    "x86_64": Arch(
        audit=0xC000003E,
        numbers=_COMMON | {name: x86_64 for name, (x86_64, _) in _BY_ARCH.items()},
        other_abi_from=0x40000000,
    ),
    "aarch64": Arch(
        audit=0xC00000B7,
        numbers=_COMMON | {name: arm64 for name, (_, arm64) in _BY_ARCH.items()},
    ),
}

_LD_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_JSET = 0x45  # BPF_JMP | BPF_JSET | BPF_K
_RET = 0x06  # BPF_RET | BPF_K
_ALLOW = 0x7FFF0000
_ERRNO = 0x00050000
_KILL_PROCESS = 0x80000000
_NR, _ARCH, _ARG0 = 0, 4, 16  # offsets in struct seccomp_data (arg 0's low word: little-endian)


def filter_program(machine: str | None = None) -> bytes:
    """The filter for `machine` (default: this one's) as `struct sock_filter[]`, what
    bubblewrap reads from `--seccomp FD`; raises ValueError for an architecture not known."""
    name = machine or platform.machine()
    if name not in ARCHES:
        raise ValueError(f"no sandbox seccomp filter for {name}; known: {', '.join(ARCHES)}")
    arch = ARCHES[name]
    program: list[tuple[int, int, int, int]] = []

    def op(code: int, k: int, jt: int = 0, jf: int = 0) -> None:
        program.append((code, jt, jf, k))

    op(_LD_ABS, _ARCH)
    op(_JEQ, arch.audit, 1, 0)
    op(_RET, _KILL_PROCESS)
    op(_LD_ABS, _NR)
    if arch.other_abi_from is not None:
        op(_JGE, arch.other_abi_from, 0, 1)
        op(_RET, _KILL_PROCESS)
    for name_ in BLOCKED:
        op(_JEQ, arch.numbers[name_], 0, 1)
        op(_RET, _ERRNO | errno.EPERM)
    op(_JEQ, arch.numbers["clone3"], 0, 1)
    op(_RET, _ERRNO | errno.ENOSYS)
    op(_JEQ, arch.numbers["clone"], 1, 0)  # clone: to the flags check
    op(_JEQ, arch.numbers["unshare"], 0, 3)  # unshare: to the flags check; else allow
    op(_LD_ABS, _ARG0)
    op(_JSET, NAMESPACE_FLAGS, 0, 1)
    op(_RET, _ERRNO | errno.EPERM)
    op(_RET, _ALLOW)
    return b"".join(struct.pack("<HBBI", *instruction) for instruction in program)
