"""The pieces every family shares: :class:`DecoderLM` (parameter and FLOP counts, the FSDP2 units),
:class:`StackedDecoderLM` (the block loop with optional activation checkpointing, the lean head and loss), causal
attention over rows that may hold several documents, and :func:`fsdp_units`, the one place that asks a model for
its units.

A packed row carries each token's position within its own document (0 at every document's first token). Two tokens
may attend to each other only when they lie in the same document and the key does not come after the query: a
block-diagonal causal mask. Rows without positions (one sequence per row) use the plain causal kernel.
"""

from __future__ import annotations

import abc
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from bigbatch.models.lm_output import logits_or_loss
from bigbatch.models.matrix_layout import MatrixLayout


def document_causal_mask(positions: torch.Tensor) -> torch.Tensor:
    """``True`` where query ``i`` may attend to key ``j``, shape (B, 1, T, T), from ``positions`` (B, T).

    A document begins wherever the position is 0, so the segment of a token is the number of zeros up to it.
    Built once per forward and shared by every layer (T x T booleans per row: 256 KiB at T = 512)."""
    T = positions.size(1)
    segments = (positions == 0).cumsum(dim=1)  # (B, T)
    same_document = segments[:, :, None] == segments[:, None, :]  # (B, T, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=positions.device).tril()  # (T, T)
    return (same_document & causal).unsqueeze(1)  # (B, 1, T, T)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dropout_p: float
) -> torch.Tensor:
    """SDPA over (B, heads, T, head_dim): within documents when ``mask`` (from :func:`document_causal_mask`) is
    given, else plain causal. Every query sees at least itself, so no row of the mask is empty.

    Fewer queries (T) than keys (S): the queries are the last T positions after S - T cached keys
    (:class:`KVCache`), each seeing the keys up to its own position (SDPA's ``is_causal`` would align them with the
    first T keys instead)."""
    T, S = q.size(-2), k.size(-2)
    if mask is None and T != S:
        if T == 1:  # one new token sees every key
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=S - T)  # (T, S)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


class LayerCache:
    """One layer's keys and values (B, kv_heads, length, head_dim) of the tokens seen so far, for decoding one token
    at a time without recomputing the earlier ones. The buffers hold ``capacity`` positions and are allocated at the
    first :meth:`append` (their shape, dtype and device are the layer's, which only its attention knows)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.length = 0
        self.keys: torch.Tensor | None = None  # (B, kv_heads, capacity, head_dim)
        self.values: torch.Tensor | None = None  # (B, kv_heads, capacity, head_dim)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' ``k`` and ``v`` (B, kv_heads, T, head_dim) after the cached ones; return all the
        keys and values so far (B, kv_heads, length + T, head_dim), views of the buffers."""
        end = self.length + k.size(2)
        if end > self.capacity:
            raise ValueError(f"the key/value cache holds {self.capacity} positions; {end} asked")
        if self.keys is None or self.values is None:
            B, H, _, D = k.shape
            self.keys = k.new_empty(B, H, self.capacity, D)
            self.values = v.new_empty(B, H, self.capacity, v.size(-1))
        self.keys[:, :, self.length : end] = k
        self.values[:, :, self.length : end] = v
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]


