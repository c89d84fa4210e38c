"""`unit_conversion`: a tool environment whose tool comes from an MCP server and whose answer
is judged by a model as well as checked.

The model converts a length with `units.convert`, a tool of the example MCP server
(examples/mcp/units_server.py, which the operator registers as `units`), and replies with the
result and its unit. Two rewards: `correct` (the number within 0.1% of the truth) and, at a
small weight, `judged` (the stack's base model grades how the answer is stated, env_svc/judge.py).
Register it with env_svc, this folder on its Python path, beside the server:

    MARLAAS_ENVIRONMENTS=unit_conversion=unit_conversion:UnitConversionEnv
    MARLAAS_MCP_SERVERS='{"units": {"command": "python", "args": ["examples/mcp/units_server.py"]}}'

tests/integration/test_agentic_jobs.py runs its jobs end to end.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Annotated

from msgspec import Meta

from env_svc.judge import Judge
from env_svc.protocol import ChatMessage, Reward, Task
from env_svc.tools import ToolEnvironment, ToolParams
from env_svc.tools.rewards import final_number

UNITS = {"mi": 1609.344, "km": 1000.0, "ft": 0.3048, "m": 1.0}


class UnitConversionParams(ToolParams, frozen=True):
    mcp_servers: tuple[str, ...] = ("units",)
    judge_weight: Annotated[float, Meta(ge=0, le=1)] = 0.2
    """Weight of the judged reward (0: no judge asked)."""


class ConversionTask(Task, frozen=True):
    value: int
    from_unit: str
    to_unit: str
    answer: float


class UnitConversionEnv(ToolEnvironment[ConversionTask]):
    name = "unit_conversion"
    params_type = UnitConversionParams
    task_type = ConversionTask
    params: UnitConversionParams
    tools_intro = "You are a helpful assistant with a unit converter."
    tools_example = ("units.convert", {"value": 2, "from_unit": "km", "to_unit": "m"})
    tools_outro = "The result comes back in a tool message. Then reply with it and its unit."

    @property
    def max_turns(self) -> int:
        return 2

    def sample_task(self, rng: random.Random) -> ConversionTask:
        from_unit, to_unit = rng.sample(sorted(UNITS), 2)
        value = rng.randint(2, 99)
        return ConversionTask(
            question=f"How many {to_unit} are {value} {from_unit}?",
            value=value,
            from_unit=from_unit,
            to_unit=to_unit,
            answer=value * UNITS[from_unit] / UNITS[to_unit],
        )

    def make_rewards(self) -> list[Reward[ConversionTask]]:
        rewards = [Reward("correct", correct)]
        if self.params.judge_weight:
            judge = Judge("Is the answer one clear number with its unit?")
            rewards.append(Reward("judged", judge, self.params.judge_weight))
        return rewards


def correct(task: ConversionTask, completion: Sequence[ChatMessage]) -> float:
    said = final_number(completion)
    return float(said is not None and abs(float(said) - task.answer) <= 1e-3 * task.answer)
