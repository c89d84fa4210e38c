"""Judged rewards (env_svc/judge.py) against an OpenAI-compatible endpoint on loopback: a
stand-in server here (its replies scripted); tests/integration/test_judge.py asks the stack's
own rollout service."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from common.wire.chat import JOB_HEADER
from env_svc.judge import Judge
from env_svc.protocol import EPISODE_JOB, ChatMessage, Reward, Task, ascore

REPLIES = {"good": "9", "bad": "2 out of 10", "rambling": "It depends.", "slow": "5"}
"""What the stand-in judge says for an answer (by its text)."""


class StandIn(BaseHTTPRequestHandler):
    asked: list[dict[str, object]] = []
    for_jobs: list[str | None] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        StandIn.asked.append(body)
        StandIn.for_jobs.append(self.headers.get(JOB_HEADER))
        answer = body["messages"][-1]["content"].split("Answer: ")[1].split("\n")[0]
        if answer == "slow":
            time.sleep(1.0)
        reply = {"choices": [{"message": {"content": REPLIES.get(answer, "0")}}]}
        data = json.dumps(reply).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the judge gave up waiting (its time limit)

    def log_message(self, *args: object) -> None:
        return None


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


def said(text: str) -> list[ChatMessage]:
    return [{"role": "assistant", "content": text}]


async def test_a_judge_scores_caches_and_fails_as_an_episode_error(endpoint: str) -> None:
    judge = Judge("Is it right?", endpoint=endpoint, timeout_s=0.5)
    task = Task(question="What is 2 + 2?")
    rewards = [Reward("judged", judge)]
    assert (await ascore(rewards, task, said("good"))).total == pytest.approx(0.9)
    assert (await ascore(rewards, task, said("bad"))).total == pytest.approx(0.2)
    assert (await ascore(rewards, task, said("good"))).total == pytest.approx(0.9)
    assert judge.requests == 2  # the repeated answer came from the cache
    rambling = await ascore(rewards, task, said("rambling"))
    assert rambling.error.startswith("reward 'judged' failed: JudgeError: judge gave no score")
    slow = await ascore(rewards, task, said("slow"))
    assert "JudgeError" in slow.error and "ReadTimeout" in slow.error
    body = StandIn.asked[0]
    assert body["model"] == "base" and body["temperature"] == 0.0


async def test_an_unreachable_judge_ends_the_episode_not_the_replica() -> None:
    judge = Judge("Is it right?", endpoint="http://127.0.0.1:9/v1", timeout_s=1.0)
    result = await ascore([Reward("judged", judge)], Task(question="q"), said("good"))
    assert result.error.startswith("reward 'judged' failed: JudgeError: judge at")


async def test_a_judge_names_the_job_whose_episode_it_scores(endpoint: str) -> None:
    """The stack's endpoint admits the request as that job's tenant's (rollout_svc); env_svc
    sets the job while it drives the episode (env_svc/episodes.py)."""
    judge = Judge("Is it right?", endpoint=endpoint)
    StandIn.for_jobs.clear()
    await ascore([Reward("judged", judge)], Task(question="q1"), said("good"))
    token = EPISODE_JOB.set("acme-job-1")
    try:
        await ascore([Reward("judged", judge)], Task(question="q2"), said("good"))
    finally:
        EPISODE_JOB.reset(token)
    assert StandIn.for_jobs == [None, "acme-job-1"]
