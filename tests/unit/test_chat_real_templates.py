"""Chat masks on the templates models really ship (byte copies, tests/support/real_chat/): every family x every
conversation is trained with the hand-marked mask, refused only where the template itself refuses, audited, and
tokenized as ``AutoTokenizer`` tokenizes it.

The table of tests/support/real_templates.py, one tokenizer directory per family built once offline. Each case of
the issue's silent wrongs has a test here that failed on the prefix rule: a conversation the assistant opens
(Qwen2.5's injected system prompt and the role headers were trained), a template without a generation prompt
(every role header trained), Qwen3 / Phi-3 / DeepSeek / gpt-oss multi-turn (refused), a tool call the template
drops (its end-of-turn token trained alone, silently).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from real_templates import FAMILIES, HAND_MARKED, TEMPLATE_REFUSES, conversations, hand_mask, real_chat_dir

from bigbatch.data.chat import ChatEncoder, ChatSettings, EncodedConversation, conversation_from_record
from bigbatch.data.tokenizers import file_tokenizer_name, get_tokenizer
from bigbatch.errors import DataError

transformers = pytest.importorskip("transformers")


def run_tokenizer_json(directory: Path) -> str:
    """The tokenizer.json a run encodes with: the pipeline AutoTokenizer builds from the directory."""
    return get_tokenizer(file_tokenizer_name(directory / "tokenizer.json")).to_str()  # type: ignore[attr-defined]


CASES = [(family, name) for family in FAMILIES for name in conversations()]


@pytest.fixture(scope="module")
def directories(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("real-chat")
    return {family: real_chat_dir(root / family, family) for family in FAMILIES}


@pytest.fixture(scope="module")
def encoders(directories: dict[str, Path]) -> dict[str, ChatEncoder]:
    return {family: ChatEncoder(run_tokenizer_json(d), d, ChatSettings()) for family, d in directories.items()}


def _encode(encoder: ChatEncoder, name: str, **settings: Any) -> EncodedConversation:
    if settings:
        encoder = ChatEncoder(encoder._tokenizer.to_str(), encoder.template.directory, ChatSettings(**settings))
    encoded = encoder.encode(conversation_from_record(conversations()[name], name))
    assert encoded is not None
    return encoded


@pytest.mark.parametrize(("family", "name"), CASES, ids=[f"{f}-{n}" for f, n in CASES])
def test_every_family_and_conversation_is_trained_as_marked_or_refused_by_its_template(
    encoders: dict[str, ChatEncoder], family: str, name: str
) -> None:
    encoder = encoders[family]
    if (family, name) in TEMPLATE_REFUSES:  # the template's own refusal, in one line naming the row
        with pytest.raises(DataError, match=rf"^{name}: the chat template refused the conversation \("):
            _encode(encoder, name)
        return
    encoded = _encode(encoder, name)
    assert encoded.mask[1:].any()
    expected = HAND_MARKED.get((family, name))
    if expected is not None:
        assert encoded.mask.tolist() == hand_mask(encoded.text, encoded.offsets.tolist(), expected), (
            encoded.trained_text(),
            expected,
        )


@pytest.mark.parametrize("family", FAMILIES)
def test_the_trained_ids_are_autotokenizers(
    directories: dict[str, Path], encoders: dict[str, ChatEncoder], family: str
) -> None:
    """What the model sees at inference: apply_chat_template(tokenize=True)'s ids, for every conversation."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directories[family]), local_files_only=True)
    for name, row in conversations().items():
        if (family, name) in TEMPLATE_REFUSES:
            continue
        theirs = tokenizer.apply_chat_template(
            row["messages"], tools=row.get("tools"), tokenize=True, return_dict=False
        )
        theirs = theirs["input_ids"] if isinstance(theirs, dict) else theirs
        assert _encode(encoders[family], name).ids.tolist() == list(theirs), (family, name)


def test_a_reply_the_template_renders_in_part_or_not_at_all_is_said_in_the_audit(
    encoders: dict[str, ChatEncoder], directories: dict[str, Path]
) -> None:
    """Qwen3 drops the reasoning of replies before the last question (trained as rendered, counted); Phi-3 drops a
    reply's tool calls (its lone end-of-turn token is not trained: that would teach stopping without an answer)."""
    qwen3 = ChatEncoder(run_tokenizer_json(directories["qwen3"]), directories["qwen3"], ChatSettings())
    encoded = qwen3.encode(conversation_from_record(conversations()["reasoning"], "reasoning"))
    assert encoded is not None and qwen3.audit.partial_turns == 1 and qwen3.audit.first_partial == "reasoning"
    assert encoded.trained_text()[0] == "51<|im_end|>"
    phi3 = ChatEncoder(run_tokenizer_json(directories["phi3"]), directories["phi3"], ChatSettings())
    encoded = phi3.encode(conversation_from_record(conversations()["tools"], "tools"))
    assert encoded is not None and phi3.audit.unrendered_turns == 1 and phi3.audit.first_unrendered == "tools"
    assert encoded.trained_text() == ["It is 18 °C and cloudy in Lyon.<|end|>"]
    assert phi3.audit.assistant_turns == phi3.audit.turns_with_stop == 1


def test_last_assistant_and_all(encoders: dict[str, ChatEncoder]) -> None:
    """--loss-on last-assistant trains the last reply of a template that closes it differently (gpt-oss);
    --loss-on all needs no spans at all."""
    last = _encode(encoders["gpt-oss"], "multi", loss_on="last-assistant")
    assert last.trained_text() == ["<|channel|>final<|message|>  Café, with the accent kept.  <|return|>"]
    everything = _encode(encoders["qwen3"], "tools", loss_on="all")
    assert everything.mask[0] == 0 and everything.mask[1:].all() and everything.spans == []


