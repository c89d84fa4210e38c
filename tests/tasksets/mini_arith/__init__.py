"""A small taskset of the `verifiers` library (`verifiers.v1`), as a package a user installs:
sums of two digits, an async reward and a metric. tests/integration/test_agentic_jobs.py runs
it as a MARLaaS job (`env = {name = "verifiers", params = {taskset = "mini-arith"}}`)."""

from __future__ import annotations

from collections.abc import Iterator

import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: int


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        words = (trace.last_reply or "").replace(".", " ").split()
        return float(bool(words) and words[-1] == str(self.data.answer))

    @vf.metric
    async def reply_words(self, trace: vf.Trace) -> float:
        return float(len((trace.last_reply or "").split()))


class MiniArithTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self) -> Iterator[SumTask]:
        for a in range(1, 10):
            for b in range(1, 10):
                data = SumData(
                    id=f"{a}+{b}",
                    prompt=f"What is {a} + {b}?",
                    system_prompt="Answer with the number only.",
                    answer=a + b,
                )
                yield SumTask(data, self.config.task)


__all__ = ["MiniArithTaskset"]
