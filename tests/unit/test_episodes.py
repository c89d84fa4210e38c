"""The token-level episode driver against the real SmolLM2 tokenizer and chat template."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
from transformers import PreTrainedTokenizerFast

from common.wire.messages import (
    ContextTooLongError,
    EnvSettings,
    GenerationRequest,
    GenerationResult,
    JobSpec,
    RLSettings,
    SamplingSettings,
    Trajectory,
    result_for,
)
from env_svc import episodes
from env_svc.chat_template import ChatTokenizer
from env_svc.episodes import (
    EpisodeCarry,
    EpisodeCarryError,
    EpisodeError,
    decode_carry,
    encode_carry,
    failed_trajectory,
)
from env_svc.protocol import (
    ChatMessage,
    Environment,
    Reward,
    RewardResult,
    environment_for,
    finish,
)


def start_episode(env: Environment[Any], *args: Any, **kwargs: Any) -> GenerationRequest:
    """The episode driver, run to its end as env_svc runs it (a worker or the event loop)."""
    return finish(episodes.start_episode(env, *args, **kwargs), awaits=env.awaits)


def advance_episode(env: Environment[Any], *args: Any) -> GenerationRequest | Trajectory:
    return finish(episodes.advance_episode(env, *args), awaits=env.awaits)


def weighted(components: dict[str, float]) -> dict[str, float]:
    """Without the tool layer's metrics (weight 0)."""
    return {k: v for k, v in components.items() if not k.startswith("tools.")}


TOOL_CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> ChatTokenizer:
    return ChatTokenizer.from_dir(smollm2_dir)


@pytest.fixture(scope="module")
def hf(smollm2_dir: Path) -> Any:
    """The plain Hugging Face tokenizer, to decode with special tokens kept."""
    return PreTrainedTokenizerFast.from_pretrained(str(smollm2_dir))


def make_job(env: str, params: dict[str, Any] | None = None, **rl: Any) -> JobSpec:
    rl.setdefault("sampling", SamplingSettings(max_new_tokens=32))
    return JobSpec(
        job_id="job-1",
        tenant="t",
        base_model="smollm2-135m-instruct",
        env=EnvSettings(name=env, params=params or {}, seed=7),
        rl=RLSettings(group_size=4, **rl),
    )


def sample(
    tokenizer: ChatTokenizer,
    request: GenerationRequest,
    text: str,
    *,
    version: int,
    eos: bool = True,
) -> GenerationResult:
    """What rollout_svc would send back had the model written `text` (canonical tokens)."""
    completion_ids = tokenizer.encode(text) + ([tokenizer.eos_token_id] if eos else [])
    return result_for(
        request,
        completion_token_ids=completion_ids,
        logprobs=[-0.01 * (i + 1) - version for i in range(len(completion_ids))],
        adapter_version=version,
        finish_reason="stop" if eos else "length",
    )


def start(env: Environment[Any], tokenizer: ChatTokenizer, job: JobSpec) -> GenerationRequest:
    return start_episode(env, tokenizer, job, group_id="g0", group_index=0, sample_index=1)


def transcript(env: Environment[Any], replies: list[ChatMessage]) -> list[ChatMessage]:
    return [*env.reset(env.task_for(7, 0))[1], *replies]


def assistant(content: str) -> ChatMessage:
    return {"role": "assistant", "content": content}


def tool(content: str) -> ChatMessage:
    return {"role": "tool", "content": content}


def assert_sampled_exactly(trajectory: Trajectory, results: list[GenerationResult]) -> None:
    """Mask 1 and behaviour logprobs exactly on each result's completion, in place."""
    expected_mask = [0] * len(trajectory.token_ids)
    expected_logprobs = [0.0] * len(trajectory.token_ids)
    for result in results:
        start = len(result.context_token_ids)
        end = start + len(result.completion_token_ids)
        assert trajectory.token_ids[start:end] == result.completion_token_ids
        expected_mask[start:end] = [1] * (end - start)
        expected_logprobs[start:end] = result.logprobs
    assert trajectory.loss_mask == expected_mask
    assert trajectory.behaviour_logprobs == expected_logprobs


