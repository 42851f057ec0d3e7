"""Text generation from a trained model: :func:`generate` and :func:`generate_stream` for text,
:func:`sample_completions` for several completions of one prompt at once (learning from rewards).

A bigbatch family with a key/value cache (:meth:`~bigbatch.models.decoder.StackedDecoderLM.decode`) runs the prompt
once and then one token per step; any other model runs the whole context for every token."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Any, Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from bigbatch.errors import BigBatchError
from bigbatch.models.decoder import KVCache, LanguageModel, StackedDecoderLM
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


def _draw(
    logits: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """One token (B,) per row of ``logits`` (B, V): the argmax when ``temperature`` is 0, else one
    ``torch.multinomial`` draw for all rows from the probabilities after :func:`filter_logits`."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = F.softmax(filter_logits(logits.float() / temperature, top_k, top_p), dim=-1)  # (B, V)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)  # (B,)


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """``logits`` (B, V) with -inf outside each row's ``top_k`` highest (0: no limit; ties with the k-th stay) and
    then outside its nucleus: the fewest most likely tokens whose probabilities reach ``top_p`` (1: no limit; the
    most likely token always stays)."""
    if 0 < top_k < logits.size(-1):
        kth = torch.topk(logits, top_k).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V) each
        sorted_probs = F.softmax(sorted_logits, dim=-1)  # (B, V)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # (B, V): the more likely tokens' probability
        drop_sorted = mass_before >= top_p  # (B, V): the nucleus already holds top_p without this token
        drop = drop_sorted.scatter(-1, order, drop_sorted)  # (B, V), back in vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class _LogitsStepper(Protocol):
    def next_logits(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """The fp32 logits (B, V) after the rows so far followed by ``new_tokens`` (B, T): the prompt first, then
        each drawn token (B, 1)."""
        ...


class _Recompute:
    """No cache: the whole context (its last ``block_size`` tokens) through the model for each token."""

    def __init__(self, model: LanguageModel) -> None:
        self.model = model
        self.block_size: int = model.config.block_size
        self.context: torch.Tensor | None = None  # (B, T) every token so far

    def next_logits(self, new_tokens: torch.Tensor) -> torch.Tensor:
        self.context = new_tokens if self.context is None else torch.cat([self.context, new_tokens], dim=1)
        window = self.context[:, -self.block_size :]  # (B, <= block_size)
        if computes_loss(self.model):  # bigbatch's families: the head on the last position only
            return self.model(window, last_only=True)[:, -1, :].float()  # (B, V)
        return self.model(window)[:, -1, :].float()  # (B, V)


class _NativeCached:
    """A bigbatch family's :meth:`~bigbatch.models.decoder.StackedDecoderLM.decode` with a key/value cache of
    ``capacity`` positions: the prompt's prefill, then one token per step."""

    def __init__(self, decoder: StackedDecoderLM, capacity: int) -> None:
        self.decoder = decoder
        self.cache = KVCache(len(decoder.blocks()), capacity)

    def next_logits(self, new_tokens: torch.Tensor) -> torch.Tensor:
        return self.decoder.decode(new_tokens, self.cache, last_only=True)[:, -1, :].float()  # (B, V)


def _hf_cache_argument(hf_model: nn.Module) -> str | None:
    """The name under which ``hf_model``'s forward takes and returns its cache: ``cache`` (transformers 5, where
    ``past_key_values`` is deprecated), ``past_key_values`` (4.x), or None when it takes neither."""
    parameters = inspect.signature(hf_model.forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in parameters), None)


