"""The key/value cache of the native families (GPT, Llama, MoE) and the batched completion sampler: cached logits are
the full forward's, and the cache changes no sampled token (float64 models, so rounding cannot move a draw)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from bigbatch.models import GPT, GPTConfig
from bigbatch.models.decoder import KVCache, StackedDecoderLM
from bigbatch.models.llama.model import Llama, LlamaConfig
from bigbatch.models.moe.model import MoE, MoEConfig
from bigbatch.models.sampling import filter_logits, generate, generate_stream, sample_completions

VOCAB = 61  # not a multiple of 64: GPT's padded head rows are exercised
BLOCK = 48
FAMILIES = ["gpt", "llama", "moe"]
PROMPT = [3, 17, 40, 8, 25, 1, 59]
STOPS = (2, 11, 23, 31, 44, 52)  # about one draw in ten stops a row: rows end at different steps


def tiny(family: str) -> StackedDecoderLM:
    """A tiny float64 model of ``family`` in eval mode: grouped-query attention for Llama; qk-norm and a shared
    expert for the MoE."""
    torch.manual_seed(0)
    model: StackedDecoderLM
    if family == "gpt":
        model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=BLOCK, vocab_size=VOCAB))
    elif family == "llama":
        model = Llama(
            LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=48, block_size=BLOCK, vocab_size=VOCAB)
        )
    else:
        model = MoE(
            MoEConfig(
                n_layer=2,
                n_head=4,
                n_kv_head=2,
                n_embd=32,
                ffn_hidden=16,
                n_expert=4,
                top_k=2,
                block_size=BLOCK,
                vocab_size=VOCAB,
                shared_ffn_hidden=8,
                qk_norm=True,
            )
        )
    return model.double().eval()


@pytest.fixture(scope="module", params=FAMILIES)
def model(request: pytest.FixtureRequest) -> StackedDecoderLM:
    return tiny(request.param)


def test_cached_logits_equal_the_full_forward(model: StackedDecoderLM) -> None:
    idx = torch.randint(0, VOCAB, (3, 20), generator=torch.Generator().manual_seed(1))  # (3, 20)
    cache = KVCache(len(model.blocks()), 20)
    with torch.no_grad():
        full = model(idx)  # (3, 20, V)
        # A prefill, several tokens after cached ones (a rectangular causal mask), then one token at a time.
        pieces = [model.decode(idx[:, :7], cache), model.decode(idx[:, 7:12], cache)]
        pieces += [model.decode(idx[:, t : t + 1], cache) for t in range(12, 20)]
        cached = torch.cat(pieces, dim=1)  # (3, 20, V)
        last = model.decode(idx[:, :5], KVCache(len(model.blocks()), 5), last_only=True)  # (3, 1, V)
    assert cache.length == 20
    torch.testing.assert_close(cached, full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(last, full[:, 4:5], rtol=1e-12, atol=1e-12)


def test_decode_stops_at_block_size_and_at_the_caches_capacity() -> None:
    model = tiny("llama")
    with torch.no_grad():
        model.decode(torch.zeros(1, BLOCK, dtype=torch.long), KVCache(len(model.blocks()), BLOCK))  # exactly fits
        with pytest.raises(ValueError, match="block_size"):
            model.decode(torch.zeros(1, BLOCK + 1, dtype=torch.long), KVCache(len(model.blocks()), BLOCK + 1))
        with pytest.raises(ValueError, match="cache holds 4 positions"):
            model.decode(torch.zeros(1, 5, dtype=torch.long), KVCache(len(model.blocks()), 4))


@pytest.mark.parametrize("temperature", [0.0, 1.3])
def test_cached_samples_equal_recomputed_ones(model: StackedDecoderLM, temperature: float) -> None:
    def sample(use_cache: bool) -> list[list[int]]:
        generator = torch.Generator().manual_seed(5)
        return sample_completions(
            model, PROMPT, 6, 24, temperature=temperature, stop_tokens=STOPS, generator=generator, use_cache=use_cache
        )

    cached, recomputed = sample(True), sample(False)
    assert cached == recomputed
    assert_stopped_at_first_stop(cached, 24)
    if temperature > 0:  # greedy rows of one prompt are all alike
        assert len({len(row) for row in cached}) >= 3, "rows should end at different steps"


def assert_stopped_at_first_stop(rows: list[list[int]], max_new_tokens: int) -> None:
    for row in rows:
        assert 1 <= len(row) <= max_new_tokens
        assert not set(row[:-1]) & set(STOPS)  # no stop token before the end
        assert len(row) == max_new_tokens or row[-1] in STOPS  # a row shorter than the limit ends on one


def test_greedy_and_one_row_sampling_agree_with_generate() -> None:
    """generate takes the cache when everything fits in block_size; its tokens are the cache-free sampler's."""
    model = tiny("gpt")
    idx = torch.tensor([PROMPT])
    greedy = generate(model, idx, 20, temperature=0.0)[0, len(PROMPT) :].tolist()
    assert sample_completions(model, PROMPT, 3, 20, temperature=0.0, use_cache=False) == [greedy] * 3
    drawn = generate(model, idx, 20, temperature=0.9, top_k=7, generator=torch.Generator().manual_seed(2))
    stream = list(generate_stream(model, idx, 20, 0.9, 7, generator=torch.Generator().manual_seed(2)))
    single = sample_completions(
        model, PROMPT, 1, 20, temperature=0.9, top_k=7, generator=torch.Generator().manual_seed(2), use_cache=False
    )
    assert single == [drawn[0, len(PROMPT) :].tolist()] == [stream]


