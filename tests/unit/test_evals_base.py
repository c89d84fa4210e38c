"""A version worse than the base model on held-out tasks: by more than the standard error of
the difference, not by noise."""

from __future__ import annotations

from common.state.evals import EvalTally, below_base


def tally(version: int, solved: int, episodes: int = 32) -> EvalTally:
    return EvalTally(version, episodes, float(solved), solved, {})


def test_a_drop_beyond_the_standard_error_of_the_difference_is_named() -> None:
    # The demo run issue 26 reports: 0.66 -> 0.34 on 32 tasks (SE of the difference 0.119).
    reason = below_base(tally(8, 11), tally(0, 21))
    assert reason.startswith("held-out accuracy 0.344 of v8 is below the base model's 0.656")
    assert "(0.119)" in reason


def test_noise_and_gains_are_not() -> None:
    assert below_base(tally(8, 19), tally(0, 21)) == ""  # 0.59 vs 0.66: within the error
    assert below_base(tally(8, 30), tally(0, 21)) == ""
    assert below_base(tally(8, 0, episodes=0), tally(0, 21)) == ""  # nothing evaluated