class _HFCached:
    """A transformers model's own key/value cache; should it return none, the whole context from then on (through
    the bigbatch wrapper, ``model``)."""

    def __init__(self, model: LanguageModel, hf_model: nn.Module, cache_argument: str) -> None:
        self.hf_model = hf_model
        self.cache_argument = cache_argument
        self.recompute = _Recompute(model)  # keeps the context, for the fallback
        self.past: Any = None
        self.cached = True
        self.kwargs: dict[str, Any] = {"use_cache": True}
        if hasattr(getattr(hf_model, "config", None), "output_router_logits"):
            self.kwargs["output_router_logits"] = False  # no auxiliary loss to compute while sampling
        if "logits_to_keep" in inspect.signature(hf_model.forward).parameters:
            self.kwargs["logits_to_keep"] = 1  # the prompt's prefill without its (B, T, V) logits

    def next_logits(self, new_tokens: torch.Tensor) -> torch.Tensor:
        if not self.cached:
            return self.recompute.next_logits(new_tokens)
        context = self.recompute.context
        self.recompute.context = new_tokens if context is None else torch.cat([context, new_tokens], dim=1)
        output = self.hf_model(input_ids=new_tokens, **{self.cache_argument: self.past}, **self.kwargs)
        self.past = getattr(output, self.cache_argument, None)
        self.cached = self.past is not None
        logits: torch.Tensor = output.logits[:, -1, :].float()  # (B, V)
        return logits


