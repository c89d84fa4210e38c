"""What this process computes on, and the precision each service computes in.

The CPUs of our machines and of our users' differ: an AMX Xeon or an AVX-512-bf16 EPYC runs
bf16 matmuls several times faster than float32, an AVX2-only CPU some 40 times slower
(bench/results/precision-*.json). So the trainer's and the engine's precision default to
`auto`: bfloat16 only where the hardware runs it natively, float32 elsewhere.

The CPU's ISA level comes from /proc/cpuinfo's flags, lowered by the caps a user (or a
benchmark reproducing a smaller CPU) sets for the libraries: `ONEDNN_MAX_CPU_ISA` (oneDNN, which
runs torch's and vLLM's bf16 matmuls) and `ATEN_CPU_CAPABILITY` (torch's own kernels). Nothing
here imports torch unless asked to look for GPUs.
"""

from __future__ import annotations

import logging
import os
import platform
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Any, Literal, get_args

log = logging.getLogger(__name__)

IsaLevel = Literal["default", "avx2", "avx512", "avx512_bf16", "amx"]
ISA_LEVELS: tuple[IsaLevel, ...] = get_args(IsaLevel)
"""From least to most capable: `avx512_bf16` and `amx` run bf16 matmuls natively."""

ISA_NAMES: Mapping[IsaLevel, str] = {
    "default": "SSE only",
    "avx2": "AVX2",
    "avx512": "AVX-512 (no bf16)",
    "avx512_bf16": "AVX-512 with bf16",
    "amx": "AMX (bf16 tiles)",
}

_ONEDNN_CAPS: Mapping[str, IsaLevel] = {
    "SSE41": "default",
    "AVX": "default",
    "AVX2": "avx2",
    "AVX2_VNNI": "avx2",
    "AVX2_VNNI_2": "avx2",
    "AVX512_CORE": "avx512",
    "AVX512_CORE_VNNI": "avx512",
    "AVX512_CORE_BF16": "avx512_bf16",
    "AVX512_CORE_FP16": "avx512_bf16",
    "AVX10_1_512": "avx512_bf16",
}
"""`ONEDNN_MAX_CPU_ISA` values and the level they cap at; AMX ones and `ALL` cap nothing."""

_ATEN_CAPS: Mapping[str, IsaLevel] = {"default": "default", "avx2": "avx2"}
"""`ATEN_CPU_CAPABILITY` values that cap torch's kernels below AVX-512."""

TrainerDtype = Literal["auto", "float32", "bfloat16"]
EngineDtype = Literal["auto", "float32", "bfloat16", "float16"]
ComputeDtype = Literal["float32", "bfloat16", "float16"]

BF16_EMULATED_SLOWDOWN = 38
"""float32 matmul rate / bf16 matmul rate on a CPU without native bf16: 105.8 vs 2.8 GFLOP/s,
one thread, an AMD EPYC (Zen 5) capped to AVX2 (bench/results/precision-20261204-cpu2-avx2.json;
on two threads 75x: the emulated path does not parallelise); a native AVX2-only EPYC
measured 31x."""


@dataclass(frozen=True)
class CpuInfo:
    model: str
    """The CPU's model name (/proc/cpuinfo), or the platform's processor string."""
    isa: IsaLevel
    """The level this process's libraries may use: the CPU's, lowered by any cap."""
    native_isa: IsaLevel
    """What the CPU itself has."""
    capped_by: str
    """The variable(s) that lowered `isa` below `native_isa`, e.g. "ONEDNN_MAX_CPU_ISA=AVX2"."""
    cores: int
    """Cores this process may run on (its affinity)."""
    family: str = ""
    """/proc/cpuinfo's "cpu family" and "model" (e.g. "25/17", an AMD Zen 4; "26/..." a Zen 5):
    model names such as "AMD EPYC" do not tell the generations apart."""

    @property
    def native_bf16(self) -> bool:
        return ISA_LEVELS.index(self.isa) >= ISA_LEVELS.index("avx512_bf16")

    def describe(self) -> str:
        text = f"{self.model}, {self.cores} core{'s' if self.cores != 1 else ''}, "
        text += ISA_NAMES[self.isa]
        if self.capped_by:
            text += f" (capped from {ISA_NAMES[self.native_isa]} by {self.capped_by})"
        return text


