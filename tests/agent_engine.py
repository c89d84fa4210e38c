"""A deterministic stand-in for the rollout engine that plays a model which has learnt the
agentic example environments (`ROLLOUT_ENGINE=tests.agent_engine:AgentEngine`), for
tests/integration/test_agentic_jobs.py: the tiny random model never writes a well-formed
call, so the test could not tell a tool that works from one never called. Everything around it
(rollout_svc and its chat endpoint, the broker, Redis, env_svc with its MCP session and judge,
the trainer on the tiny model) is the real thing; the same job on vLLM's engine runs in the
pipeline test (tests/integration/test_pipeline.py).

It answers from the episode's context, as the model would read it:
- `unit_conversion`, turn 0: a `units.convert` call built from the question; later turns:
  the tool's result with the unit asked for.
- `verifiers` with tests/tasksets/mini_arith: the sum asked for.
- a judge's request on the chat endpoint (request ids `chat-*`): a score of 8.
"""

from __future__ import annotations

import re

from common.wire.messages import GenerationRequest
from env_svc.tools import format_call
from tests.chaos.scripted_engine import ScriptedEngine

CONVERSION = re.compile(r"How many (\w+) are (\d+) (\w+)\?")
SUM = re.compile(r"What is (\d+) \+ (\d+)\?")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")
JUDGE_SCORE = "8"


class AgentEngine(ScriptedEngine):
    def reply_to(self, request: GenerationRequest) -> list[int]:
        context = str(self.tokenizer.decode(request.context_token_ids))
        return [
            *self.tokenizer.encode(self.text_for(request, context), add_special_tokens=False),
            self.tokenizer.eos_token_id,
        ]

    @staticmethod
    def text_for(request: GenerationRequest, context: str) -> str:
        if request.request_id.startswith("chat-"):
            return JUDGE_SCORE
        if summed := SUM.findall(context):
            return str(sum(map(int, summed[-1])))
        asked = CONVERSION.findall(context)
        if not asked:
            return "I do not know."
        to_unit, value, from_unit = asked[-1]
        if request.turn == 0:
            arguments = {"value": int(value), "from_unit": from_unit, "to_unit": to_unit}
            return format_call("units.convert", arguments)
        result = NUMBER.findall(context.rsplit("</tool_call>", 1)[-1])
        return f"{result[0]} {to_unit}" if result else "I do not know."