def test_generate_uses_the_cache_only_when_everything_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny("gpt")
    decoded: list[int] = []
    original = GPT.decode

    def counting(self: GPT, idx: torch.Tensor, cache: KVCache, last_only: bool = False) -> torch.Tensor:
        decoded.append(idx.size(1))
        return original(self, idx, cache, last_only)

    monkeypatch.setattr(GPT, "decode", counting)
    generate(model, torch.tensor([PROMPT]), 5, temperature=0.0)
    assert decoded == [len(PROMPT), 1, 1, 1, 1]  # the prompt once, then one token per step
    decoded.clear()
    generate(model, torch.tensor([PROMPT]), BLOCK, temperature=0.0)  # the window slides: no cache
    assert decoded == []


def test_top_k_and_top_p_mask_the_logits() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5]])  # (2, 4)
    logits = probs.log()

    def kept(top_k: int, top_p: float) -> list[list[int]]:
        finite = filter_logits(logits, top_k, top_p).isfinite()  # (2, 4)
        return [row.nonzero().flatten().tolist() for row in finite]

    assert kept(0, 1.0) == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert kept(2, 1.0) == [[0, 1], [2, 3]]
    assert kept(0, 0.4) == [[0], [3]]  # the most likely token alone already holds 0.4
    assert kept(0, 0.7) == [[0, 1], [2, 3]]
    assert kept(0, 0.9) == [[0, 1, 2], [1, 2, 3]]
    assert kept(3, 0.6) == [[0, 1], [2, 3]]  # top-k first, then the nucleus
    assert kept(1, 1.0) == [[0], [3]]


def test_top_k_one_or_a_tiny_nucleus_is_greedy() -> None:
    model = tiny("llama")
    greedy = sample_completions(model, PROMPT, 2, 12, temperature=0.0)
    generator = torch.Generator().manual_seed(0)
    assert sample_completions(model, PROMPT, 2, 12, temperature=2.0, top_k=1, generator=generator) == greedy
    assert sample_completions(model, PROMPT, 2, 12, temperature=2.0, top_p=1e-6, generator=generator) == greedy


