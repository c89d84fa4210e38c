"""Tools through the chat template's `tools=` (env_svc/tools/environment.py,
env_svc/chat_template.py): where the base model's template renders a tool list in the
Hermes/Qwen `<tool_call>` format (as Qwen's do), the tool layer hands it the schemas and its
system prompt keeps only the words around them; SmolLM2's template takes no tools, and the
system prompt lists them as before."""

from __future__ import annotations

import json

import pytest
from transformers import PreTrainedTokenizerFast

from common.files.models import tiny_model
from env_svc.chat_template import ChatTokenizer
from env_svc.envs.calculator import CalculatorEnv
from env_svc.protocol import ChatMessage

QWEN_LIKE = """
{%- if tools %}<|im_start|>system
{%- if messages[0].role == 'system' %}
{{ messages[0].content }}
{%- endif %}
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call a function with <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}{%- if message.role != 'system' %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def tokenizers() -> tuple[ChatTokenizer, ChatTokenizer]:
    """(SmolLM2's template, a Qwen-like one that renders `tools=`), one vocabulary."""
    plain = PreTrainedTokenizerFast.from_pretrained(str(tiny_model()))
    qwen = PreTrainedTokenizerFast.from_pretrained(str(tiny_model()))
    qwen.chat_template = QWEN_LIKE
    return ChatTokenizer(plain), ChatTokenizer(qwen)


def test_a_template_that_renders_tools_gets_them_and_the_system_prompt_only_its_words(
    tokenizers: tuple[ChatTokenizer, ChatTokenizer],
) -> None:
    plain, qwen = tokenizers
    assert not plain.takes_tools and qwen.takes_tools
    env = CalculatorEnv()
    task = env.task_for(0, 0)
    listed = env.initial_messages(task)[0]["content"]
    assert "<tools>" in listed and env.template_tools() is None  # SmolLM2: as before

    env.template_takes_tools = True  # env_svc sets it from the base model's template
    schemas = env.template_tools()
    assert schemas == [tool.schema() for tool in env.toolbox.tools.values()]
    messages = env.initial_messages(task)
    assert "<tools>" not in messages[0]["content"]
    prompt = qwen.render(messages, add_generation_prompt=True, tools=schemas)
    assert prompt.count(json.dumps(schemas[0])) == 1  # listed once, by the template
    assert prompt.count("<tools>") == 1 and env.tools_intro in prompt


def test_an_episode_with_template_tools_extends_its_context_turn_by_turn(
    tokenizers: tuple[ChatTokenizer, ChatTokenizer],
) -> None:
    _, qwen = tokenizers
    env = CalculatorEnv()
    env.template_takes_tools = True
    schemas = env.template_tools()
    task = env.task_for(0, 1)
    opening = env.initial_messages(task)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'
    said: ChatMessage = {"role": "assistant", "content": call}
    reply: ChatMessage = {"role": "tool", "content": "5"}
    prompt = qwen.prompt_ids(opening, schemas)
    sampled = [*qwen.encode(call), qwen.eos_token_id]
    more = qwen.continuation_ids([*opening, said], [reply], tools=schemas)
    whole = qwen.render([*opening, said, reply], add_generation_prompt=True, tools=schemas)
    assert [*prompt, *sampled, *more] == qwen.encode(whole)  # only ever appended to
