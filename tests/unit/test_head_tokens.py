"""Per-token cross-entropy and entropy from the chunked head (bigbatch.models.head_loss.linear_cross_entropy_tokens)
against a float64 ``F.linear`` + ``log_softmax`` reference: values, and gradients of the rows, the head and its bias
for random incoming gradients on both columns, over chunk sizes, with ignored rows, under bf16 autocast; and the
models' ``forward(..., per_token=True)`` (GPT, Llama, a Hugging Face model) against their summed loss and the whole
logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny import VOCAB, random_batch

from bigbatch.models import GPT, GPTConfig, Llama, LlamaConfig
from bigbatch.models.head_loss import IGNORE_INDEX, linear_cross_entropy_sum, linear_cross_entropy_tokens
from bigbatch.models.lm_output import logits_or_loss, token_losses_from_logits

N, C, V = 40, 16, 70
FP32_RTOL = 1e-5  # fp32 against float64: a few ulps, relative to the norm


def inputs(
    seed: int = 0, ignored: float = 0.3, bias: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """hidden (N, C), weight (V, C), bias (V,) or None, all fp32 leaves wanting a gradient, and targets (N,) with
    about ``ignored`` of them IGNORE_INDEX. Logits of order 1-3, as a trained head gives."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, C, generator=g).requires_grad_()
    weight = (torch.randn(V, C, generator=g) * 0.4).requires_grad_()
    b = (torch.randn(V, generator=g) * 0.1).requires_grad_() if bias else None
    targets = torch.randint(0, V, (N,), generator=g)
    targets[torch.rand(N, generator=g) < ignored] = IGNORE_INDEX
    return hidden, weight, b, targets


def reference(
    hidden: torch.Tensor, weight: torch.Tensor, b: torch.Tensor | None, targets: torch.Tensor
) -> torch.Tensor:
    """(N, 2) in the inputs' dtype from the whole logits: cross-entropy and entropy, 0 where ignored."""
    log_p = F.log_softmax(F.linear(hidden, weight, b), dim=-1)  # (N, V)
    valid = targets != IGNORE_INDEX
    loss = -log_p.gather(1, targets.clamp_min(0)[:, None]).squeeze(1)  # (N,)
    entropy = -(log_p.exp() * log_p).sum(dim=-1)  # (N,)
    return torch.stack((loss, entropy), dim=1).masked_fill(~valid[:, None], 0.0)


