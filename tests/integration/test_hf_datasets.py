"""The ``hf:`` source through the real ``datasets`` package, offline, on local files it writes itself: every
local form gives the same documents, tokenized in worker processes into the same shards as bigbatch's own
text path; nothing reaches the Hub; a Hub name offline is one clear line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bigbatch.data.cache import ensure_prepared
from bigbatch.data.prepare import prepare_dataset
from bigbatch.data.tokenizers import get_tokenizer
from bigbatch.errors import BigBatchError

datasets = pytest.importorskip("datasets")

TEXTS = [f"document {i}: héllo " + "some words here\n" * (i % 5) for i in range(40)] + ["", "last one"]
KEPT = [t for t in TEXTS if t]  # prepare skips empty documents, as it skips empty files


@pytest.fixture(autouse=True)
def _offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # nothing lands in the user's cache
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # read at import: set where it is used
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same documents as .jsonl files (two), csv, parquet and text, and as save_to_disk directories."""
    root = tmp_path_factory.mktemp("hf-files")
    (root / "jsonl").mkdir()
    for name, part in (("a", TEXTS[:20]), ("b", TEXTS[20:])):
        (root / "jsonl" / f"{name}.jsonl").write_text("".join(json.dumps({"text": t, "n": 1}) + "\n" for t in part))
    table = datasets.Dataset.from_dict({"body": TEXTS, "n": list(range(len(TEXTS)))})
    table.to_csv(str(root / "t.csv"))
    table.to_parquet(str(root / "t.parquet"))
    table.save_to_disk(str(root / "saved"))
    datasets.DatasetDict({"train": table.select(range(5)), "validation": table}).save_to_disk(str(root / "saved_dict"))
    (root / "t.txt").write_text("\n".join(t.replace("\n", " ") for t in KEPT) + "\n")
    return root


def documents_of(out: Path) -> list[str]:
    meta = json.loads((out / "meta.json").read_text())
    tokenizer = get_tokenizer(meta["tokenizer"], out)
    texts = []
    for name in meta["shards"]["train"]:
        tokens = np.load(out / name)
        offsets = np.load(out / name.replace(".npy", ".offsets.npy"))
        texts += [tokenizer.decode(tokens[a:b].tolist()) for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
    return texts


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("hf:json:{root}/jsonl/*.jsonl", KEPT),
        ("hf:json:{root}/jsonl", KEPT),
        ("hf:csv:{root}/t.csv#body", KEPT),
        ("hf:parquet:{root}/t.parquet#body", KEPT),
        ("hf:{root}/saved#body", KEPT),
        ("hf:{root}/saved_dict:validation#body", KEPT),
        ("hf:text:{root}/t.txt", [t.replace("\n", " ") for t in KEPT]),
        ("hf:{root}/jsonl", KEPT),
    ],
    ids=[
        "json-glob",
        "json-dir",
        "csv-column",
        "parquet",
        "save_to_disk",
        "save_to_disk-split",
        "text-lines",
        "directory-of-files",
    ],
)
def test_every_local_form_gives_the_documents(files: Path, tmp_path: Path, source: str, expected: list[str]) -> None:
    source = source.format(root=files)
    meta = prepare_dataset(source, tmp_path / "out", val_fraction=0.0, mode="documents", workers=1)
    assert meta.source == source and meta.documents == len(expected)
    assert documents_of(tmp_path / "out") == expected


def test_tokenized_in_workers_into_the_shards_of_bigbatchs_own_text_path(files: Path, tmp_path: Path) -> None:
    """hf:json with 2 tokenizer processes and a trained BPE gives the shards that bigbatch's own .jsonl reader
    gives in one process."""
    source = f"hf:json:{files}/jsonl/*.jsonl"
    hf = prepare_dataset(source, tmp_path / "hf", tokenizer_name="bpe:300", val_fraction=0.1, workers=2)
    own = prepare_dataset(str(files / "jsonl"), tmp_path / "own", tokenizer_name="bpe:300", val_fraction=0.1, workers=1)
    assert (tmp_path / "hf" / "tokenizer.json").read_text() == (tmp_path / "own" / "tokenizer.json").read_text()
    assert hf.tokens == own.tokens and hf.documents == own.documents == len(KEPT)
    for split in ("train", "val"):
        for a, b in zip(hf.shards[split], own.shards[split], strict=True):
            assert np.array_equal(np.load(tmp_path / "hf" / a), np.load(tmp_path / "own" / b))


def test_the_cache_follows_the_local_files(files: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "x.jsonl").write_text(json.dumps({"text": "hello world\n" * 20}) + "\n")
    source = f"hf:json:{data}/*.jsonl"
    first = ensure_prepared(source, "byte", 0.1, cache_dir=tmp_path / "cache")
    assert ensure_prepared(source, "byte", 0.1, cache_dir=tmp_path / "cache") == first
    (data / "x.jsonl").write_text(json.dumps({"text": "other text\n" * 20}) + "\n")
    assert ensure_prepared(source, "byte", 0.1, cache_dir=tmp_path / "cache") != first


