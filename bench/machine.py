"""The machine a benchmark ran on, recorded in every result (bench/README.md, "Machines").

Figures from different CPUs differ several-fold (an AVX2-only CPU runs bf16 some 40x slower
than float32, an AMX one 2-5x faster), so each result names its machine class in its file
name and carries the CPU model, ISA level (after any cap such as `ONEDNN_MAX_CPU_ISA`), cores
and the precision each part computed in.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from common.runtime.hardware import ComputeDtype, Hardware, detect
from console.stack.services import service_precisions

RESULTS = Path(__file__).parent / "results"
SETTING_PREFIXES = ("ROLLOUT_", "TRAINER_", "ENV_SVC_", "ONEDNN_", "ATEN_", "OMP_")
"""Environment variables a result records when set: the services' settings and the kernels'
caps, so two runs that differ in one are told apart by their JSON, not only their names."""


def machine_tag(hardware: Hardware | None = None) -> str:
    """What result files are named by: `cpu<cores>-<isa>` (e.g. cpu2-avx2) or `gpu-<name>`."""
    hardware = hardware or detect()
    if hardware.gpus:
        return hardware.machine_class
    return f"cpu{hardware.cpu.cores}-{hardware.cpu.isa}"


def machine_fields(**precision: str) -> dict[str, Any]:
    """The `machine` block of a result: the hardware, and what each named part (trainer,
    engine, ...) computed in."""
    return {
        **detect().record(),
        "tag": machine_tag(),
        "precision": precision,
        "settings": settings_set(),
    }


def settings_set() -> dict[str, str]:
    """The `SETTING_PREFIXES` variables set in this environment (none of them a secret)."""
    return {
        name: value
        for name, value in sorted(os.environ.items())
        if name.startswith(SETTING_PREFIXES)
        and not any(word in name for word in ("PASSWORD", "SECRET", "KEY", "TOKEN"))
    }


def result_path(what: str, suffix: str = ".json", *, date: str | None = None) -> Path:
    """`bench/results/<what>-<date>-<machine tag><suffix>`."""
    date = date or datetime.now(UTC).strftime("%Y%m%d")
    return RESULTS / f"{what}-{date}-{machine_tag()}{suffix}"


def trainer_dtype() -> ComputeDtype:
    """What the trainer computes in on this machine with its settings (`TRAINER_COMPUTE_DTYPE`,
    default auto), so a bench measures the trainer the service would run."""
    return service_precisions(("trainer_svc",), detect())["trainer_svc"].dtype


def engine_dtype() -> ComputeDtype:
    """The rollout engine's, likewise (`ROLLOUT_DTYPE`, default auto)."""
    return service_precisions(("rollout_svc",), detect())["rollout_svc"].dtype
