"""The LM head and its cross-entropy in one pass that never holds the ``(N, V)`` logits.

The plain loss, ``F.cross_entropy(F.linear(h, W).float(), targets, reduction="sum")``, materializes the logits:
for GPT-2 at T=1024 that is 1024 x 50257 x 4 bytes = 206 MB per sequence in fp32, held three times around the
backward (the logits, the log-softmax saved for backward, and the logits' gradient). :func:`linear_cross_entropy_sum`
computes the same sum chunk by chunk of rows (the idea of Liger-kernel's fused linear cross-entropy and of "Cut Your
Losses in Large-Vocabulary Language Models"): per chunk, the logits, their log-sum-exp and target logit, and, when a
gradient will be needed, right away ``dlogits = softmax - one_hot`` and its products with the head and the rows.
Only the gradients (``N x C`` for the rows, ``V x C`` and ``V`` for the head) are kept for backward, which just
scales them by the incoming gradient. Beyond the gradients (which the plain path makes too), peak extra memory is
one chunk of logits, turned into its softmax in place; the matmul FLOPs are those of the plain forward + backward
(no recompute); rows whose target is ``IGNORE_INDEX`` never reach the head.

:func:`linear_cross_entropy_tokens` gives each row's cross-entropy and softmax entropy instead of their sum (for
learning from rewards). Its incoming gradient differs per row, so its backward recomputes each chunk's logits from
the saved rows and head: one more head matmul per chunk, still never the ``(N, V)`` logits.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

IGNORE_INDEX = -100
"""A target without loss (padding, a masked prompt): ``F.cross_entropy``'s ``ignore_index``. The loss's convention,
so it is defined here, beside the loss; :mod:`bigbatch.engine.batch` and the data pipeline use it from here."""

CHUNK_BYTES = 128 << 20
"""At most this many bytes of float32 logits in one chunk by default (see :func:`default_chunk_rows`). Measured on
a 2-core CPU, GPT-2's head, fp32 forward + backward of 1024 rows (benchmarks/head_loss.py): chunks of 512 rows
(this default) took 0.87x the plain path's time, of 256 rows 0.96x, of 166 (32 MiB) 1.2x: every chunk streams
the (V, C) head twice and its (V, C) gradient once more, so small chunks pay in memory traffic and skinny matmuls.
One chunk is still a fraction of the plain path's three (N, V) tensors."""
MIN_CHUNK_ROWS = 64
"""Fewer rows make skinny matmuls that waste the head's bandwidth (a small vocabulary still gets this many)."""


