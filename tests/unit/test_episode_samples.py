"""marlaas/episodes.py: a finished episode as the web console shows it (the tenant API's
`GET /v1/jobs/{job}/episodes`): turns from the loss mask, tool calls, clipping, JSON-safe
numbers."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from common.wire.messages import Trajectory
from marlaas.episodes import (
    MAX_CALL_CHARS,
    MAX_TURN_CHARS,
    MAX_TURNS,
    ToolCallShown,
    episode_sample,
    load_decoder,
)


class Words:
    """A decoder over a made-up vocabulary: token i is `words[i]`."""

    def __init__(self, *words: str) -> None:
        self.words = list(words)

    def ids(self, *texts: str) -> list[int]:
        found = []
        for text in texts:
            if text not in self.words:
                self.words.append(text)
            found.append(self.words.index(text))
        return found

    def __call__(self, ids: Sequence[int]) -> str:
        return "".join(self.words[i] for i in ids)


def trajectory(
    token_ids: list[int], loss_mask: list[int], *, reward: float = 1.0, **fields: object
) -> Trajectory:
    return Trajectory(
        episode_id="job-1/3/0",
        job_id="job-1",
        group_id="job-1/3",
        sample_index=0,
        group_size=2,
        token_ids=token_ids,
        loss_mask=loss_mask,
        behaviour_logprobs=[0.0] * len(token_ids),
        reward=reward,
        **fields,  # type: ignore[arg-type]
    )


CALL = '<tool_call>{"name": "units.convert", "arguments": {"value": 2, "to_unit": "m"}}</tool_call>'


def test_the_turns_are_the_runs_of_the_loss_mask_with_the_model_turns_tool_calls() -> None:
    words = Words()
    ids = words.ids("<s>user\n", "2 km in m?", "<e>", CALL, "<e>", "<s>tool\n", "2000", "<e>")
    ids += words.ids("2000 m", "<e>")
    mask = [0, 0, 0, 1, 1, 0, 0, 0, 1, 1]
    sample = episode_sample(
        trajectory(ids, mask, reward_components={"correct": 1.0}, adapter_versions=[3, 4]),
        words,
    )
    assert [(t.source, t.tokens) for t in sample.turns] == [
        ("prompt", 3),
        ("model", 2),
        ("environment", 3),
        ("model", 2),
    ]
    assert sample.turns[0].text == "<s>user\n2 km in m?<e>"
    assert sample.turns[2].text == "<s>tool\n2000<e>"
    assert sample.turns[1].tool_calls == [
        ToolCallShown("units.convert", '{"value":2,"to_unit":"m"}')
    ]
    assert sample.turns[3].tool_calls == []
    assert (sample.reward, sample.reward_components) == (1.0, {"correct": 1.0})
    assert (sample.adapter_versions, sample.tokens, sample.turns_left_out) == ([3, 4], 10, 0)


def test_a_malformed_call_is_shown_as_written_and_only_model_turns_hold_calls() -> None:
    words = Words()
    ids = words.ids("<tool_call>not json", "<tool_call>{}</tool_call>", CALL, "x" * 3000)
    sample = episode_sample(trajectory(ids, [0, 1, 0, 1]), words)
    prompt, model, environment, last = sample.turns
    assert prompt.tool_calls == [] and environment.tool_calls == []  # a prompt can quote one
    assert model.tool_calls == [ToolCallShown("", "{}")]
    assert last.tool_calls == []
    (cut,) = episode_sample(trajectory(words.ids(CALL[:40]), [1]), words).turns[0].tool_calls
    assert cut == ToolCallShown("", CALL[len("<tool_call>") : 40])  # cut off mid-call


def test_every_text_is_clipped_the_prompt_to_its_end_and_the_rest_to_their_start() -> None:
    words = Words()
    long_prompt = "".join(f"{i:05d}" for i in range(1000))  # 5000 characters
    huge = {"value": "v" * 2000}
    call = f'<tool_call>{{"name": "t", "arguments": {json.dumps(huge)}}}</tool_call>'
    ids = words.ids(long_prompt, call + "y" * 5000)
    prompt, model = episode_sample(trajectory(ids, [0, 1]), words).turns
    assert prompt.clipped and len(prompt.text) == MAX_TURN_CHARS
    assert prompt.text.startswith("…") and prompt.text.endswith("00999")  # the question's end
    assert model.clipped and len(model.text) == MAX_TURN_CHARS and model.text.startswith(call[:50])
    (shown,) = model.tool_calls  # parsed from the whole turn, then clipped
    assert shown.name == "t" and len(shown.arguments) == MAX_CALL_CHARS
    assert shown.arguments.endswith("…")


def test_a_long_episode_keeps_its_prompt_and_latest_turns() -> None:
    words = Words()
    ids = words.ids("prompt") + [words.ids(f"t{i}")[0] for i in range(60)]
    mask = [0] + [1 if i % 2 == 0 else 0 for i in range(60)]
    sample = episode_sample(trajectory(ids, mask), words)
    assert len(sample.turns) == MAX_TURNS and sample.turns_left_out == 61 - MAX_TURNS
    assert sample.turns[0].text == "prompt" and sample.turns[-1].text == "t59"
    assert sample.turns[1].text == f"t{60 - MAX_TURNS + 1}"


def test_what_could_not_be_scored_has_no_reward_and_its_numbers_are_json() -> None:
    words = Words()
    failed = trajectory(
        words.ids("a", "b"),
        [0, 1],
        reward=0.0,
        error="reward raised ZeroDivisionError",
        reward_components={"correct": math.nan, "format": 1.0},
    )
    sample = episode_sample(failed, words)
    assert sample.reward is None and sample.error == "reward raised ZeroDivisionError"
    assert sample.reward_components == {"correct": None, "format": 1.0}
    infinite = episode_sample(trajectory(words.ids("a"), [1], reward=math.inf), words)
    assert infinite.reward is None


def test_the_base_models_tokenizer_decodes_with_the_templates_special_tokens(
    smollm2_dir: Path,
) -> None:
    from tokenizers import Tokenizer

    text = "<|im_start|>user\nWhat is 7 + 5?<|im_end|>\n<|im_start|>assistant\n12<|im_end|>"
    ids = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json")).encode(text).ids
    decode = load_decoder(smollm2_dir)
    assert decode(ids) == text
    assert load_decoder(smollm2_dir) is decode  # loaded once
