"""How the models are sharded: FSDP2 wraps each unit a model names, then the root (see
:func:`bigbatch.parallel.distributed.wrap_model`, which knows nothing of the model's layout).

Each family says its own units with a ``fsdp_units()`` method (GPT: its transformer blocks, Llama and a Hugging
Face model: their decoder layers); :func:`fsdp_units` is the one place that asks.
"""

from __future__ import annotations

import torch.nn as nn


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The submodules that FSDP2 shards as units before the root: what ``model``'s class says through its
    ``fsdp_units()`` method (the embeddings, final norm and head stay with the root). A model whose class has no
    such method gives none: only the root."""
    units = getattr(type(model), "fsdp_units", None)  # the class's: a submodule named fsdp_units is no method
    return list(units(model)) if callable(units) else []
