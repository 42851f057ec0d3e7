"""The chunked head + cross-entropy (bigbatch.models.head_loss) against the plain ``F.linear`` + ``F.cross_entropy``:
the summed loss and the gradients of the rows, the head and its bias, in fp32 and under bf16 autocast, with ignored
targets, odd chunk sizes, a tied head, a scaled loss, no_grad, torch.compile; and that no tensor saved for backward
is logits-sized."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from bigbatch.engine.batch import IGNORE_INDEX
from bigbatch.models.head_loss import default_chunk_rows, linear_cross_entropy_sum

N, C, V = 96, 24, 130
FP32_RTOL = 1e-5  # fp32 sums in another order: a few ulps, relative to the norm


def inputs(
    seed: int = 0, ignored: float = 0.3, bias: bool = True, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """hidden (N, C), weight (V, C), bias (V,) or None, all leaves wanting a gradient, and targets (N,) with about
    ``ignored`` of them IGNORE_INDEX. Logits of order 1-3, as a trained head gives."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, C, generator=g, dtype=dtype).requires_grad_()
    weight = (torch.randn(V, C, generator=g, dtype=dtype) * 0.4).requires_grad_()
    b = (torch.randn(V, generator=g, dtype=dtype) * 0.1).requires_grad_() if bias else None
    targets = torch.randint(0, V, (N,), generator=g)
    targets[torch.rand(N, generator=g) < ignored] = IGNORE_INDEX
    return hidden, weight, b, targets


