"""The token-level episode driver: chat messages in, token ids out, and back (pure logic).

Token-in/token-out (docs/architecture.md, "Token-in/token-out"): an episode's context is
tokenized once and only ever extended. The prompt comes from the chat template; each sampled
completion is appended as the sampler's own token ids; the environment's replies (tool
results) and the next generation prompt are appended as the template's *text delta*,
tokenized on its own. So the trainer scores exactly the sampled tokens, and the text of the
context always equals what the chat template renders for the message list. The token ids
equal `apply_chat_template(..., tokenize=True)` whenever the sampler chose the canonical
tokenization of its text; when it did not (BPE allows several spellings of one string), only
the ids of sampled spans differ, the decoded text does not.

env_svc replicas keep no state: everything an episode needs between turns (`EpisodeCarry`)
rides in `GenerationRequest.env_state`, which rollout_svc echoes back in the result, while the
context itself travels as `context_token_ids`.

The chat template and tokenizer that render and extend contexts: env_svc/chat_template.py.
"""

from __future__ import annotations

import math
import time
from typing import Any

import msgspec

from common.state.evals import eval_group_id
from common.wire.messages import (
    ContextTooLongError,
    GenerationRequest,
    GenerationResult,
    JobSpec,
    SamplingSettings,
    Trajectory,
)
from env_svc.chat_template import ChatTokenizer
from env_svc.protocol import (
    EPISODE_JOB,
    Environment,
    RewardResult,
    encode_state,
    unanswered,
)


class EpisodeError(ValueError):
    """A generation result that cannot continue its episode (env_svc dead-letters it)."""


class EpisodeCarryError(EpisodeError):
    """`env_state` bytes that are not a valid, consistent episode carry."""


# --- carry ----------------------------------------------------------------------------


class EpisodeCarry(msgspec.Struct, array_like=True, kw_only=True, tag="episode_carry"):
    """env_svc -> rollout_svc -> env_svc: an episode's bookkeeping, echoed back unread."""

    env_state: bytes
    """The environment's `EpisodeState`, from `encode_state`."""
    group_index: int
    """Index of the group's task in the job's task stream (`Environment.task_for`)."""
    prompt_len: int
    context_len: int
    """Length of the context sent with the pending request; checks the echo."""
    sampled_spans: list[tuple[int, int]] = []
    """[start, end) of each sampled completion in the context, in turn order."""
    logprobs: list[float] = []
    """Behaviour logprobs of all sampled tokens, spans concatenated."""
    adapter_versions: list[int] = []
    """Adapter version of each sampled turn."""
    turn: int = 0
    """Model turns completed; also the `turn` of the pending request."""
    eval_version: int = -1
    """The adapter version an evaluation episode evaluates (greedy, pinned to it); -1 for
    training episodes."""


_carry_decoder = msgspec.msgpack.Decoder(EpisodeCarry)


def encode_carry(carry: EpisodeCarry) -> bytes:
    return msgspec.msgpack.encode(carry)


def decode_carry(raw: bytes) -> EpisodeCarry:
    try:
        carry = _carry_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise EpisodeCarryError(f"env_state is not an episode carry: {exc}") from None
    sampled_n = sum(end - start for start, end in carry.sampled_spans)
    ends = [carry.prompt_len] + [edge for span in carry.sampled_spans for edge in span]
    if (
        ends != sorted(ends)
        or carry.context_len < ends[-1]
        or sampled_n != len(carry.logprobs)
        or len(carry.adapter_versions) != len(carry.sampled_spans)
        or carry.turn != len(carry.sampled_spans)
    ):
        raise EpisodeCarryError(f"inconsistent episode carry: {carry!r}")
    return carry


# --- episodes -------------------------------------------------------------------------


def episode_id_for(job_id: str, group_index: int, sample_index: int) -> str:
    """Deterministic, so a group issued twice (after a crash) de-duplicates downstream."""
    return f"{job_id}/{group_index}/{sample_index}"


def turn_limit(env: Environment[Any], job: JobSpec) -> int:
    """The environment's own `max_turns`, capped by the job's `rl.max_turns` when set."""
    if job.rl.max_turns is None:
        return env.max_turns
    return min(env.max_turns, job.rl.max_turns)


async def start_episode(
    env: Environment[Any],
    tokenizer: ChatTokenizer,
    job: JobSpec,
    *,
    group_id: str,
    group_index: int,
    sample_index: int,
) -> GenerationRequest:
    """The first request of one episode; all G samples of a group share `group_index`'s task."""
    episode_id = episode_id_for(job.job_id, group_index, sample_index)
    task = env.task_for(job.env.seed, group_index)
    return await _first_request(
        env, tokenizer, job, task, episode_id, group_id, group_index, sample_index
    )


