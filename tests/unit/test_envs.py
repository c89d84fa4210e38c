"""env_svc environments: rewards in numbers, reproducible tasks, state as bytes, the registry."""

from __future__ import annotations

import importlib.metadata
import json
import math
import random
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest

from common.wire.messages import EnvSettings, JobSpec
from env_svc.envs.arithmetic import ArithmeticEnv, ArithmeticTask
from env_svc.envs.calculator import (
    DEMONSTRATION,
    MAX_CALLS_PER_TURN,
    CalculatorEnv,
    CalculatorTask,
    calculator,
)
from env_svc.envs.code_tasks import CodeTasksEnv
from env_svc.envs.countdown import CountdownEnv, CountdownTask
from env_svc.protocol import (
    ChatMessage,
    Environment,
    EnvironmentLoadError,
    EnvParamsError,
    EnvSpecError,
    EpisodeStateError,
    Reward,
    RewardResult,
    Task,
    UnknownEnvironmentError,
    available_environments,
    decode_state,
    encode_state,
    environment_for,
    get_environment,
    score,
)
from env_svc.safe_eval import evaluate, safe_eval
from env_svc.tools import parse_tool_calls

BUILTINS = ("arithmetic", "calculator", "code_tasks", "countdown")


def tool_call(expression: str) -> str:
    payload = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(payload)}</tool_call>"


def answer(env: Environment[Any], task: Task, reply: str) -> RewardResult:
    """Reward of a one-turn episode answered with `reply`."""
    state, _ = env.reset(task)
    result = env.step(state, reply)
    assert result.done and result.reward is not None
    return result.reward


# --- arithmetic -----------------------------------------------------------------------

SEVEN_PLUS_FIVE = ArithmeticTask(
    question="What is 7 + 5? Answer with just the number.",
    left=7,
    operation="+",
    right=5,
    answer=12,
)


@pytest.mark.parametrize(
    ("reply", "total", "components"),
    [
        ("12", 1.1, {"correct": 1.0, "format": 1.0}),
        (" 12.\n", 1.1, {"correct": 1.0, "format": 1.0}),
        ("7 + 5 = 12", 1.0, {"correct": 1.0, "format": 0.0}),
        ("The answer is 12.0, a classic example.", 1.0, {"correct": 1.0, "format": 0.0}),
        ("13", 0.1, {"correct": 0.0, "format": 1.0}),
        ("12 is wrong, it is 13", 0.0, {"correct": 0.0, "format": 0.0}),
        ("7+5", 0.0, {"correct": 0.0, "format": 0.0}),
        ("I like turtles", 0.0, {"correct": 0.0, "format": 0.0}),
        ("", 0.0, {"correct": 0.0, "format": 0.0}),
    ],
)
def test_arithmetic_rewards(reply: str, total: float, components: dict[str, float]) -> None:
    reward = answer(ArithmeticEnv(), SEVEN_PLUS_FIVE, reply)
    assert reward.total == pytest.approx(total)
    assert reward.components == components
    assert reward.error == ""


def test_arithmetic_negative_and_grouped_answers() -> None:
    env = ArithmeticEnv()
    minus = ArithmeticTask(question="q", left=3, operation="-", right=8, answer=-5)
    assert answer(env, minus, "-5").components == {"correct": 1.0, "format": 1.0}
    assert answer(env, minus, "3-8 = -5").components["correct"] == 1.0
    big = ArithmeticTask(question="q", left=47, operation="*", right=86, answer=4042)
    assert answer(env, big, "It is 4,042.").components["correct"] == 1.0


def test_arithmetic_format_weight_zero_drops_the_component() -> None:
    reward = answer(ArithmeticEnv({"format_weight": 0}), SEVEN_PLUS_FIVE, "12")
    assert reward.total == 1.0
    assert reward.components == {"correct": 1.0}


