"""Mixture-of-experts weights in the Hugging Face layouts: Mixtral and Qwen3-MoE in and out, Qwen2-MoE out.

On disk each expert is its own three matrices: Mixtral's ``block_sparse_moe.experts.N.w1`` (gate), ``w3`` (up) and
``w2`` (down), Qwen's ``mlp.experts.N.gate_proj``, ``up_proj`` and ``down_proj``; the native model stacks them
(``mlp.experts.gate_up_proj`` (E, 2F, C) and ``down_proj`` (E, C, F), as transformers does in memory). Attention,
norms and embeddings are Llama's names. Which layout a shape exports to: a shared expert is Qwen2-MoE's (with zero
query/key/value biases: it always has them), per-head query/key norms Qwen3-MoE's, otherwise Mixtral's (which
always renormalises the top-k weights). Nothing here touches the network.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from bigbatch.errors import CheckpointError, ConfigError
from bigbatch.models.hf.config import CAPACITY_KEYS  # the same keys hf:DIR is refused for
from bigbatch.models.hf_files import (
    check_new_directory,
    load_fitting_weights,
    read_config,
    read_weights,
    write_hf_directory,
)
from bigbatch.models.moe.config import MoEConfig
from bigbatch.models.moe.model import MoE

MODEL_TYPES = ("mixtral", "qwen3_moe")
"""The ``model_type`` s ``--init-from`` reads into the native family (others: ``--model hf:DIR``)."""

_CLASSES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}


def refuse_capacity(config: dict[str, Any], where: str) -> None:
    """One line for a config.json that caps the tokens an expert takes."""
    for key in CAPACITY_KEYS:
        value = config.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            raise ConfigError(
                f"{where} sets {key} = {value}: a capacity drops the tokens routed to a full expert, so one sample's "
                "output depends on the others in its micro-batch and accumulation cannot be exact; bigbatch trains "
                f"mixtures of experts dropless (remove {key})"
            )


def hf_layout(config: MoEConfig) -> str:
    """The transformers class a shape exports to, or one line naming why none fits."""
    if config.shared_ffn_hidden and config.qk_norm:
        raise ConfigError(
            "no transformers layout has both a shared expert and query/key norms (Qwen2-MoE has the first, "
            "Qwen3-MoE the second); this model cannot be exported"
        )
    if config.shared_ffn_hidden:
        return _CLASSES["qwen2_moe"]
    if config.qk_norm:
        return _CLASSES["qwen3_moe"]
    if not config.norm_topk_prob:
        raise ConfigError(
            "Mixtral's layout always renormalises the top-k weights and Qwen3-MoE's has query/key norms: a model "
            "with neither norm_topk_prob nor qk_norm has no transformers layout"
        )
    return _CLASSES["mixtral"]


def moe_config_from_hf(config: dict[str, Any]) -> MoEConfig:
    """The :class:`MoEConfig` of a Mixtral or Qwen3-MoE ``config.json``; variants it does not compute are refused."""
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise CheckpointError(f"model_type {model_type!r} is not one of {', '.join(MODEL_TYPES)}")
    refuse_capacity(config, "config.json")
    n_embd = int(config.get("hidden_size", 4096))
    n_head = int(config.get("num_attention_heads", 32))
    problems = []
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {config.get('hidden_act')!r} (bigbatch uses SiLU)")
    head_dim = config.get("head_dim")
    if head_dim is not None and int(head_dim) * n_head != n_embd:
        problems.append(f"head_dim {head_dim} (bigbatch uses hidden_size / num_attention_heads = {n_embd / n_head:g})")
    if config.get("attention_bias"):
        problems.append("attention biases")
    if float(config.get("router_jitter_noise") or 0.0):
        problems.append("router jitter noise")
    if config.get("sliding_window") and config.get("use_sliding_window", model_type == "mixtral"):
        problems.append("sliding-window attention")
    if config.get("mlp_only_layers") or int(config.get("decoder_sparse_step", 1)) != 1:
        problems.append("dense layers between the MoE layers (mlp_only_layers, decoder_sparse_step)")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if isinstance(rope, dict) and rope.get("rope_type", "default") != "default":
        problems.append(f"rope_type {rope.get('rope_type')!r}")
    if config.get("quantization_config"):
        problems.append("quantized weights")
    if problems:
        raise CheckpointError(
            f"this {model_type} variant is not supported natively: {'; '.join(problems)}; --model hf:DIR trains it "
            "as transformers computes it"
        )
    mixtral = model_type == "mixtral"
    rope_base = float((rope if isinstance(rope, dict) else {}).get("rope_theta", config.get("rope_theta", 1e6)))
    try:
        return MoEConfig(
            n_layer=int(config.get("num_hidden_layers", 32)),
            n_head=n_head,
            n_kv_head=int(config.get("num_key_value_heads") or n_head),
            n_embd=n_embd,
            ffn_hidden=int(config["intermediate_size"] if mixtral else config.get("moe_intermediate_size", 768)),
            n_expert=int(config.get("num_local_experts") or config.get("num_experts") or 8),
            top_k=int(config.get("num_experts_per_tok", 2)),
            block_size=int(config.get("max_position_embeddings", 4096)),
            vocab_size=int(config.get("vocab_size", 32000)),
            norm_topk_prob=True if mixtral else bool(config.get("norm_topk_prob", False)),
            qk_norm=not mixtral,
            router_aux_coef=float(config.get("router_aux_loss_coef", 0.001)),
            rope_base=rope_base,
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        )
    except (ConfigError, KeyError) as exc:
        raise CheckpointError(f"this {model_type} config.json does not describe a valid model: {exc}") from exc


def _read_moe_config(directory: Path) -> dict[str, Any]:
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a directory; give a Hugging Face Mixtral or Qwen3-MoE directory")
    return read_config(directory, kind="mixture-of-experts")


def read_hf_moe_config(directory: Path | str) -> MoEConfig:
    return moe_config_from_hf(_read_moe_config(Path(directory)))


def _expert_names(layer: int, expert: int, mixtral: bool) -> tuple[str, str, str]:
    """(gate, up, down) weight names of one expert on disk."""
    if mixtral:
        base = f"model.layers.{layer}.block_sparse_moe.experts.{expert}"
        return f"{base}.w1.weight", f"{base}.w3.weight", f"{base}.w2.weight"
    base = f"model.layers.{layer}.mlp.experts.{expert}"
    return f"{base}.gate_proj.weight", f"{base}.up_proj.weight", f"{base}.down_proj.weight"


def _stack_experts(state: dict[str, torch.Tensor], config: MoEConfig, mixtral: bool) -> None:
    """Replace the per-expert matrices of ``state`` (in place) by the native stacked ones; a checkpoint already
    stacked (transformers' in-memory names) is left as it is."""
    for layer in range(config.n_layer):
        prefix = f"model.layers.{layer}.mlp"
        if mixtral and f"model.layers.{layer}.block_sparse_moe.gate.weight" in state:
            state[f"{prefix}.gate.weight"] = state.pop(f"model.layers.{layer}.block_sparse_moe.gate.weight")
        if f"{prefix}.experts.gate_up_proj" in state:
            continue
        gates, ups, downs = [], [], []
        for expert in range(config.n_expert):
            gate, up, down = (state.pop(name, None) for name in _expert_names(layer, expert, mixtral))
            if gate is None or up is None or down is None:
                raise CheckpointError(
                    f"the weights have no expert {expert} in layer {layer} (config.json has {config.n_expert} experts)"
                )
            gates.append(gate)
            ups.append(up)
            downs.append(down)
        state[f"{prefix}.experts.gate_up_proj"] = torch.cat([torch.stack(gates), torch.stack(ups)], dim=1)
        state[f"{prefix}.experts.down_proj"] = torch.stack(downs)


def load_hf_moe(directory: Path | str) -> MoE:
    """A :class:`MoE` (fp32, on the CPU) with the weights of a local Mixtral or Qwen3-MoE directory; missing,
    unexpected or misshapen tensors are refused in one line."""
    directory = Path(directory)
    values = _read_moe_config(directory)
    config = moe_config_from_hf(values)
    state = {k: v for k, v in read_weights(directory).items() if not k.endswith("rotary_emb.inv_freq")}
    _stack_experts(state, config, mixtral=values.get("model_type") == "mixtral")
    with torch.device("meta"):
        model = MoE(config)
    load_fitting_weights(model, state, directory, "lm_head.weight" if config.tie_embeddings else "",
                         "model.embed_tokens.weight")  # fmt: skip
    if config.tie_embeddings:
        model.tie_head()  # assign replaced the parameter: tie it again
    return model


def hf_moe_config(config: MoEConfig) -> dict[str, Any]:
    """``config.json`` of a shape in its export layout (:func:`hf_layout`), every field spelled out."""
    architecture = hf_layout(config)
    model_type = next(t for t, name in _CLASSES.items() if name == architecture)
    values: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [architecture],
        "torch_dtype": "float32",
        "vocab_size": config.vocab_size,
        "hidden_size": config.n_embd,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_kv_head,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.block_size,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_base,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_base},
        "attention_dropout": config.dropout,
        "tie_word_embeddings": config.tie_embeddings,
        "num_experts_per_tok": config.top_k,
        "router_aux_loss_coef": config.router_aux_coef,
        "output_router_logits": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "sliding_window": None,
        "bos_token_id": config.vocab_size - 1,
        "eos_token_id": config.vocab_size - 1,
        "pad_token_id": None,
    }
    if model_type == "mixtral":
        values.update(intermediate_size=config.ffn_hidden, num_local_experts=config.n_expert, router_jitter_noise=0.0)
    else:
        values.update(
            moe_intermediate_size=config.ffn_hidden,
            intermediate_size=config.shared_ffn_hidden or config.ffn_hidden,
            num_experts=config.n_expert,
            norm_topk_prob=config.norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            use_sliding_window=False,
            attention_bias=False,
        )
    if model_type == "qwen2_moe":
        values.update(shared_expert_intermediate_size=config.shared_ffn_hidden, qkv_bias=True)
    return values