async def start_eval_episode(
    env: Environment[Any], tokenizer: ChatTokenizer, job: JobSpec, *, version: int, index: int
) -> GenerationRequest:
    """The first request of evaluation episode `index` of adapter `version`: task `index` of
    the evaluation stream, decoded greedily with exactly that version (common/state/evals.py)."""
    group_id = eval_group_id(job.job_id, version)
    task = env.eval_task_for(job.eval.seed, index)
    return await _first_request(
        env, tokenizer, job, task, f"{group_id}/{index}", group_id, index, 0, eval_version=version
    )


async def _first_request(
    env: Environment[Any],
    tokenizer: ChatTokenizer,
    job: JobSpec,
    task: Any,
    episode_id: str,
    group_id: str,
    group_index: int,
    sample_index: int,
    *,
    eval_version: int = -1,
) -> GenerationRequest:
    state, messages = await env.areset(task)
    prompt_ids = tokenizer.prompt_ids(messages, env.template_tools())
    room = job.rl.max_context_tokens - job.rl.sampling.max_new_tokens
    if len(prompt_ids) > room:
        raise ContextTooLongError(
            f"job {job.job_id}: prompt of {len(prompt_ids)} tokens + max_new_tokens "
            f"{job.rl.sampling.max_new_tokens} exceeds max_context_tokens "
            f"{job.rl.max_context_tokens}"
        )
    carry = EpisodeCarry(
        env_state=encode_state(state),
        group_index=group_index,
        prompt_len=len(prompt_ids),
        context_len=len(prompt_ids),
        eval_version=eval_version,
    )
    return _request(job, episode_id, group_id, sample_index, prompt_ids, carry)


async def advance_episode(
    env: Environment[Any], tokenizer: ChatTokenizer, job: JobSpec, result: GenerationResult
) -> GenerationRequest | Trajectory:
    """Apply one sampled turn: the next turn's request, or the finished `Trajectory`.

    A coroutine that suspends only where the environment's own code awaits: env_svc drives
    one of a synchronous environment to its end in a worker thread (`run_sync`), one of an
    environment that awaits on its event loop. Meanwhile `EPISODE_JOB` names the job (what a
    judged reward's requests are charged to)."""
    named = EPISODE_JOB.set(job.job_id)
    try:
        return await _advance(env, tokenizer, job, result)
    finally:
        EPISODE_JOB.reset(named)


async def _advance(
    env: Environment[Any], tokenizer: ChatTokenizer, job: JobSpec, result: GenerationResult
) -> GenerationRequest | Trajectory:
    carry = decode_carry(result.env_state)
    completion_ids = list(result.completion_token_ids)
    context_ids = list(result.context_token_ids)
    if result.finish_reason == "abort":
        # An aborted turn is not what the policy would have written: the episode ends here.
        raise EpisodeError(f"{result.request_id}: generation was aborted")
    if result.job_id != job.job_id or result.turn != carry.turn:
        raise EpisodeCarryError(f"{result.request_id}: result does not match its carry")
    if len(context_ids) != carry.context_len or len(result.logprobs) != len(completion_ids):
        raise EpisodeError(f"{result.request_id}: echoed context or logprobs have wrong length")

    start = len(context_ids)
    context_ids += completion_ids
    carry.sampled_spans.append((start, len(context_ids)))
    carry.logprobs.extend(result.logprobs)
    carry.adapter_versions.append(result.adapter_version)
    carry.turn += 1

    state = env.decode_state(carry.env_state)
    step = await env.astep(state, tokenizer.text(completion_ids))
    if step.done:
        assert step.reward is not None
        reward = step.reward
        if result.finish_reason == "length" and not job.rl.score_cut_off:
            reward = unanswered(reward)  # the limit, not the policy, ended this answer
        return _trajectory(job, result, carry, context_ids, reward)
    if carry.turn >= turn_limit(env, job):
        return _trajectory(job, result, carry, context_ids, await env.ascore(step.state))

    # The sampled turn as the template sees it: the env's completion minus its new replies.
    history = step.state.completion[: len(step.state.completion) - len(step.messages)]
    messages_before = [*await env.prompt(step.state.task), *history]
    ended_with_eos = bool(completion_ids) and completion_ids[-1] == tokenizer.eos_token_id
    context_ids += tokenizer.continuation_ids(
        messages_before,
        step.messages,
        completion_ended_with_eos=ended_with_eos,
        tools=env.template_tools(),
    )
    if len(context_ids) + job.rl.sampling.max_new_tokens > job.rl.max_context_tokens:
        # No room for another turn: score the episode as it stands; unsent replies get no tokens.
        context_ids = context_ids[: carry.sampled_spans[-1][1]]
        return _trajectory(job, result, carry, context_ids, await env.ascore(step.state))

    carry.env_state = encode_state(step.state)
    carry.context_len = len(context_ids)
    follow_up = _request(
        job, result.episode_id, result.group_id, result.sample_index, context_ids, carry
    )
    if carry.eval_version >= 0:
        return follow_up  # pinned to its version
    # A later turn never samples with an older adapter than an earlier one did.
    return msgspec.structs.replace(follow_up, min_adapter_version=result.adapter_version)