@dataclass(frozen=True)
class GpuInfo:
    name: str
    bf16: bool
    """Whether the GPU runs bf16 natively (compute capability 8.0 or newer)."""


@dataclass(frozen=True)
class Hardware:
    cpu: CpuInfo
    gpus: tuple[GpuInfo, ...] = ()

    def describe(self) -> str:
        gpus = "; ".join(f"GPU {g.name}{' (bf16)' if g.bf16 else ''}" for g in self.gpus)
        return self.cpu.describe() + (f"; {gpus}" if gpus else "")

    def record(self) -> dict[str, Any]:
        """The machine as a benchmark result records it (bench/README.md)."""
        return {
            "cpu_model": self.cpu.model,
            "cpu_family_model": self.cpu.family,
            "isa": self.cpu.isa,
            "native_isa": self.cpu.native_isa,
            "isa_capped_by": self.cpu.capped_by,
            "native_bf16": self.cpu.native_bf16,
            "cores": self.cpu.cores,
            "machine_class": self.machine_class,
            "gpus": [asdict(gpu) for gpu in self.gpus],
        }

    @property
    def machine_class(self) -> str:
        """What results are grouped by: `cpu-<isa>` or `gpu-<name>`."""
        if self.gpus:
            return "gpu-" + self.gpus[0].name.lower().replace(" ", "-")
        return f"cpu-{self.cpu.isa}"


def native_isa_from_flags(flags: set[str]) -> IsaLevel:
    """The ISA level of a CPU with these /proc/cpuinfo flags."""
    if {"amx_bf16", "amx_tile"} <= flags:
        return "amx"
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags
    if avx512 and "avx512_bf16" in flags:
        return "avx512_bf16"
    if avx512:
        return "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return "default"


def capped_isa(native: IsaLevel, environ: Mapping[str, str]) -> tuple[IsaLevel, str]:
    """`native` lowered by the libraries' ISA caps in `environ`, and which caps did it."""
    level, capped_by = native, []
    caps = (
        ("ONEDNN_MAX_CPU_ISA", _ONEDNN_CAPS, environ.get("ONEDNN_MAX_CPU_ISA", "").upper()),
        ("ATEN_CPU_CAPABILITY", _ATEN_CAPS, environ.get("ATEN_CPU_CAPABILITY", "").lower()),
    )
    for variable, table, value in caps:
        cap = table.get(value)
        if cap is not None and ISA_LEVELS.index(cap) < ISA_LEVELS.index(native):
            capped_by.append(f"{variable}={environ[variable]}")
            if ISA_LEVELS.index(cap) < ISA_LEVELS.index(level):
                level = cap
    return level, " and ".join(capped_by)


def read_cpu(
    cpuinfo: Path = Path("/proc/cpuinfo"), environ: Mapping[str, str] | None = None
) -> CpuInfo:
    """This machine's CPU as the process sees it."""
    model, flags = platform.processor() or platform.machine(), set[str]()
    numbers: dict[str, str] = {}
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and value.strip():
                model = value.strip()
            elif key in ("cpu family", "model"):
                numbers[key] = value.strip()
            elif key == "flags":
                flags = set(value.split())
            if flags and key == "":  # the first processor's block is enough
                break
    except OSError:
        pass  # not Linux: model from the platform, no flags, so no native bf16 assumed
    native = native_isa_from_flags(flags)
    isa, capped_by = capped_isa(native, os.environ if environ is None else environ)
    family = "/".join(numbers[k] for k in ("cpu family", "model") if k in numbers)
    return CpuInfo(model, isa, native, capped_by, len(os.sched_getaffinity(0)), family)


