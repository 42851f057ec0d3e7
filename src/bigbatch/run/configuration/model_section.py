"""The ``[model]`` section: the model, its size and init, LoRA adapters, the router of a mixture of experts."""

from __future__ import annotations

from dataclasses import dataclass

from bigbatch.models.registry import model_names_help
from bigbatch.run.configuration.fields import config_field as _opt
from bigbatch.settings.choices import ROUTER_BALANCE
from bigbatch.settings.ranges import NON_NEGATIVE_INT, POSITIVE_INT_OR_AUTO, POSITIVE_OR_AUTO, PROBABILITY


@dataclass
class ModelSection:
    preset: str = _opt(
        "nano",
        f"model preset: {model_names_help()}",
        flag="model",
    )
    block_size: int = _opt(
        0,
        "maximum context length; auto: the preset's",
        range=POSITIVE_INT_OR_AUTO,
        legacy_zero=True,
    )
    dropout: float = _opt(
        0.0,
        "dropout probability of every dropout in the model, an hf: model's config.json ones included (they are "
        "replaced: 0 turns them off); 0 keeps micro-batch and full-batch gradients identical",
        range=PROBABILITY,
    )
    activation_checkpointing: bool = _opt(
        False, "recompute each transformer block in backward (less activation memory, about 1/3 more compute)"
    )
    chunked_loss: bool = _opt(
        True,
        "compute the head and the loss in chunks of rows, never holding the whole (micro_batch, seq_len, vocab) "
        "logits (the same numbers to rounding; an hf: model whose logits are not its head's linear map uses the "
        "whole logits)",
    )
    router_balance: str = _opt(
        "auto",
        "a mixture of experts' load-balancing loss: exact (over the whole step: a routing pass without gradients "
        "counts every micro-batch's tokens per expert first, so the update is the big batch's at any K and world "
        "size), running (counts so far, as Megatron-LM: cheaper, depends on K), micro (each micro-batch's own, as "
        "transformers: depends on K) or off (none; loads still measured); auto: exact (dense models: none)",
        choices=ROUTER_BALANCE,
    )
    router_aux_coef: float = _opt(
        0.0,
        "weight of a mixture of experts' load-balancing loss; auto: the model's (the MoE presets' 0.01, an hf: or "
        "--init-from model's router_aux_loss_coef)",
        range=POSITIVE_OR_AUTO,
    )
    router_z_coef: float = _opt(
        0.0,
        "weight of the router z-loss (mean squared log-sum-exp of the router logits); auto: the model's (0: none)",
        range=POSITIVE_OR_AUTO,
    )
    lora_rank: int = _opt(
        0,
        "train LoRA adapters of this rank (through peft) instead of the model: every base weight frozen, only the "
        "adapters in the optimizer and its state; 0: train the whole model",
        range=NON_NEGATIVE_INT,
    )
    lora_alpha: float = _opt(
        0.0,
        "LoRA scale numerator (the update is alpha / rank x B A); auto: the rank (a scale of 1)",
        range=POSITIVE_OR_AUTO,
    )
    lora_dropout: float = _opt(
        0.0,
        "dropout on the LoRA adapters' inputs; 0 keeps micro-batch and full-batch gradients identical",
        range=PROBABILITY,
    )
    lora_targets: str = _opt(
        "auto",
        "the linear maps that get adapters: auto (every linear map in the model's blocks: attention and MLP "
        "projections, a mixture of experts' router left out) or comma-separated module names, e.g. q_proj,v_proj",
    )
    init_from: str = _opt(
        "",
        "start from a local Hugging Face GPT-2, Llama, Mixtral or Qwen3-MoE directory (config.json + "
        "model.safetensors; its model_type decides); replaces the preset; its tokenizer.json, when present, is what "
        "--tokenizer auto uses",
    )
