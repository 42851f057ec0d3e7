"""Batch-size ramp-up in training: K follows the ramp, every step is exact at its own size, the learning-rate
schedule counts optimizer steps, the ramp is part of the run (SIGKILL mid-ramp and resume is bitwise
identical; another ramp on resume is refused unless --allow-ramp-change), and ``auto`` grows toward the
measured noise scale."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from exactness import assert_big_batch_updates as big_batch_updates
from exactness import capture_training
from helpers import assert_one_line_error, corpus_bytes, run_main
from reliability_runs import cli_args, final_model, run_cli, step_losses

from bigbatch.engine.optim import CosineSchedule
from bigbatch.noise.scale import NoiseScale
from bigbatch.run.configuration.train_config import TrainConfig
from bigbatch.run.loop.trainer import Trainer
from bigbatch.sizing.ramp import BatchRamp, RampSpec

UNIT = 2 * 32  # micro_batch x seq_len: the tokens one more micro-batch adds
RAMP = "128:512"  # K 2 -> 4 (256 tokens per step) over the first 512 tokens seen: K 2, 2, 3, 3, 4, 4, ...


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_bytes(corpus_bytes(60_000))
    return path


def make_config(corpus: Path, out: Path, ramp: str = RAMP, steps: int = 6, **run: Any) -> TrainConfig:
    config = TrainConfig()
    config.model.preset = "pico"
    config.data.data = str(corpus)
    config.data.cache_dir = str(corpus.parent / "cache")
    config.batch.micro_batch, config.batch.seq_len, config.batch.total_batch_tokens = 2, 32, 256  # K = 4
    config.batch.batch_ramp = ramp
    config.optim.warmup_steps = 2
    config.run.max_steps = steps
    config.run.eval_every = 0
    config.run.sample_tokens = 0
    config.run.out = str(out)
    for key, value in run.items():
        setattr(config.run, key, value)
    return config


def records(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "step"]


def train_and_capture(config: TrainConfig) -> tuple[Trainer, torch.nn.Module, list[list[Any]], list[dict[str, Any]]]:
    """Train ``config``; the trainer, a copy of its initial model, every step's micro-batches and metrics records."""
    trainer = Trainer(config)
    return (trainer, *capture_training(trainer))


def assert_big_batch_updates(
    trainer: Trainer,
    reference: torch.nn.Module,
    steps: list[list[Any]],
    logged: list[dict[str, Any]],
    betas: list[tuple[float, float]] | None = None,
) -> None:
    """See :func:`exactness.assert_big_batch_updates` (on this corpus fp32 lands 7e-5 from a float64 replay for a
    LayerNorm bias after 7 steps: the bar follows it)."""
    big_batch_updates(trainer.model, reference, steps, logged, check_norm=False, betas=betas)


@pytest.mark.parametrize("rule", ["auto", "none"])
def test_a_ramped_run_follows_the_ramp_and_every_step_is_exact_at_its_own_size(
    corpus: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, rule: str
) -> None:
    """K and tokens per step follow the ramp at the tokens seen; each step's update is the big batch's at its own
    size. The learning rate is the per-step schedule times sqrt(B / B0) and beta2 is 0.95 ** (B / B0) with the
    default batch-change rule (B0 = the 256 tokens the ramp grows to); the schedule alone with ``none``."""
    caplog.set_level("INFO")
    config = make_config(corpus, tmp_path / "run", steps=7)
    config.optim.batch_change_rule = rule
    trainer, initial, steps, logged = train_and_capture(config)
    ramp = BatchRamp(RampSpec(128, 512), trainer.plan)
    seen, expected_k = 0, []
    for _ in range(7):
        expected_k.append(ramp.k(seen))
        seen += expected_k[-1] * UNIT
    assert expected_k == [2, 2, 3, 3, 4, 4, 4]
    assert [r["micro_batches"] for r in logged] == expected_k == [len(s) for s in steps]
    assert [r["tokens"] for r in logged] == [k * UNIT for k in expected_k]
    assert trainer.state.tokens_seen == seen
    schedule = CosineSchedule(2e-3, 2e-4, 2, 7)
    ratios = [k / 4 for k in expected_k]
    factors = [r**0.5 if rule == "auto" else 1.0 for r in ratios]
    assert [r["lr"] for r in logged] == pytest.approx([schedule(s) * f for s, f in enumerate(factors)], rel=1e-12)
    assert "step 3 | loss" in caplog.text and "| K 3 | tokens 192" in caplog.text
    assert "batch ramp | 128 -> 256 tokens/step over the first 512 tokens seen (K 2 -> 4" in caplog.text
    lines = (trainer.run_dir / "metrics.jsonl").read_text().splitlines()
    changes = [c for c in map(json.loads, lines) if c["kind"] == "batch_change"]
    assert [(c["step"], c["tokens_per_step_before"], c["tokens_per_step_after"]) for c in changes] == [
        (1, 256, 128),  # the first step is half the size the settings are given for
        (3, 128, 192),
        (5, 192, 256),
    ]
    expected_beta2 = [0.95**r for r in (0.5, 0.75, 1.0)] if rule == "auto" else [0.95] * 3
    assert [c["beta2_after"] for c in changes] == pytest.approx(expected_beta2, rel=1e-12)
    assert caplog.text.count("batch change at step") == 3
    betas = [(0.9, 0.95**r if rule == "auto" else 0.95) for r in ratios]
    assert_big_batch_updates(trainer, initial, steps, logged, betas=betas)


