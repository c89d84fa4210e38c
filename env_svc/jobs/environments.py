"""Each job's environment, built once per job and replica: an environment is stateless after
construction, so one serves every episode of its job."""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import Any

from common.wire.messages import JobSpec
from env_svc.calls import EnvCalls
from env_svc.chat_template import ChatTokenizer
from env_svc.protocol import Environment, environment_for


class JobEnvironments:
    """A cache of environments by job id; what is dropped is built again should a late
    record of its job need it."""

    def __init__(self, calls: EnvCalls, tokenizer: ChatTokenizer) -> None:
        self.calls = calls
        self.tokenizer = tokenizer
        self.by_job: dict[str, Environment[Any]] = {}

    async def build(self, spec: JobSpec) -> Environment[Any]:
        """A fresh environment for `spec`, built in a worker: its params are the tenant's,
        its code may read files or hang."""
        return await self.calls.run(
            f"job {spec.job_id}: environment", partial(environment_for, spec)
        )

    async def get(self, spec: JobSpec) -> Environment[Any]:
        """The job's environment, built on first use."""
        if (env := self.by_job.get(spec.job_id)) is None:
            env = await self.build(spec)
            env.template_takes_tools = self.tokenizer.takes_tools
            self.by_job[spec.job_id] = env
        return env

    def keep(self, job_id: str, env: Environment[Any]) -> None:
        self.by_job[job_id] = env

    def forget(self, job_id: str) -> None:
        self.by_job.pop(job_id, None)

    def keep_only(self, job_ids: Iterable[str]) -> None:
        """Forget every job not in `job_ids` (retired, maybe by another replica)."""
        for job_id in set(self.by_job) - set(job_ids):
            del self.by_job[job_id]