def _directory_with(base: Path, target: Path, template: str, specials: tuple[str, ...] = ()) -> Path:
    """A copy of a tokenizer directory with another template and, where it writes them, more control tokens."""
    import json
    import shutil

    from tokenizers import AddedToken, Tokenizer

    shutil.copytree(base, target)
    tokenizer = Tokenizer.from_file(str(target / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tokenizer.save(str(target / "tokenizer.json"))
    config = json.loads((target / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {
        str(i): {
            "content": t.content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t.special,
        }
        for i, t in tokenizer.get_added_tokens_decoder().items()
    }
    config["chat_template"] = template
    (target / "chat_template.jinja").unlink(missing_ok=True)
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target


MORE = Path(__file__).resolve().parents[1] / "support" / "real_chat" / "more"
TWO_QUESTIONS = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And Japan?"},
        {"role": "assistant", "content": "Tokyo."},
    ]
}


def test_an_earlier_reply_under_a_shorter_header_than_the_prompt_trains_no_role_name(
    directories: dict[str, Path], tmp_path: Path
) -> None:
    """Qwen3.6's generation prompt ends in <think>\\n, its earlier replies follow <|im_start|>assistant\\n alone: the
    header is that shorter form, not <|im_start|> (which trained 'assistant\\n')."""
    directory = _directory_with(
        directories["qwen3"], tmp_path / "q36", (MORE / "qwen3_6.jinja").read_text(encoding="utf-8")
    )
    encoder = ChatEncoder(run_tokenizer_json(directory), directory, ChatSettings())
    encoded = encoder.encode(conversation_from_record(TWO_QUESTIONS, "row"))
    assert encoded is not None
    assert encoded.trained_text() == [
        "Paris.<|im_end|>",
        "\n</think>\n\nTokyo.<|im_end|>",
    ]  # the prompt holds <think>\n


def test_parallel_tool_calls_that_name_each_function_twice_are_trained_whole(
    directories: dict[str, Path], tmp_path: Path
) -> None:
    """Muse Glimmer writes each call's name in its header and in its body: a name met again neither ends nor extends
    the reply, so both calls and their closing <|eot|> are trained (only the first header was)."""
    specials = ("<|begin_of_text|>", "<|start|>", "<|message|>", "<|eot|>", "<|eom|>")
    directory = _directory_with(
        directories["llama3"], tmp_path / "muse", (MORE / "muse_glimmer.jinja").read_text(encoding="utf-8"), specials
    )
    call = lambda name, city: {"type": "function", "id": name, "function": {"name": name, "arguments": {"city": city}}}  # noqa: E731
    row = {
        "messages": [
            {"role": "user", "content": "Weather and time?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [call("get_weather", "Lyon"), call("get_time", "Paris")],
            },
            {"role": "tool", "tool_call_id": "get_weather", "name": "get_weather", "content": "18"},
            {"role": "tool", "tool_call_id": "get_time", "name": "get_time", "content": "noon"},
            {"role": "assistant", "content": "18 C, noon."},
        ],
        "tools": conversations()["tools"]["tools"],
    }
    encoder = ChatEncoder(run_tokenizer_json(directory), directory, ChatSettings())
    encoded = encoder.encode(conversation_from_record(row, "row"))
    assert encoded is not None
    calls, answer = encoded.trained_text()
    assert calls.startswith(" to=get_weather<|message|>") and "get_time" in calls and calls.endswith("<|eot|>")
    assert answer.endswith("18 C, noon.<|eot|>") and encoder.audit.partial_turns == 0


def test_special_token_text_anywhere_the_template_writes_is_refused(encoders: dict[str, ChatEncoder]) -> None:
    """In a tool call's arguments or in reasoning, <|im_end|> would end a reply in the middle of a call."""
    row = conversations()["tools"]
    row["messages"][1]["tool_calls"][0]["function"]["arguments"] = {"city": "<|im_end|>"}
    with pytest.raises(DataError, match=r"^row: message 2 \(assistant\)'s tool_calls holds the special token text"):
        encoders["qwen3"].encode(conversation_from_record(row, "row"))


def test_a_reply_of_weight_0_is_shown_not_trained(encoders: dict[str, ChatEncoder]) -> None:
    """OpenAI's fine-tuning rows: an assistant message with weight 0 is context, not a target."""
    row = {"messages": [dict(m) for m in TWO_QUESTIONS["messages"]]}
    row["messages"][2]["weight"] = 0
    encoded = encoders["qwen2.5"].encode(conversation_from_record(row, "row"))
    assert encoded is not None and encoded.trained_text() == ["Tokyo.<|im_end|>"]


def test_a_template_that_refuses_every_probe_is_one_line(directories: dict[str, Path], tmp_path: Path) -> None:
    """Nothing to learn its header and end of turn from: refused, rather than masks from empty marks."""
    template = "{% if not tools %}{{ raise_exception('tools are required') }}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
    directory = _directory_with(directories["qwen2.5"], tmp_path / "picky", template)
    encoder = ChatEncoder(run_tokenizer_json(directory), directory, ChatSettings())
    with pytest.raises(DataError, match=r"picky: the chat template refuses the simplest conversation"):
        encoder.encode(conversation_from_record(conversations()["tools"], "tools"))
