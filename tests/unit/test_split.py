"""The validation split: a seeded random set of documents, not the tail of the sorted list; a single text keeps its
last share; the prepared-data cache follows the split rule."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import bigbatch.data.cache as cache_module
from bigbatch.data.cache import ensure_prepared
from bigbatch.data.prepare import prepare_dataset
from bigbatch.data.shards import TokenDataset
from bigbatch.data.split import SPLIT_RULE, document_splits, packed_splits


def split_text(dataset: Path, split: str) -> bytes:
    return b"".join(bytes(np.asarray(s).tolist()) for s in TokenDataset(dataset).shard_arrays(split))


def corpus(directory: Path, n: int = 20) -> list[bytes]:
    """``n`` files sorted by name; the last one is unlike the others (another author, so to speak)."""
    directory.mkdir()
    texts = []
    for i in range(n):
        text = (f"play {i:02d}: " + "to be or not to be " * (20 + i)).encode()
        if i == n - 1:
            text = b"POEM " * 150
        (directory / f"{i:02d}.txt").write_bytes(text)
        texts.append(text)
    return texts


def test_packed_validation_is_random_whole_documents_not_the_tail(tmp_path: Path) -> None:
    texts = corpus(tmp_path / "src")
    meta = prepare_dataset(str(tmp_path / "src"), tmp_path / "ds", val_fraction=0.2)
    train, val = split_text(tmp_path / "ds", "train"), split_text(tmp_path / "ds", "val")
    total = sum(len(t) for t in texts)
    assert meta.tokens == {"train": total - int(total * 0.2), "val": int(total * 0.2)}
    assert train + val != b"".join(texts)  # not the tail of the stream
    held = [i for i, t in enumerate(texts) if t in val]
    assert len(held) >= 2  # whole documents ...
    assert sum(1 for t in texts if t not in val and t not in train) <= 1  # ... and at most one cut in two
    assert held != list(range(len(texts) - len(held), len(texts)))  # not the last files of the sorted list
    assert any(t in train for t in texts[held[0] + 1 :])  # training documents lie between validation ones
    # seeded: preparing again gives the same split
    prepare_dataset(str(tmp_path / "src"), tmp_path / "again", val_fraction=0.2)
    assert split_text(tmp_path / "again", "val") == val
    assert meta.extra["split"] == {"rule": SPLIT_RULE, "seed": 1337}


def test_packed_split_ranges_cover_the_stream_once_with_exactly_the_validation_share() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        lengths = rng.integers(0, 60, rng.integers(1, 25)).tolist()
        total = sum(lengths)
        fraction = float(rng.choice([0.0, 0.05, 0.1, 0.5]))
        splits = packed_splits(lengths, fraction)
        covered = sorted(splits["train"] + splits["val"])
        assert sum(b - a for a, b in splits["val"]) == int(total * fraction)
        position = 0
        for start, stop in covered:  # a partition of [0, total) into non-empty ranges
            assert start == position and stop > start
            position = stop
        assert position == total
        starts = np.concatenate([[0], np.cumsum(lengths)])
        cut = [a for a, b in splits["val"] if a not in starts]  # a range that begins inside a document
        assert len(cut) <= 1


def test_a_single_text_keeps_its_last_share_as_validation(tmp_path: Path) -> None:
    text = b"".join(f"line {i} of the one play\n".encode() for i in range(400))
    (tmp_path / "play.txt").write_bytes(text)
    prepare_dataset(str(tmp_path / "play.txt"), tmp_path / "ds", val_fraction=0.1)
    cut = len(text) - int(len(text) * 0.1)
    assert split_text(tmp_path / "ds", "train") == text[:cut]
    assert split_text(tmp_path / "ds", "val") == text[cut:]
    assert packed_splits([1000], 0.1) == {"train": [(0, 900)], "val": [(900, 1000)]}


def test_documents_mode_holds_out_a_seeded_random_set_of_documents() -> None:
    splits = document_splits(100, 0.1)
    assert len(splits["val"]) == 10 and len(splits["train"]) == 90
    assert sorted(np.concatenate([splits["train"], splits["val"]]).tolist()) == list(range(100))
    assert splits["val"].tolist() != list(range(90, 100))
    assert np.array_equal(document_splits(100, 0.1)["val"], splits["val"])
    assert document_splits(2, 0.1)["val"].size == 1 and document_splits(1, 0.1)["val"].size == 0


def test_the_cache_key_follows_the_split_rule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "c.txt").write_text("hello world " * 200)
    first = ensure_prepared(str(tmp_path / "c.txt"), "byte", 0.1, tmp_path / "cache")
    assert ensure_prepared(str(tmp_path / "c.txt"), "byte", 0.1, tmp_path / "cache") == first
    monkeypatch.setattr(cache_module, "SPLIT_RULE", "another-rule")
    assert ensure_prepared(str(tmp_path / "c.txt"), "byte", 0.1, tmp_path / "cache") != first
