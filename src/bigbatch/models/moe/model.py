"""A mixture-of-experts decoder: Llama's attention, norms and rotary positions, and in every layer a router that
sends each token to ``top_k`` of ``n_expert`` SwiGLU experts (optionally beside a shared expert).

Routing is dropless (no capacity: a token never loses its experts because others chose them too, which would make
one sample's output depend on the rest of the batch), so the model is exact under accumulation like a dense one.
Each MoE layer reports its routing (:class:`~bigbatch.models.routing.RoutedTokens`) to the model's recorder; the
load-balancing loss over the whole step is the trainer's (:mod:`bigbatch.engine.router_balance`).

Parameter names are those of transformers' ``MixtralForCausalLM`` and ``Qwen3MoeForCausalLM`` in memory
(``model.layers.0.mlp.gate.weight``, ``model.layers.0.mlp.experts.gate_up_proj``, ...), so weights move between
them by name (:mod:`bigbatch.models.moe.hf`).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from bigbatch.models.decoder import LayerCache
from bigbatch.models.llama.config import LlamaConfig
from bigbatch.models.llama.model import MLP, Attention, LlamaModel, RMSNorm, RotaryDecoderLM
from bigbatch.models.matrix_layout import MatrixLayout
from bigbatch.models.moe.config import MOE_PRESETS, MoEConfig, moe_preset
from bigbatch.models.routing import RouterRecorder, RouterSpec, route_tokens

__all__ = ["MOE_PRESETS", "MoE", "MoEConfig", "moe_preset"]


class Experts(nn.Module):
    """``n_expert`` SwiGLU experts as two stacked weights: ``gate_up_proj`` (E, 2F, C), gate rows then up rows,
    and ``down_proj`` (E, C, F)."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        e, c, f = config.n_expert, config.n_embd, config.ffn_hidden
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * f, c))
        self.down_proj = nn.Parameter(torch.empty(e, c, f))

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``x`` (N, C) through each token's ``experts`` (N, k), mixed by ``weights`` (N, k): (N, C). The N x k
        assignments are sorted by expert (one read of the counts per layer, not one per expert), and every expert
        runs, on its tokens or on none, so each has a gradient (DDP needs one for every parameter)."""
        k = experts.shape[1]
        flat = experts.reshape(-1)  # (N * k,)
        order = flat.argsort(stable=True)  # assignments grouped by expert, each group in token order
        token = order // k  # (N * k,)
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        routed = x[token]  # (N * k, C)
        outputs = []
        for e, group in enumerate(routed.split(counts)):
            gate, up = F.linear(group, self.gate_up_proj[e]).chunk(2, dim=-1)  # (n_e, F) each
            outputs.append(F.linear(F.silu(gate) * up, self.down_proj[e]))  # (n_e, C)
        mixed = torch.cat(outputs) * weights.reshape(-1)[order, None]  # (N * k, C)
        return torch.zeros_like(x).index_add_(0, token, mixed.to(x.dtype))


class SparseMoE(nn.Module):
    """The router (``gate``: C -> E logits), the experts, and the shared expert with its sigmoid gate."""

    def __init__(self, config: MoEConfig, recorder: RouterRecorder) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = config.top_k, config.norm_topk_prob
        self.gate = nn.Linear(config.n_embd, config.n_expert, bias=False)
        self.experts = Experts(config)
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if config.shared_ffn_hidden:
            self.shared_expert = MLP(_with_ffn(config, config.shared_ffn_hidden))
            self.shared_expert_gate = nn.Linear(config.n_embd, 1, bias=False)
        self.dropout = nn.Dropout(config.dropout)
        self.recorder = recorder  # shared with the model: not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        flat = x.reshape(-1, C)  # (N, C)
        routed = route_tokens(self.gate(flat), self.top_k)  # probs (N, E) fp32, experts (N, k)
        self.recorder.add(routed)
        top = routed.experts
        weights = routed.probs.gather(1, top)  # (N, k)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = self.experts(flat, top, weights.to(flat.dtype))  # (N, C)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return self.dropout(out.view(B, T, C))


def _with_ffn(config: MoEConfig, ffn_hidden: int) -> LlamaConfig:
    """The shared expert's shape: a Llama MLP of ``ffn_hidden`` (the MoE output's dropout is the layer's)."""
    return replace(config.llama, ffn_hidden=ffn_hidden, dropout=0.0)


class MoELayer(nn.Module):
    def __init__(self, config: MoEConfig, recorder: RouterRecorder) -> None:
        super().__init__()
        llama = config.llama
        self.input_layernorm = RMSNorm(config.n_embd, config.norm_eps)
        self.self_attn = Attention(llama, qk_norm=config.qk_norm)
        self.post_attention_layernorm = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = SparseMoE(config, recorder)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class MoE(RotaryDecoderLM):
    """A mixture-of-experts decoder on Llama's embedding, positions and head
    (:class:`~bigbatch.models.llama.model.RotaryDecoderLM`); its FLOPs count the parameters a token uses (its k
    experts, not all E)."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.router_recorder = RouterRecorder(
            RouterSpec(
                n_expert=config.n_expert,
                top_k=config.top_k,
                n_moe_layer=config.n_layer,
                pooling="layer",
                per_assignment=True,
                aux_coef=config.router_aux_coef,
                z_coef=config.router_z_coef,
            )
        )
        moe_layers: list[nn.Module] = [MoELayer(config, self.router_recorder) for _ in range(config.n_layer)]
        self.model = LlamaModel(config.llama, moe_layers)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.tie_head()
        self.activation_checkpointing = False
        self.chunked_loss = True
        self.apply(self._init_weights)

    def rope_shape(self) -> LlamaConfig:
        return self.config.llama

    def _init_weights(self, module: nn.Module) -> None:
        """Llama's, and the stacked experts as Llama's MLP: gate and up at 0.02, down scaled as a residual
        projection."""
        super()._init_weights(module)
        if isinstance(module, Experts):
            nn.init.normal_(module.gate_up_proj, mean=0.0, std=0.02)
            nn.init.normal_(module.down_proj, mean=0.0, std=0.02 * (2 * self.config.n_layer) ** -0.5)

    def matrix_layout(self, path: str, module: nn.Module, name: str, param: torch.Tensor) -> MatrixLayout:
        """Each expert's ``gate_up_proj`` stacks gate then up in its rows: two matrices per expert."""
        return MatrixLayout(2, -2) if isinstance(module, Experts) and name == "gate_up_proj" else MatrixLayout()

    def inactive_parameters(self) -> int:
        """The experts a token does not reach: ``(E - k)`` experts in every layer."""
        cfg = self.config
        return cfg.n_layer * (cfg.n_expert - cfg.top_k) * cfg.expert_parameters()