def _inner_modules(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` and the modules it wraps (DDP's ``module``, ``torch.compile``'s ``_orig_mod``, the compile
    fallback's ``eager``), outermost first."""
    seen: set[int] = set()
    current: Any = model
    while isinstance(current, nn.Module) and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = (
            getattr(current, "module", None) or getattr(current, "_orig_mod", None) or getattr(current, "eager", None)
        )


def _is_fsdp(module: nn.Module) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def _cached_decoder(model: nn.Module) -> StackedDecoderLM | None:
    """The bigbatch model inside ``model`` when its family has a key/value cache, else None. An FSDP2 root has
    :meth:`~bigbatch.models.decoder.StackedDecoderLM.decode` registered as a forward method (once), so that it too
    gathers the root's parameters (embeddings, final norm, head); the blocks gather their own when called."""
    for module in _inner_modules(model):
        if isinstance(module, StackedDecoderLM) and module.supports_kv_cache:
            if _is_fsdp(module) and "decode" not in vars(module):
                from torch.distributed.fsdp import register_fsdp_forward_method

                register_fsdp_forward_method(module, "decode")  # sets the instance's ``decode``
            return module
    return None


def _hf_model(model: nn.Module) -> nn.Module | None:
    """The transformers model inside an ``hf:`` model (its ``hf_model``), unless FSDP shards the wrapper: then
    calling the inner model directly would skip the wrapper's gathering of the parameters it holds."""
    for module in _inner_modules(model):
        inner = getattr(module, "hf_model", None)
        if isinstance(inner, nn.Module):
            return None if _is_fsdp(module) else inner
    return None


def _stepper(model: LanguageModel, capacity: int, use_cache: bool, hf_cache: bool) -> _LogitsStepper:
    """How the logits of each step are computed: a bigbatch family's key/value cache, transformers' cache (with
    ``hf_cache``), else the whole context per token. ``capacity``: the longest row the cache must hold."""
    if use_cache:
        decoder = _cached_decoder(model)
        if decoder is not None:
            return _NativeCached(decoder, capacity)
        hf_model = _hf_model(model) if hf_cache else None
        cache_argument = _hf_cache_argument(hf_model) if hf_model is not None else None
        if hf_model is not None and cache_argument is not None:
            return _HFCached(model, hf_model, cache_argument)
    return _Recompute(model)


def _token_steps(
    model: LanguageModel,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    generator: torch.Generator | None,
) -> Iterator[torch.Tensor]:
    """Each new token (B, 1) after ``idx`` (B, T), for :func:`generate` and :func:`generate_stream`. A bigbatch
    family's key/value cache when every token fits in ``block_size`` (the same logits as the whole context's, to
    rounding); else the last ``block_size`` tokens through the model each time (the window slides, and a cache of
    learned or rotary positions would not)."""
    fits = idx.size(1) + max_new_tokens <= model.config.block_size
    stepper = _stepper(model, idx.size(1) + max_new_tokens, use_cache=fits, hf_cache=False)
    new_tokens = idx
    for _ in range(max_new_tokens):
        logits = stepper.next_logits(new_tokens)  # (B, V)
        new_tokens = _draw(logits, temperature, top_k or 0, 1.0, generator).unsqueeze(1)  # (B, 1)
        yield new_tokens


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
        new_tokens = list(_token_steps(model, idx, max_new_tokens, temperature, top_k, generator))  # (B, 1) each
        idx = torch.cat([idx, *new_tokens], dim=1)
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
        steps = _token_steps(model, idx, max_new_tokens, temperature, top_k, generator)
        for _ in range(max_new_tokens):
            with torch.no_grad():  # the step's forward runs inside next()
                next_token = next(steps)  # (1, 1)
            yield int(next_token.item())
    finally:
        model.train(was_training)


@torch.no_grad()
def sample_completions(
    model: LanguageModel,
    prompt_ids: list[int],
    n: int,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop_tokens: Collection[int] = (),
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    keep_going: Callable[[bool], bool] | None = None,
) -> list[list[int]]:
    """``n`` completions of one prompt (its token ids), sampled together as ``n`` rows (the prompt is shared: no
    padding). Each ends at (and includes) its first token of ``stop_tokens``, or after ``max_new_tokens``.

    ``temperature`` 0 is greedy; else each step divides the fp32 logits by it, keeps each row's ``top_k`` highest
    (0: all) and then its ``top_p`` nucleus (:func:`filter_logits`), and draws for all ``n`` rows with one
    ``torch.multinomial`` call (the rows that stopped too, their draws discarded), so ``generator`` is used the same
    way whatever computes the logits. ``use_cache``: a bigbatch family's key/value cache, or an ``hf:`` model's
    transformers cache (not under FSDP); off, or for a family without one, the whole context per token.

    The loop stops when no row is running. ``keep_going``, for FSDP (where every process must run the same number
    of forwards, as the same ``max_new_tokens`` everywhere): called after each step but the last with whether this
    process still has a running row, it returns whether any process has (the caller all-reduces); a process whose
    rows all stopped keeps stepping, its draws discarded, until it says no. The model is in eval mode while sampling
    and back in its previous mode after."""
    block_size: int = model.config.block_size
    if n < 1 or max_new_tokens < 0:
        raise ValueError(f"sample_completions needs n >= 1 and max_new_tokens >= 0, got n={n}, {max_new_tokens}")
    if not prompt_ids:
        raise ValueError("sample_completions needs a prompt of at least one token")
    if temperature < 0 or top_k < 0 or not 0.0 < top_p <= 1.0:
        raise ValueError(f"temperature and top_k must be >= 0 and 0 < top_p <= 1 (got {temperature}, {top_k}, {top_p})")
    if len(prompt_ids) + max_new_tokens - 1 > block_size:  # the last token drawn is never fed to the model
        raise ValueError(
            f"a prompt of {len(prompt_ids)} tokens and {max_new_tokens} new ones exceed the model's block_size "
            f"{block_size} + 1; shorten the prompt or max_new_tokens"
        )
    device = next(model.parameters()).device
    stops = torch.tensor(sorted(set(stop_tokens)), dtype=torch.long, device=device)  # (S,)
    drawn = torch.zeros(n, max_new_tokens, dtype=torch.long, device=device)  # (n, max_new_tokens)
    kept = torch.zeros(n, max_new_tokens, dtype=torch.bool, device=device)  # the draws of running rows
    running = torch.ones(n, dtype=torch.bool, device=device)  # (n,)
    new_tokens = torch.tensor(prompt_ids, dtype=torch.long, device=device).repeat(n, 1)  # (n, P): the prefill
    was_training = model.training
    model.eval()
    try:
        stepper = _stepper(model, len(prompt_ids) + max(max_new_tokens - 1, 0), use_cache, hf_cache=True)
        for step in range(max_new_tokens):
            logits = stepper.next_logits(new_tokens)  # (n, V)
            tokens = _draw(logits, temperature, top_k, top_p, generator)  # (n,)
            drawn[:, step] = tokens
            kept[:, step] = running
            running = running & ~torch.isin(tokens, stops)  # a row that drew a stop token keeps it, then ends
            new_tokens = tokens.unsqueeze(1)  # (n, 1)
            if step + 1 == max_new_tokens:
                break  # no forward follows: nothing to agree on
            local = bool(running.any())
            if not (keep_going(local) if keep_going is not None else local):
                break
    finally:
        model.train(was_training)
    return [row[keep].tolist() for row, keep in zip(drawn.cpu(), kept.cpu(), strict=True)]


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
