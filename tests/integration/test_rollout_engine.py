"""rollout_svc.engine against vLLM's real CPU engine on the tiny random Llama.

One engine serves the whole module (start-up takes ~15-30 s on 2 cores). The reference
numbers come from transformers (+ peft) scoring the same tokens in float32.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from common.files.models import tiny_model
from common.wire.adapters import AdapterRef
from common.wire.messages import (
    ContextTooLongError,
    GenerationRequest,
    GenerationResult,
    SamplingSettings,
    new_id,
)
from rollout_svc.compute import EngineCompute
from rollout_svc.engine import RolloutEngine
from rollout_svc.engine_settings import CPU_BLOCK_SIZE, EngineSettings
from rollout_svc.loras import AdapterUnavailableError

pytestmark = pytest.mark.asyncio(loop_scope="module")

CONTEXT = [1, 504, 3458, 282, 2114, 30, 216, 34, 2]
"""Any token ids will do: the model is random."""
LOGPROB_TOLERANCE = 0.05
"""vLLM computes in bfloat16 where the CPU runs it natively (float32 elsewhere,
common/runtime/hardware.py), the reference in float32."""


def make_adapter(base_dir: Path, out_dir: Path, seed: int) -> Path:
    """A PEFT LoRA (r=8, q/k/v/o) with seeded random lora_B, so it changes the outputs."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:  # PEFT initialises lora_B to zero: a no-op adapter
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    peft_model.save_pretrained(str(out_dir))
    return out_dir


def reference_logprobs(
    base_dir: Path, context: list[int], completion: list[int], adapter_dir: Path | None = None
) -> list[float]:
    """transformers' float32 logprob of each completion token given everything before it."""
    return score(load_reference(base_dir, adapter_dir), context, completion)


def load_reference(base_dir: Path, adapter_dir: Path | None = None) -> torch.nn.Module:
    """The base model in float32, with the PEFT adapter `adapter_dir` if given."""
    from transformers import AutoModelForCausalLM

    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    return model


def score(model: torch.nn.Module, context: list[int], completion: list[int]) -> list[float]:
    tokens = torch.tensor([context + completion])
    with torch.no_grad():
        logits = model(tokens).logits[0].float()
    logprobs_TV = torch.log_softmax(logits[len(context) - 1 : -1], dim=-1)
    return logprobs_TV.gather(1, torch.tensor(completion)[:, None])[:, 0].tolist()


class ReferenceScorer:
    """`reference_logprobs` for many samples, each adapter's model loaded once."""

    def __init__(self, base_dir: Path) -> None:
        self.base_dir = base_dir
        self._models: dict[Path | None, torch.nn.Module] = {}

    def logprobs(
        self, context: list[int], completion: list[int], adapter_dir: Path | None = None
    ) -> list[float]:
        if adapter_dir not in self._models:
            self._models[adapter_dir] = load_reference(self.base_dir, adapter_dir)
        return score(self._models[adapter_dir], context, completion)


def request(
    max_new_tokens: int = 8,
    temperature: float = 0.0,
    stop: list[str] | None = None,
    context: list[int] = CONTEXT,
    seed: int | None = None,
    job_id: str = "job",
    sample_index: int = 0,
) -> GenerationRequest:
    return GenerationRequest(
        request_id=new_id(),
        job_id=job_id,
        episode_id=new_id(),
        group_id=f"{job_id}/g0",
        sample_index=sample_index,
        turn=0,
        context_token_ids=context,
        env_state=b"state",
        sampling=SamplingSettings(
            temperature=temperature, max_new_tokens=max_new_tokens, stop=stop or [], seed=seed
        ),
    )


@pytest.fixture(scope="module")
def base_dir() -> Path:
    return tiny_model()


@pytest.fixture(scope="module")
def adapters(base_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, AdapterRef]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: AdapterRef(f"job-{name}", 1, str(make_adapter(base_dir, root / name, seed)))
        for seed, name in enumerate(["a", "b", "c"], start=1)
    }


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(base_dir: Path) -> AsyncIterator[RolloutEngine]:
    rollout_engine = RolloutEngine(
        EngineSettings(base_dir, max_loras=2, max_cpu_loras=4, max_lora_rank=8)
    )
    await rollout_engine.start()
    try:
        yield rollout_engine
    finally:
        await rollout_engine.stop()


