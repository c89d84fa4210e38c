"""common.runtime.cores and the embedded stack's split of the cores between engine and trainer."""

from __future__ import annotations

import pytest

from common.runtime.cores import engine_trainer_split, format_cores, parse_cores, pin_to_cores
from console.stack.services import core_placement

SERVICES = ("env_svc", "rollout_svc", "trainer_svc")


@pytest.mark.parametrize(
    ("spec", "cores"),
    [("1", {1}), ("0-3,6", {0, 1, 2, 3, 6}), (" 2 , 4-5", {2, 4, 5})],
)
def test_core_lists_parse_and_format_back(spec: str, cores: set[int]) -> None:
    assert parse_cores(spec) == cores
    assert parse_cores(format_cores(cores)) == cores


def test_format_writes_ranges() -> None:
    assert format_cores([5, 0, 1, 2]) == "0-2,5"


@pytest.mark.parametrize("spec", ["", "a", "3-1", "-1", "1-"])
def test_a_bad_core_list_says_what_is_wrong(spec: str) -> None:
    with pytest.raises(ValueError, match="bad CPU core list"):
        parse_cores(spec)


def test_engine_gets_the_first_half_trainer_the_rest() -> None:
    assert engine_trainer_split({0, 1}) == ([0], [1])
    assert engine_trainer_split(range(16)) == (list(range(8)), list(range(8, 16)))
    assert engine_trainer_split({3}) is None


def test_the_stack_places_engine_and_trainer_unless_told_otherwise() -> None:
    assert core_placement(SERVICES, {0, 1}, {}) == {
        "rollout_svc": {"ROLLOUT_CPU_CORES": "0"},
        "trainer_svc": {"TRAINER_CPU_CORES": "1", "TRAINER_BORROW_CORES": "0"},
    }
    assert core_placement(SERVICES, {0, 1}, {"TRAINER_CPU_CORES": "0-1"}) == {}
    assert core_placement(SERVICES, {0, 1}, {"TRAINER_BORROW_CORES": ""}) == {
        "rollout_svc": {"ROLLOUT_CPU_CORES": "0"},
        "trainer_svc": {"TRAINER_CPU_CORES": "1"},
    }
    assert core_placement(("env_svc", "trainer_svc"), {0, 1}, {}) == {}
    assert core_placement(SERVICES, {0}, {}) == {}


def test_pinning_binds_the_process_and_counts_threads() -> None:
    import os

    before = os.sched_getaffinity(0)
    core = min(before)
    try:
        assert pin_to_cores(str(core)) == 1
        assert os.sched_getaffinity(0) == {core}
        assert pin_to_cores("", threads=3) == 3
    finally:
        os.sched_setaffinity(0, before)


@pytest.mark.parametrize("prefix", ["ROLLOUT", "TRAINER"])
def test_a_service_refuses_a_bad_core_setting(prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from pydantic import ValidationError

    from common.runtime.config import RolloutSettings, TrainerSettings

    settings = {"ROLLOUT": RolloutSettings, "TRAINER": TrainerSettings}[prefix]
    monkeypatch.setenv(f"{prefix}_CPU_CORES", "2-1")
    with pytest.raises(ValidationError, match="bad CPU core list"):
        settings()
    monkeypatch.setenv(f"{prefix}_CPU_CORES", "0-1,3")
    assert settings().cpu_cores == "0-1,3"
