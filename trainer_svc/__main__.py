"""`python -m trainer_svc`: one base model, one LoRA adapter and optimizer per owned job."""

from __future__ import annotations

import asyncio
import sys

from common.config import SharedSettings, TrainerSettings, load
from common.logs import setup_logging
from common.service import log_settings, run_service


def main() -> int:
    shared, settings = load(SharedSettings), load(TrainerSettings)
    setup_logging(shared.log_level)
    log_settings(shared, settings)
    from common.models import resolve_base_model
    from trainer_svc.policy import MultiAdapterPolicy
    from trainer_svc.service import TrainerService

    policy = MultiAdapterPolicy(
        resolve_base_model(shared.base_model, shared.cache_dir),
        torch_threads=settings.torch_threads,
    )
    return asyncio.run(run_service(TrainerService(shared, settings, policy)))


if __name__ == "__main__":
    sys.exit(main())
