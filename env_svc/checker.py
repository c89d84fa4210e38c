"""`marlaas envs check NAME`: try an environment the way env_svc will use it, before a job
does (in the spirit of gymnasium's `check_env`).

env_svc runs an environment's code on every episode of every replica, with whatever text the
model writes, and keeps no state but the bytes of `EpisodeState`. So the checker builds the
environment from its params, draws training and evaluation tasks (reproducible, encodable),
and plays episodes to the end with text a model might write (a plausible answer, nothing,
noise, a very long reply, markup), checking at every step that the state survives a round
trip through bytes, that a finished episode has a finite reward or an error (never a raised
exception) and how long each call takes. It reports every finding; it raises nothing.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from env_svc.protocol import Environment, RewardResult, encode_state, environment_class
from env_svc.tools import Tool, ToolCall, ToolEnvironment
from env_svc.tools.toolbox import ERROR_KINDS

ACTIONS: tuple[str, ...] = (
    "42",
    "",
    "The answer is 7.",
    "<tool>add(1, 2)</tool>",
    '{"name": "add", "arguments": {"a": 1, "b": 2}}',
    '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>',
    "<tool_call>{not json" + "<tool_call>{}</tool_call>" * 20,
    "ünïcödé ✓ \x00 \u202e",
    "9" * 5_000,
    "To compute this, let me think step by step. " * 40,
)
"""What a model may write: plausible answers, tool calls, nothing, noise, far too much."""

SLOW_STEP_S = 0.5
"""A call slower than this holds one of env_svc's worker threads long enough to matter."""


@dataclass(frozen=True)
class Finding:
    check: str
    ok: bool
    detail: str


@dataclass
class CheckReport:
    env: str
    findings: list[Finding] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(f.ok for f in self.findings)

    def add(self, check: str, ok: bool, detail: str) -> None:
        self.findings.append(Finding(check, ok, detail))


def describe(env_class: type[Environment[Any]]) -> dict[str, Any]:
    """What `marlaas envs` shows of an environment: params with their defaults."""
    params = {
        name: _default(env_class.params_type, name)
        for name in env_class.params_type.__struct_fields__
    }
    doc = (env_class.__doc__ or "").strip().splitlines()
    return {
        "class": f"{env_class.__module__}:{env_class.__qualname__}",
        "params": params,
        "about": doc[0] if doc else "",
    }


def check_environment(
    name: str, params: Mapping[str, Any] | None = None, *, tasks: int = 8, seed: int = 0
) -> CheckReport:
    report = CheckReport(name)
    try:
        env = environment_class(name)(params)
    except Exception as exc:
        report.add("construct", False, f"{type(exc).__name__}: {exc}")
        return report
    report.add("construct", True, f"params {msgspec.to_builtins(env.params)}")
    _check_tasks(report, env, tasks, seed)
    if isinstance(env, ToolEnvironment):
        _attempt(report, "tools", lambda: _check_tools(report, env))
    rng = random.Random(seed)
    for index in range(tasks):
        # The environment's own code raising is a FAIL row, never the checker's traceback.
        task = _attempt(report, "training tasks", lambda i=index: env.task_for(seed, i))  # type: ignore[misc]
        if task is None:
            break
        _play(report, env, task, rng)
    if report.step_s:
        slowest = max(report.step_s)
        report.add(
            "time per step",
            slowest <= SLOW_STEP_S,
            f"mean {1000 * sum(report.step_s) / len(report.step_s):.2f} ms, "
            f"max {1000 * slowest:.2f} ms over {len(report.step_s)} steps "
            f"(more than {SLOW_STEP_S:.1f} s ties up an env_svc worker)",
        )
    return report


def _check_tasks(report: CheckReport, env: Environment[Any], tasks: int, seed: int) -> None:
    for stream, draw in (("training", env.task_for), ("evaluation", env.eval_task_for)):

        def stream_of(draw: Callable[[int, int], Any] = draw) -> list[Any]:
            return [draw(seed, i) for i in range(tasks)]

        drawn = _attempt(report, f"{stream} tasks", stream_of)
        if drawn is None:
            continue
        again = _attempt(report, f"{stream} tasks", stream_of)
        if again is None:
            continue
        distinct = len({msgspec.msgpack.encode(t) for t in drawn})
        report.add(
            f"{stream} tasks",
            drawn == again,
            f"{tasks} drawn, {distinct} distinct; "
            + ("the same again from the same seed" if drawn == again else "NOT reproducible"),
        )
        if isinstance(drawn[0], env.task_type):
            continue
        report.add(
            f"{stream} tasks",
            False,
            f"a task is {type(drawn[0]).__name__}, "
            f"not the environment's task_type {env.task_type.__name__}",
        )


