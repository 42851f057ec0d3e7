"""Real chat templates, byte for byte, and tiny offline tokenizer directories laid out as the real models ship them.

:mod:`chat_models` holds this project's look-alike templates; this module holds what models really ship, so that
tests meet the real behaviours (default system prompts injected, date lines, replies trimmed or not, reasoning
dropped from earlier turns, tool calls silently dropped, eos appended, templates that raise).

* ``real_chat/templates/*.jinja``: byte-exact copies of the templates (sources and sha256 in
  ``real_chat/PROVENANCE.md``); :func:`template_text` reads one.
* ``real_chat/trl_training/*.jinja``: TRL's patched copies with ``{% generation %}`` markers
  (:data:`TRAINING_TEMPLATE`), a cross-check for a benchmark, never the trained truth.
* :func:`real_chat_dir` writes a tokenizer directory that ``AutoTokenizer.from_pretrained(dir,
  local_files_only=True)`` loads: ``tokenizer.json`` (a vocabulary of a few hundred tokens trained here on
  :data:`_CORPUS`) and ``tokenizer_config.json`` with the family's real ``tokenizer_class``, special tokens and
  flags; the template sits in ``tokenizer_config.json`` or, where the real repo ships it so, in
  ``chat_template.jinja``. Three layouts: ``spm`` (SentencePiece-like BPE: Metaspace "first", byte fallback; for
  ``LlamaTokenizer`` transformers rebuilds the pipeline from the vocabulary, as it does for the real files),
  ``bytelevel`` (GPT-2 style byte-level BPE; DeepSeek's ``LlamaTokenizerFast`` over it makes transformers warn and
  load ``TokenizersBackend``, as the real files do) and ``gemma`` (spaces replaced by ``▁``, byte fallback).
* :data:`CONVERSATIONS`: named rows as users bring them (:func:`conversations` returns fresh copies);
  :data:`TEMPLATE_REFUSES`: the (family, row) pairs a template itself refuses, and why;
  :data:`HAND_MARKED`: the trained spans of a rendering, marked by hand (see its docstring for the rule).

Control tokens are special, one id each, only where the real model has them so: Llama-2's ``[INST]``/``<<SYS>>``
and Zephyr's ``<|user|>``/``<|assistant|>`` are plain text in the real vocabularies and stay plain text here.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

REAL_CHAT = Path(__file__).parent / "real_chat"
TEMPLATES_DIR = REAL_CHAT / "templates"
TRL_TRAINING_DIR = REAL_CHAT / "trl_training"


@dataclass(frozen=True)
class RealFamily:
    """One real template and the tokenizer files of a model that ships it."""

    template_file: str
    model: str  # the Hugging Face repo that ships the template (one of them)
    layout: str  # "spm", "bytelevel" or "gemma"
    tokenizer_class: str
    base: tuple[str, ...]  # special tokens at the start of the vocabulary (ids 0, 1, ...)
    controls: tuple[str, ...] = ()  # further special tokens the template writes, added after the vocabulary
    bos: str | None = None
    eos: str | None = None
    pad: str | None = None
    unk: str | None = None
    extra: tuple[tuple[str, Any], ...] = ()  # further tokenizer_config.json entries, as the real file has them
    jinja_file: bool = False  # the template ships as chat_template.jinja rather than inside tokenizer_config.json
    bos_post_processor: bool = False  # tokenizer.json's post-processor adds bos (real Llama-3, DeepSeek files)

    @property
    def specials(self) -> tuple[str, ...]:
        """Every special token of the directory: each encodes to one id."""
        return self.base + self.controls


_SPM = ("<unk>", "<s>", "</s>")
_LLAMA_SPM: tuple[tuple[str, Any], ...] = (
    ("add_bos_token", True),
    ("add_eos_token", False),
    ("legacy", False),
    ("sp_model_kwargs", {}),
    ("spaces_between_special_tokens", False),
    ("clean_up_tokenization_spaces", False),
    ("use_default_system_prompt", False),
)
_LLAMA3 = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
_LLAMA31 = (*_LLAMA3, "<|finetune_right_pad_id|>", "<|eom_id|>", "<|python_tag|>")
_LLAMA3_CONFIG: tuple[tuple[str, Any], ...] = (
    ("clean_up_tokenization_spaces", True),
    ("model_input_names", ["input_ids", "attention_mask"]),
)
_CHATML = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_QWEN_CONFIG: tuple[tuple[str, Any], ...] = (
    ("add_prefix_space", False),
    ("errors", "replace"),
    ("split_special_tokens", False),
    ("clean_up_tokenization_spaces", False),
)
_PHI3 = ("<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>")
_DEEPSEEK = (
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
    "<｜tool▁sep｜>",
)
_GEMMA = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")
_GEMMA_CONFIG: tuple[tuple[str, Any], ...] = (
    ("add_bos_token", True),
    ("add_eos_token", False),
    ("sp_model_kwargs", {}),
    ("spaces_between_special_tokens", False),
    ("use_default_system_prompt", False),
)


def _spm(template: str, model: str, controls: tuple[str, ...], eos: str = "</s>", **kw: Any) -> RealFamily:
    return RealFamily(template, model, "spm", "LlamaTokenizer", _SPM, controls, bos="<s>", eos=eos, unk="<unk>", **kw)


# fmt: off
SPECS: dict[str, RealFamily] = {
    "llama2": _spm("llama2.jinja", "meta-llama/Llama-2-7b-chat-hf", (), extra=_LLAMA_SPM),
    "llama3": RealFamily(
        "llama3.jinja", "meta-llama/Meta-Llama-3-8B-Instruct", "bytelevel", "PreTrainedTokenizerFast", (), _LLAMA3,
        bos="<|begin_of_text|>", eos="<|eot_id|>", extra=_LLAMA3_CONFIG, bos_post_processor=True),
    "llama3.1": RealFamily(
        "llama3_1.jinja", "meta-llama/Llama-3.1-8B-Instruct", "bytelevel", "PreTrainedTokenizerFast", (), _LLAMA31,
        bos="<|begin_of_text|>", eos="<|eot_id|>", extra=_LLAMA3_CONFIG, bos_post_processor=True),
    "llama3.2": RealFamily(
        "llama3_2.jinja", "meta-llama/Llama-3.2-1B-Instruct", "bytelevel", "PreTrainedTokenizerFast", (), _LLAMA31,
        bos="<|begin_of_text|>", eos="<|eot_id|>", extra=_LLAMA3_CONFIG, bos_post_processor=True),
    "mistral-v0.3": _spm(
        "mistral_v0_3.jinja", "mistralai/Mistral-7B-Instruct-v0.3",
        ("[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
         "[/TOOL_RESULTS]"),
        extra=_LLAMA_SPM),
    "gemma": RealFamily(
        "gemma.jinja", "google/gemma-2-2b-it", "gemma", "GemmaTokenizer", _GEMMA, ("<start_of_turn>", "<end_of_turn>"),
        bos="<bos>", eos="<eos>", pad="<pad>", unk="<unk>", extra=_GEMMA_CONFIG, bos_post_processor=True),
    "gemma3": RealFamily(
        "gemma3.jinja", "google/gemma-3-1b-it", "gemma", "GemmaTokenizer", _GEMMA,
        ("<start_of_turn>", "<end_of_turn>", "<start_of_image>"),
        bos="<bos>", eos="<eos>", pad="<pad>", unk="<unk>", extra=_GEMMA_CONFIG, bos_post_processor=True),
    "phi3": _spm("phi3.jinja", "microsoft/Phi-3-mini-4k-instruct", _PHI3, eos="<|endoftext|>", pad="<|endoftext|>",
                 extra=_LLAMA_SPM),
    "phi3.5": _spm("phi3_5.jinja", "microsoft/Phi-3.5-mini-instruct", _PHI3, eos="<|endoftext|>",
                   pad="<|endoftext|>", extra=_LLAMA_SPM),
    "qwen2.5": RealFamily(
        "qwen2_5.jinja", "Qwen/Qwen2.5-7B-Instruct", "bytelevel", "Qwen2Tokenizer", (),
        (*_CHATML, "<tool_call>", "</tool_call>"), eos="<|im_end|>", pad="<|endoftext|>", extra=_QWEN_CONFIG),
    "qwen3": RealFamily(
        "qwen3.jinja", "Qwen/Qwen3-8B", "bytelevel", "Qwen2Tokenizer", (),
        (*_CHATML, "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"),
        eos="<|im_end|>", pad="<|endoftext|>", extra=_QWEN_CONFIG),
    "deepseek-v3": RealFamily(
        "deepseekv3.jinja", "deepseek-ai/DeepSeek-V3", "bytelevel", "LlamaTokenizerFast", (), _DEEPSEEK,
        bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>", pad="<｜end▁of▁sentence｜>",
        extra=(("add_bos_token", False), ("add_eos_token", False), ("legacy", True)), bos_post_processor=True),
    "deepseek-r1-distill": RealFamily(
        "deepseek_r1_distill.jinja", "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", "bytelevel", "LlamaTokenizerFast", (),
        (*_DEEPSEEK, "<think>", "</think>"),
        bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>", pad="<｜end▁of▁sentence｜>",
        extra=(("add_bos_token", True), ("add_eos_token", False), ("legacy", True)), bos_post_processor=True),
    "gpt-oss": RealFamily(
        "gptoss.jinja", "openai/gpt-oss-20b", "bytelevel", "PreTrainedTokenizerFast", (),
        ("<|startoftext|>", "<|endoftext|>", "<|start|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|end|>",
         "<|return|>", "<|call|>"),
        bos="<|startoftext|>", eos="<|return|>", pad="<|endoftext|>",
        extra=(("model_input_names", ["input_ids", "attention_mask"]),), jinja_file=True),
    "smollm2": RealFamily(
        "smollm2.jinja", "HuggingFaceTB/SmolLM2-135M-Instruct", "bytelevel", "GPT2Tokenizer", _CHATML, (),
        bos="<|im_start|>", eos="<|im_end|>", pad="<|im_end|>", unk="<|endoftext|>",
        extra=(("add_prefix_space", False), ("clean_up_tokenization_spaces", False),
               ("additional_special_tokens", ["<|im_start|>", "<|im_end|>"]))),
    "zephyr": _spm("zephyr.jinja", "HuggingFaceH4/zephyr-7b-beta", (), pad="</s>",
                   extra=(*_LLAMA_SPM[:2], ("legacy", True), *_LLAMA_SPM[3:6], ("use_default_system_prompt", True))),
    "chatml-no-prompt": _spm(
        "chatml_no_generation_prompt.jinja",
        "community ChatML fine-tunes (tokenizer files as teknium/OpenHermes-2.5-Mistral-7B)",
        ("<|im_start|>", "<|im_end|>"), eos="<|im_end|>", extra=_LLAMA_SPM),
}
# fmt: on
"""Every family: its template file, the model whose files the directory copies, and those files' settings."""