def test_a_ramp_over_ragged_documents_counts_valid_targets_and_stays_exact(tmp_path: Path) -> None:
    """Documents (padding, masked prompts): the ramp's clock is the valid targets seen, and each step of its own
    K is normalized by its own valid targets (``mean / K`` would fail the comparison)."""
    import json as json_module

    source = tmp_path / "qa.jsonl"
    rows = [{"prompt": f"Q{i}: " + "why? " * (i % 5), "completion": " because" * (1 + i % 3)} for i in range(400)]
    source.write_text("\n".join(json_module.dumps(r) for r in rows) + "\n")
    config = make_config(source, tmp_path / "run", ramp="128:200", steps=6)
    config.data.data_mode = "documents"
    trainer, initial, steps, logged = train_and_capture(config)
    assert trainer.parts.documents
    ramp = BatchRamp(RampSpec(128, 200), trainer.plan)
    seen = 0
    for record in logged:
        assert record["micro_batches"] == ramp.k(seen)
        assert record["tokens"] < record["micro_batches"] * UNIT  # padding and prompts do not count
        seen += record["tokens"]
    assert [r["micro_batches"] for r in logged] == sorted(r["micro_batches"] for r in logged)
    assert logged[0]["micro_batches"] == 2 and logged[-1]["micro_batches"] > 2
    # beta2 keeps its half-life in tokens at each step's planned size (K micro-batches of positions)
    betas = [(0.9, 0.95 ** (r["micro_batches"] / 4)) for r in logged]
    assert_big_batch_updates(trainer, initial, steps, logged, betas=betas)


@pytest.mark.slow
def test_sigkill_mid_ramp_then_resume_is_bitwise_identical(corpus: Path, tmp_path: Path) -> None:
    """Killed (SIGKILL) inside step 4 (K 3, mid-ramp, dropout on), the same command resumes from step 2 and ends
    with the loss sequence and parameters of a run that never stopped."""
    ramped = ["--batch-ramp", RAMP, "--dropout", "0.1"]
    golden = tmp_path / "golden"
    done = run_cli(cli_args(corpus, golden, *ramped))
    assert done.returncode == 0, done.stderr[-2000:]
    assert [r["micro_batches"] for r in records(golden)] == [2, 2, 3, 3, 4, 4]

    out = tmp_path / "run"
    args = cli_args(corpus, out, *ramped, "--save-every", "2")
    killed = run_cli(args, fault="kill:step=4,micro=1")
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed = run_cli(args)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "at step 2 (256 tokens)" in resumed.stdout
    assert step_losses(out) == step_losses(golden)  # bitwise: == on floats
    assert [r["micro_batches"] for r in records(out)] == [2, 2, 3, 3, 4, 4]
    golden_model, model = final_model(golden), final_model(out)
    for name, value in golden_model.items():
        assert torch.equal(model[name], value), name


@pytest.mark.usefixtures("isolated")
def test_another_ramp_on_resume_is_refused_unless_allowed(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    Trainer(make_config(corpus, out, steps=2)).train()
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    base = cli_args(corpus, out)
    base[base.index("--max-steps") + 1] = "5"
    code, stdout, stderr = run_main([*base, "--batch-ramp", "256:512", "--warmup-steps", "2"])
    line = assert_one_line_error(code, stdout, stderr)
    assert "batch.batch_ramp '128:512' -> '256:512'" in line and "--allow-ramp-change" in line
    code, stdout, stderr = run_main([*base, "--warmup-steps", "2"])  # dropping the ramp is a change too
    assert "'128:512' -> none" in assert_one_line_error(code, stdout, stderr)
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before  # nothing written

    code, stdout, stderr = run_main([*base, "--batch-ramp", "256:512", "--warmup-steps", "2", "--allow-ramp-change"])
    assert code == 0, stderr
    assert "--allow-ramp-change: batch.batch_ramp '128:512' -> '256:512' from the next step on (K 4" in stdout
    assert [r["micro_batches"] for r in records(out)] == [2, 2, 4, 4, 4]  # the new ramp starts at the full 256 tokens
    # The same ramp spelled otherwise is no change.
    assert Trainer(make_config(corpus, out, ramp="256:0.512K", steps=6)).engine.step_count == 5


@pytest.mark.usefixtures("isolated")
@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--batch-ramp", "32:512"], "START_TOKENS 32 is below one micro-batch per process"),
        (["--batch-ramp", "64:512", "--nproc", "2"], "(micro_batch 2 x seq_len 32 x world 2 = 128 tokens)"),
        (["--batch-ramp", "1K:512"], "START_TOKENS 1,000 is above the tokens per step 256"),
        (["--batch-ramp", "128"], "must be START_TOKENS:RAMP_TOKENS"),
        (["--batch-ramp", "128:512", "--token-budget", "200"], "use one of them"),
        (["--batch-ramp", "auto", "--noise-scale-every", "0"], "--noise-scale-every is 0"),
    ],
)
def test_bad_ramps_are_one_line_errors_that_write_nothing(
    corpus: Path, tmp_path: Path, extra: list[str], expected: str
) -> None:
    out = tmp_path / "fresh"
    code, stdout, stderr = run_main([*cli_args(corpus, out), *extra])
    assert expected in assert_one_line_error(code, stdout, stderr)
    assert not out.exists()


