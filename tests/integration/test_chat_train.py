"""Fine-tuning a chat model on conversations, end to end: ``bigbatch prepare`` of ``messages`` rows and its audit,
and ``bigbatch train --model hf:DIR`` on them, exact whatever the micro-batch (packed and one per row), with the
model's chat template carried into the run's tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from chat_models import chat_model_dir, conversations
from exactness import rel_diff
from helpers import assert_one_line_error, run_main
from reliability_runs import final_model, step_losses


@pytest.fixture(scope="module")
def chat_setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("chat")
    model = chat_model_dir(root / "model", "qwen2.5", with_model=True)
    rows = conversations() * 4  # uneven assistant lengths, many turns
    data = root / "chat.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return model, data


def _train(model: Path, data: Path, out: Path, micro_batch: int, *extra: str) -> tuple[int, str, str]:
    return run_main(
        [
            "train",
            "--model",
            f"hf:{model}",
            "--data",
            str(data),
            "--data-mode",
            "documents",
            "--seq-len",
            "64",
            "--micro-batch",
            str(micro_batch),
            "--total-batch-tokens",
            "512",
            "--max-steps",
            "3",
            "--eval-every",
            "0",
            "--sample-tokens",
            "0",
            "--noise-scale-every",
            "0",
            "--lr",
            # AdamW turns the rounding of near-zero gradient entries into moves of up to lr each step: at 1e-2 the
            # 1e-5 bar held on one CPU's kernels only (o_proj at 1.6e-5 on another); at 1e-3 it holds ~5x over
            "1e-3",
            "--warmup-steps",
            "0",
            "--cache-dir",
            str(out.parent / "cache"),
            "--out",
            str(out),
            *extra,
        ]
    )


def test_prepare_prints_the_audit_and_shows_the_trained_spans(tmp_path: Path, chat_setup: tuple[Path, Path]) -> None:
    model, data = chat_setup
    code, out, err = run_main(
        [
            "prepare",
            str(data),
            "--out",
            str(tmp_path / "d"),
            "--tokenizer",
            f"file:{model}",
            "--mode",
            "documents",
            "--show",
            "1",
        ]
    )
    assert code == 0, err
    assert "trained assistant turn" in out and "end on a trained end-of-turn token (every one)" in out
    assert "\u27e6" in out and "<|im_end|>\u27e7" in out


def test_prepare_of_a_bad_row_is_one_line(tmp_path: Path, chat_setup: tuple[Path, Path]) -> None:
    model, _ = chat_setup
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "narrator", "content": "x"}]}) + "\n")
    line = assert_one_line_error(
        *run_main(
            ["prepare", str(data), "--out", str(tmp_path / "d"), "--tokenizer", f"file:{model}", "--mode", "documents"]
        )
    )
    assert "bad.jsonl:1: message 1 has role 'narrator'" in line
    assert not (tmp_path / "d").exists()


@pytest.mark.slow
@pytest.mark.parametrize("pack", ["on", "off"])
def test_chat_training_is_exact_whatever_the_micro_batch(
    tmp_path: Path, chat_setup: tuple[Path, Path], pack: str
) -> None:
    """8 rows x K 1 and 1 row x K 8 train on the same conversations each step, with very uneven assistant tokens
    per row: the same parameters (relative L2 <= 1e-5)."""
    model, data = chat_setup
    for micro_batch in (8, 1):
        code, out, err = _train(model, data, tmp_path / f"mb{micro_batch}", micro_batch, "--pack", pack)
        assert code == 0, out + err
    big, small = final_model(tmp_path / "mb8"), final_model(tmp_path / "mb1")
    assert big.keys() == small.keys()
    for name, value in big.items():
        if name.endswith("k_proj.bias"):  # an exact gradient of zero: rounding only (see exactness.py), held absolute
            assert (small[name] - value).abs().max().item() <= 1e-5, name
            continue
        assert rel_diff(small[name].float(), value.float()) <= 1e-5, name
    losses = [step_losses(tmp_path / f"mb{mb}") for mb in (8, 1)]
    assert len(losses[0]) == 3 and losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert losses[0][0] != losses[0][-1]  # it trained: the compared parameters moved


def test_the_run_keeps_the_chat_template(tmp_path: Path, chat_setup: tuple[Path, Path]) -> None:
    model, data = chat_setup
    code, out, err = _train(model, data, tmp_path / "run", 8)
    assert code == 0, out + err
    saved = json.loads((tmp_path / "run" / "tokenizer" / "tokenizer_config.json").read_text())
    original = json.loads((model / "tokenizer_config.json").read_text())
    assert saved["chat_template"] == original["chat_template"]


def _real_template_model(root: Path, family: str) -> Path:
    """The tiny Qwen2 chat model with the byte copy of a real template (tests/support/real_chat/) in place of its
    look-alike: the tokenizer holds the ChatML control tokens every Qwen template writes."""
    from real_templates import template_text

    model = chat_model_dir(root / f"model-{family}", "qwen2.5", with_model=True)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template_text(family)}))
    return model


LONG_ROW = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        *[
            m
            for n in range(6)
            for m in (
                {"role": "user", "content": f"question {n}? " + "why " * 6},
                {"role": "assistant", "content": f"answer {n}. " + "so " * 6},
            )
        ],
    ]
}


def test_qwen3_as_shipped_trains_multi_turn_and_keeps_long_conversations_whole(tmp_path: Path) -> None:
    """Qwen3's real template (an empty think block in the last reply only) trained on multi-turn rows, a greeting
    before the first question and conversations longer than a row: the oldest rounds are left out (counted in the
    audit), never a reply cut from its question; prepare --seq-len says the same, and a dataset prepared without
    a limit is refused by a run whose rows are shorter, in one line."""
    model = _real_template_model(tmp_path, "qwen3")
    greeting = {"messages": [{"role": "assistant", "content": "Hi!"}, *conversations()[0]["messages"]]}
    rows = [*conversations()[:6], greeting, LONG_ROW] * 3
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    code, out, err = run_main(
        ["prepare", str(data), "--out", str(tmp_path / "d"), "--tokenizer", f"file:{model}", "--mode", "documents"]
        + ["--seq-len", "64", "--val-fraction", "0"]
    )
    assert code == 0, err
    assert "kept without their oldest turns" in out and "(--long-conversations drop-oldest-turns)" in out
    code, out, err = _train(model, data, tmp_path / "run", 4)
    assert code == 0, out + err
    unlimited = tmp_path / "whole"
    code, out, err = run_main(
        ["prepare", str(data), "--out", str(unlimited), "--tokenizer", f"file:{model}", "--mode", "documents"]
    )
    assert code == 0, err
    line = assert_one_line_error(*_train(model, unlimited, tmp_path / "run2", 4))
    assert "longer than seq_len+1=65 tokens" in line and "prepare the conversations with --seq-len 64" in line
    refused = assert_one_line_error(*_train(model, data, tmp_path / "run3", 4, "--long-conversations", "refuse"))
    assert "longer than a row of 65 (--seq-len + 1)" in refused
