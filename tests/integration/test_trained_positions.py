"""A documents run's positions count what was trained: not a micro-batch that skip-micro dropped, not a step that
was skipped, not the steps a rewind undid (the end-of-run line, and the shares of each step record)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from reliability_runs import STEPS, cli_args, run_cli
from text_corpus import text_corpus

PER_STEP = 4 * 2 * 32  # K 4 x micro-batch 2 x seq_len 32: every position of a step (one process)
PER_MICRO_BATCH = 2 * 32


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Short documents, each within one row: the poisoned micro-batch's documents are in no other micro-batch, so
    dropping it drops nothing else (a document over several micro-batches is dropped whole, see
    test_bad_step_attribution.py)."""
    text = text_corpus(60_000).decode("utf-8", "replace")
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": text[i : i + 24]}) + "\n" for i in range(0, len(text) - 24, 24)))
    return path


def positions_line(stdout: str) -> int:
    found = re.search(r"positions \| ([\d,]+) trained on: ", stdout)
    assert found, stdout[-3000:]
    return int(found.group(1).replace(",", ""))


def steps(out: Path) -> list[dict]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "step"]


@pytest.mark.parametrize(
    ("mode", "extra", "fault"),
    [
        ("skip-micro", (), "nan-input:step=2,micro=1"),
        ("rewind", ("--save-every", "2"), "nan-input:step=4,micro=2"),  # back to step 2: steps 3 and 4 again
    ],
)
def test_positions_count_only_the_micro_batches_trained(
    corpus: Path, tmp_path: Path, mode: str, extra: tuple[str, ...], fault: str
) -> None:
    out = tmp_path / mode
    args = cli_args(corpus, out, "--data-mode", "documents", "--bad-step", mode, "--eval-every", "0", *extra)
    done = run_cli(args, fault=fault)
    assert done.returncode == 0, done.stderr[-3000:]
    applied = [r for r in steps(out) if not r["skipped"]]
    assert [r["step"] for r in applied] == list(range(1, STEPS + 1))
    assert positions_line(done.stdout) == STEPS * PER_STEP - PER_MICRO_BATCH  # one micro-batch never trained
    # each step record's shares are of the positions it trained: its valid targets over its valid share
    trained = [r["tokens"] / (1 - r["padding_share"] - r["prompt_share"]) for r in applied]
    assert sorted(round(t) for t in trained) == [PER_STEP - PER_MICRO_BATCH] + [PER_STEP] * (STEPS - 1)
