"""A finished episode as a person reads it: its turns as text, the tool calls the model wrote,
its reward and the reward's components (the tenant API's episode samples, the web console).

A trajectory carries token ids only (`Trajectory`, common/wire/messages.py), with a loss mask
that tells the policy's tokens from the rest. Its turns are the runs of that mask: the prompt
(the context before the first sampled token), each `model` turn (tokens the policy sampled)
and, between two of them, what the `environment` answered (tool results, the chat template's
next turn), each decoded with the base model's tokenizer, special tokens kept: the text is
what the model saw. Every text is clipped, so one sample stays small whatever the episode.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Literal

from common.wire.messages import Trajectory
from common.wire.toolcalls import TOOL_CALL_BLOCK

MAX_TURN_CHARS = 2000
"""A turn's text at most; the prompt keeps its end (the question comes last), the others
their start."""
MAX_TURNS = 24
"""Turns of one sample at most: the prompt, then the latest ones."""
MAX_CALL_CHARS = 500
"""A tool call's arguments (or a malformed call's body) at most, as shown."""

TurnSource = Literal["prompt", "model", "environment"]
Decode = Callable[[Sequence[int]], str]
"""Token ids to text, special tokens kept (`load_decoder`)."""


@dataclass
class ToolCallShown:
    """One `<tool_call>` block of a model turn (common/wire/toolcalls.py)."""

    name: str
    """The tool named; "" when the block is not a well-formed call."""
    arguments: str
    """The arguments as compact JSON, or a malformed block's body; clipped."""


@dataclass
class Turn:
    source: TurnSource
    """`prompt`, `model` (sampled by the policy) or `environment` (what came back)."""
    text: str
    """Decoded, special tokens kept; clipped to `MAX_TURN_CHARS`."""
    tokens: int
    clipped: bool = False
    tool_calls: list[ToolCallShown] = field(default_factory=list)
    """A model turn's tool calls, in order."""


@dataclass
class EpisodeSample:
    """One finished episode of a job (its `Trajectory`, readable)."""

    episode_id: str
    group_id: str
    sample_index: int
    finished_at: float
    reward: float | None
    """None when it could not be computed (`error` says why) or is not finite."""
    reward_components: dict[str, float | None]
    """Each named part of the reward (a component that failed: None)."""
    adapter_versions: list[int]
    """The adapter version that sampled each model turn."""
    error: str
    tokens: int
    turns: list[Turn]
    turns_left_out: int = 0
    """Turns between the prompt and the ones shown (past `MAX_TURNS`)."""


def episode_sample(trajectory: Trajectory, decode: Decode) -> EpisodeSample:
    """`trajectory` as a sample: its turns decoded and clipped, its numbers made JSON-safe."""
    turns = _turns(trajectory.token_ids, trajectory.loss_mask, decode)
    left_out = max(0, len(turns) - MAX_TURNS)
    if left_out:
        turns = [turns[0], *turns[len(turns) - MAX_TURNS + 1 :]]
    return EpisodeSample(
        episode_id=trajectory.episode_id,
        group_id=trajectory.group_id,
        sample_index=trajectory.sample_index,
        finished_at=trajectory.finished_at,
        reward=None if trajectory.error else _finite(trajectory.reward),
        reward_components={k: _finite(v) for k, v in trajectory.reward_components.items()},
        adapter_versions=list(trajectory.adapter_versions),
        error=trajectory.error,
        tokens=len(trajectory.token_ids),
        turns=turns,
        turns_left_out=left_out,
    )


def _turns(token_ids: Sequence[int], loss_mask: Sequence[int], decode: Decode) -> list[Turn]:
    turns: list[Turn] = []
    position = 0
    for sampled, run in itertools.groupby(loss_mask[: len(token_ids)], key=bool):
        length = len(list(run))
        ids = token_ids[position : position + length]
        position += length
        source: TurnSource = "model" if sampled else "environment" if turns else "prompt"
        turns.append(_turn(source, decode(ids), len(ids)))
    return turns


def _turn(source: TurnSource, text: str, tokens: int) -> Turn:
    calls = [_call(body) for body in TOOL_CALL_BLOCK.findall(text)] if source == "model" else []
    clipped = len(text) > MAX_TURN_CHARS
    if clipped:
        keep = MAX_TURN_CHARS - 1
        text = "…" + text[-keep:] if source == "prompt" else text[:keep] + "…"
    return Turn(source, text, tokens, clipped, calls)


def _call(body: str) -> ToolCallShown:
    body = body.strip()
    try:  # a turn's text: at most the job's max_new_tokens long
        payload = json.loads(body)
    except (ValueError, RecursionError):
        payload = None
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return ToolCallShown("", _clip(body))
    arguments = json.dumps(payload.get("arguments", {}), separators=(",", ":"))
    return ToolCallShown(payload["name"], _clip(arguments))


def _clip(text: str) -> str:
    return text if len(text) <= MAX_CALL_CHARS else text[: MAX_CALL_CHARS - 1] + "…"


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


@cache
def load_decoder(tokenizer_dir: Path) -> Decode:
    """The tokenizer in `tokenizer_dir` (its tokenizer.json) as a `Decode`; loaded once per
    directory. The `tokenizers` library only: no transformers, no torch."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))

    def decode(ids: Sequence[int]) -> str:
        return str(tokenizer.decode(list(ids), skip_special_tokens=False))

    return decode
