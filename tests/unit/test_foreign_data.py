"""Foreign token shards read where they are: build-nanogpt ``.npy`` and llm.c / modded-nanogpt ``.bin``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bigbatch.cli import main
from bigbatch.data.cache import ensure_prepared
from bigbatch.data.dataset import open_dataset
from bigbatch.data.foreign import BIN_MAGIC, ForeignDataset, foreign_files
from bigbatch.data.prepare import prepare_dataset
from bigbatch.data.shards import TokenDataset
from bigbatch.errors import DataError
from bigbatch.run.configuration.train_config import TrainConfig
from bigbatch.run.loop.trainer import Trainer


def tokens(n: int, seed: int) -> np.ndarray:
    """GPT-2-range ids, some above 32767 so a signed reading would show."""
    return np.random.default_rng(seed).integers(0, 50257, size=n).astype(np.uint16)


def write_bin(path: Path, data: np.ndarray, magic: int = BIN_MAGIC, version: int = 1, count: int | None = None) -> None:
    """An llm.c token file (as llm.c's dev/data/data_common.py write_datafile writes it)."""
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2] = magic, version, len(data) if count is None else count
    with open(path, "wb") as handle:
        handle.write(header.tobytes())
        handle.write(data.astype(np.uint16).tobytes())


@pytest.fixture
def npy_dir(tmp_path: Path) -> Path:
    """A build-nanogpt fineweb.py output directory."""
    root = tmp_path / "edu_fineweb10B"
    root.mkdir()
    np.save(root / "edufineweb_val_000000.npy", tokens(3_000, 0))
    np.save(root / "edufineweb_train_000001.npy", tokens(5_000, 1))
    np.save(root / "edufineweb_train_000002.npy", tokens(4_000, 2))
    return root


@pytest.fixture
def bin_dir(tmp_path: Path) -> Path:
    """An llm.c / modded-nanogpt data directory (llm.c keeps the raw text beside the .bin files)."""
    root = tmp_path / "fineweb10B"
    root.mkdir()
    write_bin(root / "fineweb_val_000000.bin", tokens(3_000, 3))
    write_bin(root / "fineweb_train_000001.bin", tokens(5_000, 4))
    write_bin(root / "fineweb_train_000002.bin", tokens(4_000, 5))
    (root / "tiny_shakespeare.txt").write_text("raw text that is not read\n")
    return root


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


def test_build_nanogpt_npy_directory_reads_as_is(npy_dir: Path) -> None:
    dataset = open_dataset(npy_dir)
    assert isinstance(dataset, ForeignDataset)
    meta = dataset.meta
    assert (meta.tokenizer, meta.vocab_size, meta.dtype) == ("gpt2", 50257, "uint16")
    assert (meta.mode, meta.eot_token) == ("packed", 50256)
    assert meta.shards == {
        "train": ["edufineweb_train_000001.npy", "edufineweb_train_000002.npy"],
        "val": ["edufineweb_val_000000.npy"],
    }
    assert meta.tokens == {"train": 9_000, "val": 3_000}
    assert dataset.vocab_size == 50257 and dataset.directory == npy_dir
    train = dataset.shard_arrays("train")
    assert [a.dtype for a in train] == [np.uint16, np.uint16]
    assert isinstance(train[0], np.memmap)
    np.testing.assert_array_equal(train[0], tokens(5_000, 1))
    np.testing.assert_array_equal(train[1], tokens(4_000, 2))
    np.testing.assert_array_equal(dataset.shard_arrays("val")[0], tokens(3_000, 0))
    dataset.check_token_ids(50257)


def test_llmc_bin_directory_reads_as_is_and_skips_other_files(bin_dir: Path) -> None:
    dataset = open_dataset(bin_dir)
    assert isinstance(dataset, ForeignDataset)
    assert dataset.meta.shards == {
        "train": ["fineweb_train_000001.bin", "fineweb_train_000002.bin"],
        "val": ["fineweb_val_000000.bin"],
    }
    assert dataset.meta.tokens == {"train": 9_000, "val": 3_000}
    train = dataset.shard_arrays("train")
    assert isinstance(train[0], np.memmap) and train[0].dtype == np.uint16 and train[0].ndim == 1
    np.testing.assert_array_equal(train[0], tokens(5_000, 4))
    np.testing.assert_array_equal(train[1], tokens(4_000, 5))
    np.testing.assert_array_equal(dataset.shard_arrays("val")[0], tokens(3_000, 3))
    dataset.check_token_ids(50257)


def test_a_glob_and_a_single_file_select_shards(bin_dir: Path) -> None:
    only_train = open_dataset(f"{bin_dir}/fineweb_train_*.bin")
    assert isinstance(only_train, ForeignDataset)
    assert only_train.meta.shards == {"train": ["fineweb_train_000001.bin", "fineweb_train_000002.bin"], "val": []}
    single = open_dataset(bin_dir / "fineweb_train_000002.bin")
    assert isinstance(single, ForeignDataset) and single.meta.tokens == {"train": 4_000, "val": 0}


