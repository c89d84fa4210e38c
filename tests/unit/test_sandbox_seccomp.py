"""The sandbox's own seccomp filter (env_svc/sandbox/seccomp.py): its syscall numbers are the
kernel's, per architecture; tests/unit/test_sandbox.py tries the calls from inside a run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from env_svc.sandbox.seccomp import ARCHES, BLOCKED, filter_program

HEADERS = {
    "x86_64": Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h"),
    "aarch64": Path("/usr/include/asm-generic/unistd.h"),  # arm64 uses the generic table
}


@pytest.mark.parametrize("arch", sorted(ARCHES))
def test_the_numbers_are_the_kernel_s(arch: str) -> None:
    header = HEADERS[arch]
    if not header.exists():
        pytest.skip(f"no kernel headers here ({header}: Debian's linux-libc-dev)")
    text = header.read_text()
    kernel = {n: int(nr) for n, nr in re.findall(r"#define __NR(?:3264)?_(\w+)\s+(\d+)", text)}
    numbers = ARCHES[arch].numbers
    assert {name: kernel[name] for name in numbers} == numbers
    assert set(BLOCKED) | {"clone", "clone3", "unshare"} <= numbers.keys()


@pytest.mark.parametrize("arch", sorted(ARCHES))
def test_a_program_for_each_architecture(arch: str) -> None:
    program = filter_program(arch)
    assert len(program) % 8 == 0 and len(program) // 8 < 4096  # the kernel's BPF_MAXINSNS


def test_an_unknown_architecture_has_no_filter_and_so_no_sandbox() -> None:
    with pytest.raises(ValueError, match="no sandbox seccomp filter for riscv64"):
        filter_program("riscv64")
