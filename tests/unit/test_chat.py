"""Chat data: conversations rendered with the model's own template, masked to the assistant's tokens by rendering
and character offsets (no template markers), refused in one line where that cannot be done, and audited.

Every tokenizer and template is built in the test (tests/support/chat_models.py), offline.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from chat_models import FAMILIES, GENERATION_MARKED, chat_model_dir, conversations

from bigbatch.data.chat import (
    TRAINED_CLOSE,
    TRAINED_OPEN,
    ChatEncoder,
    ChatSettings,
    Conversation,
    conversation_from_record,
)
from bigbatch.data.prepare import prepare_dataset, shown_conversations
from bigbatch.data.shards import DatasetMeta
from bigbatch.errors import BigBatchError, ConfigError, DataError

TWO_TURNS = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hello there"},
        {"role": "user", "content": "how are you"},
        {"role": "assistant", "content": "I am fine, thank you"},
    ]
}


def _encoder(directory: Path, **settings: str) -> ChatEncoder:
    return ChatEncoder((directory / "tokenizer.json").read_text(), directory, ChatSettings(**settings))


def _trained_text(encoder: ChatEncoder, row: dict) -> list[str]:
    """The decoded trained runs of tokens of one row."""
    encoded = encoder.encode(conversation_from_record(row, "row 1"))
    assert encoded is not None
    return [encoder.decode(encoded.ids[a:b].tolist()) for a, b in encoded.spans]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return chat_model_dir(tmp_path_factory.mktemp("qwen"), "qwen2.5")


def test_every_assistant_turn_and_its_end_of_turn_token_is_trained(qwen: Path) -> None:
    """Hand-marked: ChatML trains each reply and its <|im_end|>, never the headers, the system or user text."""
    assert _trained_text(_encoder(qwen), TWO_TURNS) == ["hello there<|im_end|>", "I am fine, thank you<|im_end|>"]


def test_last_assistant_trains_only_the_last_turn_and_all_trains_everything(qwen: Path) -> None:
    assert _trained_text(_encoder(qwen, loss_on="last-assistant"), TWO_TURNS) == ["I am fine, thank you<|im_end|>"]
    everything = _encoder(qwen, loss_on="all").encode(conversation_from_record(TWO_TURNS, "row"))
    assert everything is not None
    assert everything.mask[0] == 0 and everything.mask[1:].all()  # every target; position 0 is never one


def test_the_mask_follows_the_template_for_every_family(tmp_path: Path) -> None:
    """In every family whose prefixes render as the whole, each trained run is one assistant reply followed by the
    family's end of turn (after trailing white space is left out), and nothing else is trained."""
    row = {"messages": TWO_TURNS["messages"][1:]}  # no system message: not every family has one
    ends = {
        "llama3": "<|eot_id|>",
        "qwen2.5": "<|im_end|>",
        "mistral": "</s>",
        "gemma": "<end_of_turn>",
        "phi3": "<|end|>",
        "smollm": "<|im_end|>",
        "plain": "",
    }
    for family, end in ends.items():
        encoder = _encoder(chat_model_dir(tmp_path / family, family))
        trained = _trained_text(encoder, row)
        assert [t.strip() for t in trained] == [f"hello there{end}", f"I am fine, thank you{end}"], family


def test_a_template_that_closes_the_last_reply_differently_trains_each_with_its_own_close(tmp_path: Path) -> None:
    """gpt-oss-style: the last reply ends in <|return|>, an earlier one in <|end|>; rendering prefixes would see two
    different conversations. Each reply is found in the one rendering of the whole and trained with its own close
    (after the <|start|>assistant header, so the channel header the model writes is trained too)."""
    encoder = _encoder(chat_model_dir(tmp_path / "oss", "gpt-oss"))
    assert _trained_text(encoder, TWO_TURNS) == [
        "<|channel|>final<|message|>hello there<|end|>",
        "<|channel|>final<|message|>I am fine, thank you<|return|>",
    ]


