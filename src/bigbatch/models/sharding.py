"""How the models are sharded: FSDP2 wraps each transformer block, then the root (see
:func:`bigbatch.parallel.distributed.wrap_model`, which knows nothing of the model's layout)."""

from __future__ import annotations

import torch.nn as nn

from bigbatch.models.gpt.model import GPT
from bigbatch.models.hf_causal import HFCausalLM
from bigbatch.models.llama.model import Llama


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The submodules that FSDP2 shards as units before the root: a GPT's transformer blocks, a Llama's
    decoder layers, a Hugging Face model's decoder layers (their embeddings, final norm and head stay with the
    root). Another model gives none: only the root."""
    if isinstance(model, GPT):
        return list(model.transformer.h)  # the blocks
    if isinstance(model, Llama):
        return list(model.model.layers)
    if isinstance(model, HFCausalLM):
        return model.decoder_layers()
    return []
