"""Tiny chat-model directories built in the test, offline, for chat data and ``--model hf:DIR``.

:func:`chat_model_dir` writes, for one template family:

* ``tokenizer.json``: a byte-level BPE (GPT-2 pre-tokenization, about 500 tokens) trained here on a small fixed
  corpus, with the family's control tokens added as special tokens (``<|im_end|>`` is one token, never text);
* ``tokenizer_config.json``: the family's ``chat_template``, ``eos_token``, ``bos_token`` (where the family has
  one), ``pad_token`` and ``tokenizer_class: PreTrainedTokenizerFast``;
* with ``with_model``, a tiny random causal LM over that vocabulary (``config.json`` + ``model.safetensors``:
  Qwen2 for the Qwen families, Llama for the others; 2 layers, 32 wide, 128 positions, ``torch.manual_seed(0)``).

The templates are this project's own Jinja, written in the manner of each family's conversation format (its turn
headers, its end-of-turn token, its generation prompt, where tools and tool calls go); none is a copy of a model's
template. What sets some apart, on purpose:

* ``smollm`` wraps each reply and its ``<|im_end|>`` in ``{% generation %}`` markers (:data:`GENERATION_MARKED`);
  no other family has markers.
* ``gpt-oss`` ends the last reply with ``<|return|>`` and every earlier one with ``<|end|>``: a conversation cut
  after an earlier reply renders differently from the whole (a strict prefix check refuses it).
* ``qwen3`` drops the ``<think>...</think>`` reasoning of replies before the last user message and keeps that of
  the replies after it: a conversation whose earlier reply reasons (:data:`THINKING_CONVERSATION`) renders
  differently cut after that reply than whole. The rows of :func:`conversations` hold no reasoning, so in qwen3
  they render prefix-stably.
* ``plain`` has no control token at all: ``User: ...`` / ``Assistant: ...`` lines; its eos ``<|endoftext|>`` is in
  the vocabulary but the template never writes it.
* ``smollm``'s pad token is its eos (``<|im_end|>``), as in SmolLM2; every other family pads with a token the
  template never writes.

Every family but ``gpt-oss`` renders each row of :func:`conversations` prefix-stably (:data:`PREFIX_UNSTABLE`); in
every family the conversation up to a reply, with the generation prompt, renders as the start of the whole.
The tokenizers add no special token when encoding (no post-processor): the templates write bos themselves.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from textwrap import dedent
from typing import Any


def _jinja(text: str) -> str:
    """A template written one tag to a line, indented: every tag trims the white space before it (``{%-``,
    ``{{-``), so the layout of the source is not output."""
    return dedent(text).strip()


_CALL_JSON = r"""
{%- macro call_json(call) %}
  {%- set f = call.function if call.function is defined else call %}
  {{- '{"name": ' + (f.name | tojson) + ', "arguments": ' }}
  {{- (f.arguments if f.arguments is string else (f.arguments | tojson)) + '}' }}
{%- endmacro %}
"""
"""A tool call as one JSON object, ``{"name": ..., "arguments": ...}`` (``arguments`` an object or JSON text)."""

_SPLIT_SYSTEM = r"""
{%- if messages and messages[0].role in ['system', 'developer'] %}
  {%- set system = messages[0].content %}
  {%- set rest = messages[1:] %}
{%- else %}
  {%- set system = '' %}
  {%- set rest = messages %}
{%- endif %}
"""
"""``system`` (the first message's text when it is a system or developer message, else empty) and ``rest``."""

_LLAMA3 = r"""
{{- bos_token }}
{%- if tools %}
  {%- set ns = namespace(text=(system | trim) + ('\n\n' if system else '')) %}
  {%- set ns.text = ns.text + 'You can call these functions; to call one, reply with {"name": ..., "arguments": ...}:' %}
  {%- for tool in tools %}
    {%- set ns.text = ns.text + '\n' + (tool | tojson) %}
  {%- endfor %}
  {%- set system = ns.text %}
{%- endif %}
{%- if system %}
  {{- '<|start_header_id|>system<|end_header_id|>\n\n' + (system | trim) + '<|eot_id|>' }}
{%- endif %}
{%- for message in rest %}
  {{- '<|start_header_id|>' + ('ipython' if message.role == 'tool' else message.role) + '<|end_header_id|>\n\n' }}
  {%- if message.tool_calls %}
    {%- for call in message.tool_calls %}
      {{- ('' if loop.first else '\n') + call_json(call) }}
    {%- endfor %}
  {%- else %}
    {{- message.content | trim }}
  {%- endif %}
  {{- '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
  {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

_CHATML_SYSTEM = r"""
{%- if tools %}
  {%- set ns = namespace(text=(system or default_system) + '\n\n# Tools\n\nThese functions can be called, one JSON signature a line:\n<tools>') %}
  {%- for tool in tools %}
    {%- set ns.text = ns.text + '\n' + (tool | tojson) %}
  {%- endfor %}
  {%- set system = ns.text + '\n</tools>\n\nTo call one, write {"name": ..., "arguments": ...} between <tool_call> and </tool_call>.' %}
{%- endif %}
{%- if system or default_system %}
  {{- '<|im_start|>system\n' + (system or default_system) + '<|im_end|>\n' }}
{%- endif %}
"""
"""ChatML's system turn (``default_system`` when the row has none; none at all when that is empty too), with the
tools' signatures in it."""

_CHATML_CALLS = r"""
  {%- for call in message.tool_calls or [] %}
    {{- ('' if loop.first and not message.content else '\n') + '<tool_call>\n' + call_json(call) + '\n</tool_call>' }}
  {%- endfor %}
"""

_CHATML_TOOL_RESULT = r"""
    {%- if loop.first or rest[loop.index0 - 1].role != 'tool' %}
      {{- '<|im_start|>user' }}
    {%- endif %}
    {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
    {%- if loop.last or rest[loop.index0 + 1].role != 'tool' %}
      {{- '<|im_end|>\n' }}
    {%- endif %}
"""
"""Consecutive tool results in one user turn, each in ``<tool_response>`` tags."""

_QWEN25 = (
    r"""
{%- set default_system = 'You are a helpful assistant.' %}
"""
    + _CHATML_SYSTEM
    + r"""
{%- for message in rest %}
  {%- if message.role == 'tool' %}
"""
    + _CHATML_TOOL_RESULT
    + r"""
  {%- elif message.role == 'assistant' %}
    {{- '<|im_start|>assistant\n' + message.content }}
"""
    + _CHATML_CALLS
    + r"""
    {{- '<|im_end|>\n' }}
  {%- else %}
    {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
  {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""
)

_QWEN3 = (
    r"""
{%- set default_system = '' %}
{%- set last = namespace(user=-1) %}
{%- for message in rest %}
  {%- if message.role == 'user' %}
    {%- set last.user = loop.index0 %}
  {%- endif %}
{%- endfor %}
"""
    + _CHATML_SYSTEM
    + r"""
{%- for message in rest %}
  {%- if message.role == 'tool' %}
"""
    + _CHATML_TOOL_RESULT
    + r"""
  {%- elif message.role == 'assistant' %}
    {%- set said = namespace(text=message.content, reasoning='') %}
    {%- if message.reasoning_content is string %}
      {%- set said.reasoning = message.reasoning_content | trim %}
    {%- elif '</think>' in message.content %}
      {%- set said.reasoning = message.content.split('</think>')[0].split('<think>')[-1] | trim %}
      {%- set said.text = message.content.split('</think>')[-1].lstrip('\n') %}
    {%- endif %}
    {{- '<|im_start|>assistant\n' }}
    {%- if loop.index0 > last.user and said.reasoning %}
      {{- '<think>\n' + said.reasoning + '\n</think>\n\n' }}
    {%- endif %}
    {{- said.text }}
"""
    + _CHATML_CALLS.replace("message.content", "said.text")
    + r"""
    {{- '<|im_end|>\n' }}
  {%- else %}
    {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
  {{- '<|im_start|>assistant\n' }}
  {%- if enable_thinking is defined and not enable_thinking %}
    {{- '<think>\n\n</think>\n\n' }}
  {%- endif %}
{%- endif %}
"""
)

_MISTRAL = r"""
{{- bos_token }}
{%- if tools %}
  {{- '[AVAILABLE_TOOLS] ' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}
{%- endif %}
{%- set pending = namespace(system=system) %}
{%- for message in rest %}
  {%- if message.role == 'user' %}
    {{- '[INST] ' + ((pending.system + '\n\n') if pending.system else '') + message.content + ' [/INST]' }}
    {%- set pending.system = '' %}
  {%- elif message.role == 'assistant' and message.tool_calls %}
    {{- '[TOOL_CALLS] [' }}
    {%- for call in message.tool_calls %}
      {{- ('' if loop.first else ', ') + call_json(call) }}
    {%- endfor %}
    {{- ']' + eos_token }}
  {%- elif message.role == 'assistant' %}
    {{- ' ' + message.content + eos_token }}
  {%- elif message.role == 'tool' %}
    {{- '[TOOL_RESULTS] ' + ({'content': message.content} | tojson) + '[/TOOL_RESULTS]' }}
  {%- endif %}
{%- endfor %}
"""
"""No generation prompt: a reply follows ``[/INST]`` directly."""

_GEMMA = r"""
{{- bos_token }}
{%- set pending = namespace(text=((system | trim) + '\n\n') if system else '') %}
{%- if tools %}
  {%- set pending.text = pending.text + 'You can call these functions; to call one, reply with {"name": ..., "arguments": ...}:\n' %}
  {%- for tool in tools %}
    {%- set pending.text = pending.text + (tool | tojson) + '\n' %}
  {%- endfor %}
  {%- set pending.text = pending.text + '\n' %}
{%- endif %}
{%- for message in rest %}
  {%- if message.role == 'assistant' %}
    {{- '<start_of_turn>model\n' }}
  {%- else %}
    {{- '<start_of_turn>user\n' + pending.text }}
    {%- set pending.text = '' %}
  {%- endif %}
  {%- if message.role == 'tool' %}
    {{- 'The function ' + (message.name or 'called') + ' returned: ' }}
  {%- endif %}
  {%- if message.tool_calls %}
    {%- for call in message.tool_calls %}
      {{- ('' if loop.first else '\n') + call_json(call) }}
    {%- endfor %}
  {%- else %}
    {{- message.content | trim }}
  {%- endif %}
  {{- '<end_of_turn>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
  {{- '<start_of_turn>model\n' }}
{%- endif %}
"""
"""The system text (and the tools) open the first user turn; a tool's result is a user turn."""

_PHI3 = r"""
{%- if system or tools %}
  {{- '<|system|>\n' + system }}
  {%- if tools %}
    {{- '<|tool|>' + (tools | tojson) + '<|/tool|>' }}
  {%- endif %}
  {{- '<|end|>\n' }}
{%- endif %}
{%- for message in rest %}
  {%- if message.role == 'tool' %}
    {{- '<|user|>\n' + message.content + '<|end|>\n' }}
  {%- else %}
    {{- '<|' + message.role + '|>\n' + message.content }}
    {%- if message.tool_calls %}
      {{- '<|tool_call|>[' }}
      {%- for call in message.tool_calls %}
        {{- ('' if loop.first else ', ') + call_json(call) }}
      {%- endfor %}
      {{- ']<|/tool_call|>' }}
    {%- endif %}
    {{- '<|end|>\n' }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
  {{- '<|assistant|>\n' }}
{%- endif %}
"""

_SMOLLM = (
    r"""
{%- set default_system = 'You are a small, helpful assistant.' %}
"""
    + _CHATML_SYSTEM
    + r"""
{%- for message in rest %}
  {%- if message.role == 'assistant' %}
    {{- '<|im_start|>assistant\n' }}
    {%- generation %}
      {{- message.content }}
"""
    + _CHATML_CALLS
    + r"""
      {{- '<|im_end|>' }}
    {%- endgeneration %}
    {{- '\n' }}
  {%- else %}
    {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
  {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""
)
"""ChatML with every reply and its ``<|im_end|>`` between generation markers (TRL's assistant masks)."""

_GPT_OSS = r"""
{{- '<|start|>system<|message|>You are a helpful assistant.\nReasoning: medium\n\n' }}
{{- '# Valid channels: analysis, commentary, final. Every message names its channel.' }}
{%- if tools %}
  {{- '\nFunction calls go to the commentary channel.' }}
{%- endif %}
{{- '<|end|>' }}
{%- if system or tools %}
  {{- '<|start|>developer<|message|>' }}
  {%- if system %}
    {{- '# Instructions\n\n' + system }}
  {%- endif %}
  {%- if tools %}
    {{- ('\n\n' if system else '') + '# Tools\n\n## functions' }}
    {%- for tool in tools %}
      {%- set f = tool.function if tool.function is defined else tool %}
      {{- '\n\n' + (f.description or f.name) + '\n' + f.name + ': ' + (f.parameters | tojson) }}
    {%- endfor %}
  {%- endif %}
  {{- '<|end|>' }}
{%- endif %}
{%- set called = namespace(name='tool') %}
{%- for message in rest %}
  {%- if message.role == 'assistant' and message.tool_calls %}
    {%- for call in message.tool_calls %}
      {%- set f = call.function if call.function is defined else call %}
      {%- set called.name = f.name %}
      {{- '<|start|>assistant<|channel|>commentary to=functions.' + f.name + ' <|constrain|>json<|message|>' }}
      {{- (f.arguments if f.arguments is string else (f.arguments | tojson)) + '<|call|>' }}
    {%- endfor %}
  {%- elif message.role == 'assistant' %}
    {{- '<|start|>assistant<|channel|>final<|message|>' + message.content }}
    {{- '<|return|>' if loop.last and not add_generation_prompt else '<|end|>' }}
  {%- elif message.role == 'tool' %}
    {{- '<|start|>functions.' + (message.name or called.name) + ' to=assistant<|channel|>commentary<|message|>' }}
    {{- message.content + '<|end|>' }}
  {%- else %}
    {{- '<|start|>' + message.role + '<|message|>' + message.content + '<|end|>' }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
  {{- '<|start|>assistant' }}
{%- endif %}
"""
"""Harmony-like: the last reply of a finished conversation ends in ``<|return|>``, earlier ones in ``<|end|>``."""

_PLAIN = r"""
{%- if system %}
  {{- 'System: ' + system + '\n' }}
{%- endif %}
{%- for tool in tools or [] %}
  {{- 'Function: ' + (tool | tojson) + '\n' }}
{%- endfor %}
{%- for message in rest %}
  {%- if message.role == 'assistant' %}
    {{- 'Assistant: ' + message.content }}
    {%- for call in message.tool_calls or [] %}
      {{- ('' if loop.first and not message.content else ' ') + 'call ' + call_json(call) }}
    {%- endfor %}
    {{- '\n' }}
  {%- elif message.role == 'tool' %}
    {{- 'Result: ' + message.content + '\n' }}
  {%- else %}
    {{- 'User: ' + message.content + '\n' }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
  {{- 'Assistant:' }}
{%- endif %}
"""


@dataclass(frozen=True)
class Family:
    """One template family: its template, its control tokens (special in the tokenizer) and which are bos, eos and
    pad, and the architecture of its tiny model."""

    template: str
    specials: tuple[str, ...]
    eos: str
    pad: str
    bos: str | None = None
    architecture: str = "llama"  # or "qwen2"


_CHATML_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

SPECS: dict[str, Family] = {
    "llama3": Family(
        _jinja(_CALL_JSON + _SPLIT_SYSTEM + _LLAMA3),
        (
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|finetune_right_pad_id|>",
        ),
        eos="<|eot_id|>",
        pad="<|finetune_right_pad_id|>",
        bos="<|begin_of_text|>",
    ),
    "qwen2.5": Family(
        _jinja(_CALL_JSON + _SPLIT_SYSTEM + _QWEN25),
        _CHATML_TOKENS,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        architecture="qwen2",
    ),
    "qwen3": Family(
        _jinja(_CALL_JSON + _SPLIT_SYSTEM + _QWEN3),
        (*_CHATML_TOKENS, "<think>", "</think>"),
        eos="<|im_end|>",
        pad="<|endoftext|>",
        architecture="qwen2",
    ),
    "mistral": Family(
        _jinja(_CALL_JSON + _SPLIT_SYSTEM + _MISTRAL),
        (
            "<unk>",
            "<s>",
            "</s>",
            "[INST]",
            "[/INST]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_CALLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        ),
        eos="</s>",
        pad="<unk>",
        bos="<s>",
    ),
    "gemma": Family(
        _jinja(_CALL_JSON + _SPLIT_SYSTEM + _GEMMA),
        ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"),
        eos="<end_of_turn>",
        pad="<pad>",
        bos="<bos>",
    ),
    "phi3": Family(
        _jinja(_CALL_JSON + _SPLIT_SYSTEM + _PHI3),
        (
            "<|endoftext|>",
            "<|system|>",
            "<|user|>",
            "<|assistant|>",
            "<|end|>",
            "<|tool|>",
            "<|/tool|>",
            "<|tool_call|>",
            "<|/tool_call|>",
        ),
        eos="<|end|>",
        pad="<|endoftext|>",
    ),
    "smollm": Family(
        _jinja(_CALL_JSON + _SPLIT_SYSTEM + _SMOLLM),
        _CHATML_TOKENS,
        eos="<|im_end|>",
        pad="<|im_end|>",  # as SmolLM2: pad is eos
        bos="<|im_start|>",
    ),
    "gpt-oss": Family(
        _jinja(_SPLIT_SYSTEM + _GPT_OSS),
        (
            "<|endoftext|>",
            "<|start|>",
            "<|message|>",
            "<|channel|>",
            "<|constrain|>",
            "<|end|>",
            "<|return|>",
            "<|call|>",
        ),
        eos="<|return|>",
        pad="<|endoftext|>",
    ),
    "plain": Family(
        _jinja(_CALL_JSON + _SPLIT_SYSTEM + _PLAIN), ("<|endoftext|>",), eos="<|endoftext|>", pad="<|endoftext|>"
    ),
}
"""Every family's template and tokens, by name."""

FAMILIES: tuple[str, ...] = tuple(SPECS)
TEMPLATES: dict[str, str] = {name: spec.template for name, spec in SPECS.items()}
GENERATION_MARKED: frozenset[str] = frozenset(
    name for name, spec in SPECS.items() if "{%- generation %}" in spec.template
)
PREFIX_UNSTABLE: frozenset[str] = frozenset({"gpt-oss"})
"""The families in which a conversation cut after an earlier reply renders differently from the whole: in gpt-oss
for every earlier reply that is not a tool call (those end in ``<|call|>`` wherever they are), so for every row of
:func:`conversations` with two replies or more but the tool row; qwen3 only for rows whose earlier reply reasons
(:data:`THINKING_CONVERSATION`)."""
VOCAB_SIZE = 512
"""What the BPE is trained to (its corpus is small: the vocabulary may end a little smaller)."""


def template(family: str) -> str:
    """The Jinja chat template of ``family``."""
    return SPECS[family].template


_WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city's name, e.g. Lyon"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}

_LONG_REPLY = (
    "Gradient accumulation splits one optimizer step into several micro-batches: each runs forward and backward, "
    "the gradients add up in place, and only after the last one are they clipped and applied. Dividing each "
    "micro-batch's loss by the tokens of the whole step keeps the update exactly that of the big batch."
)  # 300 characters

_ROWS: list[dict[str, Any]] = [
    {
        "messages": [
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris."},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "Explain gradient accumulation."},
            {"role": "assistant", "content": _LONG_REPLY},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "Is seven a prime number?"},
            {"role": "assistant", "content": "Yes"},
            {"role": "user", "content": "And nine?"},
            {"role": "assistant", "content": "No: nine is three times three."},
        ]
    },
    {
        "messages": [
            {"role": "system", "content": "You are a patient maths tutor."},
            {"role": "user", "content": "Count from one."},
            {"role": "assistant", "content": "one"},
            {"role": "user", "content": "Go on."},
            {"role": "assistant", "content": "two, three"},
            {"role": "user", "content": "Faster!"},
            {"role": "assistant", "content": "four five six seven eight nine ten"},
            {"role": "user", "content": "Why do we stop at ten?"},
            {"role": "assistant", "content": "We do not have to; ten is only where the fingers run out. " * 3},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "Traduis « bonjour » en japonais, s'il te plaît."},
            {"role": "assistant", "content": "« Bonjour » se dit こんにちは (konnichiwa) en japonais. 😊"},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "2 + 2 = ?"},
            {"role": "assistant", "content": "4"},
        ]
    },
    {
        "messages": [
            {"role": "system", "content": "You can look up the weather."},
            {"role": "user", "content": "What is the weather in Lyon right now?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Lyon"}}}
                ],
            },
            {
                "role": "tool",
                "name": "get_weather",
                "content": '{"temperature": 18, "unit": "celsius", "sky": "cloudy"}',
            },
            {"role": "assistant", "content": "It is 18 °C and cloudy in Lyon."},
        ],
        "tools": [_WEATHER_TOOL],
    },
    {
        "messages": [
            {"role": "user", "content": "Write a Python function that adds two numbers."},
            {
                "role": "assistant",
                "content": "```python\ndef add(a, b):\n    return a + b\n```\nCall it as `add(2, 3)`.",
            },
        ]
    },
    {
        "messages": [
            {"role": "system", "content": "Reply politely."},
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "Hello! How can I help you today?"},
            {"role": "user", "content": "Nothing, thanks."},
            {"role": "assistant", "content": "You are welcome."},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "한국어로 인사해 줘. 그리고 中文也可以吗？"},
            {"role": "assistant", "content": "안녕하세요! 当然可以：你好！"},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue"},
            {"role": "user", "content": "Another one, and say why you like it."},
            {"role": "assistant", "content": "Green, because it is the colour of spring leaves and of calm."},
            {"role": "user", "content": "One more?"},
            {"role": "assistant", "content": "Ochre."},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "Summarise: the cat sat on the mat, then slept in the sun all afternoon."},
            {"role": "assistant", "content": "A cat sat on a mat and napped in the sun."},
        ]
    },
]

THINKING_CONVERSATION: dict[str, Any] = {
    "messages": [
        {"role": "user", "content": "What is 17 times 3?"},
        {"role": "assistant", "content": "<think>\n17 times 3 is 30 plus 21.\n</think>\n\n51"},
        {"role": "user", "content": "And 17 times 4?"},
        {"role": "assistant", "content": "<think>\nAdd 17 to 51.\n</think>\n\n68"},
    ]
}
"""Replies that reason in ``<think>`` tags: qwen3 keeps the first reply's reasoning when the conversation ends
after it and drops it from the whole (a strict prefix check refuses this row in qwen3)."""


def conversations() -> list[dict[str, Any]]:
    """Twelve rows of chat data (fresh copies): with and without a system message, one to four replies each of
    very uneven length (one word to 300 characters), unicode (French, Japanese, Korean, Chinese, an emoji), code,
    and one row with ``tools`` (one function schema) whose reply calls it (``tool_calls``) before a ``tool``
    message answers. No row reasons in ``<think>`` tags: see :data:`THINKING_CONVERSATION` for that."""
    return json.loads(json.dumps(_ROWS))


_EXTRA_TEXT = [
    "system user assistant model tool developer System: User: Assistant: Result: Function: ",
    "You are a helpful assistant. You are a small, helpful assistant. Reasoning: medium",
    "The quick brown fox jumps over the lazy dog. The function returned: the answer is 42.",
    "Hello there, how are you? I am fine, thank you. Be brief. hello there how are you",
]


@cache
def _tokenizer_json(family: str) -> str:
    """The trained tokenizer of ``family`` as JSON text (trained once per process: the corpus is fixed)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECS[family].specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [json.dumps(row, ensure_ascii=False) for row in _ROWS + [THINKING_CONVERSATION]]
    corpus += [str(m.get("content") or "") for row in _ROWS for m in row["messages"]]
    tokenizer.train_from_iterator((corpus + _EXTRA_TEXT) * 2, trainer=trainer)
    return tokenizer.to_str()


def vocab_size(family: str) -> int:
    """The size of ``family``'s vocabulary, special tokens included (the tiny model's ``vocab_size``)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_tokenizer_json(family)).get_vocab_size(with_added_tokens=True)


def chat_model_dir(directory: Path, family: str, with_model: bool = False) -> Path:
    """A chat-model directory of ``family`` in ``directory`` (made if missing), offline; returns ``directory``."""
    if family not in SPECS:
        raise ValueError(f"unknown chat family {family!r}; one of {', '.join(FAMILIES)}")
    spec = SPECS[family]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(_tokenizer_json(family), encoding="utf-8")
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": spec.template,
        "eos_token": spec.eos,
        "pad_token": spec.pad,
        "clean_up_tokenization_spaces": False,
    }
    if spec.bos is not None:
        config["bos_token"] = spec.bos
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
    if with_model:
        _tiny_model(directory, spec)
    return directory


def _tiny_model(directory: Path, spec: Family) -> None:
    import torch
    import transformers
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str((directory / "tokenizer.json").read_text(encoding="utf-8"))
    ids = {
        f"{name}_token_id": tokenizer.token_to_id(token)
        for name, token in (("bos", spec.bos), ("eos", spec.eos), ("pad", spec.pad))
        if token is not None
    }
    shape = {
        "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
        **ids,
    }
    config = transformers.AutoConfig.for_model(spec.architecture, **shape)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(directory))