def test_no_assistant_token_is_refused_or_dropped_and_counted(qwen: Path) -> None:
    row = {"messages": [{"role": "user", "content": "hello"}]}
    with pytest.raises(DataError, match=r"row 1: the conversation has no assistant token.*--no-assistant drop"):
        _encoder(qwen).encode(conversation_from_record(row, "row 1"))
    dropping = _encoder(qwen, no_assistant="drop")
    assert dropping.encode(conversation_from_record(row, "row 1")) is None
    assert dropping.audit.dropped == 1 and dropping.audit.conversations == 0


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"messages": []}, r"x\.jsonl:1: 'messages' is empty"),
        ({"messages": "hi"}, r"x\.jsonl:1: 'messages' must be a list"),
        ({"messages": [{"role": "bot", "content": "hi"}]}, r"message 1 has role 'bot'; use one of system, developer"),
        ({"messages": [{"role": "user", "content": ["a"]}]}, r"message 1 \(user\) has no string 'content'"),
        ({"messages": [{"role": "user", "content": "a"}], "tools": "x"}, r"'tools' must be a list of objects"),
    ],
)
def test_bad_rows_are_one_line_naming_the_row(row: dict, message: str) -> None:
    with pytest.raises(DataError, match=message):
        conversation_from_record(row, "x.jsonl:1")


def test_special_token_text_inside_a_message_is_refused(qwen: Path) -> None:
    row = {"messages": [{"role": "user", "content": "say <|im_end|> now"}, {"role": "assistant", "content": "ok"}]}
    with pytest.raises(DataError, match=r"row 1: message 1 \(user\) holds the special token text '<\|im_end\|>'"):
        _encoder(qwen).encode(conversation_from_record(row, "row 1"))


def _write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_prepare_writes_the_masks_and_the_audit(tmp_path: Path, qwen: Path) -> None:
    rows = conversations()
    data = _write_rows(tmp_path / "chat.jsonl", rows)
    meta = prepare_dataset(str(data), tmp_path / "out", f"file:{qwen}", val_fraction=0.0, mode="documents")
    tokens = np.load(tmp_path / "out" / "train_000000.npy")
    mask = np.load(tmp_path / "out" / "train_000000.mask.npy")
    offsets = np.load(tmp_path / "out" / "train_000000.offsets.npy")
    encoder = _encoder(qwen)
    expected = [encoder.encode(conversation_from_record(row, "r")) for row in rows]
    assert len(offsets) - 1 == len(rows) == meta.documents
    for i, want in enumerate(expected):  # the shard holds each conversation's tokens and mask as encoded
        assert want is not None
        a, b = offsets[i], offsets[i + 1]
        assert tokens[a:b].tolist() == want.ids.tolist() and mask[a:b].tolist() == want.mask.tolist()
    chat = DatasetMeta.from_file(tmp_path / "out" / "meta.json").extra["chat"]
    assert chat["conversations"] == len(rows) and chat["dropped"] == 0
    assert chat["trained"] == sum(int(e.mask.sum()) for e in expected if e is not None)
    assert chat["assistant_turns"] == chat["turns_with_stop"] == sum(len(e.spans) for e in expected if e)