FAMILIES: tuple[str, ...] = tuple(SPECS)
TRAINING_TEMPLATE: dict[str, str] = {
    family: spec.template_file.replace(".jinja", "_training.jinja")
    for family, spec in SPECS.items()
    if (TRL_TRAINING_DIR / spec.template_file.replace(".jinja", "_training.jinja")).is_file()
}
"""Family -> file name in ``real_chat/trl_training/`` of TRL's generation-marked copy of its template."""


def template_text(family: str) -> str:
    """The byte-exact template of ``family``, decoded as UTF-8."""
    return (TEMPLATES_DIR / SPECS[family].template_file).read_bytes().decode("utf-8")


def training_template_text(family: str) -> str:
    """TRL's ``{% generation %}``-marked copy of ``family``'s template (a cross-check, not the truth)."""
    return (TRL_TRAINING_DIR / TRAINING_TEMPLATE[family]).read_bytes().decode("utf-8")


_WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city's name, e.g. Lyon"}},
            "required": ["city"],
        },
    },
}
_CODE_REPLY = "```python\ndef add(a, b):\n    return a + b\n```\nCall it as `add(2, 3)`."

CONVERSATIONS: dict[str, dict[str, Any]] = {
    "single": {
        "messages": [
            {"role": "user", "content": "Traduis « bonjour » en japonais, s'il te plaît."},
            {"role": "assistant", "content": "« Bonjour » se dit こんにちは (konnichiwa)."},
        ]
    },
    "multi": {
        "messages": [
            {"role": "user", "content": "Write a Python function that adds two numbers."},
            {"role": "assistant", "content": _CODE_REPLY},
            {"role": "user", "content": "“函数”用英语怎么说？"},
            {"role": "assistant", "content": "“函数”就是 function。"},
            {"role": "user", "content": "And a word with an accent?"},
            {"role": "assistant", "content": "  Café, with the accent kept.  "},  # leading and trailing spaces
        ]
    },
    "system": {
        "messages": [
            {"role": "system", "content": "You are a terse assistant. Réponds brièvement."},
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And of Japan? 日本の首都は？"},
            {"role": "assistant", "content": "東京 (Tokyo)."},
        ]
    },
    "tools": {
        "messages": [
            {"role": "user", "content": "What is the weather in Lyon right now?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call0Lyon",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Lyon"}},
                    }
                ],
            },
            {
                "role": "tool",
                "tool_call_id": "call0Lyon",
                "name": "get_weather",
                "content": '{"temperature": 18, "sky": "cloudy"}',
            },
            {"role": "assistant", "content": "It is 18 °C and cloudy in Lyon."},
        ],
        "tools": [_WEATHER_TOOL],
    },
    "reasoning": {
        "messages": [
            {"role": "user", "content": "What is 17 × 3?"},
            {"role": "assistant", "reasoning_content": "17 × 3 = 30 + 21.", "content": "51"},
            {"role": "user", "content": "And 17 × 4?"},
            {"role": "assistant", "reasoning_content": "Add 17 to 51.", "content": "68"},
        ]
    },
    "reasoning_inline": {
        "messages": [
            {"role": "user", "content": "What is 17 × 3?"},
            {"role": "assistant", "content": "<think>\n17 × 3 = 30 + 21.\n</think>\n\n51"},
            {"role": "user", "content": "And 17 × 4?"},
            {"role": "assistant", "content": "<think>\nAdd 17 to 51.\n</think>\n\n68"},
        ]
    },
    "assistant_first": {
        "messages": [
            {"role": "assistant", "content": "Bonjour ! How can I help?"},
            {"role": "user", "content": "Say hello in Korean."},
            {"role": "assistant", "content": "안녕하세요!"},
        ]
    },
}
"""Rows as users bring them (OpenAI-style messages; ``tools`` a list of function schemas): accents, CJK, code with
newlines, a reply with leading and trailing spaces, a tool call with empty ``content`` and a 9-character id, reasoning
in ``reasoning_content`` and inline in ``<think>`` tags, and a conversation opened by the assistant."""


