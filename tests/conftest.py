"""Shared fixtures: tiny deterministic models and batches on CPU in fp32; an isolated working directory."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import fast_suite
import outside_stop
import pytest
import torch
from outside_stop import (  # noqa: F401 (hooks: pytest finds them by name here)
    pytest_runtest_makereport,
    pytest_runtest_setup,
    pytest_unconfigure,
)
from tiny import VOCAB

from bigbatch.models import GPT, GPTConfig


def pytest_configure(config: pytest.Config) -> None:
    outside_stop.pytest_configure(config)
    fast_suite.register(config)


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(1234)


@pytest.fixture
def tiny_config() -> GPTConfig:
    return GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=VOCAB)


@pytest.fixture
def tiny_model(tiny_config: GPTConfig) -> GPT:
    return GPT(tiny_config)


@pytest.fixture
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A test that runs commands: its own working directory and data cache, and the root logger restored
    afterwards (``main()`` points it at the current stdout). Use with ``pytest.mark.usefixtures("isolated")``."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("BIGBATCH_CACHE", str(tmp_path / "env-cache"))
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