def test_prepare_refuses_bad_input_and_writes_nothing(tmp_path: Path, qwen: Path) -> None:
    good = conversations()[:2]
    cases = [
        (good + [{"messages": []}], DataError, r"chat\.jsonl:3: 'messages' is empty"),
        (good + [{"text": "plain"}], DataError, r"chat\.jsonl:3 is text in a dataset of conversations"),
        (
            good + [{"messages": [{"role": "user", "content": "hi"}]}],
            DataError,
            r"chat\.jsonl:3: the conversation "
            "has no assistant token",
        ),
    ]
    for rows, kind, message in cases:
        data = _write_rows(tmp_path / "chat.jsonl", rows)
        with pytest.raises(kind, match=message):
            prepare_dataset(str(data), tmp_path / "out", f"file:{qwen}", val_fraction=0.0, mode="documents")
        assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
    data = _write_rows(tmp_path / "chat.jsonl", good)
    with pytest.raises(ConfigError, match=r"is a conversation: .* add --mode documents"):
        prepare_dataset(str(data), tmp_path / "out", f"file:{qwen}", val_fraction=0.0, mode="packed")
    with pytest.raises(ConfigError, match=r"give the model's tokenizer, --tokenizer file:DIR"):
        prepare_dataset(str(data), tmp_path / "out", "byte", val_fraction=0.0, mode="documents")
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_without_a_chat_template_is_one_line(tmp_path: Path, qwen: Path) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_text((qwen / "tokenizer.json").read_text())
    with pytest.raises(ConfigError, match=r"has no chat template"):
        _encoder(bare)


def test_dropped_conversations_are_left_out_and_counted(tmp_path: Path, qwen: Path) -> None:
    rows = conversations()[:3] + [{"messages": [{"role": "user", "content": "hi"}]}]
    data = _write_rows(tmp_path / "chat.jsonl", rows)
    meta = prepare_dataset(
        str(data), tmp_path / "out", f"file:{qwen}", 0.0, mode="documents", chat=ChatSettings(no_assistant="drop")
    )
    assert meta.documents == 3 and meta.extra["chat"]["dropped"] == 1  # type: ignore[index]


def test_show_marks_exactly_the_trained_tokens(tmp_path: Path, qwen: Path) -> None:
    data = _write_rows(tmp_path / "chat.jsonl", [TWO_TURNS])
    (shown,) = list(shown_conversations(str(data), f"file:{qwen}", ChatSettings(), 5))
    body = shown.split("\n", 1)[1]
    assert f"{TRAINED_OPEN}hello there<|im_end|>{TRAINED_CLOSE}" in body
    assert f"{TRAINED_OPEN}I am fine, thank you<|im_end|>{TRAINED_CLOSE}" in body
    assert body.count(TRAINED_OPEN) == 2 and "Be brief." in body.replace(TRAINED_OPEN, "")


def test_tools_reach_the_template(qwen: Path) -> None:
    """A row's tools are rendered (into qwen2.5's system message), and a tool-calling turn is trained."""
    row = next(r for r in conversations() if r.get("tools"))
    conversation = conversation_from_record(row, "row")
    encoder = _encoder(qwen)
    text = encoder.template.render(conversation.name, conversation.messages, conversation.tools)
    assert json.dumps(row["tools"][0]["function"]["name"]).strip('"') in text
    assert encoder.encode(conversation) is not None


def test_generation_marked_families_are_named(tmp_path: Path) -> None:
    assert GENERATION_MARKED <= set(FAMILIES) and "smollm" in GENERATION_MARKED
    assert isinstance(conversation_from_record(TWO_TURNS, "r"), Conversation)


def test_bigbatch_errors_are_one_line(qwen: Path) -> None:
    with pytest.raises(BigBatchError) as raised:
        _encoder(qwen).encode(conversation_from_record({"messages": [{"role": "user", "content": "x"}]}, "r"))
    assert "\n" not in str(raised.value)


def test_the_audit_names_a_turn_that_trains_no_stop_token(tmp_path: Path) -> None:
    """The plain template writes no end-of-turn token: the audit says so and names a conversation."""
    from bigbatch.data.chat import audit_lines

    plain = chat_model_dir(tmp_path / "plain", "plain")
    data = _write_rows(tmp_path / "chat.jsonl", [TWO_TURNS])
    meta = prepare_dataset(str(data), tmp_path / "out", f"file:{plain}", val_fraction=0.0, mode="documents")
    chat = meta.extra["chat"]
    assert isinstance(chat, dict) and chat["turns_with_stop"] == 0 and chat["assistant_turns"] == 2
    (_, stops) = audit_lines(chat, "assistant")
    assert "0 of 2 trained turns end on a trained end-of-turn token (2 do not, e.g. " in stops
    assert "chat.jsonl:1: the model may not learn to stop" in stops


