"""Held-out evaluation of a job's adapter versions, in one place: which versions are
evaluated, how evaluation episodes are named, and how their results are tallied in Redis.

Training reward at temperature 1 on a few samples per step is too noisy to say whether a job
learned. So env_svc evaluates the base model (version 0), every `eval.every_steps` versions
and the final one: one greedy episode (temperature 0) per task of the environment's
evaluation stream (`Environment.eval_task_for`, never a training task stream), sampled with
exactly that adapter version (`GenerationRequest.pinned_adapter_version`). Evaluation
episodes never reach the trainer: env_svc tallies each finished one here and, when the last
one is in, sends an `eval` event with the mean reward, the accuracy (share of episodes the
environment counts as solved, `Environment.solved`) and its standard error.

A job has one evaluation in flight at a time: a version reached while another is evaluated
waits its turn, so a job's evaluation episodes in flight never pass `eval.tasks`, the share
of its tenant's quota they are counted at (`common.state.tenants.samples_in_flight`), however often
it evaluates. They go through the rollout replicas' fair queue as the job's other requests
do, in its tenant's turns.

State: `evals:{job}` maps each evaluated version to when its requests were last sent (in
flight: a claim, re-sent by the sweeper when old), `waiting` (behind the one in flight) or
`done`; `evalresends:{job}` counts the re-sends per version; `evalseen:{job}:{v}` holds the
episodes counted, so a redelivered result is counted once (and a re-send skips them);
`eval:{job}:{v}` holds the tally.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from common.state.keyspace import eval_resends_key, eval_seen_key, eval_tally_key, evals_key
from common.state.redis_part import Lua, RedisPart, text, texts
from common.wire.messages import JobSpec

DONE = "done"
WAITING = "waiting"
MAX_RESENDS = 2
"""An evaluation still short of episodes after its requests were sent again this often ends
with the episodes it has (a result lost mid-episode never comes): `eval_episodes` says how
many."""
_COMPONENT = "component:"


def eval_group_id(job_id: str, version: int) -> str:
    return f"{job_id}/eval{version}"


def eval_version_of(job_id: str, group_id: str) -> int | None:
    """The version an evaluation group evaluates, or None for a training group."""
    prefix = f"{job_id}/eval"
    suffix = group_id[len(prefix) :] if group_id.startswith(prefix) else ""
    return int(suffix) if suffix.isdigit() else None


def evaluated(spec: JobSpec, version: int) -> bool:
    """Whether `version` of the job is evaluated: the base model, every `every_steps`-th
    version and the final one, when the job evaluates at all."""
    settings = spec.eval
    if settings.tasks <= 0 or not 0 <= version <= spec.rl.max_steps:
        return False
    every = settings.every_steps
    return version in (0, spec.rl.max_steps) or (every > 0 and version % every == 0)


@dataclass(frozen=True)
class EvalTally:
    """One version's evaluation so far."""

    version: int
    episodes: int
    reward_sum: float
    solved: int
    component_sums: dict[str, float]

    @classmethod
    def from_hash(cls, version: int, fields: Mapping[Any, Any]) -> EvalTally:
        values = {k: float(v) for k, v in texts(fields).items()}
        return cls(
            version=version,
            episodes=int(values.get("episodes", 0)),
            reward_sum=values.get("reward", 0.0),
            solved=int(values.get("solved", 0)),
            component_sums={
                k[len(_COMPONENT) :]: v for k, v in values.items() if k.startswith(_COMPONENT)
            },
        )

    @property
    def accuracy(self) -> float:
        return self.solved / self.episodes if self.episodes else 0.0

    @property
    def accuracy_stderr(self) -> float:
        """Binomial standard error of the accuracy, sqrt(p (1 - p) / n)."""
        p, n = self.accuracy, self.episodes
        return math.sqrt(p * (1 - p) / n) if n else 0.0

    def metrics(self) -> dict[str, float]:
        """The `eval` event's metrics; reward components as `eval_reward/<name>` means."""
        n = max(self.episodes, 1)
        return {
            "eval_reward": self.reward_sum / n,
            "eval_accuracy": self.accuracy,
            "eval_accuracy_stderr": self.accuracy_stderr,
            "eval_episodes": float(self.episodes),
            **{f"eval_reward/{name}": total / n for name, total in self.component_sums.items()},
        }


