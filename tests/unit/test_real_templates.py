"""The real chat templates of tests/support/real_templates.py: byte copies as PROVENANCE.md records them, tokenizer
directories that load offline with the template unchanged and their control tokens whole, the hand-marked spans
where the renderings put them, and the refusals the templates really raise."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import pytest
from real_templates import (
    CONVERSATIONS,
    FAMILIES,
    HAND_MARKED,
    REAL_CHAT,
    SPECS,
    TEMPLATE_REFUSES,
    TRAINING_TEMPLATE,
    conversations,
    real_chat_dir,
    render,
    template_text,
    training_template_text,
)

transformers = pytest.importorskip("transformers")

_LEADS: dict[str, tuple[str, ...]] = {
    "llama2": ("[/INST] ",),
    "llama3": ("<|start_header_id|>assistant<|end_header_id|>\n\n",),
    "llama3.1": ("<|start_header_id|>assistant<|end_header_id|>\n\n",),
    "llama3.2": ("<|start_header_id|>assistant<|end_header_id|>\n\n",),
    "mistral-v0.3": ("[/INST] ", "<s> ", "[/TOOL_RESULTS]  "),
    "gemma": ("<start_of_turn>model\n",),
    "gemma3": ("<start_of_turn>model\n",),
    "phi3": ("<|assistant|>\n",),
    "phi3.5": ("<|assistant|>\n",),
    "qwen2.5": ("<|im_start|>assistant\n",),
    "qwen3": ("<|im_start|>assistant\n",),
    "deepseek-v3": ("<｜Assistant｜>",),
    "deepseek-r1-distill": ("<｜Assistant｜>", "<｜tool▁outputs▁end｜>"),
    "gpt-oss": ("<|start|>assistant",),
    "smollm2": ("<|im_start|>assistant\n",),
    "zephyr": ("<|assistant|>\n",),
    "chatml-no-prompt": ("<|im_start|>assistant\n",),
}
"""What a reply's span follows in each family's rendering (its reply header, or what stands for it): written here
from the templates, independently of the module, so that a span found in the wrong place fails."""


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("real-chat")
    return {
        family: transformers.AutoTokenizer.from_pretrained(
            str(real_chat_dir(root / family, family)), local_files_only=True
        )
        for family in FAMILIES
    }


def test_the_copies_are_the_bytes_provenance_records() -> None:
    recorded = dict(
        re.findall(
            r"\| `((?:templates|trl_training|more)/[\w.]+\.jinja)` \|.*\| `([0-9a-f]{64})` \|",
            (REAL_CHAT / "PROVENANCE.md").read_text(encoding="utf-8"),
        )
    )
    on_disk = {f"{p.parent.name}/{p.name}": p for p in REAL_CHAT.glob("*/*.jinja")}
    assert set(recorded) == set(on_disk) and len(on_disk) == 29
    for name, path in on_disk.items():
        assert hashlib.sha256(path.read_bytes()).hexdigest() == recorded[name], name
    assert {SPECS[f].template_file for f in FAMILIES} == {
        n.split("/")[1] for n in on_disk if n.startswith("templates/")
    }
    assert all("{% generation %}" in training_template_text(f) for f in TRAINING_TEMPLATE)
    assert set(TRAINING_TEMPLATE) == set(FAMILIES) - {
        "llama2",
        "llama3.1",
        "llama3.2",
        "mistral-v0.3",
        "smollm2",
        "zephyr",
        "chatml-no-prompt",
    }


def test_each_directory_loads_offline_with_the_byte_exact_template(tokenizers: dict[str, Any], tmp_path: Path) -> None:
    for family, tokenizer in tokenizers.items():
        spec = SPECS[family]
        assert tokenizer.chat_template == template_text(family), family
        assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (spec.bos, spec.eos, spec.pad), family
    config = json.loads((real_chat_dir(tmp_path / "gpt-oss", "gpt-oss") / "tokenizer_config.json").read_text("utf-8"))
    assert (
        "chat_template" not in config
        and (tmp_path / "gpt-oss" / "chat_template.jinja").read_bytes() == template_text("gpt-oss").encode()
    )
    assert (
        json.loads((real_chat_dir(tmp_path / "zephyr", "zephyr") / "tokenizer_config.json").read_text("utf-8"))[
            "tokenizer_class"
        ]
        == "LlamaTokenizer"
    )


def test_control_tokens_are_single_ids(tokenizers: dict[str, Any]) -> None:
    for family, tokenizer in tokenizers.items():
        ids = [tokenizer.encode(token, add_special_tokens=False) for token in SPECS[family].specials]
        assert all(len(i) == 1 for i in ids) and len({i[0] for i in ids}) == len(ids), family
    # Where the real vocabulary has no such token, the header is text, as in the real model.
    assert len(tokenizers["zephyr"].encode("<|assistant|>", add_special_tokens=False)) > 1
    assert len(tokenizers["llama2"].encode("[INST]", add_special_tokens=False)) > 1


def test_hand_marked_spans_sit_after_a_reply_header_in_order(tokenizers: dict[str, Any]) -> None:
    required = {(f, c) for f in FAMILIES for c in ("single", "multi")}
    required |= {
        (f, c)
        for f in (
            "llama3.1",
            "qwen2.5",
            "qwen3",
            "mistral-v0.3",
            "phi3",
            "deepseek-r1-distill",
            "gpt-oss",
            "chatml-no-prompt",
        )
        for c in ("system", "tools", "assistant_first", "reasoning")
    }
    assert required <= set(HAND_MARKED)
    for (family, name), spans in HAND_MARKED.items():
        tokenizer = tokenizers[family]
        text = render(tokenizer, name)
        pos = 0
        for span in spans:
            at = text.find(span, pos)
            while at >= 0 and not text[:at].endswith(_LEADS[family]):
                at = text.find(span, at + 1)
            assert at >= 0, (family, name, span)
            pos = at + len(span)
        assert text[pos:].strip() in ("", tokenizer.eos_token), (family, name, text[pos:])  # nothing trainable after


def test_refusals_raise_and_every_other_pair_renders(tokenizers: dict[str, Any]) -> None:
    for family, tokenizer in tokenizers.items():
        for name in CONVERSATIONS:
            if (family, name) in TEMPLATE_REFUSES:
                with pytest.raises(Exception):  # noqa: B017 (jinja2's TemplateError, or a TypeError inside it)
                    render(tokenizer, name)
            else:
                assert render(tokenizer, name), (family, name)


def test_conversations_are_fresh_copies() -> None:
    rows = conversations()
    assert rows == CONVERSATIONS and rows["tools"] is not CONVERSATIONS["tools"]
    rows["tools"]["messages"][1]["tool_calls"][0]["function"]["arguments"]["city"] = "Paris"
    assert CONVERSATIONS["tools"]["messages"][1]["tool_calls"][0]["function"]["arguments"] == {"city": "Lyon"}
    assert any(ord(c) > 0x3000 for m in rows["system"]["messages"] for c in m["content"])
    assert rows["multi"]["messages"][-1]["content"].startswith(" ") and rows["multi"]["messages"][-1][
        "content"
    ].endswith(" ")