def plain(hidden: torch.Tensor, weight: torch.Tensor, b: torch.Tensor | None, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(hidden, weight, b).float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")


def loss_and_grads(loss: torch.Tensor, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    return [loss.detach(), *torch.autograd.grad(loss, leaves)]


def assert_close_rel(got: torch.Tensor, want: torch.Tensor, rtol: float) -> None:
    """``got`` within ``rtol`` of ``want`` relative to ``want``'s norm (elementwise tolerances mislead for the
    head's gradient, most of whose entries are near zero)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    err, scale = (got.double() - want.double()).norm().item(), want.double().norm().item()
    assert err <= rtol * max(scale, 1e-30), f"error {err:.3g} > {rtol} x norm {scale:.3g}"


@pytest.mark.parametrize("chunk_rows", [1, 7, None, 10_000])  # one row, not dividing N, the default, > N
@pytest.mark.parametrize("bias", [True, False])
def test_fp32_loss_and_gradients_equal_the_plain_path(chunk_rows: int | None, bias: bool) -> None:
    hidden, weight, b, targets = inputs(bias=bias)
    leaves = [hidden, weight] + ([b] if b is not None else [])
    want = loss_and_grads(plain(hidden, weight, b, targets), leaves)
    got_loss = linear_cross_entropy_sum(hidden, weight, targets, b, chunk_rows=chunk_rows)
    assert got_loss.shape == () and got_loss.dtype == torch.float32
    got = loss_and_grads(got_loss, leaves)
    for g, w in zip(got, want, strict=True):
        assert_close_rel(g, w, FP32_RTOL)
    ignored = targets == IGNORE_INDEX
    assert ignored.any() and (got[1][ignored] == 0).all()  # rows without a target get exactly no gradient


def test_bf16_autocast_is_no_less_accurate_than_the_plain_path() -> None:
    """Under CPU bf16 autocast both paths run the head matmuls in bf16 (8-bit mantissa: relative rounding ~4e-3
    per product) and the softmax in fp32, so both are off the float64 truth by bf16 rounding, not by 1e-5. The
    chunked one sums the head's gradient over chunks in fp32 and otherwise rounds at the same places: its error
    must be no worse than twice the plain path's, plus a little."""
    hidden, weight, b, targets = inputs(seed=1)
    leaves = [hidden, weight, b]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain_out = loss_and_grads(plain(hidden, weight, b, targets), leaves)
        chunked_out = loss_and_grads(linear_cross_entropy_sum(hidden, weight, targets, b, chunk_rows=10), leaves)
    leaves64 = [x.detach().double().requires_grad_() for x in leaves]
    truth = loss_and_grads(plain(leaves64[0], leaves64[1], leaves64[2], targets), leaves64)
    for p, c, t in zip(plain_out, chunked_out, truth, strict=True):
        assert c.dtype == p.dtype  # fp32 loss and gradients of fp32 leaves, as the plain path gives
        plain_err, chunked_err = (p.double() - t).norm().item(), (c.double() - t).norm().item()
        assert plain_err > 1e-6 * t.norm().item()  # the comparison means something: bf16 did round
        assert chunked_err <= 2 * plain_err + 1e-4 * t.norm().item(), (chunked_err, plain_err)
        assert chunked_err <= 2e-2 * t.norm().item()  # and is bf16-sized in absolute terms


def test_all_targets_ignored_gives_zero_loss_and_zero_gradients() -> None:
    hidden, weight, b, targets = inputs(ignored=1.0)
    assert (targets == IGNORE_INDEX).all()
    loss = linear_cross_entropy_sum(hidden, weight, targets, b)
    assert loss.item() == 0.0 and loss.dtype == torch.float32
    loss.backward()
    for leaf in (hidden, weight, b):
        assert leaf.grad is not None and leaf.grad.shape == leaf.shape and (leaf.grad == 0).all()


def test_tied_head_accumulates_both_uses_of_the_embedding() -> None:
    """The head is an embedding's weight, which the graph also uses as the input embedding (GPT-2's tying)."""
    g = torch.Generator().manual_seed(2)
    idx = torch.randint(0, V, (N,), generator=g)
    targets = torch.roll(idx, -1)
    targets[-5:] = IGNORE_INDEX
    grads = []
    for loss_fn in (lambda h, w, t: plain(h, w, None, t), lambda h, w, t: linear_cross_entropy_sum(h, w, t)):
        torch.manual_seed(3)
        embedding, mix = nn.Embedding(V, C), nn.Linear(C, C)
        hidden = torch.tanh(mix(embedding(idx)))  # (N, C)
        loss_fn(hidden, embedding.weight, targets).backward()
        grads.append([embedding.weight.grad, mix.weight.grad, mix.bias.grad])
    for got, want in zip(grads[1], grads[0], strict=True):
        assert_close_rel(got, want, FP32_RTOL)


def test_incoming_gradient_scales_every_gradient_and_backward_can_repeat() -> None:
    hidden, weight, b, targets = inputs(seed=4)
    leaves = [hidden, weight, b]
    want = torch.autograd.grad(plain(hidden, weight, b, targets) * 3.7, leaves)
    scaled = linear_cross_entropy_sum(hidden, weight, targets, b, chunk_rows=16) * 3.7
    first = torch.autograd.grad(scaled, leaves, retain_graph=True)
    again = torch.autograd.grad(scaled, leaves)  # the stored gradients were not scaled in place
    for got, repeat, w in zip(first, again, want, strict=True):
        assert_close_rel(got, w, FP32_RTOL)
        assert torch.equal(got, repeat)


def test_no_grad_returns_the_same_loss_without_a_graph() -> None:
    hidden, weight, b, targets = inputs(seed=5)
    want = plain(hidden, weight, b, targets).detach()
    with torch.no_grad():
        got = linear_cross_entropy_sum(hidden, weight, targets, b, chunk_rows=9)
    assert not got.requires_grad and got.grad_fn is None
    assert_close_rel(got, want, FP32_RTOL)
    frozen = linear_cross_entropy_sum(hidden.detach(), weight.detach(), targets, b.detach())  # nothing wants one
    assert frozen.grad_fn is None
    assert_close_rel(frozen, want, FP32_RTOL)


@pytest.mark.parametrize("ignored", [0.0, 0.3])  # all rows valid (the view goes in as it is) or selected
def test_non_contiguous_hidden_and_leading_dimensions(ignored: float) -> None:
    hidden, weight, b, targets = inputs(seed=6, ignored=ignored)
    wide = torch.randn(2, N // 2, 2 * C, requires_grad=True)
    view = wide[..., ::2]  # (2, N/2, C), strided
    assert not view.is_contiguous()
    want = loss_and_grads(plain(view.reshape(N, C), weight, b, targets), [wide, weight, b])
    got = loss_and_grads(linear_cross_entropy_sum(view, weight, targets.view(2, N // 2), b, 11), [wide, weight, b])
    for g, w in zip(got, want, strict=True):
        assert_close_rel(g, w, FP32_RTOL)


def test_compiled_caller_breaks_the_graph_around_it() -> None:
    hidden, weight, b, targets = inputs(seed=7)
    layer = nn.Linear(C, C)

    def step(h: torch.Tensor) -> torch.Tensor:
        return linear_cross_entropy_sum(torch.tanh(layer(h)), weight, targets, b, chunk_rows=32)

    want = loss_and_grads(step(hidden), [hidden, weight, b, layer.weight])
    compiled = torch.compile(step, backend="eager")  # dynamo, without inductor's compile time
    got = loss_and_grads(compiled(hidden), [hidden, weight, b, layer.weight])
    for g, w in zip(got, want, strict=True):
        assert_close_rel(g, w, FP32_RTOL)


def test_nothing_saved_for_backward_is_logits_sized() -> None:
    """The memory claim, structurally: the CPU allocator has no peak to read, but every tensor autograd keeps for
    backward passes through saved_tensors_hooks. The plain path keeps (N, V) ones (the logits' log-softmax); the
    chunked one only the gradients, (N, C), (V, C) and (V,), with C < N so that none of them is N x V."""
    n, c, v = 512, 32, 1000
    g = torch.Generator().manual_seed(8)
    hidden = torch.randn(n, c, generator=g, requires_grad=True)
    weight = torch.randn(v, c, generator=g, requires_grad=True)
    targets = torch.randint(0, v, (n,), generator=g)

    def saved_sizes(loss_fn: object) -> list[int]:
        sizes: list[int] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = loss_fn()  # type: ignore[operator]
        loss.backward()
        return sizes

    assert max(saved_sizes(lambda: plain(hidden, weight, None, targets))) >= n * v  # the hooks see the logits
    chunked = saved_sizes(lambda: linear_cross_entropy_sum(hidden, weight, targets, chunk_rows=64))
    assert chunked and max(chunked) < n * v
    assert v * c in chunked and n * c in chunked  # what it does keep: the head's and the rows' gradients


def test_default_chunk_is_sized_by_bytes() -> None:
    assert default_chunk_rows(50257) * 4 * 50257 <= 128 << 20  # GPT-2: a bounded slab of fp32 logits
    assert default_chunk_rows(256) >= 64  # a small vocabulary still gets a matmul worth its overhead