def test_ensure_prepared_returns_foreign_data_as_is(npy_dir: Path, bin_dir: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    assert ensure_prepared(str(npy_dir), "byte", 0.1, cache_dir=cache) == npy_dir
    pattern = f"{bin_dir}/*.bin"
    assert str(ensure_prepared(pattern, "byte", 0.1, cache_dir=cache)) == pattern
    assert not cache.exists()


def test_raw_text_and_prepared_datasets_are_not_foreign(tmp_path: Path) -> None:
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("hello " * 200)
    assert foreign_files(str(tmp_path / "text")) is None
    assert foreign_files("builtin") is None
    prepare_dataset(str(tmp_path / "text"), tmp_path / "ds")  # its shards are .npy, but meta.json makes it bigbatch's
    assert foreign_files(str(tmp_path / "ds")) is None
    assert isinstance(open_dataset(tmp_path / "ds"), TokenDataset)


# --------------------------------------------------------------------------------------------
# Errors: one line, naming the file and what is wrong
# --------------------------------------------------------------------------------------------


def one_line_error(target: object) -> str:
    with pytest.raises(DataError) as info:
        open_dataset(target)  # type: ignore[arg-type]
    message = str(info.value)
    assert "\n" not in message
    return message


def test_wrong_magic_number(bin_dir: Path) -> None:
    write_bin(bin_dir / "fineweb_train_000001.bin", tokens(100, 0), magic=12345)
    message = one_line_error(bin_dir)
    assert "fineweb_train_000001.bin" in message and "wrong magic number 12345" in message and "20240520" in message


def test_wrong_version(bin_dir: Path) -> None:
    write_bin(bin_dir / "fineweb_val_000000.bin", tokens(100, 0), version=2)
    message = one_line_error(bin_dir)
    assert "fineweb_val_000000.bin" in message and "version 2" in message


def test_size_mismatch(bin_dir: Path) -> None:
    write_bin(bin_dir / "fineweb_train_000002.bin", tokens(1_000, 0), count=1_500)
    message = one_line_error(bin_dir)
    assert "fineweb_train_000002.bin" in message and "holds 1,000 tokens, header says 1,500" in message


def test_truncated_header(bin_dir: Path) -> None:
    (bin_dir / "fineweb_train_000002.bin").write_bytes(b"\x00" * 100)
    assert "shorter than the 1024-byte" in one_line_error(bin_dir)


def test_mixed_formats_are_refused(npy_dir: Path) -> None:
    write_bin(npy_dir / "fineweb_train_000009.bin", tokens(100, 0))
    message = one_line_error(npy_dir)
    assert "mixes" in message and ".npy" in message and ".bin" in message


def test_a_glob_matching_shards_and_other_files_is_refused(bin_dir: Path) -> None:
    with pytest.raises(DataError, match="narrow it"):
        open_dataset(f"{bin_dir}/*")


def test_npy_with_the_wrong_dtype(npy_dir: Path) -> None:
    np.save(npy_dir / "edufineweb_train_000001.npy", np.arange(10, dtype=np.int32))
    message = one_line_error(npy_dir)
    assert "edufineweb_train_000001.npy" in message and "uint16" in message


def test_damaged_npy(npy_dir: Path) -> None:
    path = npy_dir / "edufineweb_train_000002.npy"
    path.write_bytes(path.read_bytes()[:50])
    assert "edufineweb_train_000002.npy" in one_line_error(npy_dir)


def test_only_validation_files(npy_dir: Path) -> None:
    for path in npy_dir.glob("*train*"):
        path.unlink()
    assert "no training shards" in one_line_error(npy_dir)


def test_documents_mode_and_out_of_vocabulary_ids_are_clear_errors(bin_dir: Path) -> None:
    dataset = open_dataset(bin_dir)
    with pytest.raises(DataError, match="packed"):
        dataset.document_shards("train")
    data = tokens(100, 0)
    data[7] = 60_000
    write_bin(bin_dir / "fineweb_train_000001.bin", data)
    with pytest.raises(DataError, match="token id 60000"):
        open_dataset(bin_dir).check_token_ids(50257)


# --------------------------------------------------------------------------------------------
# Training on them
# --------------------------------------------------------------------------------------------


def tiny_config(data: str, out: Path) -> TrainConfig:
    config = TrainConfig()
    config.model.preset = "pico"
    config.data.data = data
    config.data.cache_dir = str(out.parent / "cache")
    config.batch.micro_batch, config.batch.seq_len, config.batch.total_batch_tokens = 2, 32, 128  # K = 2
    config.run.max_steps = 2
    config.run.eval_every = 2
    config.run.eval_batches = 1
    config.run.sample_tokens = 0  # sampling would load tiktoken's GPT-2 encoding (a download)
    config.run.out = str(out)
    return config


@pytest.mark.parametrize("kind", ["npy", "bin"])
def test_trainer_runs_two_steps_on_foreign_shards(kind: str, npy_dir: Path, bin_dir: Path, tmp_path: Path) -> None:
    data = str(npy_dir) if kind == "npy" else f"{bin_dir}/*.bin"
    out = tmp_path / f"run-{kind}"
    result = Trainer(tiny_config(data, out)).train()
    assert result.steps == 2 and np.isfinite(result.final_loss)
    assert result.val_loss is not None and np.isfinite(result.val_loss)
    assert result.final_loss > 8.0  # about ln(50257) = 10.8: random GPT-2 ids, an untrained model
    assert not (tmp_path / "cache").exists()  # nothing was converted or cached


def test_cli_train_takes_a_glob_of_bin_files(bin_dir: Path, tmp_path: Path) -> None:
    code = main(
        [
            "train",
            "--data",
            f"{bin_dir}/fineweb_*.bin",
            "--model",
            "pico",
            "--seq-len",
            "32",
            "--micro-batch",
            "2",
            "--total-batch-tokens",
            "64",
            "--max-steps",
            "1",
            "--eval-every",
            "1",
            "--eval-batches",
            "1",
            "--sample-tokens",
            "0",
            "--out",
            str(tmp_path / "run"),
            "--cache-dir",
            str(tmp_path / "cache"),
        ]
    )
    assert code == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records if r["kind"] == "step"] == ["step"]
    assert not (tmp_path / "cache").exists()
