"""Seeded sampling (`rl.sampling.seed`): which seed each sampled turn gets
(`rollout_svc.sampling.turn_seed`); vLLM drawing the same tokens from it is
tests/integration/test_rollout_engine.py's."""

from __future__ import annotations

import msgspec

from common.state.flow import group_id_of
from common.wire.messages import SamplingSettings
from rollout_svc.sampling import turn_seed
from tests.handler_kit import request_for


def seeded(job_id: str, group: int, sample: int, turn: int, seed: int | None) -> int | None:
    request = msgspec.structs.replace(
        request_for(job_id, group, 0),
        group_id=group_id_of(job_id, group),
        sample_index=sample,
        turn=turn,
        sampling=SamplingSettings(seed=seed),
    )
    return turn_seed(request)


def test_unseeded_sampling_stays_unseeded() -> None:
    assert seeded("j", 0, 0, 0, None) is None


def test_a_turns_seed_is_named_by_the_spec_not_the_job_id() -> None:
    first = seeded("seq-0", 3, 1, 0, seed=5)
    assert first == seeded("conc-0", 3, 1, 0, seed=5)  # the same spec under another id
    assert first is not None and 0 <= first < 2**63
    others = {
        seeded("seq-0", 4, 1, 0, seed=5),  # another group
        seeded("seq-0", 3, 2, 0, seed=5),  # another sample
        seeded("seq-0", 3, 1, 1, seed=5),  # the next turn
        seeded("seq-0", 3, 1, 0, seed=6),  # another seed
    }
    assert len(others) == 4 and first not in others
