"""The verifier: passes on exact models, names what breaks equivalence, reports the classic mistakes."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import verify_factories

from bigbatch.cli import main
from bigbatch.model import GPT, GPTConfig
from bigbatch.verify import check_equivalence
from bigbatch.verify_cli import token_batch


def gpt(dropout: float = 0.0) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=verify_factories.VOCAB, dropout=dropout))


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
    report_path = tmp_path / "report.json"
    code = main(["verify", "--factory", "verify_factories:batchnorm_lm", "--vocab-size", "50", "--json", str(report_path)])
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
