"""A step's rows and each job's tally: freshness, the loss's denominator, metric means."""

import pytest

from common.wire.messages import Trajectory
from trainer_svc.tally import Row, Tally, step_rows


def _trajectory(mask: list[int], versions: list[int]) -> Trajectory:
    return Trajectory(
        episode_id="e",
        job_id="job",
        group_id="g",
        sample_index=0,
        group_size=1,
        token_ids=list(range(len(mask))),
        loss_mask=mask,
        behaviour_logprobs=[-1.0 * m for m in mask],
        reward=1.0,
        adapter_versions=versions,
    )


def test_a_row_is_fresh_only_when_every_turn_used_the_version_its_job_holds() -> None:
    batches = {
        "a": ([_trajectory([0, 1], [3]), _trajectory([0, 1], [2, 3])], [1.0, 0.0]),
        "b": ([_trajectory([0, 1], [3])], [1.0]),
    }
    rows = step_rows(batches, {"a": 3})
    assert [(r.job_id, r.fresh) for r in rows] == [("a", True), ("a", False), ("b", False)]
    with pytest.raises(ValueError, match="one advantage per trajectory"):
        step_rows({"a": ([_trajectory([0, 1], [3])], [])}, None)


def test_skipped_rows_count_in_the_loss_but_not_in_the_policy_metrics() -> None:
    tally = Tally()
    computed, skipped = (
        Row("a", _trajectory([0, 1, 1], [0]), 1.0),
        Row("a", _trajectory([0, 1, 1], [0]), 0.0),
    )
    for row in (computed, skipped):
        tally.add_row(row)
    tally.add_computed(computed)
    metrics = dict.fromkeys(
        ("loss", "clip_fraction", "is_capped_fraction", "mean_ratio", "mean_is_weight"), 0.5
    )
    tally.add({**metrics, "approx_kl": 0.5, "tokens": 2.0})
    out = tally.metrics()
    assert out["loss"] == pytest.approx(0.25)  # over all 4 tokens
    assert out["approx_kl"] == pytest.approx(0.5)  # over the 2 computed ones
    assert out["entropy"] == pytest.approx(1.0) and out["zero_advantage_share"] == 0.5
    assert tally.has_signal
