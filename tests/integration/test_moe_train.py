"""The mixture-of-experts family through every command: train (the router line, the router loss and expert load in
every step record, the summary and the report; bitwise resume after SIGKILL with dropout), verify (exact is
EQUIVALENT, running and micro are named), export (loaded back by transformers as Mixtral) and --init-from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import corpus_bytes, run_main
from reliability_runs import cli_args, final_model, run_cli, step_losses

from bigbatch.models.moe.model import MoE, MoEConfig
from bigbatch.run.checkpoints import checkpoint as ckpt

TRAIN = ["--seq-len", "32", "--micro-batch", "4", "--total-batch-tokens", "512", "--sample-tokens", "0"]


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("moe")
    (path / "corpus.txt").write_bytes(corpus_bytes(60_000))
    return path


def train_argv(workspace: Path, out: Path, *extra: str) -> list[str]:
    data = ["--data", str(workspace / "corpus.txt"), "--cache-dir", str(workspace / "cache")]
    return ["train", *data, "--out", str(out), *TRAIN, *extra]


@pytest.fixture(scope="module")
def run(workspace: Path) -> tuple[Path, str]:
    """A moe-pico run of 3 steps (K = 4) with validation: its directory and what it printed."""
    out = workspace / "run"
    argv = train_argv(workspace, out, "--model", "moe-pico", "--max-steps", "3", "--eval-every", "3")
    code, stdout, stderr = run_main(argv)
    assert code == 0, stdout + stderr
    return out, stdout


@pytest.mark.slow
def test_a_moe_run_says_its_router_and_records_its_loss_and_load(run: tuple[Path, str], tmp_path: Path) -> None:
    out, stdout = run
    assert "moe: 2 layers, 2 heads (1 key/value), 32 wide, 4 experts of 32, top-2" in stdout
    assert "router | top-2 of 4 experts | balance exact (over the whole step, from a routing pass) x 0.01" in stdout
    assert "| router 0.01" in stdout and "| load max/mean " in stdout
    assert "experts | last step: router loss" in stdout
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if r["kind"] == "step"]
    assert len(steps) == 3 and all(r["micro_batches"] == 4 for r in steps)
    for record in steps:
        assert record["router_replay_mismatch"] == 0.0  # the routing pass counted what training routed
        assert record["router_loss"] == pytest.approx(0.01 * record["router_balance_loss"])
        assert record["expert_load_cv"] == max(record["expert_load_cv/0"], record["expert_load_cv/1"])
        assert record["expert_load_max_over_mean"] >= 1.0
    assert ckpt.load_checkpoint(out)["model_family"] == "moe"
    code, stdout, stderr = run_main(["report", str(out), "--out", str(tmp_path / "report")])
    assert code == 0, stdout + stderr
    assert (tmp_path / "report" / "expert_load.png").is_file() and (tmp_path / "report" / "router_loss.png").is_file()
    assert "experts            router loss" in (tmp_path / "report" / "summary.txt").read_text()


@pytest.mark.slow
def test_export_loads_in_transformers_and_init_from_trains_it(
    run: tuple[Path, str], workspace: Path, tmp_path: Path
) -> None:
    transformers = pytest.importorskip("transformers")
    out, _ = run
    code, stdout, stderr = run_main(["export", str(out), str(tmp_path / "hf")])
    assert code == 0, stdout + stderr
    assert "MixtralForCausalLM layout" in stdout
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True).eval()
    document = ckpt.load_checkpoint(out)
    ours = MoE(MoEConfig.from_dict(document["model_config"])).eval()
    ours.load_state_dict(document["model"])
    tokens = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(theirs(input_ids=tokens).logits, ours(tokens), rtol=1e-5, atol=1e-5)
    code, stdout, stderr = run_main(
        train_argv(workspace, tmp_path / "again", "--init-from", str(tmp_path / "hf"), "--max-steps", "1")
    )
    assert code == 0, stdout + stderr
    assert "router | top-2 of 4 experts" in stdout


@pytest.mark.slow
def test_verify_is_equivalent_in_exact_and_names_the_router_loss_otherwise() -> None:
    code, stdout, stderr = run_main(["verify", "--model", "moe-pico", "--top", "0"])
    assert code == 0, stdout + stderr
    assert stdout.strip().endswith("verdict: EQUIVALENT")
    code, stdout, stderr = run_main(["verify", "--model", "moe-pico", "--top", "0", "--router-balance", "micro"])
    assert code == 1, stdout + stderr
    assert "<router loss> [router] the load-balancing loss couples the micro-batches: --router-balance micro" in stdout
    assert "verdict: NOT EQUIVALENT" in stdout


@pytest.mark.slow
def test_sigkill_then_resume_is_bitwise_identical(workspace: Path, tmp_path: Path) -> None:
    """moe-pico with dropout (the routing pass replays the generators) killed inside step 5 resumes from step 4 and
    ends with the loss sequence and parameters of a run that never stopped."""

    def args(out: Path, *extra: str) -> list[str]:
        argv = cli_args(workspace / "corpus.txt", out, "--dropout", "0.1", *extra)
        argv[argv.index("--model") + 1] = "moe-pico"
        return argv

    golden = tmp_path / "golden"
    done = run_cli(args(golden))
    assert done.returncode == 0, done.stderr[-2000:]
    out = tmp_path / "run"
    killed = run_cli(args(out, "--save-every", "2"), fault="kill:step=5,micro=2")
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed = run_cli(args(out, "--save-every", "2"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout and "at step 4" in resumed.stdout
    assert step_losses(out) == step_losses(golden)  # bitwise: == on floats
    golden_model, model = final_model(golden), final_model(out)
    assert "model.layers.0.mlp.experts.gate_up_proj" in model
    for name, value in golden_model.items():
        assert torch.equal(model[name], value), name
