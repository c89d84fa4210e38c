"""Building blocks of the handler tests: job specs, trajectories, requests, services on a
backend, and a deterministic rollout engine (tests/unit/conftest.py has the fixtures)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common.files.artifacts import adapter_dir
from common.runtime.config import (
    EnvServiceSettings,
    RolloutSettings,
    SharedSettings,
    TrainerSettings,
)
from common.state.flow import ISSUED_GROUPS
from common.state.keyspace import flow_key
from common.state.store import RedisStore
from common.wire.adapters import AdapterRef
from common.wire.messages import (
    AdapterUpdate,
    EnvSettings,
    EvalSettings,
    Event,
    GenerationRequest,
    GenerationResult,
    JobSpec,
    RLSettings,
    SamplingSettings,
    Trajectory,
    new_id,
    result_for,
)
from env_svc.chat_template import ChatTokenizer
from env_svc.service import EnvService
from rollout_svc.engine_protocol import GenerationEngine
from rollout_svc.service import RolloutService
from tests.fakes import Backend
from trainer_svc.policy import MultiAdapterPolicy
from trainer_svc.service import TrainerService

BASE_MODEL = "smollm2-135m-instruct"


def job_spec(
    name: str,
    *,
    env: str = "arithmetic",
    group_size: int,
    groups_per_step: int,
    max_staleness: int,
    max_steps: int,
    evals: EvalSettings | None = None,
    resample_uniform_groups: int = 0,
) -> JobSpec:
    """A job on the tiny model; without `evals` it evaluates nothing, so tests of training
    see only training requests."""
    return JobSpec(
        job_id=f"{name}-{new_id()[:8]}",
        tenant="acme",
        base_model=BASE_MODEL,
        env=EnvSettings(name=env, params={"max_operand": 9}),
        rl=RLSettings(
            group_size=group_size,
            groups_per_step=groups_per_step,
            max_steps=max_steps,
            max_staleness=max_staleness,
            max_context_tokens=128,
            resample_uniform_groups=resample_uniform_groups,
            sampling=SamplingSettings(max_new_tokens=8),
        ),
        eval=evals or EvalSettings(tasks=0),
    )


async def register_running(store: RedisStore, spec: JobSpec, *, issued: int = 64) -> None:
    """Register the job as running with `issued` groups already issued, as env_svc would
    have (the trainer takes trajectories only of issued groups), for tests that hand the
    trainer trajectories themselves."""
    await store.jobs.register(spec, status="running")
    await store.client.hset(flow_key(spec.job_id), ISSUED_GROUPS, issued)


def events(messages: Sequence[object], kind: str) -> list[Event]:
    return [m for m in messages if isinstance(m, Event) and m.event == kind]


def adapter_uri(job_id: str, version: int) -> str:
    """Where the trainer would publish the version, in the handler services' artifact store
    (rollout and env_svc act only on updates naming their job's own directory)."""
    return str(adapter_dir(SharedSettings().artifacts, job_id) / f"v{version}")


def adapter_update(job_id: str, version: int) -> AdapterUpdate:
    """The announcement of a version published at `adapter_uri` (publish it in the store)."""
    return AdapterUpdate(
        job_id=job_id, version=version, uri=adapter_uri(job_id, version), step=version
    )


def rollout_service(backend: Backend, engine: GenerationEngine) -> RolloutService:
    return RolloutService(
        SharedSettings(),
        RolloutSettings(),
        engine,
        producer=backend.producer,
        store=backend.store,
    )


def env_service(backend: Backend, tokenizer: ChatTokenizer, **settings: Any) -> EnvService:
    return EnvService(
        SharedSettings(base_model=BASE_MODEL),
        EnvServiceSettings(**settings),
        tokenizer,
        producer=backend.producer,
        store=backend.store,
    )


async def trainer_service(
    backend: Backend, model_dir: Path, artifact_dir: Path, **settings: Any
) -> TrainerService:
    """A trainer on the tiny model at `model_dir`, its model loaded."""
    service = TrainerService(
        SharedSettings(base_model=str(model_dir), artifact_dir=artifact_dir),
        TrainerSettings(**settings),
        lambda: MultiAdapterPolicy(model_dir),
        producer=backend.producer,
        store=backend.store,
    )
    await service.load_model()
    return service


def trajectory(spec: JobSpec, group: int, sample: int, reward: float, version: int) -> Trajectory:
    return Trajectory(
        episode_id=f"{spec.job_id}/{group}/{sample}",
        job_id=spec.job_id,
        group_id=f"{spec.job_id}/g{group}",
        sample_index=sample,
        group_size=spec.rl.group_size,
        token_ids=[1, 2, 3, 4, 5],
        loss_mask=[0, 0, 1, 1, 1],
        behaviour_logprobs=[0.0, 0.0, -2.0, -2.0, -2.0],
        reward=reward,
        adapter_versions=[version],
    )


class GatedEngine:
    """A deterministic engine whose generations finish when the test opens the gate."""

    ready = True
    loaded_adapters = 0
    busy_seconds = 0.0
    request_seconds = 0.0
    prompt_tokens = 0
    cached_prompt_tokens = 0
    preemptions = 0

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.in_flight = 0
        self.generated_tokens = 0
        self.loaded: list[AdapterRef] = []
        self.used: list[AdapterRef | None] = []
        self.retired: list[tuple[str, int]] = []

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def generate(
        self, request: GenerationRequest, adapter: AdapterRef | None = None
    ) -> GenerationResult:
        self.used.append(adapter)
        self.in_flight += 1
        await self.gate.wait()
        self.in_flight -= 1
        self.generated_tokens += 2
        return result_for(
            request,
            completion_token_ids=[7, 8],
            logprobs=[-0.5, -0.5],
            adapter_version=adapter.version if adapter else 0,
            finish_reason="stop",
        )

    async def load(self, adapter: AdapterRef) -> None:
        self.loaded.append(adapter)

    async def retire(self, job_id: str, version: int) -> None:
        self.retired.append((job_id, version))


def request_for(job_id: str, index: int, min_adapter_version: int) -> GenerationRequest:
    return GenerationRequest(
        request_id=f"{job_id}/{index}/0/t0",
        job_id=job_id,
        episode_id=f"{job_id}/{index}/0",
        group_id=f"{job_id}/g{index}",
        sample_index=0,
        turn=0,
        context_token_ids=[1, 2, 3],
        sampling=SamplingSettings(),
        min_adapter_version=min_adapter_version,
    )