def failed_trajectory(job: JobSpec, result: GenerationResult, error: str) -> Trajectory:
    """The end of an episode that cannot go on: recorded with its error, never scored.

    It still completes its group, so the group's other samples are trained (or the group is
    dropped as invalid and replaced) instead of waiting forever for the missing sample.
    """
    return _failed(
        job,
        result.episode_id,
        result.group_id,
        result.sample_index,
        list(result.context_token_ids),
        error,
    )


def unstarted_trajectory(
    job: JobSpec, *, group_id: str, group_index: int, sample_index: int, error: str
) -> Trajectory:
    """An episode whose first request could not be made (the environment raised): it ends
    at once with its error, so its group still completes (and is dropped and replaced)."""
    episode_id = episode_id_for(job.job_id, group_index, sample_index)
    return _failed(job, episode_id, group_id, sample_index, [], error)


def _failed(
    job: JobSpec,
    episode_id: str,
    group_id: str,
    sample_index: int,
    token_ids: list[int],
    error: str,
) -> Trajectory:
    return Trajectory(
        episode_id=episode_id,
        job_id=job.job_id,
        group_id=group_id,
        sample_index=sample_index,
        group_size=job.rl.group_size,
        token_ids=token_ids,
        loss_mask=[0] * len(token_ids),
        behaviour_logprobs=[0.0] * len(token_ids),
        reward=0.0,
        error=error,
        finished_at=time.time(),
    )


def _request(
    job: JobSpec,
    episode_id: str,
    group_id: str,
    sample_index: int,
    context_ids: list[int],
    carry: EpisodeCarry,
) -> GenerationRequest:
    evaluating = carry.eval_version >= 0
    return GenerationRequest(
        request_id=f"{episode_id}/t{carry.turn}",
        job_id=job.job_id,
        episode_id=episode_id,
        group_id=group_id,
        sample_index=sample_index,
        turn=carry.turn,
        context_token_ids=context_ids,
        sampling=greedy(job.rl.sampling) if evaluating else job.rl.sampling,
        env_state=encode_carry(carry),
        issued_at=time.time(),
        pinned_adapter_version=carry.eval_version,
        tenant=job.tenant,
    )


def greedy(sampling: SamplingSettings) -> SamplingSettings:
    """Evaluation decodes the most likely tokens, with the job's own length and stops."""
    return msgspec.structs.replace(sampling, temperature=0.0, top_p=1.0)


def _trajectory(
    job: JobSpec,
    result: GenerationResult,
    carry: EpisodeCarry,
    token_ids: list[int],
    reward: RewardResult,
) -> Trajectory:
    """The finished episode. A reward that could not be computed (NaN) is sent as 0.0 only
    together with a non-empty `error`: the trainer drops every trajectory whose `error` is set
    (a NaN would poison its group's advantages; a bare 0.0 would train as a real score)."""
    loss_mask_T = [0] * len(token_ids)
    logprobs_T = [0.0] * len(token_ids)
    flat_logprobs = iter(carry.logprobs)
    for start, end in carry.sampled_spans:
        for position in range(start, end):
            loss_mask_T[position] = 1
            logprobs_T[position] = next(flat_logprobs)
    error = reward.error
    if not math.isfinite(reward.total) and not error:
        error = f"reward is {reward.total!r}"
    return Trajectory(
        episode_id=result.episode_id,
        job_id=job.job_id,
        group_id=result.group_id,
        sample_index=result.sample_index,
        group_size=job.rl.group_size,
        token_ids=token_ids,
        loss_mask=loss_mask_T,
        behaviour_logprobs=logprobs_T,
        reward=0.0 if error else reward.total,
        reward_components=dict(reward.components),
        adapter_versions=list(carry.adapter_versions),
        error=error,
        finished_at=time.time(),
    )
