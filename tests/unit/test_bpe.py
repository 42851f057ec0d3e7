"""The byte-level BPE trained on the corpus (``bpe:VOCAB``), and parallel preparation."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from text_corpus import text_corpus_str

import bigbatch.data.encode as encode_module
import bigbatch.data.text as text_module
from bigbatch.cli import main
from bigbatch.data.cache import ensure_prepared
from bigbatch.data.prepare import prepare_dataset
from bigbatch.data.shards import META_FILE, TokenDataset
from bigbatch.data.text import split_text
from bigbatch.data.tokenizers import BPE_FILE, get_tokenizer, train_bpe
from bigbatch.errors import ConfigError, DataError
from bigbatch.run.configuration.train_config import TrainConfig
from bigbatch.run.loop.trainer import Trainer

TRICKY = [
    "héllo wörld, naïve café — “quotes” and ‘apostrophes’\n",
    "日本語のテキスト、中文文本，한국어 텍스트\n",
    "emoji 😀🎉👩‍👩‍👧 and flags 🇫🇷\n",
    "tabs\tand\r\nwindows line ends\n\n\n   indented\n \n",
    "a literal <|endoftext|> inside a document stays text\n",
    "controls \x00\x01\x1b[0m and nbsp\u00a0\u3000ideographic space\n",
    "don't won't it's we're I'll they've I'd\n",
]


def corpus_text(limit: int = 200_000) -> str:
    return text_corpus_str(limit)


@pytest.fixture(scope="module")
def bpe():
    text = corpus_text()
    return train_bpe("bpe:512", (text[i : i + 10_000] for i in range(0, len(text), 10_000)))


# --------------------------------------------------------------------------------------------
# The tokenizer
# --------------------------------------------------------------------------------------------


def test_bpe_trains_to_the_vocabulary_and_compresses(bpe) -> None:
    assert bpe.name == "bpe:512" and bpe.vocab_size == 512
    assert bpe.eot_token is not None and 0 <= bpe.eot_token < 512
    text = corpus_text(20_000)
    ids = bpe.encode(text.encode())
    assert max(ids) < 512 and len(ids) < len(text.encode()) / 1.5  # merges were learnt


@pytest.mark.parametrize("text", [corpus_text(50_000), "", " ", *TRICKY, "".join(TRICKY)])
def test_bpe_round_trips_any_utf8_text(bpe, text: str) -> None:
    ids = bpe.encode(text.encode("utf-8"))
    assert bpe.decode(ids) == text
    assert bpe.eot_token not in ids  # not even for a literal "<|endoftext|>"


def test_bpe_round_trips_random_unicode(bpe) -> None:
    rng = random.Random(1)
    for _ in range(50):
        ranges = [(0x20, 0x7E), (0xA0, 0xD7FF), (0xE000, 0x10FFFF)]  # printable ASCII, then no surrogates
        text = "".join(chr(rng.randint(*rng.choice(ranges))) for _ in range(rng.randint(1, 40)))
        assert bpe.decode(bpe.encode(text.encode("utf-8"))) == text


def test_bpe_saved_and_loaded_from_the_dataset_directory(bpe, tmp_path: Path) -> None:
    bpe.save(tmp_path / BPE_FILE)
    loaded = get_tokenizer("bpe:512", tmp_path)
    sample = "".join(TRICKY).encode()
    assert loaded.encode(sample) == bpe.encode(sample) and loaded.vocab_size == 512


def test_bpe_without_its_file_or_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="tokenizer.json is missing") as info:
        get_tokenizer("bpe:512", tmp_path)
    assert "\n" not in str(info.value) and "prepare" in str(info.value)
    with pytest.raises(ConfigError, match="dataset directory"):
        get_tokenizer("bpe:512")


@pytest.mark.parametrize("name", ["bpe:", "bpe:abc", "bpe:100", "bpe:-5", "bpe:99999999"])
def test_bad_bpe_names_are_config_errors(name: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="bpe:VOCAB"):
        get_tokenizer(name, tmp_path)
    (tmp_path / "c.txt").write_text("hello")
    with pytest.raises(ConfigError):
        prepare_dataset(str(tmp_path / "c.txt"), tmp_path / "out", tokenizer_name=name)
    assert not (tmp_path / "out").exists()


def test_cutting_text_into_pieces_changes_no_token(bpe) -> None:
    text = ("".join(TRICKY) + corpus_text(30_000)).encode()
    pieces = split_text(text, 200)
    assert len(pieces) > 20 and b"".join(pieces) == text
    whole = bpe.encode(text)
    assert [t for piece in pieces for t in bpe.encode(piece)] == whole


def test_the_piece_size_is_read_when_text_is_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests below shrink ``PIECE_BYTES`` to cut documents into many pieces; that only works when
    ``split_text`` reads it when called (a default argument bound at import would ignore the patch)."""
    text = corpus_text(30_000).encode()
    assert len(split_text(text)) == 1
    monkeypatch.setattr(text_module, "PIECE_BYTES", 1_000)
    assert len(split_text(text)) > 10


# --------------------------------------------------------------------------------------------
# prepare --tokenizer bpe:VOCAB
# --------------------------------------------------------------------------------------------


