"""The data pipeline: the token-stream loader, dataset preparation, caching, shard reading, tokenizers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import bigbatch.data.cache as cache_module
from bigbatch.data.cache import ensure_prepared
from bigbatch.data.prepare import prepare_dataset
from bigbatch.data.shards import META_FILE, TokenDataset
from bigbatch.data.stream import TokenStreamLoader
from bigbatch.data.tokenizers import get_tokenizer
from bigbatch.errors import BigBatchError, ConfigError, DataError

# --------------------------------------------------------------------------------------------
# TokenStreamLoader
# --------------------------------------------------------------------------------------------


def shard(length: int, base: int = 0) -> np.ndarray:
    """A uint16 shard whose token values reveal their positions: ``base + i``."""
    return (np.arange(base, base + length) % 50_000).astype(np.uint16)


def flat(batch) -> list[int]:
    return batch.inputs.flatten().tolist()


def test_targets_are_inputs_shifted_by_one_token() -> None:
    loader = TokenStreamLoader([shard(100)], micro_batch=2, seq_len=4)
    batch = loader.next_micro_batch()
    assert batch.inputs.shape == (2, 4) and batch.targets.shape == (2, 4)
    assert batch.inputs.dtype == torch.int64 and batch.targets.dtype == torch.int64
    assert batch.inputs.flatten().tolist() == list(range(0, 8))
    assert batch.targets.flatten().tolist() == list(range(1, 9))
    # rows are consecutive sequences of the stream
    assert batch.inputs[1].tolist() == [4, 5, 6, 7]
    assert batch.targets[1].tolist() == [5, 6, 7, 8]
    second = loader.next_micro_batch()
    assert second.inputs.flatten().tolist() == list(range(8, 16))
    assert second.targets.flatten().tolist() == list(range(9, 17))


def test_token_values_above_int16_survive() -> None:
    data = np.array([40_000 + i for i in range(9)], dtype=np.uint16)
    batch = TokenStreamLoader([data], micro_batch=1, seq_len=8).next_micro_batch()
    assert batch.inputs.flatten().tolist() == list(range(40_000, 40_008))


def test_two_ranks_read_disjoint_windows_that_tile_the_global_window() -> None:
    B, T, world = 2, 4, 2
    window = B * T  # 8 tokens per rank
    n_windows = 5
    data = shard(window * world * n_windows + 1)  # exactly 5 global windows
    ranks = [TokenStreamLoader([data], B, T, rank=r, world_size=world) for r in range(world)]
    seen: list[int] = []
    for j in range(n_windows):
        per_rank = [flat(loader.next_micro_batch()) for loader in ranks]
        for r, tokens in enumerate(per_rank):
            start = j * window * world + r * window
            assert tokens == list(range(start, start + window)), (j, r)
        assert not set(per_rank[0]) & set(per_rank[1])
        # the two ranks together cover one contiguous global window
        assert sorted(per_rank[0] + per_rank[1]) == list(range(j * window * world, (j + 1) * window * world))
        seen.extend(per_rank[0] + per_rank[1])
    assert sorted(seen) == list(range(window * world * n_windows))  # no token read twice, none skipped


def test_rank_outside_world_size_is_rejected() -> None:
    with pytest.raises(ValueError):
        TokenStreamLoader([shard(100)], 2, 4, rank=2, world_size=2)


def test_wraps_to_rank_start_of_first_shard_and_counts_epochs() -> None:
    B, T, world = 2, 4, 2
    global_window = B * T * world  # 16
    data = shard(global_window * 3 + 10)  # 3 full global windows plus a short tail of 10 tokens
    for rank in range(world):
        loader = TokenStreamLoader([data], B, T, rank=rank, world_size=world)
        first = flat(loader.next_micro_batch())
        assert first[0] == rank * B * T
        loader.next_micro_batch()
        assert loader.epoch == 0
        third = flat(loader.next_micro_batch())
        assert third[0] == 2 * global_window + rank * B * T
        assert loader.epoch == 1  # the tail (10 tokens) cannot hold another window
        assert flat(loader.next_micro_batch()) == first
        assert loader.epoch == 1


def test_multi_shard_traversal_skips_tails_and_short_shards() -> None:
    B, T = 2, 4  # window 8, needs 9 tokens
    shards = [
        shard(50, base=0),  # windows at 0, 8, 16, 24, 32, 40; tail 48..49 skipped
        shard(8, base=10_000),  # exactly one window but not the +1 target token: skipped
        shard(40, base=20_000),  # windows at 0, 8, 16, 24; tail skipped
        shard(3, base=30_000),  # far too short: skipped
    ]
    loader = TokenStreamLoader(shards, B, T)
    assert loader.usable == [0, 2]
    expected_starts = [0, 8, 16, 24, 32, 40, 20_000, 20_008, 20_016, 20_024]
    starts = []
    epochs = []
    for _ in expected_starts:
        tokens = flat(loader.next_micro_batch())
        assert tokens == list(range(tokens[0], tokens[0] + 8))  # always contiguous within one shard
        starts.append(tokens[0])
        epochs.append(loader.epoch)
    assert starts == expected_starts
    assert epochs == [0] * 9 + [1]
    assert flat(loader.next_micro_batch())[0] == 0  # second epoch starts at the first shard again
    assert loader.shard_index == 0


def test_multi_shard_two_ranks_cover_each_shard_without_overlap() -> None:
    B, T, world = 1, 4, 2  # 4 tokens per rank, global window 8 (+1)
    shards = [shard(30, base=0), shard(5, base=10_000), shard(20, base=20_000)]
    ranks = [TokenStreamLoader(shards, B, T, rank=r, world_size=world) for r in range(world)]
    # shard 0: global windows at 0, 8, 16 (24 + 9 > 30); shard 1 skipped; shard 2: 0, 8 (16 + 9 > 20)
    expected_global = [0, 8, 16, 20_000, 20_008]
    for g in expected_global:
        r0, r1 = (flat(loader.next_micro_batch()) for loader in ranks)
        assert r0 == list(range(g, g + 4))
        assert r1 == list(range(g + 4, g + 8))
    assert [loader.epoch for loader in ranks] == [1, 1]
    assert flat(ranks[1].next_micro_batch()) == [4, 5, 6, 7]


@pytest.mark.parametrize(("rank", "world"), [(0, 1), (1, 2)])
@pytest.mark.parametrize("consumed", [0, 3, 7, 13])
def test_state_dict_round_trip_resumes_identically(rank: int, world: int, consumed: int) -> None:
    shards = [shard(70, base=0), shard(4, base=5_000), shard(45, base=10_000)]

    def make() -> TokenStreamLoader:
        return TokenStreamLoader(shards, 2, 3, rank=rank, world_size=world)

    original = make()
    for _ in range(consumed):
        original.next_micro_batch()
    state = original.state_dict()
    # the state is plain ints, so it survives a weights_only checkpoint
    assert all(isinstance(v, int) for v in state.values())

    fresh = make()
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    for _ in range(25):  # crosses shard boundaries and at least one wrap-around
        a, b = original.next_micro_batch(), fresh.next_micro_batch()
        assert torch.equal(a.inputs, b.inputs)
        assert torch.equal(a.targets, b.targets)
        assert (original.epoch, original.shard_index, original.offset) == (fresh.epoch, fresh.shard_index, fresh.offset)
    assert original.epoch >= 1


def test_load_state_dict_rejects_state_from_other_data() -> None:
    loader = TokenStreamLoader([shard(50), shard(4)], 2, 4)
    with pytest.raises(DataError, match="shard 1"):
        loader.load_state_dict({"shard": 1, "offset": 0, "epoch": 0})  # shard 1 is too short to be usable
    with pytest.raises(DataError, match="offset"):
        loader.load_state_dict({"shard": 0, "offset": 51, "epoch": 0})  # beyond the shard's 50 tokens
    # Inside the shard but without room for a whole window (saved under a smaller window):
    # the reader continues where it would go next, here the start of the next pass.
    loader.load_state_dict({"shard": 0, "offset": 48, "epoch": 0})
    assert (loader.shard_index, loader.offset, loader.epoch) == (0, 0, 1)


def test_reset_returns_to_the_start() -> None:
    loader = TokenStreamLoader([shard(30)], 2, 4)
    first = flat(loader.next_micro_batch())
    for _ in range(4):
        loader.next_micro_batch()
    loader.reset()
    assert (loader.epoch, loader.offset) == (0, 0)
    assert flat(loader.next_micro_batch()) == first


@pytest.mark.parametrize(("world", "needed"), [(1, 129), (2, 257)])
def test_corpus_shorter_than_one_window_is_a_data_error(world: int, needed: int) -> None:
    with pytest.raises(DataError) as info:
        TokenStreamLoader([shard(100), shard(128)], micro_batch=4, seq_len=32, rank=0, world_size=world)
    message = str(info.value)
    assert str(needed) in message
    assert "128" in message  # the longest shard it did find
    assert "\n" not in message


def test_exactly_one_window_is_enough() -> None:
    loader = TokenStreamLoader([shard(129)], micro_batch=4, seq_len=32)
    assert flat(loader.next_micro_batch()) == list(range(128))
    assert loader.epoch == 1


def test_no_shards_at_all_is_a_data_error() -> None:
    with pytest.raises(DataError):
        TokenStreamLoader([], 2, 4)


# --------------------------------------------------------------------------------------------
# prepare_dataset
# --------------------------------------------------------------------------------------------


def sample_text(n_bytes: int) -> bytes:
    line = "Ünïcödé line — with bytes above 127; número {}\n"
    out = "".join(line.format(i) for i in range(n_bytes // 20 + 1)).encode("utf-8")
    return out[:n_bytes]


def read_split(directory: Path, split: str) -> np.ndarray:
    meta = json.loads((directory / META_FILE).read_text())
    parts = [np.load(directory / name) for name in meta["shards"][split]]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def test_prepare_byte_dataset_meta_and_lossless_shards(tmp_path: Path) -> None:
    text = sample_text(10_007)
    source = tmp_path / "corpus.txt"
    source.write_bytes(text)
    out = tmp_path / "prepared"

    meta = prepare_dataset(str(source), out, tokenizer_name="byte", val_fraction=0.1, shard_tokens=2_000)

    on_disk = json.loads((out / META_FILE).read_text())
    assert on_disk["tokenizer"] == meta.tokenizer == "byte"
    assert on_disk["vocab_size"] == 256
    assert on_disk["dtype"] == "uint16"
    assert on_disk["format"] == "bigbatch-tokens"
    assert on_disk["documents"] == 1
    assert on_disk["eot_token"] is None
    tokens = on_disk["tokens"]
    assert tokens["train"] + tokens["val"] == len(text)
    assert abs(tokens["val"] - 0.1 * len(text)) <= 1
    # shards of at most 2,000 tokens each
    assert len(on_disk["shards"]["train"]) == math.ceil(tokens["train"] / 2_000)
    for split in ("train", "val"):
        for name in on_disk["shards"][split]:
            array = np.load(out / name)
            assert array.dtype == np.uint16 and array.ndim == 1 and len(array) <= 2_000
    train, val = read_split(out, "train"), read_split(out, "val")
    assert len(train) == tokens["train"] and len(val) == tokens["val"]
    assert np.concatenate([train, val]).astype(np.uint8).tobytes() == text
    # the staging directory was renamed into place, nothing left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "prepared"]


def test_prepared_dataset_reads_back_through_token_dataset(tmp_path: Path) -> None:
    text = sample_text(3_000)
    (tmp_path / "c.txt").write_bytes(text)
    prepare_dataset(str(tmp_path / "c.txt"), tmp_path / "ds", val_fraction=0.25)
    dataset = TokenDataset(tmp_path / "ds")
    assert dataset.vocab_size == 256
    train = np.concatenate(dataset.shard_arrays("train"))
    val = np.concatenate(dataset.shard_arrays("val"))
    assert len(val) == int(3_000 * 0.25)
    assert np.concatenate([train, val]).astype(np.uint8).tobytes() == text


def test_prepare_refuses_non_empty_out_dir_and_leaves_it_untouched(tmp_path: Path) -> None:
    (tmp_path / "c.txt").write_bytes(b"some text " * 100)
    out = tmp_path / "existing"
    out.mkdir()
    (out / "keep.txt").write_bytes(b"precious")
    (out / "sub").mkdir()
    (out / "sub" / "more.bin").write_bytes(b"\x00\x01")

    with pytest.raises(DataError, match="not empty"):
        prepare_dataset(str(tmp_path / "c.txt"), out)

    assert (out / "keep.txt").read_bytes() == b"precious"
    assert (out / "sub" / "more.bin").read_bytes() == b"\x00\x01"
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == ["keep.txt", "sub", "sub/more.bin"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt", "existing"]  # no staging dir left


def test_prepare_refuses_an_existing_file_as_out(tmp_path: Path) -> None:
    (tmp_path / "c.txt").write_bytes(b"some text " * 100)
    out = tmp_path / "a_file"
    out.write_bytes(b"x")
    with pytest.raises(DataError):
        prepare_dataset(str(tmp_path / "c.txt"), out)
    assert out.read_bytes() == b"x"


def test_prepare_into_an_existing_empty_dir_is_fine(tmp_path: Path) -> None:
    (tmp_path / "c.txt").write_bytes(b"some text " * 100)
    out = tmp_path / "empty"
    out.mkdir()
    meta = prepare_dataset(str(tmp_path / "c.txt"), out)
    assert meta.tokens["train"] + meta.tokens["val"] == 1_000
    assert (out / META_FILE).is_file()


def test_empty_file_is_a_data_error(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(DataError, match="no text"):
        prepare_dataset(str(tmp_path / "empty.txt"), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt"]


def test_empty_directory_is_a_data_error(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    with pytest.raises(DataError):
        prepare_dataset(str(tmp_path / "src"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_directory_of_only_binary_or_hidden_files_is_a_data_error(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "blob.bin").write_bytes(b"abc\x00def")
    (src / ".hidden.txt").write_bytes(b"hidden text")
    with pytest.raises(DataError):
        prepare_dataset(str(src), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_directory_source_is_recursive_sorted_and_skips_binary_and_hidden(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "a" / "sub").mkdir(parents=True)
    (src / ".git").mkdir()
    files = {
        "c.txt": b"third file\n",
        "a/z.txt": b"second file\n",
        "a/sub/m.txt": b"first file\n",
        "d.txt": b"fourth file\n",
        "b.bin": b"binary\x00data",  # NUL byte: skipped
        ".hidden.txt": b"HIDDEN\n",  # hidden file: skipped
        ".git/config": b"GITCONFIG\n",  # inside a hidden directory: skipped
        "a/.secret": b"SECRET\n",
    }
    for name, data in files.items():
        (src / name).write_bytes(data)

    meta = prepare_dataset(str(src), tmp_path / "out", val_fraction=0.0)

    assert meta.documents == 4
    expected = b"first file\nsecond file\nthird file\nfourth file\n"
    assert read_split(tmp_path / "out", "train").astype(np.uint8).tobytes() == expected
    assert meta.tokens == {"train": len(expected), "val": 0}


def test_hidden_parent_of_the_source_dir_does_not_hide_its_files(tmp_path: Path) -> None:
    src = tmp_path / ".data" / "corpus"
    src.mkdir(parents=True)
    (src / "a.txt").write_bytes(b"visible\n")
    meta = prepare_dataset(str(src), tmp_path / "out", val_fraction=0.0)
    assert meta.tokens["train"] == len(b"visible\n")


def test_glob_source(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "b.txt").write_bytes(b"BBB\n")
    (src / "a.txt").write_bytes(b"AAA\n")
    (src / "c.md").write_bytes(b"not matched\n")
    meta = prepare_dataset(str(src / "*.txt"), tmp_path / "out", val_fraction=0.0)
    assert meta.documents == 2
    assert read_split(tmp_path / "out", "train").astype(np.uint8).tobytes() == b"AAA\nBBB\n"


def test_glob_matching_nothing_is_a_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="matches no files"):
        prepare_dataset(str(tmp_path / "*.nothing"), tmp_path / "out")


def test_missing_path_is_a_data_error(tmp_path: Path) -> None:
    missing = tmp_path / "no_such_file.txt"
    with pytest.raises(DataError, match="does not exist") as info:
        prepare_dataset(str(missing), tmp_path / "out")
    assert str(missing) in str(info.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fraction", [-0.1, 1.0])
def test_bad_val_fraction_is_a_config_error(tmp_path: Path, fraction: float) -> None:
    (tmp_path / "c.txt").write_bytes(b"text")
    with pytest.raises(ConfigError):
        prepare_dataset(str(tmp_path / "c.txt"), tmp_path / "out", val_fraction=fraction)


# --------------------------------------------------------------------------------------------
# ensure_prepared
# --------------------------------------------------------------------------------------------


def test_ensure_prepared_caches_and_reuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "corpus.txt"
    source.write_bytes(sample_text(2_000))
    cache = tmp_path / "cache"

    first = ensure_prepared(str(source), "byte", 0.1, cache_dir=cache)
    assert first.parent == cache
    assert (first / META_FILE).is_file()
    mtime = (first / META_FILE).stat().st_mtime_ns

    def no_second_prepare(*args, **kwargs):
        raise AssertionError("ensure_prepared re-prepared a cached dataset")

    monkeypatch.setattr(cache_module, "prepare_dataset", no_second_prepare)
    second = ensure_prepared(str(source), "byte", 0.1, cache_dir=cache)
    assert second == first
    assert (first / META_FILE).stat().st_mtime_ns == mtime
    assert len(list(cache.iterdir())) == 1


def test_ensure_prepared_key_depends_on_source_and_settings(tmp_path: Path) -> None:
    source = tmp_path / "corpus.txt"
    source.write_bytes(b"first version of the corpus\n" * 10)
    cache = tmp_path / "cache"
    first = ensure_prepared(str(source), "byte", 0.1, cache_dir=cache)
    other_fraction = ensure_prepared(str(source), "byte", 0.2, cache_dir=cache)
    assert other_fraction != first
    source.write_bytes(b"a changed, longer corpus\n" * 20)
    changed = ensure_prepared(str(source), "byte", 0.1, cache_dir=cache)
    assert changed not in (first, other_fraction)
    assert (
        np.concatenate([read_split(changed, "train"), read_split(changed, "val")]).astype(np.uint8).tobytes()
        == b"a changed, longer corpus\n" * 20
    )


def test_ensure_prepared_returns_a_prepared_dir_as_is(tmp_path: Path) -> None:
    (tmp_path / "c.txt").write_bytes(b"hello " * 100)
    prepared = tmp_path / "prepared"
    prepare_dataset(str(tmp_path / "c.txt"), prepared)
    cache = tmp_path / "cache"
    assert ensure_prepared(str(prepared), "byte", 0.1, cache_dir=cache) == prepared
    assert not cache.exists()


def test_ensure_prepared_uses_bigbatch_cache_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BIGBATCH_CACHE", str(tmp_path / "envcache"))
    (tmp_path / "c.txt").write_bytes(b"hello " * 100)
    target = ensure_prepared(str(tmp_path / "c.txt"), "byte", 0.1)
    assert target.parent == tmp_path / "envcache"


def test_ensure_prepared_missing_source_is_a_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError):
        ensure_prepared(str(tmp_path / "missing.txt"), "byte", 0.1, cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


# --------------------------------------------------------------------------------------------
# TokenDataset: damaged files are DataErrors
# --------------------------------------------------------------------------------------------


@pytest.fixture
def prepared(tmp_path: Path) -> Path:
    (tmp_path / "c.txt").write_bytes(sample_text(5_000))
    out = tmp_path / "ds"
    prepare_dataset(str(tmp_path / "c.txt"), out)
    return out


@pytest.mark.parametrize("keep", [3, 50, 0.5, -1], ids=["magic", "header", "half", "one-byte-short"])
def test_truncated_shard_is_a_data_error(prepared: Path, keep: float) -> None:
    path = prepared / "train_000000.npy"
    data = path.read_bytes()
    cut = int(len(data) * keep) if isinstance(keep, float) else (len(data) + keep if keep < 0 else keep)
    path.write_bytes(data[:cut])
    with pytest.raises(DataError, match="train_000000.npy"):
        TokenDataset(prepared).shard_arrays("train")


def test_zero_byte_shard_is_a_data_error(prepared: Path) -> None:
    (prepared / "train_000000.npy").write_bytes(b"")
    with pytest.raises(DataError):
        TokenDataset(prepared).shard_arrays("train")


def test_missing_shard_is_a_data_error(prepared: Path) -> None:
    (prepared / "val_000000.npy").unlink()
    dataset = TokenDataset(prepared)
    dataset.shard_arrays("train")
    with pytest.raises(DataError, match="missing"):
        dataset.shard_arrays("val")


def test_shard_with_wrong_dtype_is_a_data_error(prepared: Path) -> None:
    np.save(prepared / "train_000000.npy", np.arange(10, dtype=np.uint32))
    with pytest.raises(DataError, match="uint16"):
        TokenDataset(prepared).shard_arrays("train")


@pytest.mark.parametrize(
    "content",
    [
        "this is not json",
        "[1, 2, 3]",
        json.dumps({"tokenizer": "byte"}),  # no format field
        json.dumps({"format": "something-else", "version": 1}),
        "__version__",  # replaced below by a valid meta with a future version
        "__unknown_field__",  # replaced below by a valid meta with an extra field
        "__missing_field__",  # replaced below by a valid meta without vocab_size
    ],
)
def test_meta_json_with_wrong_format_is_a_data_error(prepared: Path, content: str) -> None:
    meta = json.loads((prepared / META_FILE).read_text())
    if content == "__version__":
        content = json.dumps(dict(meta, version=99))
    elif content == "__unknown_field__":
        content = json.dumps(dict(meta, colour="blue"))
    elif content == "__missing_field__":
        content = json.dumps({k: v for k, v in meta.items() if k != "vocab_size"})
    (prepared / META_FILE).write_text(content)
    with pytest.raises(DataError):
        TokenDataset(prepared)


def test_directory_without_meta_is_a_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="prepare"):
        TokenDataset(tmp_path)


@pytest.mark.parametrize(
    "override", [{"dtype": "not-a-dtype"}, {"shards": "train_000000.npy"}], ids=["dtype", "shards"]
)
def test_meta_json_with_wrong_field_values_is_a_data_error(prepared: Path, override: dict) -> None:
    meta = json.loads((prepared / META_FILE).read_text())
    (prepared / META_FILE).write_text(json.dumps(dict(meta, **override)))
    with pytest.raises(DataError):
        TokenDataset(prepared).shard_arrays("train")


# --------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------


def test_byte_tokenizer_round_trip() -> None:
    tok = get_tokenizer("byte")
    data = "héllo wörld\n".encode()
    ids = tok.encode(data)
    assert ids == list(data) and tok.vocab_size == 256 and tok.eot_token is None
    assert tok.decode(ids) == "héllo wörld\n"


def test_unknown_tokenizer_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="byte"):
        get_tokenizer("sentencepiece")


def test_gpt2_tokenizer_offline_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import tiktoken

    calls: list[str] = []

    def offline(name: str):
        calls.append(name)
        raise ConnectionError("offline")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    with pytest.raises(BigBatchError) as info:
        get_tokenizer("gpt2")
    message = str(info.value)
    assert calls == ["gpt2"]
    assert "could not load" in message
    assert "TIKTOKEN_CACHE_DIR" in message
    assert "ConnectionError" in message
    assert "\n" not in message
    # What loads GPT-2 here holds its ids (GPT-2 token shards, a checkpoint trained on them): no other tokenizer
    # is offered, since byte, bpe:VOCAB or file:PATH would read those ids as other text.
    assert "byte" not in message and "bpe:" not in message and "file:" not in message


def test_prepare_with_gpt2_offline_fails_cleanly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tiktoken

    def offline(name: str):
        raise ConnectionError("offline")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    (tmp_path / "c.txt").write_bytes(b"hello")
    with pytest.raises(BigBatchError) as info:
        prepare_dataset(str(tmp_path / "c.txt"), tmp_path / "out", tokenizer_name="gpt2")
    # raw text may take any tokenizer: the ones that need no download are named, all of them
    assert "TIKTOKEN_CACHE_DIR" in str(info.value)
    assert "bpe:VOCAB" in str(info.value) and "file:PATH" in str(info.value) and "byte" in str(info.value)
    assert "\n" not in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt"]


def test_a_prepare_that_waited_returns_what_the_other_process_prepared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``wait_for_lock`` (two runs preparing one cache entry), the process that waited finds the dataset
    the other one finished while it waited, and returns its metadata instead of preparing again."""
    from collections.abc import Iterator
    from contextlib import contextmanager

    import bigbatch.data.prepare as prepare_module

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog.\n" * 200)
    out = tmp_path / "data"
    prepared_by_the_other: list[Path] = []

    @contextmanager
    def the_other_process_prepares_while_we_wait(path: Path, wait: bool) -> Iterator[None]:
        assert wait
        monkeypatch.undo()  # the other process takes the real lock and prepares
        prepare_dataset(str(corpus), path)
        prepared_by_the_other.append(path)
        yield

    monkeypatch.setattr(prepare_module, "preparation_lock", the_other_process_prepares_while_we_wait)
    meta = prepare_dataset(str(corpus), out, wait_for_lock=True)
    assert prepared_by_the_other == [out]
    assert meta == TokenDataset(out).meta
