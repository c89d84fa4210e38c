"""`ChatTokenizer`: the base model's chat template and tokenizer, rendering an episode's
messages and extending its token context turn by turn (only ever appended to: the episode
driver, env_svc/episodes.py, and docs/architecture.md, "Token-in/token-out"). Where the
template renders a `tools=` list in the Hermes/Qwen `<tool_call>` format, every render of an
episode passes the same tool schemas.

The tokenizer is loaded as `PreTrainedTokenizerFast`, not `AutoTokenizer`: in transformers 5,
`AutoTokenizer` imports torch (model-class resolution), which env_svc must not pay for.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerFast

from env_svc.protocol import ChatMessage

_SENTINEL = "\x00marlaas-assistant-content\x00"
"""Stands in for an assistant turn's content to find the text the template puts after it."""


class ChatTokenizer:
    """A chat template plus tokenizer that only ever appends to a token context."""

    def __init__(self, tokenizer: Any) -> None:
        if tokenizer.eos_token_id is None or not tokenizer.chat_template:
            raise ValueError("the tokenizer needs an eos token and a chat template")
        self._tokenizer = tokenizer
        self.eos_token_id: int = tokenizer.eos_token_id
        self._eos_text: str = tokenizer.eos_token

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ChatTokenizer:
        return cls(PreTrainedTokenizerFast.from_pretrained(str(model_dir)))

    @property
    def takes_tools(self) -> bool:
        """Whether the template renders a `tools=` list, and in the Hermes/Qwen `<tool_call>`
        format the tool layer parses (a template with another call format is given none)."""
        template = str(self._tokenizer.chat_template)
        return "tools" in template and "<tool_call>" in template

    def render(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        extra = {} if tools is None else {"tools": tools}
        text = self._tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **extra
        )
        assert isinstance(text, str)
        return text

    def encode(self, text: str) -> list[int]:
        # The template writes its special tokens as text; nothing may be added around them.
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def text(self, ids: Sequence[int]) -> str:
        """What the model wrote: special tokens (the closing eos) dropped, spaces untouched."""
        return str(
            self._tokenizer.decode(
                list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False
            )
        )

    def prompt_ids(
        self, messages: Sequence[ChatMessage], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        return self.encode(self.render(messages, add_generation_prompt=True, tools=tools))

    def continuation_ids(
        self,
        messages_before: Sequence[ChatMessage],
        new_messages: Sequence[ChatMessage],
        *,
        completion_ended_with_eos: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Tokens to append after a sampled assistant turn (the last of `messages_before`):
        the rest of that turn's closing, `new_messages`, and the next generation prompt.

        The template's closing of an assistant turn is `eos` + "\\n" in ChatML; a turn that
        ended with the eos token needs only the "\\n", one cut off by length (or by a stop
        string) gets the whole closing here, as context the trainer does not score.
        """
        if not messages_before or messages_before[-1]["role"] != "assistant":
            raise ValueError("messages_before must end with the sampled assistant turn")
        before = self.render(messages_before, add_generation_prompt=False, tools=tools)
        after = self.render(
            [*messages_before, *new_messages], add_generation_prompt=True, tools=tools
        )
        if not after.startswith(before):
            # Templates that rewrite earlier turns (e.g. drop old reasoning) cannot be extended.
            raise ValueError("the chat template does not render earlier turns stably")
        closing = self._assistant_closing(messages_before[:-1], tools)
        if completion_ended_with_eos:
            if not closing.startswith(self._eos_text):
                raise ValueError(f"the template does not close a turn with {self._eos_text!r}")
            closing = closing[len(self._eos_text) :]
        return self.encode(closing + after[len(before) :])

    def _assistant_closing(
        self, history: Sequence[ChatMessage], tools: list[dict[str, Any]] | None = None
    ) -> str:
        sentinel: ChatMessage = {"role": "assistant", "content": _SENTINEL}
        rendered = self.render([*history, sentinel], add_generation_prompt=False, tools=tools)
        return rendered[rendered.rindex(_SENTINEL) + len(_SENTINEL) :]
