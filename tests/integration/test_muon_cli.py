"""``--optimizer muon`` from the command line: a run trains with finite metrics and says what each half trains;
bad values and Muon with LoRA are refused in one line with nothing written; a run stopped mid-way resumes to the
bitwise same parameters as one never stopped (the momentum is in the checkpoint); another optimizer on resume is
refused by name."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers import assert_one_line_error, corpus_bytes, run_main, snapshot
from reliability_runs import Crash, assert_same_final_model, crash_at, make_config, step_losses

from bigbatch.run.configuration.train_config import TrainConfig
from bigbatch.run.loop.trainer import Trainer


def train_args(root: Path, out: str, *extra: str, cache: str = "cache") -> list[str]:
    return [
        *("train", "--data", str(root / "corpus.txt"), "--model", "pico", "--seq-len", "32", "--micro-batch", "4"),
        *("--total-batch-tokens", "256", "--max-steps", "2", "--eval-every", "0", "--sample-tokens", "0"),
        *("--cache-dir", str(root / cache), "--out", str(root / out), *extra),
    ]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A corpus, its prepared cache and a finished two-step Muon run (``muon-run``); the run's stdout."""
    root = tmp_path_factory.mktemp("muon")
    (root / "corpus.txt").write_bytes(corpus_bytes(30_000))
    code, out, err = run_main(train_args(root, "muon-run", "--optimizer", "muon"))
    assert code == 0, out + err
    return root, out


