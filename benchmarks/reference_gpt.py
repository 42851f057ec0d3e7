"""A minimal reference GPT-2 and the plainest training loop, to measure bigbatch against.

    from reference_gpt import ReferenceGPT, train_reference   # with benchmarks/ on sys.path

Written in the style of the best-known minimal GPT scripts, independent of bigbatch (it imports nothing from
it): token + position embeddings, pre-LayerNorm blocks of causal self-attention (one fused q/k/v Linear,
``F.scaled_dot_product_attention(is_causal=True)``) and a tanh-GELU MLP, a final LayerNorm and an LM head tied
to the token embedding; ``F.cross_entropy`` on the logits. Initialization as GPT-2: normal(0, 0.02), residual
projections scaled by ``1/sqrt(2 * n_layer)``, zero biases. Parameter names match bigbatch's GPT
(``transformer.wte.weight``, ``transformer.h.0.attn.c_attn.weight``, ...) so a state dict moves between them
when the vocabulary is not padded.

The loop: per step, set the learning rate, zero gradients, for each of ``accum`` micro-batches forward and
``(loss / accum).backward()``, clip the global norm, AdamW step. AdamW groups and betas as bigbatch (decay on
tensors of 2+ dims, betas (0.9, 0.95), eps 1e-8), and bigbatch's default schedule (linear warmup, cosine decay
to ``min_lr_ratio x lr`` at ``decay_steps``, 0 meaning the last step). Windows come from a 1-D token array at
random (seeded: ``B`` random offsets per micro-batch) or sequentially (window ``j`` starts at ``j * B * T``, as
bigbatch's token-stream loader reads one process; it wraps when the next window would run past the end).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class SelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, -1).transpose(1, 2)  # (B, nh, T, hd)
        k = k.view(B, T, self.n_head, -1).transpose(1, 2)
        v = v.view(B, T, self.n_head, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class FeedForward(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Layer(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = SelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = FeedForward(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Trunk(nn.Module):
    def __init__(self, vocab_size: int, n_layer: int, n_head: int, n_embd: int, block_size: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList([Layer(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)


class ReferenceGPT(nn.Module):
    """GPT-2 at ``vocab_size`` exactly (no padding). ``forward(idx, targets)`` -> ``(logits, mean loss or None)``."""

    def __init__(self, vocab_size: int, n_layer: int, n_head: int, n_embd: int, block_size: int) -> None:
        super().__init__()
        self.block_size = block_size
        self.transformer = Trunk(vocab_size, n_layer, n_head, n_embd, block_size)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied
        residual_std = 0.02 / math.sqrt(2 * n_layer)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, residual_std)
            elif name.endswith(".weight") and p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)
            # LayerNorm weights keep their default of one

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        _, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # (B, T, C)
        for layer in self.transformer.h:
            x = layer(x)
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, V)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def make_adamw(
    model: nn.Module,
    lr: float,
    weight_decay: float = 0.1,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    fused: bool | None = None,
) -> torch.optim.AdamW:
    """AdamW with decay on matrices and embeddings only (bigbatch's grouping); torch's default kernel unless
    ``fused``."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused)


def lr_at(step: int, max_lr: float, min_lr: float, warmup: int, decay: int) -> float:
    """Linear warmup over ``warmup`` steps, cosine to ``min_lr`` at ``decay`` (step is 0-based)."""
    if step < warmup:
        return max_lr * (step + 1) / warmup
    if step >= decay:
        return min_lr
    progress = (step - warmup) / max(1, decay - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (max_lr - min_lr)


def random_windows(tokens: np.ndarray, B: int, T: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless ``(x, y)`` micro-batches of ``B`` windows at seeded random offsets."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
    while True:
        starts = torch.randint(len(data) - T - 1, (B,), generator=gen)
        x = torch.stack([data[s : s + T] for s in starts.tolist()])
        y = torch.stack([data[s + 1 : s + T + 1] for s in starts.tolist()])
        yield x, y


def sequential_windows(tokens: np.ndarray, B: int, T: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless ``(x, y)`` micro-batches read in order: window ``j`` is tokens ``[j*B*T, (j+1)*B*T + 1)``."""
    data = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
    span = B * T
    offset = 0
    while True:
        if offset + span + 1 > len(data):
            offset = 0
        chunk = data[offset : offset + span + 1]
        yield chunk[:-1].view(B, T), chunk[1:].view(B, T)
        offset += span


@torch.no_grad()
def evaluate(model: ReferenceGPT, windows: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Token-weighted mean loss over the given ``(x, y)`` windows (eval mode; training mode restored)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    device = next(model.parameters()).device
    for x, y in windows:
        logits, _ = model(x.to(device))
        total += float(F.cross_entropy(logits.view(-1, logits.size(-1)), y.to(device).reshape(-1), reduction="sum"))
        count += y.numel()
    model.train(was_training)
    return total / count


@dataclass
class ReferenceResult:
    losses: list[float] = field(default_factory=list)  # mean training loss of each step
    val_losses: dict[int, float] = field(default_factory=dict)  # step -> validation loss
    step_times: list[float] = field(default_factory=list)  # seconds per step
    tokens_per_step: int = 0

    @property
    def tokens_per_s(self) -> float:
        """Over the steps after the first (warm-up)."""
        times = self.step_times[1:] or self.step_times
        return self.tokens_per_step * len(times) / sum(times) if times else 0.0


def train_reference(
    model: ReferenceGPT,
    tokens: np.ndarray,
    *,
    steps: int,
    micro_batch: int,
    seq_len: int,
    accum: int = 1,
    order: str = "random",
    seed: int = 1337,
    lr: float = 2e-3,
    min_lr_ratio: float = 0.1,
    warmup_steps: int = 20,
    decay_steps: int = 0,
    weight_decay: float = 0.1,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    grad_clip: float = 1.0,
    fused: bool | None = None,
    val_windows: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
    eval_every: int = 0,
    on_step: Callable[[int, float], None] | None = None,
    optimizers: Sequence[tuple[torch.optim.Optimizer, float]] = (),
) -> ReferenceResult:
    """Train ``model`` in place for ``steps`` optimizer steps of ``accum`` micro-batches of ``micro_batch`` x
    ``seq_len`` tokens; ``order`` is ``random`` or ``sequential``. With ``val_windows`` and ``eval_every``,
    evaluates every ``eval_every`` steps and after the last. ``on_step(step, loss)`` is called after each step
    (1-based). The schedule is bigbatch's default: ``decay_steps`` 0 means ``steps``; warmup at most that.
    ``fused`` picks torch's fused AdamW kernel (default: torch's default, the for-loop one on CPU).
    ``optimizers``: (optimizer, its learning rate as a multiple of ``lr``) pairs that share the parameters between
    them, stepped in order, instead of one AdamW over all of them (reference_muon.py's Muon and AdamW)."""
    if order not in ("random", "sequential"):
        raise ValueError(f"order must be random or sequential, got {order!r}")
    decay = decay_steps or steps
    warmup = min(warmup_steps, decay)
    windows = (
        random_windows(tokens, micro_batch, seq_len, seed)
        if order == "random"
        else sequential_windows(tokens, micro_batch, seq_len)
    )
    optimizers = optimizers or [(make_adamw(model, lr, weight_decay, betas, eps, fused), 1.0)]
    result = ReferenceResult(tokens_per_step=micro_batch * seq_len * accum)
    device = next(model.parameters()).device
    model.train()
    for step in range(steps):
        started = time.perf_counter()
        now = lr_at(step, lr, lr * min_lr_ratio, warmup, decay)
        for optimizer, scale in optimizers:
            for group in optimizer.param_groups:
                group["lr"] = now * scale
        model.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for _ in range(accum):
            x, y = next(windows)
            _, loss = model(x.to(device), y.to(device))
            assert loss is not None
            (loss / accum).backward()
            loss_sum += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        for optimizer, _ in optimizers:
            optimizer.step()
        result.step_times.append(time.perf_counter() - started)
        result.losses.append(loss_sum / accum)
        if on_step is not None:
            on_step(step + 1, loss_sum / accum)
        if val_windows and eval_every and ((step + 1) % eval_every == 0 or step + 1 == steps):
            result.val_losses[step + 1] = evaluate(model, val_windows)
    return result
