"""``--objective grpo`` across processes (gloo on CPU): on a rollouts file, 2 DDP and 2 FSDP2 processes give one
process's parameters (uneven completions per rank, groups split across ranks); a sampled run on 2 processes
samples the same completions as on one (each prompt's generator is seeded by its draw, not its rank) and trains to
the same parameters; and a 2-process FSDP2 sampled run (its cached decoding a forward of the sharded model) killed
inside a step resumes bitwise.

Every test here starts processes, so the whole file is marked slow: ``make test`` runs it, ``make test-fast`` does
not."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from reliability_runs import assert_same_final_model, final_model, run_cli, step_losses

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("BIGBATCH_CACHE", str(tmp_path / "env-cache"))
    yield


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rewards-dist")
    gen = random.Random(1)
    text = root / "text.txt"
    text.write_text(" ".join(str(gen.randint(0, 99)) for _ in range(3000)) + "\n")
    rollouts = root / "rollouts.jsonl"
    lines = []
    for g in range(10):
        prompt = f"{gen.randint(0, 9)}+{gen.randint(0, 9)}="
        for _ in range(gen.randint(2, 5)):  # groups of uneven size, completions of uneven length
            completion = str(gen.randint(0, 18)) * gen.randint(1, 5) + "\n"
            lines.append({"group": g, "prompt": prompt, "completion": completion, "reward": float(gen.randint(0, 2))})
    rollouts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    # the same with the generating policy's log-probabilities: no rank runs a scoring forward, and a rank's
    # micro-batch of padding alone must not run one either (its collectives would no longer pair up)
    with_logps = root / "rollouts_logps.jsonl"
    for line in lines:
        line["logps"] = [-0.5 - 0.1 * i for i in range(len(str(line["completion"])))]
    with_logps.write_text("".join(json.dumps(line) + "\n" for line in lines))
    prompts = root / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n" for a in range(5) for b in range(5))
    )
    module = root / "digit_reward.py"
    module.write_text("def first_digit(row, completion):\n    return float(completion[:1] == row['answer'][:1])\n")
    return {
        "text": text,
        "rollouts": rollouts,
        "logps": with_logps,
        "prompts": prompts,
        "module": module,
        "cache": root / "cache",
    }


def args(data: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return [
        *("train", "--data", str(data["text"]), "--tokenizer", "byte", "--model", "pico", "--seq-len", "24"),
        *("--micro-batch", "2", "--max-steps", "3", "--sample-tokens", "0", "--cache-dir", str(data["cache"])),
        *("--objective", "grpo", "--prompts-per-step", "4", "--eval-every", "0", "--out", str(out), *extra),
    ]


def sampled(data: dict[str, Path]) -> list[str]:
    return [
        *("--prompts", str(data["prompts"]), "--reward", f"{data['module']}:first_digit", "--stop", "\\n"),
        *("--group-size", "3", "--max-completion-tokens", "4"),
    ]


def relative_l2(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    num = sum(float(((ours[k].double() - reference[k].double()) ** 2).sum()) for k in reference)
    den = sum(float((reference[k].double() ** 2).sum()) for k in reference)
    return (num / den) ** 0.5


def records(run_dir: Path) -> list[dict[str, float]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "step"]


def test_two_processes_train_a_rollouts_file_as_one_does(data: dict[str, Path], tmp_path: Path) -> None:
    """group-token-mean (the mode whose unit spans micro-batches and ranks: a group's shares), with the file's
    log-probabilities (no rank may run a scoring forward the others do not); the other modes across ranks are
    verify's (tests/integration/test_verify_rewards.py) and benchmarks/grpo_exactness.py's."""
    common = ["--rollouts", str(data["logps"]), "--loss-aggregation", "group-token-mean", "--clip-high", "0.28"]
    one = tmp_path / "one"
    done = run_cli(args(data, one, *common))
    assert done.returncode == 0, done.stderr[-2000:]
    for parallel in ("ddp", "fsdp"):
        out = tmp_path / parallel
        done = run_cli(args(data, out, *common, "--nproc", "2", "--parallel", parallel))
        assert done.returncode == 0, done.stderr[-2000:]
        assert relative_l2(final_model(out), final_model(one)) < 1e-5, parallel
        assert step_losses(out) == pytest.approx(step_losses(one), rel=1e-4, abs=1e-6)


def test_two_processes_sample_what_one_samples(data: dict[str, Path], tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    for out, extra in ((one, []), (two, ["--nproc", "2"])):
        done = run_cli(args(data, out, *sampled(data), *extra))
        assert done.returncode == 0, done.stderr[-2000:]
    # the same completions and rewards (each prompt's generator is seeded by its draw), the same training
    for ours, theirs in zip(records(two), records(one), strict=True):
        assert ours["reward/mean"] == theirs["reward/mean"]
        assert ours["completion/tokens"] == theirs["completion/tokens"]
    assert relative_l2(final_model(two), final_model(one)) < 1e-5


def test_a_two_process_fsdp_sampled_run_killed_inside_a_step_resumes_bitwise(
    data: dict[str, Path], tmp_path: Path
) -> None:
    extra = [*sampled(data), "--nproc", "2", "--parallel", "fsdp", "--updates-per-rollout", "2", "--save-every", "1"]
    golden = tmp_path / "golden"
    done = run_cli(args(data, golden, *extra))
    assert done.returncode == 0, done.stderr[-2000:]
    out = tmp_path / "run"
    killed = run_cli(args(data, out, *extra), fault="kill:step=2,micro=0")
    assert killed.returncode != 0
    resumed = run_cli(args(data, out, *extra))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert step_losses(out) == step_losses(golden)
    assert_same_final_model(out, golden)
