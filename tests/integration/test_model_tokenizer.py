"""``--init-from DIR`` with ``--tokenizer auto``: the directory's own tokenizer.json prepares the data (offline, no
tiktoken download), the run says so and owns a copy; without one it falls back as before, saying so; a tokenizer
whose ids do not fit the model is one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import assert_one_line_error, corpus_bytes, run_main

from bigbatch.data.dataset import open_dataset
from bigbatch.data.tokenizers import get_tokenizer

transformers = pytest.importorskip("transformers")


def tokenizer_json(path: Path, vocab_size: int, text: str) -> Path:
    """A small byte-level BPE with an end-of-text token, trained here on ``text``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator([text[i : i + 2000] for i in range(0, len(text), 2000)], trainer)
    tokenizer.save(str(path))
    return path


def gpt2_dir(root: Path, vocab_size: int, with_tokenizer: bool, text: str) -> Path:
    directory = root / "model"
    config = transformers.GPT2Config(vocab_size=vocab_size, n_positions=64, n_embd=32, n_layer=2, n_head=2)
    transformers.GPT2LMHeadModel(config).save_pretrained(directory)
    if with_tokenizer:
        tokenizer_json(directory / "tokenizer.json", vocab_size, text)
    return directory


def args(root: Path, model: Path, *extra: str, hf: bool = False) -> list[str]:
    source = ["--model", f"hf:{model}"] if hf else ["--init-from", str(model)]
    return [
        "train",
        *source,
        "--data",
        str(root / "c.txt"),
        "--micro-batch",
        "2",
        "--seq-len",
        "32",
        "--total-batch-tokens",
        "128",
        "--max-steps",
        "2",
        "--eval-every",
        "0",
        "--sample-tokens",
        "0",
        "--cache-dir",
        str(root / "cache"),
        "--out",
        str(root / "run"),
        *extra,
    ]


@pytest.fixture
def text(tmp_path: Path) -> str:
    data = corpus_bytes(30_000).decode()
    (tmp_path / "c.txt").write_text(data)
    return data


NO_NETWORK = Path(__file__).resolve().parents[1] / "support" / "no_network.py"


@pytest.mark.slow
def test_auto_uses_the_model_directorys_own_tokenizer_offline(tmp_path: Path, text: str) -> None:
    model = gpt2_dir(tmp_path, 320, with_tokenizer=True, text=text)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(NO_NETWORK), *args(tmp_path, model)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "NETWORK:" not in done.stderr  # the model's own tokenizer: nothing to download
    assert f"--tokenizer auto: the model's own tokenizer, {model / 'tokenizer.json'}" in done.stdout
    name = f"file:{model / 'tokenizer.json'}"
    dataset = open_dataset(next(p for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".")))
    assert dataset.meta.tokenizer == name
    # The prepared tokens are the model tokenizer's own ids (the corpus is one document; the split keeps its head
    # for training).
    ids = get_tokenizer(name).encode(text.encode())
    assert dataset.shard_arrays("train")[0][:50].tolist() == ids[:50]
    assert (tmp_path / "run" / "tokenizer").is_dir()  # the run's own copy
    # The same command again resumes: the saved tokenizer is the same file by content.
    code, out, err = run_main(args(tmp_path, model, "--max-steps", "3"))
    assert code == 0, err
    assert "resumed from" in out


def test_an_hf_model_directory_brings_its_tokenizer_too(tmp_path: Path, text: str) -> None:
    model = gpt2_dir(tmp_path, 320, with_tokenizer=True, text=text)
    code, out, err = run_main(args(tmp_path, model, hf=True))
    assert code == 0, err
    assert f"--tokenizer auto: the model's own tokenizer, {model / 'tokenizer.json'}" in out


@pytest.mark.parametrize("hf", [False, True])
def test_a_directory_without_a_tokenizer_falls_back_and_says_so(tmp_path: Path, text: str, hf: bool) -> None:
    model = gpt2_dir(tmp_path, 256, with_tokenizer=False, text=text)
    code, out, err = run_main(args(tmp_path, model, hf=hf))
    assert code == 0, err
    assert f"--tokenizer auto: {model} has no tokenizer.json; using the data's byte tokenizer" in out


def test_a_tokenizer_larger_than_the_model_is_one_line(tmp_path: Path, text: str) -> None:
    model = gpt2_dir(tmp_path, 300, with_tokenizer=False, text=text)
    tokenizer_json(model / "tokenizer.json", 340, text)
    code, out, err = run_main(args(tmp_path, model))
    line = assert_one_line_error(code, out, err)
    assert "tokenizer" in line and "300" in line
    assert not (tmp_path / "run").exists()