def below_base(tally: EvalTally, base: EvalTally) -> str:
    """Why `tally` is worse than the base model's evaluation (version 0): its accuracy lower
    by more than the standard error of the difference, sqrt(se^2 + se_base^2); "" when not
    (or when either has no episodes)."""
    if not tally.episodes or not base.episodes or tally.version == base.version:
        return ""
    stderr = math.hypot(tally.accuracy_stderr, base.accuracy_stderr)
    if base.accuracy - tally.accuracy <= stderr:
        return ""
    return (
        f"held-out accuracy {tally.accuracy:.3f} of v{tally.version} is below the base "
        f"model's {base.accuracy:.3f} by more than the standard error of the difference "
        f"({stderr:.3f}): its training reward may have risen on what does not generalise"
    )


def _record_args(
    episode_id: str, reward: float, solved: bool, components: dict[str, float]
) -> list[Any]:
    flat: list[Any] = [episode_id, reward, int(solved)]
    for name, value in sorted(components.items()):
        flat += [f"{_COMPONENT}{name}", value]
    return flat


_CLAIM_EVAL = """
-- KEYS[1] evals:{job}; ARGV version, now -> 1 when this caller starts the version's
-- evaluation (and sends its requests); 0 when it was claimed before, or waits behind the
-- job's evaluation in flight (a state that is a time)
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 0 end
for _, state in ipairs(redis.call('HVALS', KEYS[1])) do
  if tonumber(state) ~= nil then
    redis.call('HSET', KEYS[1], ARGV[1], 'waiting')
    return 0
  end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""

_NEXT_EVAL = """
-- KEYS[1] evals:{job}; ARGV version done ('' for none), now -> the waiting version whose
-- evaluation this caller starts (and sends), the lowest; -1 when none waits or one is in flight
if ARGV[1] ~= '' then redis.call('HSET', KEYS[1], ARGV[1], 'done') end
local states = redis.call('HGETALL', KEYS[1])
local next = nil
for i = 1, #states, 2 do
  if tonumber(states[i + 1]) ~= nil then return -1 end
  if states[i + 1] == 'waiting' then
    local version = tonumber(states[i])
    if next == nil or version < next then next = version end
  end
end
if next == nil then return -1 end
redis.call('HSET', KEYS[1], next, ARGV[2])
return next
"""

_TAKE_STALE_EVALS = """
-- KEYS[1] evals:{job}; ARGV cutoff, now -> versions whose requests were sent before cutoff
-- and whose evaluation is not done, each re-armed to now so that one sweeper takes it
local taken = {}
local claims = redis.call('HGETALL', KEYS[1])
for i = 1, #claims, 2 do
  local at = tonumber(claims[i + 1])
  if at ~= nil and at < tonumber(ARGV[1]) then
    redis.call('HSET', KEYS[1], claims[i], ARGV[2])
    table.insert(taken, tonumber(claims[i]))
  end
end
return taken
"""

_RECORD_EVAL = """
-- KEYS[1] evalseen:{job}:{v}, KEYS[2] eval:{job}:{v}; ARGV episode id, reward, solved 0/1,
-- then component name/value pairs -> episodes counted so far, or -1 for an episode counted
-- before (a redelivered result)
if redis.call('SADD', KEYS[1], ARGV[1]) == 0 then return -1 end
redis.call('HINCRBYFLOAT', KEYS[2], 'reward', ARGV[2])
redis.call('HINCRBY', KEYS[2], 'solved', ARGV[3])
for i = 4, #ARGV, 2 do
  redis.call('HINCRBYFLOAT', KEYS[2], ARGV[i], ARGV[i + 1])
