"""``bigbatch verify --objective grpo``: each term of the reward objective (policy under ppo and cispo, kl, entropy)
under each loss aggregation and every split of the step's completions equals the one micro-batch's; bad settings are
one line; an aggregation normalised per micro-batch is caught and named with its term and split."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from bigbatch.cli.app import main
from bigbatch.engine.policy_gradient import LOSS_AGGREGATIONS, RewardObjective
from bigbatch.verify.objective_terms import SPLITS
from bigbatch.verify.rollout_terms import WHOLE, check_rollout_terms

# pico at a vocabulary of 256 in rows of 32: the same arithmetic as GPT-2's vocabulary, a fifth of the time
FAST = ("--model", "pico", "--vocab-size", "256", "--seq-len", "32")
TERMS = ("policy(ppo)", "kl", "entropy", "policy(cispo)")


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # these models are too small to gain from two threads on a shared machine
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("isolated")
def test_every_aggregation_term_and_split_is_equivalent_and_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "reports" / "grpo.json"
    assert main(["verify", "--objective", "grpo", *FAST, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    for mode in LOSS_AGGREGATIONS:
        for term in TERMS:
            for split in (*SPLITS, WHOLE):
                line = rf"\n  {re.escape(mode)}\s+term {re.escape(term)}\s+split {split}\s+rel L2 \S+  ok\n"
                assert re.search(line, printed), (mode, term, split)
        assert re.search(rf"{re.escape(mode)}\s+negative control .* differs, as it must", printed), mode
    assert "BROKEN" not in printed and printed.rstrip().endswith("verdict: EQUIVALENT")
    report = json.loads(out.read_text())
    assert report["equivalent"] is True and report["modes"] == list(LOSS_AGGREGATIONS)
    assert report["policy_losses"] == ["ppo", "cispo"]
    assert len(report["checks"]) == len(LOSS_AGGREGATIONS) * len(TERMS) * (len(SPLITS) + 1)
    assert all(check["rel_diff"] <= report["tolerance"] for check in report["checks"])
    assert min(report["controls"].values()) > 1e-2  # a leak between completions shows, in every mode
    assert report["groups_cut"]["equal"] > 0 and report["groups_cut"]["permuted"] > 0  # completions, not groups
    assert "1 flat group, 1 of a single completion" in report["shape"]


@pytest.mark.usefixtures("isolated")
def test_one_aggregation_and_policy_loss_under_lora(capsys: pytest.CaptureFixture[str]) -> None:
    """The reference is the base with the adapters off; only the adapters' gradients are compared."""
    pytest.importorskip("peft")
    argv = ["verify", "--objective", "grpo", *FAST, "--loss-aggregation", "seq-mean-token-mean", "--lora-rank", "4"]
    assert main([*argv, "--policy-loss", "ppo"]) == 0
    printed = capsys.readouterr().out
    checked = set(re.findall(r"^  (\S+)\s+term (\S+)", printed, re.MULTILINE))
    assert checked == {("seq-mean-token-mean", term) for term in ("policy(ppo)", "kl", "entropy")}
    assert "term kl            split empty" in printed and "verdict: EQUIVALENT" in printed


@pytest.mark.usefixtures("isolated")
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--objective", "grpo", "--loss-aggregation", "bnpo"],
            "argument --loss-aggregation: loss_aggregation must be one of token-mean, .*; bnpo is not offered",
        ),
        (["--objective", "grpo", "--policy-loss", "ppo2"], "argument --policy-loss: policy_loss must be ppo or cispo"),
        (
            ["--objective", "grpo", "--model", "moe-pico"],
            "--objective grpo on a mixture of experts: .* not part of the reward objective yet",
        ),
        (["--loss-aggregation", "token-mean"], "--loss-aggregation is a setting of --objective grpo"),
        (["--objective", "dpo", "--policy-loss", "cispo"], "--policy-loss is a setting of --objective grpo"),
        (["--objective", "grpo", "--beta", "0.5"], "--beta is a preference objective's"),
        (["--objective", "grpo", "--splits", "equal,halves"], "--splits halves: choose from"),
    ],
)
def test_bad_settings_are_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1 and re.search(message, captured.err), captured.err


def per_micro_batch_tokens(original: Any) -> Any:
    """token-mean normalised by each micro-batch's own tokens (TRL's bnpo under accumulation)."""

    def weights(self: RewardObjective, batch: Any) -> torch.Tensor:
        held = float((batch.answers.segment >= 0).sum())
        return original(self, batch) * (40.0 / max(held, 1.0))

    return weights


def micro_batch_group_tokens(original: Any) -> Any:
    """group-token-mean with ``T_g`` counted over the group's completions in this micro-batch, not the step."""

    def weights(self: RewardObjective, batch: Any) -> torch.Tensor:
        segment, scores = batch.answers.segment, batch.answers.rollout
        count = scores.advantage.numel()
        lengths = torch.bincount(segment[segment >= 0], minlength=count)[:count].float()
        group = batch.answers.group
        held = torch.zeros(int(group.max()) + 1 if count else 0).index_add_(0, group, lengths)
        return 1.0 / held[group].clamp_min(1.0)

    return weights


@pytest.mark.parametrize(
    ("mode", "broken", "named"),
    [
        ("token-mean", per_micro_batch_tokens, "token-mean policy(ppo) (equal)"),
        ("group-token-mean", micro_batch_group_tokens, "group-token-mean policy(ppo) (equal)"),
    ],
)
def test_an_aggregation_normalised_per_micro_batch_is_caught_and_named(
    mode: str, broken: Any, named: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bigbatch.verify.command import build_case

    model = build_case(None, "pico", 256, 0.0, 0, 1, 32, False).model
    monkeypatch.setattr(RewardObjective, "token_weights", broken(RewardObjective.token_weights))
    report = check_rollout_terms(
        model, groups=8, k=4, seq_len=32, vocab_size=256, modes=(mode,), policy_losses=("ppo",)
    )
    broken_checks = {(check.term, check.split) for check in report.broken}
    for term in ("policy(ppo)", "kl", "entropy"):  # every term shares the aggregation, so every term is named
        assert (term, "equal") in broken_checks and (term, "permuted") in broken_checks, term
        assert (term, WHOLE) not in broken_checks  # one micro-batch either way: the bug cannot show there
    assert not report.equivalent
    assert re.search(rf"{mode}\s+term policy\(ppo\)\s+split equal\s+rel L2 \S+  BROKEN", report.format())
    assert f"verdict: NOT EQUIVALENT: {named}" in report.format()


@pytest.mark.slow  # two processes under torchrun
def test_across_two_ranks_with_a_rank_of_padding(tmp_path: Path) -> None:
    out = tmp_path / "ranks.json"
    command = [sys.executable, "-m", "bigbatch", "verify", "--objective", "grpo", "--nproc", "2", *FAST]
    command += ["--loss-aggregation", "group-token-mean", "--json", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert "objective grpo across 2 ranks" in done.stdout and "verdict: EQUIVALENT" in done.stdout
    for term in TERMS:
        for layout in ("ranks", "pad-rank"):
            assert re.search(
                rf"group-token-mean\s+term {re.escape(term)}\s+split {layout}\s+rel L2 \S+  ok", done.stdout
            )
    report = json.loads(out.read_text())
    assert report["equivalent"] is True and report["groups_cut"]["ranks"] > 0
