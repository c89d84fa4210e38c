"""Judged rewards: a model grades the final answer against a rubric.

    Reward("helpful", Judge("Is the answer correct and polite?"), 1.0)

`Judge` is an `async def` reward function: it asks an OpenAI-compatible chat endpoint (by
default the stack's own rollout service, `MARLAAS_CHAT_URL`, with the base model, `base`, and
the bus's internal credential) to score the answer from 0 to `max_score`, and returns the
score over `max_score`. Greedy, so one (question, answer) always gets one score: scores are
cached per pair (an LRU of `cache_size`), and a group's identical answers cost one request. A
judge that cannot be reached, answers past `timeout_s` or with no score in range raises
`JudgeError`: the reward records it and the episode ends with that error, never env_svc.

Each request names the job whose episode it scores (`X-Marlaas-Job`): the stack's rollout
service admits it through the tenants' fair queue as that job's tenant's, beside its rollouts,
so a tenant's judging shares the engine as its sampling does (rollout_svc/chat_sampling.py).
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from common.wire.chat import CHAT, JOB_HEADER
from env_svc.protocol import EPISODE_JOB, ChatMessage, Task, last_assistant_text
from env_svc.tools.calls import strip_tool_calls

_SCORE = re.compile(r"-?\d+(?:\.\d+)?")


class JudgeError(RuntimeError):
    """No score: the endpoint failed, timed out, or answered without one."""


@dataclass
class Judge:
    rubric: str
    endpoint: str = ""
    """`http://host:port/v1`; "" takes the stack's (`MARLAAS_CHAT_URL`)."""
    model: str = "base"
    max_score: int = 10
    timeout_s: float = 30.0
    max_tokens: int = 8
    cache_size: int = 4096
    token: str | None = None
    """Bearer credential; None takes the bus's internal one for the chat endpoint."""
    requests: int = 0
    """Requests sent (cache misses), for metrics and tests."""
    _cache: OrderedDict[str, float] = field(default_factory=OrderedDict, repr=False)

    __name__ = "judge"

    async def __call__(self, task: Task, completion: Sequence[ChatMessage]) -> float:
        answer = strip_tool_calls(last_assistant_text(completion))
        key = hashlib.sha256(f"{task.question}\0{answer}".encode()).hexdigest()
        if (score := self._cache.get(key)) is not None:
            self._cache.move_to_end(key)
            return score
        score = self._score(await self._ask(task.question, answer))
        self._cache[key] = score
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return score

    def prompt(self, question: str, answer: str) -> list[dict[str, str]]:
        return [
            {
                "role": "system",
                "content": f"You grade answers. {self.rubric} Reply with only a whole "
                f"number from 0 (worst) to {self.max_score} (best).",
            },
            {"role": "user", "content": f"Question: {question}\nAnswer: {answer}\nScore:"},
        ]

    async def _ask(self, question: str, answer: str) -> str:
        endpoint, token = self._where()
        body = {
            "model": self.model,
            "messages": self.prompt(question, answer),
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
        }
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        if job := EPISODE_JOB.get():  # the stack's endpoint queues it as the job's tenant's
            headers[JOB_HEADER] = job
        self.requests += 1
        try:
            async with httpx.AsyncClient(timeout=self.timeout_s) as http:
                response = await http.post(
                    f"{endpoint.rstrip('/')}/chat/completions", json=body, headers=headers
                )
            response.raise_for_status()
            return str(response.json()["choices"][0]["message"]["content"])
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            raise JudgeError(f"judge at {endpoint}: {type(exc).__name__}: {exc}") from None

    def _score(self, reply: str) -> float:
        found = _SCORE.search(reply)
        if found is None or not 0 <= float(found.group()) <= self.max_score:
            raise JudgeError(f"judge gave no score from 0 to {self.max_score}: {reply[:80]!r}")
        return float(found.group()) / self.max_score

    def _where(self) -> tuple[str, str | None]:
        if self.endpoint:
            return self.endpoint, self.token
        chat_url, token = _stack_chat()
        if not chat_url:
            raise JudgeError("no judge endpoint: MARLAAS_CHAT_URL is not set for env_svc")
        return chat_url, self.token or token


@functools.cache
def _stack_chat() -> tuple[str, str | None]:
    """The stack's chat endpoint and its credential, read from env_svc's settings once."""
    from common.runtime.config import SharedSettings

    shared = SharedSettings()
    return shared.chat_url, shared.internal_token(CHAT)
