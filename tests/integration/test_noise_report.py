"""The measured noise scale read back from a run: ``bigbatch report``'s noise_scale.png and ``bigbatch plan
--from-run`` (synthetic metrics.jsonl with known values, and one real run end to end)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from helpers import assert_one_line_error, corpus_bytes, run_main

from bigbatch.observe.noise_report import NOISE_PLOT, NOISE_TITLE, measured_noise, noise_figure, noise_series
from bigbatch.observe.report import PLOTS, make_report, summarize
from bigbatch.observe.runs import read_metrics

pytestmark = pytest.mark.usefixtures("isolated")

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
B_SMALL, B_BIG = 128.0, 256.0


def noise_fields(smoothed: float, g_sq: float = 1.0, trace: float = 200.0) -> dict[str, float]:
    """A measurement whose raw norms are their expectations for ``|G|^2 = g_sq``, ``tr(Sigma) = trace``."""
    return {
        "noise_small_sq": g_sq + trace / B_SMALL,
        "noise_big_sq": g_sq + trace / B_BIG,
        "noise_b_small": B_SMALL,
        "noise_b_big": B_BIG,
        "noise_g_sq": 1.0,
        "noise_trace": smoothed,
        "noise_scale": smoothed,
    }


def step(n: int, tokens: int = 256, k: int = 2, skipped: bool = False, **extra: object) -> dict:
    return {
        "kind": "step",
        "step": n,
        "loss": 5.0 - 0.1 * n,
        "grad_norm": 1.0,
        "lr": 1e-3,
        "tokens": tokens,
        "micro_batches": k,
        "dt": 0.1,
        "skipped": skipped,
        "tokens_per_s": 2560.0,
        **extra,
    }


def write_run(path: Path, records: list[dict], **run_settings: object) -> Path:
    """A run directory: metrics.jsonl and a config.toml with micro-batch 4 x seq_len 32 (128 tokens)."""
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    settings = {"noise_scale_every": 2, "parallel": "auto", "sync_every_micro_step": False, "nproc": 1, **run_settings}
    run = "\n".join(f"{key} = {json.dumps(value)}" for key, value in settings.items())
    (path / "config.toml").write_text(
        f'[data]\ndata_mode = "packed"\n\n[batch]\nmicro_batch = 4\nseq_len = 32\ntoken_budget = 0\n\n[run]\n{run}\n'
    )
    return path


def measured_run(path: Path) -> Path:
    """Six steps of 256 tokens, measured at 1, 2, 4 and 6 (step 5 skipped: no update, no tokens)."""
    return write_run(
        path,
        [
            step(1, **noise_fields(math.nan)),
            step(2, **noise_fields(-50.0, trace=-10.0)),
            step(3),
            step(4, **noise_fields(150.0, g_sq=2.0)),
            step(4, skipped=True),
            step(5),
            step(6, **noise_fields(300.0)),
        ],
    )


def assert_png(path: Path) -> None:
    assert path.is_file() and path.read_bytes()[:8] == PNG_SIGNATURE and path.stat().st_size > 5000, path


def test_the_series_are_read_from_the_measured_steps(tmp_path: Path) -> None:
    series = noise_series(read_metrics(measured_run(tmp_path / "run")))
    assert [p.step for p in series.points] == [1, 2, 4, 6]
    assert [p.tokens for p in series.points] == [256, 512, 1024, 1536]  # cumulative; the skipped step adds none
    assert [p.smoothed for p in series.points[1:]] == [-50.0, 150.0, 300.0] and math.isnan(series.points[0].smoothed)
    assert [p.step for p in series.usable()] == [4, 6]  # positive smoothed estimates only
    # one measurement alone, from its raw norms: tr(Sigma) / |G|^2
    assert [p.single for p in series.points[2:]] == pytest.approx([100.0, 200.0])
    assert series.points[1].single == pytest.approx(-10.0)  # kept in the series; the plot shows positive ones
    assert series.steps == [(256, 256), (512, 256), (768, 256), (1024, 256), (1280, 256), (1536, 256)]
    assert [p.loss for p in series.points] == pytest.approx([4.9, 4.8, 4.6, 4.4])


@pytest.mark.slow
def test_report_plots_the_noise_scale_only_for_runs_that_measured_it(tmp_path: Path) -> None:
    measured = measured_run(tmp_path / "measured")
    plain = write_run(tmp_path / "plain", [step(n) for n in (1, 2, 3)], noise_scale_every=0)
    out, _, plots = make_report([measured])
    assert [p.name for p in plots] == [*PLOTS, NOISE_PLOT]
    assert_png(out / NOISE_PLOT)
    out, _, plots = make_report([plain])
    assert [p.name for p in plots] == list(PLOTS) and not (out / NOISE_PLOT).exists()  # no panel, no error
    code, stdout, err = run_main(["report", str(plain), str(measured), "--out", str(tmp_path / "both")])
    assert code == 0, err
    assert NOISE_PLOT in stdout
    assert_png(tmp_path / "both" / NOISE_PLOT)  # the run that measured it, beside one that did not


def test_the_noise_plot_names_its_axis_tells_runs_apart_and_says_who_is_missing(tmp_path: Path) -> None:
    """Two measured runs at the same tokens per step, one that measured nothing, one whose estimates are never
    positive: the title says what is plotted against what; each run's dashed tokens per step are its colour at
    its own dash offset (coinciding lines alternate, none hides the other); the two without an estimate have a
    legend entry saying why, and the summary says it too."""
    import matplotlib.pyplot as plt

    a, b = measured_run(tmp_path / "a"), measured_run(tmp_path / "b")
    plain = write_run(tmp_path / "plain", [step(n) for n in (1, 2, 3)], noise_scale_every=0)
    unusable = write_run(tmp_path / "unusable", [step(1, **noise_fields(-5.0)), step(2, **noise_fields(math.nan))])
    runs = [read_metrics(d) for d in (a, b, plain, unusable)]
    colors = ["C0", "C1", "C2", "C3"]
    fig = noise_figure(runs, colors)
    try:
        (ax,) = fig.axes  # several runs: no loss axis
        assert ax.get_title() == NOISE_TITLE
        assert "against tokens seen" in NOISE_TITLE and "vs tokens per step" not in NOISE_TITLE
        assert ax.get_xlabel() == "tokens (valid targets, cumulative)"
        steps = [line for line in ax.get_lines() if line.get_label().endswith(" tokens per step")]
        assert [(line.get_label(), line.get_color()) for line in steps] == [
            ("a tokens per step", "C0"),
            ("b tokens per step", "C1"),
        ]
        # the dash pattern before scaling by the line width (matplotlib keeps no public getter for it)
        patterns = [line._unscaled_dash_pattern for line in steps]  # type: ignore[attr-defined]
        assert patterns == [(0.0, (4.0, 4.0)), (4.0, (4.0, 4.0))]  # one dash in two, shifted by one dash
        assert [line.get_xydata().tolist() for line in steps][0] == [line.get_xydata().tolist() for line in steps][1]
        (legend,) = fig.legends
        texts = [t.get_text() for t in legend.get_texts()]
        assert texts[-2:] == [
            "plain: no noise-scale estimate (measured on no step)",
            "unusable: no noise-scale estimate (2 measurements, none positive)",
        ]
        assert not any(t.startswith(("plain ", "unusable ")) for t in texts)  # no line of theirs
    finally:
        plt.close(fig)
    assert noise_figure(runs[2:], colors) is None  # nothing to plot: no file (the summary says why)
    lines = [summarize(run).format().splitlines() for run in runs]
    assert "  noise scale        300 tokens (the smoothed estimate at step 6)" in lines[0]
    assert (
        "  noise scale        not measured: it was trained with --noise-scale-every 0; train with "
        "--noise-scale-every N (e.g. 10) to measure it"
    ) in lines[2]
    assert (
        "  noise scale        no estimate yet: 2 measurements, none positive (the gradient noise still drowns the "
        "signal); not in noise_scale.png"
    ) in lines[3]


def test_one_measured_run_keeps_the_plain_dashes_and_its_loss_axis(tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    fig = noise_figure([read_metrics(measured_run(tmp_path / "a"))], ["C0"])
    try:
        ax, twin = fig.axes
        (steps,) = [line for line in ax.get_lines() if line.get_label() == "a tokens per step"]
        assert steps.get_linestyle() == "--" and twin.get_ylabel() == "training loss (nats per token)"
        assert [t.get_text() for t in fig.legends[0].get_texts()][-1] == "training loss"
    finally:
        plt.close(fig)


def test_plan_from_run_suggests_whole_micro_batches_near_the_last_smoothed_estimate(tmp_path: Path) -> None:
    run = measured_run(tmp_path / "run")
    measured = measured_noise(run)
    assert (measured.tokens, measured.step, measured.micro_batch, measured.seq_len, measured.world_size) == (
        300.0,
        6,
        4,
        32,
        1,
    )  # 256 tokens = 4 x 32 x K 2 x world 1
    code, out, err = run_main(["plan", "--from-run", str(run)])
    assert code == 0, err
    assert f"from run {run}: measured noise scale 300 tokens, the smoothed estimate at step 6 (its last" in out
    assert "the run used 256 tokens per step (0.85x the noise scale)" in out
    # 300 tokens in micro-batches of 4 x 32 = 128 tokens on one device: K = round(2.34) = 2, 256 tokens
    assert "whole micro-batches of 4 x 32 on 1 device: 256 (K 2)" in out
    assert re.search(r"^accumulation steps \(K\)\s+2$", out, re.MULTILINE), out
    assert re.search(r"^tokens per step\s+256$", out, re.MULTILINE), out

    documents = tmp_path / "documents"
    documents.mkdir()
    (documents / "metrics.jsonl").write_text((run / "metrics.jsonl").read_text())
    (documents / "config.toml").write_text((run / "config.toml").read_text().replace('"packed"', '"documents"'))
    assert measured_noise(documents).world_size is None  # valid tokens of padded documents do not tell

    code, out, err = run_main(["plan", "--from-run", str(run), "--devices", "2", "--micro-batch", "2"])
    assert code == 0, err  # 2 x 32 x 2 devices = 128 tokens per micro-step: K = 2
    assert "whole micro-batches of 2 x 32 on 2 devices: 256 (K 2)" in out
    code, out, err = run_main(["plan", "--from-run", str(run), "--devices", "3"])
    assert code == 0, err  # 4 x 32 x 3 = 384 tokens > 300: one micro-batch each is already more
    assert "on 3 devices: 384 (K 1)" in out
    assert "note: the noise scale is below one micro-batch on every device (384 tokens)" in out
    code, out, err = run_main(["plan", "--from-run", str(run), "--seq-len", "16", "--micro-batch", "1"])
    assert code == 0, err  # 16 tokens per micro-batch: K = round(18.75) = 19, 304 tokens
    assert "whole micro-batches of 1 x 16 on 1 device: 304 (K 19)" in out


def test_plan_from_run_takes_the_last_usable_measurement(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", [step(1, **noise_fields(120.0)), step(2, **noise_fields(-4.0))])
    code, out, err = run_main(["plan", "--from-run", str(run)])
    assert code == 0, err
    assert (
        "measured noise scale 120 tokens, the smoothed estimate at step 1 (its last usable one; the last "
        "measurement, at step 2, is not usable yet;" in out
    )


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("missing", "run directory {run} does not exist"),
        ("no-metrics", "{run} has no metrics.jsonl"),
        (
            "off",
            "{run} has no noise-scale measurements: it was trained with --noise-scale-every 0; train with "
            "--noise-scale-every N",
        ),
        ("k1", "{run} has no noise-scale measurements: every step was one micro-batch in one process (K = 1)"),
        ("fsdp", "{run} has no noise-scale measurements: no step record carries noise_* fields"),
        ("old", "{run} has no noise-scale measurements: no step record carries noise_* fields"),
        ("unusable", "{run} has 2 noise-scale measurements but no usable estimate"),
    ],
)
def test_plan_from_run_without_measurements_is_one_line_saying_why(case: str, expected: str, tmp_path: Path) -> None:
    run = tmp_path / "run"
    if case == "no-metrics":
        run.mkdir()
    elif case == "off":
        write_run(run, [step(1), step(2)], noise_scale_every=0)
    elif case == "k1":
        write_run(run, [step(1, tokens=128, k=1), step(2, tokens=128, k=1)])
    elif case == "fsdp":
        write_run(run, [step(1), step(2)], parallel="fsdp", nproc=2)
    elif case == "old":
        write_run(run, [step(1), step(2)])
    elif case == "unusable":
        write_run(run, [step(1, **noise_fields(math.nan)), step(2, **noise_fields(-3.0))])
    line = assert_one_line_error(*run_main(["plan", "--from-run", str(run)]))
    assert expected.format(run=run) in line, line


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--tokens-per-step", "1024"], "leave out --tokens-per-step"),
        (["--k", "4"], "leave out --k"),
    ],
)
def test_plan_from_run_refuses_what_it_derives(argv: list[str], expected: str, tmp_path: Path) -> None:
    run = measured_run(tmp_path / "run")
    line = assert_one_line_error(*run_main(["plan", "--from-run", str(run), *argv]))
    assert expected in line


@pytest.mark.slow
def test_a_real_run_end_to_end(tmp_path: Path) -> None:
    """pico, K = 4, every step measured: report draws the panel, plan --from-run uses the run's last estimate."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(corpus_bytes(30_000))
    run = tmp_path / "run"
    code, out, err = run_main(
        [
            "train",
            "--data",
            str(corpus),
            "--model",
            "pico",
            "--seq-len",
            "32",
            "--micro-batch",
            "2",
            "--total-batch-tokens",
            "256",
            "--eval-every",
            "8",
            "--eval-batches",
            "1",
            "--sample-tokens",
            "0",
            "--max-steps",
            "8",
            "--noise-scale-every",
            "1",
            "--noise-scale-window",
            "3",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--out",
            str(run),
        ]
    )
    assert code == 0, out + err
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "noise_scale" in r] == list(range(1, 9))
    # A smoothed estimate is usable once positive, which 8 noisy measurements make likely but no draw promises:
    # the commands are held to what the run logged either way (the synthetic runs above cover both cases).
    usable = [r for r in records if r["kind"] == "step" and r.get("noise_scale", 0) > 0]
    if not usable:
        line = assert_one_line_error(*run_main(["plan", "--from-run", str(run)]))
        assert "has 8 noise-scale measurements but no usable estimate" in line
        assert run_main(["report", str(run)])[0] == 0 and not (run / "report" / NOISE_PLOT).exists()
        return
    last = usable[-1]
    code, out, err = run_main(["plan", "--from-run", str(run)])
    assert code == 0, err
    assert (
        f"measured noise scale {round(last['noise_scale']):,} tokens, the smoothed estimate at step "
        f"{last['step']}" in out
    )
    k = max(1, round(round(last["noise_scale"]) / 64))  # micro-batch 2 x 32 on the run's one device
    assert f"whole micro-batches of 2 x 32 on 1 device: {64 * k:,} (K {k})" in out
    code, out, err = run_main(["report", str(run)])
    assert code == 0, err
    assert_png(run / "report" / NOISE_PLOT)
