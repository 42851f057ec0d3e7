"""Streaming generation: the same tokens as the batch path, and text printed piece by piece."""

from __future__ import annotations

import pytest
import torch

from bigbatch.data.tokenizers import get_tokenizer
from bigbatch.models import GPT, GPTConfig
from bigbatch.models.sampling import decoded_pieces, generate, generate_stream


@pytest.fixture(scope="module")
def model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=256))


@pytest.mark.parametrize(("temperature", "top_k"), [(0.0, None), (1.0, None), (0.8, 10)])
def test_stream_matches_generate(model: GPT, temperature: float, top_k: int | None) -> None:
    prompt = torch.tensor([[65, 66, 67]])
    n = 25  # beyond block_size: the context window slides
    batch = generate(model, prompt, n, temperature, top_k, generator=torch.Generator().manual_seed(7))
    stream = list(generate_stream(model, prompt, n, temperature, top_k, generator=torch.Generator().manual_seed(7)))
    assert len(stream) == n
    assert stream == batch[0, 3:].tolist()


def test_stream_restores_training_mode(model: GPT) -> None:
    model.train()
    tokens = generate_stream(model, torch.tensor([[1]]), 3, 0.0)
    next(tokens)
    assert not model.training
    tokens.close()  # stopped early
    assert model.training
    assert len(list(generate_stream(model, torch.tensor([[1]]), 4, 0.0))) == 4
    assert model.training


def test_stream_takes_one_sequence(model: GPT) -> None:
    with pytest.raises(ValueError, match="one sequence"):
        next(generate_stream(model, torch.zeros(2, 3, dtype=torch.long), 1))


def test_decoded_pieces_hold_back_incomplete_utf8() -> None:
    tokenizer = get_tokenizer("byte")
    ids = list("héllo €!".encode())
    pieces = list(decoded_pieces(iter(ids), tokenizer.decode))
    assert "".join(pieces) == tokenizer.decode(ids) == "héllo €!"
    assert all("\ufffd" not in piece for piece in pieces)
    assert "é" in pieces and "€" in pieces  # each multi-byte character comes out whole, at once


def test_decoded_pieces_flush_an_incomplete_end() -> None:
    tokenizer = get_tokenizer("byte")
    ids = [*b"ab", 0xE2, 0x82]  # the start of a 3-byte character, never completed
    pieces = list(decoded_pieces(iter(ids), tokenizer.decode))
    assert pieces[-1].endswith("\ufffd")  # released at the end
    assert "".join(pieces) == tokenizer.decode(ids)
    assert list(decoded_pieces(iter([]), tokenizer.decode)) == []