@pytest.mark.parametrize(
    ("source", "needle"),
    [
        ("hf:csv:{root}/t.csv", "no string 'text' field (fields: body, n)"),
        ("hf:{root}/saved#nope", "has no column 'nope' (columns: body, n)"),
        ("hf:{root}/saved_dict:test#body", "has the splits train, validation, not 'test'"),
        ("hf:json:{root}/missing/*.jsonl", "matches no files"),
        ("hf:json", "reads local files; write hf:json:FILES"),
    ],
    ids=["csv-without-text", "bad-column", "bad-split", "no-files", "builder-without-files"],
)
def test_local_mistakes_are_named(files: Path, tmp_path: Path, source: str, needle: str) -> None:
    with pytest.raises(BigBatchError) as info:
        prepare_dataset(source.format(root=files), tmp_path / "out", workers=1)
    assert needle in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()


def _cli(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """The CLI in a process whose every attempt to reach the Internet is reported on stderr (no_network.py)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}  # not told to stay offline
    runner = Path(__file__).parents[1] / "support" / "no_network.py"
    return subprocess.run(
        [sys.executable, str(runner), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**base, "OMP_NUM_THREADS": "1", "HF_HOME": str(cwd / "hf-home"), **env},
        timeout=300,
    )


@pytest.mark.slow
def test_cli_prepare_of_local_files_never_reaches_the_hub(files: Path, tmp_path: Path) -> None:
    """Not told to stay offline, prepare of local files through datasets makes no network call at all (datasets
    otherwise pings a download counter for its packaged builders), in worker processes too."""
    done = _cli(
        ["prepare", f"hf:json:{files}/jsonl/*.jsonl", "--out", "mine", "--tokenizer", "bpe:300", "--workers", "2"],
        tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "NETWORK" not in done.stderr, done.stderr
    assert f"mine: {len(KEPT)} documents" in done.stdout
    offline = _cli(["prepare", "hf:someorg/some-dataset", "--out", "hub"], tmp_path, HF_HUB_OFFLINE="1")
    assert offline.returncode == 2
    (line,) = offline.stderr.strip().splitlines()
    assert line.startswith("bigbatch: error: the dataset someorg/some-dataset could not be downloaded")
    assert "offline?" in line and not (tmp_path / "hub").exists()


@pytest.mark.parametrize(("tokenizer", "workers"), [("byte", 1), ("bpe:300", 2)])
def test_an_interrupted_prepare_resumes_from_its_position(
    files: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    tokenizer: str,
    workers: int,
) -> None:
    """Ctrl-C after 25 records keeps .OUT.partial; the same call resumes there (reading past the documents
    done, not tokenizing them again) and writes the shards an uninterrupted prepare writes."""
    import bigbatch.data.encode as encode
    import bigbatch.data.hf_source as hf_source
    import bigbatch.data.resumable as resumable

    monkeypatch.setattr(resumable, "CHECKPOINT_SECONDS", 0.0)  # save the position after every document
    monkeypatch.setattr(encode, "TASK_BYTES", 1)  # one document per worker task: some are done before the stop
    source = f"hf:json:{files}/jsonl/*.jsonl"
    settings = {"tokenizer_name": tokenizer, "val_fraction": 0.1, "workers": workers}
    whole = prepare_dataset(source, tmp_path / "whole", **settings)
    real = hf_source.hf_text_records
    passes = 2 if tokenizer.startswith("bpe") else 1  # a BPE is trained on a first pass, kept for the resume
    calls: list[int] = []

    def interrupted(src: str):  # type: ignore[no-untyped-def]
        calls.append(0)
        for number, record in enumerate(real(src), start=1):
            if len(calls) == passes and number == 25:
                raise KeyboardInterrupt
            calls[-1] += 1
            yield record

    monkeypatch.setattr(hf_source, "hf_text_records", interrupted)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        prepare_dataset(source, out, **settings)
    partial = tmp_path / ".out.partial"
    assert not out.exists() and (partial / "progress.json").is_file()
    done = json.loads((partial / "progress.json").read_text())["documents"]
    assert 0 < done <= 24

    calls.clear()
    passes = 0  # no more interruptions
    caplog.set_level("INFO", logger="bigbatch.data.resumable")
    meta = prepare_dataset(source, out, **settings)
    assert calls == [len(TEXTS)]  # one pass (no BPE trained again), the documents done read past
    assert f"resuming an interrupted prepare after {done} documents" in caplog.text
    assert not partial.exists() and not list(out.glob(".*"))
    assert meta.tokens == whole.tokens and meta.documents == whole.documents
    for split in ("train", "val"):
        for a, b in zip(meta.shards[split], whole.shards[split], strict=True):
            assert np.array_equal(np.load(out / a), np.load(tmp_path / "whole" / b))
    if tokenizer.startswith("bpe"):
        assert (out / "tokenizer.json").read_text() == (tmp_path / "whole" / "tokenizer.json").read_text()


def test_a_partial_directory_of_other_settings_is_started_afresh(files: Path, tmp_path: Path) -> None:
    partial = tmp_path / ".out.partial"
    partial.mkdir()
    (partial / "progress.json").write_text(json.dumps({"fingerprint": "other", "documents": 7, "stream_bytes": 3}))
    (partial / ".tokens.tmp").write_bytes(b"abc")
    meta = prepare_dataset(f"hf:json:{files}/jsonl/*.jsonl", tmp_path / "out", val_fraction=0.0, mode="documents")
    assert meta.documents == len(KEPT) and documents_of(tmp_path / "out") == KEPT and not partial.exists()


# ------------------------------------------------------------------------------------ conversations through hf:


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from chat_models import chat_model_dir

    return chat_model_dir(tmp_path_factory.mktemp("qwen"), "qwen2.5")


def _chat_rows() -> list[dict]:
    from chat_models import conversations

    return [row for row in conversations() if not row.get("tools")]  # one schema for every row: Arrow needs it


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    return path


def _same_shards(a: Path, b: Path) -> None:
    for name in ("train_000000.npy", "train_000000.offsets.npy", "train_000000.mask.npy"):
        assert np.array_equal(np.load(a / name), np.load(b / name)), name


@pytest.mark.parametrize("mode", ["auto", "documents"])
def test_a_dataset_of_messages_is_read_as_conversations_without_naming_the_column(
    tmp_path: Path, qwen: Path, mode: str
) -> None:
    """hf:json of rows that hold only messages (and tools) is conversations, as docs/data.md says: no #messages,
    and under the default mode (auto) no --mode documents either; the shards are those of bigbatch's own reader."""
    data = _write_jsonl(tmp_path / "chat.jsonl", _chat_rows())
    meta = prepare_dataset(f"hf:json:{data}", tmp_path / "hf", f"file:{qwen}", val_fraction=0.0, mode=mode)
    own = prepare_dataset(str(data), tmp_path / "own", f"file:{qwen}", val_fraction=0.0, mode="documents")
    assert meta.mode == "documents" and meta.documents == own.documents == len(_chat_rows())
    _same_shards(tmp_path / "hf", tmp_path / "own")


def test_sharegpt_and_content_parts_through_hf_are_the_same_conversations(tmp_path: Path, qwen: Path) -> None:
    """The same rows as ShareGPT (conversations of from/value) and with every content a list of text parts (how
    Arrow stores OpenAI's format: a list of structs), read through datasets, give the shards of the plain rows."""
    rows = _chat_rows()
    roles = {"user": "human", "assistant": "gpt", "system": "system"}
    shared = [
        {"conversations": [{"from": roles[m["role"]], "value": m["content"]} for m in r["messages"]]} for r in rows
    ]
    parts = [
        {"messages": [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in r["messages"]]}
        for r in rows
    ]
    own = prepare_dataset(
        str(_write_jsonl(tmp_path / "plain.jsonl", rows)), tmp_path / "own", f"file:{qwen}", 0.0, mode="documents"
    )
    for name, written in (("sharegpt", shared), ("parts", parts)):
        data = _write_jsonl(tmp_path / f"{name}.jsonl", written)
        meta = prepare_dataset(f"hf:json:{data}", tmp_path / name, f"file:{qwen}", val_fraction=0.0, mode="auto")
        assert meta.documents == own.documents, name
        _same_shards(tmp_path / name, tmp_path / "own")


@pytest.mark.parametrize(
    ("source", "name", "content", "line"),
    [
        ("hf:json:{dir}/bad.jsonl", "bad.jsonl", b'{"text": "fine"}\n{"text": "caf\xe9"}\n', 2),
        ("hf:csv:{dir}/bad.csv", "bad.csv", b"text\nfine\ncaf\xe9\n", 3),
        ("hf:text:{dir}/bad.txt", "bad.txt", b"fine\ncaf\xe9\n", 2),
        ("hf:json:{dir}", "bad.json", b'[{"text": "fine"},\n {"text": "caf\xe9"}]', 2),
    ],
    ids=["json-lines", "csv", "text", "json-directory"],
)
def test_a_local_file_that_is_not_utf8_is_one_line_naming_the_file_and_the_line(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], source: str, name: str, content: bytes, line: int
) -> None:
    """datasets' builders fail with a decoding error that names neither file nor line (and log a line of their
    own); bigbatch names both and says what to do, once."""
    data = tmp_path / "data"
    data.mkdir()
    (data / name).write_bytes(content)
    with pytest.raises(BigBatchError) as info:
        prepare_dataset(source.format(dir=data), tmp_path / "out", workers=1)
    message = str(info.value)
    assert f"{data / name}:{line}: not valid UTF-8 (byte 0xe9 at byte " in message, message
    assert "re-encode it as UTF-8" in message and "\n" not in message
    assert "Failed to read file" not in capfd.readouterr().err
    assert not (tmp_path / "out").exists()