def test_prepare_with_bpe_keeps_the_tokenizer_beside_the_shards(tmp_path: Path) -> None:
    text = corpus_text(100_000)
    (tmp_path / "c.txt").write_text(text, encoding="utf-8")
    out = tmp_path / "ds"
    meta = prepare_dataset(str(tmp_path / "c.txt"), out, tokenizer_name="bpe:400", val_fraction=0.1)
    assert (out / BPE_FILE).is_file()
    assert not list(tmp_path.glob(".ds.tmp-*")) and not list(out.glob(".*"))
    recorded = json.loads((out / META_FILE).read_text())
    assert recorded["tokenizer"] == "bpe:400" and recorded["vocab_size"] == meta.vocab_size == 400
    assert recorded["dtype"] == "uint16"
    tokenizer = get_tokenizer("bpe:400", out)
    dataset = TokenDataset(out)
    stream = np.concatenate(dataset.shard_arrays("train") + dataset.shard_arrays("val")).tolist()
    assert stream[-1] == tokenizer.eot_token and stream.count(tokenizer.eot_token) == 1
    assert tokenizer.decode(stream[:-1]) == text


def test_trainer_and_sample_use_the_datasets_bpe(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "c.txt").write_text(corpus_text(60_000), encoding="utf-8")
    config = TrainConfig()
    config.model.preset = "pico"
    config.data.data = str(tmp_path / "c.txt")
    config.data.tokenizer = "bpe:300"
    config.data.cache_dir = str(tmp_path / "cache")
    config.batch.micro_batch, config.batch.seq_len, config.batch.total_batch_tokens = 2, 32, 128
    config.run.max_steps, config.run.eval_every, config.run.eval_batches = 2, 2, 1
    config.run.sample_tokens = 20
    config.run.out = str(tmp_path / "run")
    result = Trainer(config).train()
    assert result.steps == 2 and result.sample is not None
    (prepared,) = (tmp_path / "cache").iterdir()
    assert ":" not in prepared.name and (prepared / BPE_FILE).is_file()
    assert json.loads((prepared / META_FILE).read_text())["tokenizer"] == "bpe:300"
    assert ensure_prepared(str(tmp_path / "c.txt"), "bpe:300", 0.1, cache_dir=tmp_path / "cache") == prepared

    capsys.readouterr()
    code = main(["sample", "--checkpoint", str(tmp_path / "run"), "--prompt", "KING ", "--max-new-tokens", "15"])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("KING ") and len(out) > len("KING \n")


# --------------------------------------------------------------------------------------------
# Parallel preparation gives the same bytes
# --------------------------------------------------------------------------------------------


@pytest.fixture
def mixed_corpus(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    root.mkdir()
    text = corpus_text(120_000)
    (root / "a_big.txt").write_text(text, encoding="utf-8")
    for i, piece in enumerate(TRICKY):
        (root / f"b_{i}.txt").write_text(piece * (i + 1), encoding="utf-8")
    (root / "empty.txt").write_text("")
    return root


@pytest.mark.parametrize("tokenizer", ["byte", "bpe:350"])
@pytest.mark.parametrize("mode", ["packed", "documents"])
def test_parallel_prepare_is_byte_identical_to_serial(
    tokenizer: str, mode: str, mixed_corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if mode == "documents":  # prompts masked: pieces of prompt and completion must stay apart
        records = [
            {"prompt": f"Q{i}: {TRICKY[i % len(TRICKY)]}", "completion": corpus_text(3_000)[i * 50 :]}
            for i in range(20)
        ]
        (mixed_corpus / "c.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    monkeypatch.setattr(text_module, "PIECE_BYTES", 1_000)  # many pieces and tasks, documents spanning tasks
    monkeypatch.setattr(encode_module, "TASK_BYTES", 3_000)
    serial = tmp_path / "serial"
    parallel = tmp_path / "parallel"
    prepare_dataset(str(mixed_corpus), serial, tokenizer_name=tokenizer, mode=mode, shard_tokens=20_000, workers=1)
    prepare_dataset(str(mixed_corpus), parallel, tokenizer_name=tokenizer, mode=mode, shard_tokens=20_000, workers=2)
    names = sorted(p.name for p in serial.iterdir())
    assert names == sorted(p.name for p in parallel.iterdir())
    assert len([n for n in names if n.startswith("train_")]) > 1
    if mode == "documents":
        assert any(n.endswith(".mask.npy") for n in names)
    for name in names:
        assert (serial / name).read_bytes() == (parallel / name).read_bytes(), name


def test_pieces_give_the_tokens_of_whole_documents(
    mixed_corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(text_module, "PIECE_BYTES", 1_000)
    whole = tmp_path / "whole"
    prepare_dataset(str(mixed_corpus), whole, tokenizer_name="bpe:350", workers=1)
    tokenizer = get_tokenizer("bpe:350", whole)
    expected: list[int] = []
    texts = [p for p in sorted(mixed_corpus.iterdir()) if p.stat().st_size and b"\x00" not in p.read_bytes()]
    for path in texts:  # (binary and empty files are skipped)
        expected += tokenizer.encode(path.read_bytes()) + [tokenizer.eot_token]
    dataset = TokenDataset(whole)
    assert np.concatenate(dataset.shard_arrays("train") + dataset.shard_arrays("val")).tolist() == expected
