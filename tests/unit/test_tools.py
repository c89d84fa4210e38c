"""The tool layer (env_svc/tools/): schemas from signatures, calls parsed, checked and run at
once, every bad call answered in words, and the calculator on it with its prompt unchanged."""

from __future__ import annotations

import asyncio
import json
import random
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import pytest
from msgspec import Meta

from env_svc.envs.calculator import CalculatorEnv
from env_svc.protocol import ChatMessage, Reward, Task, last_assistant_text
from env_svc.tools import (
    Tool,
    ToolBox,
    ToolDefinitionError,
    ToolEnvironment,
    format_call,
    parse_tool_calls,
    tool_metrics,
)


def lookup(
    word: Annotated[str, Meta(description="the word to look up", max_length=40)],
    language: Literal["en", "fr"] = "en",
) -> str:
    """Look a word up in the dictionary.

    Longer text that is not the description."""
    return f"{word} ({language})"


async def slow_lookup(word: str, wait_s: float = 0.3) -> str:
    """Look a word up far away."""
    await asyncio.sleep(wait_s)
    return word.upper()


def crashes(word: str) -> str:
    """Always fails."""
    raise ConnectionError("the dictionary's API is down")


def call(name: str, **arguments: object) -> str:
    return format_call(name, arguments)


def test_a_tool_schema_comes_from_the_signature_and_the_docstring() -> None:
    schema = Tool.of(lookup).schema()
    assert schema == {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a word up in the dictionary.",
            "parameters": {
                "type": "object",
                "properties": {
                    "word": {
                        "description": "the word to look up",
                        "type": "string",
                        "maxLength": 40,
                    },
                    "language": {"enum": ["en", "fr"], "default": "en"},
                },
                "required": ["word"],
                "additionalProperties": False,
            },
        },
    }


@pytest.mark.parametrize(
    ("fn", "says"),
    [
        (lambda x: x, "not a tool name"),
        (lambda *args: 1, "not a tool name"),
    ],
)
def test_what_cannot_be_a_tool_is_refused_when_declared(fn: object, says: str) -> None:
    with pytest.raises(ToolDefinitionError, match=says):
        Tool.of(fn)  # type: ignore[arg-type]


def test_untyped_and_variadic_parameters_are_refused() -> None:
    def untyped(word):  # type: ignore[no-untyped-def]
        return word

    def variadic(*words: str) -> str:
        return ""

    with pytest.raises(ToolDefinitionError, match="has no type"):
        Tool.of(untyped)
    with pytest.raises(ToolDefinitionError, match=r"\*args"):
        Tool.of(variadic)


async def test_every_bad_call_is_answered_in_words_and_counted_by_kind() -> None:
    box = ToolBox([lookup, crashes, Tool.of(slow_lookup, timeout_s=0.1)], max_calls_per_turn=9)
    turn = "".join(
        [
            "<tool_call>{not json</tool_call>",
            "<tool_call>[1, 2]</tool_call>",
            call("search", query="x"),
            call("lookup", word=7),
            call("lookup", word="cat", colour="red"),
            call("lookup", word="cat", language="de"),
            call("lookup", word="x" * 41),
            call("crashes", word="cat"),
            call("slow_lookup", word="cat", wait_s=5),
        ]
    )
    replies = await box.replies(turn)
    assert replies is not None
    said = [m["content"] for m in replies]
    assert all(m["role"] == "tool" for m in replies) and len(said) == 9
    assert said[0].startswith("error: malformed tool call: tool call is not JSON")
    assert said[1] == "error: malformed tool call: tool call must be a JSON object"
    assert said[2] == "error: unknown tool 'search'; the tools are: crashes, lookup, slow_lookup"
    assert said[3] == "error: bad arguments: Expected `str`, got `int` - at `$.word`"
    assert said[4] == "error: bad arguments: Object contains unknown field `colour`"
    assert said[5] == "error: bad arguments: Invalid enum value 'de' - at `$.language`"
    assert said[6].startswith("error: bad arguments: Expected `str` of length <= 40")
    assert said[7] == "error: ConnectionError: the dictionary's API is down"
    assert said[8] == "error: no answer after 0.1s"  # cancelled at its own limit
    metrics = tool_metrics(replies)
    assert metrics == {
        "calls": 9.0,
        "errors": 9.0,
        "malformed": 2.0,
        "unknown_tool": 1.0,
        "bad_arguments": 4.0,
        "timeout": 1.0,
        "over_limit": 0.0,
        "tool_error": 1.0,
    }


async def test_a_hundred_calls_in_one_turn_run_only_up_to_the_cap() -> None:
    ran: list[str] = []

    def record(word: str) -> str:
        """Remember a word."""
        ran.append(word)
        return word

    box = ToolBox([record], max_calls_per_turn=4)
    replies = await box.replies("".join(call("record", word=str(n)) for n in range(100)))
    assert replies is not None and len(replies) == 100
    assert sorted(ran) == ["0", "1", "2", "3"]
    assert [m["content"] for m in replies[:4]] == ["0", "1", "2", "3"]
    assert {m["content"] for m in replies[4:]} == {"error: at most 4 calls per turn"}
    assert tool_metrics(replies)["over_limit"] == 96