def test_arithmetic_tasks_follow_params() -> None:
    env = ArithmeticEnv({"operations": ["+", "-", "*", "/"], "min_operand": 2, "max_operand": 12})
    tasks = [env.task_for(seed=3, index=i) for i in range(200)]
    assert {task.operation for task in tasks} == {"+", "-", "*", "/"}
    for task in tasks:
        assert task.answer == safe_eval(f"{task.left} {task.operation} {task.right}")
        assert task.question == (
            f"What is {task.left} {task.operation} {task.right}? Answer with just the number."
        )
        if task.operation == "/":
            assert 2 <= task.right <= 12 and 2 <= task.answer <= 12  # exact division
        else:
            assert 2 <= task.left <= 12 and 2 <= task.right <= 12
    first = ArithmeticEnv().task_for(seed=0, index=0)
    assert first.operation == "+" and 1 <= first.left <= 9 and 1 <= first.right <= 9


# --- reproducibility and state --------------------------------------------------------


@pytest.mark.parametrize("name", BUILTINS)
def test_tasks_are_reproducible(name: str) -> None:
    env, twin = get_environment(name), get_environment(name)
    assert env.task_for(seed=7, index=3) == twin.task_for(seed=7, index=3)
    stream = [env.task_for(seed=7, index=i) for i in range(30)]
    assert stream == [twin.task_for(seed=7, index=i) for i in range(30)]
    assert len({repr(task) for task in stream}) >= 20  # other indices, other tasks
    other_seed = [env.task_for(seed=8, index=i) for i in range(30)]
    assert other_seed != stream


def test_task_streams_are_pinned() -> None:
    # Seeds are strings hashed by `random` (SHA-512), independent of PYTHONHASHSEED and of
    # the process: every replica, and a restarted one, issues the same task for (seed, index).
    # A change here changes the tasks of running jobs after an upgrade.
    questions = [ArithmeticEnv().task_for(seed=0, index=i).question for i in range(3)]
    assert [q.split("?")[0] for q in questions] == [
        "What is 2 + 8",
        "What is 3 + 1",
        "What is 7 + 5",
    ]
    assert CalculatorEnv().task_for(seed=0, index=0).expression == "96 * 85"
    countdown = CountdownEnv().task_for(seed=0, index=0)
    assert (countdown.numbers, countdown.target) == ([1, 1, 5], 5)


@pytest.mark.parametrize("name", BUILTINS)
def test_state_round_trips_through_bytes(name: str) -> None:
    env = get_environment(name)
    state, messages = env.reset(env.task_for(seed=1, index=2))
    assert messages[-1] == {"role": "user", "content": state.task.question}
    raw = encode_state(state)
    assert isinstance(raw, bytes)
    assert decode_state(raw, env) == state
    done = env.step(env.decode_state(raw), "42")
    assert done.done
    again = env.decode_state(encode_state(done.state))
    assert again == done.state and again.done and again.turn == 1
    assert again.completion == [{"role": "assistant", "content": "42"}]


class _RenamedArithmetic(ArithmeticEnv):
    name = "arithmetic_v2"


def test_state_errors() -> None:
    env = ArithmeticEnv()
    with pytest.raises(EpisodeStateError, match="bad episode state"):
        env.decode_state(b"\x93not state")
    countdown_state, _ = CountdownEnv().reset(CountdownEnv().task_for(0, 0))
    with pytest.raises(EpisodeStateError, match="bad episode state"):
        env.decode_state(encode_state(countdown_state))
    arithmetic_state = encode_state(env.reset(SEVEN_PLUS_FIVE)[0])
    with pytest.raises(EpisodeStateError, match="belongs to 'arithmetic'"):
        _RenamedArithmetic().decode_state(arithmetic_state)
    finished = env.step(env.reset(SEVEN_PLUS_FIVE)[0], "12").state
    with pytest.raises(EpisodeStateError, match="finished episode"):
        env.step(finished, "12")


# --- calculator -----------------------------------------------------------------------

MULTIPLY = CalculatorTask(
    question="What is 47 * 86? Answer with just the number.", expression="47 * 86", answer=4042
)


def scored(reward: RewardResult) -> dict[str, float]:
    """The components of weighted rewards: without the tool layer's metrics."""
    return {k: v for k, v in reward.components.items() if not k.startswith("tools.")}