class KVCache:
    """The :class:`LayerCache` of every block of a model, for :meth:`StackedDecoderLM.decode`: rows of one
    document each (no packing), at most ``capacity`` tokens long."""

    def __init__(self, n_layer: int, capacity: int) -> None:
        self.capacity = capacity
        self.layers = [LayerCache(capacity) for _ in range(n_layer)]

    @property
    def length(self) -> int:
        """How many tokens of each row the cache holds: the position of the next one."""
        return self.layers[0].length if self.layers else 0


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The submodules that FSDP2 shards as units before the root (see
    :func:`bigbatch.parallel.distributed.wrap_model`, which knows nothing of the model's layout): what ``model``'s
    class says through its ``fsdp_units()`` method (the embeddings, final norm and head stay with the root). A
    model whose class has no such method gives none: only the root."""
    units = getattr(type(model), "fsdp_units", None)  # the class's: a submodule named fsdp_units is no method
    return list(units(model)) if callable(units) else []


class DecoderLM(nn.Module, abc.ABC):
    """A decoder language model as bigbatch trains it, whoever runs its forward: ``forward(idx)`` returns the
    logits (B, T, vocab); ``forward(idx, targets)`` the summed next-token loss over the targets that are not -100
    (:func:`~bigbatch.models.lm_output.logits_or_loss`: in chunks of rows, never the whole logits, unless
    ``chunked_loss`` is off); ``positions`` (B, T), for rows packed with several documents, restarts positions at
    each document and confines attention to it; ``last_only`` returns the last position's logits (B, 1, vocab);
    ``forward(idx, targets, per_token=True)`` each target's cross-entropy and softmax entropy (B, T, 2).

    Here: the parameter and FLOP counts and the FSDP2 units, from :meth:`blocks` and
    :meth:`lookup_only_parameters`. bigbatch's own families run their forward on :class:`StackedDecoderLM`; an
    ``hf:DIR`` model's is transformers'."""

    computes_loss = True  # forward(idx, targets) returns the loss sum (bigbatch.engine.accumulate.token_loss_sum asks)
    head_detachable = True  # the logits are the head's linear map of the final hidden states: the loss can be chunked
    packs_documents = True  # ``positions`` keep packed documents apart
    activation_checkpointing = False  # recompute each block in backward (less memory, ~1/3 more compute)
    chunked_loss = True  # the loss from chunks of rows, never the whole (B, T, V) logits

    config: Any

    @abc.abstractmethod
    def blocks(self) -> nn.ModuleList:
        """The repeated blocks, in order."""

    def lookup_only_parameters(self) -> int:
        """Parameters used only by lookup (a position table, an untied input embedding): not in the FLOPs."""
        return 0

    def inactive_parameters(self) -> int:
        """Parameters a token does not use (a mixture's experts it is not routed to): not in the FLOPs."""
        return 0

    def matrix_layout(self, path: str, module: nn.Module, name: str, param: torch.Tensor) -> MatrixLayout:
        """How parameter ``name`` of ``module`` (at ``path`` inside a block) holds its matrices: one matrix stored
        (out, in), unless a family says its weight fuses several (GPT's q, k and v) or is stored (in, out)."""
        return MatrixLayout()

    def fsdp_units(self) -> list[nn.Module]:
        """What FSDP2 shards as units before the root (see :func:`fsdp_units`): the blocks; the embeddings, final
        norm and head stay with the root."""
        return list(self.blocks())

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; tied weights are counted once. ``non_embedding`` drops the lookup-only parameters (a
        tied embedding stays: it is also the head's matmul)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.lookup_only_parameters() if non_embedding else n

    def describe_size(self) -> str:
        """``0.83M parameters``: the size ``train``'s header and ``plan``'s table both print, :meth:`num_params`
        with ``non_embedding`` (as nanoGPT counts: a position table is left out, so a longer context is not a
        larger model)."""
        return f"{self.num_params() / 1e6:,.2f}M parameters"

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward): ``6N + 12 * L * H * Q * T``, with ``N`` the parameters
        a token's matmuls use (:meth:`num_params` with ``non_embedding``, less :meth:`inactive_parameters`) and the
        second term attention over ``seq_len`` with ``H`` query heads of ``Q`` dimensions (grouped key/value heads
        do not shrink it)."""
        cfg = self.config
        active = self.num_params(non_embedding=True) - self.inactive_parameters()
        return 6 * active + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * seq_len


class StackedDecoderLM(DecoderLM):
    """A :class:`DecoderLM` whose forward is bigbatch's: embed, the blocks (with activation checkpointing), the
    final norm, then the head and the lean loss. A family's model names its parts: :meth:`embed` (the first hidden
    states and what every block takes besides them), :meth:`blocks`, :meth:`final_norm`, :meth:`head_weight` and
    :meth:`lookup_only_parameters`."""

    @abc.abstractmethod
    def embed(self, idx: torch.Tensor, positions: torch.Tensor | None) -> tuple[torch.Tensor, tuple[Any, ...]]:
        """The hidden states (B, T, C) entering the first block, and the extra arguments every block takes."""

    supports_kv_cache = False  # a family whose blocks take ``cache=`` and which has :meth:`embed_at` says True

    def embed_at(self, idx: torch.Tensor, start: int) -> tuple[torch.Tensor, tuple[Any, ...]]:
        """:meth:`embed` for tokens at positions ``start`` ... ``start + T - 1`` of unpacked rows, after ``start``
        cached ones (:meth:`decode`); only a family with :attr:`supports_kv_cache` has it."""
        raise NotImplementedError(f"{type(self).__name__} has no key/value cache")

    @abc.abstractmethod
    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The hidden states (B, T, C) after the last block, normalised for the head."""

    @abc.abstractmethod
    def head_weight(self) -> torch.Tensor:
        """The output head's (vocab, C) weight: only the real vocabulary's rows, never padding."""

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The whole logits (B, T, vocab) of the final hidden states ``x`` (B, T, C)."""
        return F.linear(x, self.head_weight())

    def decode(self, idx: torch.Tensor, cache: KVCache, last_only: bool = False) -> torch.Tensor:
        """The logits (B, T, vocab) of ``idx`` (B, T), the tokens after the ``cache.length`` ones whose keys and
        values ``cache`` holds (none: the prompt's prefill), as the full forward of the whole rows gives them for
        these positions; their keys and values join the cache. ``last_only``: the last position's (B, 1, vocab)."""
        start = cache.length
        if start + idx.size(1) > self.config.block_size:
            raise ValueError(
                f"sequence length {start + idx.size(1)} exceeds the model's block_size {self.config.block_size}"
            )
        x, extras = self.embed_at(idx, start)  # (B, T, C)
        for block, layer_cache in zip(self.blocks(), cache.layers, strict=True):
            x = block(x, *extras, cache=layer_cache)
        x = self.final_norm(x[:, -1:] if last_only else x)  # (B, T or 1, C)
        return self.logits(x)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        last_only: bool = False,
        segments: torch.Tensor | None = None,
        per_token: bool = False,
        temperature: float = 1.0,
    ) -> torch.Tensor:
        if idx.size(1) > self.config.block_size:
            raise ValueError(f"sequence length {idx.size(1)} exceeds the model's block_size {self.config.block_size}")
        x, extras = self.embed(idx, positions)  # (B, T, C)
        for block in self.blocks():
            if self.activation_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, *extras, use_reentrant=False)
            else:
                x = block(x, *extras)
        x = self.final_norm(x)
        if targets is None and not last_only:
            return self.logits(x)
        return logits_or_loss(
            x,
            self.head_weight(),
            targets,
            chunked=self.chunked_loss,
            last_only=last_only,
            segments=segments,
            per_token=per_token,
            temperature=temperature,
        )


LanguageModel = DecoderLM
"""A model of any family."""
