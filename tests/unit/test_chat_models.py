"""The tiny chat-model directories of tests/support/chat_models.py: each family loads offline through transformers,
renders every row, keeps its control tokens whole, renders prefixes as its docstring says, and (``with_model``)
runs a forward pass."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from chat_models import (
    FAMILIES,
    GENERATION_MARKED,
    PREFIX_UNSTABLE,
    SPECS,
    THINKING_CONVERSATION,
    chat_model_dir,
    conversations,
    template,
    vocab_size,
)

transformers = pytest.importorskip("transformers")


def _load(directory: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def _render(tokenizer: Any, row: dict[str, Any], messages: int | None = None, prompt: bool = False) -> str:
    text = tokenizer.apply_chat_template(
        row["messages"][:messages], tools=row.get("tools"), add_generation_prompt=prompt, tokenize=False
    )
    assert isinstance(text, str)
    return text


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("chat-models")
    return {family: _load(chat_model_dir(root / family, family)) for family in FAMILIES}


def test_the_families_and_the_rows() -> None:
    assert set(FAMILIES) >= {"llama3", "qwen2.5", "qwen3", "mistral", "gemma", "phi3", "smollm", "gpt-oss", "plain"}
    assert GENERATION_MARKED == {"smollm"} and PREFIX_UNSTABLE <= set(FAMILIES)
    rows = conversations()
    assert len(rows) == 12 and rows == conversations() and rows[0] is not conversations()[0]  # fresh copies
    replies = [m["content"] for row in rows for m in row["messages"] if m["role"] == "assistant"]
    turns = [sum(m["role"] == "assistant" for m in row["messages"]) for row in rows]
    assert min(turns) == 1 and max(turns) == 4
    assert min(len(r.split()) for r in replies if r) == 1 and 280 <= max(map(len, replies)) <= 320
    assert any(ord(c) > 0x3000 for r in replies for c in r)  # CJK and emoji, not only accents
    (tooled,) = [row for row in rows if row.get("tools")]
    roles = [m["role"] for m in tooled["messages"]]
    assert len(tooled["tools"]) == 1 and "tool" in roles
    assert tooled["messages"][roles.index("tool") - 1].get("tool_calls")
    assert not any("<think>" in m["content"] for row in rows for m in row["messages"])
    assert "<think>" in THINKING_CONVERSATION["messages"][1]["content"]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_directory_loads_offline_and_renders_every_row(family: str, tokenizers: dict[str, Any]) -> None:
    tokenizer = tokenizers[family]
    spec = SPECS[family]
    assert tokenizer.chat_template == template(family) and len(tokenizer) == vocab_size(family)
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token) == (spec.eos, spec.pad, spec.bos)
    for row in conversations():
        text = _render(tokenizer, row)
        for message in row["messages"]:
            words = message["content"].split() if message["role"] != "tool" else ["cloudy"]  # mistral quotes it
            assert not words or words[0] in text, (family, message)  # the content reaches the text (trim aside)
        if row.get("tools"):
            assert "get_weather" in text and "Lyon" in text
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text  # byte-level: the encoding keeps every character
        for token in spec.specials:  # each control token in the text is one token, never split into text
            (token_id,) = tokenizer(token, add_special_tokens=False)["input_ids"]
            assert ids.count(token_id) == text.count(token), (family, token)
    if family == "plain":
        assert not any(token in _render(tokenizer, row) for row in conversations() for token in spec.specials)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefixes_render_as_the_whole_except_where_said(family: str, tokenizers: dict[str, Any]) -> None:
    """The conversation up to each reply (with the generation prompt) and through it render as the start of the
    whole, in every family but gpt-oss (a reply's end depends on whether it is last) and qwen3 with reasoning."""
    tokenizer = tokenizers[family]
    rows = conversations() + [THINKING_CONVERSATION]
    for row in rows:
        whole = _render(tokenizer, row)
        replies = [i for i, m in enumerate(row["messages"]) if m["role"] == "assistant"]
        for i in replies:
            assert whole.startswith(_render(tokenizer, row, i, prompt=True)), (family, row, i)
        through = [whole.startswith(_render(tokenizer, row, i + 1)) for i in replies]
        unstable = [  # an earlier reply that ends differently when it is the last one rendered
            i != replies[-1]
            and (
                (family in PREFIX_UNSTABLE and not row["messages"][i].get("tool_calls"))
                or (family == "qwen3" and row is THINKING_CONVERSATION)
            )
            for i in replies
        ]
        assert through == [not u for u in unstable], (family, row)


def test_the_qwen3_reasoning_stays_on_the_last_reply_only(tokenizers: dict[str, Any]) -> None:
    tokenizer = tokenizers["qwen3"]
    whole = _render(tokenizer, THINKING_CONVERSATION)
    assert "Add 17 to 51." in whole and "30 plus 21" not in whole
    assert "30 plus 21" in _render(tokenizer, THINKING_CONVERSATION, 2)
    assert _render(tokenizer, {"messages": [{"role": "user", "content": "x"}]}, prompt=True).endswith(
        "<|im_start|>assistant\n"
    )


def test_the_generation_markers_give_transformers_assistant_masks(tokenizers: dict[str, Any]) -> None:
    row = conversations()[2]
    tokenizer = tokenizers["smollm"]
    out = tokenizer.apply_chat_template(
        row["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    trained = [i for i, keep in zip(out["input_ids"], out["assistant_masks"], strict=True) if keep]
    assert tokenizer.decode(trained) == "Yes<|im_end|>No: nine is three times three.<|im_end|>"
    for family in set(FAMILIES) - GENERATION_MARKED:
        assert "{%- generation" not in template(family) and "endgeneration" not in template(family)


def test_a_directory_is_quick_to_build_and_the_same_each_time(tmp_path: Path) -> None:
    start = time.perf_counter()
    first = chat_model_dir(tmp_path / "a", "llama3")
    assert time.perf_counter() - start < 1.0
    second = chat_model_dir(tmp_path / "b", "llama3")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes()
    config = json.loads((first / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and config["bos_token"] == "<|begin_of_text|>"
    assert not (first / "config.json").exists()
    with pytest.raises(ValueError, match="unknown chat family"):
        chat_model_dir(tmp_path / "c", "llama2")


@pytest.mark.parametrize("family", FAMILIES)
def test_with_model_loads_and_runs_forward(family: str, tmp_path: Path) -> None:
    import torch

    directory = chat_model_dir(tmp_path, family, with_model=True)
    assert (directory / "config.json").is_file() and (directory / "model.safetensors").is_file()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True).eval()
    tokenizer = _load(directory)
    config = model.config
    assert config.vocab_size == len(tokenizer) and config.max_position_embeddings == 128
    assert config.model_type == SPECS[family].architecture and config.num_hidden_layers == 2
    assert config.eos_token_id == tokenizer.eos_token_id and config.pad_token_id == tokenizer.pad_token_id
    ids = tokenizer(_render(tokenizer, conversations()[6]), add_special_tokens=False)["input_ids"][:128]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tokenizer)) and torch.isfinite(logits).all()
