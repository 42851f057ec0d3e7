"""Data: tokenizers, corpus preparation, token shards and the rank-aware loader.

The names below are imported when first used, so importing a light module of this package (``bigbatch
prepare``'s corpus, tokenizers and shards) does not import torch, which only the loaders need.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bigbatch.data.cache import ensure_prepared
    from bigbatch.data.prepare import prepare_dataset
    from bigbatch.data.shards import DatasetMeta, TokenDataset
    from bigbatch.data.stream import TokenStreamLoader
    from bigbatch.data.tokenizers import get_tokenizer
    from bigbatch.engine.batch import MicroBatch

_HOMES = {
    "DatasetMeta": "bigbatch.data.shards",
    "MicroBatch": "bigbatch.engine.batch",
    "TokenDataset": "bigbatch.data.shards",
    "TokenStreamLoader": "bigbatch.data.stream",
    "ensure_prepared": "bigbatch.data.cache",
    "get_tokenizer": "bigbatch.data.tokenizers",
    "prepare_dataset": "bigbatch.data.prepare",
}

__all__ = [
    "DatasetMeta",
    "MicroBatch",
    "TokenDataset",
    "TokenStreamLoader",
    "ensure_prepared",
    "get_tokenizer",
    "prepare_dataset",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
