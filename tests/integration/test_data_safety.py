"""Nothing silently wrong or endless in the data path: splits without valid targets, lost metadata, a
contradicting --tokenizer, long documents, invalid UTF-8, and stop signals in every loop that can run long."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_one_line_error, corpus_bytes, run_main

from bigbatch.data.documents import DocumentLoader
from bigbatch.data.prepare import prepare_dataset
from bigbatch.data.shards import META_FILE, DocumentShard, TokenDataset
from bigbatch.data.split import document_splits
from bigbatch.data.text import utf8_replacements
from bigbatch.engine.batch import IGNORE_INDEX, EmptyStepGuard, MicroBatch, StepBatch
from bigbatch.errors import DataError
from bigbatch.run.configuration.train_config import TrainConfig
from bigbatch.run.loop.trainer import Trainer


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("BIGBATCH_CACHE", str(tmp_path / "cache"))
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in previous.items():
        signal.signal(sig, handler)


TRAIN = [
    "--model",
    "pico",
    "--micro-batch",
    "2",
    "--seq-len",
    "16",
    "--total-batch-tokens",
    "64",
    "--max-steps",
    "2",
    "--sample-tokens",
    "0",
    "--eval-batches",
    "1",
]


def jsonl(path: Path, records: list[dict[str, str]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def completion(i: int, text: str) -> dict[str, str]:
    return {"prompt": f"question {i}: what is it?", "completion": text}


# --------------------------------------------------------------------------------------------
# Splits without valid targets: refused at start-up, never a made-up loss, never an endless loop
# --------------------------------------------------------------------------------------------


def test_all_empty_completions_is_one_line_error_quickly(tmp_path: Path) -> None:
    data = jsonl(tmp_path / "empty.jsonl", [completion(i, "") for i in range(40)])
    started = time.monotonic()
    code, out, err = run_main(["train", "--data", str(data), "--data-mode", "documents", "--out", "run", *TRAIN])
    line = assert_one_line_error(code, out, err)
    assert time.monotonic() - started < 60
    assert "training split" in line and "no valid targets" in line
    assert "skipping a step" not in out


def test_prepare_counts_documents_without_targets(tmp_path: Path) -> None:
    data = jsonl(tmp_path / "empty.jsonl", [completion(i, "") for i in range(9)] + [completion(9, " yes")])
    code, out, err = run_main(["prepare", str(data), "--out", "ds", "--mode", "documents"])
    assert code == 0, err
    assert "9 of 10 documents have no target to train on" in out
    assert json.loads(Path("ds/meta.json").read_text())["extra"]["documents_without_targets"] == 9


def test_validation_split_without_valid_targets_is_refused_at_start_up(tmp_path: Path) -> None:
    held_out = set(document_splits(40, 0.1)["val"].tolist())  # the validation split: 4 documents at random
    records = [completion(i, "" if i in held_out else f" answer number {i} is long enough") for i in range(40)]
    data = jsonl(tmp_path / "val_empty.jsonl", records)
    code, out, err = run_main(["train", "--data", str(data), "--data-mode", "documents", "--out", "run", *TRAIN])
    line = assert_one_line_error(code, out, err)
    assert "validation split" in line and "no valid targets" in line and "--eval-every 0" in line
    assert "val loss 0.0000" not in out and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_no_val_loss_from_zero_targets_read(tmp_path: Path) -> None:
    """The validation split has targets, but not in the windows an eval reads: no number is reported."""
    held_out = document_splits(37, 0.2)["val"].tolist()  # 7 documents at random, kept in the order of the data
    # the first validation document is the only one with targets: its sequences 0-2 (of 15; 2 windows of each
    # empty one) are not among the 2 spread-out windows an eval reads (--eval-batches 1 x micro-batch 2): 3, 11
    records = [completion(i, f" answer number {i} is long enough") for i in range(37)]
    records[held_out[0]] = completion(200, " the only scored answer")
    for i in held_out[1:]:
        records[i] = completion(100 + i, "")
    data = jsonl(tmp_path / "val_late.jsonl", records)
    code, out, err = run_main(
        ["train", "--data", str(data), "--data-mode", "documents", "--val-fraction", "0.2", "--out", "run", *TRAIN]
    )
    assert code == 0, err
    assert "val loss" not in out.replace("no val loss", "") and "no val loss" in out
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert not [r for r in records if r.get("kind") == "eval"]


def empty_documents(n: int, length: int = 5) -> DocumentShard:
    tokens = np.arange(n * length, dtype=np.uint16) % 50
    offsets = np.arange(0, n * length + 1, length, dtype=np.int64)
    return DocumentShard(tokens, offsets, np.zeros(n * length, dtype=np.uint8))  # every target masked


def test_skipping_empty_steps_is_bounded() -> None:
    loader = DocumentLoader([empty_documents(10)], micro_batch=2, seq_len=8)
    assert loader.valid_targets == 0
    guard = EmptyStepGuard()
    with pytest.raises(DataError, match="whole epoch held no valid targets"):
        for _ in range(100):
            loader.next_micro_batch()
            guard.skipped(loader)
    assert loader.epoch <= 3


def small_config(tmp_path: Path, data: Path, **run: object) -> TrainConfig:
    config = TrainConfig()
    config.model.preset = "pico"
    config.data.data = str(data)
    config.data.data_mode = "documents"
    config.data.cache_dir = str(tmp_path / "cache")
    config.batch.micro_batch, config.batch.seq_len, config.batch.total_batch_tokens = 2, 16, 64
    config.run.max_steps, config.run.eval_every, config.run.eval_batches, config.run.sample_tokens = 1000, 0, 1, 0
    config.run.out = str(tmp_path / "run")
    for key, value in run.items():
        setattr(config.run, key, value)
    return config


def documents_data(tmp_path: Path, n: int = 60) -> Path:
    return jsonl(tmp_path / "docs.jsonl", [completion(i, f" answer number {i} is long enough") for i in range(n)])


def test_sigterm_is_honoured_in_the_skip_loop(tmp_path: Path) -> None:
    trainer = Trainer(small_config(tmp_path, documents_data(tmp_path)))
    calls = 0

    def empty_step() -> StepBatch:
        nonlocal calls
        calls += 1
        if calls == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        if calls > 50:
            raise AssertionError("SIGTERM was ignored by the loop that skips empty steps")
        batch = MicroBatch(torch.zeros(2, 16, dtype=torch.long), torch.full((2, 16), IGNORE_INDEX))
        return StepBatch([batch], 0)

    trainer.next_step = empty_step  # type: ignore[method-assign]
    result = trainer.train()
    assert result.stopped_by == signal.SIGTERM and calls == 3


def test_sigterm_is_honoured_inside_an_eval(tmp_path: Path) -> None:
    trainer = Trainer(small_config(tmp_path, documents_data(tmp_path, 200), eval_every=1, eval_batches=1000))
    scored = {"eval": 0}
    loss_fn = trainer.engine.loss_fn

    def counting(model: torch.nn.Module, batch: MicroBatch) -> torch.Tensor:
        if not model.training:
            scored["eval"] += 1
            if scored["eval"] == 2:
                os.kill(os.getpid(), signal.SIGTERM)
        return loss_fn(model, batch)

    trainer.engine.loss_fn = counting
    result = trainer.train()
    assert result.stopped_by == signal.SIGTERM and result.steps == 1
    assert scored["eval"] == 2  # the pass stopped at the next micro-batch, not after 1000
    assert result.val_loss is None  # an interrupted pass reports no number
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert not [r for r in records if r.get("kind") == "eval"]


def test_sigterm_during_prepare_exits_143_and_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import bigbatch.data.encode as encode

    (tmp_path / "c.txt").write_bytes(corpus_bytes(20_000))
    real = encode._encode_piece

    def interrupted(*args: object) -> np.ndarray:
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(encode, "_encode_piece", interrupted)
    code, out, err = run_main(["prepare", str(tmp_path / "c.txt"), "--out", str(tmp_path / "ds")])
    assert code == 143 and err.strip() == "bigbatch: terminated"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt"]  # no dataset, no staging directory


# --------------------------------------------------------------------------------------------
# Lost metadata, a contradicting --tokenizer
# --------------------------------------------------------------------------------------------


@pytest.fixture
def prepared(tmp_path: Path) -> Path:
    (tmp_path / "c.txt").write_bytes(corpus_bytes(20_000))
    prepare_dataset(str(tmp_path / "c.txt"), tmp_path / "ds")
    return tmp_path / "ds"


def test_prepared_dataset_without_meta_json_is_not_read_as_gpt2_shards(prepared: Path) -> None:
    (prepared / META_FILE).unlink()
    code, out, err = run_main(["train", "--data", str(prepared), "--out", "run", *TRAIN])
    line = assert_one_line_error(code, out, err)
    assert "meta.json" in line and "bigbatch prepare" in line and "bigbatch's own layout" in line
    assert not Path("run").exists()


def test_a_shard_of_a_prepared_dataset_names_the_dataset(prepared: Path) -> None:
    code, out, err = run_main(["train", "--data", str(prepared / "train_000000.npy"), "--out", "run", *TRAIN])
    line = assert_one_line_error(code, out, err)
    assert f"point --data at the directory {prepared}" in line


def test_tokenizer_that_contradicts_the_dataset_is_an_error(prepared: Path) -> None:
    code, out, err = run_main(["train", "--data", str(prepared), "--tokenizer", "bpe:300", "--out", "run", *TRAIN])
    line = assert_one_line_error(code, out, err)
    assert "--tokenizer bpe:300 contradicts the data" in line and "byte tokens" in line
    for agreeing in (["--tokenizer", "byte"], []):  # the dataset's own name, or the default (auto)
        code, out, err = run_main(
            ["train", "--data", str(prepared), *agreeing, "--out", f"run{len(agreeing)}", *TRAIN, "--eval-every", "0"]
        )
        assert code == 0, err
        assert "byte tokenizer" in out


# --------------------------------------------------------------------------------------------
# Long documents: split (default) keeps every token; truncate says what it drops
# --------------------------------------------------------------------------------------------


def random_documents(lengths: list[int], masked_prefix: int = 0) -> DocumentShard:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 60, size=sum(lengths)).astype(np.uint16)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    mask = None
    if masked_prefix:
        mask = np.ones(len(tokens), dtype=np.uint8)
        for start in offsets[:-1]:
            mask[start : start + masked_prefix] = 0
    return DocumentShard(tokens, offsets, mask)


@pytest.mark.parametrize("masked_prefix", [0, 3])
def test_split_trains_on_every_target_once_and_pads_only_the_end(masked_prefix: int) -> None:
    lengths = [5, 40, 17, 1, 33, 100, 18]
    shard = random_documents(lengths, masked_prefix)
    T = 16
    loader = DocumentLoader([shard], micro_batch=3, seq_len=T)
    seen: list[int] = []  # stream positions of every target trained on
    while True:
        batch = loader.next_micro_batch()
        for _row_inputs, row_targets in zip(batch.inputs, batch.targets, strict=True):
            valid = (row_targets != IGNORE_INDEX).nonzero().flatten().tolist()
            if valid:  # padding only after the last target position of the window
                assert row_targets[valid[-1] + 1 :].eq(IGNORE_INDEX).all()
            seen.extend(int(t) for t in row_targets[valid])
        if loader.epoch:
            break
    expected = []
    for start, end in zip(shard.offsets[:-1], shard.offsets[1:], strict=True):
        for position in range(start + 1, end):
            if shard.mask is None or shard.mask[position]:
                expected.append(int(shard.tokens[position]))
    assert seen == expected  # every target exactly once, in order
    assert loader.valid_targets == len(expected) and loader.dropped_targets == 0
    assert loader.n_sequences == sum(max(1, -(-(n - 1) // T)) for n in lengths)


@pytest.mark.parametrize("masked_prefix", [0, 3])
def test_truncate_counts_the_targets_it_drops(masked_prefix: int) -> None:
    lengths = [5, 40, 17, 1, 33, 100, 18]
    shard = random_documents(lengths, masked_prefix)
    loader = DocumentLoader([shard], micro_batch=7, seq_len=16, long_documents="truncate")
    batch = loader.next_micro_batch()
    trained = int((batch.targets != IGNORE_INDEX).sum())
    split = DocumentLoader([shard], micro_batch=7, seq_len=16)
    assert loader.valid_targets == trained
    assert loader.dropped_targets == split.valid_targets - trained > 0
    assert loader.long_document_count == 4  # 40, 33, 100 and 18 tokens are longer than seq_len + 1 = 17


def long_documents_data(tmp_path: Path) -> Path:
    text = corpus_bytes(30_000).decode("utf-8", errors="replace")
    return jsonl(tmp_path / "long.jsonl", [{"text": text[i : i + 3000]} for i in range(0, 30_000, 3000)])


def test_header_states_the_policy_and_what_it_drops(tmp_path: Path) -> None:
    data = long_documents_data(tmp_path)
    args = ["train", "--data", str(data), "--data-mode", "documents", *TRAIN, "--eval-every", "0"]
    code, out, err = run_main([*args, "--out", "split"])
    assert code == 0, err
    (line,) = [x for x in out.splitlines() if x.startswith("long documents |")]
    assert "split into seq_len windows" in line and "| 0 of " in line and "target tokens dropped" in line
    code, out, err = run_main([*args, "--out", "truncate", "--long-documents", "truncate"])
    assert code == 0, err
    (line,) = [x for x in out.splitlines() if x.startswith("long documents |")]
    dataset = TokenDataset(next((tmp_path / "cache").iterdir()))
    train_tokens, n_docs = dataset.meta.tokens["train"], len(dataset.document_shards("train")[0].offsets) - 1
    dropped = train_tokens - n_docs * 17  # every training document is longer than seq_len + 1 = 17 tokens
    assert f"truncate to seq_len+1 tokens ({n_docs:,} of {n_docs:,} documents" in line
    assert f"{dropped:,} of {train_tokens - n_docs:,} target tokens dropped" in line


def test_long_documents_flag_is_validated(tmp_path: Path) -> None:
    code, out, err = run_main(["train", "--data", str(long_documents_data(tmp_path)), "--long-documents", "cut"])
    assert "long_documents must be split or truncate" in assert_one_line_error(code, out, err)


def test_prepare_reports_long_documents(tmp_path: Path) -> None:
    code, out, err = run_main(["prepare", str(long_documents_data(tmp_path)), "--out", "ds", "--mode", "documents"])
    assert code == 0, err
    assert "long documents: longest 3,0" in out and "0 tokens dropped" in out
    assert json.loads(Path("ds/meta.json").read_text())["extra"]["longest_document"] > 2900


# --------------------------------------------------------------------------------------------
# Invalid UTF-8 under text tokenizers: counted and reported
# --------------------------------------------------------------------------------------------


def test_utf8_replacements_are_counted() -> None:
    assert utf8_replacements("valid \ufffd text".encode()) == 0  # a literal U+FFFD is not a replacement
    assert utf8_replacements(b"a\xffb\xfe\xc3") == 3
    assert utf8_replacements(b"\xe2\x82") == 1  # a truncated sequence is one replacement


def test_prepare_reports_invalid_utf8_under_a_text_tokenizer(tmp_path: Path) -> None:
    text = corpus_bytes(20_000)
    (tmp_path / "bad.txt").write_bytes(text[:5000] + b"\xff\xfe" + text[5000:10_000] + b"\xc3(" + text[10_000:])
    code, out, err = run_main(["prepare", str(tmp_path / "bad.txt"), "--out", "bpe", "--tokenizer", "bpe:300"])
    assert code == 0, err
    assert "3 invalid UTF-8 sequences replaced by U+FFFD (bpe:300 tokenizer)" in out
    assert json.loads(Path("bpe/meta.json").read_text())["extra"]["utf8_replacements"] == 3
    code, out, err = run_main(["prepare", str(tmp_path / "bad.txt"), "--out", "byte"])
    assert code == 0 and "U+FFFD" not in out  # the byte tokenizer keeps every byte
    assert "utf8_replacements" not in json.loads(Path("byte/meta.json").read_text())["extra"]


def test_sigterm_ends_sampling_with_exit_143(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import bigbatch.models.sampling as sampling

    (tmp_path / "c.txt").write_bytes(corpus_bytes(20_000))
    code, out, err = run_main(["train", "--data", str(tmp_path / "c.txt"), "--out", "run", *TRAIN, "--max-steps", "1"])
    assert code == 0, err
    real, calls = sampling._draw, []

    def next_token(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(sampling, "_draw", next_token)
    code, out, err = run_main(["sample", "--checkpoint", "run", "--max-new-tokens", "100000", "--prompt", "a"])
    assert code == 143 and err.strip() == "bigbatch: terminated" and len(calls) <= 4


def test_prefix_sums_read_in_chunks_match_a_cumsum() -> None:
    from bigbatch.data.documents import _prefix_sums

    rng = np.random.default_rng(1)
    values = rng.integers(0, 2, size=10_007).astype(np.uint8)
    positions = np.sort(np.concatenate([[0, 10_007, 1000, 1000, 1001], rng.integers(0, 10_008, size=300)]))
    reference = np.concatenate([[0], np.cumsum(values, dtype=np.int64)])[positions]
    for chunk in (1, 7, 1000, 1 << 22):
        assert np.array_equal(_prefix_sums(values, positions, chunk=chunk), reference)
