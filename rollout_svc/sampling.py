"""One turn's sampling in vLLM: its parameters and seed in, its result out."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from common.wire.messages import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    SamplingSettings,
    result_for,
)

if TYPE_CHECKING:
    from vllm import RequestOutput, SamplingParams


def turn_seed(request: GenerationRequest) -> int | None:
    """The sampler's seed for one turn: None when the job's sampling is unseeded, else one
    of 2^63 named by the job's seed, the group's place in the job (its id without the job's:
    `g<index>`), the sample and the turn. The job id stays out, so the same spec submitted
    again under another id draws the same."""
    seed = request.sampling.seed
    if seed is None:
        return None
    group = request.group_id.removeprefix(f"{request.job_id}/")
    name = f"{seed}:{group}:{request.sample_index}:{request.turn}".encode()
    return int.from_bytes(hashlib.sha256(name).digest()[:8], "big") >> 1


def sampling_params(sampling: SamplingSettings, seed: int | None) -> SamplingParams:
    """vLLM's parameters for one turn: the final output only, the sampled token's logprob."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        seed=seed,
        max_tokens=sampling.max_new_tokens,
        stop=list(sampling.stop) or None,
        logprobs=0,  # the sampled token's logprob only
        # Stop strings need text; without them skip detokenising (CPU in this process).
        detokenize=bool(sampling.stop),
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def finish_reason(vllm_reason: str | None) -> FinishReason:
    """vLLM's "stop" (EOS, stop string) and "length" pass; anything else is an abort."""
    if vllm_reason in ("stop", "length"):
        return vllm_reason  # type: ignore[return-value]
    return "abort"


def queue_seconds(final: RequestOutput) -> float:
    """How long the request waited in vLLM's queue before it was first scheduled."""
    metrics = final.metrics
    if metrics is not None and getattr(metrics, "scheduled_ts", 0.0) > 0.0:
        return float(max(0.0, metrics.scheduled_ts - metrics.queued_ts))
    return 0.0


def result_of(
    request: GenerationRequest, final: RequestOutput, adapter_version: int, elapsed_s: float
) -> GenerationResult:
    """The turn's result from vLLM's final output: each sampled token with its logprob."""
    completion = final.outputs[0]
    token_ids = list(completion.token_ids)
    if completion.logprobs is None or len(completion.logprobs) != len(token_ids):
        raise RuntimeError(f"vLLM returned no logprob per token for {request.request_id}")
    # With logprobs=0 each position holds exactly the sampled token's entry.
    logprobs: list[float] = []
    for position, token_id in zip(completion.logprobs, token_ids, strict=True):
        if position is None or token_id not in position:
            raise RuntimeError(f"vLLM left out a sampled token's logprob: {request.request_id}")
        logprobs.append(float(position[token_id].logprob))
    queue_s = queue_seconds(final)
    return result_for(
        request,
        completion_token_ids=token_ids,
        logprobs=logprobs,
        adapter_version=adapter_version,
        finish_reason=finish_reason(completion.finish_reason),
        queue_s=queue_s,
        generate_s=max(0.0, elapsed_s - queue_s),
    )