def test_env_svc_tokenizer_does_not_import_torch(smollm2_dir: Path) -> None:
    code = (
        "import sys\n"
        "import env_svc.episodes\n"
        "from env_svc.chat_template import ChatTokenizer\n"
        f"tok = ChatTokenizer.from_dir({str(smollm2_dir)!r})\n"
        "tok.prompt_ids([{'role': 'user', 'content': 'hi'}])\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_prompt_ids_match_the_chat_template(tokenizer: ChatTokenizer, hf: Any) -> None:
    messages: list[ChatMessage] = [{"role": "user", "content": "What is 2 + 3?"}]
    expected = hf.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert tokenizer.prompt_ids(messages) == expected
    assert tokenizer.text(expected[-3:]) == "assistant\n"


@pytest.mark.parametrize(
    ("reply", "reward", "components"),
    [("right", 1.1, {"correct": 1.0, "format": 1.0}), ("13", 0.1, {"correct": 0.0, "format": 1.0})],
)
def test_arithmetic_single_turn(
    tokenizer: ChatTokenizer, hf: Any, reply: str, reward: float, components: dict[str, float]
) -> None:
    job = make_job("arithmetic")
    env = environment_for(job)
    task = env.task_for(7, 0)
    reply = str(task.answer) if reply == "right" else reply
    request = start(env, tokenizer, job)
    assert request.context_token_ids == tokenizer.prompt_ids(env.reset(task)[1])
    assert (request.request_id, request.episode_id, request.turn) == (
        "job-1/0/1/t0",
        "job-1/0/1",
        0,
    )
    assert request.sampling == job.rl.sampling

    result = sample(tokenizer, request, reply, version=2)
    trajectory = advance_episode(env, tokenizer, job, result)

    assert isinstance(trajectory, Trajectory)
    # The transcript ends with the sampled eos; the template's trailing "\n" was never sampled.
    rendered = tokenizer.render(transcript(env, [assistant(reply)]), add_generation_prompt=False)
    assert hf.decode(trajectory.token_ids) + "\n" == rendered
    assert [*trajectory.token_ids, 198] == tokenizer.encode(rendered)
    assert_sampled_exactly(trajectory, [result])
    assert sum(trajectory.loss_mask) == len(tokenizer.encode(reply)) + 1
    assert trajectory.reward == pytest.approx(reward)
    assert trajectory.reward_components == components
    assert trajectory.error == "" and trajectory.adapter_versions == [2]
    assert (trajectory.episode_id, trajectory.group_id, trajectory.group_size) == (
        "job-1/0/1",
        "g0",
        4,
    )


@pytest.mark.parametrize("score_cut_off", [False, True])
def test_a_final_answer_cut_by_length_is_no_answer_unless_the_job_grades_it(
    tokenizer: ChatTokenizer, score_cut_off: bool
) -> None:
    """Cut off by max_new_tokens, the reply's last number is where the limit fell (the
    0.61 -> 0.45 run of issue 26: "8 + 2 = 10 ... the sum of 1" was graded on the 1)."""
    job = make_job("arithmetic", score_cut_off=score_cut_off)
    env = environment_for(job)
    answer = str(env.task_for(7, 0).answer)
    request = start(env, tokenizer, job)
    result = sample(tokenizer, request, f"The answer is {answer}", version=0, eos=False)
    trajectory = advance_episode(env, tokenizer, job, result)
    assert isinstance(trajectory, Trajectory)
    assert trajectory.token_ids == request.context_token_ids + result.completion_token_ids
    assert_sampled_exactly(trajectory, [result])
    graded = RewardResult(total=trajectory.reward, components=trajectory.reward_components)
    if score_cut_off:
        assert trajectory.reward_components == {"correct": 1.0, "format": 0.0}
        assert env.solved(graded)
    else:
        assert trajectory.reward == 0.0 and trajectory.error == ""
        assert trajectory.reward_components == {"correct": 0.0, "format": 0.0, "cut_off": 1.0}
        assert not env.solved(graded)
    # The same reply ended by the model itself is graded.
    ended = advance_episode(env, tokenizer, job, sample(tokenizer, request, answer, version=0))
    assert isinstance(ended, Trajectory) and ended.reward_components["correct"] == 1.0


def test_group_samples_share_the_task_with_distinct_ids(tokenizer: ChatTokenizer) -> None:
    job = make_job("arithmetic")
    env = environment_for(job)
    requests = [
        start_episode(env, tokenizer, job, group_id="g", group_index=3, sample_index=i)
        for i in range(3)
    ]
    assert len({tuple(r.context_token_ids) for r in requests}) == 1
    assert len({r.request_id for r in requests}) == len({r.episode_id for r in requests}) == 3
    other = start_episode(env, tokenizer, job, group_id="h", group_index=4, sample_index=0)
    assert other.context_token_ids != requests[0].context_token_ids


def test_calculator_multi_turn_is_token_in_token_out(tokenizer: ChatTokenizer, hf: Any) -> None:
    job = make_job("calculator", max_turns=3)
    env = environment_for(job)
    task = env.task_for(7, 0)
    call = TOOL_CALL % task.expression
    first = start(env, tokenizer, job)
    tool_result = sample(tokenizer, first, call, version=3)

    second = advance_episode(env, tokenizer, job, tool_result)

    assert isinstance(second, GenerationRequest)
    assert (second.request_id, second.turn, second.episode_id) == ("job-1/0/1/t1", 1, "job-1/0/1")
    assert second.min_adapter_version == 3
    so_far = transcript(env, [assistant(call), tool(str(task.answer))])
    rendered = tokenizer.render(so_far, add_generation_prompt=True)
    tool_ids = tokenizer.encode(f"\n<|im_start|>tool\n{task.answer}<|im_end|>\n")
    generation_prompt_ids = tokenizer.encode("<|im_start|>assistant\n")
    assert second.context_token_ids == (
        first.context_token_ids
        + tool_result.completion_token_ids
        + tool_ids
        + generation_prompt_ids
    )
    # Canonical sampled tokens: the carried ids are exactly the template's tokenization.
    assert second.context_token_ids == tokenizer.encode(rendered)
    assert hf.decode(second.context_token_ids) == rendered

    answer_result = sample(tokenizer, second, str(task.answer), version=4)
    trajectory = advance_episode(env, tokenizer, job, answer_result)

    assert isinstance(trajectory, Trajectory)
    full = tokenizer.render([*so_far, assistant(str(task.answer))], add_generation_prompt=False)
    assert [*trajectory.token_ids, 198] == tokenizer.encode(full)
    assert_sampled_exactly(trajectory, [tool_result, answer_result])
    tool_start = len(first.context_token_ids) + len(tool_result.completion_token_ids)
    assert trajectory.loss_mask[tool_start : len(second.context_token_ids)] == [0] * (
        len(tool_ids) + len(generation_prompt_ids)
    )
    assert trajectory.adapter_versions == [3, 4]
    assert weighted(trajectory.reward_components) == {
        "correct": 1.0,
        "tool_format": 1.0,
        "tool_use": 1.0,
    }
    assert trajectory.reward == pytest.approx(1.2)


def test_tool_turn_cut_by_length_gets_an_unscored_closing(tokenizer: ChatTokenizer) -> None:
    job = make_job("calculator", max_turns=3)
    env = environment_for(job)
    call = TOOL_CALL % env.task_for(7, 0).expression
    first = start(env, tokenizer, job)
    result = sample(tokenizer, first, call, version=1, eos=False)
    second = advance_episode(env, tokenizer, job, result)
    assert isinstance(second, GenerationRequest)
    after_completion = second.context_token_ids[
        len(first.context_token_ids) + len(result.logprobs) :
    ]
    assert after_completion[:2] == [tokenizer.eos_token_id, 198]
    answer = str(env.task_for(7, 0).answer)
    rendered = tokenizer.render(
        transcript(env, [assistant(call), tool(answer)]), add_generation_prompt=True
    )
    assert second.context_token_ids == tokenizer.encode(rendered)
    trajectory = advance_episode(env, tokenizer, job, sample(tokenizer, second, answer, version=1))
    assert isinstance(trajectory, Trajectory)
    assert sum(trajectory.loss_mask) == len(result.logprobs) + len(tokenizer.encode(answer)) + 1


@pytest.mark.parametrize(("env_turns", "job_turns"), [(2, 5), (5, 2)])
def test_turn_limit_ends_the_episode(
    tokenizer: ChatTokenizer, env_turns: int, job_turns: int
) -> None:
    job = make_job("calculator", {"max_turns": env_turns}, max_turns=job_turns)
    env = environment_for(job)
    request: GenerationRequest | Trajectory = start(env, tokenizer, job)
    results: list[GenerationResult] = []
    for _ in range(2):
        assert isinstance(request, GenerationRequest)
        results.append(sample(tokenizer, request, TOOL_CALL % "1 + 1", version=len(results)))
        request = advance_episode(env, tokenizer, job, results[-1])
    assert isinstance(request, Trajectory)
    assert request.adapter_versions == [0, 1]
    # The last turn's tool result was never sent, so the transcript ends with the sampled turn.
    assert request.token_ids[-1] == tokenizer.eos_token_id
    assert_sampled_exactly(request, results)
    assert weighted(request.reward_components) == {
        "correct": 0.0,
        "tool_format": 1.0,
        "tool_use": 1.0,
    }


def test_context_limit_ends_the_episode(tokenizer: ChatTokenizer) -> None:
    probe = make_job("calculator", max_turns=3)
    env = environment_for(probe)
    prompt_n = len(start(env, tokenizer, probe).context_token_ids)
    # Room for the first turn, not for a tool reply plus another 32 new tokens.
    job = make_job("calculator", max_turns=3, max_context_tokens=prompt_n + 40)
    first = start(env, tokenizer, job)
    result = sample(tokenizer, first, TOOL_CALL % "2 * 3", version=5)
    trajectory = advance_episode(env, tokenizer, job, result)
    assert isinstance(trajectory, Trajectory)
    assert trajectory.token_ids == first.context_token_ids + result.completion_token_ids
    assert weighted(trajectory.reward_components) == {
        "correct": 0.0,
        "tool_format": 1.0,
        "tool_use": 1.0,
    }

    too_small = make_job("calculator", max_context_tokens=prompt_n + 31)
    with pytest.raises(ContextTooLongError, match="max_context_tokens"):
        start(env, tokenizer, too_small)


def test_failed_reward_is_zero_only_with_its_error(tokenizer: ChatTokenizer) -> None:
    job = make_job("arithmetic")
    env = environment_for(job)

    def broken(task: Any, completion: Any) -> float:
        raise RuntimeError("grader offline")

    env.rewards = [Reward("broken", broken)]
    trajectory = advance_episode(
        env, tokenizer, job, sample(tokenizer, start(env, tokenizer, job), "5", version=0)
    )
    assert isinstance(trajectory, Trajectory)
    assert trajectory.reward == 0.0 and not math.isnan(trajectory.reward)
    assert "grader offline" in trajectory.error


def test_bad_carry_and_results_raise_clear_errors(tokenizer: ChatTokenizer) -> None:
    job = make_job("arithmetic")
    env = environment_for(job)
    request = start(env, tokenizer, job)
    result = sample(tokenizer, request, "5", version=0)
    assert decode_carry(request.env_state).prompt_len == len(request.context_token_ids)

    for garbage in (b"", b"not msgpack", msgspec.msgpack.encode({"env_state": b""})):
        with pytest.raises(EpisodeCarryError, match="not an episode carry"):
            advance_episode(env, tokenizer, job, msgspec.structs.replace(result, env_state=garbage))
    inconsistent = EpisodeCarry(env_state=b"", group_index=0, prompt_len=10, context_len=5)
    with pytest.raises(EpisodeCarryError, match="inconsistent"):
        decode_carry(encode_carry(inconsistent))
    with pytest.raises(EpisodeCarryError, match="does not match"):
        advance_episode(env, tokenizer, job, msgspec.structs.replace(result, turn=1))
    with pytest.raises(EpisodeError, match="wrong length"):
        advance_episode(env, tokenizer, job, msgspec.structs.replace(result, logprobs=[]))
    with pytest.raises(EpisodeError, match="aborted"):
        advance_episode(env, tokenizer, job, msgspec.structs.replace(result, finish_reason="abort"))


def test_a_failed_episode_still_completes_its_group_with_an_error(
    tokenizer: ChatTokenizer,
) -> None:
    job = make_job("arithmetic")
    env = environment_for(job)
    request = start(env, tokenizer, job)
    result = msgspec.structs.replace(
        sample(tokenizer, request, "5", version=0),
        finish_reason="abort",
        completion_token_ids=[],
        logprobs=[],
    )
    failed = failed_trajectory(job, result, "generation was aborted")
    assert (failed.episode_id, failed.group_id, failed.group_size) == (
        request.episode_id,
        request.group_id,
        job.rl.group_size,
    )
    assert failed.error == "generation was aborted" and failed.reward == 0.0
    assert failed.token_ids == request.context_token_ids
    assert sum(failed.loss_mask) == 0  # nothing in it is trained
