"""The ``hf:`` data source where the real ``datasets`` cannot go offline: a Hub dataset (the cache key, a network
that fails while loading or mid-stream) and the package missing, with a fake or absent ``datasets`` module.
Local files through the real package: tests/integration/test_hf_datasets.py."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

from bigbatch.data.cache import ensure_prepared
from bigbatch.data.corpus import parse_hf_source
from bigbatch.data.prepare import prepare_dataset
from bigbatch.errors import BigBatchError

TEXTS = ["first document, héllo", "second one\nwith two lines", "", "third"]


def fake_datasets(monkeypatch: pytest.MonkeyPatch, load: Any) -> list[tuple[tuple, dict]]:
    calls: list[tuple[tuple, dict]] = []

    def load_dataset(*args: Any, **kwargs: Any) -> Any:
        calls.append((args, kwargs))
        return load(*args, **kwargs)

    module = types.ModuleType("datasets")
    module.load_dataset = load_dataset  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "datasets", module)
    return calls


def test_parse() -> None:
    assert parse_hf_source("hf:org/name") == ("org/name", None, "train")
    assert parse_hf_source("hf:HuggingFaceFW/fineweb-edu:sample-10BT:train") == (
        "HuggingFaceFW/fineweb-edu",
        "sample-10BT",
        "train",
    )
    assert parse_hf_source("hf:x::validation") == ("x", None, "validation")
    with pytest.raises(BigBatchError, match="hf:NAME"):
        parse_hf_source("hf:a:b:c:d")


def test_ensure_prepared_caches_by_source(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls = fake_datasets(monkeypatch, lambda *a, **k: iter([{"text": "hello world\n" * 20}]))
    first = ensure_prepared("hf:org/name:cfg", "byte", 0.1, cache_dir=tmp_path)
    again = ensure_prepared("hf:org/name:cfg", "byte", 0.1, cache_dir=tmp_path)
    assert first == again and len(calls) == 1
    assert ":" not in first.name and first.parent == tmp_path
    other = ensure_prepared("hf:org/name:other", "byte", 0.1, cache_dir=tmp_path)
    assert other != first and len(calls) == 2


def test_missing_datasets_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails
    with pytest.raises(BigBatchError) as caught:
        prepare_dataset("hf:org/name", tmp_path / "out")
    assert str(caught.value) == (
        "the hf: data source needs the datasets package, which is not installed: "
        "pip install -e '.[hf]' (bigbatch's [hf] extra: datasets, transformers and peft)"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("when", ["load", "iterate"])
def test_offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, when: str) -> None:
    def records() -> Any:
        yield {"text": "one"}
        raise ConnectionError("Couldn't reach the Hub\nmore detail")

    def load(*args: Any, **kwargs: Any) -> Any:
        if when == "load":
            raise ConnectionError("Couldn't reach 'org/name' on the Hub (LocalEntryNotFoundError)")
        return records()

    fake_datasets(monkeypatch, load)
    with pytest.raises(BigBatchError) as info:
        prepare_dataset("hf:org/name", tmp_path / "out")
    message = str(info.value)
    assert "\n" not in message
    assert "org/name could not be downloaded" in message and "offline?" in message and "local copy" in message
