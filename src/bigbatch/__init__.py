"""bigbatch: train GPT-style models (GPT-2, Llama, any local Hugging Face causal LM) with exact gradient accumulation.

The public API is importable from here; each name is imported on first use, so ``import bigbatch`` (and
``bigbatch --help``) stays free of torch. The rooms behind it are listed in ``docs/architecture.md``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public name -> the module that defines it.
_PUBLIC = {
    "AccumulationEngine": "bigbatch.engine.accumulate",
    "StepRecord": "bigbatch.engine.accumulate",
    "token_loss_sum": "bigbatch.engine.accumulate",
    "StepHook": "bigbatch.engine.hooks",
    "MicroBatch": "bigbatch.engine.batch",
    "build_adamw": "bigbatch.engine.optim",
    "CosineSchedule": "bigbatch.engine.optim",
    "build_muon": "bigbatch.engine.muon",
    "MuonSettings": "bigbatch.engine.muon",
    "GPT": "bigbatch.models",
    "GPTConfig": "bigbatch.models",
    "Llama": "bigbatch.models",
    "LlamaConfig": "bigbatch.models",
    "model_preset": "bigbatch.models",
    "preset": "bigbatch.models",
    "TrainConfig": "bigbatch.run.configuration.train_config",
    "Trainer": "bigbatch.run.loop.trainer",
    "check_equivalence": "bigbatch.verify",
    "check_distributed_equivalence": "bigbatch.verify",
    "EquivalenceReport": "bigbatch.verify",
}

__all__ = [
    "AccumulationEngine",
    "StepRecord",
    "token_loss_sum",
    "StepHook",
    "MicroBatch",
    "build_adamw",
    "CosineSchedule",
    "build_muon",
    "MuonSettings",
    "GPT",
    "GPTConfig",
    "Llama",
    "LlamaConfig",
    "model_preset",
    "preset",
    "TrainConfig",
    "Trainer",
    "check_equivalence",
    "check_distributed_equivalence",
    "EquivalenceReport",
    "__version__",
]

if TYPE_CHECKING:
    from bigbatch.engine.accumulate import AccumulationEngine, StepRecord, token_loss_sum
    from bigbatch.engine.batch import MicroBatch
    from bigbatch.engine.hooks import StepHook
    from bigbatch.engine.muon import MuonSettings, build_muon
    from bigbatch.engine.optim import CosineSchedule, build_adamw
    from bigbatch.models import GPT, GPTConfig, Llama, LlamaConfig, model_preset, preset
    from bigbatch.run.configuration.train_config import TrainConfig
    from bigbatch.run.loop.trainer import Trainer
    from bigbatch.verify import EquivalenceReport, check_distributed_equivalence, check_equivalence


def __getattr__(name: str) -> Any:
    """``bigbatch.GPT`` and the rest of the public API, imported on first use."""
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'bigbatch' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