def test_a_muon_run_says_what_each_half_trains_and_its_metrics_are_finite(workspace: tuple[Path, str]) -> None:
    root, out = workspace
    lines = [line for line in out.splitlines() if line.startswith("optimizer |")]
    assert len(lines) == 1, out
    line = lines[0]
    assert "Muon lr 0.002, momentum 0.95" in line and "AdamW lr 0.002" in line, line
    assert "8 hidden matrices" in line, line  # pico: 2 blocks x (c_attn, attn c_proj, c_fc, mlp c_proj)
    records = [json.loads(row) for row in (root / "muon-run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:
        assert not record["skipped"]
        assert math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"]) and record["grad_norm"] > 0
    config = (root / "muon-run" / "config.toml").read_text()
    assert 'optimizer = "muon"' in config


REFUSED = [
    pytest.param(("--optimizer", "sgdd"), ("got 'sgdd'", "adamw or muon"), id="optimizer-sgdd"),
    pytest.param(("--optimizer", "adamm"), ("did you mean adamw?",), id="optimizer-typo"),
    pytest.param(("--muon-coefficient", "quintic"), ("did you mean --muon-coefficients?",), id="flag-typo"),
    pytest.param(("--optimizer", "muon", "--muon-momentum", "-0.1"), ("--muon-momentum",), id="momentum-negative"),
    pytest.param(("--optimizer", "muon", "--muon-momentum", "1"), ("--muon-momentum",), id="momentum-one"),
    pytest.param(("--optimizer", "muon", "--muon-ns-steps", "0"), ("--muon-ns-steps",), id="ns-steps-zero"),
    pytest.param(
        ("--optimizer", "muon", "--muon-coefficients", "cubic"),
        ("muon_coefficients", "quintic or polar-express", "'cubic'"),
        id="coefficients-cubic",
    ),
    pytest.param(("--optimizer", "muon", "--muon-scale", "frobenius"), ("muon_scale",), id="scale"),
    pytest.param(("--optimizer", "muon", "--muon-lr", "-1"), ("--muon-lr",), id="muon-lr-negative"),
    pytest.param(("--batch-change-momentum", "halve"), ("batch_change_momentum",), id="batch-change-momentum"),
    pytest.param(("--optimizer", "MUON"), ("did you mean muon?",), id="optimizer-upper-case"),
    pytest.param(("--optimizer", "muon", "--muon-ns-steps", "100"), ("--muon-ns-steps", "[1, 50]"), id="ns-steps-100"),
    pytest.param(
        ("--batch-change-momentum", "keep"),
        ("--batch-change-momentum keep applies to --optimizer muon",),
        id="momentum-rule-without-muon",
    ),
    pytest.param(
        ("--muon-lr", "0.02"),
        ("--muon-lr 0.02 applies to --optimizer muon", "trains with adamw"),
        id="muon-flag-without-muon",
    ),
    pytest.param(
        ("--optimizer", "muon", "--lora-rank", "4"),
        ("--optimizer muon does not train LoRA adapters", "--optimizer adamw"),
        id="muon-with-lora",
    ),
]


@pytest.mark.parametrize(("extra", "says"), REFUSED)
def test_bad_muon_settings_are_one_line_and_write_nothing(
    workspace: tuple[Path, str], extra: tuple[str, ...], says: tuple[str, ...]
) -> None:
    root, _ = workspace
    before = snapshot(root)
    line = assert_one_line_error(*run_main(train_args(root, "new-run", *extra)))
    for fragment in says:
        assert fragment in line, line
    assert not (root / "new-run").exists()
    assert snapshot(root) == before  # the cache, the corpus and the finished run untouched


def test_muon_with_lora_is_refused_before_anything_is_prepared(workspace: tuple[Path, str]) -> None:
    root, _ = workspace
    line = assert_one_line_error(
        *run_main(train_args(root, "new-run", "--optimizer", "muon", "--lora-rank", "4", cache="fresh-cache"))
    )
    assert "LoRA" in line
    assert not (root / "fresh-cache").exists()


def test_resuming_with_another_optimizer_is_refused_by_name(workspace: tuple[Path, str]) -> None:
    root, _ = workspace
    before = snapshot(root)
    line = assert_one_line_error(*run_main(train_args(root, "muon-run", "--optimizer", "adamw")))
    assert "optim.optimizer 'muon' -> 'adamw'" in line
    assert snapshot(root) == before


# ---- resume ----------------------------------------------------------------------------------------------------


def muon_config(corpus: Path, out: Path) -> TrainConfig:
    config = make_config(corpus, out, max_steps=4, save_every=2, eval_every=0)  # pico, dropout 0.1, K = 4
    config.optim.optimizer = "muon"
    config.optim.warmup_steps = 1
    return config


def test_a_stopped_muon_run_resumes_bitwise(tmp_path: Path) -> None:
    """Four steps straight, against two steps, a crash inside step 3 and a resume from the step-2 checkpoint: the
    same losses and bitwise the same parameters (Muon's momentum buffers come back from the checkpoint)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(corpus_bytes(30_000))
    golden = tmp_path / "golden"
    Trainer(muon_config(corpus, golden)).train()
    out = tmp_path / "run"
    trainer = Trainer(muon_config(corpus, out))
    crash_at(trainer, 3, micro=1)
    with pytest.raises(Crash):
        trainer.train()
    resumed = Trainer(muon_config(corpus, out))
    assert resumed.resumed_from is not None and resumed.engine.step_count == 2
    optimizer = resumed.engine.optimizer
    muon_groups = [g for g in optimizer.param_groups if g.get("muon")]
    assert muon_groups and all(optimizer.state[p]["momentum_buffer"].any() for p in muon_groups[0]["params"])
    resumed.train()
    assert len(step_losses(golden)) == 4
    assert step_losses(out) == step_losses(golden)  # bitwise: == on floats
    assert_same_final_model(out, golden)


def test_verify_refuses_muon_on_lora_adapters_as_train_does() -> None:
    line = assert_one_line_error(
        *run_main(["verify", "--model", "pico", "--seq-len", "16", "--optimizer", "muon", "--lora-rank", "4"])
    )
    assert "--optimizer muon does not train LoRA adapters" in line, line


@pytest.mark.parametrize("extra", [("--nproc", "2"), ("--objective", "dpo")])
def test_verify_refuses_muon_where_it_would_not_compare_the_muon_update(extra: tuple[str, ...]) -> None:
    line = assert_one_line_error(
        *run_main(["verify", "--model", "pico", "--seq-len", "16", "--optimizer", "muon", *extra])
    )
    assert "verify --optimizer muon compares the update of one process" in line and f"leave out {extra[0]}" in line