def values_and_grads(values: torch.Tensor, upstream: torch.Tensor, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    return [values.detach(), *torch.autograd.grad(values, leaves, upstream.to(values.dtype))]


def assert_close_rel(got: torch.Tensor, want: torch.Tensor, rtol: float) -> None:
    """``got`` within ``rtol`` of ``want`` relative to ``want``'s norm (the head's gradient is mostly near zero)."""
    assert got.shape == want.shape
    err, scale = (got.double() - want.double()).norm().item(), want.double().norm().item()
    assert err <= rtol * max(scale, 1e-30), f"error {err:.3g} > {rtol} x norm {scale:.3g}"


@pytest.mark.parametrize("chunk_rows", [1, 7, N, None])  # one row, uneven chunks, all rows at once, the default
@pytest.mark.parametrize("bias", [True, False])
def test_values_and_gradients_equal_the_float64_reference(chunk_rows: int | None, bias: bool) -> None:
    hidden, weight, b, targets = inputs(bias=bias)
    leaves = [hidden, weight] + ([b] if b is not None else [])
    upstream = torch.randn(N, 2, generator=torch.Generator().manual_seed(5))  # both columns, any sign
    leaves64 = [x.detach().double().requires_grad_() for x in leaves]
    want = values_and_grads(
        reference(leaves64[0], leaves64[1], leaves64[2] if b is not None else None, targets), upstream, leaves64
    )
    values = linear_cross_entropy_tokens(hidden, weight, targets, b, chunk_rows=chunk_rows)
    assert values.shape == (N, 2) and values.dtype == torch.float32
    got = values_and_grads(values, upstream, leaves)
    assert all(g.dtype == leaf.dtype for g, leaf in zip(got[1:], leaves, strict=True))
    for g, w in zip(got, want, strict=True):
        assert_close_rel(g, w, FP32_RTOL)
    ignored = targets == IGNORE_INDEX
    assert ignored.any() and (got[0][ignored] == 0).all() and (got[1][ignored] == 0).all()


@pytest.mark.parametrize("column", [0, 1])
def test_each_column_alone_carries_its_own_gradient(column: int) -> None:
    """A gradient on one column only: the other's term must vanish (not leak through a shared buffer)."""
    hidden, weight, b, targets = inputs(seed=2)
    assert b is not None
    leaves = [hidden, weight, b]
    upstream = torch.zeros(N, 2)
    upstream[:, column] = 1.0
    leaves64 = [x.detach().double().requires_grad_() for x in leaves]
    want = values_and_grads(reference(leaves64[0], leaves64[1], leaves64[2], targets), upstream, leaves64)
    got = values_and_grads(linear_cross_entropy_tokens(hidden, weight, targets, b, chunk_rows=9), upstream, leaves)
    for g, w in zip(got, want, strict=True):
        assert_close_rel(g, w, FP32_RTOL)


def test_column_zero_sums_to_the_summed_loss_and_leading_dims_flatten() -> None:
    hidden, weight, b, targets = inputs(seed=3)
    values = linear_cross_entropy_tokens(hidden.view(4, 10, C), weight, targets.view(4, 10), b, chunk_rows=6)
    assert values.shape == (N, 2)
    total = linear_cross_entropy_sum(hidden, weight, targets, b, chunk_rows=6)
    torch.testing.assert_close(values[:, 0].sum(), total, rtol=1e-6, atol=1e-5)


def test_no_grad_and_all_ignored() -> None:
    hidden, weight, b, targets = inputs(seed=4)
    with torch.no_grad():
        values = linear_cross_entropy_tokens(hidden, weight, targets, b, chunk_rows=8)
    assert not values.requires_grad
    assert_close_rel(values, reference(hidden, weight, b, targets).detach(), FP32_RTOL)
    none = torch.full_like(targets, IGNORE_INDEX)
    empty = linear_cross_entropy_tokens(hidden, weight, none, b)
    assert empty.shape == (N, 2) and (empty == 0).all()
    grads = torch.autograd.grad(empty.sum(), [hidden, weight])
    assert all((g == 0).all() for g in grads)


def test_bf16_autocast_is_close_to_the_fp32_reference() -> None:
    """bf16 head matmuls (relative rounding ~4e-3 per logit), fp32 softmax: values and gradients within bf16
    tolerance of fp32, gradients back in the leaves' fp32, the values fp32. Backward runs inside the autocast
    region too, where autocast must not recast the recomputed products."""
    hidden, weight, b, targets = inputs(seed=1)
    assert b is not None
    leaves = [hidden, weight, b]
    upstream = torch.randn(N, 2, generator=torch.Generator().manual_seed(6))
    want = values_and_grads(reference(hidden, weight, b, targets), upstream, leaves)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        values = linear_cross_entropy_tokens(hidden, weight, targets, b, chunk_rows=11)
        got = values_and_grads(values, upstream, leaves)
    assert values.dtype == torch.float32
    assert all(g.dtype == torch.float32 for g in got)
    for g, w in zip(got, want, strict=True):
        assert_close_rel(g, w, 3e-2)
        assert (g - w).norm() > 0  # bf16 did round: the matmuls ran in autocast's dtype


def test_fp32_forward_keeps_fp32_backward_inside_autocast() -> None:
    """The matmul dtype is the forward's: a backward run inside a bf16 autocast region must not recast the
    recomputed logits and products (the sum version has no matmul in backward; this one has)."""
    hidden, weight, b, targets = inputs(seed=9)
    assert b is not None
    leaves = [hidden, weight, b]
    upstream = torch.randn(N, 2, generator=torch.Generator().manual_seed(10))
    values = linear_cross_entropy_tokens(hidden, weight, targets, b, chunk_rows=13)
    want = torch.autograd.grad(values, leaves, upstream, retain_graph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = torch.autograd.grad(values, leaves, upstream)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_nothing_logits_sized_is_saved_for_backward() -> None:
    """Every tensor autograd keeps passes through saved_tensors_hooks: the rows, the head, the targets and two
    floats per row, never an (N, V) one (C < N and C < V here, so only logits would reach N x V)."""
    hidden, weight, b, targets = inputs(seed=11, ignored=0.0)
    sizes: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        values = linear_cross_entropy_tokens(hidden, weight, targets, b, chunk_rows=8)
    assert sizes and max(sizes) == V * C < N * V
    values.sum().backward()


def test_per_token_with_segments_is_refused() -> None:
    hidden, weight, _, targets = inputs()
    with pytest.raises(ValueError, match="per_token"):
        logits_or_loss(
            hidden[None], weight, targets[None], segments=torch.zeros(1, N, dtype=torch.long), per_token=True
        )


def test_whole_logits_path_equals_the_chunked_one() -> None:
    hidden, weight, b, targets = inputs(seed=7)
    assert b is not None
    leaves = [hidden, weight, b]
    upstream = torch.randn(2, 20, 2, generator=torch.Generator().manual_seed(8))
    h, t = hidden.view(2, 20, C), targets.view(2, 20)
    chunked = logits_or_loss(h, weight, t, bias=b, per_token=True)
    whole = logits_or_loss(h, weight, t, bias=b, chunked=False, per_token=True)
    assert chunked.shape == whole.shape == (2, 20, 2)
    for g, w in zip(
        values_and_grads(chunked, upstream, leaves), values_and_grads(whole, upstream, leaves), strict=True
    ):
        assert_close_rel(g, w, FP32_RTOL)
    assert (token_losses_from_logits(F.linear(h, weight, b), t)[t == IGNORE_INDEX] == 0).all()


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_model_per_token_sums_to_the_models_loss(family: str) -> None:
    if family == "gpt":
        model: torch.nn.Module = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=VOCAB))
    else:
        config = LlamaConfig(
            n_layer=1, n_head=2, n_kv_head=1, n_embd=16, ffn_hidden=32, block_size=16, vocab_size=VOCAB
        )
        model = Llama(config)
    idx, targets = random_batch(2, 12)
    targets[0, :4] = IGNORE_INDEX  # a masked prompt
    values = model(idx, targets, per_token=True)
    assert values.shape == (2, 12, 2) and values.dtype == torch.float32
    assert (values[0, :4] == 0).all()  # ignored rows: 0 in both columns
    assert (values[targets != IGNORE_INDEX][:, 1] > 0).all()  # a softmax over 61 tokens has positive entropy
    torch.testing.assert_close(values[..., 0].sum(), model(idx, targets), rtol=1e-6, atol=1e-5)
    values[..., 1].sum().backward()  # the entropy's gradient reaches the trunk, not only the head
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_hf_model_per_token_matches_the_whole_logits() -> None:
    pytest.importorskip("transformers")
    from hf_models import hf_config

    from bigbatch.models import HFConfig
    from bigbatch.models.hf.model import build_hf_model

    torch.manual_seed(0)
    model = build_hf_model(HFConfig("d", hf_config("llama").to_dict()))
    assert model.head_detachable and model.chunked_loss  # the chunked path
    idx, targets = random_batch(2, 10, vocab=256)
    targets[1, :3] = IGNORE_INDEX
    want = token_losses_from_logits(model(idx), targets)  # (2, 10, 2)
    got = model(idx, targets, per_token=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    model.head_detachable = False  # the whole model's path: the logits, then the same values
    torch.testing.assert_close(model(idx, targets, per_token=True), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="per_token"):
        model(idx, targets, segments=torch.zeros_like(targets), per_token=True)