def default_chunk_rows(vocab: int) -> int:
    """Most rows of logits per chunk: ``CHUNK_BYTES`` of float32 logits, at least ``MIN_CHUNK_ROWS`` (GPT-2: 667,
    so 1024 rows go as two even chunks of 512)."""
    return max(MIN_CHUNK_ROWS, CHUNK_BYTES // (4 * vocab))


def largest_chunk(rows: int, vocab: int) -> int:
    """Rows of the largest chunk the default chunking makes of ``rows`` rows (what the memory estimate counts)."""
    return max((stop - start for start, stop in _chunks(rows, default_chunk_rows(vocab))), default=0)


def _chunks(n: int, chunk_rows: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of the fewest chunks of at most ``chunk_rows`` rows covering ``n`` rows, sized evenly (1024
    rows at most 667 a chunk: two of 512, not 667 + 357) so that no chunk is a skinny, slow matmul."""
    if n == 0:
        return []
    count = -(-n // chunk_rows)
    size = -(-n // count)
    return [(start, min(start + size, n)) for start in range(0, n, size)]


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype the plain path's head matmul runs in: autocast's when it is on and would cast ``hidden`` (a
    floating tensor other than float64, as autocast decides), else the inputs' own."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device) and hidden.is_floating_point() and hidden.dtype != torch.float64:
        return torch.get_autocast_dtype(device)
    return hidden.dtype


def _chunk_logits(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, start: int, stop: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``start:stop`` of ``h``: their logits transposed, (V, n), in the matmul dtype and as float32 (the same
    tensor when the matmul runs in float32). Transposed because the head times the rows (``W @ h.T``, a plain
    row-major product) ran 8-14% faster for the whole chunk step than ``h @ W.T`` on the CPU it was measured on
    (GPT-2's head, 256 to 1024 rows); every later step reads the columns as easily."""
    rows_t = h[start:stop].t()  # (C, n)
    logits = torch.mm(weight, rows_t) if bias is None else torch.addmm(bias[:, None], weight, rows_t)  # (V, n)
    return logits, logits.float()


def _chunked_loss(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor, chunk_rows: int
) -> torch.Tensor:
    """The summed cross-entropy of ``h``'s rows (all valid), in float32, without gradient buffers."""
    loss = torch.zeros((), dtype=torch.float32, device=h.device)
    for start, stop in _chunks(h.shape[0], chunk_rows):
        in_dtype, logits = _chunk_logits(h, weight, bias, start, stop)  # (V, n): matmul dtype, float32
        t = targets[None, start:stop]  # (1, n)
        loss += (torch.logsumexp(logits, dim=0) - logits.gather(0, t).squeeze(0)).sum()
        del in_dtype, logits  # one chunk in memory at a time
    return loss


class _LinearCrossEntropySum(torch.autograd.Function):
    """The summed loss of rows that all have a target; its forward computes the gradients too (see the module)."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,  # (n_valid, C)
        weight: torch.Tensor,  # (V, C)
        bias: torch.Tensor | None,  # (V,)
        targets: torch.Tensor,  # (n_valid,) int64, none ignored
        chunk_rows: int,
        dtype: torch.dtype,  # the head matmul's
        needs: tuple[bool, bool, bool],  # which of hidden, weight, bias want a gradient (grad mode is off in here)
    ) -> torch.Tensor:
        # The casts autocast would make (once, not per chunk); the gradients go back in the inputs' own dtypes, so
        # the head's float32 sum of the chunks' products is not rounded to the matmul dtype on its way.
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        h, weight = hidden.to(dtype), weight.to(dtype)  # (n_valid, C), (V, C)
        bias = None if bias is None else bias.to(dtype)  # (V,)
        n, vocab = h.shape[0], weight.shape[0]
        need_h, need_w, need_b = needs
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        # The gradients, filled chunk by chunk: the rows' in the matmul dtype (what the plain backward's matmul
        # returns), the head's accumulated in float32 so that summing the chunks' partial products loses nothing.
        grad_h = torch.empty(h.shape, dtype=dtype, device=h.device) if need_h else None  # (n_valid, C), contiguous
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if need_w else None  # (V, C)
        grad_b = torch.zeros(vocab, dtype=torch.float32, device=h.device) if need_b else None  # (V,)
        for start, stop in _chunks(n, chunk_rows):
            h_chunk = h[start:stop]  # (n, C)
            logits, p = _chunk_logits(h, weight, bias, start, stop)  # (V, n): matmul dtype, float32
            t = targets[None, start:stop]  # (1, n)
            target_logit = p.gather(0, t)  # (1, n), read before p is overwritten in place
            # softmax with one exp pass: p <- exp(logits - max) / sum, in place (no second (V, n) buffer in fp32)
            col_max = p.amax(dim=0, keepdim=True)  # (1, n)
            p.sub_(col_max).exp_()
            total = p.sum(dim=0, keepdim=True)  # (1, n)
            loss += (total.log() + col_max - target_logit).sum()  # log-sum-exp - target logit
            p.div_(total)
            p.scatter_add_(0, t, torch.full_like(target_logit, -1.0))  # d(loss)/d(logits) = softmax - one_hot
            # The products run in the forward matmul's dtype, as autocast's backward would run them.
            dlogits = p if logits.dtype == torch.float32 else p.to(logits.dtype)  # (V, n)
            del logits
            if grad_h is not None:
                torch.mm(dlogits.t(), weight, out=grad_h[start:stop])  # (n, C)
            if grad_w is not None:
                if dlogits.dtype == torch.float32:
                    grad_w.addmm_(dlogits, h_chunk)  # (V, C) in place, no (V, C) temporary
                else:
                    grad_w.add_(torch.mm(dlogits, h_chunk))  # (V, C), promoted to float32 as it is added
            if grad_b is not None:
                grad_b += dlogits.sum(dim=1, dtype=torch.float32)  # (V,)
            del p, dlogits  # before the next chunk's logits exist: one chunk in memory at a time, not two
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # The loss is a scalar: each stored gradient times the incoming one, cast to its input's dtype (new tensors,
        # not in place, so that a retained graph can run backward again).
        grads = [
            None if g is None else g.to(dtype) * grad_output.to(dtype)
            for g, dtype in zip(ctx.saved_tensors, ctx.dtypes, strict=True)
        ]
        return grads[0], grads[1], grads[2], None, None, None, None


@torch.compiler.disable  # dynamo graph-breaks around it: the chunk loop and the Function run eagerly
def linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias).float(), targets, ignore_index=-100, reduction="sum")``
    to rounding, gradients included, without ever holding the ``(N, V)`` logits.

    ``hidden`` (N, C) (leading dimensions are flattened), ``weight`` (V, C), ``targets`` (N,) int64 with
    ``IGNORE_INDEX`` for no loss, ``bias`` (V,) or None. Under autocast the head matmuls run in autocast's dtype
    and the softmax in float32, as for the plain path. ``chunk_rows``: rows of logits per chunk (default
    :func:`default_chunk_rows`). Returns a 0-d float32 tensor."""
    width = hidden.shape[-1]
    hidden, targets = hidden.reshape(-1, width), targets.reshape(-1)  # (N, C), (N,)
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(weight.shape[0])
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be at least 1, got {chunk_rows}")
    rows = (targets != IGNORE_INDEX).nonzero().squeeze(1)  # (n_valid,)
    if rows.numel() < targets.numel():
        # Only the rows with a target enter the head; index_select's backward scatters the rows' gradient back
        # into zeros for the others.
        hidden, targets = hidden.index_select(0, rows), targets.index_select(0, rows)  # (n_valid, C), (n_valid,)
    dtype = _compute_dtype(hidden)
    with torch.autocast(hidden.device.type, enabled=False):  # the matmul dtype is chosen here: nothing casts twice
        needs = (hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
        if not (torch.is_grad_enabled() and any(needs)):  # evaluation: the loss alone, no gradient buffers
            b = None if bias is None else bias.to(dtype)
            return _chunked_loss(hidden.to(dtype), weight.to(dtype), b, targets, chunk_rows)
        loss: torch.Tensor = _LinearCrossEntropySum.apply(hidden, weight, bias, targets, chunk_rows, dtype, needs)
        return loss


def _token_values(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor, chunk_rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of ``h`` (n, C) (all valid, already in the matmul dtype), in float32: the cross-entropy, the
    log-sum-exp of the logits and the entropy of their softmax, each (n,). Two (V, n) float32 buffers of one chunk
    at a time, never the (N, V) logits."""
    n = h.shape[0]
    loss = torch.empty(n, dtype=torch.float32, device=h.device)  # (n,)
    lse = torch.empty(n, dtype=torch.float32, device=h.device)  # (n,)
    entropy = torch.empty(n, dtype=torch.float32, device=h.device)  # (n,)
    for start, stop in _chunks(n, chunk_rows):
        in_dtype, z = _chunk_logits(h, weight, bias, start, stop)  # (V, n): matmul dtype, float32
        del in_dtype  # only the float32 logits are read from here on
        target_logit = z.gather(0, targets[None, start:stop]).squeeze(0)  # (n,), read before z is overwritten
        col_max = z.amax(dim=0)  # (n,)
        s = z.sub_(col_max)  # (V, n) shifted logits s = z - max, in place: exp cannot overflow
        e = s.exp()  # (V, n) unnormalized softmax
        total = e.sum(dim=0)  # (n,)
        # H = lse - E_p[z] = log(total) - E_p[s]: the max cancels, and E_p[s] = sum(e * s) / total. s is not
        # needed after, so the product overwrites it (no third (V, n) buffer).
        weighted = s.mul_(e).sum(dim=0)  # (n,)
        log_total = total.log()  # (n,)
        lse[start:stop] = log_total + col_max
        loss[start:stop] = lse[start:stop] - target_logit
        entropy[start:stop] = log_total - weighted / total
        del z, s, e  # one chunk in memory at a time
    return loss, lse, entropy


class _LinearCrossEntropyTokens(torch.autograd.Function):
    """Per-row cross-entropy and entropy of rows that all have a target, (n, 2) float32. Unlike the sum version,
    whose backward only scales gradients computed in forward (its incoming gradient is one number), the incoming
    gradient here differs per row and per column, so backward recomputes each chunk's logits from the saved rows
    and head (one more head matmul per chunk) instead of keeping anything logits-sized."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,  # (n_valid, C)
        weight: torch.Tensor,  # (V, C)
        bias: torch.Tensor | None,  # (V,)
        targets: torch.Tensor,  # (n_valid,) int64, none ignored
        chunk_rows: int,
        dtype: torch.dtype,  # the head matmul's
    ) -> torch.Tensor:
        h, w = hidden.to(dtype), weight.to(dtype)  # (n_valid, C), (V, C)
        b = None if bias is None else bias.to(dtype)  # (V,)
        loss, lse, entropy = _token_values(h, w, b, targets, chunk_rows)  # (n_valid,) each
        # The inputs as given (no copies; cast again in backward) and two floats per row: backward gets the
        # softmax as exp(z - lse) and E_p[z] as lse - H without a reduction over the vocabulary.
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.chunk_rows, ctx.dtype = chunk_rows, dtype
        return torch.stack((loss, entropy), dim=1)  # (n_valid, 2)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        dtype: torch.dtype = ctx.dtype
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        # backward may run inside the caller's autocast region: the matmul dtype was chosen in forward, so autocast
        # must not recast the products below.
        with torch.autocast(hidden.device.type, enabled=False):
            h, w = hidden.to(dtype), weight.to(dtype)  # (n_valid, C), (V, C)
            b = None if bias is None else bias.to(dtype)  # (V,)
            g = grad_output.float()  # (n_valid, 2)
            g_loss, g_ent = g[:, 0], g[:, 1]  # (n_valid,) each
            # As in the sum version: the rows' gradient in the matmul dtype, the head's accumulated in float32.
            grad_h = torch.empty(h.shape, dtype=dtype, device=h.device) if need_h else None  # (n_valid, C)
            grad_w = torch.zeros(w.shape, dtype=torch.float32, device=h.device) if need_w else None  # (V, C)
            grad_b = torch.zeros(w.shape[0], dtype=torch.float32, device=h.device) if need_b else None  # (V,)
            for start, stop in _chunks(h.shape[0], ctx.chunk_rows):
                in_dtype, z = _chunk_logits(h, w, b, start, stop)  # (V, n): matmul dtype, float32
                del in_dtype
                gl, ge = g_loss[start:stop], g_ent[start:stop]  # (n,) each
                # dloss/dz = p - onehot; dH/dz_k = -p_k (z_k - E_p[z]), and z - E_p[z] = log p + H. So
                # dlogits = p * (g_loss - g_ent * (log p + H)) - g_loss * onehot, built in two (V, n) buffers.
                log_p = z.sub_(lse[start:stop])  # (V, n) in place
                p = log_p.exp()  # (V, n)
                factor = log_p.add_(entropy[start:stop]).mul_(-ge).add_(gl)  # (V, n), in place over log p
                dlogits = p.mul_(factor)  # (V, n), in place over p
                dlogits.scatter_add_(0, targets[None, start:stop], -gl[None])  # the one-hot term
                del z, log_p, factor
                # The products run in the forward matmul's dtype, as autocast's backward would run them.
                d = dlogits if dtype == torch.float32 else dlogits.to(dtype)  # (V, n)
                if grad_h is not None:
                    torch.mm(d.t(), w, out=grad_h[start:stop])  # (n, C)
                if grad_w is not None:
                    if d.dtype == torch.float32:
                        grad_w.addmm_(d, h[start:stop])  # (V, C) in place, no (V, C) temporary
                    else:
                        grad_w.add_(torch.mm(d, h[start:stop]))  # (V, C), promoted to float32 as it is added
                if grad_b is not None:
                    grad_b += d.sum(dim=1, dtype=torch.float32)  # (V,)
                del p, dlogits, d  # before the next chunk's logits exist
        return (
            None if grad_h is None else grad_h.to(hidden.dtype),
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
            None,
            None,
            None,
        )


@torch.compiler.disable  # dynamo graph-breaks around it: the chunk loop and the Function run eagerly
def linear_cross_entropy_tokens(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """Each row's cross-entropy and softmax entropy, (N, 2) float32, without ever holding the ``(N, V)`` logits:
    column 0 is ``-log softmax(z)[target]``, column 1 is ``H = logsumexp(z) - sum_j p_j z_j``, for the logits
    ``z = hidden @ weight.T + bias`` of that row (what learning from rewards needs: log-probabilities, which are
    minus column 0, and entropies, per token).

    ``hidden`` (N, C) (leading dimensions are flattened), ``weight`` (V, C), ``targets`` (N,) int64 with
    ``IGNORE_INDEX`` for none, ``bias`` (V,) or None. Rows whose target is ``IGNORE_INDEX`` get 0 in both columns
    and no gradient (they never enter the head). Gradients reach ``hidden``, ``weight`` and ``bias`` from both
    columns, whatever their incoming gradients. Under autocast the head matmuls run in autocast's dtype and the
    softmax in float32, as for the plain path. ``chunk_rows``: rows of logits per chunk (default
    :func:`default_chunk_rows`). Column 0 sums to :func:`linear_cross_entropy_sum` to rounding."""
    width = hidden.shape[-1]
    hidden, targets = hidden.reshape(-1, width), targets.reshape(-1)  # (N, C), (N,)
    n_rows = targets.numel()
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(weight.shape[0])
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be at least 1, got {chunk_rows}")
    rows = (targets != IGNORE_INDEX).nonzero().squeeze(1)  # (n_valid,)
    some_ignored = rows.numel() < n_rows
    if some_ignored:
        # Only the rows with a target enter the head; index_select's backward scatters the rows' gradient back
        # into zeros for the others.
        hidden, targets = hidden.index_select(0, rows), targets.index_select(0, rows)  # (n_valid, C), (n_valid,)
    dtype = _compute_dtype(hidden)
    with torch.autocast(hidden.device.type, enabled=False):  # the matmul dtype is chosen here: nothing casts twice
        needs = (hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
        if not (torch.is_grad_enabled() and any(needs)):  # evaluation: the values alone, nothing saved
            b = None if bias is None else bias.to(dtype)
            loss, _, entropy = _token_values(hidden.to(dtype), weight.to(dtype), b, targets, chunk_rows)
            values = torch.stack((loss, entropy), dim=1)  # (n_valid, 2)
        else:
            values = _LinearCrossEntropyTokens.apply(hidden, weight, bias, targets, chunk_rows, dtype)
    if not some_ignored:
        return values
    # Zeros for the ignored rows; index_copy's backward hands the valid rows their gradient, the others none.
    return values.new_zeros(n_rows, 2).index_copy(0, rows, values)  # (N, 2)