def test_calculator_full_episode() -> None:
    env = CalculatorEnv()
    state, messages = env.reset(MULTIPLY)
    # System prompt, one worked exchange, the task.
    assert [m["role"] for m in messages] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
        "user",
    ]
    assert messages[-1]["content"] == MULTIPLY.question
    assert '"name": "calculator"' in messages[0]["content"]  # the schema is in the prompt
    assert "<tool_call>" in messages[0]["content"]

    first = env.step(env.decode_state(encode_state(state)), tool_call("47 * 86"))
    assert not first.done and first.reward is None
    assert first.messages == [{"role": "tool", "content": "4042"}]
    assert first.state.turn == 1

    final = env.step(env.decode_state(encode_state(first.state)), "4042")
    assert final.done and not final.truncated and final.messages == []
    assert final.reward is not None
    assert scored(final.reward) == {"correct": 1.0, "tool_format": 1.0, "tool_use": 1.0}
    assert final.reward.components["tools.calls"] == 1.0  # the tool layer's metrics, weight 0
    assert final.reward.components["tools.errors"] == 0.0
    assert final.reward.total == pytest.approx(1.2)
    assert [m["role"] for m in final.state.completion] == ["assistant", "tool", "assistant"]


def test_the_calculator_demonstration_is_a_true_exchange_and_can_be_left_out() -> None:
    user, call, result, answer = (m["content"] for m in DEMONSTRATION)
    (parsed,) = parse_tool_calls(call)
    assert parsed.name == "calculator" and parsed.arguments["expression"] in user
    assert calculator(parsed.arguments["expression"]) == result == answer
    _, messages = CalculatorEnv({"demonstration": False}).reset(MULTIPLY)
    assert [m["role"] for m in messages] == ["system", "user"]


@pytest.mark.parametrize(
    ("turns", "total", "components"),
    [
        (["4042"], 1.0, {"correct": 1.0, "tool_format": 0.0, "tool_use": 0.0}),
        (["4000"], 0.0, {"correct": 0.0, "tool_format": 0.0, "tool_use": 0.0}),
        (
            [tool_call("47 * 86"), "4000"],
            0.2,
            {"correct": 0.0, "tool_format": 1.0, "tool_use": 1.0},
        ),
        (
            ["<tool_call>{not json</tool_call>", "4042"],
            1.0,
            {"correct": 1.0, "tool_format": 0.0, "tool_use": 0.0},
        ),
        (
            [tool_call("__import__('os')"), "4042"],
            1.1,
            {"correct": 1.0, "tool_format": 1.0, "tool_use": 0.0},
        ),
        (
            ["<tool_call>{not json</tool_call>" + tool_call("47*86"), "The answer is 4042."],
            1.15,
            {"correct": 1.0, "tool_format": 0.5, "tool_use": 1.0},
        ),
    ],
)
def test_calculator_rewards(turns: list[str], total: float, components: dict[str, float]) -> None:
    env = CalculatorEnv()
    state, _ = env.reset(MULTIPLY)
    for turn in turns:
        result = env.step(state, turn)
        state = result.state
    assert result.done and result.reward is not None
    assert scored(result.reward) == components
    assert result.reward.total == pytest.approx(total)


def test_calculator_tool_errors_are_shown_to_the_model() -> None:
    env = CalculatorEnv({"max_turns": 5})
    state, _ = env.reset(MULTIPLY)
    cases = {
        tool_call("__import__('os').system('echo hi')"): "function calls are not allowed",
        tool_call("9**9**9"): "exponent 387420489",
        tool_call("x * 2"): "names are not allowed",
        tool_call("1" * 300): "at most 200",
        "<tool_call>not json</tool_call>": "not JSON",
        '<tool_call>{"name": "search", "arguments": {}}</tool_call>': "unknown tool 'search'",
    }
    for action, says in cases.items():
        result = env.step(state, action)
        assert not result.done
        [reply] = result.messages
        assert reply["role"] == "tool"
        assert reply["content"].startswith("error: ") and says in reply["content"]


