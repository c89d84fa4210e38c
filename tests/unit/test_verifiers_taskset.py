"""A `verifiers` taskset as an environment (env_svc/envs/verifiers_taskset.py): tasks, rewards
and metrics as verifiers declares them, and what does not map refused with the reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from env_svc.envs.verifiers_taskset import TASKSETS_VAR, VerifiersEnv
from env_svc.protocol import EnvParamsError, ascore

pytest.importorskip("verifiers.v1", reason="the verifiers extra (make venv installs it)")

TASKSETS = Path(__file__).parents[1] / "tasksets"
UNMAPPED = """
import verifiers.v1 as vf

class Data(vf.TaskData):
    answer: str = "x"

class WithRuntime(vf.Task[Data]):
    @vf.reward
    async def ran(self, trace: vf.Trace, runtime: object) -> float:
        return 1.0

class Tools(vf.Toolset):
    pass

class WithTools(vf.Task[Data]):
    @classmethod
    def toolsets(cls, config):
        return [Tools()]

    @vf.reward
    async def fine(self, trace: vf.Trace) -> float:
        return 1.0

class Tasks(vf.Taskset[{task}, vf.TasksetConfig]):
    def load(self):
        yield {task}(Data(id="a", prompt="hi"), self.config.task)

__all__ = ["Tasks"]
"""


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The operator registered the tests' taskset and two that do not map."""
    for name, task in (("needs_runtime", "WithRuntime"), ("has_tools", "WithTools")):
        (tmp_path / f"{name}.py").write_text(UNMAPPED.format(task=task))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(TASKSETS))
    monkeypatch.setenv(TASKSETS_VAR, "mini-arith,needs-runtime,has-tools")


async def test_tasks_rewards_and_metrics_map(registered: None) -> None:
    env = VerifiersEnv({"taskset": "mini-arith"})
    assert [(r.name, r.weight) for r in env.rewards] == [("correct", 1.0), ("reply_words", 0.0)]
    task = env.task_for(7, 0)
    a, b = map(int, task.question.removeprefix("What is ").removesuffix("?").split(" + "))
    assert env.initial_messages(task) == [
        {"role": "system", "content": "Answer with the number only."},
        {"role": "user", "content": task.question},
    ]
    right = await ascore(env.rewards, task, [{"role": "assistant", "content": f"{a + b}."}])
    wrong = await ascore(env.rewards, task, [{"role": "assistant", "content": "It is 0"}])
    assert right.components == {"correct": 1.0, "reply_words": 1.0} and right.total == 1.0
    assert wrong.components == {"correct": 0.0, "reply_words": 3.0} and wrong.total == 0.0
    assert env.solved(right) and not env.solved(wrong)
    # Held out by a hash of each task's id: evaluation never draws a training task.
    trained = {env.task_for(7, i).index for i in range(200)}
    evaluated = {env.eval_task_for(0, i).index for i in range(50)}
    assert trained and evaluated and not trained & evaluated


@pytest.mark.parametrize(
    ("params", "reason"),
    [
        ({"taskset": "os"}, "unknown taskset 'os'; registered: has-tools, mini-arith"),
        ({"taskset": "needs-runtime"}, "its reward 'ran' needs a runtime, which does not map"),
        ({"taskset": "has-tools"}, "it has toolsets, which do not map"),
        ({"taskset": "mini-arith", "eval_fraction": 0.9}, "must be in (0, 0.5]"),
        ({"taskset": "x" * 129}, "must have 1-128 characters, got 129"),
        ({}, "required"),
    ],
)
def test_what_does_not_map_is_refused_with_the_reason(
    registered: None, params: dict[str, object], reason: str
) -> None:
    with pytest.raises(EnvParamsError, match="bad param") as refused:
        VerifiersEnv(params)
    assert reason in str(refused.value)
