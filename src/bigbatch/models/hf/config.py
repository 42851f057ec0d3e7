"""The ``hf:DIR`` family's shape: a local Hugging Face causal LM's directory and its ``config.json`` as read, with
the few numbers the rest of bigbatch reads (block size, vocabulary, layers, heads, width), and what config.json
alone says about training it (dropout, experts). ``transformers`` is imported only where its classes are named."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bigbatch.errors import ConfigError, require_package

HF_PREFIX = "hf:"
"""``--model hf:DIR``: a local Hugging Face model directory instead of a preset."""

EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
"""config.json keys that count a mixture of experts' experts (Mixtral, Qwen2-MoE / OLMoE, DeepSeek, Ernie / Aria)."""

CAPACITY_KEYS = ("capacity_factor", "expert_capacity", "moe_capacity_factor", "router_capacity_factor")
"""Routing with an expert capacity drops tokens by what else is in the batch: not per sample."""

DROPOUT_KEY_MARKS = ("dropout", "pdrop")
"""A config.json key whose name holds one of these, with a number for its value, is a dropout probability
(GPT-2's ``attn_pdrop``, ``resid_pdrop`` and ``embd_pdrop``; ``attention_dropout``, ``hidden_dropout_prob``, ...),
in nested configs too."""


def is_hf_name(name: str) -> bool:
    """Whether a ``--model`` value names a Hugging Face directory (``hf:DIR``)."""
    return name.startswith(HF_PREFIX)


def require_transformers() -> Any:
    """The ``transformers`` module, or one line that says how to install it."""
    return require_package("transformers", "--model hf:DIR", "hf", package="transformers")


def _first_int(values: dict[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = values.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


@dataclass(frozen=True)
class HFConfig:
    """The shape of a Hugging Face causal LM: its directory and ``config.json`` (what a checkpoint stores, so the
    model can be rebuilt wherever the directory has gone)."""

    directory: str
    hf_config: dict[str, Any]

    def __post_init__(self) -> None:
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            getattr(self, name)  # each refuses, in one line, a config.json that lacks it

    def _required(self, what: str, *keys: str) -> int:
        value = _first_int(self.hf_config, *keys)
        if value is None or value < 1:
            raise ConfigError(
                f"{self.directory}/config.json gives no {what} (looked for {', '.join(keys)}); bigbatch needs it"
            )
        return value

    @property
    def model_type(self) -> str:
        return str(self.hf_config.get("model_type", ""))

    @property
    def block_size(self) -> int:
        return self._required("context length", "max_position_embeddings", "n_positions", "n_ctx", "seq_length")

    @property
    def vocab_size(self) -> int:
        return self._required("vocabulary size", "vocab_size")

    @property
    def padded_vocab_size(self) -> int:
        return self.vocab_size

    @property
    def n_layer(self) -> int:
        return self._required("number of layers", "num_hidden_layers", "n_layer", "num_layers")

    @property
    def n_head(self) -> int:
        return self._required("number of attention heads", "num_attention_heads", "n_head", "num_heads")

    @property
    def n_kv_head(self) -> int:
        return _first_int(self.hf_config, "num_key_value_heads") or self.n_head

    @property
    def n_embd(self) -> int:
        return self._required("width", "hidden_size", "n_embd", "d_model")

    @property
    def head_dim(self) -> int:
        return _first_int(self.hf_config, "head_dim") or self.n_embd // self.n_head

    @property
    def architecture(self) -> str:
        """The class ``AutoModelForCausalLM`` builds for this ``model_type`` (e.g. ``Qwen2ForCausalLM``)."""
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        return str(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(self.model_type, self.model_type))

    @property
    def experts(self) -> int:
        """The number of experts of a mixture of experts; 0 for a dense model."""
        count = _first_int(self.hf_config, *EXPERT_COUNT_KEYS) or 0
        return count if count > 1 else 0

    def to_dict(self) -> dict[str, Any]:
        return {"directory": self.directory, "hf_config": self.hf_config}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> HFConfig:
        return cls(directory=str(values["directory"]), hf_config=dict(values["hf_config"]))

    def transformers_config(self, dropout: float | None = None) -> Any:
        """The ``transformers`` config object of ``config.json``; with ``dropout``, every one of its
        :func:`dropout_settings` set to that."""
        transformers = require_transformers()
        values = self.hf_config if dropout is None else _with_dropout(self.hf_config, dropout)
        values = {k: v for k, v in values.items() if k != "model_type"}
        return transformers.AutoConfig.for_model(self.model_type, **values)


def _is_dropout_setting(key: Any, value: Any) -> bool:
    named = any(mark in str(key).lower() for mark in DROPOUT_KEY_MARKS)
    return named and isinstance(value, (int, float)) and not isinstance(value, bool)


def dropout_settings(values: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Every dropout probability of a config.json (see :data:`DROPOUT_KEY_MARKS`), by key; a nested config's as
    ``text_config.attention_dropout``."""
    found: dict[str, float] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            found.update(dropout_settings(value, f"{prefix}{key}."))
        elif _is_dropout_setting(key, value):
            found[f"{prefix}{key}"] = float(value)
    return found


def _with_dropout(values: dict[str, Any], p: float) -> dict[str, Any]:
    return {
        key: _with_dropout(value, p) if isinstance(value, dict) else p if _is_dropout_setting(key, value) else value
        for key, value in values.items()
    }


def dropout_note(config: HFConfig, p: float) -> str | None:
    """What ``--dropout p`` does to ``config``'s model, said at the start of a run: ``p`` replaces every dropout
    probability of its config.json. None when that changes nothing and ``p`` is 0."""
    own = dropout_settings(config.hf_config)
    replaced = {key: value for key, value in own.items() if value != p}
    listed = ", ".join(f"{key} {value:g}" for key, value in sorted(replaced.items()))
    if p == 0:
        if not replaced:
            return None
        return (
            f"hf:{config.directory}: its config.json sets dropout ({listed}); trained without it (--dropout 0, the "
            f"default), so micro-batch and full-batch gradients are identical; --dropout {max(replaced.values()):g} "
            "trains with dropout, and then they differ"
        )
    was = f" (config.json: {listed})" if replaced else ""
    return (
        f"hf:{config.directory}: every dropout probability set to {p:g} (--dropout){was}: micro-batch and full-batch "
        "gradients then differ (each micro-batch draws its own masks); --dropout 0 keeps them identical"
    )


def training_notes(config: HFConfig) -> tuple[str | None, str | None]:
    """(why ``config`` cannot be trained exactly by bigbatch, or None; a warning about what is left out, or None),
    from config.json alone."""
    capacity = [key for key in CAPACITY_KEYS if config.hf_config.get(key)]
    if config.experts and capacity:
        return (
            f"hf:{config.directory} routes tokens to experts with a capacity ({capacity[0]} "
            f"{config.hf_config[capacity[0]]}): which tokens an expert drops depends on the rest of the batch, so "
            "micro-batches cannot add up to the big batch; bigbatch refuses it",
            None,
        )
    return None, None
