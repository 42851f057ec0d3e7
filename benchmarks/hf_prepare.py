"""Preparing a local .jsonl through ``hf:`` (the ``datasets`` package, streamed) against bigbatch's own reader.

    python benchmarks/hf_prepare.py [--mb 100] [--tokenizer byte] [--rounds 1]

Writes ``--mb`` MB of .jsonl (documents cut from the Python standard library's sources, ``{"text": ...}`` per
line, in 8 files) into a temporary directory, then prepares it with ``bigbatch prepare``'s function twice per
round: as ``hf:json:DIR/*.jsonl`` and as ``DIR`` (bigbatch's own text path, which reads .jsonl itself), the
order turning every round. Prints each time (median over rounds), MB/s and the ratio hf / own, and checks that
the two give the same shards. The one-off start of ``hf:`` (importing ``datasets``, which imports torch, and
its first ``load_dataset``) is timed apart first, on a one-line file, and printed separately.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from bigbatch.data.corpus import builtin_corpus_files
from bigbatch.data.hf_source import hf_text_records
from bigbatch.data.prepare import prepare_dataset

FILES = 8
DOC_BYTES = 4_000


def write_corpus(directory: Path, total_bytes: int) -> int:
    """``total_bytes`` of text as .jsonl documents of about ``DOC_BYTES``; returns the text bytes written."""
    sources = [p.read_text(errors="replace") for p in builtin_corpus_files()]
    text = "".join(sources)
    per_file = total_bytes // FILES
    written, position = 0, 0
    for index in range(FILES):
        with open(directory / f"part_{index:02d}.jsonl", "w", encoding="utf-8") as handle:
            size = 0
            while size < per_file:
                if position + DOC_BYTES > len(text):
                    position = 0
                doc = text[position : position + DOC_BYTES]
                position += DOC_BYTES
                line = json.dumps({"text": doc}) + "\n"
                handle.write(line)
                size += len(line.encode())
                written += len(doc.encode())
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=100.0)
    parser.add_argument("--tokenizer", default="byte")
    parser.add_argument("--workers", type=int, default=0, help="tokenizer processes (default: prepare's choice)")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    times: dict[str, list[float]] = {"own": [], "hf": []}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        data.mkdir()
        text_bytes = write_corpus(data, int(args.mb * 1e6))
        file_mb = sum(p.stat().st_size for p in data.iterdir()) / 1e6
        print(
            f"{file_mb:.0f} MB of .jsonl in {FILES} files ({text_bytes / 1e6:.0f} MB of text), --tokenizer "
            f"{args.tokenizer}"
        )
        sources = {"own": str(data), "hf": f"hf:json:{data}/*.jsonl"}
        (Path(tmp) / "one.jsonl").write_text(json.dumps({"text": "warm-up"}) + "\n")
        started = time.perf_counter()
        list(hf_text_records(f"hf:json:{tmp}/one.jsonl"))
        print(
            f"hf: one-off start (import datasets and torch, first load_dataset): {time.perf_counter() - started:.1f} s"
        )
        metas = {}
        for round_ in range(args.rounds):
            for name in ("own", "hf") if round_ % 2 == 0 else ("hf", "own"):
                out = Path(tmp) / f"{name}-{round_}"
                started = time.perf_counter()
                metas[name] = prepare_dataset(
                    sources[name], out, tokenizer_name=args.tokenizer, workers=args.workers or None
                )
                times[name].append(time.perf_counter() - started)
        same = metas["own"].tokens == metas["hf"].tokens and all(
            np.array_equal(np.load(Path(tmp) / f"own-0/{a}"), np.load(Path(tmp) / f"hf-0/{b}"))
            for split in ("train", "val")
            for a, b in zip(metas["own"].shards[split], metas["hf"].shards[split], strict=True)
        )
    for name, label in (("own", "bigbatch's own .jsonl reader"), ("hf", "hf:json (datasets, streamed)")):
        seconds = statistics.median(times[name])
        print(f"{label:<32} {seconds:7.1f} s {file_mb / seconds:7.1f} MB/s")
    print(
        f"ratio hf / own: {statistics.median(times['hf']) / statistics.median(times['own']):.2f}; same shards: {same}"
    )
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
