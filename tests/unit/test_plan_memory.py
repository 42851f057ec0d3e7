"""Planning, measured memory, automatic micro-batch, activation checkpointing and MFU."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import mean_loss

from bigbatch.cli import main
from bigbatch.errors import ConfigError, PlanError
from bigbatch.models import GPT, GPTConfig, preset
from bigbatch.observe.metrics import device_peak_flops, mfu
from bigbatch.sizing.autobatch import (
    candidate_micro_batches,
    choose_micro_batch,
    largest_fitting,
)
from bigbatch.sizing.memory import estimate_memory, linear_fit, measure
from bigbatch.sizing.plan import parse_count, solve_plan


@pytest.mark.parametrize(
    ("tokens", "seq_len", "devices", "micro_batch", "k", "total"),
    [
        ("2M", 4096, 8, 16, 4, 2_097_152),  # 488.3 sequences rounded up to 512
        ("4M", 4096, 32, 8, 4, 4_194_304),
        ("524288", 1024, 1, 16, 32, 524_288),
        ("524288", 1024, 8, 16, 4, 524_288),
    ],
)
def test_plan_examples(tokens: str, seq_len: int, devices: int, micro_batch: int, k: int, total: int) -> None:
    solved = solve_plan(seq_len, parse_count(tokens), micro_batch=micro_batch, world_size=devices)
    assert solved.plan.accumulation_steps == k and solved.plan.tokens_per_step == total
    assert solved.rounded == (total != parse_count(tokens))


def test_plan_solves_for_micro_batch_or_devices() -> None:
    assert solve_plan(1024, 524_288, accumulation_steps=4, world_size=8).plan.micro_batch == 16
    assert solve_plan(1024, 524_288, micro_batch=16, accumulation_steps=4).plan.world_size == 8
    assert solve_plan(1024, None, micro_batch=16, accumulation_steps=2).plan.tokens_per_step == 32_768


def test_plan_errors_say_what_is_missing_or_inconsistent() -> None:
    with pytest.raises(
        PlanError, match=r"give all but one of --micro-batch, --k and --devices \(missing: --micro-batch, --k;"
    ):
        solve_plan(1024, 524_288, world_size=8)
    with pytest.raises(PlanError, match="not 524,288; leave one of them out"):
        solve_plan(1024, 524_288, micro_batch=16, accumulation_steps=3, world_size=8)
    with pytest.raises(PlanError, match="is not a count"):
        parse_count("two million")


def test_parse_count_suffixes() -> None:
    assert parse_count("2M") == 2_000_000 and parse_count("512Ki") == 524_288 and parse_count("0.5Mi") == 524_288
    assert parse_count("524_288") == 524_288 and parse_count("1,024") == 1024


def test_plan_cli_prints_the_table(capsys: pytest.CaptureFixture) -> None:
    code = main(
        [
            "plan",
            "--tokens-per-step",
            "2Mi",
            "--seq-len",
            "4096",
            "--devices",
            "8",
            "--micro-batch",
            "16",
            "--model",
            "gpt2",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "accumulation steps (K)" in out and out.split("accumulation steps (K)")[1].split()[0] == "4"
    assert "2,097,152" in out and "rounded" not in out and "AdamW state" in out


def test_plan_cli_refuses_a_budget_that_does_not_divide_and_names_both_neighbours(
    capsys: pytest.CaptureFixture,
) -> None:
    """2M is 2,000,000: no whole K at 4 x 32,768 tokens; the plan that rounds lives on only for --from-run."""
    code = main(["plan", "--tokens-per-step", "2M", "--micro-batch", "4", "--seq-len", "32768"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert captured.err == (
        "bigbatch: error: --tokens-per-step 2,000,000 is not a multiple of the 131,072 tokens each increment of K "
        "adds, so K would not be whole; the nearest that are: 1,966,080 (K 15) or 2,097,152 = 2Mi (K 16)\n"
    )
    with pytest.raises(PlanError, match=r"896 \(micro-batch 7\) or 1,024 = 1Ki \(micro-batch 8\)"):
        solve_plan(32, 1000, accumulation_steps=4, exact=True)
    with pytest.raises(PlanError, match=r"the nearest that are: 2,048 = 2Ki \(devices 1\)$"):
        solve_plan(32, 1000, micro_batch=16, accumulation_steps=4, exact=True)  # never zero devices
    assert solve_plan(32, 1024, accumulation_steps=4, exact=True).plan.micro_batch == 8


def test_memory_estimate_counts_parameters_exactly() -> None:
    config = preset("gpt2")
    estimate = estimate_memory(config, micro_batch=1, seq_len=1024)
    n = 124_439_808 + 47 * 768  # GPT-2 small with the padded vocabulary
    assert (estimate.params, estimate.grads, estimate.optimizer) == (4 * n, 4 * n, 8 * n)


@pytest.fixture(scope="module")
def measured_rows() -> list:
    config = preset("nano", vocab_size=256)
    return [measure(config, b, 128, k=8) for b in (1, 2, 4)]


@pytest.mark.slow
def test_measured_memory_is_monotone_linear_and_flat_in_k(measured_rows: list) -> None:
    forward = [r.forward_peak for r in measured_rows]
    assert forward[0] < forward[1] < forward[2]
    _, _, worst = linear_fit([r.micro_batch for r in measured_rows], forward)
    assert worst < 0.1
    for r in measured_rows:
        assert r.fixed == measured_rows[0].fixed  # parameters + AdamW state do not depend on the micro-batch
        assert abs(r.step_peak_k - r.step_peak_k2) <= 0.1 * r.step_peak_k2  # K = 8 costs what K = 2 costs
    estimate = estimate_memory(preset("nano", vocab_size=256), 4, 128).activations
    assert 0.7 < measured_rows[2].forward_peak / estimate < 1.3


@pytest.mark.slow
def test_memory_cli_writes_a_plot(tmp_path: object, capsys: pytest.CaptureFixture) -> None:
    from pathlib import Path

    plot = Path(str(tmp_path)) / "memory.png"
    code = main(
        ["memory", "--model", "pico", "--seq-len", "32", "--max-micro-batch", "2", "--k", "2", "--plot", str(plot)]
    )
    out = capsys.readouterr().out
    assert code == 0 and "activations grow linearly" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_auto_micro_batch_candidates_divide_and_search_finds_the_largest() -> None:
    candidates = candidate_micro_batches(16_384, 128, 1)
    assert candidates == [1, 2, 4, 8, 16, 32, 64, 128]
    assert all(16_384 % (b * 128) == 0 for b in candidates)
    probed: list[int] = []

    def fits(b: int) -> bool:
        probed.append(b)
        return b <= 16

    assert largest_fitting(candidates, fits) == 16 and len(probed) <= 5  # a binary search, not a scan
    with pytest.raises(ConfigError, match="even micro_batch 1 does not fit"):
        largest_fitting(candidates, lambda b: False)
    with pytest.raises(ConfigError, match="not a whole number of sequences"):
        candidate_micro_batches(1000, 128, 1)


@pytest.mark.slow
def test_auto_micro_batch_respects_a_cpu_memory_budget(measured_rows: list) -> None:
    config = preset("nano", vocab_size=256)
    need = {r.micro_batch: (r.fixed + max(r.backward_peak, r.step_peak_k2)) / 2**20 for r in measured_rows}
    budget = (need[2] + need[4]) / 2  # 2 fits, 4 does not
    chosen = choose_micro_batch(
        config, [1, 2, 4, 8], 128, k=2, device=torch.device("cpu"), precision="fp32", memory_budget_mib=budget
    )
    assert chosen == 2
    with pytest.raises(ConfigError, match="needs --memory-budget"):
        choose_micro_batch(config, [1, 2], 128, k=2, device=torch.device("cpu"), precision="fp32", memory_budget_mib=0)


def test_activation_checkpointing_leaves_gradients_unchanged() -> None:
    torch.manual_seed(0)
    plain = GPT(GPTConfig(n_layer=3, n_head=2, n_embd=32, block_size=32, vocab_size=61))
    recomputed = copy.deepcopy(plain)
    recomputed.activation_checkpointing = True
    x = torch.randint(0, 61, (4, 32))
    for model in (plain, recomputed):
        loss = mean_loss(model, x, x)
        loss.backward()
    for (name, a), b in zip(plain.named_parameters(), recomputed.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-9, msg=name)


@pytest.mark.slow
def test_activation_checkpointing_saves_measured_memory() -> None:
    config = preset("nano", vocab_size=256)
    plain = measure(config, 4, 128, k=2)
    checkpointed = measure(config, 4, 128, k=2, activation_checkpointing=True)
    assert checkpointed.forward_peak < 0.7 * plain.forward_peak


def test_mfu_arithmetic() -> None:
    assert mfu(flops_per_token=1e9, tokens_per_s=1e5, peak_flops_per_device=1e15) == pytest.approx(0.1)
    assert mfu(1e9, 1e5, 1e15, world_size=2) == pytest.approx(0.05)
    assert device_peak_flops("NVIDIA H200") == 989e12 and device_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert device_peak_flops("cpu") is None
    with torch.device("meta"):
        gpt2 = GPT(preset("gpt2"))
    # GPT-2 small at T=1024: 6 x 123,689,472 (no position table) + 12 x 12 x 12 x 64 x 1024 = 855.4 MFLOP/token
    assert gpt2.flops_per_token(1024) == 6 * 123_689_472 + 12 * 12 * 12 * 64 * 1024


def test_train_logs_mfu_with_a_peak_and_auto_needs_a_budget(tmp_path: object, capsys: pytest.CaptureFixture) -> None:
    from pathlib import Path

    base = Path(str(tmp_path))
    corpus = base / "c.txt"
    corpus.write_text("a quick brown fox jumps over the lazy dog. " * 300)
    args = [
        "train",
        "--data",
        str(corpus),
        "--model",
        "pico",
        "--seq-len",
        "32",
        "--total-batch-tokens",
        "256",
        "--max-steps",
        "2",
        "--eval-every",
        "0",
        "--sample-tokens",
        "0",
        "--cache-dir",
        str(base / "cache"),
    ]
    assert main([*args, "--micro-batch", "4", "--peak-flops", "1e12", "--out", str(base / "a")]) == 0
    assert "| mfu " in capsys.readouterr().out
    assert main([*args, "--micro-batch", "auto", "--out", str(base / "b")]) == 2
    assert "needs --memory-budget" in capsys.readouterr().err
