"""`python -m trainer_svc`: one base model, one LoRA adapter and optimizer per owned job."""

from __future__ import annotations

import asyncio
import sys

from common.runtime.config import TrainerSettings
from common.runtime.cores import parse_cores, pin_to_cores
from common.runtime.entrypoint import serve, start_up_check
from common.runtime.hardware import detect, log_precision, trainer_precision
from common.runtime.service import exit_code, start_settings


def main(argv: list[str] | None = None) -> int:
    """Run the service; with `--check`, load the base model and build the service (settings,
    imports, model, device) without connecting, and exit 0: what an image must be able to
    do."""
    check = start_up_check(argv)
    shared, settings = start_settings(TrainerSettings, check=check)
    threads = pin_to_cores(settings.cpu_cores, settings.torch_threads)
    hardware = detect()
    precision = trainer_precision(settings.compute_dtype, settings.device, hardware)
    log_precision("trainer_svc", precision, hardware)
    from common.files.models import resolve_base_model
    from trainer_svc.compute import ComputeThread
    from trainer_svc.policy import MultiAdapterPolicy
    from trainer_svc.service import TrainerService

    # Its own cores: the ones pin_to_cores left this process (ComputeThread's default).
    lent = parse_cores(settings.borrow_cores) if settings.borrow_cores else set()
    compute = ComputeThread(set(), lent, threads)

    def load_policy() -> MultiAdapterPolicy:
        return MultiAdapterPolicy(
            resolve_base_model(shared.base_model, shared.cache_dir),
            torch_threads=threads,
            compute_dtype=precision.dtype,
            device=settings.device,
            adjust_threads=compute.adjust,
        )

    # The model loads in start().
    service = TrainerService(shared, settings, load_policy, precision=precision, compute=compute)
    if check:
        asyncio.run(service.load_model())
        print(
            f"trainer_svc start-up check passed: {shared.base_model} on "
            f"{service.policy.device} in {precision.dtype}"
        )
        return 0
    return serve(service, shared, settings.metrics_port)


if __name__ == "__main__":
    sys.exit(exit_code("trainer_svc", main))
