"""bigbatch report (plots + summary), the terminal progress bar, and the optional TensorBoard / W&B loggers."""

from __future__ import annotations

import io
import json
import math
import sys
from pathlib import Path

import pytest
from helpers import assert_one_line_error, corpus_bytes, run_main

from bigbatch.engine.accumulate import StepRecord
from bigbatch.errors import BigBatchError
from bigbatch.observe.metrics import (
    JsonlLog,
    MetricsFanout,
    Throughput,
    check_optional_loggers,
    open_metrics,
    read_records,
)
from bigbatch.observe.report import PLOTS, make_report, summarize
from bigbatch.observe.runs import read_metrics, run_labels
from bigbatch.progress import ProgressBar, format_duration, plural

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


pytestmark = pytest.mark.usefixtures("isolated")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("report")
    text = corpus_bytes(60_000)
    (path / "corpus.txt").write_bytes(text)
    return path


def train_args(workspace: Path, out: Path, micro_batch: int, *extra: str) -> list[str]:
    return [
        "train",
        "--data",
        str(workspace / "corpus.txt"),
        "--model",
        "pico",
        "--seq-len",
        "32",
        "--micro-batch",
        str(micro_batch),
        "--total-batch-tokens",
        "256",
        "--eval-every",
        "2",
        "--eval-batches",
        "2",
        "--sample-tokens",
        "0",
        "--max-steps",
        "3",
        "--cache-dir",
        str(workspace / "cache"),
        "--out",
        str(out),
        *extra,
    ]


@pytest.fixture(scope="module")
def runs(workspace: Path) -> tuple[Path, Path]:
    """The same 256 tokens per step as K=2 x 4 sequences and as K=1 x 8 (with a peak FLOP/s, so MFU is logged)."""
    k2, k1 = workspace / "k2", workspace / "k1"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(workspace)
        for run_dir, argv in (
            (k2, train_args(workspace, k2, 4, "--noise-scale-every", "1")),
            (k1, train_args(workspace, k1, 8, "--peak-flops", "1e12")),
        ):
            code, out, err = run_main(argv)
            assert code == 0, out + err
            (workspace / f"{run_dir.name}.out").write_text(out)  # beside the run: its console lines
    return k2, k1


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_png(path: Path) -> None:
    assert path.is_file(), path
    assert path.read_bytes()[:8] == PNG_SIGNATURE, path
    assert path.stat().st_size > 5000, path  # a real plot, not an empty canvas


# --------------------------------------------------------------------------------------------
# metrics.jsonl carries MFU when the trainer computes it
# --------------------------------------------------------------------------------------------


def test_step_records_carry_mfu_only_when_known(runs: tuple[Path, Path]) -> None:
    k2, k1 = runs
    with_mfu = [r for r in records(k1) if r["kind"] == "step"]
    assert len(with_mfu) == 3 and all(0 < r["mfu"] < 1 for r in with_mfu)
    # mfu = flops_per_token * tokens/s / peak (1e12 on one device)
    ratios = {round(r["mfu"] * 1e12 / r["tokens_per_s"]) for r in with_mfu}
    assert len(ratios) == 1
    assert all("mfu" not in r for r in records(k2) if r["kind"] == "step")  # CPU: peak unknown, nothing written


def test_the_done_line_gives_tokens_over_time_and_the_mfu_of_that(runs: tuple[Path, Path]) -> None:
    """tok/s is the tokens of steps 2..N over their time (not the mean of the steps' rates), MFU that ratio's."""
    k2, k1 = runs
    for run_dir in runs:
        steps = [r for r in records(run_dir) if r["kind"] == "step"]
        assert [r["step"] for r in steps] == [1, 2, 3]
        rate = sum(r["tokens"] for r in steps[1:]) / sum(r["dt"] for r in steps[1:])
        (done,) = [line for line in (run_dir.parent / f"{run_dir.name}.out").read_text().splitlines() if "done" in line]
        expected = f"done | 3 steps | 768 tokens | tok/s {rate:,.0f} (tokens / time of steps 2..3)"
        if run_dir == k1:  # --peak-flops: MFU = F x (tokens / time) / P, with F / P from a step record's own
            expected += f" | mfu {rate * steps[1]['mfu'] / steps[1]['tokens_per_s']:.1%} (at that tok/s)"
        assert done.startswith(expected + f" | final loss {steps[-1]['loss']:.4f} | val loss "), done
        assert "mean" not in done


