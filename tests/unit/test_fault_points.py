"""common.runtime.faults: every named fault point is reached where it says, and the job recovers.

Each point is hit once in a handler scenario (memory bus and store; `os._exit` is replaced
by an exception, so the "crash" ends the scenario instead of pytest). Then a fresh service
on the same bus and store, as after a restart, finishes the work: the trainer points end in
a published, announced version whose ledger adds up; the env_svc points in a group that
the claim sweep sends in full.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from common.files.artifacts import latest_checkpoint_version
from common.runtime import faults
from common.state.audit import audit
from common.wire.messages import GenerationRequest, Topic, result_for
from env_svc.chat_template import ChatTokenizer
from tests.fakes import Backend, Inbox, memory_backend
from tests.handler_kit import GatedEngine, job_spec, request_for, trajectory
from tests.unit.test_faults import env_service, running_job, trainer_service


class Crashed(BaseException):
    """What `os._exit(137)` would have done to the process."""


@pytest.fixture
async def memory() -> AsyncIterator[Backend]:
    async with memory_backend() as backend:
        yield backend


@pytest.fixture
def crash_at(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    def exit_(code: int) -> None:
        raise Crashed(code)

    monkeypatch.setattr(faults.os, "_exit", exit_)
    yield faults.configure
    faults.configure("")


def test_fault_specs_are_checked() -> None:
    assert faults.parse("env.mid_group:0.5, *:0.01") == {"env.mid_group": 0.5, "*": 0.01}
    with pytest.raises(ValueError, match=r"unknown fault point 'env\.nowhere'"):
        faults.parse("env.nowhere:1")
    with pytest.raises(ValueError, match="not in \\[0, 1\\]"):
        faults.parse("env.mid_group:2")
    with pytest.raises(ValueError, match="not <point>:<probability>"):
        faults.parse("env.mid_group:often")


@pytest.mark.parametrize(
    "point",
    [
        "trainer.after_checkpoint",
        "trainer.after_latest",
        "trainer.after_pointer",
        "trainer.before_update",
        "trainer.after_update",
    ],
)
async def test_a_trainer_killed_mid_step_is_finished_by_the_next_owner(
    point: str, crash_at: Any, memory: Backend, tiny_dir: Path, tmp_path: Path
) -> None:
    spec = await running_job(memory, "crash", issued=0)
    # env_svc issued group 0 (the ledger's `issued` entry).
    assert await memory.store.flow.try_issue_group(
        spec.job_id, max_staleness=0, groups_per_step=1, max_groups=3
    )
    crashed = trainer_service(memory, tiny_dir, tmp_path)
    await crashed.load_model()
    inbox = Inbox(Topic.TRAJECTORIES)
    records = [trajectory(spec, 0, sample, float(sample), 0) for sample in range(2)]
    for record in records:
        await inbox.hand(crashed.on_trajectory, record)
    crash_at(f"{point}:1")
    with pytest.raises(Crashed):
        await crashed.train_once()
    crash_at("")
    assert inbox.committable == 0  # nothing was released: the records come again

    owner = trainer_service(memory, tiny_dir, tmp_path)
    await owner.load_model()
    again = Inbox(Topic.TRAJECTORIES)
    for record in records:
        await again.hand(owner.on_trajectory, record)
    await owner.train_once()
    pointer = await memory.store.adapters.get(spec.job_id)
    assert pointer is not None and pointer.version == 1
    updates = await memory.sent(Topic.ADAPTERS, spec.job_id, expect=1)
    assert {u.version for u in updates} == {1}  # type: ignore[union-attr]
    assert again.committable == 2
    report = audit(
        spec.job_id,
        await memory.store.flow.ledger(spec.job_id),
        status="running",
        groups_per_step=1,
        pointer_version=pointer.version,
    )
    assert report.ok and report.trained_groups == 1, report.problems
    assert latest_checkpoint_version(tmp_path, spec.job_id) == 1
    # Its step event went out once the new owner resumed, if the crash came before it.
    steps = [e for e in await memory.sent(Topic.EVENTS, spec.job_id, expect=1) if e.event == "step"]  # type: ignore[union-attr]
    assert {e.step for e in steps} == {1} and pointer.announced == 1  # type: ignore[union-attr]


@pytest.mark.parametrize("point", ["env.after_claim", "env.mid_group"])
async def test_a_group_cut_short_by_a_crashed_env_replica_is_sent_in_full_by_the_sweep(
    point: str, crash_at: Any, memory: Backend, tokenizer: ChatTokenizer
) -> None:
    spec = job_spec("crash", group_size=3, groups_per_step=1, max_staleness=0, max_steps=2)
    crash_at(f"{point}:1")
    with pytest.raises(Crashed):
        await Inbox(Topic.JOBS).hand(env_service(memory, tokenizer).handle, spec)
    crash_at("")
    before = len(await memory.sent(Topic.PROMPTS, spec.job_id, expect=0))
    assert before == (0 if point == "env.after_claim" else 1)
    sweeper = env_service(memory, tokenizer, claim_timeout_s=0.01)
    await asyncio.sleep(0.05)
    assert await sweeper.sweep_claims() == 1
    sent = await memory.sent(Topic.PROMPTS, spec.job_id, expect=before + 3)
    assert {r.episode_id for r in sent} == {f"{spec.job_id}/0/{i}" for i in range(3)}  # type: ignore[union-attr]


async def test_an_env_replica_killed_after_sending_a_follow_up_is_deduplicated(
    crash_at: Any, memory: Backend, tokenizer: ChatTokenizer
) -> None:
    spec = job_spec("crash", group_size=2, groups_per_step=1, max_staleness=0, max_steps=1)
    service = env_service(memory, tokenizer)
    await Inbox(Topic.JOBS).hand(service.handle, spec)
    first, _ = await memory.sent(Topic.PROMPTS, spec.job_id, expect=2)
    assert isinstance(first, GenerationRequest)
    completion = [*tokenizer.encode("7"), tokenizer.eos_token_id]
    result = result_for(
        first,
        completion_token_ids=completion,
        logprobs=[-0.5] * len(completion),
        adapter_version=0,
        finish_reason="stop",
    )
    crash_at("env.after_send:1")
    with pytest.raises(Crashed):
        await Inbox(Topic.ROLLOUTS).hand(service.handle, result)
    crash_at("")
    restarted = env_service(memory, tokenizer)
    await Inbox(Topic.ROLLOUTS).hand(restarted.handle, result)  # redelivered
    await Inbox(Topic.ROLLOUTS).hand(restarted.handle, result)  # and once more
    ended = await memory.sent(Topic.TRAJECTORIES, spec.job_id, expect=2)
    assert {t.episode_id for t in ended} == {first.episode_id}  # type: ignore[union-attr]
    assert len(ended) == 2  # one copy before the crash, one after; the trainer keeps one


async def test_a_rollout_replica_killed_after_sending_keeps_the_prompt_uncommitted(
    crash_at: Any, memory: Backend
) -> None:
    from common.runtime.config import RolloutSettings, SharedSettings
    from rollout_svc.service import RolloutService

    engine = GatedEngine()
    service = RolloutService(
        SharedSettings(), RolloutSettings(), engine, producer=memory.producer, store=memory.store
    )
    prompts = Inbox(Topic.PROMPTS)
    crash_at("rollout.after_send:1")
    await prompts.hand(service.on_request, request_for("crash-job", 0, min_adapter_version=0))
    engine.gate.set()
    with pytest.raises(Crashed):
        await asyncio.gather(*service.slots.generations)
    assert prompts.committable == 0  # redelivered after the restart; env_svc de-duplicates
    assert len(await memory.sent(Topic.ROLLOUTS, "crash-job", expect=1)) == 1


def test_every_fault_point_has_a_scenario() -> None:
    here = Path(__file__).read_text()
    assert all(f'"{point}' in here for point in faults.FAULT_POINTS)