async def test_a_turn_s_calls_run_at_once_plain_ones_in_threads() -> None:
    threads: set[str] = set()
    release = threading.Barrier(3, timeout=5)

    def meet(word: str) -> str:
        """Wait for the other two calls: only possible if all three run at once."""
        threads.add(threading.current_thread().name)
        release.wait()
        return word

    box = ToolBox([meet, slow_lookup], max_calls_per_turn=8)
    turn = "".join(call("meet", word=w) for w in "abc") + call("slow_lookup", word="d")
    replies = await box.replies(turn)
    assert replies is not None
    assert [m["content"] for m in replies] == ["a", "b", "c", "D"]
    assert len(threads) == 3 and threading.current_thread().name not in threads


async def test_a_turn_without_a_call_is_the_final_answer() -> None:
    assert await ToolBox([lookup], max_calls_per_turn=4).replies("The answer is 12.") is None


def test_call_blocks_may_be_unclosed_and_arguments_a_json_string() -> None:
    text = '<tool_call>{"name": "lookup", "arguments": "{\\"word\\": \\"cat\\"}"}'
    (parsed,) = parse_tool_calls(text)
    assert parsed.name == "lookup" and parsed.arguments == {"word": "cat"}
    (deep,) = parse_tool_calls("<tool_call>" + "[" * 100_000 + "</tool_call>")
    assert deep.malformed  # not a RecursionError in env_svc


class WordTask(Task, frozen=True):
    word: str


class Dictionary(ToolEnvironment[WordTask]):
    """The guide's example: a tool environment in a few lines."""

    name = "dictionary"
    task_type = WordTask
    tools = (lookup,)

    @property
    def max_turns(self) -> int:
        return 3

    def sample_task(self, rng: random.Random) -> WordTask:
        word = rng.choice(["cat", "dog"])
        return WordTask(question=f"Look up {word} and say what the tool said.", word=word)

    def make_rewards(self) -> list[Reward[WordTask]]:
        return [Reward("correct", said_it)]


def said_it(task: WordTask, completion: Sequence[ChatMessage]) -> float:
    return float(last_assistant_text(completion) == f"{task.word} (en)")


def test_a_tool_environment_renders_its_tools_and_plays_an_episode() -> None:
    env = Dictionary()
    assert env.awaits  # the layer awaits the calls: env_svc runs it on its loop
    state, messages = env.reset(env.task_for(0, 0))
    system = messages[0]["content"]
    assert messages[0]["role"] == "system" and json.dumps(Tool.of(lookup).schema()) in system
    assert "To use it, reply with only:\n<tool_call>" in system
    word = state.task.word
    looked = env.step(state, call("lookup", word=word))
    assert looked.messages == [{"role": "tool", "content": f"{word} (en)"}]
    ended = env.step(looked.state, f"{word} (en)")
    assert ended.done and ended.reward is not None
    assert ended.reward.total == 1.0 and ended.reward.components["tools.calls"] == 1.0
    assert env.solved(ended.reward)


def test_the_calculator_on_the_tool_layer_shows_the_prompt_it_always_had() -> None:
    """Byte for byte the system prompt of the calculator before the tool layer (so its
    learning, measured on the demo, is the same)."""
    schema = {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression: numbers, + - * / // % ** and ( ).",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. 47 * 86"}},
                "required": ["expression"],
            },
        },
    }
    before = (
        "You are a helpful assistant with a calculator tool.\n"
        f"<tools>\n{json.dumps(schema)}\n</tools>\n"
        "To use it, reply with only:\n"
        '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34"}}</tool_call>\n'
        "The result comes back in a tool message. When you know the answer, reply with just "
        "the number."
    )
    env = CalculatorEnv()
    assert env.reset(env.task_for(0, 0))[1][0]["content"] == before


def test_the_guide_s_tool_environment_is_short_and_plays() -> None:
    """docs/environments.md's example, as printed: under 40 lines, and it works."""
    guide = (Path(__file__).parents[2] / "docs" / "environments.md").read_text()
    code = guide.split("```python\n", 1)[1].split("```", 1)[0]
    assert len(code.strip().splitlines()) < 40
    namespace: dict[str, Any] = {}
    exec(compile(code, "environments.md", "exec"), namespace)
    env = namespace["Dictionary"]()
    state, _ = env.reset(env.task_for(0, 0))
    looked = env.step(state, call("define", word=state.task.word))
    definition = looked.messages[0]["content"]
    ended = env.step(looked.state, f'It means "{definition}".')
    assert ended.done and ended.reward.components["correct"] == 1.0
    assert ended.reward.total == pytest.approx(1.1)
