"""Memory of a Llama: the shapes-only estimate (SwiGLU, grouped-query k/v, RMSNorm, no position table), measured
against the real thing; plan and memory with Llama presets; --micro-batch auto for a Llama."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bigbatch.cli import main
from bigbatch.models import llama_preset, model_preset
from bigbatch.models.llama.family import layer_bytes_per_token as llama_layer_bytes_per_token
from bigbatch.sizing.autobatch import choose_micro_batch
from bigbatch.sizing.memory import estimate_memory, measure


def test_estimate_counts_parameters_exactly() -> None:
    config = llama_preset("llama3.2-1b")
    estimate = estimate_memory(config, micro_batch=1, seq_len=1024)
    n = 1_235_814_400  # Meta's Llama 3.2 1B: tied embedding of 128,256 x 2,048, 16 layers, no biases
    assert (estimate.params, estimate.grads, estimate.optimizer) == (4 * n, 4 * n, 8 * n)


def test_activation_estimate_counts_the_llama_layer_by_hand() -> None:
    """llama-nano (C 128, 2 of 4 heads for k/v, so kv 64, ffn 352), fp32, one token, vocabulary 256."""
    config = llama_preset("llama-nano", vocab_size=256)
    c, ffn = 128, 352
    norms = 2 * (2 * c * 4 + c * 4)  # per RMSNorm: its fp32 input and normalised vector, and its output
    attention = (c + 2 * c + c + c) * 4  # queries, keys and values repeated to 4 heads, output, o_proj's input
    mlp = 4 * ffn * 4  # gate, SiLU, up, product
    assert llama_layer_bytes_per_token(config, 4) == norms + attention + mlp
    head = c * 4 + 256 * c * 4 + 256 * 4  # chunked loss: the row's gradient, the head's, a chunk of logits
    assert estimate_memory(config, 1, 1).activations == 4 * (norms + attention + mlp) + head
    logits = 2 * 256 * 4  # the whole logits: fp32 logits and the log-softmax saved for backward
    assert estimate_memory(config, 1, 1, chunked_loss=False).activations == 4 * (norms + attention + mlp) + logits
    # bf16: the residual stream and the norms' statistics stay fp32, the rest halves
    assert llama_layer_bytes_per_token(config, 2) == 2 * (2 * c * 4 + c * 2) + (attention + mlp) // 2
    # Without grouping keys and values are kv wide themselves (no copy repeated to every head)
    mha = llama_preset("llama-nano", n_kv_head=4, vocab_size=256)
    assert llama_layer_bytes_per_token(mha, 4) == llama_layer_bytes_per_token(config, 4)  # kv = C: same count
    mqa = llama_preset("llama-nano", n_kv_head=1, vocab_size=256)
    assert llama_layer_bytes_per_token(mqa, 4) == llama_layer_bytes_per_token(config, 4)  # repeated: C wide


@pytest.mark.slow
def test_estimate_is_within_ten_percent_of_the_measured_forward_peak() -> None:
    """On CPU in fp32 (a fresh process per size, see bigbatch/sizing/memory.py), llama-nano at 2 and 4 sequences of 128."""
    config = llama_preset("llama-nano", vocab_size=256)
    for micro_batch in (2, 4):
        measured = measure(config, micro_batch, 128, k=2).forward_peak
        estimate = estimate_memory(config, micro_batch, 128).activations
        assert 0.9 < measured / estimate < 1.1, (micro_batch, measured, estimate)


def test_plan_with_the_llama_1b_preset_derives_k_and_its_memory(capsys: pytest.CaptureFixture) -> None:
    code = main(
        [
            "plan",
            "--tokens-per-step",
            "2097152",
            "--seq-len",
            "4096",
            "--devices",
            "8",
            "--micro-batch",
            "8",
            "--model",
            "llama3.2-1b",
            "--precision",
            "bf16",
            "--device",
            "cpu",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert out.split("accumulation steps (K)")[1].split()[0] == "8"
    assert "model llama3.2-1b" in out and "1,235.81M parameters" in out and "activations per micro-batch (bf16" in out


def test_plan_seq_len_auto_is_the_llama_presets_block_size(capsys: pytest.CaptureFixture) -> None:
    code = main(
        ["plan", "--tokens-per-step", "16384", "--micro-batch", "16", "--model", "llama-nano", "--device", "cpu"]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith("seq_len 256 (the llama-nano model's block size)")
    assert out.split("accumulation steps (K)")[1].split()[0] == "4"


@pytest.mark.slow
def test_memory_cli_measures_a_llama_preset(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code = main(
        ["memory", "--model", "llama-pico", "--seq-len", "32", "--max-micro-batch", "2", "--k", "2", "--device", "cpu"]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith("llama-pico | vocab 50,257 | seq_len 32 | fp32 | cpu") and "activations grow linearly" in out


@pytest.mark.slow
def test_auto_micro_batch_measures_a_llama() -> None:
    """The CPU probe process builds the Llama from its family and shape: a budget between what 2 and 4 sequences
    need picks 2."""
    config = model_preset("llama-nano", vocab_size=256)
    rows = {b: measure(config, b, 128, k=2) for b in (2, 4)}
    need = {b: (r.fixed + max(r.backward_peak, r.step_peak_k2)) / 2**20 for b, r in rows.items()}
    chosen = choose_micro_batch(
        config,
        [1, 2, 4, 8],
        128,
        k=2,
        device=torch.device("cpu"),
        precision="fp32",
        memory_budget_mib=(need[2] + need[4]) / 2,
    )
    assert chosen == 2
