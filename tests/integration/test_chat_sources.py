"""Chat data as it is found, from the command line: a ``.jsonl`` of conversations given to ``prepare`` and
``train`` without any mode is read as conversations and said so in one line (``--data-mode auto``, the default),
a run on text stays the run it was, and a ``.jsonl`` that is not UTF-8 is one line naming the file and the line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from chat_models import chat_model_dir, conversations
from helpers import assert_one_line_error, run_main

from bigbatch.run.configuration.config_sources import config_from_dict
from bigbatch.run.configuration.identity import default_run_dir, identity_settings

TRAIN = (
    "--seq-len",
    "64",
    "--micro-batch",
    "4",
    "--total-batch-tokens",
    "256",
    "--max-steps",
    "1",
    "--eval-every",
    "0",
    "--sample-tokens",
    "0",
    "--noise-scale-every",
    "0",
    "--cache-dir",
    "cache",
)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return chat_model_dir(tmp_path_factory.mktemp("chat") / "model", "qwen2.5", with_model=True)


def _chat_file(path: Path) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in conversations() * 2))
    return path


@pytest.mark.usefixtures("isolated")
def test_prepare_without_a_mode_reads_conversations_and_says_so(tmp_path: Path, chat_model: Path) -> None:
    data = _chat_file(tmp_path / "chat.jsonl")
    code, out, err = run_main(["prepare", str(data), "--out", "d", "--tokenizer", f"file:{chat_model}"])
    assert code == 0, err
    assert "d: read as conversations (--mode auto: the first row holds 'messages'" in out
    assert f"(file:{chat_model}/tokenizer.json, vocab" in out and ", documents)" in out
    code, out, err = run_main(
        ["prepare", str(data), "--out", "d2", "--tokenizer", f"file:{chat_model}", "--mode", "documents"]
    )
    assert code == 0, err
    assert "read as conversations" not in out  # the mode was given: nothing to explain


@pytest.mark.usefixtures("isolated")
def test_train_without_a_data_mode_trains_on_conversations_and_says_so(tmp_path: Path, chat_model: Path) -> None:
    data = _chat_file(tmp_path / "chat.jsonl")
    code, out, err = run_main(["train", "--model", f"hf:{chat_model}", "--data", str(data), "--out", "run", *TRAIN])
    assert code == 0, out + err
    said = [line for line in out.splitlines() if "read as conversations" in line]
    assert len(said) == 1 and "chat | read as conversations (--data-mode auto" in said[0], out
    assert 'data_mode = "documents"' in (tmp_path / "run" / "config.toml").read_text()  # saved resolved


def test_auto_is_the_same_run_as_the_mode_it_resolves_to(tmp_path: Path, chat_model: Path) -> None:
    """The default run directory (the settings' fingerprint) of --data-mode auto is that of the mode it resolves
    to: packed for text (the directory every run on text had before auto), documents for conversations."""
    chat = _chat_file(tmp_path / "chat.jsonl")
    text = tmp_path / "corpus.txt"
    text.write_text("some text\n" * 100)
    for data, model, resolved in ((text, "pico", "packed"), (chat, f"hf:{chat_model}", "documents")):
        runs = {
            mode: config_from_dict({"model": {"preset": model}, "data": {"data": str(data), "data_mode": mode}})
            for mode in ("auto", "packed", "documents")
        }
        assert identity_settings(runs["auto"])["data.data_mode"] == resolved
        assert default_run_dir(runs["auto"]) == default_run_dir(runs[resolved])
        other = "documents" if resolved == "packed" else "packed"
        assert default_run_dir(runs["auto"]) != default_run_dir(runs[other])


@pytest.mark.usefixtures("isolated")
@pytest.mark.parametrize("command", ["prepare", "train"])
def test_a_jsonl_that_is_not_utf8_is_one_line_naming_the_file_and_the_line(tmp_path: Path, command: str) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_bytes(b'{"text": "first"}\n\n{"text": "na\xefve"}\n')
    if command == "prepare":
        argv = ["prepare", str(data), "--out", "d"]
    else:
        argv = ["train", "--model", "pico", "--data", str(data), "--out", "run", *TRAIN]
    line = assert_one_line_error(*run_main(argv))
    assert f"{data}:3: not valid UTF-8 (byte 0xef at byte 13 of the line)" in line
    assert "re-encode it as UTF-8" in line
    assert not (tmp_path / "d").exists()