def test_a_request_beyond_block_size_is_refused() -> None:
    model = tiny("gpt")
    with pytest.raises(ValueError, match="block_size 48"):
        sample_completions(model, PROMPT, 2, BLOCK - len(PROMPT) + 2)
    # exactly fits: the last token drawn is never fed back, so a row of block_size + 1 tokens needs no more context
    rows = sample_completions(model, PROMPT, 2, BLOCK - len(PROMPT) + 1, temperature=0.0)
    assert [len(row) for row in rows] == [BLOCK - len(PROMPT) + 1] * 2
    uncached = sample_completions(model, PROMPT, 2, BLOCK - len(PROMPT) + 1, temperature=0.0, use_cache=False)
    assert uncached == rows


def test_keep_going_runs_extra_steps_without_changing_the_tokens() -> None:
    model = tiny("moe")
    forwards: list[int] = []
    handle = model.blocks()[0].register_forward_pre_hook(lambda module, args: forwards.append(1))

    def sample(keep_going: Callable[[bool], bool] | None) -> list[list[int]]:
        generator = torch.Generator().manual_seed(9)
        return sample_completions(
            model, PROMPT, 4, 30, temperature=1.3, stop_tokens=STOPS, generator=generator, keep_going=keep_going
        )

    alone = sample(None)
    steps_alone = len(forwards)
    forwards.clear()
    told: list[bool] = []

    def always(running: bool) -> bool:  # another process still runs a row
        told.append(running)
        return True

    assert sample(always) == alone
    handle.remove()
    assert max(len(row) for row in alone) < 30 and steps_alone == max(len(row) for row in alone)
    assert len(forwards) == 30  # every step ran
    assert len(told) == 29  # after each step but the last
    assert told[steps_alone - 1 :] == [False] * (30 - steps_alone)  # this process had stopped


def test_sampling_restores_the_training_mode() -> None:
    model = tiny("gpt").train()
    sample_completions(model, PROMPT, 2, 4)
    assert model.training


def test_a_family_without_a_cache_recomputes() -> None:
    from toy_family.config import ToyConfig
    from toy_family.model import ToyLM

    torch.manual_seed(0)
    model = ToyLM(ToyConfig(vocab_size=VOCAB, block_size=BLOCK)).double()
    assert not model.supports_kv_cache
    generator = torch.Generator().manual_seed(4)
    cached = sample_completions(model, PROMPT, 3, 10, stop_tokens=STOPS, generator=generator)
    generator = torch.Generator().manual_seed(4)
    assert cached == sample_completions(model, PROMPT, 3, 10, stop_tokens=STOPS, generator=generator, use_cache=False)
    assert generate(model, torch.tensor([PROMPT]), 4, temperature=0.0).shape == (1, len(PROMPT) + 4)


def test_an_hf_model_samples_reproducibly_with_its_own_cache(tmp_path: Path) -> None:
    from hf_models import save_hf

    from bigbatch.models.hf.model import build_hf_model, read_hf_config

    save_hf("llama", tmp_path)
    model = build_hf_model(read_hf_config(tmp_path), weights=True).double()  # in training mode, as built
    fed: list[int] = []  # the tokens of each row that each forward runs, seen by the first decoder layer

    def count(module: nn.Module, args: tuple[torch.Tensor, ...], kwargs: dict[str, torch.Tensor]) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]  # (B, T, C)
        fed.append(hidden.size(1))

    model.blocks()[0].register_forward_pre_hook(count, with_kwargs=True)

    def sample(use_cache: bool) -> list[list[int]]:
        generator = torch.Generator().manual_seed(6)
        prompt = [72, 105, 33]
        return sample_completions(
            model, prompt, 4, 16, temperature=1.5, top_p=0.95, generator=generator, use_cache=use_cache
        )

    first = sample(True)
    assert fed == [3] + [1] * 15  # transformers' cache: the prompt once, then one token per step
    assert sample(True) == first
    fed.clear()
    assert sample(False) == first
    assert fed == list(range(3, 19))  # the whole context each step
    assert model.training