def test_a_resumed_session_times_its_steps_after_its_first(workspace: Path, tmp_path: Path) -> None:
    """The first step of every session includes warm-up: a session resumed at step 2 times steps 4..5."""
    out_dir = tmp_path / "resumed"
    assert run_main(train_args(workspace, out_dir, 8, "--max-steps", "2"))[0] == 0
    code, out, err = run_main(train_args(workspace, out_dir, 8, "--max-steps", "5"))
    assert code == 0, out + err
    steps = {r["step"]: r for r in records(out_dir) if r["kind"] == "step"}
    rate = (steps[4]["tokens"] + steps[5]["tokens"]) / (steps[4]["dt"] + steps[5]["dt"])
    assert f"done | 5 steps | 1,280 tokens | tok/s {rate:,.0f} (tokens / time of steps 4..5) | final loss" in out
    # and a session of one step says that its number includes warm-up
    code, out, err = run_main(train_args(workspace, out_dir, 8, "--max-steps", "6"))
    assert code == 0, out + err
    six = [r for r in records(out_dir) if r["kind"] == "step"][-1]
    assert six["step"] == 6
    assert f"| tok/s {six['tokens_per_s']:,.0f} (step 6 alone, warm-up included) | final loss" in out


def test_throughput_is_a_ratio_of_totals() -> None:
    t = Throughput(tokens=4500, seconds=4.5, first_step=2, last_step=4)
    assert t.tokens_per_s == 1000.0
    assert t.describe() == "tok/s 1,000 (tokens / time of steps 2..4)"
    assert Throughput(100, 0.5, 7, 7).describe() == "tok/s 200 (tokens / time of step 7)"
    assert Throughput(100, 4.0, 1, 1, warm_up=True).describe() == "tok/s 25 (step 1 alone, warm-up included)"
    assert Throughput(100, 0.0, 1, 1).tokens_per_s == 0.0


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------


def test_report_of_one_run_writes_plots_and_a_matching_summary(runs: tuple[Path, Path]) -> None:
    run_dir = runs[1]
    code, out, err = run_main(["report", str(run_dir)])
    assert code == 0, err
    report_dir = run_dir / "report"  # the default for one run
    for name in (*PLOTS, "mfu.png"):
        assert_png(report_dir / name)

    steps = [r for r in records(run_dir) if r["kind"] == "step"]
    evals = [r for r in records(run_dir) if r["kind"] == "eval"]
    best = min(evals, key=lambda r: r["val_loss"])
    # ratios of totals over steps 2 and 3 (step 1, warm-up, left out): tokens / time, FLOPs / peak FLOPs
    rate = sum(r["tokens"] for r in steps[1:]) / sum(r["dt"] for r in steps[1:])
    total_mfu = rate * steps[1]["mfu"] / steps[1]["tokens_per_s"]  # MFU is linear in tok/s: F / P per step
    summary = (report_dir / "summary.txt").read_text()
    assert summary.strip() in out  # printed as well
    assert f"run {run_dir.name}\n" in summary
    assert "  steps              3\n" in summary
    assert "  tokens seen        768\n" in summary
    assert f"  final train loss   {steps[-1]['loss']:.4f}\n" in summary
    assert f"  best val loss      {best['val_loss']:.4f} at step {best['step']} " in summary
    assert f"(perplexity {math.exp(best['val_loss']):,.2f})" in summary
    assert f"  final val loss     {evals[-1]['val_loss']:.4f}\n" in summary
    assert f"  tok/s              {rate:,.0f} (tokens / time of steps 2..3)\n" in summary
    assert f"  MFU                {total_mfu:.1%} (at that tok/s)\n" in summary
    assert "mean" not in summary
    assert "  skipped steps      0" in summary

    s = summarize(read_metrics(run_dir))
    assert (s.steps, s.tokens, s.skipped, s.best_val_step) == (3, 768, 0, best["step"])
    assert s.final_loss == steps[-1]["loss"] and s.best_val_loss == best["val_loss"]
    assert s.tokens_per_s == pytest.approx(rate, rel=1e-12) and s.mfu == pytest.approx(total_mfu, rel=1e-9)


