"""From records (one dict per row, as `sources` reads them) to tasks' rows, by a column
mapping: the prompt is a text column or a chat `messages` column (a list of `{role, content}`,
TRL's conversational format), the reference answer a column or, when the row has none, the
content of a final assistant message; an optional column gives each row's system prompt.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

from env_svc.datafiles import MAX_LINE_BYTES
from env_svc.protocol import ChatMessage

ROLES = ("system", "user", "assistant")
MAX_PROMPT_CHARS = MAX_LINE_BYTES
"""A row's prompt, all its messages together (a JSONL line's cap, for every format)."""


class Row(NamedTuple):
    prompt: tuple[ChatMessage, ...]
    """The row's messages up to the model's turn, ending with the user's."""
    answer: str

    @property
    def question(self) -> str:
        return self.prompt[-1]["content"]

    @property
    def key(self) -> str:
        """What the held-out split hashes: the question, or the whole prompt when it has more
        than one message."""
        if len(self.prompt) == 1:
            return self.question
        return json.dumps(self.prompt, sort_keys=True, ensure_ascii=False)


@dataclass(frozen=True)
class Columns:
    question: str
    answer: str
    messages: str = ""
    """The chat-messages column; empty: the prompt is `question`'s text."""
    system: str = ""
    """A column of system prompts (empty or null in a row: none)."""

    @property
    def required(self) -> tuple[str, ...]:
        """The columns every dataset of this mapping has (the others are never loaded)."""
        prompt = self.messages or self.question
        answer = () if self.messages else (self.answer,)  # else: maybe the last message
        return tuple(dict.fromkeys(c for c in (prompt, *answer, self.system) if c))

    @property
    def optional(self) -> tuple[str, ...]:
        """Columns read where the dataset has them."""
        return (self.answer,) if self.messages else ()

    def rows(self, records: Iterable[Mapping[str, Any]], where: str) -> tuple[Row, ...]:
        """Each record as a row; a record that is not one raises ValueError naming `where`
        and its number (from 1), never its content."""
        rows: list[Row] = []
        for number, record in enumerate(records, start=1):
            try:
                rows.append(self.row(record))
            except ValueError as exc:
                raise ValueError(f"{where}: row {number}: {exc}") from None
        if not rows:
            raise ValueError(f"{where}: no rows")
        return tuple(rows)

    def row(self, record: Mapping[str, Any]) -> Row:
        """The record as a row; ValueError with the reason when it is not one."""
        answer = record.get(self.answer)
        if self.messages:
            prompt = _messages(record.get(self.messages), self.messages)
            if answer is None and prompt and prompt[-1]["role"] == "assistant":
                answer, prompt = prompt[-1]["content"], prompt[:-1]
            if not prompt or prompt[-1]["role"] != "user":
                raise ValueError(f"{self.messages!r} must end with a user message")
        else:
            prompt = [{"role": "user", "content": _text(record.get(self.question), self.question)}]
        if self.system and (system := record.get(self.system)) not in (None, ""):
            prompt = [{"role": "system", "content": _text(system, self.system)}, *prompt]
        if sum(len(message["content"]) for message in prompt) > MAX_PROMPT_CHARS:
            raise ValueError(f"the prompt has more than {MAX_PROMPT_CHARS} characters")
        if answer is None:
            raise ValueError(f"column {self.answer!r} missing")
        return Row(tuple(prompt), _text(answer, self.answer, empty_ok=True))


def _text(value: Any, column: str, *, empty_ok: bool = False) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(f"column {column!r} missing or not text/number")
    text = str(value)
    if not empty_ok and not text.strip():
        raise ValueError(f"empty {column!r}")
    return text


def _messages(value: Any, column: str) -> list[ChatMessage]:
    if not isinstance(value, Sequence) or isinstance(value, str | bytes) or not value:
        raise ValueError(f"{column!r} missing or not a list of messages")
    messages: list[ChatMessage] = []
    for index, message in enumerate(value):
        if not isinstance(message, Mapping):
            raise ValueError(f"{column!r}[{index}] is not a message")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES or not isinstance(content, str):
            raise ValueError(
                f"{column!r}[{index}] needs a role ({', '.join(ROLES)}) and text content"
            )
        messages.append(cast(ChatMessage, {"role": role, "content": content}))
    return messages
