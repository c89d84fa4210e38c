"""common.runtime.hardware: the CPU's ISA level from its flags and the libraries' caps, and the
precision each service chooses for it (capabilities injected; nothing timed)."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from common.runtime.hardware import (
    CpuInfo,
    GpuInfo,
    Hardware,
    IsaLevel,
    capped_isa,
    engine_precision,
    log_precision,
    native_isa_from_flags,
    read_cpu,
    trainer_precision,
)

AVX2_EPYC = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx fma avx2 bmi2"
AVX512 = AVX2_EPYC + " avx512f avx512dq avx512bw avx512vl avx512_vnni"
ZEN5 = AVX512 + " avx512_bf16 avx512_vp2intersect"
SAPPHIRE_RAPIDS = ZEN5 + " amx_bf16 amx_tile amx_int8"


def machine(isa: IsaLevel, *gpus: GpuInfo) -> Hardware:
    return Hardware(CpuInfo("test CPU", isa, isa, "", 2), tuple(gpus))


@pytest.mark.parametrize(
    ("flags", "level"),
    [
        ("fpu sse sse2", "default"),
        (AVX2_EPYC, "avx2"),
        (AVX512, "avx512"),
        (ZEN5, "avx512_bf16"),
        (SAPPHIRE_RAPIDS, "amx"),
        ("avx2 fma avx512_bf16", "avx2"),  # bf16 without the AVX-512 base is not usable
    ],
)
def test_the_isa_level_is_read_from_the_cpu_flags(flags: str, level: IsaLevel) -> None:
    assert native_isa_from_flags(set(flags.split())) == level


def test_library_caps_lower_the_level_and_are_named() -> None:
    environ = {"ONEDNN_MAX_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2"}
    assert capped_isa("amx", environ) == (
        "avx2",
        "ONEDNN_MAX_CPU_ISA=avx2 and ATEN_CPU_CAPABILITY=avx2",
    )
    assert capped_isa("avx512_bf16", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}) == (
        "avx512",
        "ONEDNN_MAX_CPU_ISA=AVX512_CORE",
    )
    # A cap at or above the CPU's own level, or one that caps nothing, is not a cap.
    assert capped_isa("avx2", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}) == ("avx2", "")
    assert capped_isa("amx", {"ONEDNN_MAX_CPU_ISA": "ALL"}) == ("amx", "")


def test_the_cpu_is_read_from_cpuinfo(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        f"processor\t: 0\ncpu family\t: 25\nmodel\t\t: 1\nmodel name\t: AMD EPYC 7B13\n"
        f"flags\t\t: {AVX2_EPYC}\n\n"
        f"processor\t: 1\nmodel name\t: AMD EPYC 7B13\nflags\t\t: {AVX2_EPYC}\n"
    )
    cpu = read_cpu(cpuinfo, environ={})
    assert (cpu.model, cpu.isa, cpu.native_bf16) == ("AMD EPYC 7B13", "avx2", False)
    assert cpu.family == "25/1"  # the generation, which the model name may not say
    assert cpu.cores >= 1
    assert "AVX2" in cpu.describe()


def test_an_unreadable_cpuinfo_assumes_no_native_bf16(tmp_path: Path) -> None:
    cpu = read_cpu(tmp_path / "missing", environ={})
    assert cpu.isa == "default" and not cpu.native_bf16


@pytest.mark.parametrize(
    ("isa", "dtype"),
    [
        ("default", "float32"),
        ("avx2", "float32"),
        ("avx512", "float32"),
        ("avx512_bf16", "bfloat16"),
        ("amx", "bfloat16"),
    ],
)
def test_auto_is_bf16_only_on_cpus_that_run_it_natively(isa: IsaLevel, dtype: str) -> None:
    hardware = machine(isa)
    assert engine_precision("auto", hardware).dtype == dtype
    assert trainer_precision("auto", "cpu", hardware).dtype == dtype
    assert trainer_precision("auto", "auto", hardware).dtype == dtype
    assert not engine_precision("auto", hardware).warning


def test_a_cap_to_avx2_turns_auto_to_float32() -> None:
    cpu = read_cpu(Path("/proc/cpuinfo"), environ={"ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert not cpu.native_bf16
    assert trainer_precision("auto", "cpu", Hardware(cpu)).dtype == "float32"


def test_auto_on_a_gpu_follows_its_bf16_support() -> None:
    h200 = machine("avx2", GpuInfo("NVIDIA H200", bf16=True))
    t4 = machine("amx", GpuInfo("Tesla T4", bf16=False))
    assert engine_precision("auto", h200).dtype == "bfloat16"
    assert trainer_precision("auto", "auto", h200).dtype == "bfloat16"
    # Without bf16 the engine takes fp16; the trainer, which has no loss scaling, float32.
    assert engine_precision("auto", t4).dtype == "float16"
    assert trainer_precision("auto", "cuda:0", t4).dtype == "float32"
    # A trainer told to use the CPU decides by the CPU, whatever GPU there is.
    assert trainer_precision("auto", "cpu", h200).dtype == "float32"
    assert h200.machine_class == "gpu-nvidia-h200"


def test_an_explicit_bf16_without_native_support_runs_with_one_warning_naming_the_cost(
    caplog: pytest.LogCaptureFixture,
) -> None:
    hardware = machine("avx2")
    precision = trainer_precision("bfloat16", "cpu", hardware)
    assert precision.dtype == "bfloat16"
    assert "38x slower than float32" in precision.warning
    with caplog.at_level(logging.INFO, logger="common.runtime.hardware"):
        log_precision("trainer_svc", precision, hardware)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "auto or float32" in warnings[0].getMessage()
    assert not trainer_precision("bfloat16", "cpu", machine("amx")).warning
    assert not trainer_precision("float32", "cpu", hardware).warning


def test_the_record_carries_the_machine_fields() -> None:
    record = Hardware(
        CpuInfo("AMD EPYC", "avx2", "avx512_bf16", "ONEDNN_MAX_CPU_ISA=AVX2", 2, "26/2")
    )
    fields = record.record()
    assert fields["cpu_model"] == "AMD EPYC" and fields["cpu_family_model"] == "26/2"
    assert fields["isa"] == "avx2" and fields["native_isa"] == "avx512_bf16"
    assert fields["machine_class"] == "cpu-avx2" and fields["cores"] == 2
    assert fields["native_bf16"] is False


@pytest.mark.parametrize(
    ("service", "variable", "allowed"),
    [
        ("trainer_svc", "TRAINER_COMPUTE_DTYPE", "'auto', 'float32' or 'bfloat16'"),
        ("rollout_svc", "ROLLOUT_DTYPE", "'auto', 'float32', 'bfloat16' or 'float16'"),
    ],
)
def test_a_bad_dtype_setting_is_one_line_naming_the_allowed_values(
    tmp_path: Path, service: str, variable: str, allowed: str
) -> None:
    env = {"PATH": "", "MARLAAS_STATE_DIR": str(tmp_path), variable: "fp16"}
    result = subprocess.run(
        [sys.executable, "-m", service], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert result.stderr.strip() == f"{service}: {variable}='fp16': must be {allowed}"