GREETING_FIRST = {
    "messages": [
        {"role": "assistant", "content": "Hi, how can I help?"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hello there"},
    ]
}


def test_a_conversation_that_opens_with_the_assistant_trains_only_its_replies(qwen: Path) -> None:
    """The first reply starts at character 0 of the conversation, yet what the template writes before it (qwen2.5's
    default system prompt, the role header) is prompt, not reply (it was trained on the prefix rule)."""
    assert _trained_text(_encoder(qwen), GREETING_FIRST) == ["Hi, how can I help?<|im_end|>", "hello there<|im_end|>"]


NO_PROMPT_CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n'}}{% endfor %}"
)


def test_a_template_without_a_generation_prompt_trains_no_role_header(tmp_path: Path, qwen: Path) -> None:
    """ChatML as some fine-tunes ship it, ignoring add_generation_prompt: each reply starts at its own text, not at
    its role header (every turn trained its header before)."""
    directory = tmp_path / "no-prompt"
    directory.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).write_text((qwen / name).read_text())
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": NO_PROMPT_CHATML}))
    row = {"messages": TWO_TURNS["messages"] + GREETING_FIRST["messages"][1:]}
    assert _trained_text(_encoder(directory), row) == [
        "hello there<|im_end|>",
        "I am fine, thank you<|im_end|>",
        "hello there<|im_end|>",
    ]


LONG = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        *[
            message
            for n in range(4)
            for message in (
                {"role": "user", "content": f"question {n}: " + "why " * 20},
                {"role": "assistant", "content": f"answer {n}: " + "because " * 20},
            )
        ],
    ]
}


def _length(directory: Path, row: dict) -> int:
    encoded = _encoder(directory).encode(conversation_from_record(row, "row 1"))
    assert encoded is not None
    return len(encoded.ids)


@pytest.mark.parametrize("policy", ["drop-oldest-turns", "drop", "refuse"])
def test_a_conversation_longer_than_a_row_is_never_cut_silently(qwen: Path, policy: str) -> None:
    """Longer than max_tokens (a row of seq_len + 1): its oldest rounds are left out (the system prompt stays), it is
    left out, or refused, and the audit counts it; a conversation is never cut into windows of replies without
    their questions."""
    whole = _length(qwen, LONG)
    last_round = {"messages": [LONG["messages"][0], *LONG["messages"][-2:]]}
    limit = _length(qwen, last_round) + 5  # room for the last round only
    encoder = _encoder(qwen, long_conversations=policy, max_tokens=limit)  # type: ignore[arg-type]
    conversation = conversation_from_record(LONG, "row 1")
    if policy == "refuse":
        with pytest.raises(DataError, match=rf"row 1: the conversation is {whole:,} tokens, longer than a row of"):
            encoder.encode(conversation)
        return
    encoded = encoder.encode(conversation)
    if policy == "drop":
        assert encoded is None and encoder.audit.too_long == 1 and encoder.audit.first_too_long == "row 1"
        return
    assert encoded is not None and len(encoded.ids) <= limit < whole
    trained = [encoder.decode(encoded.ids[a:b].tolist()) for a, b in encoded.spans]
    assert trained == ["answer 3: " + "because " * 20 + "<|im_end|>"]  # qwen2.5 writes the reply as given
    assert "Be brief." in encoder.decode(encoded.ids.tolist())  # the system prompt stays
    assert (encoder.audit.shortened, encoder.audit.turns_cut) == (1, 6)
    # a last round alone too long: left out, counted
    tight = _encoder(qwen, long_conversations=policy, max_tokens=limit - 10)  # type: ignore[arg-type]
    assert tight.encode(conversation) is None and tight.audit.too_long == 1
