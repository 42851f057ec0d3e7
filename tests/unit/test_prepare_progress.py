"""The tokenization progress of ``prepare``: a bar on a terminal, periodic log lines anywhere else."""

from __future__ import annotations

import io
import logging
import sys
from pathlib import Path

import pytest

from bigbatch.data import corpus_progress, prepare


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    root.mkdir()
    for i in range(5):
        (root / f"doc{i}.txt").write_text(f"document {i}\n" * 200)
    return root


def test_no_bar_without_a_terminal(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    stderr = io.StringIO()  # not a TTY
    monkeypatch.setattr(sys, "stderr", stderr)
    monkeypatch.setattr(corpus_progress, "PROGRESS_SECONDS", 0.0)  # a log line per document
    with caplog.at_level(logging.INFO, logger="bigbatch.data"):
        prepare.prepare_dataset(str(corpus), tmp_path / "out", workers=1)
    assert stderr.getvalue() == ""
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("tokenized ")]
    assert lines and all("MB/s" in line for line in lines)
    assert lines[0].startswith("tokenized 1 document, ") and lines[-1].startswith("tokenized 5 documents, ")
    (done,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("prepared ")]
    assert f"prepared {tmp_path / 'out'}: 5 documents, " in done


def test_one_document_is_one_document(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "one.txt").write_text("document\n" * 50)
    with caplog.at_level(logging.INFO, logger="bigbatch.data"):
        prepare.prepare_dataset(str(tmp_path / "one.txt"), tmp_path / "out", workers=1)
    (done,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("prepared ")]
    assert f"prepared {tmp_path / 'out'}: 1 document, " in done


def test_bar_on_a_terminal(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    stderr = FakeTTY()
    monkeypatch.setattr(sys, "stderr", stderr)
    monkeypatch.setattr(corpus_progress, "PROGRESS_SECONDS", 0.0)
    with caplog.at_level(logging.INFO, logger="bigbatch.data"):
        meta = prepare.prepare_dataset(str(corpus), tmp_path / "out", workers=1)
    drawn = stderr.getvalue()
    assert "\rtokenized MB 0.0/0.0 [####....." in drawn and " 20% | 1 document | " in drawn
    assert "100% | 5 documents" in drawn  # the last frame is always drawn
    assert "MB/s" in drawn and "ETA" in drawn and "documents" in drawn
    assert drawn.endswith("\r")  # erased at the end
    assert not any(r.getMessage().startswith("tokenized ") for r in caplog.records)  # the bar replaces them
    assert meta.documents == 5