def read_gpus() -> tuple[GpuInfo, ...]:
    """CUDA GPUs torch sees (none when torch is missing or has no CUDA)."""
    try:
        import torch
    except ImportError:
        return ()
    if not torch.cuda.is_available():
        return ()
    gpus = []
    for index in range(torch.cuda.device_count()):
        major, _ = torch.cuda.get_device_capability(index)
        gpus.append(GpuInfo(torch.cuda.get_device_name(index), bf16=major >= 8))
    return tuple(gpus)


@cache
def detect(*, gpus: bool = True) -> Hardware:
    """The hardware of this process (read once); `gpus` False skips importing torch."""
    return Hardware(read_cpu(), read_gpus() if gpus else ())


@dataclass(frozen=True)
class Precision:
    """A service's compute precision, why it was chosen, and what is wrong with it if forced."""

    dtype: ComputeDtype
    reason: str
    warning: str = ""

    def describe(self) -> str:
        return f"{self.dtype} ({self.reason})"


def choose_precision(
    setting: str, device: Literal["cpu", "cuda"], hardware: Hardware, *, half: ComputeDtype
) -> Precision:
    """The precision for `setting` (auto or a dtype) on `device`. `half`: what a GPU without
    bf16 gets under `auto` (the engine: float16; the trainer, which has no loss scaling:
    float32). An explicit bf16 where it is not native is kept, with a warning naming its cost.
    """
    if device == "cuda":
        gpu = hardware.gpus[0] if hardware.gpus else None
        native = gpu is not None and gpu.bf16
        where = f"GPU {gpu.name}" if gpu else "GPU"
    else:
        native = hardware.cpu.native_bf16
        where = f"{ISA_NAMES[hardware.cpu.isa]} CPU"
    if setting == "auto":
        if native:
            return Precision("bfloat16", f"auto: the {where} runs bf16 natively")
        fallback: ComputeDtype = half if device == "cuda" else "float32"
        return Precision(fallback, f"auto: the {where} has no native bf16")
    if setting not in get_args(ComputeDtype):
        raise ValueError(
            f"unknown precision {setting!r}: one of auto, {', '.join(get_args(ComputeDtype))}"
        )
    dtype: ComputeDtype = setting  # type: ignore[assignment]
    warning = ""
    if device == "cpu" and dtype != "float32" and not native:
        warning = (
            f"{dtype} was set explicitly, but this {where} has no native bf16/fp16 matmul: "
            f"such a CPU ran bf16 matmuls {BF16_EMULATED_SLOWDOWN}x slower than float32 "
            "(bench/results/precision-*.json); set it to auto or float32"
        )
    elif device == "cuda" and dtype == "bfloat16" and not native:
        warning = f"bfloat16 was set explicitly, but this {where} has no native bf16"
    return Precision(dtype, "set explicitly", warning)


def log_precision(service: str, precision: Precision, hardware: Hardware) -> None:
    """What a service logs at start: the hardware, its precision and why (one warning when
    the precision was forced against the hardware)."""
    log.info("%s computes in %s on %s", service, precision.describe(), hardware.describe())
    if precision.warning:
        log.warning("%s: %s", service, precision.warning)


def engine_precision(setting: str, hardware: Hardware, *, on_gpu: bool | None = None) -> Precision:
    """The rollout engine's precision; `on_gpu` None: on a GPU when there is one."""
    gpu = bool(hardware.gpus) if on_gpu is None else on_gpu
    return choose_precision(setting, "cuda" if gpu else "cpu", hardware, half="float16")


def trainer_precision(setting: str, device: str, hardware: Hardware) -> Precision:
    """The trainer's precision on `device` (its setting: auto, cpu, cuda or cuda:N)."""
    gpu = device.startswith("cuda") or (device == "auto" and bool(hardware.gpus))
    return choose_precision(setting, "cuda" if gpu else "cpu", hardware, half="float32")
