"""Bad steps in real runs (CPU): a fault traced to its micro-batch and documents, each --bad-step mode, and the
engine's skip-micro equal bit for bit to a step that never held the micro-batch."""

from __future__ import annotations

import json
from pathlib import Path
from unittest.mock import ANY

import pytest
import torch
from reliability_runs import assert_same_final_model, cli_args, run_cli, torchrun_cli
from text_corpus import text_corpus
from tiny import random_batch

from bigbatch.engine.accumulate import AccumulationEngine
from bigbatch.engine.bad_steps import GRAD_NOT_FINITE, GRAD_SPIKE, LEFT_OUT, LOSS_SPIKE, BadStepSettings, SpikeDetector
from bigbatch.engine.batch import MicroBatch
from bigbatch.engine.hooks import StepHook
from bigbatch.engine.optim import build_adamw, constant_schedule
from bigbatch.models import GPT, GPTConfig


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_bytes(text_corpus(60_000))
    return path


class NanLossOnce(StepHook):
    def __init__(self, step: int, micro: int) -> None:
        self.step, self.micro, self.fired = step, micro, False

    def after_forward(self, engine: AccumulationEngine, index: int, loss_sum: torch.Tensor) -> torch.Tensor:
        if not self.fired and engine.step_count + 1 == self.step and index == self.micro:
            self.fired = True
            return loss_sum * float("nan")
        return loss_sum


