"""`python -m rollout_svc`: the vLLM engine serving every job's adapter in one batch."""

from __future__ import annotations

import os
import sys

from common.runtime.config import RolloutSettings
from common.runtime.cores import pin_to_cores
from common.runtime.entrypoint import serve
from common.runtime.imports import load_object
from common.runtime.service import exit_code, start_settings


def main() -> int:
    shared, settings = start_settings(RolloutSettings)
    if settings.cpu_cores:  # before vLLM starts its threads and engine process: they inherit it
        pin_to_cores(settings.cpu_cores)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", settings.cpu_cores)
    from common.files.models import resolve_base_model
    from rollout_svc.engine import RolloutEngine
    from rollout_svc.engine_settings import EngineSettings
    from rollout_svc.service import GenerationEngine, RolloutService

    model = resolve_base_model(shared.base_model, shared.cache_dir)
    engine: GenerationEngine = (
        RolloutEngine(
            EngineSettings(
                model,
                max_loras=shared.max_loras,
                max_lora_rank=shared.max_lora_rank,
                lora_target_modules=shared.lora_target_modules,
                max_model_len=settings.max_model_len,
                kv_cache_gib=settings.kv_cache_gib,
                gpu_memory_utilization=settings.gpu_memory_utilization,
                enforce_eager=settings.enforce_eager,
                dtype=settings.dtype,
            )
        )
        if settings.engine == "vllm"
        else load_object(settings.engine)(model)
    )
    service = RolloutService(shared, settings, engine)
    return serve(service, shared, settings.metrics_port)


if __name__ == "__main__":  # vLLM spawns an engine process that re-imports the main module
    sys.exit(exit_code("rollout_svc", main))
