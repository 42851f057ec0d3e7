"""Chat rows in the shapes datasets come in (content as a list of parts, ShareGPT ``conversations``), ``--data-mode
auto`` (conversations prepared as documents, text exactly as before), and local files that are not UTF-8 (one line
naming the file and the line, never a traceback).

Every tokenizer and template is built in the test (tests/support/chat_models.py), offline.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from chat_models import chat_model_dir, conversations

from bigbatch.data.cache import ensure_prepared
from bigbatch.data.chat import ChatEncoder, ChatSettings, conversation_from_record, is_conversation_record
from bigbatch.data.chat_rows import SHAREGPT_ROLES
from bigbatch.data.data_mode import resolve_data_mode
from bigbatch.data.prepare import prepare_dataset
from bigbatch.data.shards import DatasetMeta
from bigbatch.errors import DataError

TO_SHAREGPT = {"user": "human", "assistant": "gpt", "system": "system", "tool": "observation"}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return chat_model_dir(tmp_path_factory.mktemp("qwen"), "qwen2.5")


def _encoder(directory: Path) -> ChatEncoder:
    return ChatEncoder((directory / "tokenizer.json").read_text(), directory, ChatSettings())


def _sharegpt(row: dict[str, Any]) -> dict[str, Any]:
    """A messages row as ShareGPT writes it: ``from``/``value``, a tool call as a ``function_call`` message."""
    turns = []
    for message in row["messages"]:
        if message.get("tool_calls"):
            (call,) = message["tool_calls"]
            value = json.dumps({"name": call["function"]["name"], "arguments": call["function"]["arguments"]})
            turns.append({"from": "function_call", "value": value})
        else:
            turns.append({"from": TO_SHAREGPT[message["role"]], "value": message["content"]})
    return {"conversations": turns}


def _write_rows(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    return path


def _shards(directory: Path) -> tuple[list[int], list[int], list[int]]:
    tokens = np.load(directory / "train_000000.npy").tolist()
    offsets = np.load(directory / "train_000000.offsets.npy").tolist()
    mask_file = directory / "train_000000.mask.npy"
    return tokens, offsets, np.load(mask_file).tolist() if mask_file.is_file() else []


# ------------------------------------------------------------------------------------- content as a list of parts


def test_text_parts_are_joined_with_nothing_between_them_as_openai_joins_them(qwen: Path) -> None:
    row = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2 + 2?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "4"}]},
        ]
    }
    plain = {"messages": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}]}
    parts = conversation_from_record(row, "row 1")
    assert [m["content"] for m in parts.messages] == ["What is 2 + 2?", "4"]
    encoder = _encoder(qwen)
    a, b = encoder.encode(parts), encoder.encode(conversation_from_record(plain, "row 1"))
    assert a is not None and b is not None
    assert a.ids.tolist() == b.ids.tolist() and a.mask.tolist() == b.mask.tolist()


def test_parts_as_a_dataset_stores_them_are_read(qwen: Path) -> None:
    """Arrow gives every part every field of the column (absent ones null); OpenAI's Responses API names its text
    parts input_text and output_text."""
    row = {
        "messages": [
            {"role": "user", "content": [{"type": "input_text", "text": "hi", "image": None}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "hello", "image": None}]},
        ]
    }
    assert [m["content"] for m in conversation_from_record(row, "r").messages] == ["hi", "hello"]


@pytest.mark.parametrize(
    ("part", "says"),
    [
        ({"type": "image_url", "image_url": {"url": "data:..."}}, "holds a part of type 'image_url' (part 2)"),
        ({"type": "input_audio", "input_audio": {"data": "..."}}, "holds a part of type 'input_audio' (part 2)"),
        ({"type": "text", "text": None}, "holds a text part without a string 'text' (part 2)"),
    ],
)
def test_a_part_that_is_not_text_is_one_line_naming_the_row_the_message_and_the_type(part: dict, says: str) -> None:
    row = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]},
        ]
    }
    with pytest.raises(DataError) as raised:
        conversation_from_record(row, "chat.jsonl:3")
    assert str(raised.value).startswith(f"chat.jsonl:3: message 2 (user) {says}; only text parts are read here")
    assert "\n" not in str(raised.value)


# ---------------------------------------------------------------------------------------------------- ShareGPT


def test_sharegpt_rows_are_read_as_the_conversations_they_are(qwen: Path) -> None:
    """Every row of the shared chat data, written as ShareGPT, encodes to the tokens and mask of the row itself
    (the tool row: its function_call becomes the assistant's tool call, its observation the tool message)."""
    encoder = _encoder(qwen)
    for number, row in enumerate(conversations(), start=1):
        shared = _sharegpt(row)
        assert is_conversation_record(shared)
        if row.get("tools"):
            messages = conversation_from_record(shared, "r").messages
            assert messages[2]["role"] == "assistant" and messages[2]["tool_calls"] == row["messages"][2]["tool_calls"]
            assert messages[3] == {"role": "tool", "content": row["messages"][3]["content"]}
            continue
        a = encoder.encode(conversation_from_record(shared, f"row {number}"))
        b = encoder.encode(conversation_from_record(row, f"row {number}"))
        assert a is not None and b is not None
        assert a.ids.tolist() == b.ids.tolist() and a.mask.tolist() == b.mask.tolist(), number


def test_role_and_content_objects_under_conversations_are_read_as_messages() -> None:
    row = {"conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    assert conversation_from_record(row, "r").messages == tuple(row["conversations"])


def test_a_sharegpt_system_column_becomes_the_first_message() -> None:
    """LLaMA-Factory keeps the system prompt in a column of its own."""
    row = {"system": "Be brief.", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    assert [m["role"] for m in conversation_from_record(row, "r").messages] == ["system", "user", "assistant"]


def test_an_unknown_from_value_is_one_line_naming_it_and_the_mapping() -> None:
    row = {"conversations": [{"from": "human", "value": "hi"}, {"from": "bing", "value": "hello"}]}
    with pytest.raises(DataError) as raised:
        conversation_from_record(row, "chat.jsonl:7")
    message = str(raised.value)
    assert message.startswith("chat.jsonl:7: message 2 is from 'bing', which no role is known for")
    assert "human->user, " in message and "gpt->assistant" in message and "\n" not in message
    assert set(SHAREGPT_ROLES.values()) <= {"system", "user", "assistant", "tool"}


def test_a_function_call_that_is_not_json_is_one_line() -> None:
    row = {"conversations": [{"from": "human", "value": "hi"}, {"from": "function_call", "value": "get_weather"}]}
    with pytest.raises(DataError, match=r"r: message 2 \(function_call\) is not a tool call"):
        conversation_from_record(row, "r")


def test_a_text_row_with_a_conversations_field_stays_text() -> None:
    assert not is_conversation_record({"text": "a document", "conversations": []})
    assert not is_conversation_record({"prompt": "q", "completion": "a", "conversations": []})
    assert is_conversation_record({"conversations": []}) and is_conversation_record({"messages": "x"})


def test_prepare_reads_a_sharegpt_file_as_it_reads_messages(tmp_path: Path, qwen: Path) -> None:
    rows = [row for row in conversations() if not row.get("tools")]
    messages = _write_rows(tmp_path / "messages.jsonl", rows)
    shared = _write_rows(tmp_path / "sharegpt.jsonl", [_sharegpt(row) for row in rows])
    a = prepare_dataset(str(messages), tmp_path / "a", f"file:{qwen}", val_fraction=0.0, mode="documents")
    b = prepare_dataset(str(shared), tmp_path / "b", f"file:{qwen}", val_fraction=0.0, mode="documents")
    assert a.documents == b.documents == len(rows)
    assert _shards(tmp_path / "a") == _shards(tmp_path / "b")


def test_a_row_of_no_known_shape_names_its_fields(tmp_path: Path) -> None:
    data = _write_rows(tmp_path / "x.jsonl", [{"dialogue": ["hi", "hello"], "id": 3}])
    with pytest.raises(DataError, match=r"x\.jsonl:1 needs a string 'text'.*ShareGPT 'conversations'\) \(fields: "):
        prepare_dataset(str(data), tmp_path / "out")


# ------------------------------------------------------------------------------------------------ --data-mode auto


def test_auto_prepares_conversations_as_documents(tmp_path: Path, qwen: Path) -> None:
    data = _write_rows(tmp_path / "chat.jsonl", conversations())
    auto = prepare_dataset(str(data), tmp_path / "auto", f"file:{qwen}", val_fraction=0.0, mode="auto")
    given = prepare_dataset(str(data), tmp_path / "given", f"file:{qwen}", val_fraction=0.0, mode="documents")
    assert auto.mode == "documents" and isinstance(auto.extra.get("chat"), dict)
    assert _shards(tmp_path / "auto") == _shards(tmp_path / "given")
    assert auto.fingerprints == given.fingerprints


def test_auto_is_the_old_default_for_text_same_cache_directory_and_tokens(tmp_path: Path, qwen: Path) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text("a document of text.\n" * 200)
    rows = _write_rows(tmp_path / "rows.jsonl", [{"text": f"document {i}"} for i in range(40)])
    for source in (text, rows):
        for tokenizer in ("byte", f"file:{qwen}"):  # a tokenizer with a chat template: still text
            auto = ensure_prepared(str(source), tokenizer, 0.1, tmp_path / "cache", mode="auto")
            assert ensure_prepared(str(source), tokenizer, 0.1, tmp_path / "cache", mode="packed") == auto
            assert auto.name.split("-")[-2] == "packed" and DatasetMeta.from_file(auto / "meta.json").mode == "packed"
    assert len(list((tmp_path / "cache").iterdir())) == 4  # each prepared once, under the key it always had


@pytest.mark.parametrize(
    ("first", "mode"),
    [
        ({"text": "a document"}, "packed"),
        ({"prompt": "q", "completion": "a"}, "packed"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "documents"),
        ({"conversations": [{"from": "human", "value": "hi"}]}, "documents"),
    ],
)
def test_auto_reads_the_first_row(tmp_path: Path, first: dict, mode: str) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_text("\n  \n" + json.dumps(first) + "\n" + "not json at all\n")  # blank lines first; one row read
    assert resolve_data_mode("auto", str(data), "byte") == mode
    assert resolve_data_mode("packed", str(data), "byte") == "packed"


def test_auto_leaves_what_it_cannot_read_to_the_old_default(tmp_path: Path) -> None:
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "caf\xe9"}\n')
    for source in ("builtin", str(tmp_path / "missing.jsonl"), str(tmp_path / "bad.jsonl"), "hf:json:x.jsonl"):
        assert resolve_data_mode("auto", source, "byte") == "packed", source


# ------------------------------------------------------------------------------------ local files that are not UTF-8


def test_a_jsonl_line_that_is_not_utf8_is_one_line_naming_the_file_and_the_line(tmp_path: Path, qwen: Path) -> None:
    data = tmp_path / "bad.jsonl"
    data.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9 au lait"}\n')
    for tokenizer, mode in (("byte", "packed"), ("bpe:300", "documents"), ("byte", "auto")):
        with pytest.raises(DataError) as raised:
            prepare_dataset(str(data), tmp_path / "out", tokenizer, mode=mode)
        message = str(raised.value)
        assert message.startswith(f"{data}:2: not valid UTF-8 (byte 0xe9 at byte 14 of the line)"), message
        assert "re-encode it as UTF-8" in message and "\n" not in message
        assert not (tmp_path / "out").exists()
    chat = tmp_path / "chat.jsonl"
    good = json.dumps(conversations()[0]).encode()
    chat.write_bytes(good + b"\n" + good.replace(b"Paris.", b"Par\xeds.") + b"\n")
    with pytest.raises(DataError, match=rf"^{chat}:2: not valid UTF-8 \(byte 0xed at byte \d+ of the line\)"):
        prepare_dataset(str(chat), tmp_path / "out", f"file:{qwen}", mode="documents")


def test_text_files_that_are_not_utf8_are_still_prepared_and_counted(tmp_path: Path, qwen: Path) -> None:
    """Plain text is bytes: the byte tokenizer keeps them, a text tokenizer counts what it replaces (unchanged)."""
    data = tmp_path / "latin1.txt"
    data.write_bytes("café crème, à la carte\n".encode("latin-1") * 20)
    meta = prepare_dataset(str(data), tmp_path / "out", f"file:{qwen}", val_fraction=0.0)
    assert meta.extra["utf8_replacements"] == 60


def test_a_meta_json_that_is_not_utf8_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "meta.json").write_bytes(b'{"format": "bigbatch-tokens", "source": "caf\xe9"}')
    with pytest.raises(
        DataError, match=r"meta\.json is not a readable dataset metadata file .*re-run bigbatch prepare"
    ):
        DatasetMeta.from_file(tmp_path / "meta.json")


def test_a_chat_template_file_that_is_not_utf8_is_one_line(tmp_path: Path, qwen: Path) -> None:
    from bigbatch.data.tokenizer_files import write_tokenizer_files
    from bigbatch.data.tokenizers import get_tokenizer

    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text((qwen / "tokenizer.json").read_text())
    (model / "chat_template.jinja").write_bytes(b"{{ messages }} caf\xe9")
    (tmp_path / "out").mkdir()
    with pytest.raises(DataError, match=r"chat_template\.jinja is not valid UTF-8 .*re-encode the file as UTF-8"):
        write_tokenizer_files(tmp_path / "out", get_tokenizer(f"file:{model}"), 64)
