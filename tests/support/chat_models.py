"""Tiny chat-model directories built in the test, offline: a byte-level BPE ``tokenizer.json`` with the family's
special tokens, a ``tokenizer_config.json`` holding a chat template written here in the manner of that family's
format, and (``with_model``) a tiny random Qwen2 model (``config.json`` + ``model.safetensors``) for
``--model hf:DIR``.

The templates are this project's own Jinja, shaped like each family's conversation format (its headers, its
end-of-turn token, what its generation prompt is); ``smollm`` wraps replies in ``{% generation %}`` markers, the
others do not, and ``gpt-oss`` ends the last reply with another token than the earlier ones (so a prefix of a
conversation renders differently from the whole).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_CHATML_TOOLS = (
    "{%- if tools %}<|im_start|>system\n{{ system }}\n\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% else %}<|im_start|>system\n{{ system }}<|im_end|>\n{% endif %}"
)
_CHATML_BODY = (
    "{%- for m in rest %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{%- for call in m.tool_calls or [] %}<tool_call>{{ call | tojson }}</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_SPLIT_SYSTEM = (
    "{%- if messages and messages[0].role == 'system' %}{%- set system = messages[0].content %}"
    "{%- set rest = messages[1:] %}{%- else %}{%- set system = 'You are a helpful assistant.' %}"
    "{%- set rest = messages %}{%- endif %}"
)

TEMPLATES: dict[str, str] = {
    "llama3": (
        "<|begin_of_text|>{%- for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
        "{{ m.content | trim }}<|eot_id|>{%- endfor %}"
        "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    ),
    "qwen2.5": _SPLIT_SYSTEM + _CHATML_TOOLS + _CHATML_BODY,
    "qwen3": (  # earlier replies lose their reasoning; the last keeps it
        _SPLIT_SYSTEM + "{%- set ns = namespace(last_user=0) %}{%- for m in rest %}{%- if m.role == 'user' %}"
        "{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}<|im_start|>system\n{{ system }}<|im_end|>\n"
        "{%- for m in rest %}{%- if m.role == 'assistant' %}{%- set text = m.content %}"
        "{%- if loop.index0 < ns.last_user and '</think>' in text %}{%- set text = text.split('</think>')[-1] | trim %}"
        "{%- endif %}<|im_start|>assistant\n{{ text }}<|im_end|>\n"
        "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    "mistral": (
        "{{ bos_token }}{%- set ns = namespace(system='') %}{%- for m in messages %}"
        "{%- if m.role == 'system' %}{%- set ns.system = m.content + '\n\n' %}"
        "{%- elif m.role == 'user' %}[INST] {{ ns.system }}{{ m.content }} [/INST]{%- set ns.system = '' %}"
        "{%- elif m.role == 'assistant' %} {{ m.content }}{{ eos_token }}{%- endif %}{%- endfor %}"
    ),
    "gemma": (
        "{{ bos_token }}{%- set ns = namespace(system='') %}{%- for m in messages %}"
        "{%- if m.role == 'system' %}{%- set ns.system = m.content + '\n\n' %}"
        "{%- else %}<start_of_turn>{{ 'model' if m.role == 'assistant' else 'user' }}\n{{ ns.system }}"
        "{{ m.content | trim }}<end_of_turn>\n{% set ns.system = '' %}{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
    ),
    "phi3": (
        "{%- for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}"
        "{%- if add_generation_prompt %}<|assistant|>\n{% endif %}"
    ),
    "smollm": (
        "{%- for m in messages %}{%- if m.role == 'assistant' %}<|im_start|>assistant\n"
        "{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}\n"
        "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    "gpt-oss": (
        "{%- for m in messages %}{%- if m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>"
        "{{ m.content }}{{ '<|return|>' if loop.last and not add_generation_prompt else '<|end|>' }}"
        "{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
    ),
    "plain": (
        "{%- for m in messages %}{{ m.role | capitalize }}: {{ m.content }}\n{% endfor %}"
        "{%- if add_generation_prompt %}Assistant:{%- endif %}"
    ),
}
FAMILIES: tuple[str, ...] = tuple(TEMPLATES)
GENERATION_MARKED: frozenset[str] = frozenset({"smollm"})

SPECIAL: dict[str, dict[str, Any]] = {  # special tokens, and which are bos / eos
    "llama3": {
        "tokens": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "bos": "<|begin_of_text|>",
        "eos": "<|eot_id|>",
    },
    "qwen2.5": {"tokens": ["<|im_start|>", "<|im_end|>"], "eos": "<|im_end|>"},
    "qwen3": {"tokens": ["<|im_start|>", "<|im_end|>"], "eos": "<|im_end|>"},
    "mistral": {"tokens": ["<s>", "</s>", "[INST]", "[/INST]"], "bos": "<s>", "eos": "</s>"},
    "gemma": {"tokens": ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], "bos": "<bos>", "eos": "<eos>"},
    "phi3": {"tokens": ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"], "eos": "<|end|>"},
    "smollm": {"tokens": ["<|im_start|>", "<|im_end|>"], "eos": "<|im_end|>"},
    "gpt-oss": {"tokens": ["<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|return|>"], "eos": "<|return|>"},
    "plain": {"tokens": [], "eos": "<|endoftext|>"},
}


def template(family: str) -> str:
    return TEMPLATES[family]


def conversations() -> list[dict[str, Any]]:
    """Rows of chat data: system or not, one to four assistant turns of very uneven length, unicode, and one row
    with tools and a tool-calling turn."""
    long_reply = "Here is a longer answer, with several clauses, commas, and numbers 1, 2, 3. " * 4
    rows: list[dict[str, Any]] = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"}]},
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "How are you?"},
                {"role": "assistant", "content": "Fine."},
                {"role": "user", "content": "And now?"},
                {"role": "assistant", "content": long_reply.strip()},
            ]
        },
        {"messages": [{"role": "user", "content": "Say yes."}, {"role": "assistant", "content": "yes"}]},
        {
            "messages": [
                {"role": "user", "content": "Café, naïve, 日本語?"},
                {"role": "assistant", "content": "Oui: café, naïve, 日本語."},
            ]
        },
        {
            "messages": [
                {"role": "user", "content": "Count."},
                {"role": "assistant", "content": "one"},
                {"role": "user", "content": "More."},
                {"role": "assistant", "content": "two three"},
                {"role": "user", "content": "More!"},
                {"role": "assistant", "content": "four five six"},
                {"role": "user", "content": "Last."},
                {"role": "assistant", "content": long_reply.strip()},
            ]
        },
        {
            "messages": [
                {"role": "system", "content": "You answer questions about the weather."},
                {"role": "user", "content": "Will it rain?"},
                {"role": "assistant", "content": "Probably not today, but take an umbrella tomorrow."},
            ]
        },
        {
            "messages": [
                {"role": "user", "content": "What is the weather in Paris?"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
                    ],
                },
                {"role": "tool", "content": "sunny, 21 C"},
                {"role": "assistant", "content": "It is sunny and 21 C in Paris."},
            ],
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "description": "the weather",
                        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                    },
                }
            ],
        },
    ]
    return rows


def _corpus() -> list[str]:
    texts = []
    for row in conversations():
        texts.extend(str(m.get("content") or "") for m in row["messages"])
    texts += ["system user assistant model tool Be brief hello there how are you I am fine thank you"] * 4
    return texts * 3


def chat_model_dir(directory: Path, family: str, with_model: bool = False) -> Path:
    """A chat-model directory of ``family`` in ``directory`` (made if missing), offline; returns ``directory``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    spec = SPECIAL[family]
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", *(t for t in spec["tokens"] if t != "<|endoftext|>")]
    trainer = trainers.BpeTrainer(
        vocab_size=480,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": TEMPLATES[family],
        "eos_token": spec["eos"],
        "pad_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": False,
    }
    if "bos" in spec:
        config["bos_token"] = spec["bos"]
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    if with_model:
        _tiny_model(directory, tokenizer.get_vocab_size(with_added_tokens=True))
    return directory


def _tiny_model(directory: Path, vocab_size: int) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    transformers.Qwen2ForCausalLM(config).save_pretrained(str(directory))