def test_calculator_call_variants() -> None:
    env = CalculatorEnv()
    state, _ = env.reset(MULTIPLY)
    # A stop string may cut the closing tag; OpenAI-style string arguments are accepted.
    unclosed = '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"7/2\\"}"}'
    assert env.step(state, unclosed).messages == [{"role": "tool", "content": "3.5"}]
    many = "".join(tool_call(f"{i} + 1") for i in range(MAX_CALLS_PER_TURN + 1))
    replies = env.step(state, many).messages
    assert [m["content"] for m in replies[:MAX_CALLS_PER_TURN]] == ["1", "2", "3", "4"]
    assert replies[-1]["content"].startswith("error: at most")


def test_calculator_turn_limit_ends_the_episode_with_a_reward() -> None:
    env = CalculatorEnv({"max_turns": 2})
    state, _ = env.reset(MULTIPLY)
    first = env.step(state, tool_call("47 * 86"))
    assert not first.done
    # An episode cut short elsewhere (context limit) is scored as it stands.
    assert scored(env.score(first.state)) == {
        "correct": 0.0,
        "tool_format": 1.0,
        "tool_use": 1.0,
    }
    second = env.step(first.state, tool_call("47 * 86"))
    assert second.done and second.truncated and second.messages == []
    assert second.reward is not None
    # No final answer: the last number of the expression (86) must not count as one.
    assert scored(second.reward) == {"correct": 0.0, "tool_format": 1.0, "tool_use": 1.0}
    assert second.reward.total == pytest.approx(0.2)
    assert second.state.turn == 2 and second.state.done

    single = CalculatorEnv({"max_turns": 1})
    result = single.step(single.reset(MULTIPLY)[0], tool_call("1 + 1"))
    assert result.done and result.truncated


def test_calculator_tasks() -> None:
    env = CalculatorEnv({"operations": ["*", "+"], "num_operands": 3})
    for index in range(50):
        task = env.task_for(seed=0, index=index)
        literals = evaluate(task.expression).literals
        assert len(literals) == 3 and all(10 <= n <= 99 for n in literals)
        assert task.answer == safe_eval(task.expression)
        assert task.expression in task.question


# --- countdown ------------------------------------------------------------------------

COUNTDOWN = CountdownTask(question="q", numbers=[3, 7, 2], target=23, solution="3 * 7 + 2")


@pytest.mark.parametrize(
    ("reply", "total", "components"),
    [
        ("<answer>3 * 7 + 2</answer>", 1.1, {"correct": 1.0, "format": 1.0}),
        ("Let me think.\n<answer>(7 * 3) + 2 = 23</answer>", 1.1, {"correct": 1.0, "format": 1.0}),
        ("Let me think.\n2 + 7 * 3", 1.0, {"correct": 1.0, "format": 0.0}),
        ("<answer>3 + 7 + 2</answer>", 0.1, {"correct": 0.0, "format": 1.0}),
        ("<answer>7 + 7 + 7 + 2</answer>", 0.1, {"correct": 0.0, "format": 1.0}),
        ("<answer>20 + 3</answer>", 0.1, {"correct": 0.0, "format": 1.0}),
        ("<answer>seven times three</answer>", 0.0, {"correct": 0.0, "format": 0.0}),
        ("<answer>__import__('os')</answer>", 0.0, {"correct": 0.0, "format": 0.0}),
        ("<answer>3 ** 2 + 7 * 2</answer>", 0.0, {"correct": 0.0, "format": 0.0}),
        ("I cannot do this.", 0.0, {"correct": 0.0, "format": 0.0}),
    ],
)
def test_countdown_rewards(reply: str, total: float, components: dict[str, float]) -> None:
    reward = answer(CountdownEnv(), COUNTDOWN, reply)
    assert reward.components == components
    assert reward.total == pytest.approx(total)