async def test_greedy_generation_is_repeatable(engine: RolloutEngine) -> None:
    first, second = [await engine.generate(request(max_new_tokens=12)) for _ in range(2)]
    assert first.completion_token_ids == second.completion_token_ids
    assert len(first.completion_token_ids) == 12
    assert first.logprobs == pytest.approx(second.logprobs, abs=1e-6)
    assert first.adapter_version == 0
    assert first.env_state == b"state" and first.context_token_ids == CONTEXT


async def test_a_seeded_job_samples_the_same_tokens_under_any_job_id(
    engine: RolloutEngine,
) -> None:
    """Temperature 1: a seed names each sample's draws (not the job's id), beside other
    requests in the batch; another sample of the group, or no seed, draws otherwise."""

    async def sample(job_id: str, seed: int | None = None, sample_index: int = 0) -> list[int]:
        turn = request(16, 1.0, seed=seed, job_id=job_id, sample_index=sample_index)
        return (await engine.generate(turn)).completion_token_ids

    first = await sample("seq-0", seed=7)
    again = await asyncio.gather(sample("conc-0", seed=7), *(sample(f"x-{i}") for i in range(3)))
    assert again[0] == first
    others = [await sample("seq-0", seed=7, sample_index=1), *again[1:]]
    assert all(tokens != first for tokens in others)


async def test_logprobs_are_the_base_models_log_softmax(
    engine: RolloutEngine, base_dir: Path
) -> None:
    sampled = await engine.generate(request(max_new_tokens=16, temperature=1.0))
    assert len(sampled.logprobs) == len(sampled.completion_token_ids) > 0
    expected = reference_logprobs(base_dir, CONTEXT, sampled.completion_token_ids)
    assert sampled.logprobs == pytest.approx(expected, abs=LOGPROB_TOLERANCE)


async def test_each_request_in_a_batch_gets_its_own_adapter(
    engine: RolloutEngine, adapters: dict[str, AdapterRef], base_dir: Path
) -> None:
    a, b = adapters["a"], adapters["b"]
    batched = await asyncio.gather(
        engine.generate(request(), None),
        engine.generate(request(), a),
        engine.generate(request(), b),
    )
    base_out, a_out, b_out = (r.completion_token_ids for r in batched)
    assert [r.adapter_version for r in batched] == [0, 1, 1]
    assert len({tuple(base_out), tuple(a_out), tuple(b_out)}) == 3
    # Alone, each gives the same; the base request is the one vLLM 0.32's CPU kernels got
    # wrong (it picked up a neighbour's adapter). Here it carries no adapter at all: the
    # stacked CPU LoRA plugin (rollout_svc/cpu_lora.py) masks its rows.
    assert engine.loras.null_lora is None
    for adapter, out in ((None, base_out), (a, a_out), (b, b_out)):
        assert (await engine.generate(request(), adapter)).completion_token_ids == out
    # The batched logprobs are those of the adapter each request named, not its neighbours'.
    for result, adapter in zip(batched, (None, a, b), strict=True):
        adapter_dir = Path(adapter.path) if adapter is not None else None
        expected = reference_logprobs(base_dir, CONTEXT, result.completion_token_ids, adapter_dir)
        assert result.logprobs == pytest.approx(expected, abs=LOGPROB_TOLERANCE)


async def test_max_new_tokens_ends_with_length_and_stop_strings_with_stop(
    engine: RolloutEngine, adapters: dict[str, AdapterRef], base_dir: Path
) -> None:
    long = await engine.generate(request(max_new_tokens=5, temperature=1.0), adapters["a"])
    assert len(long.completion_token_ids) == len(long.logprobs) == 5
    assert long.finish_reason == "length"

    # The model is random, so take a stop string from what greedy decoding produces anyway.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    greedy = await engine.generate(request(max_new_tokens=8), adapters["a"])
    stop_at = next(
        i
        for i, token_id in enumerate(greedy.completion_token_ids)
        if i >= 2 and str(tokenizer.decode([token_id])).strip()
    )
    stop = str(tokenizer.decode([greedy.completion_token_ids[stop_at]])).strip()
    stopped = await engine.generate(request(max_new_tokens=8, stop=[stop]), adapters["a"])
    assert stopped.finish_reason == "stop"
    assert stopped.completion_token_ids == greedy.completion_token_ids[: len(stopped.logprobs)]
    assert len(stopped.completion_token_ids) <= stop_at + 1


async def test_context_that_fills_max_model_len_is_rejected(engine: RolloutEngine) -> None:
    with pytest.raises(ContextTooLongError):
        await engine.generate(request(context=[5] * engine.settings.max_model_len))
    near_limit = await engine.generate(request(context=[5] * (engine.settings.max_model_len - 3)))
    assert len(near_limit.completion_token_ids) == 3
    assert near_limit.finish_reason == "length"


