"""Preference training through ``bigbatch train`` (issue 53): a DPO run killed inside a step resumes bitwise, a KTO
run records its step-wide KL point and validates the objective, and every setting without meaning under a preference
objective, or data of the wrong kind, is refused in one line with nothing written."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import assert_one_line_error, run_main
from reliability_runs import final_model, run_cli, step_losses

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("BIGBATCH_CACHE", str(tmp_path / "env-cache"))
    yield


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("preference")
    gen = random.Random(0)

    def words(low: int, high: int) -> str:
        return " ".join(gen.choice(WORDS) for _ in range(gen.randint(low, high)))

    pairs, kto = root / "pairs.jsonl", root / "kto.jsonl"
    pairs.write_text(
        "".join(
            json.dumps({"prompt": words(2, 5), "chosen": " " + words(1, 3).upper(), "rejected": " " + words(1, 3)})
            + "\n"
            for _ in range(80)
        )
    )
    kto.write_text(
        "".join(
            json.dumps({"prompt": words(2, 5), "completion": " " + words(1, 3), "label": i % 3 != 1}) + "\n"
            for i in range(80)
        )
    )
    return {"pairs": pairs, "kto": kto, "cache": root / "cache"}


def args(data: dict[str, Path], kind: str, out: Path, *extra: str) -> list[str]:
    return [
        *("train", "--data", str(data[kind]), "--model", "pico", "--micro-batch", "4", "--seq-len", "48"),
        *("--total-batch-tokens", "768", "--max-steps", "4", "--eval-every", "2", "--sample-tokens", "0"),
        *("--cache-dir", str(data["cache"]), "--dropout", "0.1", "--out", str(out), *extra),
    ]


@pytest.mark.slow
def test_a_dpo_run_killed_inside_a_step_resumes_bitwise(data: dict[str, Path], tmp_path: Path) -> None:
    """pico with dropout (the generators matter) and a frozen reference, killed inside step 3, resumes from step 2
    and ends with the losses and parameters of a run that never stopped."""
    golden = tmp_path / "golden"
    done = run_cli(args(data, "pairs", golden, "--objective", "dpo"))
    assert done.returncode == 0, done.stderr[-2000:]
    out = tmp_path / "run"
    killed = run_cli(args(data, "pairs", out, "--objective", "dpo", "--save-every", "2"), fault="kill:step=3,micro=1")
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed = run_cli(args(data, "pairs", out, "--objective", "dpo", "--save-every", "2"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout and "at step 2" in resumed.stdout
    assert step_losses(out) == step_losses(golden)  # bitwise: == on floats
    golden_model, model = final_model(golden), final_model(out)
    assert set(model) == set(golden_model)
    for name, value in golden_model.items():
        assert torch.equal(model[name], value), name


def test_a_kto_run_records_the_steps_kl_point_and_validates_the_objective(
    data: dict[str, Path], tmp_path: Path
) -> None:
    code, out, err = run_main(args(data, "kto", tmp_path / "kto", "--objective", "kto", "--dropout", "0"))
    assert code == 0, err
    assert "objective | kto: kto per sequence" in out and "reference | a frozen reference model" in out
    assert "the gradient noise scale is not measured in this run" in out
    records = [json.loads(line) for line in (tmp_path / "kto" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    assert len(steps) == 4 and all("kl" in r and r["term/kto"] == pytest.approx(r["loss"]) for r in steps)
    assert steps[0]["kl"] == 0.0  # the policy is the reference at the first step
    assert all(r["loss"] == pytest.approx(0.5, abs=0.1) for r in steps[:1])  # 1 - sigmoid(0) per completion
    evals = [r for r in records if r["kind"] == "eval"]
    assert evals and all("val_rewards/desirable" in r and r["val_loss"] > 0 for r in evals)


@pytest.mark.parametrize(
    ("kind", "extra", "message"),
    [
        ("kto", [], "the data holds KTO rows"),
        ("pairs", [], "--objective lm"),
        ("pairs", ["--objective", "kto"], "preference pairs"),
        ("pairs", ["--objective", "dpo", "--batch-ramp", "256:2048"], "--objective dpo does not take --batch-ramp"),
        ("pairs", ["--objective", "dpo", "--token-budget", "512"], "--objective dpo does not take --token-budget"),
        ("pairs", ["--objective", "orpo", "--micro-batch", "auto"], "does not take --micro-batch auto"),
        ("pairs", ["--beta", "0.2"], "--beta sets the parameters of a preference objective"),
        ("pairs", ["--objective", "simpo", "--label-smoothing", "0.1"], "are DPO's"),
        ("pairs", ["--objective", "orpo", "--reference", "elsewhere"], "--objective orpo has no reference policy"),
        ("pairs", ["--objective", "dpo", "--robust"], "--robust corrects for --label-smoothing"),
        ("pairs", ["--objective", "ipo", "--robust"], "are DPO's"),
        ("pairs", ["--objective", "dpo", "--simpo-gamma", "2"], "--simpo-gamma is SimPO's"),
        ("pairs", ["--objective", "dpo", "--desirable-weight", "2"], "--desirable-weight is KTO's"),
        ("pairs", ["--objective", "dpo", "--schedule", "seesaw"], "does not take --schedule seesaw"),
        ("pairs", ["--objective", "dpo", "--reference", "missing"], "--reference missing: no such directory"),
    ],
    ids=[
        "kto-rows-for-lm",
        "pairs-for-lm",
        "pairs-for-kto",
        "ramp",
        "budget",
        "auto-micro",
        "beta-for-lm",
        "smoothing-for-simpo",
        "reference-for-orpo",
        "robust-alone",
        "robust-for-ipo",
        "gamma-for-dpo",
        "kto-weight-for-dpo",
        "seesaw",
        "missing-reference",
    ],
)
def test_what_a_preference_run_cannot_mean_is_refused_in_one_line(
    data: dict[str, Path], tmp_path: Path, kind: str, extra: list[str], message: str
) -> None:
    out = tmp_path / "refused"
    code, stdout, err = run_main(args(data, kind, out, *extra))
    line = assert_one_line_error(code, stdout, err)
    assert message in line, line
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()


def test_eval_says_what_it_scores_on_a_dpo_run_and_critical_batch_refuses_one(
    data: dict[str, Path], tmp_path: Path
) -> None:
    run = tmp_path / "dpo"
    code, out, err = run_main(args(data, "pairs", run, "--objective", "dpo", "--max-steps", "2", "--dropout", "0"))
    assert code == 0, err
    code, out, err = run_main(["eval", str(run)])
    assert code == 0, err
    assert "the next-token loss of every answer's tokens, not the dpo objective" in out
    code, out, err = run_main(["report", str(run), "--out", str(tmp_path / "report")])
    assert code == 0, err
    summary = (tmp_path / "report" / "summary.txt").read_text()
    assert "(the objective)" in summary and "perplexity" not in summary and "reward accuracy" in summary
    code, out, err = run_main(["critical-batch", str(run), "--tokens-per-step", "384,768", "--budget", "1536"])
    line = assert_one_line_error(code, out, err)
    assert "trained with --objective dpo" in line and "branch a run of --objective lm" in line


def test_reference_log_probabilities_computed_once_train_as_those_of_each_step(
    data: dict[str, Path], tmp_path: Path
) -> None:
    """--reference-logps once: the table is computed before the first step (the frozen copy then leaves memory),
    kept in the run directory, read again by a run that continues; the steps are those of --reference-logps step."""
    each = tmp_path / "each"
    code, out, err = run_main(args(data, "pairs", each, "--objective", "dpo", "--max-steps", "3", "--dropout", "0"))
    assert code == 0, err
    once = tmp_path / "once"
    flags = ["--objective", "dpo", "--dropout", "0", "--reference-logps", "once"]
    code, out, err = run_main(args(data, "pairs", once, *flags, "--max-steps", "3"))
    assert code == 0, err
    assert "reference | computed once:" in out and "the frozen reference model left memory" in out
    assert (once / "reference_logps.pt").is_file()
    assert step_losses(once) == pytest.approx(step_losses(each), rel=1e-6, abs=1e-7)
    code, out, err = run_main(args(data, "pairs", once, *flags, "--max-steps", "4"))  # continues the same run
    assert code == 0, err
    assert "reference | read from" in out and "reference | computed once:" not in out
    code, out, err = run_main(
        args(data, "pairs", tmp_path / "orpo", "--objective", "orpo", "--reference-logps", "once")
    )
    assert "--objective orpo has no reference policy" in assert_one_line_error(code, out, err)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "extra"),
    [
        ("pairs", ["--objective", "dpo", "--replay-every", "1"]),  # each rank re-runs the other's micro-batch
        ("kto", ["--objective", "kto", "--parallel", "fsdp"]),  # every rank runs the KL pass's forwards
    ],
    ids=["dpo-ddp-replay", "kto-fsdp"],
)
def test_two_processes_train_a_preference_objective(
    data: dict[str, Path], tmp_path: Path, kind: str, extra: list[str]
) -> None:
    """Two processes: DPO under DDP with a replay of every step (the reference log-probabilities travel with the
    replayed micro-batch, so a healthy run is not taken for a faulty device), and KTO under FSDP2, whose ranks may
    hold different numbers of KL answers (the statistics pass runs as many forwards on each)."""
    out = tmp_path / "run"
    done = run_cli(args(data, kind, out, *extra, "--nproc", "2", "--max-steps", "3", "--dropout", "0"))
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in records if r["kind"] == "step" and not r.get("skipped")]) == 3
    if "--replay-every" in extra:
        replays = [r for r in records if r["kind"] == "replay"]
        assert replays and all(check["matched"] for r in replays for check in r["replays"])