def test_countdown_division_is_exact() -> None:
    task = CountdownTask(question="q", numbers=[8, 3, 3], target=8, solution="(8 / 3) * 3")
    assert answer(CountdownEnv(), task, "<answer>(8 / 3) * 3</answer>").components["correct"] == 1


def test_countdown_tasks_are_solvable() -> None:
    env = CountdownEnv({"num_numbers": 4, "max_number": 20, "max_target": 50})
    for index in range(50):
        task = env.task_for(seed=5, index=index)
        assert len(task.numbers) == 4 and all(1 <= n <= 20 for n in task.numbers)
        assert 1 <= task.target <= 50
        solution = evaluate(task.solution)
        assert solution.value == task.target
        assert Counter(solution.literals) == Counter(task.numbers)
        assert answer(env, task, f"<answer>{task.solution}</answer>").total == pytest.approx(1.1)


# --- rewards --------------------------------------------------------------------------


def _one(task: Task, completion: Sequence[ChatMessage]) -> float:
    return 1.0


def _boom(task: Task, completion: Sequence[ChatMessage]) -> float:
    return 1 / 0


def test_reward_components_are_weighted_and_named() -> None:
    rewards = [
        Reward("one", _one, 0.5),
        Reward("parts", lambda task, completion: {"x": 1.0, "y": 0.5}, 2.0),
    ]
    result = score(rewards, Task(question="q"), [])
    assert result.components == {"one": 1.0, "parts.x": 1.0, "parts.y": 0.5}
    assert result.total == pytest.approx(0.5 + 2.0 + 1.0)
    assert result.ok


@pytest.mark.parametrize(
    ("broken", "says"),
    [
        (_boom, "ZeroDivisionError: division by zero"),
        (lambda task, completion: math.inf, "returned inf"),
        (lambda task, completion: "1.0", "returned '1.0', not a number"),
        (lambda task, completion: {"a": None}, "returned None, not a number"),
    ],
)
def test_reward_failures_are_recorded_not_scored_zero(broken: Any, says: str) -> None:
    rewards = [Reward("one", _one, 0.5), Reward("broken", broken), Reward("later", _one)]
    result = score(rewards, Task(question="q"), [])
    assert not result.ok
    assert result.error.startswith("reward 'broken' failed") and says in result.error
    assert result.components == {"one": 1.0}  # what was computed before the failure
    assert math.isnan(result.total)


class _BrokenArithmetic(ArithmeticEnv):
    def make_rewards(self) -> list[Reward[ArithmeticTask]]:
        return [*super().make_rewards(), Reward("boom", _boom)]


def test_environment_step_records_reward_errors() -> None:
    env = _BrokenArithmetic()
    result = env.step(env.reset(SEVEN_PLUS_FIVE)[0], "12")
    assert result.done and result.reward is not None
    assert "ZeroDivisionError" in result.reward.error
    assert result.reward.components == {"correct": 1.0, "format": 1.0}
    assert math.isnan(result.reward.total)


# --- registry and params --------------------------------------------------------------


def test_builtins_are_registered() -> None:
    assert set(BUILTINS) <= set(available_environments())
    classes = (ArithmeticEnv, CalculatorEnv, CodeTasksEnv, CountdownEnv)
    for name, cls in zip(BUILTINS, classes, strict=True):
        env = get_environment(name)
        assert type(env) is cls and env.name == name
    job = JobSpec(
        job_id="j", tenant="t", env=EnvSettings(name="calculator", params={"max_turns": 5})
    )
    env = environment_for(job)
    assert isinstance(env, CalculatorEnv) and env.max_turns == 5


def test_unknown_environment_lists_the_available_ones() -> None:
    with pytest.raises(UnknownEnvironmentError) as caught:
        get_environment("chess")
    assert "'chess'" in str(caught.value)
    assert "arithmetic, calculator, code_tasks, countdown" in str(caught.value)
    assert isinstance(caught.value, EnvSpecError) and isinstance(caught.value, ValueError)


