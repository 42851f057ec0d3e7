"""Text generation from a trained model."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

import torch
import torch.nn.functional as F

from bigbatch.errors import BigBatchError
from bigbatch.models.decoder import LanguageModel
from bigbatch.models.lm_output import computes_loss

NEWLINE = 10  # the start token of an empty prompt when the vocabulary has no end-of-text token (bytes, GPT-2)


class PromptTokenizer(Protocol):
    @property
    def eot_token(self) -> int | None: ...

    def encode(self, data: bytes) -> list[int]: ...


def prompt_ids(tokenizer: PromptTokenizer, prompt: str, vocab_size: int) -> list[int]:
    """The prompt's token ids; an empty prompt starts from the end-of-text token (a newline without one)."""
    ids = list(tokenizer.encode(prompt.encode("utf-8")))
    if not ids:
        ids = [tokenizer.eot_token if tokenizer.eot_token is not None else NEWLINE]
    if max(ids) >= vocab_size:
        raise BigBatchError(
            "the prompt holds tokens outside the model's vocabulary; was it trained with this tokenizer?"
        )
    return ids


def _next_token(
    model: LanguageModel,
    idx: torch.Tensor,
    temperature: float,
    top_k: int | None,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """The next token (B, 1) after ``idx`` (B, T); greedy when ``temperature`` is 0."""
    context = idx[:, -model.config.block_size :]  # (B, <= block_size)
    if computes_loss(model):  # bigbatch's families: the head on the last position only
        logits = model(context, last_only=True)[:, -1, :].float()  # (B, vocab)
    else:
        logits = model(context)[:, -1, :].float()  # (B, vocab)
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)  # (B, 1)


@torch.no_grad()
def generate(
    model: LanguageModel,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Extend ``idx`` (B, T) by ``max_new_tokens`` sampled tokens; greedy when ``temperature`` is 0."""
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            idx = torch.cat([idx, _next_token(model, idx, temperature, top_k, generator)], dim=1)
    finally:
        model.train(was_training)
    return idx


def generate_stream(
    model: LanguageModel,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> Iterator[int]:
    """Each of ``max_new_tokens`` new token ids after ``idx`` (1, T), as it is sampled.

    The same tokens as :func:`generate` gives for the same generator state. The model is in eval mode while
    the stream runs and back in its previous mode when it ends or is closed.
    """
    if idx.dim() != 2 or idx.size(0) != 1:
        raise ValueError(f"generate_stream takes one sequence (1, T), got shape {tuple(idx.shape)}")
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            with torch.no_grad():
                next_token = _next_token(model, idx, temperature, top_k, generator)
            idx = torch.cat([idx, next_token], dim=1)
            yield int(next_token.item())
    finally:
        model.train(was_training)


def decoded_pieces(tokens: Iterable[int], decode: Callable[[list[int]], str]) -> Iterator[str]:
    """The text of ``tokens`` piece by piece as they arrive: joined, the pieces are ``decode(all tokens)``.

    The whole list is decoded each time and only the new suffix is yielded; while the text ends in an
    incomplete UTF-8 sequence (decoded as U+FFFD) it is held back, until more tokens complete it or the
    tokens end.
    """
    ids: list[int] = []
    shown = ""
    text = ""
    for token in tokens:
        ids.append(token)
        text = decode(ids)
        if text.endswith("\ufffd"):
            continue
        if len(text) > len(shown):
            yield text[len(shown) :]
        shown = text
    if len(text) > len(shown):
        yield text[len(shown) :]


class TextTokenizer(PromptTokenizer, Protocol):
    def decode(self, ids: list[int]) -> str: ...


def sample_text(
    model: LanguageModel,
    tokenizer: TextTokenizer,
    prompt: str,
    max_new_tokens: int,
    seed: int,
    device: torch.device,
    temperature: float = 0.8,
    top_k: int = 50,
) -> str:
    """The text ``model`` writes after ``prompt`` (the prompt itself not included), reproducibly from ``seed``."""
    ids = prompt_ids(tokenizer, prompt, model.config.vocab_size)
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    out = generate(model, idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=generator)
    return tokenizer.decode(out[0, len(ids) :].tolist())