def conversations() -> dict[str, dict[str, Any]]:
    """Fresh deep copies of :data:`CONVERSATIONS` (templates and tests may mutate what they get)."""
    return copy.deepcopy(CONVERSATIONS)


def render(tokenizer: Any, name: str, add_generation_prompt: bool = False, messages: int | None = None) -> str:
    """The text ``tokenizer``'s template renders for row ``name`` (its first ``messages`` messages)."""
    row = conversations()[name]
    text = tokenizer.apply_chat_template(
        row["messages"][:messages], tools=row.get("tools"), add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert isinstance(text, str)
    return text


_CORPUS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog. You are a helpful assistant. Today Date: 26 Jul 2024",
    "system user assistant model tool ipython developer functions commentary final analysis json",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i)  # a comment\n",
    '{"name": "get_weather", "arguments": {"city": "Lyon"}, "parameters": {"type": "object"}}',
    "Bonjour, ça va ? Très bien, merci. Où est la gare ? Réponds brièvement. Café crème.",
    "日本の首都は東京です。こんにちは。你好，世界！函数就是 function。안녕하세요! 감사합니다.",
    "Cutting Knowledge Date: December 2023. Reasoning: medium. # Valid channels: analysis, commentary, final.",
)


def _corpus() -> list[str]:
    texts = list(_CORPUS)
    for row in CONVERSATIONS.values():
        texts.append(json.dumps(row, ensure_ascii=False))
        texts += [str(m.get(k) or "") for m in row["messages"] for k in ("content", "reasoning_content")]
    return texts * 3


