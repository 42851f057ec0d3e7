"""Documents packed into rows through ``bigbatch train``: on by default, exact against the giant batch, visible in
the header, the step records and the run's summary, resumed bitwise, and refused or left off where it cannot
hold (an hf: model whose attention ignores position_ids, a checkpoint read the other way)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from exactness import assert_big_batch_updates, capture_training
from helpers import assert_one_line_error, run_main
from reliability_runs import final_model

from bigbatch.models.hf.model import HFCausalLM
from bigbatch.run.configuration.train_config import TrainConfig
from bigbatch.run.loop.trainer import Trainer


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Prompt/completion pairs of very different lengths (most far shorter than a row), prompts masked."""
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    rows = [{"prompt": f"f{i}(" + "x," * (i % 4) + ")=", "completion": " ok" * (1 + i % 6)} for i in range(200)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def argv(pairs: Path, out: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--data",
        str(pairs),
        "--data-mode",
        "documents",
        "--model",
        "pico",
        "--seq-len",
        "64",
        "--micro-batch",
        "4",
        "--total-batch-tokens",
        "512",
        "--sample-tokens",
        "0",
        "--eval-every",
        "0",
        "--cache-dir",
        str(out.parent / "cache"),
        "--out",
        str(out),
        *extra,
    ]


def step_records(run_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "step"]


def test_packing_is_the_default_and_says_where_the_positions_go(pairs: Path, tmp_path: Path) -> None:
    code, packed_out, err = run_main(argv(pairs, tmp_path / "packed", "--max-steps", "3"))
    assert code == 0, packed_out + err
    code, padded_out, err = run_main(argv(pairs, tmp_path / "padded", "--max-steps", "3", "--pack", "off"))
    assert code == 0, padded_out + err
    assert "documents | packed into" in packed_out and "(--pack on)" in packed_out
    assert "one per row of 64 (--pack off)" in padded_out
    plan_packed, plan_padded = (
        next(line for line in out.splitlines() if line.startswith("plan | ")) for out in (packed_out, padded_out)
    )
    assert plan_packed.startswith(
        "plan | micro_batch 4 x seq_len 64 x K 2 x world 1 = 512 tokens/step (positions; packed rows: whole "
        "documents, or windows of long ones, back to back, positions restarting at each; normalized by the valid "
        "targets of each step) | last window: "
    )
    assert plan_padded.startswith(
        "plan | micro_batch 4 x seq_len 64 x K 2 x world 1 = 512 tokens/step (positions; one document, or one "
        "window of a long one, per sequence; normalized by the valid targets of each step) | last window: "
    )
    packed, padded = step_records(tmp_path / "packed"), step_records(tmp_path / "padded")
    for records in (packed, padded):
        for r in records:
            assert 0 <= r["padding_share"] < 1 and 0 < r["prompt_share"] < 1
            valid_share = 1 - r["padding_share"] - r["prompt_share"]
            assert r["tokens"] == pytest.approx(valid_share * 512 * r["micro_batches"] / 2, abs=0.5)  # K 2 of 4 x 64
    # the same positions per step, far less of them padding: more valid targets per step
    assert max(r["padding_share"] for r in packed) < 0.15 < min(r["padding_share"] for r in padded)
    assert sum(r["tokens"] for r in packed) > 1.5 * sum(r["tokens"] for r in padded)
    assert "positions |" in packed_out and "% padding" in packed_out.split("positions |")[1]
    for run, packs in (("packed", True), ("padded", False)):  # metrics.jsonl: the epoch's layout, for the run
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        (layout,) = [r for r in map(json.loads, lines) if r["kind"] == "documents"]
        assert layout["step"] == 0 and layout["packed"] is packs and layout["seq_len"] == 64
        assert 0 <= layout["padding_share"] < 1 and 0 < layout["prompt_share"] < 1


def test_a_packed_run_is_the_giant_batch_of_its_documents(pairs: Path, tmp_path: Path) -> None:
    config = TrainConfig()
    config.data.data, config.data.data_mode, config.data.cache_dir = str(pairs), "documents", str(tmp_path / "cache")
    config.model.preset, config.batch.seq_len, config.batch.micro_batch = "pico", 64, 2
    config.batch.total_batch_tokens = 64 * 2 * 3
    config.run.max_steps, config.run.eval_every, config.run.sample_tokens = 3, 0, 0
    config.run.out, config.run.device = str(tmp_path / "run"), "cpu"
    trainer = Trainer(config, prefetch=False)
    initial, steps, logged = capture_training(trainer)
    assert all(mb.positions is not None for step in steps for mb in step)
    assert any(int((mb.positions == 0).sum(dim=1).max()) > 2 for step in steps for mb in step)  # rows share
    assert_big_batch_updates(trainer.model, initial, steps, logged)


def test_a_packed_run_resumes_bitwise(pairs: Path, tmp_path: Path) -> None:
    whole, split = tmp_path / "whole", tmp_path / "split"
    schedule = ["--warmup-steps", "1", "--decay-steps", "4"]  # the same learning rates whatever --max-steps says
    assert run_main(argv(pairs, whole, "--max-steps", "4", *schedule))[0] == 0
    assert run_main(argv(pairs, split, "--max-steps", "2", *schedule))[0] == 0
    assert run_main(argv(pairs, split, "--max-steps", "4", *schedule))[0] == 0
    assert [r["loss"] for r in step_records(split)] == [r["loss"] for r in step_records(whole)]
    one, other = final_model(whole), final_model(split)
    assert all(torch.equal(one[name], other[name]) for name in one)


def test_resuming_a_packed_run_unpacked_is_a_one_line_error(pairs: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert run_main(argv(pairs, out, "--max-steps", "1"))[0] == 0
    code, stdout, stderr = run_main(argv(pairs, out, "--max-steps", "2", "--pack", "off"))
    message = assert_one_line_error(code, stdout, stderr)
    assert "pack" in message


def test_an_hf_model_whose_attention_ignores_positions_is_not_packed(
    pairs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hf_models import save_hf

    save_hf("llama", tmp_path / "model", max_position_embeddings=64)
    monkeypatch.setattr(HFCausalLM, "_probe", lambda self: (True, False))  # as if transformers ignored them
    model = ["--model", f"hf:{tmp_path / 'model'}", "--max-steps", "1"]
    code, stdout, stderr = run_main(argv(pairs, tmp_path / "on", *model, "--pack", "on"))
    message = assert_one_line_error(code, stdout, stderr)
    assert "--pack on" in message and "position_ids" in message and "--pack off" in message
    code, stdout, stderr = run_main(argv(pairs, tmp_path / "auto", *model))
    assert code == 0, stdout + stderr
    assert "one document per row (--pack off)" in stdout + stderr and "(--pack off)" in stdout


def test_an_hf_model_whose_head_cannot_be_taken_apart_says_so_once(
    pairs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hf_models import save_hf

    save_hf("llama", tmp_path / "model", max_position_embeddings=64)
    monkeypatch.setattr(HFCausalLM, "_probe", lambda self: (False, True))  # as if it capped its logits
    code, stdout, stderr = run_main(
        argv(pairs, tmp_path / "run", "--model", f"hf:{tmp_path / 'model'}", "--max-steps", "1")
    )
    assert code == 0, stdout + stderr
    assert (stdout + stderr).count("--chunked-loss has no effect") == 1