end
return redis.call('HINCRBY', KEYS[2], 'episodes', 1)
"""


class EvalTallies(RedisPart):
    """Claims, re-sends and tallies of each job's evaluations."""

    _claim_eval = Lua(_CLAIM_EVAL)
    _next_eval = Lua(_NEXT_EVAL)
    _take_stale_evals = Lua(_TAKE_STALE_EVALS)
    _record_eval = Lua(_RECORD_EVAL)

    async def claim(self, job_id: str, version: int) -> bool:
        """True for the one caller that sends the evaluation of `version` now; False when it
        was claimed before, or waits behind the job's evaluation in flight (`finish`
        starts it)."""
        return bool(await self._claim_eval(keys=[evals_key(job_id)], args=[version, time.time()]))

    async def take_stale(self, job_id: str, older_than_s: float) -> list[int]:
        """Evaluations sent more than `older_than_s` ago and not done, each handed to one
        caller per `older_than_s`: the caller finishes it or sends its requests again."""
        now = time.time()
        taken = await self._take_stale_evals(
            keys=[evals_key(job_id)], args=[now - older_than_s, now]
        )
        return [int(version) for version in taken]

    async def record(
        self,
        job_id: str,
        version: int,
        episode_id: str,
        *,
        reward: float,
        solved: bool,
        components: Mapping[str, float],
    ) -> int:
        """Count one finished evaluation episode; returns the episodes counted so far, or -1
        when this one was counted before."""
        return int(
            await self._record_eval(
                keys=[eval_seen_key(job_id, version), eval_tally_key(job_id, version)],
                args=_record_args(episode_id, reward, solved, dict(components)),
            )
        )

    async def tally(self, job_id: str, version: int) -> EvalTally:
        return EvalTally.from_hash(
            version, await self._redis.hgetall(eval_tally_key(job_id, version))
        )

    async def count_resend(self, job_id: str, version: int) -> int:
        """One more re-send of the evaluation of `version`; returns how many so far."""
        return int(await self._redis.hincrby(eval_resends_key(job_id), str(version), 1))

    async def finish(self, job_id: str, version: int) -> int | None:
        """Its `eval` event is out: the sweeper leaves it alone. Returns the waiting version
        whose evaluation the caller now starts (and sends), if any."""
        return await self.start_waiting(job_id, done=version)

    async def start_waiting(self, job_id: str, *, done: int | None = None) -> int | None:
        """The lowest waiting version, claimed for the caller to send when none is in
        flight (after marking `done` done); None otherwise."""
        started = int(
            await self._next_eval(
                keys=[evals_key(job_id)], args=["" if done is None else done, time.time()]
            )
        )
        return None if started < 0 else started

    async def abandon(self, job_id: str) -> None:
        """A job whose evaluations stop (cancelled, failed): every one not done is."""
        key = evals_key(job_id)
        left = [k for k, v in (await self._redis.hgetall(key)).items() if text(v) != DONE]
        if left:
            await self._redis.hset(key, mapping=dict.fromkeys(left, DONE))

    async def seen(self, job_id: str, version: int) -> set[str]:
        """The episodes of `version`'s evaluation counted so far."""
        return {text(m) for m in await self._redis.smembers(eval_seen_key(job_id, version))}

    async def state(self, job_id: str, version: int) -> str | None:
        """When `version`'s evaluation requests were last sent, `waiting`, `done`, or None
        (never claimed, or expired with the job's state)."""
        state = await self._redis.hget(evals_key(job_id), str(version))
        return None if state is None else text(state)

    async def versions(self, job_id: str) -> dict[int, str]:
        """Evaluated versions: when their requests were last sent, or `done`."""
        raw = await self._redis.hgetall(evals_key(job_id))
        return {int(text(k)): text(v) for k, v in raw.items()}