VOCAB_SIZE = 600
"""What each BPE is trained to (the corpus is small: the vocabulary may end smaller)."""


PLAIN_TAGS = frozenset({"<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"})


@cache
def _tokenizer_json(family: str) -> str:
    """``family``'s trained ``tokenizer.json`` (trained once per process: the corpus is fixed)."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    spec = SPECS[family]
    if spec.layout == "bytelevel":
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tokenizer.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        fallback: list[str] = []
    else:
        tokenizer = Tokenizer(models.BPE(unk_token=spec.unk, byte_fallback=True, fuse_unk=True))
        if spec.layout == "spm":  # train on words; the saved pipeline does not split (as SentencePiece's)
            tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
        else:
            tokenizer.normalizer = normalizers.Replace(" ", "▁")
            tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("▁"), behavior="merged_with_next")
        alphabet = []
        fallback = [f"<0x{byte:02X}>" for byte in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[*spec.base, *fallback],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    if spec.layout == "spm":
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        tokenizer.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    elif spec.layout == "gemma":
        tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    # Qwen's and DeepSeek's reasoning and tool tags are added tokens but not special ones ("special": false in the
    # real files): one token each, yet text a message may hold
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec.controls if t in PLAIN_TAGS])
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in spec.controls if t not in PLAIN_TAGS]
    )
    if spec.layout == "spm" or spec.bos_post_processor:
        bos = spec.bos
        assert bos is not None
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.token_to_id(bos))]
        )
    elif spec.layout == "bytelevel":
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    data = json.loads(tokenizer.to_str())
    # The byte-fallback pieces are vocabulary, not added tokens (as in the real files).
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] not in fallback]
    return json.dumps(data, ensure_ascii=False, indent=2)


def _config(family: str) -> dict[str, Any]:
    spec = SPECS[family]
    vocab = json.loads(_tokenizer_json(family))
    config: dict[str, Any] = {
        "added_tokens_decoder": {
            str(t["id"]): {
                "content": t["content"],
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": t["special"],
            }
            for t in vocab["added_tokens"]
        },
        "bos_token": spec.bos,
        "eos_token": spec.eos,
        "pad_token": spec.pad,
        "unk_token": spec.unk,
        "model_max_length": 131072,
        "tokenizer_class": spec.tokenizer_class,
        **dict(spec.extra),
    }
    if not spec.jinja_file:
        config["chat_template"] = template_text(family)
    return config


def real_chat_dir(directory: Path, family: str) -> Path:
    """A tokenizer directory of ``family`` in ``directory`` (made if missing), offline; returns ``directory``."""
    if family not in SPECS:
        raise ValueError(f"unknown real chat family {family!r}; one of {', '.join(FAMILIES)}")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(_tokenizer_json(family), encoding="utf-8")
    config = json.dumps(_config(family), indent=2, ensure_ascii=False)
    (directory / "tokenizer_config.json").write_text(config, encoding="utf-8")
    if SPECS[family].jinja_file:  # bytes, not text: no newline translation
        (directory / "chat_template.jinja").write_bytes((TEMPLATES_DIR / SPECS[family].template_file).read_bytes())
    return directory


TEMPLATE_REFUSES: dict[tuple[str, str], str] = {
    ("llama2", "tools"): "roles must alternate user/assistant: a tool message breaks the alternation",
    ("llama2", "assistant_first"): "roles must alternate, starting with the user",
    ("gemma", "system"): "System role not supported",
    ("gemma", "tools"): "roles must alternate user/assistant: a tool message breaks the alternation",
    ("gemma", "assistant_first"): "roles must alternate, starting with the user",
    ("gemma3", "tools"): "roles must alternate user/assistant: a tool message breaks the alternation",
    ("gemma3", "assistant_first"): "roles must alternate, starting with the user",
    ("deepseek-v3", "tools"): "concatenates the tool call's arguments as a string: a dict of arguments is a TypeError",
}
"""The (family, row) pairs whose template raises (Jinja's ``raise_exception`` or a type error): every other pair of
:data:`FAMILIES` x :data:`CONVERSATIONS` renders."""

HAND_MARKED: dict[tuple[str, str], list[str]] = {
    # Llama-2-chat: no generation prompt (a reply follows "[/INST]" directly), so a span starts at the reply's own
    # content; the template writes " " + content.strip() + " " + eos: replies are stripped, "</s>" follows a space.
    # The system text goes into the first user turn between <<SYS>> tags; [INST]/<<SYS>> are plain text.
    ("llama2", "single"): ["« Bonjour » se dit こんにちは (konnichiwa). </s>"],
    ("llama2", "multi"): [
        "```python\ndef add(a, b):\n    return a + b\n```\nCall it as `add(2, 3)`. </s>",
        "“函数”就是 function。 </s>",
        "Café, with the accent kept. </s>",
    ],
    # Llama-3: every message (the reply too) is trimmed; bos written by the template (and again by the tokenizer's
    # post-processor if the rendered text is encoded with special tokens).
    ("llama3", "single"): ["« Bonjour » se dit こんにちは (konnichiwa).<|eot_id|>"],
    ("llama3", "multi"): [
        "```python\ndef add(a, b):\n    return a + b\n```\nCall it as `add(2, 3)`.<|eot_id|>",
        "“函数”就是 function。<|eot_id|>",
        "Café, with the accent kept.<|eot_id|>",
    ],
    # Llama-3.1: a system turn with "Cutting Knowledge Date ... Today Date: 26 Jul 2024" always; tools go into the
    # first user turn; a tool call renders as {"name", "parameters"} (not "arguments"), one call per reply; a tool
    # result that is a string is written through tojson (quoted again); reasoning_content is dropped.
    ("llama3.1", "single"): ["« Bonjour » se dit こんにちは (konnichiwa).<|eot_id|>"],
    ("llama3.1", "multi"): [
        "```python\ndef add(a, b):\n    return a + b\n```\nCall it as `add(2, 3)`.<|eot_id|>",
        "“函数”就是 function。<|eot_id|>",
        "Café, with the accent kept.<|eot_id|>",
    ],
    ("llama3.1", "system"): ["Paris.<|eot_id|>", "東京 (Tokyo).<|eot_id|>"],
    ("llama3.1", "tools"): [
        '{"name": "get_weather", "parameters": {"city": "Lyon"}}<|eot_id|>',
        "It is 18 °C and cloudy in Lyon.<|eot_id|>",
    ],
    ("llama3.1", "assistant_first"): ["Bonjour ! How can I help?<|eot_id|>", "안녕하세요!<|eot_id|>"],
    ("llama3.1", "reasoning"): ["51<|eot_id|>", "68<|eot_id|>"],
    # Llama-3.2: as 3.1, but "Today Date" is strftime_now("%d %b %Y"): the rendering changes with the day.
    ("llama3.2", "single"): ["« Bonjour » se dit こんにちは (konnichiwa).<|eot_id|>"],
    ("llama3.2", "multi"): [
        "```python\ndef add(a, b):\n    return a + b\n```\nCall it as `add(2, 3)`.<|eot_id|>",
        "“函数”就是 function。<|eot_id|>",
        "Café, with the accent kept.<|eot_id|>",
    ],
    # Mistral-7B-Instruct-v0.3 (the mid-2024 revision copied here): no generation prompt; a reply is
    # " " + content + " " + eos, untrimmed; the system message is dropped altogether (no branch renders it); tools
    # go before the last user turn; a tool call is "[TOOL_CALLS] [...] " + eos and its result is parsed JSON again.
    ("mistral-v0.3", "single"): ["« Bonjour » se dit こんにちは (konnichiwa). </s>"],
    ("mistral-v0.3", "multi"): [
        "```python\ndef add(a, b):\n    return a + b\n```\nCall it as `add(2, 3)`. </s>",
        "“函数”就是 function。 </s>",
        "  Café, with the accent kept.   </s>",
    ],
    ("mistral-v0.3", "system"): ["Paris. </s>", "東京 (Tokyo). </s>"],
    ("mistral-v0.3", "tools"): [
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Lyon"}, "id": "call0Lyon"}] </s>',
        "It is 18 °C and cloudy in Lyon. </s>",
    ],
    ("mistral-v0.3", "assistant_first"): ["Bonjour ! How can I help? </s>", "안녕하세요! </s>"],
    ("mistral-v0.3", "reasoning"): ["51 </s>", "68 </s>"],
    # Gemma (1 and 2): bos by the template; every message trimmed; no system role (raises), no tool role.
    ("gemma", "single"): ["« Bonjour » se dit こんにちは (konnichiwa).<end_of_turn>"],
    ("gemma", "multi"): [
        "```python\ndef add(a, b):\n    return a + b\n```\nCall it as `add(2, 3)`.<end_of_turn>",
        "“函数”就是 function。<end_of_turn>",
        "Café, with the accent kept.<end_of_turn>",
    ],
    # Gemma 3: as Gemma, but the system text opens the first user turn (followed by a blank line).
    ("gemma3", "single"): ["« Bonjour » se dit こんにちは (konnichiwa).<end_of_turn>"],
    ("gemma3", "multi"): [
        "```python\ndef add(a, b):\n    return a + b\n```\nCall it as `add(2, 3)`.<end_of_turn>",
        "“函数”就是 function。<end_of_turn>",
        "Café, with the accent kept.<end_of_turn>",
    ],
    # Phi-3: without the generation prompt the template appends eos ("<|endoftext|>") after the last "<|end|>\n":
    # not part of any span by the rule (it follows the newline). Tool messages and tool calls are dropped: the
    # calling reply renders as an empty turn, so its span is its "<|end|>" alone; two assistant turns then follow
    # each other. Replies untrimmed.
    ("phi3", "single"): ["« Bonjour » se dit こんにちは (konnichiwa).<|end|>"],
    ("phi3", "multi"): [
        "```python\ndef add(a, b):\n    return a + b\n```\nCall it as `add(2, 3)`.<|end|>",
        "“函数”就是 function。<|end|>",
        "  Café, with the accent kept.  <|end|>",
    ],
    ("phi3", "system"): ["Paris.<|end|>", "東京 (Tokyo).<|end|>"],
    # the calling reply renders as "" + <|end|>: the template drops its tool calls, so bigbatch trains none of it
    # (a lone end of turn would teach the model to stop without answering) and the audit counts the turn
    ("phi3", "tools"): ["It is 18 °C and cloudy in Lyon.<|end|>"],
    ("phi3", "assistant_first"): ["Bonjour ! How can I help?<|end|>", "안녕하세요!<|end|>"],
    ("phi3", "reasoning"): ["51<|end|>", "68<|end|>"],
    # Phi-3.5: as Phi-3 (an empty system message is skipped); eos appended likewise.
    ("phi3.5", "single"): ["« Bonjour » se dit こんにちは (konnichiwa).<|end|>"],
    ("phi3.5", "multi"): [
        "```python\ndef add(a, b):\n    return a + b\n```\nCall it as `add(2, 3)`.<|end|>",
        "“函数”就是 function。<|end|>",
        "  Café, with the accent kept.  <|end|>",
    ],
    # Qwen2.5: injects "You are Qwen, created by Alibaba Cloud. You are a helpful assistant." when the row has no
    # system message (with and without tools); a calling reply with empty content writes "<|im_start|>assistant"
    # then "\n<tool_call>...": the header is still "<|im_start|>assistant\n". Tool results become a user turn.
    ("qwen2.5", "single"): ["« Bonjour » se dit こんにちは (konnichiwa).<|im_end|>"],
    ("qwen2.5", "multi"): [
        "```python\ndef add(a, b):\n    return a + b\n```\nCall it as `add(2, 3)`.<|im_end|>",
        "“函数”就是 function。<|im_end|>",
        "  Café, with the accent kept.  <|im_end|>",
    ],
    ("qwen2.5", "system"): ["Paris.<|im_end|>", "東京 (Tokyo).<|im_end|>"],
    ("qwen2.5", "tools"): [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call><|im_end|>',
        "It is 18 °C and cloudy in Lyon.<|im_end|>",
    ],
    ("qwen2.5", "assistant_first"): ["Bonjour ! How can I help?<|im_end|>", "안녕하세요!<|im_end|>"],
    ("qwen2.5", "reasoning"): ["51<|im_end|>", "68<|im_end|>"],
    # Qwen3: no default system prompt; the LAST reply gets a think block, empty ("<think>\n\n</think>\n\n") when it
    # has no reasoning, while earlier replies (before the last user message) lose theirs: a conversation cut after
    # an earlier reply renders that reply differently than the whole does. Inline <think> is parsed out of content
    # as reasoning_content is (the two reasoning rows render alike). The calling reply (after the last user
    # message, not last, no reasoning) has no think block.
    ("qwen3", "single"): ["<think>\n\n</think>\n\n« Bonjour » se dit こんにちは (konnichiwa).<|im_end|>"],
    ("qwen3", "multi"): [
        "```python\ndef add(a, b):\n    return a + b\n```\nCall it as `add(2, 3)`.<|im_end|>",
        "“函数”就是 function。<|im_end|>",
        "<think>\n\n</think>\n\n  Café, with the accent kept.  <|im_end|>",
    ],
    ("qwen3", "system"): ["Paris.<|im_end|>", "<think>\n\n</think>\n\n東京 (Tokyo).<|im_end|>"],
    ("qwen3", "tools"): [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call><|im_end|>',
        "<think>\n\n</think>\n\nIt is 18 °C and cloudy in Lyon.<|im_end|>",
    ],
    ("qwen3", "assistant_first"): [
        "Bonjour ! How can I help?<|im_end|>",
        "<think>\n\n</think>\n\n안녕하세요!<|im_end|>",
    ],
    ("qwen3", "reasoning"): ["51<|im_end|>", "<think>\nAdd 17 to 51.\n</think>\n\n68<|im_end|>"],
    ("qwen3", "reasoning_inline"): ["51<|im_end|>", "<think>\nAdd 17 to 51.\n</think>\n\n68<|im_end|>"],
    # DeepSeek-V3: the generation prompt is "<｜Assistant｜><think>\n" but a rendered reply follows "<｜Assistant｜>"
    # alone: the prefilled "<think>\n" never appears in a finished conversation, so a span starts after
    # "<｜Assistant｜>". The system text is written bare after bos (no role marker). Everything up to "</think>" is cut
    # from a reply, keeping the "\n\n" after it; reasoning_content is ignored.
    ("deepseek-v3", "single"): ["« Bonjour » se dit こんにちは (konnichiwa).<｜end▁of▁sentence｜>"],
    ("deepseek-v3", "multi"): [
        "```python\ndef add(a, b):\n    return a + b\n```\nCall it as `add(2, 3)`.<｜end▁of▁sentence｜>",
        "“函数”就是 function。<｜end▁of▁sentence｜>",
        "  Café, with the accent kept.  <｜end▁of▁sentence｜>",
    ],
    # DeepSeek-R1-Distill: as V3 for plain replies; every reply's reasoning is dropped (reasoning_content ignored,
    # inline <think> cut). Tool calls are dropped whenever content is not None ("" included): the calling reply is
    # "<｜Assistant｜>" + eos. The reply after tool outputs has no "<｜Assistant｜>" at all: it follows
    # "<｜tool▁outputs▁end｜>" (which is also all the generation prompt writes after a tool message).
    ("deepseek-r1-distill", "single"): ["« Bonjour » se dit こんにちは (konnichiwa).<｜end▁of▁sentence｜>"],
    ("deepseek-r1-distill", "multi"): [
        "```python\ndef add(a, b):\n    return a + b\n```\nCall it as `add(2, 3)`.<｜end▁of▁sentence｜>",
        "“函数”就是 function。<｜end▁of▁sentence｜>",
        "  Café, with the accent kept.  <｜end▁of▁sentence｜>",
    ],
    ("deepseek-r1-distill", "system"): ["Paris.<｜end▁of▁sentence｜>", "東京 (Tokyo).<｜end▁of▁sentence｜>"],
    # the calling reply's tool calls are dropped: not trained (see phi3's tools)
    ("deepseek-r1-distill", "tools"): ["It is 18 °C and cloudy in Lyon.<｜end▁of▁sentence｜>"],
    ("deepseek-r1-distill", "assistant_first"): [
        "Bonjour ! How can I help?<｜end▁of▁sentence｜>",
        "안녕하세요!<｜end▁of▁sentence｜>",
    ],
    ("deepseek-r1-distill", "reasoning"): ["51<｜end▁of▁sentence｜>", "68<｜end▁of▁sentence｜>"],
    ("deepseek-r1-distill", "reasoning_inline"): ["\n\n51<｜end▁of▁sentence｜>", "\n\n68<｜end▁of▁sentence｜>"],
    # gpt-oss: the generation prompt is "<|start|>assistant" (no channel): a span starts with the channel. A system
    # turn with "Current date: " + strftime_now (changes daily) always; the row's system text becomes a developer
    # turn. The last reply ends in "<|return|>", earlier ones in "<|end|>", tool calls in "<|call|>": the same
    # reply renders differently cut there than in the whole. Only the last reply keeps its reasoning (transformers
    # hands reasoning_content to the template as "thinking"), written as a separate analysis message inside the
    # span, second "<|start|>assistant" included. Tool results go through tojson (a JSON string quoted again).
    ("gpt-oss", "single"): ["<|channel|>final<|message|>« Bonjour » se dit こんにちは (konnichiwa).<|return|>"],
    ("gpt-oss", "multi"): [
        "<|channel|>final<|message|>```python\ndef add(a, b):\n    return a + b\n```\nCall it as `add(2, 3)`.<|end|>",
        "<|channel|>final<|message|>“函数”就是 function。<|end|>",
        "<|channel|>final<|message|>  Café, with the accent kept.  <|return|>",
    ],
    ("gpt-oss", "system"): [
        "<|channel|>final<|message|>Paris.<|end|>",
        "<|channel|>final<|message|>東京 (Tokyo).<|return|>",
    ],
    ("gpt-oss", "tools"): [
        ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Lyon"}<|call|>',
        "<|channel|>final<|message|>It is 18 °C and cloudy in Lyon.<|return|>",
    ],
    ("gpt-oss", "assistant_first"): [
        "<|channel|>final<|message|>Bonjour ! How can I help?<|end|>",
        "<|channel|>final<|message|>안녕하세요!<|return|>",
    ],
    ("gpt-oss", "reasoning"): [
        "<|channel|>final<|message|>51<|end|>",
        "<|channel|>analysis<|message|>Add 17 to 51.<|end|><|start|>assistant<|channel|>final<|message|>68<|return|>",
    ],
    # SmolLM2: injects "You are a helpful AI assistant named SmolLM, trained by Hugging Face" when the first message
    # is not a system message (before an opening assistant message too); tool calls dropped, tool role kept.
    ("smollm2", "single"): ["« Bonjour » se dit こんにちは (konnichiwa).<|im_end|>"],
    ("smollm2", "multi"): [
        "```python\ndef add(a, b):\n    return a + b\n```\nCall it as `add(2, 3)`.<|im_end|>",
        "“函数”就是 function。<|im_end|>",
        "  Café, with the accent kept.  <|im_end|>",
    ],
    # Zephyr: eos ("</s>") closes every turn, user turns too; the generation prompt is "<|assistant|>\n" (only after
    # the last message); <|user|>/<|assistant|> are plain text, not tokens. Tool messages and calls are dropped.
    ("zephyr", "single"): ["« Bonjour » se dit こんにちは (konnichiwa).</s>"],
    ("zephyr", "multi"): [
        "```python\ndef add(a, b):\n    return a + b\n```\nCall it as `add(2, 3)`.</s>",
        "“函数”就是 function。</s>",
        "  Café, with the accent kept.  </s>",
    ],
    # ChatML that ignores add_generation_prompt: a prompt for generation ends with "<|im_end|>\n" and the model must
    # write "<|im_start|>assistant\n" itself; by the rule a span starts at the reply's content, so the header is not
    # trained. Tool calls dropped (the calling reply is an empty turn), tool role kept, reasoning_content dropped.
    ("chatml-no-prompt", "single"): ["« Bonjour » se dit こんにちは (konnichiwa).<|im_end|>"],
    ("chatml-no-prompt", "multi"): [
        "```python\ndef add(a, b):\n    return a + b\n```\nCall it as `add(2, 3)`.<|im_end|>",
        "“函数”就是 function。<|im_end|>",
        "  Café, with the accent kept.  <|im_end|>",
    ],
    ("chatml-no-prompt", "system"): ["Paris.<|im_end|>", "東京 (Tokyo).<|im_end|>"],
    # the calling reply's tool calls are dropped: not trained (see phi3's tools)
    ("chatml-no-prompt", "tools"): ["It is 18 °C and cloudy in Lyon.<|im_end|>"],
    ("chatml-no-prompt", "assistant_first"): ["Bonjour ! How can I help?<|im_end|>", "안녕하세요!<|im_end|>"],
    ("chatml-no-prompt", "reasoning"): ["51<|im_end|>", "68<|im_end|>"],
}
"""The trained spans of ``render(tokenizer, row)`` (the whole row, tools passed, no generation prompt), in order,
as text, marked by hand from the renderings: for each assistant message, a span starts right after the assistant
header that the template's generation prompt writes (where the template has no generation prompt, at the reply's
own content), holds everything the template writes for that reply (a think block, the content as written, its
tool calls) and ends with the end-of-turn token(s) that close it, never the newline after them nor the next turn's
header. A reply the template does not render has no span; one it renders empty is its end-of-turn token alone."""


def hand_mask(text: str, offsets: list[list[int]] | list[tuple[int, int]], spans: list[str]) -> list[int]:
    """The token mask of hand-marked trained texts over a tokenization (``offsets``: each token's characters) of the
    rendering ``text``: each span found after the one before, and every token that holds one of its characters
    trained (a SentencePiece token ``▁Hello`` holds the space the template writes before a reply, which the model
    writes too); position 0 is never a target."""
    mask, at = [0] * len(offsets), 0
    for span in spans:
        start = text.index(span, at)
        at = start + len(span)
        for i, (a, b) in enumerate(offsets):
            if a < at and b > start:
                mask[i] = 1
    if mask:
        mask[0] = 0
    return mask