@pytest.mark.parametrize(
    ("name", "params", "param", "says"),
    [
        ("arithmetic", {"min_operand": "one"}, "min_operand", "Expected `int`, got `str`"),
        ("arithmetic", {"operations": ["^"]}, "operations", "Invalid enum value '^'"),
        ("arithmetic", {"operation": ["+"]}, "operation", "unknown param"),
        ("arithmetic", {"operations": []}, "operations", "must have at least 1 items, got 0"),
        ("arithmetic", {"min_operand": 9, "max_operand": 1}, "min_operand", "max_operand"),
        ("calculator", {"max_turns": 0}, "max_turns", "must be in [1, 16], got 0"),
        ("calculator", {"tool_use_weight": -1}, "tool_use_weight", "must be in [0, 100], got -1"),
        ("countdown", {"num_numbers": 9}, "num_numbers", "must be in [2, 6], got 9"),
        ("countdown", {"min_number": 0}, "min_number", "must be in [1, 1000], got 0"),
        ("countdown", {"min_number": 9, "max_number": 3}, "min_number", "max_number"),
        ("calculator", {"max_operand": 10**7}, "max_operand", "must be in [-1000000, 1000000]"),
    ],
)
def test_bad_params_name_the_param(
    name: str, params: dict[str, Any], param: str, says: str
) -> None:
    with pytest.raises(EnvParamsError) as caught:
        get_environment(name, params)
    assert caught.value.param == param and caught.value.env == name
    assert says in str(caught.value) and f"'{param}'" in str(caught.value)


# --- entry-point discovery ------------------------------------------------------------


class EchoEnv(Environment[Task]):
    """A third-party environment, as a plugin package would ship it."""

    name = "echo"

    def make_rewards(self) -> list[Reward[Task]]:
        return [Reward("said_it", lambda task, completion: float(bool(completion)))]

    def sample_task(self, rng: random.Random) -> Task:
        return Task(question=f"Say {rng.randint(0, 9)}.")


def _fake_entry_points(monkeypatch: pytest.MonkeyPatch, **targets: str) -> None:
    points = [
        importlib.metadata.EntryPoint(name=name, value=value, group="marlaas.envs")
        for name, value in targets.items()
    ]

    def entry_points(*, group: str) -> list[importlib.metadata.EntryPoint]:
        return [point for point in points if point.group == group]

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)


def test_entry_point_environments_are_discovered(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_entry_points(monkeypatch, echo=f"{__name__}:EchoEnv")
    assert "echo" in available_environments()
    env = get_environment("echo")
    assert isinstance(env, EchoEnv)
    task = env.task_for(seed=0, index=0)
    assert answer(env, task, "hi").components == {"said_it": 1.0}
    with pytest.raises(
        UnknownEnvironmentError,
        match="arithmetic, calculator, code_tasks, countdown, dataset, echo",
    ):
        get_environment("nope")


def test_entry_points_cannot_shadow_builtins(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_entry_points(monkeypatch, arithmetic=f"{__name__}:EchoEnv")
    assert isinstance(get_environment("arithmetic"), ArithmeticEnv)


@pytest.mark.parametrize(
    ("target", "says"),
    [("no_such_module_xyz:Env", "failed to load"), (f"{__name__}:SEVEN_PLUS_FIVE", "not an")],
)
def test_broken_entry_points_fail_clearly(
    monkeypatch: pytest.MonkeyPatch, target: str, says: str
) -> None:
    _fake_entry_points(monkeypatch, broken=target)
    with pytest.raises(EnvironmentLoadError, match=says):
        get_environment("broken")


def test_an_environment_can_be_registered_by_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from env_svc.protocol import ENVIRONMENTS_VAR, EnvironmentLoadError, available_environments

    monkeypatch.setenv(ENVIRONMENTS_VAR, "chaos=tests.chaos_env:ChaosEnv")
    assert "chaos" in available_environments()
    assert get_environment("chaos", {"fail": "respond"}).name == "chaos"
    monkeypatch.setenv(ENVIRONMENTS_VAR, "chaos")
    with pytest.raises(EnvironmentLoadError, match="is not name=module:EnvironmentClass"):
        available_environments()
