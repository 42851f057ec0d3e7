"""Data: tokenizers, corpus preparation, token shards and the rank-aware loader."""

from bigbatch.batch import MicroBatch
from bigbatch.data.cache import ensure_prepared
from bigbatch.data.loader import PackedLoader
from bigbatch.data.prepare import prepare_dataset
from bigbatch.data.shards import DatasetMeta, TokenDataset
from bigbatch.data.tokenizers import get_tokenizer

__all__ = [
    "DatasetMeta",
    "MicroBatch",
    "PackedLoader",
    "TokenDataset",
    "ensure_prepared",
    "get_tokenizer",
    "prepare_dataset",
]
