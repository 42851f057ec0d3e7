"""Tiny random Hugging Face causal LMs built in the test (never downloaded), for ``--model hf:DIR``: the byte
vocabulary (256), 2 layers, 32 wide, 64 positions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

SHAPES: dict[str, dict[str, Any]] = {
    "gpt2": {  # without dropout (GPT-2's config has 0.1 in three places), and special tokens in the vocabulary
        "n_layer": 2,
        "n_head": 2,
        "n_embd": 32,
        "n_positions": 64,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 0,
    },
    "llama": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    },
    "qwen2": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
    },
    "mixtral": {
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "router_aux_loss_coef": 0.02,
        "output_router_logits": True,
    },
    "qwen2_moe": {  # with its shared expert and query/key/value biases
        "hidden_size": 32,
        "intermediate_size": 48,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 24,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": False,
        "router_aux_loss_coef": 0.01,
        "tie_word_embeddings": False,
    },
    "qwen3_moe": {
        "hidden_size": 32,
        "intermediate_size": 48,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 64,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "router_aux_loss_coef": 0.01,
        "tie_word_embeddings": False,
    },
    "olmoe": {
        "hidden_size": 32,
        "intermediate_size": 24,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "router_aux_loss_coef": 0.01,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 1,
    },
    "granitemoe": {  # a router bigbatch does not read
        "hidden_size": 32,
        "intermediate_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    },
}
CLASSES = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}
MOE_KINDS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def hf_config(kind: str, **extra: Any) -> Any:
    """The transformers config of a tiny ``kind`` model over the byte vocabulary."""
    import transformers

    return transformers.AutoConfig.for_model(kind, vocab_size=256, **{**SHAPES[kind], **extra})


def save_hf(kind: str, directory: Path, weights: bool = True, seed: int = 0, **extra: Any) -> Any:
    """A random ``kind`` model saved to ``directory`` (config.json only with ``weights`` off); returns the model
    (in eval mode), or its config without weights."""
    import transformers

    config = hf_config(kind, **extra)
    if not weights:
        config.save_pretrained(directory)
        return config
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(directory)
    return model
