"""Every mixture-of-experts causal LM the installed transformers ships, as a tiny random model built offline: the
model types found by behaviour (a config that counts experts), each config shrunk to 2 layers, 32 wide, 4 experts
(top-2) over the byte vocabulary, whatever the family names its keys. A type that cannot be built this way on the
CPU is reported with the reason, not skipped in silence."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")

SHRUNK: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 24,
    "expert_intermediate_size": 16,
    "expert_ffn_hidden_size": 16,
    "ffn_hidden_size": 48,
    "num_hidden_layers": 2,
    "num_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,  # multi-head latent attention (DeepSeek's) wants as many as the query heads
    "head_dim": 8,
    "max_position_embeddings": 64,
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "moe_k": 2,
    "top_k": 2,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "first_k_dense_replace": 0,
    "decoder_sparse_step": 1,
    "n_group": 1,
    "topk_group": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "qk_head_dim": 16,
    "v_head_dim": 8,
    "sliding_window": 16,
    "router_jitter_noise": 0.0,  # noise drawn per forward: K micro-batches would draw other noise than one batch
    "input_jitter_noise": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 1,
}
"""Each key set where a family's config has it (hybrid and attention-variant keys are left at their defaults
unless they only size the model)."""


OVERRIDES: dict[str, dict[str, Any]] = {
    "zaya": {"num_experts_per_tok": 1},  # routes to one expert only
    "granitemoehybrid": {"mamba_n_heads": 4, "mamba_d_head": 16},
    "lfm2_moe": {"layer_types": ["full_attention", "conv"], "num_dense_layers": 0},
    "kimi_linear": {"num_experts_per_token": 2},
    "longcat_flash": {"zero_expert_num": 2},  # identity experts beside the routed ones
}


def moe_model_types() -> list[str]:
    """The causal-LM model types whose default config counts experts (a number of experts above 1)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            values = CONFIG_MAPPING[model_type]().to_dict()
        except Exception:  # noqa: BLE001 - a config that needs arguments is no text-only causal LM to build here
            continue
        if any(isinstance(values.get(key), int) and values[key] > 1 for key in EXPERT_KEYS):
            found.append(model_type)
    return found


def tiny_config(model_type: str) -> Any:
    """The shrunk transformers config of ``model_type`` (per-layer lists cut to the layers kept)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    defaults = CONFIG_MAPPING[model_type]().to_dict()
    values = {key: value for key, value in SHRUNK.items() if key in defaults}
    layers = values.get("num_hidden_layers", 2)
    for key, value in defaults.items():
        if isinstance(value, list) and len(value) == defaults.get("num_hidden_layers"):
            values[key] = value[:layers]
    for key in ("mlp_only_layers",):
        if key in defaults:
            values[key] = []
    if "router_aux_loss_coef" in defaults:
        values["router_aux_loss_coef"] = 0.02
    values.update(OVERRIDES.get(model_type, {}))
    return CONFIG_MAPPING[model_type](**values)


def build_tiny(model_type: str, seed: int = 0) -> Any:
    """A tiny random ``model_type`` causal LM in eval mode (fp32, CPU)."""
    import torch
    import transformers

    config = tiny_config(model_type)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.getLogger("transformers").setLevel(logging.ERROR)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        with torch.no_grad():  # a shrunk config that builds a model whose plain forward fails is no model
            model(input_ids=torch.arange(2, 34).view(2, 16), use_cache=False)
    return model


NOT_BUILT: dict[str, str] = {
    "mimo_v2_flash": "its shrunk attention fails in a plain forward (a tensor of 0 heads)",
}
"""Model types this zoo cannot build tiny on the CPU, with the reason."""


def accumulated_gradient(model: Any, inputs: Any, targets: Any, k: int) -> Any:
    """The gradient of a copy of ``model`` (an ``HFCausalLM``) accumulated over ``inputs``/``targets`` split into
    ``k`` micro-batches, flattened over the parameters that get one."""
    import copy

    import torch

    from bigbatch.engine.accumulate import AccumulationEngine
    from bigbatch.engine.batch import MicroBatch
    from bigbatch.engine.optim import constant_schedule

    replica = copy.deepcopy(model)
    engine = AccumulationEngine(replica, torch.optim.SGD(replica.parameters(), lr=1.0), constant_schedule(1.0))
    engine.accumulate([MicroBatch(x, y) for x, y in zip(inputs.tensor_split(k), targets.tensor_split(k), strict=True)])
    return torch.cat([p.grad.flatten() for p in replica.parameters() if p.grad is not None])


def wrap_tiny(model_type: str, directory: Path) -> Any:
    """The tiny ``model_type`` as ``bigbatch train --model hf:DIR`` wraps it (an ``HFCausalLM``, dropout off, in
    train mode; its config.json written to ``directory``), or the one line that refuses its config.json."""
    from bigbatch.errors import ConfigError
    from bigbatch.models.coupling import set_dropout
    from bigbatch.models.hf.config import training_notes
    from bigbatch.models.hf.model import HFCausalLM, read_hf_config

    hf = build_tiny(model_type)
    set_dropout(hf, 0.0)
    hf.config.save_pretrained(directory)
    try:
        config = read_hf_config(directory)
    except ConfigError as exc:
        return str(exc)
    refusal, _ = training_notes(config)
    return refusal or HFCausalLM(config, hf.train())
