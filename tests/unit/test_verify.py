"""The verifier: passes on exact models, names what breaks equivalence, reports the classic mistakes."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import verify_factories

from bigbatch.cli import main
from bigbatch.models import GPT, GPTConfig
from bigbatch.verify import check_equivalence, split_indices
from bigbatch.verify.command import token_batch


def gpt(dropout: float = 0.0) -> GPT:
    torch.manual_seed(0)
    return GPT(
        GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=verify_factories.VOCAB, dropout=dropout)
    )


def batch(samples: int, ragged: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return token_batch(samples, 24, verify_factories.VOCAB, ragged, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("k", [2, 4])
def test_builtin_gpt_is_equivalent_and_classic_mistakes_are_not(k: int) -> None:
    report = check_equivalence(gpt(), batch(2 * k, ragged=False), k=k)
    assert report.equivalent
    assert report.total_rel_diff <= 1e-5 and report.total_cosine > 1 - 1e-9
    no_norm, mean_k = report.mistakes
    # Full micro-batches: no normalization is exactly K times too large; mean / K happens to be right.
    assert no_norm.norm_ratio == pytest.approx(k, rel=1e-5)
    assert no_norm.rel_diff == pytest.approx(k - 1, rel=1e-4)
    assert mean_k.rel_diff <= 1e-5
    assert report.update_rel_diff < 1e-3


def test_ragged_batches_expose_mean_over_k() -> None:
    x, y = batch(8, ragged=True)
    y[:2, 1:] = -100  # micro-batch 0: 2 valid targets; the others far more
    report = check_equivalence(gpt(), (x, y), k=4)
    assert report.valid_counts[0] == 2 and len(set(report.valid_counts)) > 1
    assert report.equivalent
    assert report.mistakes[1].rel_diff > 0.05  # mean / K over-weights the short micro-batch


def test_batchnorm_is_named_and_fails_the_verdict() -> None:
    report = check_equivalence(verify_factories.batchnorm_lm(), batch(8, ragged=False), k=4)
    assert not report.equivalent
    assert report.total_rel_diff > 1e-3
    named = {f.module: f for f in report.findings}
    assert named["bn"].kind == "BatchNorm1d"
    assert "verdict: NOT EQUIVALENT" in report.format()
    assert "breaks equivalence: bn [BatchNorm1d]" in report.format()


def test_unknown_cross_sample_module_is_found_empirically() -> None:
    torch.manual_seed(0)
    report = check_equivalence(verify_factories.CenteredLM(), batch(8, ragged=False), k=4)
    assert not report.equivalent
    finding = next(f for f in report.findings if f.module == "center")
    assert finding.kind == "empirical" and finding.output_rel_diff is not None and finding.output_rel_diff > 1e-3
    assert all(f.module != "head" for f in report.findings)  # downstream effects are not blamed


def test_dropout_is_disabled_and_reported() -> None:
    report = check_equivalence(gpt(dropout=0.2), batch(4, ragged=True), k=2)
    assert report.equivalent
    assert "transformer.drop" in report.dropout_disabled
    assert "transformer.h.0.mlp.dropout" in report.dropout_disabled
    assert "dropout disabled for the comparison" in report.format()


def test_any_model_with_a_custom_loss() -> None:
    model, data, loss_fn = verify_factories.regression_case()
    report = check_equivalence(model, data, loss_fn=loss_fn, k=3)  # 10 samples: uneven micro-batches 4, 3, 3
    assert report.valid_counts == [4, 3, 3]
    assert report.equivalent


def test_the_callers_model_is_left_untouched() -> None:
    model = verify_factories.batchnorm_lm()
    before = copy.deepcopy(model.state_dict())
    check_equivalence(model, batch(8, ragged=False), k=4)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert all(p.grad is None for p in model.parameters())


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="k must be between 1"):
        check_equivalence(gpt(), batch(2, ragged=False), k=3)
    x, y = batch(4, ragged=False)
    with pytest.raises(ValueError, match="no valid items"):
        check_equivalence(gpt(), (x, torch.full_like(y, -100)), k=2)


def test_cli_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["verify", "--factory", "verify_factories:pico_gpt", "--k", "2", "--seq-len", "16"]) == 0
    assert "verdict: EQUIVALENT" in capsys.readouterr().out
    report_path = tmp_path / "reports" / "new" / "report.json"  # a folder that does not exist yet is made
    code = main(
        ["verify", "--factory", "verify_factories:batchnorm_lm", "--vocab-size", "50", "--json", str(report_path)]
    )
    out = capsys.readouterr().out
    assert code == 1 and "verdict: NOT EQUIVALENT" in out
    saved = json.loads(report_path.read_text())
    assert saved["equivalent"] is False and saved["findings"][0]["module"] == "bn"
    assert main(["verify", "--factory", "verify_factories:regression_case", "--k", "2"]) == 0
    capsys.readouterr()


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        ("no_such_module_xyz:f", "cannot import"),
        ("verify_factories:missing", "has no function"),
        ("verify_factories:not_a_model", "returned str"),
        ("verify_factories", "must look like"),
        ("verify_factories:batchnorm_lm", "give --vocab-size"),
    ],
)
def test_cli_bad_factory_is_a_one_line_error(factory: str, message: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["verify", "--factory", factory]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("bigbatch: error:")


def test_cli_preset_with_dropout(capsys: pytest.CaptureFixture) -> None:
    code = main(["verify", "--model", "pico", "--vocab-size", "64", "--dropout", "0.1", "--k", "2", "--seq-len", "16"])
    out = capsys.readouterr().out
    assert code == 0 and "dropout disabled" in out and "classic mistake 'mean / K'" in out


def test_fp16_report_shows_unscaled_gradients() -> None:
    fp32 = check_equivalence(gpt(), batch(4, ragged=True), k=2)
    fp16 = check_equivalence(gpt(), batch(4, ragged=True), k=2, precision="fp16")
    assert fp16.equivalent and fp16.tolerance == 1e-2
    full32 = {p.name: p.full_norm for p in fp32.params}
    for p in fp16.params:  # true magnitudes, not multiplied by the 65,536 loss scale
        assert p.full_norm == pytest.approx(full32[p.name], rel=0.05, abs=1e-4)


# --- What the verifier must not be fooled by (issue 10, holes 1-4) ---


def test_split_indices_cover_every_sample_once() -> None:
    for samples in range(1, 23):
        for k in range(1, samples + 1):
            for name in ("equal", "unequal", "permuted"):
                pieces = split_indices(samples, k, name, seed=3)
                assert sorted(torch.cat(pieces).tolist()) == list(range(samples)), (samples, k, name)
                assert all(p.numel() > 0 for p in pieces)
    assert [p.numel() for p in split_indices(8, 4, "unequal")] == [1, 2, 3, 2]
    assert torch.cat(split_indices(8, 4, "permuted")).tolist() != list(range(8))


def test_instance_norm_with_running_stats_is_not_equivalent() -> None:
    report = check_equivalence(verify_factories.instance_norm_lm(), batch(8, ragged=False), k=4)
    assert report.total_rel_diff <= report.tolerance  # the gradient is exact: only the statistics differ
    assert not report.equivalent
    assert any(f.module == "norm" and f.kind == "InstanceNorm1d" for f in report.findings)
    differing = {b.name for b in report.splits[0].buffers}
    assert {"norm.running_mean", "norm.running_var"} <= differing
    assert "buffer norm.running_mean differs after the step" in "\n".join(report.reasons)
    assert "verdict: NOT EQUIVALENT" in report.format()


def test_batch_coupled_type_fails_the_verdict_below_the_tolerance() -> None:
    report = check_equivalence(
        verify_factories.scaled_branch_batchnorm_lm(), batch(8, ragged=False), k=4, precision="bf16"
    )
    assert all(s.total_rel_diff < report.tolerance for s in report.splits)  # hidden under the bf16 tolerance
    assert not report.equivalent
    assert any("bn [BatchNorm1d]" in reason for reason in report.reasons)


def test_a_buffer_that_differs_fails_the_verdict_and_is_named() -> None:
    report = check_equivalence(verify_factories.tracked_lm(), batch(8, ragged=False), k=4)
    assert all(s.gradient_matches for s in report.splits)
    assert not report.equivalent
    assert [b.name for b in report.splits[0].buffers] == ["tracker.ema"]
    finding = next(f for f in report.findings if f.module == "tracker")
    assert finding.kind == "buffer" and "tracker.ema" in finding.detail
    assert report.buffers_compared == 1


def test_equal_splits_alone_miss_an_adjacent_pair_mixer_and_the_default_splits_find_it() -> None:
    aligned = check_equivalence(verify_factories.pair_mix_lm(), batch(8, ragged=False), k=4, splits=["equal"])
    assert aligned.equivalent  # pairs (0,1), (2,3), ... never straddle an equal split of 2s
    report = check_equivalence(verify_factories.pair_mix_lm(), batch(8, ragged=False), k=4)
    assert not report.equivalent
    by_name = {s.name: s for s in report.splits}
    assert by_name["equal"].gradient_matches
    assert not by_name["unequal"].gradient_matches and not by_name["permuted"].gradient_matches
    mix = next(f for f in report.findings if f.module == "mix")
    assert mix.kind == "empirical" and mix.split == "unequal"
    assert {f.module for f in report.findings} == {"mix"}  # not the head or emb downstream/upstream of it
    assert "under the unequal split [1, 2, 3, 2]" in "\n".join(report.reasons)


def test_a_non_leaf_module_that_mixes_in_its_own_forward_is_named() -> None:
    report = check_equivalence(verify_factories.neighbour_lm(), batch(8, ragged=False), k=4)
    assert not report.equivalent
    assert {f.module for f in report.findings} == {"block"}  # not block.proj / block.norm, nor the root


def test_mixing_in_the_roots_own_forward_is_attributed_to_the_model() -> None:
    report = check_equivalence(verify_factories.root_mix_lm(), batch(8, ragged=False), k=4)
    assert not report.equivalent
    (finding,) = report.findings
    assert finding.module == "<model>" and "model's own forward" in finding.detail


def test_a_loss_that_couples_samples_is_named() -> None:
    model, data, loss_fn = verify_factories.contrastive_case()
    report = check_equivalence(model, data, loss_fn=loss_fn, k=4)
    assert not report.equivalent
    (finding,) = report.findings
    assert finding.module == "<loss>" and "the loss function couples samples" in finding.detail


def test_a_model_that_cannot_run_on_one_sample_is_reported_not_raised() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    x, y = torch.randn(8, 4), torch.randn(8, 1)

    def loss_fn(m: torch.nn.Module, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, int]:
        return ((m(a) - b) ** 2).sum(), a.shape[0]

    report = check_equivalence(model, (x, y), loss_fn=loss_fn, k=4)
    unequal = next(s for s in report.splits if s.name == "unequal")
    assert unequal.error is not None and "value per channel" in unequal.error
    assert not report.equivalent and "the model fails on the micro-batches of the unequal split" in report.format()


def test_exact_models_pass_every_split() -> None:
    report = check_equivalence(gpt(), batch(9, ragged=True), k=3)
    assert [s.name for s in report.splits] == ["equal", "unequal", "permuted"]
    assert report.equivalent and not report.findings and not report.reasons
    assert all(s.total_rel_diff <= 1e-5 for s in report.splits)


def test_unknown_split_is_a_clear_error(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(ValueError, match="splits must be one or more of equal, unequal, permuted"):
        check_equivalence(gpt(), batch(4, ragged=False), k=2, splits=["diagonal"])
    assert (
        main(["verify", "--factory", "verify_factories:pico_gpt", "--k", "2", "--seq-len", "8", "--splits", "x"]) == 2
    )
    assert "splits must be one or more of" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("factory", "splits", "expected_code", "named"),
    [
        ("instance_norm_lm", "equal,unequal,permuted", 1, "norm [InstanceNorm1d]"),
        ("pair_mix_lm", "equal", 0, None),
        ("pair_mix_lm", "equal,unequal,permuted", 1, "mix [empirical]"),
        ("neighbour_lm", "equal,unequal,permuted", 1, "block [empirical]"),
        ("contrastive_case", "equal,unequal,permuted", 1, "<loss> [loss]"),
    ],
)
def test_cli_verdicts(
    factory: str, splits: str, expected_code: int, named: str | None, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    report_path = tmp_path / "report.json"
    argv = [
        "verify",
        "--factory",
        f"verify_factories:{factory}",
        "--vocab-size",
        "50",
        "--seq-len",
        "12",
        "--splits",
        splits,
        "--json",
        str(report_path),
    ]
    assert main(argv) == expected_code
    out = capsys.readouterr().out
    saved = json.loads(report_path.read_text())
    assert saved["equivalent"] is (expected_code == 0)
    assert [s["name"] for s in saved["splits"]] == splits.split(",")
    if named:
        assert f"breaks equivalence: {named}" in out and saved["reasons"]


@pytest.mark.slow
def test_distributed_verify_scans_modules_and_buffers() -> None:
    import os
    import subprocess
    import sys

    from launch import support_pythonpath

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": support_pythonpath()}
    command = [
        sys.executable,
        "-m",
        "bigbatch",
        "verify",
        "--nproc",
        "2",
        "--factory",
        "verify_factories:tracked_lm",
        "--vocab-size",
        "50",
        "--k",
        "2",
        "--seq-len",
        "8",
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "rank 0: tracker.ema" in done.stdout and "rank 1: tracker.ema" in done.stdout
    assert "verdict: NOT EQUIVALENT" in done.stdout
    command[command.index("verify_factories:tracked_lm")] = "verify_factories:batchnorm_lm"
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "breaks equivalence: bn [BatchNorm1d]" in done.stdout, done.stdout + done.stderr


def test_verification_leaves_the_callers_generators_alone() -> None:
    import random

    import numpy as np

    from bigbatch.engine.rng import capture_rng_state

    model, data = gpt(dropout=0.1), batch(4, ragged=True)
    torch.manual_seed(77)
    random.seed(77)
    np.random.seed(77)
    before = capture_rng_state()
    check_equivalence(model, data, k=2, seed=5)
    after = capture_rng_state()
    assert torch.equal(before["torch"], after["torch"])
    assert torch.equal(before["python_state"], after["python_state"])
    assert torch.equal(before["numpy_keys"], after["numpy_keys"]) and before["numpy_pos"] == after["numpy_pos"]


def test_packed_rows_give_the_gradient_of_one_document_per_row(capsys: pytest.CaptureFixture) -> None:
    assert (
        main(
            [
                "verify",
                "--factory",
                "verify_factories:pico_gpt",
                "--k",
                "2",
                "--seq-len",
                "24",
                "--packed",
                "--splits",
                "equal",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "packed rows vs the same documents one per row: relative L2 difference" in out
    assert "verdict: EQUIVALENT" in out


def test_attention_that_crosses_documents_is_caught_by_the_packed_check(monkeypatch: pytest.MonkeyPatch) -> None:
    import bigbatch.models.gpt.model as gpt_module
    from bigbatch.verify.packed_batch import packed_documents

    monkeypatch.setattr(gpt_module, "document_causal_mask", lambda positions: None)  # plain causal: rows mix
    packed, unpacked = packed_documents(4, 24, verify_factories.VOCAB, torch.Generator().manual_seed(0))
    report = check_equivalence(gpt(), packed, k=2, splits=["equal"], unpacked=unpacked)
    assert report.packing_rel_diff is not None and report.packing_rel_diff > 1e-3
    assert not report.equivalent
    assert any("cross document boundaries" in reason for reason in report.reasons)
    assert report.total_rel_diff <= 1e-5  # accumulation itself stays exact: only packing is wrong


def test_packed_documents_are_the_loaders_rows_of_the_same_documents_one_per_row() -> None:
    from bigbatch.verify.packed_batch import START, packed_documents, position_mismatch

    (inputs, targets, positions), (one_inputs, one_targets) = packed_documents(
        6, 32, 50, torch.Generator().manual_seed(1)
    )
    assert inputs.shape == targets.shape == positions.shape == (6, 32)
    packed = []  # cut the loader's rows where each document starts: its positions count 0, 1, ... from there
    for row in range(inputs.shape[0]):
        starts = [int(i) for i in torch.nonzero(inputs[row] == START).flatten()]
        ends = [*starts[1:], int((inputs[row] != 0).sum())]  # the documents come first, the padding (0) after
        assert (inputs[row, ends[-1] :] == 0).all() and (targets[row, ends[-1] :] == -100).all()
        for start, stop in zip(starts, ends, strict=True):
            assert torch.equal(positions[row, start:stop], torch.arange(stop - start))
            packed.append((tuple(inputs[row, start:stop].tolist()), tuple(targets[row, start:stop].tolist())))
    alone = []
    for index in range(one_inputs.shape[0]):
        n = int((one_inputs[index] != 0).sum())
        assert one_inputs[index, 0] == START and (one_targets[index, n:] == -100).all()
        alone.append((tuple(one_inputs[index, :n].tolist()), tuple(one_targets[index, :n].tolist())))
    assert len(alone) > 6 and sorted(packed) == sorted(alone)  # the same documents, packed several to a row
    assert position_mismatch(inputs, positions) is None


def test_positions_are_checked_against_the_document_boundaries() -> None:
    from bigbatch.verify.packed_batch import position_mismatch

    inputs = torch.tensor([[1, 5, 6, 1, 7, 0, 0], [1, 8, 9, 9, 0, 0, 0]])
    right = torch.tensor([[0, 1, 2, 0, 1, 0, 1], [0, 1, 2, 3, 0, 1, 2]])
    assert position_mismatch(inputs, right) is None
    assert position_mismatch(inputs, torch.arange(7).expand_as(inputs)) == (
        "row 0, column 3: the loader gives position 3, the document boundaries give 0 (its document starts at column 3)"
    )
    cut = torch.tensor([[6, 1, 5, 0, 0, 0, 0]])  # a document token before any document's first
    assert position_mismatch(cut, torch.tensor([[0, 0, 1, 0, 1, 2, 3]])) == (
        "row 0, column 0 holds a document token before any document starts"
    )


PACKED_VERIFY = ["verify", "--factory", "verify_factories:pico_gpt", "--k", "2", "--seq-len", "24", "--packed"]


def test_verify_packed_catches_a_loader_whose_positions_count_along_the_row(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    """A planted bug in the training loader: packed rows whose positions run 0..T-1 along the row instead of
    restarting at each document. Every split shares it, so accumulation stays exact: only --packed, reading the
    rows through the loader, can see it."""
    from bigbatch.data.documents import DocumentLoader
    from bigbatch.engine.batch import MicroBatch

    read_rows = DocumentLoader._read_rows

    def along_the_row(self: DocumentLoader, rows: list[int]) -> MicroBatch:
        batch = read_rows(self, rows)
        positions = torch.arange(self.seq_len).expand_as(batch.inputs).clone()
        return MicroBatch(batch.inputs, batch.targets, positions, batch.padding)

    monkeypatch.setattr(DocumentLoader, "_read_rows", along_the_row)
    json_path = tmp_path / "report.json"
    assert main([*PACKED_VERIFY, "--splits", "equal", "--json", str(json_path)]) == 1
    out = capsys.readouterr().out
    reasons = [line.strip() for line in out.splitlines() if line.startswith("  because ")]
    assert reasons[0] == (
        "because the training loader's positions do not restart at each document: row 0, column 11: the loader "
        "gives position 11, the document boundaries give 0 (its document starts at column 11)"
    )
    assert "packed rows give another gradient than the same documents one per row" in reasons[1]
    report = json.loads(json_path.read_text())
    assert report["equivalent"] is False and report["packing_rel_diff"] > 1e-2
    assert report["total_rel_diff"] <= 1e-5  # every split shares the bug: accumulation alone cannot show it


def test_verify_packed_catches_a_loader_that_loses_targets(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from bigbatch.data.documents import DocumentLoader
    from bigbatch.engine.batch import MicroBatch

    read_rows = DocumentLoader._read_rows

    def losing_one(self: DocumentLoader, rows: list[int]) -> MicroBatch:
        batch = read_rows(self, rows)
        targets = batch.targets.clone()
        targets[0, (targets[0] != -100).nonzero()[0]] = -100  # the first trained target of row 0
        return MicroBatch(batch.inputs, targets, batch.positions, batch.padding)

    monkeypatch.setattr(DocumentLoader, "_read_rows", losing_one)
    assert main([*PACKED_VERIFY, "--splits", "equal"]) == 1
    out = capsys.readouterr().out
    assert "because the packed rows hold 38 valid targets, the same documents one per row 39" in out
