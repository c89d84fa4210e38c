"""`marlaas envs` and `marlaas envs check`: the built-in environments pass; a broken one is
flagged for each thing env_svc would trip over."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from console.cli.main import app
from env_svc.checker import check_environment
from env_svc.envs.arithmetic import last_number
from env_svc.protocol import ENVIRONMENTS_VAR, available_environments
from tests.readme_env import install_readme_environment

BROKEN = '''
import random

from env_svc.protocol import Environment, Reward, Task


class FlakyTask(Task, frozen=True):
    noise: float


def picky(task, completion):
    if not completion[-1]["content"].strip():
        raise ValueError("nothing to score")
    return 1.0


class BrokenEnv(Environment[FlakyTask]):
    """Fails every way the checker knows."""

    name = "broken"
    task_type = FlakyTask

    def make_rewards(self):
        return [Reward("picky", picky)]

    def sample_task(self, rng):
        # Not reproducible (a global RNG), and NaN never equals itself after a round trip.
        noise = random.random()
        return FlakyTask(question="?", noise=noise if noise < 0.5 else float("nan"))

    def respond(self, state, action_text):
        if "<tool>" in action_text:
            raise RuntimeError("tool parser crashed")
        return None
'''


@pytest.fixture
def broken_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    (tmp_path / "broken_env.py").write_text(BROKEN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(ENVIRONMENTS_VAR, "broken=broken_env:BrokenEnv")
    yield "broken"
    sys.modules.pop("broken_env", None)


CRASHING = '''
from env_svc.protocol import Environment, Task


class CrashingEnv(Environment[Task]):
    """Its tasks come from a list too short for the draw (a dataset env's bug)."""

    name = "crashing"
    task_type = Task

    def make_rewards(self):
        return []

    def sample_task(self, rng):
        return [][rng.randrange(3)]
'''


def test_an_environment_whose_own_code_raises_is_a_fail_row_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "crashing_env.py").write_text(CRASHING)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(ENVIRONMENTS_VAR, "crashing=crashing_env:CrashingEnv")
    try:
        report = check_environment("crashing", tasks=4)
        failed = {f.check: f.detail for f in report.findings if not f.ok}
        assert failed["training tasks"].startswith("raised IndexError")
        assert failed["evaluation tasks"].startswith("raised IndexError")
        result = CliRunner().invoke(app, ["envs", "check", "crashing", "--tasks", "4"])
        assert result.exit_code == 1, result.output
        assert isinstance(result.exception, SystemExit)  # typer's exit, nothing raised
        assert "FAIL" in result.output and "IndexError" in result.output
        assert "Traceback" not in result.output
    finally:
        sys.modules.pop("crashing_env", None)


@pytest.mark.parametrize("name", ["arithmetic", "calculator", "code_tasks", "countdown"])
def test_the_built_in_environments_pass(name: str) -> None:
    report = check_environment(name, tasks=16)
    assert report.ok, [f for f in report.findings if not f.ok]
    assert {f.check for f in report.findings} >= {
        "construct",
        "training tasks",
        "evaluation tasks",
        "state bytes",
        "reward",
        "time per step",
    }


def test_a_number_of_thousands_of_digits_scores_zero_instead_of_failing_the_reward() -> None:
    """Found by the checker: Python refuses int('9' * 5000), so the reward failed and the
    episode was lost to training (a job fails after enough of those in a row)."""
    assert last_number("9" * 5_000) is None and last_number("so 12") == 12


def test_a_broken_environment_is_flagged_for_each_fault(broken_env: str) -> None:
    assert broken_env in available_environments()
    report = check_environment(broken_env, tasks=24, seed=3)
    failed = {f.check: f.detail for f in report.findings if not f.ok}
    assert "NOT reproducible" in failed["training tasks"]
    assert "tool parser crashed" in failed["step"]
    assert "nothing to score" in failed["reward"]
    assert "decoded state differs" in failed["state bytes"]
    assert not report.ok


def test_the_cli_lists_environments_and_exits_1_on_a_failed_check(broken_env: str) -> None:
    runner = CliRunner()
    listed = runner.invoke(app, ["envs"])
    assert listed.exit_code == 0, listed.output
    assert "calculator" in listed.output and "BrokenEnv" in listed.output
    assert "max_operand=9" in listed.output  # arithmetic's default
    checked = runner.invoke(app, ["envs", "check", broken_env, "--tasks", "12"])
    assert checked.exit_code == 1 and "check(s) failed" in checked.output
    good = runner.invoke(app, ["envs", "check", "arithmetic", "--params", '{"max_operand": 99}'])
    assert good.exit_code == 0 and "every check passed" in good.output, good.output
    bad = runner.invoke(app, ["envs", "check", "arithmetic", "--params", "[1]"])
    assert bad.exit_code != 0 and "JSON object" in bad.output


def test_the_readme_example_is_found_by_its_entry_point_and_passes_the_checker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = install_readme_environment(tmp_path)  # a real `pip install`
    monkeypatch.syspath_prepend(str(site))
    try:
        assert "reverse" in available_environments()
        report = check_environment("reverse", tasks=8)
        assert report.ok, [f for f in report.findings if not f.ok]
        bad = check_environment("reverse", {"min_length": 0})
        assert "min_length" in bad.findings[0].detail and not bad.ok
    finally:
        sys.modules.pop("reverse_env", None)
