from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import mean_loss
from tiny import VOCAB, random_batch

from bigbatch.errors import ConfigError
from bigbatch.models import GPT, GPTConfig, pad_vocab, preset


def test_vocab_is_padded_but_logits_are_not(tiny_model: GPT) -> None:
    assert pad_vocab(50257) == 50304
    assert pad_vocab(256) == 256
    assert tiny_model.transformer.wte.weight.shape[0] == 64
    x, _ = random_batch(3, 16)
    logits = tiny_model(x)
    assert logits.shape == (3, 16, VOCAB)


def test_lm_head_is_tied_to_token_embedding(tiny_model: GPT) -> None:
    assert tiny_model.lm_head.weight is tiny_model.transformer.wte.weight
    n_unique = sum(p.numel() for p in tiny_model.parameters())
    assert tiny_model.num_params(non_embedding=False) == n_unique


def test_init_scales_residual_projections() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=8, n_head=4, n_embd=256, block_size=64, vocab_size=512))
    proj_std = model.transformer.h[0].attn.c_proj.weight.std().item()
    fc_std = model.transformer.h[0].mlp.c_fc.weight.std().item()
    assert fc_std == pytest.approx(0.02, rel=0.05)
    assert proj_std == pytest.approx(0.02 / math.sqrt(2 * 8), rel=0.05)
    assert torch.all(model.transformer.h[0].attn.c_attn.bias == 0)


def test_loss_is_mean_over_non_ignored_targets(tiny_model: GPT) -> None:
    x, y = random_batch(4, 16)
    y[0, :10] = -100
    y[2, :] = -100
    loss = mean_loss(tiny_model, x, y)  # bigbatch's one loss definition: a sum over valid targets, here / count
    logits = tiny_model(x)
    keep = y != -100
    manual = F.cross_entropy(logits[keep], y[keep])
    torch.testing.assert_close(loss, manual)


def test_causal_attention_ignores_future_tokens(tiny_model: GPT) -> None:
    tiny_model.eval()
    x, _ = random_batch(1, 16)
    changed = x.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % VOCAB
    a = tiny_model(x)
    b = tiny_model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_sequence_longer_than_block_size_is_refused(tiny_model: GPT) -> None:
    x, _ = random_batch(1, 33)
    with pytest.raises(ValueError, match="block_size"):
        tiny_model(x)


def test_gpt2_preset_parameter_count() -> None:
    with torch.device("meta"):
        model = GPT(preset("gpt2"))
    # GPT-2 small has 124,439,808 parameters at vocabulary 50257; padding adds 47 rows of 768.
    assert model.num_params(non_embedding=False) == 124_439_808 + 47 * 768
    assert model.num_params() == 124_439_808 + 47 * 768 - 1024 * 768


def test_flops_per_token_formula(tiny_config: GPTConfig) -> None:
    model = GPT(tiny_config)
    n = model.num_params(non_embedding=True)
    # 6N for the matmuls forward + backward, 12 * L * H * Q * T for attention scores and values.
    assert model.flops_per_token(seq_len=32) == 6 * n + 12 * 2 * 2 * 16 * 32


def test_presets_and_config_validation() -> None:
    assert preset("nano").n_layer == 4 and preset("nano").n_embd == 128
    assert preset("gpt2-xl").n_embd == 1600
    assert preset("nano", vocab_size=256).vocab_size == 256
    with pytest.raises(ConfigError, match="unknown model preset"):
        preset("gpt5")
    with pytest.raises(ConfigError, match="not divisible by n_head"):
        GPTConfig(n_embd=100, n_head=3)