def test_auto_grows_toward_the_noise_scale_and_resumes_exactly(
    corpus: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """auto starts at K 2, changes K only after a step that measured the noise scale, toward it, never shrinking
    and at most doubling, is logged at each change, and a crash after a change resumes to the same K sequence and
    losses. pico's real noise scale over a few steps is ~10 tokens, below one micro-batch, so the estimate is
    scripted: 160 tokens x the measurements so far (2.5, 5, 7.5, ... micro-batches)."""
    caplog.set_level("INFO")
    monkeypatch.setattr(NoiseScale, "estimate", property(lambda self: 2.5 * UNIT * self.measurements))
    golden = tmp_path / "golden"
    config = make_config(corpus, golden, ramp="auto", steps=8, noise_scale_every=2)
    config.batch.total_batch_tokens = 1024  # K up to 16
    Trainer(config).train()
    logged = records(golden)
    ks = [r["micro_batches"] for r in logged]
    # measured at steps 1, 2, 4, 6, 8: 160 (K 2), 320 (5, doubling caps it at 4), 480 (8), 640 (10) tokens
    assert ks == [2, 2, 4, 4, 8, 8, 10, 10]
    assert [r["step"] for r in logged if "noise_scale" in r] == [1, 2, 4, 6, 8]
    assert "batch ramp auto: K 2 -> 4 (128 -> 256 tokens/step) from step 3; measured noise scale 320 tokens" in (
        caplog.text
    )

    out = tmp_path / "run"
    config = make_config(corpus, out, ramp="auto", steps=8, noise_scale_every=2, save_every=3)
    config.batch.total_batch_tokens = 1024
    first = Trainer(config)
    inner = first.engine.loss_fn

    def crash(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        if first.engine.step_count + 1 == 8:
            raise RuntimeError("injected crash in step 8")
        return inner(model, batch)

    first.engine.loss_fn = crash
    with pytest.raises(RuntimeError, match="injected"):
        first.train()
    resumed = Trainer(config)
    assert resumed.engine.step_count == 6 and resumed.parts.ramp is not None
    assert resumed.parts.ramp.k(0) == ks[6]  # the size reached is part of the state
    resumed.train()
    assert [r["micro_batches"] for r in records(out)] == ks
    assert step_losses(out) == step_losses(golden)


@pytest.mark.slow
def test_a_ramp_across_two_processes_matches_one_process(corpus: Path, tmp_path: Path) -> None:
    """`--nproc 2` with micro-batch 1 (the same 64 tokens per K as one process with micro-batch 2): every rank
    takes the same K from the global tokens seen, and the run ends with one process's parameters."""
    ramped = ["--batch-ramp", RAMP]
    one = run_cli(cli_args(corpus, tmp_path / "one", *ramped))
    assert one.returncode == 0, one.stderr[-2000:]
    args = cli_args(corpus, tmp_path / "two", *ramped, "--nproc", "2")
    args[args.index("--micro-batch") + 1] = "1"
    two = run_cli(args)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "x world 2" in two.stdout and two.stdout.count("step 3 | loss") == 1
    k_one, k_two = ([r["micro_batches"] for r in records(tmp_path / name)] for name in ("one", "two"))
    assert k_one == k_two == [2, 2, 3, 3, 4, 4]
    for name, value in final_model(tmp_path / "one").items():
        if not name.endswith("attn.c_attn.bias"):  # key-bias rounding, see exactness.assert_parameters_match
            torch.testing.assert_close(final_model(tmp_path / "two")[name], value, rtol=1e-4, atol=1e-6)


@pytest.mark.usefixtures("isolated")
def test_the_ramp_is_part_of_the_default_run_directory(corpus: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Another ramp is another run (its own default directory); --allow-ramp-change on a fresh start says it has
    no effect rather than silently starting a new run."""
    from bigbatch.run.configuration.identity import default_run_dir

    plain = make_config(corpus, Path(""), ramp="")
    plain.run.out = ""
    ramped, other = copy.deepcopy(plain), copy.deepcopy(plain)
    ramped.batch.batch_ramp, other.batch.batch_ramp = RAMP, "auto"
    assert len({default_run_dir(c) for c in (plain, ramped, other)}) == 3
    assert default_run_dir(copy.deepcopy(ramped)) == default_run_dir(ramped)
    caplog.set_level("INFO")
    ramped.run.allow_ramp_change = True
    trainer = Trainer(ramped)
    assert trainer.resumed_from is None and "--allow-ramp-change has no effect" in caplog.text
