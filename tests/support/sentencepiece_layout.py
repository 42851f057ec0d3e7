"""A tiny SentencePiece-style (Llama 2) tokenizer directory, built offline in the test, laid out as real ones are.

:func:`llama2_like` writes:

* ``tokenizer.json``: a BPE with ``byte_fallback`` (ids 0-2 ``<unk>``, ``<s>``, ``</s>``, then the 256 byte
  pieces ``<0x00>``..``<0xFF>``, then ``▁``-prefixed pieces trained here on a small fixed corpus, runs of spaces
  ``▁▁`` and ``▁▁▁▁`` merged first as in Llama 2), the three
  special tokens as added tokens, a ``<s> $A`` post-processor, and Llama 2's decoder chain (Replace ``▁`` -> space,
  ByteFallback, Fuse, Strip one leading space). Its front end is one of two layouts (``layout``):

  - ``"normalizer"``: a Prepend ``▁`` + Replace space -> ``▁`` normalizer and no pre-tokenizer, as
    Llama 2, Phi-3 and Mistral ship (the normalizer runs on each piece between special tokens, so the raw file
    puts a ``▁`` after every one of them);
  - ``"metaspace"``: no normalizer and a Metaspace pre-tokenizer (replacement ``▁``, ``prepend_scheme``
    ``"first"``, ``split`` true), as newer conversions write;

* ``tokenizer_config.json``: ``tokenizer_class`` (``LlamaTokenizer`` unless told), ``add_bos_token`` true,
  ``add_eos_token`` false, ``bos_token``/``eos_token``/``unk_token``, ``legacy`` (left out when ``None``) and a
  Llama-2-style ``chat_template`` (``<s>[INST] ... [/INST] ... </s>``);

No model weights. transformers (v5) rebuilds such a tokenizer's front end from the class named in
``tokenizer_config.json`` (``LlamaTokenizer``: Metaspace with ``split`` false, prepend ``first`` unless
``legacy`` is true), so ``tokenizers.Tokenizer.from_file`` of the file encodes otherwise than
``AutoTokenizer.from_pretrained(DIR)``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SPECIALS = ("<unk>", "<s>", "</s>")
BYTE_PIECES = tuple(f"<0x{b:02X}>" for b in range(256))
LLAMA2_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)
"""Llama 2's conversation format, written here (no system prompt): each user turn ``<s>[INST] ... [/INST]``,
each reply `` ... </s>``."""

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "the cat sat in the hat, and the hat sat on the mat",
    "Hello there! How are you today? I am fine, thank you.",
    "hi, what is the capital of France? It is Paris.",
    "def add(a, b):\n    return a + b\n\n\nprint(add(2, 3))",
    "  indented   text with    runs of spaces  ",
    "naïve café, héllo wörld — “quotes”",
    "日本語のテキストと中文文本",
    "numbers 12345 and 3.14159, ok ok ok",
]


def _trained(vocab_size: int) -> tuple[dict[str, int], list[str]]:
    """Vocabulary (pieces only, in training order) and merges of a BPE trained on ``CORPUS`` with Metaspace."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, special_tokens=[])
    tokenizer.train_from_iterator(CORPUS * 4, trainer=trainer)
    model = json.loads(tokenizer.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    vocab = dict(model["vocab"])
    for token in ("▁▁", "▁▁▁▁"):  # runs of spaces are pieces, merged first (Llama 2's ids 259 and 268)
        vocab.setdefault(token, len(vocab))
    return vocab, ["▁ ▁", "▁▁ ▁▁", *merges]


def llama2_tokenizer_json(layout: str = "normalizer", vocab_size: int = 300) -> str:
    """The ``tokenizer.json`` text of :func:`llama2_like` (``layout``: ``"normalizer"`` or ``"metaspace"``)."""
    if layout not in ("normalizer", "metaspace"):
        raise ValueError(f"layout must be 'normalizer' or 'metaspace', not {layout!r}")
    pieces, merges = _trained(vocab_size)
    vocab: dict[str, int] = {}
    for token in (*SPECIALS, *BYTE_PIECES):
        vocab[token] = len(vocab)
    for token in sorted(pieces, key=pieces.__getitem__):
        vocab.setdefault(token, len(vocab))
    added = [
        {
            "id": i,
            "content": text,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, text in enumerate(SPECIALS)
    ]
    normalizer: Any = None
    pre_tokenizer: Any = None
    if layout == "normalizer":
        normalizer = {
            "type": "Sequence",
            "normalizers": [
                {"type": "Prepend", "prepend": "▁"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
            ],
        }
    else:
        pre_tokenizer = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": True}
    document = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                {"SpecialToken": {"id": "<s>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": "<s>", "type_id": 1}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
        },
        "decoder": {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0},
            ],
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": "<unk>",
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": True,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }
    return json.dumps(document, ensure_ascii=False, indent=2)


def llama2_like(
    directory: Path,
    layout: str = "normalizer",
    legacy: bool | None = False,
    tokenizer_class: str | None = "LlamaTokenizer",
    chat_template: bool = True,
    **config: Any,
) -> Path:
    """Write a Llama-2-style tokenizer directory (see the module's docstring) into ``directory``; ``config``
    adds to (or overrides) ``tokenizer_config.json``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(llama2_tokenizer_json(layout), encoding="utf-8")
    settings: dict[str, Any] = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "sp_model_kwargs": {},
    }
    if tokenizer_class is not None:
        settings["tokenizer_class"] = tokenizer_class
    if legacy is not None:
        settings["legacy"] = legacy
    if chat_template:
        settings["chat_template"] = LLAMA2_TEMPLATE
    settings.update(config)
    (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=2), encoding="utf-8")
    return directory