def _train(
    guard: BadStepSettings | None,
    hooks: list[StepHook],
    drop: tuple[int, int] | None = None,
    steps: tuple[int, ...] = (0, 1, 2),
    engine_out: list[AccumulationEngine] | None = None,
) -> GPT:
    """Three steps of four micro-batches (``steps``: which of the data's steps it reads), dropout on."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, dropout=0.1))
    engine = AccumulationEngine(model, build_adamw(model, 1e-3), constant_schedule(1e-3), hooks=hooks, bad_steps=guard)
    for step in steps:
        x, y = random_batch(8, 16, vocab=64, seed=step)
        batches = [
            MicroBatch(a, b, origin=((0, i * 100),))
            for i, (a, b) in enumerate(zip(x.chunk(4), y.chunk(4), strict=True))
        ]
        if drop is not None and step == drop[0]:
            batches = [b for i, b in enumerate(batches) if i != drop[1]]
        engine.step(batches)
    if engine_out is not None:
        engine_out.append(engine)
    return model


def _same(a: GPT, b: GPT) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_the_guard_changes_no_bit_and_skip_micro_is_the_step_without_that_micro_batch() -> None:
    plain = _train(None, [])
    assert _same(plain, _train(BadStepSettings(), []))
    assert _same(plain, _train(BadStepSettings(replay_every=1), []))  # replays find nothing and change nothing
    skipped = _train(BadStepSettings(), [NanLossOnce(step=2, micro=1)])
    assert _same(skipped, _train(BadStepSettings(), [], drop=(1, 1)))
    assert not _same(skipped, plain)


def test_skip_step_is_a_run_whose_data_never_held_the_step() -> None:
    """An Inf in step 2's gradient under skip-step: parameters, Adam moments, step count and the dropout generator
    are as if the data had gone from step 1 to step 3 (bitwise), and the moments are finite."""
    engines: list[AccumulationEngine] = []
    skipped = _train(
        BadStepSettings(mode="skip-step"), [NanLossOnce(step=2, micro=1)], steps=(0, 1, 2, 3), engine_out=engines
    )
    without = _train(None, [], steps=(0, 2, 3), engine_out=engines)
    assert _same(skipped, without)
    ours, theirs = (e.optimizer.state_dict()["state"] for e in engines)
    for index, moments in theirs.items():
        for name, value in moments.items():
            assert torch.equal(ours[index][name], value), (index, name)
            assert torch.isfinite(ours[index][name]).all()
    assert engines[0].step_count == engines[1].step_count == 3 and engines[0].skipped_steps == 1


def test_the_spike_window_flags_an_outlier_and_survives_its_state() -> None:
    detector = SpikeDetector(window=50, loss_threshold=6.0, grad_threshold=12.0, min_steps=20)
    for i in range(40):
        detector.observe(3.0 + 0.01 * (i % 5), 1.0 + 0.02 * (i % 3))
    assert detector.check(3.02, 1.01) is None
    restored = SpikeDetector(window=50, min_steps=20)
    restored.load_state_dict(json.loads(json.dumps(detector.state_dict())))
    flagged = restored.check(9.0, 1.0)
    assert flagged is not None and flagged[0] == "loss spike"


def test_a_spike_is_large_against_the_median_even_in_a_quiet_window() -> None:
    """A window without spread measures in at least 5% (loss) and 25% (gradient norm) of its median: at the
    defaults a spike is 1.6x the median loss or 11x the median gradient norm, not an ordinary wiggle."""
    detector = SpikeDetector(min_steps=20)
    for _ in range(30):
        detector.observe(3.0, 1.0)
    assert detector.check(3.0 * 1.59, 1.0) is None and detector.check(3.0, 10.99) is None
    assert detector.check(3.0 * 1.61, 1.0) == (LOSS_SPIKE, ANY) and detector.check(3.0, 11.01) == (GRAD_SPIKE, ANY)


def test_spikes_on_step_after_step_are_a_new_level_and_restart_the_window() -> None:
    """Three flagged steps in a row (each on other data) are spikes; the fourth says the run has moved: it is taken
    as it is, the window starts again, and the count of flagged steps survives a checkpoint."""
    detector = SpikeDetector(min_steps=20)
    for i in range(30):
        detector.observe(3.0, 1.0 + 0.01 * (i % 3))
    assert detector.check(3.0, 1.0) is None
    for _ in range(2):
        assert detector.check(3.0, 20.0) == (GRAD_SPIKE, ANY)
    restored = SpikeDetector(min_steps=20)
    restored.load_state_dict(json.loads(json.dumps(detector.state_dict())))
    assert restored.check(3.0, 20.0) == (GRAD_SPIKE, ANY) and not restored.restarted
    assert restored.check(3.0, 20.0) is None
    assert "gradient-norm spike for 4 steps in a row" in restored.restarted and not restored.grad_norms
    assert restored.check(3.0, 80.0) is None  # a new window judges nothing until it holds min_steps


def _records(out: Path, kind: str) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


@pytest.mark.parametrize(
    ("mode", "fault", "verdict"),
    [("skip-micro", "nan-input:step=2,micro=1", "data"), ("skip-step", "nan:step=2,micro=1", "transient")],
)
def test_a_fault_is_traced_to_its_micro_batch_and_documents(
    corpus: Path, tmp_path: Path, mode: str, fault: str, verdict: str
) -> None:
    out = tmp_path / "run"
    done = run_cli(cli_args(corpus, out, "--bad-step", mode), fault=fault)
    assert done.returncode == 0, done.stderr[-2000:]
    (bad,) = _records(out, "bad_step")
    (suspect,) = bad["suspects"]
    assert bad["step"] == 2 and suspect["micro_batch"] == 1 and suspect["rank"] == 0
    assert suspect["verdict"] == verdict and suspect["documents"].startswith("shard 0 @ ")
    assert "bad step 2: non-finite loss on rank 0, micro-batch 1" in done.stdout
    steps = _records(out, "step")
    assert steps[-1]["step"] == 6
    assert sum(s["tokens"] for s in steps if not s["skipped"]) == (6 * 256 - 64 if mode == "skip-micro" else 6 * 256)


def test_stop_ends_the_run_in_one_line_and_rewind_replays_without_the_micro_batch(corpus: Path, tmp_path: Path) -> None:
    stopped = run_cli(cli_args(corpus, tmp_path / "stop", "--bad-step", "stop"), fault="inf-grad:step=2,micro=3")
    assert stopped.returncode != 0 and "Traceback" not in stopped.stderr
    assert stopped.stderr.strip().count("\n") == 0 and "(--bad-step stop)" in stopped.stderr
    out = tmp_path / "rewind"
    rewound = run_cli(
        cli_args(corpus, out, "--bad-step", "rewind", "--save-every", "2"), fault="nan-input:step=4,micro=2"
    )
    assert rewound.returncode == 0, rewound.stderr[-2000:]
    assert "rewind 1 of at most 3: back to step 2" in rewound.stdout
    saved = json.loads((out / "bad-steps.json").read_text())
    assert saved["rewinds"] == 1 and len(saved["excluded"]) == 1
    assert len(_records(out, "bad_step")) == 1 and len(_records(out, "rewind")) == 1
    assert [s["step"] for s in _records(out, "step")] == [1, 2, 3, 4, 5, 6]  # the replaced steps were truncated


def test_with_one_micro_batch_a_step_rewind_skip_step_and_skip_micro_end_alike(corpus: Path, tmp_path: Path) -> None:
    """K 1: skip-micro has nothing left (the step is skipped), rewind's replay finds every micro-batch of the step
    left out (skipped before it runs); skip-step skips it. Each leaves the generators as they were: one model."""
    k1 = ("--total-batch-tokens", "64", "--eval-every", "0")
    for mode in ("skip-step", "skip-micro", "rewind"):
        done = run_cli(cli_args(corpus, tmp_path / mode, "--bad-step", mode, *k1), fault="nan-input:step=4,micro=0")
        assert done.returncode == 0, done.stderr[-2000:]
        assert sum(not s["skipped"] for s in _records(tmp_path / mode, "step")) == 6
    assert "bad step 4: every micro-batch left out by a rewind: skipped step" in done.stdout
    assert [r["cause"] for r in _records(tmp_path / "rewind", "bad_step")] == ["non-finite loss", LEFT_OUT]
    assert_same_final_model(tmp_path / "skip-micro", tmp_path / "skip-step")
    assert_same_final_model(tmp_path / "rewind", tmp_path / "skip-step")


def _bad(out: Path) -> list[dict]:
    return [s for r in _records(out, "bad_step") for s in r["suspects"]]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["skip-micro", "skip-step", "rewind", "stop"])
def test_each_mode_with_two_processes_names_the_rank_and_keeps_the_step_exact(
    corpus: Path, tmp_path: Path, mode: str
) -> None:
    """Bad data on rank 1 (K 2 per rank): both ranks agree on what to do and the record names rank 1."""
    out = tmp_path / mode
    done = torchrun_cli(
        cli_args(corpus, out, "--bad-step", mode, "--save-every", "2"), "nan-input:step=4,rank=1,micro=1"
    )
    if mode == "stop":
        assert done.returncode != 0 and "(--bad-step stop)" in done.stderr
        assert "bad step 4: non-finite loss on rank 1, micro-batch 1" in done.stderr
        return
    assert done.returncode == 0, done.stderr[-3000:]
    (suspect,) = _bad(out)
    assert (suspect["rank"], suspect["micro_batch"], suspect["verdict"]) == (1, 1, "data")
    steps = [s for s in _records(out, "step") if not s["skipped"]]
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5, 6]
    lost = {"skip-micro": 64, "skip-step": 256, "rewind": 64}[mode]  # one micro-batch of 2 x 32, or the whole step
    assert sum(s["tokens"] for s in steps) == 7 * 256 - lost if mode == "skip-step" else 6 * 256 - lost


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_rewind_replays_to_the_parameters_of_skip_micro_with_two_processes(
    corpus: Path, tmp_path: Path, parallel: str
) -> None:
    """Going back to step 2 and reading the data again without the micro-batch is the same update as leaving it
    out of step 4 at once: bitwise, because both are the exact update of the remaining tokens (FSDP2: rank 1 runs
    a micro-batch without targets in its place, as every rank must run as many forwards)."""
    fault = "nan-input:step=4,rank=1,micro=1"
    for mode in ("skip-micro", "rewind"):
        args = cli_args(corpus, tmp_path / mode, "--bad-step", mode, "--save-every", "2", "--parallel", parallel)
        done = torchrun_cli(args, fault)
        assert done.returncode == 0, done.stderr[-3000:]
    assert_same_final_model(tmp_path / "rewind", tmp_path / "skip-micro")


@pytest.mark.slow
@pytest.mark.parametrize(("parallel", "micro"), [("ddp", 1), ("fsdp", 0)])
def test_an_inf_gradient_with_two_processes_is_traced_to_its_micro_batch(
    corpus: Path, tmp_path: Path, parallel: str, micro: int
) -> None:
    """DDP's last micro-batch is reduced inside its backward, and FSDP2 never holds a micro-batch's gradient in
    ``.grad``: both are checked on the way in, so the Inf is named and only its micro-batch is dropped."""
    out = tmp_path / parallel
    args = cli_args(corpus, out, "--parallel", parallel)
    done = torchrun_cli(args, f"inf-grad:step=4,rank=1,micro={micro}")
    assert done.returncode == 0, done.stderr[-3000:]
    (suspect,) = _bad(out)
    assert (suspect["rank"], suspect["micro_batch"], suspect["cause"]) == (1, micro, GRAD_NOT_FINITE)
    assert f"fault inf-grad fired: step 4, rank 1, micro-batch {micro}, documents {suspect['key']}" in done.stdout
    steps = [s for s in _records(out, "step") if not s["skipped"]]
    assert sum(s["tokens"] for s in steps) == 6 * 256 - 64


@pytest.mark.slow
@pytest.mark.parametrize(("fault", "rank"), [("bitflip", 1), ("bitflip-same", 1), ("bitflip-same", 0)])
def test_a_faulty_device_on_one_rank_stops_the_run_naming_that_rank(
    corpus: Path, tmp_path: Path, fault: str, rank: int
) -> None:
    """A device that computes wrongly in every backward from step 3 on, on one rank (K 2 per rank, the default
    skip-micro). A wrong value that varies is named by the three ways its micro-batch came out; one that repeats
    its value, which the digests of two ranks cannot tell from its peer's, by a float64 recomputation on the host
    (whichever side of the disputed micro-batch the faulty rank is on). Either way the run stops at step 3 in one
    line naming that rank, applies nothing of step 3, and metrics.jsonl holds every replay and the bad step."""
    out = tmp_path / f"{fault}-{rank}"
    done = torchrun_cli(cli_args(corpus, out, "--replay-every", "1"), f"{fault}:step=3,rank={rank}")
    assert done.returncode != 0, done.stdout[-2000:]
    assert f"replay at step 3: the device of rank {rank} is suspect: " in done.stderr, done.stderr[-3000:]
    if fault == "bitflip-same":
        assert f"a float64 recomputation on the host (by rank {1 - rank}) sides with rank {1 - rank}" in done.stderr
    (bad,) = _records(out, "bad_step")
    assert (bad["step"], bad["action"], [s["rank"] for s in bad["suspects"]]) == (3, "stopped: device suspect", [rank])
    assert [s["step"] for s in _records(out, "step")] == [1, 2]
    replays = _records(out, "replay")
    assert [r["step"] for r in replays] == [1, 2, 3]
    assert [[c["matched"] for c in r["replays"]] for r in replays] == [[True, True], [True, True], [False, False]]
    assert [c["rerun_by"] for c in replays[0]["replays"]] == [[1], [0]]


@pytest.mark.slow
def test_a_kill_after_a_bad_step_resumes_exactly_and_the_window_judges_the_first_step_after_it(
    corpus: Path, tmp_path: Path
) -> None:
    """A bad step at 3, SIGKILL during step 23's accumulation, a resume from step 22 whose first step spikes: the
    spike is seen (the detector's window of 22 steps came back with the checkpoint), the first bad step's record
    survives the resume, and the run ends bitwise where one never killed ends."""
    steps = ["--max-steps", "24", "--eval-every", "0", "--save-every", "1"]
    bad_data = "nan-input:step=3,micro=1"
    spike = "spike-input:step=23,micro=2"
    golden = tmp_path / "golden"
    assert run_cli(cli_args(corpus, golden, *steps), fault=f"{bad_data};{spike}").returncode == 0
    out = tmp_path / "killed"
    killed = run_cli(cli_args(corpus, out, *steps), fault=f"{bad_data};kill:step=23,micro=1")
    assert killed.returncode != 0
    resumed = run_cli(cli_args(corpus, out, *steps), fault=spike)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "bad step 23: loss spike on rank 0, micro-batch 2" in resumed.stdout
    assert "of 22 steps" in resumed.stdout
    assert (
        [r["step"] for r in _records(out, "bad_step")] == [3, 23] == [r["step"] for r in _records(golden, "bad_step")]
    )
    assert_same_final_model(out, golden)
