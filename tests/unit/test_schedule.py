"""The learning-rate schedule: each step's share of `rl.learning_rate`."""

from __future__ import annotations

import itertools
import math

import pytest

from common.wire.messages import RLSettings
from trainer_svc.schedule import learning_rate, lr_factor


def _factors(**rl: object) -> list[float]:
    settings = RLSettings(**rl)  # type: ignore[arg-type]
    return [lr_factor(settings, step) for step in range(1, settings.max_steps + 1)]


def test_constant_takes_the_rate_every_step() -> None:
    assert _factors(max_steps=5) == [1.0] * 5


def test_linear_falls_from_the_peak_to_one_nth_at_the_last_step() -> None:
    assert _factors(max_steps=4, lr_schedule="linear") == [1.0, 0.75, 0.5, 0.25]


def test_cosine_starts_at_the_peak_and_never_reaches_zero() -> None:
    factors = _factors(max_steps=12, lr_schedule="cosine")
    assert factors[0] == 1.0
    assert all(a > b for a, b in itertools.pairwise(factors))
    assert factors[-1] == pytest.approx((1 + math.cos(math.pi * 11 / 12)) / 2) and factors[-1] > 0
    assert factors[6] == pytest.approx(0.5)  # halfway through the decay


def test_warmup_rises_to_the_peak_then_the_schedule_decays_over_the_steps_left() -> None:
    assert _factors(max_steps=6, warmup_steps=2, lr_schedule="linear") == [
        0.5,
        1.0,
        1.0,
        0.75,
        0.5,
        0.25,
    ]
    assert _factors(max_steps=3, warmup_steps=4) == [0.25, 0.5, 0.75]


def test_steps_count_from_one_and_stop_at_the_last() -> None:
    rl = RLSettings(max_steps=4, lr_schedule="linear", learning_rate=0.2)
    with pytest.raises(ValueError, match="count from 1"):
        lr_factor(rl, 0)
    assert lr_factor(rl, 9) == lr_factor(rl, 4)
    assert learning_rate(rl, 3) == pytest.approx(0.1)
