"""bigbatch's JSON is standard JSON: NaN and infinities written as null and named, read back as they were; older
metrics.jsonl files with bare NaN still read; every writer of JSON in the package goes through it or says why it
need not."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

import bigbatch
from bigbatch.files.atomic import write_json_atomically
from bigbatch.files.json_text import NONFINITE_FIELD, from_json, to_json
from bigbatch.observe.metrics import METRICS_FILE, JsonlLog, read_records, truncate_metrics
from bigbatch.observe.runs import read_metrics


def strict_loads(text: str) -> Any:
    """What a strict parser (node's JSON.parse, jq) accepts: no bare NaN / Infinity."""

    def refuse(word: str) -> None:
        raise ValueError(f"not JSON: {word}")

    return json.loads(text, parse_constant=refuse)


def same(a: Any, b: Any) -> bool:
    """Equal, with NaN equal to NaN."""
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_non_finite_numbers_are_null_named_and_read_back_as_they_were() -> None:
    record = {
        "kind": "step",
        "step": 3,
        "loss": math.nan,
        "grad_norm": math.inf,
        "lr": 1e-3,
        "router": {"load": [1.0, -math.inf, 2.0]},
        "skipped": True,
    }
    text = to_json(record)
    written = strict_loads(text)
    assert written["loss"] is None and written["grad_norm"] is None and written["router"]["load"][1] is None
    assert written[NONFINITE_FIELD] == {"loss": "NaN", "grad_norm": "Infinity", "router.load.1": "-Infinity"}
    assert same(from_json(text), record)
    assert to_json({"loss": 2.5}) == json.dumps({"loss": 2.5})  # finite records: byte for byte as before
    assert strict_loads(to_json({"a": 1}, indent=2)) == {"a": 1}
    with pytest.raises(ValueError, match="outside a JSON object"):
        to_json([math.nan])


def test_older_files_with_bare_nan_still_read() -> None:
    assert same(
        from_json('{"loss": NaN, "grad_norm": Infinity, "x": -Infinity}'),
        {"loss": math.nan, "grad_norm": math.inf, "x": -math.inf},
    )
    # a null that the file itself wrote (no nonfinite field) stays None; a stray path is ignored
    assert from_json('{"loss": null, "nonfinite": {"nowhere.3": "NaN", "loss": "bogus"}}') == {"loss": None}


def test_metrics_jsonl_is_json_lines_and_every_reader_gets_the_numbers(tmp_path: Path) -> None:
    log = JsonlLog(tmp_path / METRICS_FILE)
    log.write("step", step=1, loss=2.5, grad_norm=0.5, tokens=128, skipped=False)
    log.write("step", step=2, loss=math.nan, grad_norm=math.inf, tokens=128, skipped=True)
    log.write("eval", step=2, val_loss=math.nan)
    log.close()
    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    assert [strict_loads(line)["kind"] for line in lines] == ["step", "step", "eval"]
    records = read_records(tmp_path)
    assert math.isnan(records[1]["loss"]) and records[1]["grad_norm"] == math.inf
    assert NONFINITE_FIELD not in records[1] and math.isnan(records[2]["val_loss"])
    run = read_metrics(tmp_path)
    assert [r["step"] for r in run.trained] == [1] and math.isnan(run.evals[0]["val_loss"])
    truncate_metrics(tmp_path, 1)  # a resume reads each line too
    assert [r["step"] for r in read_records(tmp_path)] == [1]


def test_a_run_written_before_keeps_reading(tmp_path: Path) -> None:
    (tmp_path / METRICS_FILE).write_text(
        '{"kind": "step", "step": 1, "loss": 2.5, "tokens": 128, "skipped": false}\n'
        '{"kind": "step", "step": 2, "loss": NaN, "grad_norm": Infinity, "tokens": 128, "skipped": true}\n'
    )
    records = read_records(tmp_path)
    assert len(records) == 2 and math.isnan(records[1]["loss"]) and records[1]["grad_norm"] == math.inf
    assert [r["step"] for r in read_metrics(tmp_path).trained] == [1]


def test_json_files_are_standard_json(tmp_path: Path) -> None:
    path = tmp_path / "result.json"
    write_json_atomically(path, {"noise_scale": math.nan, "points": [{"b": 1.0}]})
    assert strict_loads(path.read_text())["noise_scale"] is None
    assert same(from_json(path.read_text()), {"noise_scale": math.nan, "points": [{"b": 1.0}]})


WITHOUT_NON_FINITE: dict[str, str] = {
    "files/json_text.py": "the strict writer itself",
    "files/lock.py": "a holder record: host, pid, time, command, token",
    "observe/wandb_log.py": "W&B's config, passed to W&B (which takes what Python's json takes)",
    "models/hf_files.py": "a Hugging Face config.json, written as transformers writes it",
    "data/tokenizer_files.py": "tokenizer files in Hugging Face's formats: names, ids, strings",
    "data/tokenizer_pipeline.py": "Hugging Face tokenizers' own JSON, round-tripped",
    "data/tokenizers.py": "a canonical form of a tokenizer's JSON, hashed",
    "data/resumable.py": "a read position: integers",
    "data/chat.py": "a conversation's fields as text, searched for special tokens: never written",
    "data/cache.py": "a hash's input, never read back",
    "data/prepare.py": "a hash's input, never read back",
    "run/checkpoints/sharded.py": "a commit marker and a hash's input: sizes and checksums",
    "run/checkpoints/checkpoint.py": "a commit marker: step, size, checksum",
    "run/configuration/identity.py": "a run's hash input: changing it would change every run's directory name",
    "run/loop/bad_step_handling.py": "bad-steps.json: micro-batch keys and a count",
}
"""The modules that call ``json.dumps`` themselves, with why a NaN cannot reach a reader through them; every other
writer uses :func:`bigbatch.files.json_text.to_json` (or ``write_json_atomically``, which does)."""


def test_every_json_writer_writes_standard_json_or_says_why_it_need_not() -> None:
    package = Path(bigbatch.__file__).parent
    calling = {
        path.relative_to(package).as_posix()
        for path in package.rglob("*.py")
        if re.search(r"\bjson\.dumps?\(", path.read_text(encoding="utf-8"))
    }
    unexplained = sorted(calling - WITHOUT_NON_FINITE.keys())
    assert not unexplained, f"{unexplained} call json.dumps: use bigbatch.files.json_text.to_json, or list them here"
    gone = sorted(name for name in WITHOUT_NON_FINITE if not (package / name).is_file())
    assert not gone, f"{gone} no longer exist: drop them from WITHOUT_NON_FINITE"
