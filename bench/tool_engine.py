"""A deterministic stand-in for the rollout engine, for bench/async_tools.py only
(`ROLLOUT_ENGINE=tool_engine:ToolCallingEngine`, bench/ and the repository on the Python path):
the chaos run's scripted engine (tests/chaos/scripted_engine.py), answering an episode's first
turn with a `lookup` tool call and every later turn with a short answer, at once. The bench
measures env_svc, so the engine must not be the bottleneck; everything else (rollout_svc, the
broker, Redis, env_svc, the trainer on the tiny model) is the real thing.
"""

from __future__ import annotations

from common.wire.messages import GenerationRequest
from tests.chaos.scripted_engine import ScriptedEngine


class ToolCallingEngine(ScriptedEngine):
    replies = ('<tool_call>{"name": "lookup", "arguments": {"key": "k1"}}</tool_call>', "v-1")

    def reply_to(self, request: GenerationRequest) -> list[int]:
        call, answer = self._replies
        return call if request.turn == 0 else answer