async def test_retire_waits_for_in_flight_requests(
    engine: RolloutEngine, adapters: dict[str, AdapterRef]
) -> None:
    c = adapters["c"]
    in_flight = asyncio.create_task(engine.generate(request(max_new_tokens=400), c))
    lora_id = None
    for _ in range(200):  # until the engine has loaded the adapter for this request
        lora_id = engine.lora_int_id(c.job_id, c.version)
        if lora_id is not None and lora_id in await engine.loaded_lora_ids():
            break
        await asyncio.sleep(0.01)
    assert lora_id is not None and not in_flight.done()

    await engine.retire(c.job_id, c.version)
    assert not in_flight.done(), "the request must outlive this check; raise max_new_tokens"
    assert lora_id in await engine.loaded_lora_ids()
    assert engine.lora_int_id(c.job_id, c.version) == lora_id

    result = await in_flight
    assert result.finish_reason == "length" and result.adapter_version == c.version
    assert lora_id not in await engine.loaded_lora_ids()
    assert engine.lora_int_id(c.job_id, c.version) is None

    # Idle adapters go at once; using a retired version later loads it again.
    await engine.load(c)
    reloaded_id = engine.lora_int_id(c.job_id, c.version)
    assert reloaded_id is not None and reloaded_id != lora_id
    assert reloaded_id in await engine.loaded_lora_ids()
    await engine.retire(c.job_id, c.version)
    assert reloaded_id not in await engine.loaded_lora_ids()


async def test_utilisation_counters(engine: RolloutEngine, adapters: dict[str, AdapterRef]) -> None:
    tokens_before, busy_before = engine.generated_tokens, engine.busy_seconds
    requests_before = engine.request_seconds
    compute = EngineCompute(on_gpu=False)  # vLLM's engine core: a child of this process
    compute_before = compute.seconds() or 0.0
    loop = asyncio.get_running_loop()
    started = loop.time()
    results: list[GenerationResult] = await asyncio.gather(
        *(
            engine.generate(request(max_new_tokens=4 + i, temperature=1.0), adapter)
            for i, adapter in enumerate([None, adapters["a"], adapters["b"], None])
        )
    )
    wall = loop.time() - started
    assert engine.in_flight == 0
    assert engine.generated_tokens - tokens_before == sum(
        len(r.completion_token_ids) for r in results
    )
    busy = engine.busy_seconds - busy_before
    assert 0 < busy <= wall + 1e-3
    # four requests at once: the engine held between one and four while busy
    assert busy - 1e-3 <= engine.request_seconds - requests_before <= 4 * busy + 1e-3
    assert (compute.seconds() or 0.0) - compute_before > 0  # the engine core computed
    assert all(r.queue_s >= 0 and r.generate_s > 0 for r in results)
    assert all(r.queue_s + r.generate_s <= wall + 1e-3 for r in results)


async def test_prompt_counters_show_the_prefix_cache(engine: RolloutEngine) -> None:
    """A context seen before is found in the prefix cache, in whole blocks; the counters say
    how much of what was asked was computed."""
    context = [(7 * i) % 500 + 3 for i in range(100)]
    before = engine.prompt_tokens, engine.cached_prompt_tokens, engine.preemptions
    await engine.generate(request(max_new_tokens=2, context=context))
    first = engine.cached_prompt_tokens - before[1]
    await engine.generate(request(max_new_tokens=2, context=context))
    second = engine.cached_prompt_tokens - before[1] - first
    assert engine.prompt_tokens - before[0] == 2 * len(context)
    assert first == 0  # never seen: all prefilled
    assert second == len(context) // CPU_BLOCK_SIZE * CPU_BLOCK_SIZE
    assert engine.preemptions == before[2]


