"""The tests' own corpus (tests/support/text_corpus.py): the same bytes everywhere, never periodic, English-like."""

from __future__ import annotations

import hashlib
from collections import Counter

from text_corpus import Lcg64, text_corpus, text_corpus_str

from bigbatch.data.tokenizers import train_bpe


def test_the_corpus_is_the_same_bytes_on_every_machine() -> None:
    # Pinned: a change here changes the data of every test that trains on the corpus, on purpose or not.
    assert hashlib.sha256(text_corpus(100_000)).hexdigest() == (
        "0efb11135efc3e65ce56186b6123d1400f496b71415d4d4e19d694df0ba6ded1"
    )
    assert Lcg64(0).next() == 1093944153  # the generator's arithmetic, apart from the grammar
    assert text_corpus(100_000, seed=1) != text_corpus(100_000)


def test_a_shorter_corpus_is_a_prefix_of_a_longer_one() -> None:
    whole = text_corpus(50_000)
    assert len(whole) == 50_000
    assert all(text_corpus(n) == whole[:n] for n in (0, 1, 999, 31_337))
    assert text_corpus_str(999) == whole[:999].decode("ascii")


def test_the_corpus_never_repeats_periodically() -> None:
    text = text_corpus(200_000)
    # Periodic text of period p would repeat its start at offset p and its end p bytes earlier.
    assert text.find(text[:500], 1) == -1
    assert text.find(text[-500:]) == len(text) - 500
    # The last tenth (a validation split) shares no 200-byte block with the rest.
    train, val = text[:180_000], text[180_000:]
    assert not any(val[i : i + 200] in train for i in range(0, len(val) - 200, 200))


def test_the_corpus_looks_like_english_to_a_tokenizer() -> None:
    text = text_corpus(100_000)
    counts = Counter(text)
    assert [chr(c) for c, _ in counts.most_common(2)] == [" ", "e"]  # as in English
    assert {"\n", ":", ",", ".", "?", "!", "0", "7"} <= set(text.decode("ascii"))
    assert text.count(b"\n") / len(text) > 0.02  # lines, not one paragraph
    # A BPE trained on it learns hundreds of merges that also occur in text it was not trained on.
    chunks = [text[i : i + 10_000].decode("ascii") for i in range(0, len(text), 10_000)]
    bpe = train_bpe("bpe:512", chunks)
    held_out = text_corpus(100_000, seed=1)
    ids = bpe.encode(held_out)
    assert len(set(ids)) - len(set(held_out)) >= 200
    assert len(ids) < len(held_out) / 2
