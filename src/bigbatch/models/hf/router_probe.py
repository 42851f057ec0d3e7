"""Whether bigbatch can balance an ``hf:`` mixture of experts over the whole step, decided by what the model does,
not by its name.

A transformers model that returns router logits when asked (``output_router_logits``) defines its load-balancing
loss as the ``aux_loss`` of that forward. On a probe batch at load, bigbatch computes its own balancing loss from
the same router logits under each definition it can accumulate exactly (:data:`DEFINITIONS`: how the
probabilities are scored, how the MoE layers are pooled, whether ``f`` counts tokens or assignments, and the top-k
from the config or, failing it, every k) and keeps the first that equals ``aux_loss`` to :data:`MATCH_RTOL`. Where
none does, or the model returns no router logits or no ``aux_loss``, the router is refused in one line that says
what differed; ``--router-balance off`` then trains it as transformers' own training would: with no balancing
loss, and any per-expert routing bias (auxiliary-loss-free balancing, DeepSeek-V3 style) held as loaded.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from bigbatch.models.routing import SCORINGS, RouterSpec, route_tokens

MATCH_RTOL = 1e-5
"""bigbatch's balancing loss of the probe batch must equal the model's ``aux_loss`` to this (relative)."""

TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "top_k", "num_selected_experts")
"""config.json keys that give the experts per token; without one every k is tried."""

AUX_COEF_KEYS = ("router_aux_loss_coef", "aux_loss_coef", "moe_aux_loss_coeff", "aux_loss_alpha")

Z_COEF_KEYS = ("router_z_loss_coef", "z_loss_coef", "moe_z_loss_coeff")

DEFINITIONS = tuple(itertools.product(SCORINGS, ("pooled", "layer"), (False, True)))
"""(scoring, pooling, f per assignment): transformers' ``load_balancing_loss_func`` is ``softmax``, ``pooled``,
per token, and is tried first."""


@dataclass(frozen=True)
class RouterProbe:
    """What the probe found: the ``spec`` bigbatch balances the step with (None: refused), ``refusal`` (one
    sentence: what differed, or what the model does not return), ``bias`` (the name of a per-expert routing bias
    outside the gradient, when the model has one) and ``found`` (the match, for the header)."""

    spec: RouterSpec | None
    refusal: str = ""
    bias: str = ""
    found: str = ""


def _config_number(config: Any, keys: tuple[str, ...]) -> float | None:
    for key in keys:
        value = getattr(config, key, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def routing_bias(model: nn.Module, n_expert: int) -> str:
    """The name of a bias of one value per expert that the gradient does not train (a buffer, or a frozen
    parameter): auxiliary-loss-free balancing (e.g. DeepSeek-V3's ``e_score_correction_bias``); ``""``."""
    for name, buffer in model.named_buffers():
        if "bias" in name and buffer.dim() == 1 and buffer.numel() == n_expert and buffer.is_floating_point():
            return name
    for name, param in model.named_parameters():
        if not param.requires_grad and param.dim() == 1 and param.numel() == n_expert and "bias" in name:
            return name
    return ""


def probe_tokens(vocab_size: int, device: torch.device) -> torch.Tensor:
    """Two rows of 32 tokens spread over the vocabulary (no random numbers drawn): (2, 32)."""
    return ((torch.arange(64, device=device) * 7919 + 3) % vocab_size).view(2, 32)


def balancing_loss(logits: list[torch.Tensor], spec: RouterSpec) -> float:
    """bigbatch's balancing loss of one forward whose MoE layers gave router ``logits`` (each (N, E)), every token
    counted: what its step computes at K = 1."""
    stats = [route_tokens(layer, spec.top_k, spec.scoring).stats(None) for layer in logits]
    counts = torch.stack([s.counts for s in stats])  # (layers, E)
    sums = torch.stack([s.prob_sums for s in stats])  # (layers, E)
    return float((spec.balance_weights(counts, stats[0].tokens) * sums).sum())


@torch.no_grad()
def probe_router(model: nn.Module, vocab_size: int, experts: int = 0) -> RouterProbe | None:
    """The router of transformers ``model`` (a CausalLM) as bigbatch can balance it; None for a dense model (its
    config has no ``output_router_logits`` and counts no ``experts``)."""
    config = model.config
    if not hasattr(config, "output_router_logits") and experts <= 1:
        return None
    was_training = model.training
    model.eval()
    try:
        tokens = probe_tokens(vocab_size, next(model.parameters()).device)
        output = model(input_ids=tokens, use_cache=False, output_router_logits=True)
    except (TypeError, ValueError, RuntimeError, IndexError, AttributeError) as exc:
        reason = (str(exc).strip().splitlines() or [""])[0][:160]
        return RouterProbe(None, f"its forward with output_router_logits fails ({type(exc).__name__}: {reason})")
    finally:
        model.train(was_training)
    raw = getattr(output, "router_logits", None)
    logits = [layer.reshape(-1, layer.shape[-1]).float() for layer in raw or () if torch.is_tensor(layer)]
    if not logits:
        return RouterProbe(None, "its forward returns no router logits")
    n_expert = logits[0].shape[-1]
    bias = routing_bias(model, n_expert)
    aux = getattr(output, "aux_loss", None)
    if not torch.is_tensor(aux) or not bool(torch.isfinite(aux).all()):
        return RouterProbe(None, "transformers computes no load-balancing loss for it (no aux_loss)", bias)
    return _match(config, logits, float(aux), bias)


def _match(config: Any, logits: list[torch.Tensor], aux: float, bias: str) -> RouterProbe:
    n_expert = logits[0].shape[-1]
    given = _config_number(config, TOP_K_KEYS)
    top_ks = [int(given)] if given and 1 <= given <= n_expert else list(range(1, n_expert + 1))
    aux_coef = _config_number(config, AUX_COEF_KEYS)
    z_coef = _config_number(config, Z_COEF_KEYS) or 0.0
    best: tuple[float, float, RouterSpec] | None = None
    for top_k in top_ks:
        for scoring, pooling, per_assignment in DEFINITIONS:
            spec = RouterSpec(
                n_expert=n_expert,
                top_k=top_k,
                n_moe_layer=len(logits),
                pooling=pooling,
                per_assignment=per_assignment,
                aux_coef=0.001 if aux_coef is None else aux_coef,
                z_coef=z_coef,
                scoring=scoring,
            )
            ours = balancing_loss(logits, spec)
            difference = abs(ours - aux) / max(abs(aux), 1e-12)
            if difference <= MATCH_RTOL:
                found = f"aux_loss {aux:.6g} = bigbatch's {ours:.6g} ({describe(spec)})"
                return RouterProbe(spec, bias=bias, found=found)
            if best is None or difference < best[0]:
                best = (difference, ours, spec)
    assert best is not None
    difference, ours, spec = best
    return RouterProbe(
        None,
        f"its aux_loss {aux:.6g} is not bigbatch's balancing loss of the same router logits: {ours:.6g} at the "
        f"closest ({describe(spec)}), {difference:.1e} apart (relative; {MATCH_RTOL:g} is needed)",
        bias,
    )


def describe(spec: RouterSpec) -> str:
    """``softmax then top-2 of 4, every layer pooled, f per token``."""
    scoring = {"softmax": "softmax then top-{k}", "topk-softmax": "top-{k} then softmax"}[spec.scoring]
    pooling = "every layer pooled" if spec.pooling == "pooled" else "per layer, averaged"
    share = "f per assignment" if spec.per_assignment else "f per token"
    return f"{scoring.format(k=spec.top_k)} of {spec.n_expert}, {pooling}, {share}"


def router_refusal(probe: RouterProbe, config: Any) -> str:
    """The one line that refuses ``probe``'s router for ``config`` (an :class:`~bigbatch.models.hf.config.HFConfig`),
    with what is supported and the way out."""
    held = (
        f"; it balances by a per-expert routing bias outside the gradient ({probe.bias}), which bigbatch does not "
        "update"
        if probe.bias
        else ""
    )
    return (
        f"hf:{config.directory} is a mixture of experts (model_type {config.model_type}) whose balancing loss "
        f"bigbatch cannot accumulate over the step: {probe.refusal}{held}; {SUPPORTED}. --router-balance off "
        "trains it exactly with no balancing loss (as transformers trains it), any routing bias held as loaded"
    )


SUPPORTED = (
    "bigbatch balances a router whose aux_loss is E x sum f x P of its router logits (softmax then top-k or top-k "
    "then softmax; layers pooled or averaged; f per token or per assignment)"
)
"""What the refusal line says is supported."""