async def test_an_adapter_that_cannot_load_fails_its_requests_alone(
    engine: RolloutEngine, adapters: dict[str, AdapterRef], tmp_path: Path
) -> None:
    """The CI run that found it: an AdapterUpdate pointing at a missing directory reached
    vLLM with its requests; the load failed inside the engine's step and killed the engine,
    so every tenant's requests were aborted from then on."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{not json")
    missing = AdapterRef("job-missing", 1, str(tmp_path / "nonexistent" / "v1"))
    unreadable = AdapterRef("job-broken", 1, str(broken))
    results = await asyncio.gather(
        *(engine.generate(request(), bad) for bad in (missing, unreadable) for _ in range(3)),
        engine.generate(request(), adapters["a"]),
        engine.generate(request(), None),
        return_exceptions=True,
    )
    failed, served = results[:6], results[6:]
    assert all(isinstance(r, AdapterUnavailableError) for r in failed), failed
    assert "no adapter_config.json" in str(failed[0]) and "not loaded from" in str(failed[3])
    assert all(isinstance(r, GenerationResult) for r in served), served
    assert engine.ready
    assert len((await engine.generate(request(), adapters["b"])).completion_token_ids) == 8


async def test_more_adapters_than_slots_churning_versions_each_get_their_own_weights(
    engine: RolloutEngine, base_dir: Path, tmp_path: Path
) -> None:
    """Issue 26's open question (a shared run whose samples scored like another job's
    adapter): six jobs on an engine with 2 batch slots and 4 cached adapters, each job
    publishing new versions while its older ones are still in flight (as rollout_svc's
    `on_adapter` does: load the new, retire the old). Every sample's logprobs must be those
    of the exact version its request named, whatever was evicted, reloaded or retired."""
    versions = {
        (job, version): AdapterRef(
            f"churn-{job}",
            version,
            str(make_adapter(base_dir, tmp_path / f"{job}-v{version}", 100 * job + version)),
        )
        for job in range(6)
        for version in (1, 2, 3)
    }

    async def sample(adapter: AdapterRef, n: int) -> list[GenerationResult]:
        return list(
            await asyncio.gather(
                *(
                    engine.generate(request(max_new_tokens=6 + 3 * i, temperature=1.0), adapter)
                    for i in range(n)
                )
            )
        )

    async def publish(adapter: AdapterRef, previous: AdapterRef | None) -> None:
        await engine.load(adapter)
        if previous is not None:
            await engine.retire(previous.job_id, previous.version)

    sampled: list[tuple[AdapterRef, GenerationResult]] = []
    for version in (1, 2, 3):
        # Each job's new version is published (and the one before retired) while requests
        # for the one before still run.
        previous = [versions[job, max(version - 1, 1)] for job in range(6)]
        current = [versions[job, version] for job in range(6)]
        old_rounds, _, new_rounds = await asyncio.gather(
            asyncio.gather(*(sample(adapter, 3) for adapter in previous)),
            asyncio.gather(
                *(
                    publish(new, old if old != new else None)
                    for new, old in zip(current, previous, strict=True)
                )
            ),
            asyncio.gather(*(sample(adapter, 2) for adapter in current)),
        )
        for adapters_, rounds in ((previous, old_rounds), (current, new_rounds)):
            sampled += [
                (a, r) for a, results in zip(adapters_, rounds, strict=True) for r in results
            ]
    assert all(r.adapter_version == a.version for a, r in sampled)

    scorer = ReferenceScorer(base_dir)

    def distance(result: GenerationResult, adapter: AdapterRef) -> float:
        """Mean logprob error against the adapter: a token's error in bf16 reaches 0.07 at
        times on these random adapters, another adapter's is ~1 on every token."""
        expected = scorer.logprobs(CONTEXT, result.completion_token_ids, Path(adapter.path))
        errors = [abs(a - b) for a, b in zip(result.logprobs, expected, strict=True)]
        return sum(errors) / len(errors)

    wrong = [
        (adapter.lora_name, round(own, 3), nearest.lora_name, round(distance(result, nearest), 3))
        for adapter, result in sampled
        if (own := distance(result, adapter)) > LOGPROB_TOLERANCE
        for nearest in [min(versions.values(), key=lambda other: distance(result, other))]
    ]
    # (named adapter, its mean logprob error, the adapter nearest the sample, its error)
    assert not wrong, f"{len(wrong)} of {len(sampled)} samples were not their adapter's: {wrong}"
    for job in range(6):
        await engine.retire(f"churn-{job}", 3)


async def test_stop_aborts_requests_in_flight(engine: RolloutEngine) -> None:
    """Last in this module: it stops the shared engine (the fixture's stop is then a no-op)."""
    in_flight = asyncio.create_task(engine.generate(request(max_new_tokens=900)))
    await asyncio.sleep(0.5)
    assert engine.in_flight == 1
    await engine.stop()
    result = await asyncio.wait_for(in_flight, timeout=10)  # without the abort: forever
    assert result.finish_reason == "abort"
    assert len(result.completion_token_ids) == len(result.logprobs) < 900
    assert engine.in_flight == 0