def _play(report: CheckReport, env: Environment[Any], task: Any, rng: random.Random) -> None:
    """One episode to its end with random actions, checking every step."""
    started = _attempt(report, "reset", lambda: env.reset(task))
    if started is None:
        return
    state, messages = started
    # Worked examples (assistant and tool turns) may precede the task; the model answers a
    # user turn.
    roles = [m.get("role") for m in messages] if messages else []
    if (
        not roles
        or roles[-1] != "user"
        or not set(roles) <= {"system", "user", "assistant", "tool"}
    ):
        report.add("reset", False, f"initial messages must end with a user turn: {messages!r}")
        return
    for turn in range(env.max_turns + 1):
        action = rng.choice(ACTIONS)
        began = time.perf_counter()
        step = _attempt(report, "step", lambda s=state, a=action: env.step(s, a))  # type: ignore[misc]
        report.step_s.append(time.perf_counter() - began)
        if step is None:
            return
        if step.done:
            _check_reward(report, step.reward, action)
        if not _round_trips(report, env, step.state) or step.done:
            return
        if turn >= env.max_turns:
            report.add("max_turns", False, f"not done after max_turns={env.max_turns} steps")
            return
        state = step.state


def _check_tools(report: CheckReport, env: ToolEnvironment[Any]) -> None:
    """Each tool: its schema shown in the prompt, one call with plausible arguments (the
    environment's example for its tool, else the simplest value of each required
    parameter's type), answered within its time limit and not refused as bad arguments."""
    prompt = env.system_prompt()
    for tool in env.toolbox.tools.values():
        schema = json.dumps(tool.schema())
        report.add(
            f"tool {tool.name}: schema",
            schema in prompt or "tools=" in prompt,
            f"{len(schema)} characters, in the system prompt"
            if schema in prompt
            else "not in the system prompt: the model cannot know it",
        )
        example = env.tools_example
        arguments = example[1] if example and example[0] == tool.name else _plausible(tool)
        began = time.perf_counter()
        reply = asyncio.run(env.toolbox.call(ToolCall(tool.name, dict(arguments))))
        took = time.perf_counter() - began
        refused = reply.startswith((ERROR_KINDS["bad_arguments"], ERROR_KINDS["timeout"]))
        report.add(
            f"tool {tool.name}: a call",
            not refused,
            f"{json.dumps(arguments)[:80]} -> {reply[:80]!r} in {1000 * took:.1f} ms "
            f"(limit {tool.timeout_s:g} s)",
        )


def _plausible(tool: Tool) -> dict[str, Any]:
    simplest = {"string": "1", "integer": 1, "number": 1.0, "boolean": True, "array": []}
    properties = tool.parameters.get("properties", {})
    return {
        name: simplest.get(properties.get(name, {}).get("type", "string"), "1")
        for name in tool.parameters.get("required", [])
    }


def _check_reward(report: CheckReport, reward: RewardResult | None, action: str) -> None:
    if reward is None or not (math.isfinite(reward.total) or reward.error):
        report.add("reward", False, f"finished with reward {reward!r}: neither finite nor an error")
    elif reward.error:  # recorded, not raised; yet the episode is lost to training
        report.add("reward", False, f"failed on the reply {action[:40]!r}: {reward.error[:200]}")
    elif not any(f.check == "reward" for f in report.findings):
        report.add("reward", True, f"finite for every reply tried (e.g. {reward.total})")


def _round_trips(report: CheckReport, env: Environment[Any], state: Any) -> bool:
    try:
        back = env.decode_state(encode_state(state))
    except Exception as exc:
        report.add("state bytes", False, f"{type(exc).__name__}: {exc}")
        return False
    if back != state:
        report.add("state bytes", False, f"decoded state differs: {back!r} != {state!r}")
        return False
    if not any(f.check == "state bytes" for f in report.findings):
        report.add("state bytes", True, "every state survives encode_state / decode_state")
    return True


def _attempt(report: CheckReport, check: str, call: Callable[[], Any]) -> Any:
    try:
        return call()
    except Exception as exc:  # what env_svc would turn into a failed episode
        report.add(check, False, f"raised {type(exc).__name__}: {exc}")
        return None


def _default(kind: type[msgspec.Struct], name: str) -> Any:
    info = {f.name: f for f in msgspec.structs.fields(kind)}[name]
    if info.default is not msgspec.NODEFAULT:
        return info.default
    if info.default_factory is not msgspec.NODEFAULT:
        return info.default_factory()
    return "(required)"