def test_report_overlays_several_runs_beside_them(
    runs: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several runs: report/ in the directory that holds them (runs/report for runs under runs/), named as the
    runs were; the working directory, often the user's checkout, gets nothing."""
    k2, k1 = runs
    monkeypatch.chdir(k2.parent.parent)
    code, out, err = run_main(["report", f"{k2.parent.name}/k2", f"{k1.parent.name}/k1"])
    assert code == 0, err
    report_dir = k2.parent / "report"
    assert f"\nreport: {k2.parent.name}/report (loss_vs_step.png, " in out
    assert not (k2.parent.parent / "report").exists() and not (tmp_path / "report").exists()
    for name in (*PLOTS, "mfu.png"):
        assert_png(report_dir / name)
    summary = (report_dir / "summary.txt").read_text()
    assert "run k2\n" in summary and "run k1\n" in summary
    assert summary.count("\n  MFU   ") == 1  # only the run whose records carry it
    # the same tokens per step as K=2 and K=1 is the same training, to rounding
    a, b = (summarize(read_metrics(d)) for d in runs)
    assert a.final_loss == pytest.approx(b.final_loss, rel=1e-5)
    assert a.tokens == b.tokens == 768


def test_a_report_of_runs_that_meet_only_in_the_working_directory_asks_for_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Their common directory is where the user is (or above it): nothing is written there, --out says where."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text('{"kind": "step", "step": 1, "loss": 2.0}\n')
    monkeypatch.chdir(tmp_path)
    line = assert_one_line_error(*run_main(["report", "a", "b"]))
    assert "the runs a, b meet only in" in line and line.endswith("so give --out DIR for these")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


def test_a_report_given_among_the_runs_is_left_out(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """runs/* takes in runs/report, written by a report before: it is no run, and is said to be left out."""
    from bigbatch.files.outputs import REPORT_MARKER, mark_own_dir
    from bigbatch.observe.report import leave_out_reports

    run, report = tmp_path / "run", tmp_path / "report"
    run.mkdir()
    mark_own_dir(report, REPORT_MARKER, "report")
    assert leave_out_reports([run, report]) == [run]
    assert f"{report} is a report written by bigbatch report, not a run: left out" in caplog.text
    with pytest.raises(BigBatchError, match="is a report written by bigbatch report, not a run; give run dir"):
        leave_out_reports([report])


def test_report_out_option(runs: tuple[Path, Path], tmp_path: Path) -> None:
    out_dir, summaries, plots = make_report([runs[0]], tmp_path / "elsewhere" / "r")
    assert out_dir == tmp_path / "elsewhere" / "r"
    # no MFU in this run: no mfu.png; K = 2 measured the noise scale: noise_scale.png when an estimate is usable
    # (positive), which depends on the draws of its 3 noisy measurements, so the run's own records decide
    usable = any(r.get("noise_scale", 0) > 0 for r in records(runs[0]) if r["kind"] == "step")
    assert any("noise_scale" in r for r in records(runs[0]))
    assert sorted(p.name for p in plots) == sorted([*PLOTS, *["noise_scale.png"] * usable])
    assert (out_dir / "summary.txt").is_file() and len(summaries) == 1


def write_jsonl(path: Path, lines: list[object]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    text = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    (path / "metrics.jsonl").write_text(text)
    return path


def step(n: int, loss: float, tokens: int = 100, tps: float = 1000.0, skipped: bool = False, **extra: object) -> dict:
    return {
        "kind": "step",
        "step": n,
        "loss": loss,
        "grad_norm": 1.0,
        "lr": 1e-3,
        "tokens": tokens,
        "micro_batches": 2,
        "dt": tokens / tps,
        "skipped": skipped,
        "tokens_per_s": tps,
        **extra,
    }


def test_summary_handles_skipped_steps_nan_and_a_cut_line(tmp_path: Path) -> None:
    run_dir = write_jsonl(
        tmp_path / "r",
        [
            step(1, 5.0, tps=10.0, mfu=0.01),  # warm-up: left out of the throughput
            step(2, 4.0, tps=2000.0, mfu=0.2),
            step(2, float("nan"), tps=3000.0, skipped=True),  # a skipped step keeps the step number
            {"kind": "eval", "step": 2, "val_loss": 3.5},
            step(3, 3.0, tps=4000.0, mfu=0.4),
            {"kind": "eval", "step": 3, "val_loss": 3.7},
            '{"kind": "step", "step": 4, "lo',  # cut by a crash
        ],
    )
    s = summarize(read_metrics(run_dir))
    assert s.steps == 3 and s.skipped == 1
    assert s.tokens == 300  # the skipped step trained on nothing
    assert s.final_loss == 3.0
    assert (s.best_val_loss, s.best_val_step, s.final_val_loss) == (3.5, 2, 3.7)
    # steps 2 and 3, applied ones only: 200 tokens in 0.05 + 0.025 s (their rates' mean, 3,000, overstates it)
    assert s.tokens_per_s == pytest.approx(200 / 0.075)
    assert s.mfu == pytest.approx(0.2 / 2000 * 200 / 0.075)  # F / P = 1e-4 on both steps, at the run's tok/s
    out_dir, _, plots = make_report([run_dir])
    for path in plots:
        assert_png(path)
    assert "skipped steps      1" in (out_dir / "summary.txt").read_text()


def test_summary_throughput_and_mfu_are_ratios_of_totals(tmp_path: Path) -> None:
    """Steps of unequal tokens and times: tok/s is their tokens over their time, 4,500 / 4.5 s (the mean of their
    rates would say 1,083); MFU is their FLOPs over the peak FLOPs of their time (the mean of theirs: 10.8%)."""
    flops_per_peak = 1e-4  # F / P: each step's mfu = F x its tok/s / P
    run_dir = write_jsonl(
        tmp_path / "r",
        [
            step(1, 5.0, tokens=100, tps=10.0, mfu=10.0 * flops_per_peak),  # warm-up: left out
            step(2, 4.0, tokens=1000, tps=1000.0, mfu=1000.0 * flops_per_peak),  # 1 s
            step(3, 3.5, tokens=3000, tps=2000.0, mfu=2000.0 * flops_per_peak),  # 1.5 s
            step(4, 3.0, tokens=500, tps=250.0, mfu=250.0 * flops_per_peak),  # 2 s
        ],
    )
    s = summarize(read_metrics(run_dir))
    assert s.throughput == Throughput(4500, pytest.approx(4.5), 2, 4)
    assert s.tokens_per_s == pytest.approx(1000.0)
    assert s.mfu == pytest.approx(0.1)
    text = s.format()
    assert "\n  tok/s              1,000 (tokens / time of steps 2..4)\n" in text
    assert "\n  MFU                10.0% (at that tok/s)\n" in text


def test_summary_mfu_when_the_peak_changes_between_sessions(tmp_path: Path) -> None:
    """Step 2 on one device, steps 3 and 4 resumed on two (twice the peak): MFU = FLOPs / peak FLOPs of the
    time = 4,500 F / (1 s x P + 3.5 s x 2P) = 4,500 / 80,000 with F / P = 1e-4."""
    run_dir = write_jsonl(
        tmp_path / "r",
        [
            step(1, 5.0, tokens=100, tps=10.0),
            step(2, 4.0, tokens=1000, tps=1000.0, mfu=1000.0 * 1e-4),
            step(3, 3.5, tokens=3000, tps=2000.0, mfu=2000.0 * 0.5e-4),
            step(4, 3.0, tokens=500, tps=250.0, mfu=250.0 * 0.5e-4),
        ],
    )
    assert summarize(read_metrics(run_dir)).mfu == pytest.approx(4500 / 80_000)


def test_summary_of_step_1_alone_says_it_includes_warm_up(tmp_path: Path) -> None:
    s = summarize(read_metrics(write_jsonl(tmp_path / "r", [step(1, 5.0, tokens=100, tps=40.0)])))
    assert s.throughput == Throughput(100, 2.5, 1, 1, warm_up=True)
    assert "\n  tok/s              40 (step 1 alone, warm-up included)\n" in s.format()
    skipped = summarize(read_metrics(write_jsonl(tmp_path / "s", [step(1, math.nan, skipped=True)])))
    assert skipped.throughput is None and skipped.mfu is None
    assert "\n  tok/s              n/a (no applied step)\n" in skipped.format()


def test_summary_gives_the_padding_and_prompt_shares_of_the_positions_trained(tmp_path: Path) -> None:
    """Step 1: 60 valid targets, 20% padding and 20% prompts of 100 positions; step 2: 150 valid targets, no
    padding and 25% prompts of 200. Of the 300 positions: 20 padding (6.7%), 70 prompts (23.3%), 210 valid
    targets (70.0%); a mean of the steps' shares would say 10.0% and 22.5%."""
    layout = {"kind": "documents", "step": 0, "packed": True, "rows": 3, "seq_len": 32}
    run_dir = write_jsonl(
        tmp_path / "r",
        [
            {**layout, "padding_share": 0.05, "prompt_share": 0.2},
            step(1, 5.0, tokens=60, padding_share=0.2, prompt_share=0.2),
            step(2, 4.0, tokens=150, padding_share=0.0, prompt_share=0.25),
        ],
    )
    s = summarize(read_metrics(run_dir))
    assert s.positions is not None
    assert (s.positions.trained, s.positions.padding, s.positions.prompt) == (
        300,
        pytest.approx(20 / 300),
        pytest.approx(70 / 300),
    )
    text = s.format()
    assert "\n  positions          300 trained on: 6.7% padding, 23.3% masked prompts, 70.0% valid targets\n" in text
    assert "\n  epoch layout       packed into 3 rows of 32: 5.0% padding, 20.0% masked prompts\n" in text
    plain = summarize(read_metrics(write_jsonl(tmp_path / "plain", [step(1, 5.0), step(2, 4.0)])))
    assert plain.positions is None and "positions" not in plain.format()  # packed data: no such shares


def test_one_reader_of_metrics_jsonl(tmp_path: Path) -> None:
    """read_records: every JSON object, in file order (the loggers' history); read_metrics: the steps and
    evaluations among them, for report, plan --from-run and critical-batch."""
    lines = [
        step(1, 5.0),
        {"kind": "documents", "step": 0, "padding_share": 0.1},
        "",
        "[1, 2]",  # not an object
        {"kind": "eval", "step": 1, "val_loss": 4.5},
        {"kind": "step", "loss": 1.0},  # no step number
        '{"kind": "step", "step": 2, "lo',  # cut by a crash
    ]
    run_dir = write_jsonl(tmp_path / "r", lines)
    kinds = [r["kind"] for r in read_records(run_dir)]
    assert kinds == ["step", "documents", "eval", "step"]
    run = read_metrics(run_dir)
    assert [r["step"] for r in run.steps] == [1] and [r["val_loss"] for r in run.evals] == [4.5]
    assert run.label == "r" and read_records(tmp_path / "nothing-here") == []


def test_run_labels_are_the_directory_names(tmp_path: Path) -> None:
    default, chosen = tmp_path / "runs" / "nano-6771823094", tmp_path / "runs" / "my-experiment"
    assert run_labels([default, chosen]) == ["nano-6771823094", "my-experiment"]  # not the settings hash alone
    assert run_labels([tmp_path / "k1", tmp_path / "k8"]) == ["k1", "k8"]
    assert run_labels([Path("runs/nano-6771823094")]) == ["nano-6771823094"]  # relative as given


def test_run_labels_disambiguate_equal_names(tmp_path: Path) -> None:
    assert run_labels([tmp_path / "a" / "run", tmp_path / "b" / "run"]) == ["a/run", "b/run"]
    # only the runs that share a name grow, and only as far as it takes
    assert run_labels([tmp_path / "x" / "a" / "run", tmp_path / "y" / "a" / "run", tmp_path / "k1"]) == [
        "x/a/run",
        "y/a/run",
        "k1",
    ]
    # one run's path is the end of the other's: the longer one grows past it
    assert run_labels([tmp_path / "a" / "run", tmp_path / "b" / "a" / "run"]) == [
        f"{tmp_path.name}/a/run",
        "b/a/run",
    ]
    assert run_labels([tmp_path / "k1", tmp_path / "k1"]) == ["k1", "k1"]  # the same run twice


def named_run(path: Path, name: str) -> Path:
    """A run directory whose config.toml carries ``run.name`` (as bigbatch train writes it)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.toml").write_text(f'[run]\nout = ""\nname = "{name}"\n')
    return path


def test_run_labels_use_the_name_given_at_training_time(tmp_path: Path) -> None:
    named = named_run(tmp_path / "runs" / "nano-6771823094", "baseline")
    assert run_labels([named, tmp_path / "runs" / "nano-1234567890"]) == ["baseline", "nano-1234567890"]
    # two runs with one name: each says which directory it is
    again = named_run(tmp_path / "other" / "nano-6771823094", "baseline")
    assert run_labels([named, again]) == ["baseline (runs/nano-6771823094)", "baseline (other/nano-6771823094)"]
    # a name equal to another run's directory name: both say where they are
    assert run_labels([named_run(tmp_path / "a" / "k1", "k2"), tmp_path / "b" / "k2"]) == ["k2 (k1)", "b/k2"]
    # an empty name, a config.toml without one, or no readable config.toml: the directory's name
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.toml").write_text("[run\n")
    unnamed = [named_run(tmp_path / "empty", ""), named_run(tmp_path / "blank", "  "), tmp_path / "broken"]
    assert run_labels(unnamed) == ["empty", "blank", "broken"]


def test_the_run_name_is_not_part_of_the_runs_identity() -> None:
    from bigbatch.run.configuration.identity import (
        default_run_dir,
        identity_settings,
        settings_diff,
        settings_fingerprint,
    )
    from bigbatch.run.configuration.train_config import TrainConfig

    base, named = TrainConfig(), TrainConfig()
    named.run.name = "my-experiment"
    assert default_run_dir(named) == default_run_dir(base)
    assert settings_fingerprint(named) == settings_fingerprint(base)
    assert "run.name" not in identity_settings(named)
    assert settings_diff(base.to_dict(), named) == [] and settings_diff(named.to_dict(), base) == []


@pytest.mark.slow
def test_train_name_labels_the_report_and_survives_a_resume(workspace: Path, tmp_path: Path) -> None:
    """--name goes into config.toml (the run directory and its identity stay), report labels the run by it, a
    resume may rename the run, and a resume without --name keeps the name."""
    run_dir = tmp_path / "runs" / "plain-dir"
    code, out, err = run_main([*train_args(workspace, run_dir, 8), "--name", "baseline lr 2e-3"])
    assert code == 0, out + err
    assert 'name = "baseline lr 2e-3"' in (run_dir / "config.toml").read_text()
    code, out, err = run_main(["report", str(run_dir), "--out", str(tmp_path / "r1")])
    assert code == 0, err
    assert "run baseline lr 2e-3\n" in (tmp_path / "r1" / "summary.txt").read_text()

    code, out, err = run_main(train_args(workspace, run_dir, 8, "--max-steps", "4", "--name", "renamed"))
    assert code == 0, out + err
    assert "resumed from" in out and "step 4 | loss" in out  # another name is the same run, continued
    code, out, err = run_main(train_args(workspace, run_dir, 8, "--max-steps", "5"))
    assert code == 0, out + err
    assert "resumed from" in out and 'name = "renamed"' in (run_dir / "config.toml").read_text()
    other = tmp_path / "elsewhere" / "plain-dir"  # an unnamed run with the same directory name
    other.mkdir(parents=True)
    (other / "metrics.jsonl").write_text((run_dir / "metrics.jsonl").read_text())
    _, summaries, _ = make_report([run_dir, other], tmp_path / "r2")
    assert [s.label for s in summaries] == ["renamed", "plain-dir"]


@pytest.mark.parametrize("case", ["missing-dir", "no-metrics", "empty-metrics", "only-eval"])
def test_report_without_step_records_is_a_one_line_error(case: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    if case != "missing-dir":
        run_dir.mkdir()
    if case == "empty-metrics":
        (run_dir / "metrics.jsonl").write_text("")
    if case == "only-eval":
        write_jsonl(run_dir, [{"kind": "eval", "step": 1, "val_loss": 2.0}])
    code, out, err = run_main(["report", str(run_dir)])
    line = assert_one_line_error(code, out, err)
    assert str(run_dir) in line
    assert not (run_dir / "report").exists()
    with pytest.raises(BigBatchError):
        read_metrics(run_dir)


# --------------------------------------------------------------------------------------------
# progress bar
# --------------------------------------------------------------------------------------------


def test_progress_bar_draws_nothing_on_a_non_tty() -> None:
    stream = io.StringIO()
    bar = ProgressBar(10, stream=stream, min_interval=0)
    assert not bar.enabled
    for i in range(11):
        bar.update(i, tokens_per_s=1234.0)
    bar.clear()
    bar.close()
    assert stream.getvalue() == ""


def test_progress_bar_draws_frames_with_eta_on_a_tty() -> None:
    stream = FakeTTY()
    now = [100.0]
    bar = ProgressBar(10, stream=stream, min_interval=0, clock=lambda: now[0])
    assert bar.enabled
    bar.update(0)
    now[0] += 10.0
    bar.update(1, tokens_per_s=12345.0)  # 10 s per step, 9 steps to go
    text = stream.getvalue()
    frames = text.split("\r")[1:]
    assert len(frames) == 2 and "\n" not in text
    assert frames[0].startswith("step 0/10 [") and "ETA --:--" in frames[0]
    assert frames[1].startswith("step 1/10 [##") and " 10%" in frames[1]
    assert "tok/s 12,345" in frames[1] and frames[1].rstrip().endswith("ETA 1:30")
    bar.clear()  # erases the line for a log line, then the next update redraws
    assert stream.getvalue().endswith("\r" + " " * len(frames[1]) + "\r")
    now[0] += 10.0
    bar.update(2)
    assert stream.getvalue().split("\r")[-1].startswith("step 2/10") and "ETA 1:20" in stream.getvalue()
    bar.close()
    size = len(stream.getvalue())
    bar.update(3)  # closed: nothing more
    assert len(stream.getvalue()) == size


def test_progress_bar_rate_limits_but_draws_the_last_frame() -> None:
    stream = FakeTTY()
    bar = ProgressBar(100, stream=stream, min_interval=3600)
    for i in range(101):
        bar.update(i)
    frames = stream.getvalue().split("\r")[1:]
    assert [f.split()[1] for f in frames] == ["0/100", "100/100"]


def test_plural() -> None:
    assert [plural(n, "document") for n in (0, 1, 2, 12_345)] == [
        "0 documents",
        "1 document",
        "2 documents",
        "12,345 documents",
    ]
    assert plural(1, "packed row") == "1 packed row" and plural(3, "process", "processes") == "3 processes"


def test_format_duration() -> None:
    assert [format_duration(s) for s in (0, 3.4, 247, 3909)] == ["0:00", "0:03", "4:07", "1:05:09"]


def test_trainer_bar_only_on_a_tty_and_log_lines_unchanged(workspace: Path, tmp_path: Path) -> None:
    plain_code, plain_out, plain_err = run_main(train_args(workspace, tmp_path / "plain", 4))
    assert plain_code == 0 and "\r" not in plain_out + plain_err and plain_err == ""
    tty = FakeTTY()
    code, out, err = run_main(train_args(workspace, tmp_path / "tty", 4), stderr=tty)
    assert code == 0, out + err
    assert "\r" not in out  # stdout: the same log lines

    def logged(text: str) -> list[str]:  # step and eval lines without their timings
        return [" | ".join(line.split(" | ")[:2]) for line in text.splitlines() if line.startswith(("step", "eval"))]

    assert logged(out) == logged(plain_out) and len(logged(out)) == 5
    assert "step 3/3 [####################] 100%" in err and "ETA" in err
    assert err.endswith("\r")  # cleared at the end


def fake_measurement(size: int):  # noqa: ANN201
    from bigbatch.sizing.memory import MicroStepMeasurement

    mib = 1 << 20
    return MicroStepMeasurement(
        size, 10 * mib, size * mib, 2 * size * mib, mib, 3 * size * mib, 3 * size * mib, 8, 0.01 * size, 0.001
    )


@pytest.mark.parametrize("tty", [False, True], ids=["pipe", "tty"])
def test_memory_progress(tty: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    import bigbatch.sizing.memory

    monkeypatch.setattr(bigbatch.sizing.memory, "measure", lambda config, size, *a, **k: fake_measurement(size))
    stream = FakeTTY() if tty else io.StringIO()
    code, out, err = run_main(
        ["memory", "--model", "pico", "--seq-len", "32", "--max-micro-batch", "4", "--device", "cpu"], stderr=stream
    )
    assert code == 0, err
    assert "micro-batch" in out
    if tty:
        assert "measured micro-batch 1\n" not in err
        assert "measured 3/3 [" in err and "ETA" in err and "\r" in err
    else:
        assert err == (
            "measuring a training micro-step of pico on cpu (fp32, seq_len 32, K 4) at micro-batch 1, 2, 4\n"
            "measured micro-batch 1\nmeasured micro-batch 2\nmeasured micro-batch 4\n"
        )
    assert err.startswith("measuring a training micro-step of pico on cpu")  # before the first size, on a TTY too


def test_plan_measure_says_what_it_measures_before_it_measures(monkeypatch: pytest.MonkeyPatch) -> None:
    """plan --measure (minutes for GPT-2 on CPU) says what it measures first, then each size, as memory does."""
    import bigbatch.sizing.memory

    def fake(config: object, size: int, *args: object, **kwargs: object):  # noqa: ANN202
        assert stream.getvalue().startswith("measuring a training micro-step of pico on cpu")  # said before
        return fake_measurement(size)

    monkeypatch.setattr(bigbatch.sizing.memory, "measure", fake)
    stream = io.StringIO()
    argv = [
        "plan",
        "--model",
        "pico",
        "--seq-len",
        "32",
        "--micro-batch",
        "2",
        "--k",
        "8",
        "--measure",
        "--device",
        "cpu",
    ]
    code, out, err = run_main(argv, stderr=stream)
    assert code == 0, err
    assert err == (
        "measuring a training micro-step of pico on cpu (fp32, seq_len 32, K 4) at micro-batch 2\n"
        "measured micro-batch 2\n"
    )
    assert "micro-step time (measured)" in out


# --------------------------------------------------------------------------------------------
# optional loggers
# --------------------------------------------------------------------------------------------


def test_default_loggers_write_only_jsonl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # importing either would now fail
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    check_optional_loggers(False, "")
    sink = open_metrics(tmp_path / "run")
    assert [type(s) for s in sink.sinks] == [JsonlLog]
    sink.write_step(StepRecord(1, 2.0, 0.5, 1e-3, 64, 2, 0.1))
    sink.write_eval(1, 1.9)
    sink.close()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["metrics.jsonl"]
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["kind"] for line in lines] == ["step", "eval"] and "mfu" not in lines[0]


@pytest.mark.parametrize(
    ("flags", "module", "needle"),
    [
        (
            ["--tensorboard"],
            "torch.utils.tensorboard",
            "pip install -e '.[tensorboard]' (bigbatch's [tensorboard] extra: tensorboard)",
        ),
        (["--wandb", "myproj"], "wandb", "pip install -e '.[wandb]' (bigbatch's [wandb] extra: wandb)"),
    ],
    ids=["tensorboard", "wandb"],
)
def test_missing_logger_package_is_a_one_line_error(
    flags: list[str], module: str, needle: str, workspace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, module, None)
    run_dir = tmp_path / "run"
    code, out, err = run_main([*train_args(workspace, run_dir, 4), *flags])
    line = assert_one_line_error(code, out, err)
    assert needle in line
    assert not run_dir.exists()  # refused before anything was written


@pytest.mark.slow
def test_loggers_are_fed_when_the_packages_exist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real TensorBoard and W&B (offline), read back with their own readers: the scalars of metrics.jsonl."""
    from logger_readers import metrics_records, tensorboard_scalars, wandb_offline_env, wandb_run

    for key, value in wandb_offline_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    sink = open_metrics(tmp_path / "run", tensorboard=True, wandb_project="proj", config={"a": 1})
    assert isinstance(sink, MetricsFanout) and len(sink.sinks) == 3
    sink.write_step(StepRecord(7, 2.0, 0.5, 1e-3, 64, 2, 0.1), mfu=0.25)
    sink.write_eval(7, 1.5)
    sink.close()
    step, evaluation = metrics_records(tmp_path / "run")
    scalars = tensorboard_scalars(tmp_path / "run" / "tensorboard")
    assert scalars["train/loss"] == [(7, 2.0)] and scalars["train/mfu"] == [(7, 0.25)]
    assert scalars["val/loss"] == [(7, 1.5)] and scalars["by_tokens/val_loss"] == [(64, 1.5)]
    assert scalars["train/tokens_per_s"] == [(7, pytest.approx(step["tokens_per_s"]))]
    _, logged = wandb_run(tmp_path / "run")
    (row,) = logged.rows
    assert row["_step"] == 7 and row["train/loss"] == 2.0 and row["val/loss"] == evaluation["val_loss"]
    assert row["train/tokens_per_s"] == step["tokens_per_s"] and logged.config == {"a": 1}