def save_hf_moe(model: MoE, directory: Path | str) -> Path:
    """``config.json`` + ``model.safetensors`` (fp32) in the layout of :func:`hf_layout` (a new or empty
    directory), for ``AutoModelForCausalLM.from_pretrained``."""
    directory = Path(directory)
    config = model.config
    hf_config = hf_moe_config(config)
    check_new_directory(directory)
    mixtral = hf_config["model_type"] == "mixtral"
    tensors: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        if key == "lm_head.weight" and config.tie_embeddings:
            continue
        tensors[key] = value.detach().to("cpu", torch.float32, copy=True).contiguous()
    for layer in range(config.n_layer):
        prefix = f"model.layers.{layer}.mlp"
        gate_up, down = tensors.pop(f"{prefix}.experts.gate_up_proj"), tensors.pop(f"{prefix}.experts.down_proj")
        for expert in range(config.n_expert):
            gate_name, up_name, down_name = _expert_names(layer, expert, mixtral)
            gate, up = gate_up[expert].chunk(2, dim=0)
            tensors[gate_name], tensors[up_name] = gate.contiguous(), up.contiguous()
            tensors[down_name] = down[expert].contiguous()
        if mixtral:
            tensors[f"model.layers.{layer}.block_sparse_moe.gate.weight"] = tensors.pop(f"{prefix}.gate.weight")
        if hf_config["model_type"] == "qwen2_moe":  # its attention always has biases: zeros compute the same
            for name, width in (("q", config.n_embd), ("k", config.n_kv_head * config.head_dim)):
                tensors[f"model.layers.{layer}.self_attn.{name}_proj.bias"] = torch.zeros(width)
            tensors[f"model.layers.{layer}.self_attn.v_proj.bias"] = torch.zeros(config.n_kv_head * config.head_dim)
    return write_hf_directory(directory, tensors, hf_config)
