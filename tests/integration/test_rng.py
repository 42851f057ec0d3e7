"""Randomness: every rank its own training streams, the same model on every rank, streams that survive a
resume bitwise, and probes that leave every generator as they found it."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import corpus_bytes, run_main
from launch import SUPPORT, torchrun
from reliability_runs import make_config

import bigbatch.sizing.autobatch
import bigbatch.sizing.memory
from bigbatch.engine.rng import capture_rng_state, derive_rank_seeds, preserved_rng, seed_rank_generators
from bigbatch.models import preset
from bigbatch.run.checkpoints import checkpoint as ckpt
from bigbatch.run.loop.trainer import Trainer
from bigbatch.sizing.autobatch import choose_micro_batch
from bigbatch.sizing.memory import measure_in_process


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_bytes(corpus_bytes(60_000))
    return path


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Every generator of two :func:`capture_rng_state` results is equal (Python, NumPy, torch, CUDA)."""
    assert a.keys() == b.keys()
    for key in a:
        if key == "cuda":
            assert len(a[key]) == len(b[key]) and all(torch.equal(x, y) for x, y in zip(a[key], b[key], strict=True)), (
                key
            )
        elif torch.is_tensor(a[key]):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


def draws() -> tuple[float, float, list[float]]:
    """One draw from each global generator (advances them)."""
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


# ---- the derivation ------------------------------------------------------------------------------------


def test_rank_seeds_are_distinct_deterministic_and_not_seed_plus_rank() -> None:
    grid = {
        (seed, rank, step): derive_rank_seeds(seed, rank, step)
        for seed in (-1, 0, 1, 2, 1337, 2**40)
        for rank in range(4)
        for step in (0, 7)
    }
    for field in ("python", "numpy", "torch"):
        values = [getattr(s, field) for s in grid.values()]
        assert len(set(values)) == len(values), field  # (seed, rank) and (seed + 1, rank - 1) never collide
    assert derive_rank_seeds(1337, 1) == derive_rank_seeds(1337, 1, step=0)
    seed_rank_generators(5, 1)
    first = draws()
    seed_rank_generators(5, 1)
    assert draws() == first


# ---- probes --------------------------------------------------------------------------------------------


def test_preserved_rng_restores_every_generator_even_after_an_error() -> None:
    seed_rank_generators(11, 3)
    draws()  # not at a freshly seeded position
    if torch.cuda.is_available():
        torch.rand(3, device="cuda")
    before = capture_rng_state()
    with pytest.raises(RuntimeError), preserved_rng():
        random.seed(0), np.random.seed(0), torch.manual_seed(0)
        draws()
        if torch.cuda.is_available():
            for device in range(torch.cuda.device_count()):
                torch.rand(5, device=f"cuda:{device}")
        raise RuntimeError("the probe failed")  # e.g. out of memory
    assert_same_state(capture_rng_state(), before)
    expected = draws()

    @preserved_rng()
    def probe() -> None:
        torch.manual_seed(0)
        draws()

    seed_rank_generators(11, 3)
    draws()
    probe()
    assert draws() == expected


def in_process_measure(
    config: Any,
    micro_batch: int,
    seq_len: int,
    k: int = 4,
    device: Any = "cpu",
    precision: str = "fp32",
    activation_checkpointing: bool = False,
    chunked_loss: bool = True,
    optimizer: str = "adamw",
) -> Any:
    """:func:`bigbatch.sizing.memory.measure` as it runs on CUDA: in this process."""
    return bigbatch.sizing.memory.measure_in_process(
        config,
        micro_batch,
        seq_len,
        k,
        torch.device(device),
        precision,
        activation_checkpointing,
        chunked_loss,
        optimizer,
    )


def run_probe(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    config = preset("pico", vocab_size=61)
    monkeypatch.setattr(bigbatch.sizing.autobatch, "measure", in_process_measure)
    monkeypatch.setattr(bigbatch.sizing.memory, "measure", in_process_measure)
    if name == "measure_in_process":
        measure_in_process(config, 2, 16, 2, torch.device("cpu"))
    elif name == "auto micro-batch":
        choose_micro_batch(
            config, [1, 2, 4], 16, k=2, device=torch.device("cpu"), precision="fp32", memory_budget_mib=1e6
        )
    elif name == "plan --measure":
        code, out, err = run_main(
            [
                "plan",
                "--tokens-per-step",
                "64",
                "--seq-len",
                "16",
                "--micro-batch",
                "2",
                "--model",
                "pico",
                "--vocab-size",
                "61",
                "--measure",
            ]
        )
        assert code == 0, err
    elif name == "memory":
        code, out, err = run_main(
            ["memory", "--model", "pico", "--seq-len", "16", "--max-micro-batch", "2", "--k", "2"]
        )
        assert code == 0, err


@pytest.mark.slow
@pytest.mark.parametrize("probe", ["measure_in_process", "auto micro-batch", "plan --measure", "memory"])
def test_probes_leave_every_generator_as_they_found_it(probe: str, monkeypatch: pytest.MonkeyPatch) -> None:
    seed_rank_generators(21, 1)
    draws()
    before = capture_rng_state()
    run_probe(probe, monkeypatch)
    assert_same_state(capture_rng_state(), before)


@pytest.mark.slow
def test_rng_after_start_up_depends_on_the_seed_not_on_micro_batch_auto(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--micro-batch auto`` on CUDA probes in this process; simulated on CPU by measuring in-process."""
    monkeypatch.setattr(bigbatch.sizing.autobatch, "measure", in_process_measure)
    probed: list[int] = []
    real_measure_in_process = bigbatch.sizing.memory.measure_in_process

    def counting(*args: Any, **kwargs: Any) -> Any:
        probed.append(args[1])
        return real_measure_in_process(*args, **kwargs)

    monkeypatch.setattr(bigbatch.sizing.memory, "measure_in_process", counting)

    def started(name: str, micro_batch: int, seed: int = 1337) -> tuple[Trainer, dict[str, Any]]:
        config = make_config(corpus, tmp_path / name, seed=seed)
        config.batch.micro_batch, config.batch.memory_budget = micro_batch, 1e6
        trainer = Trainer(config)
        return trainer, capture_rng_state()

    auto, auto_state = started("auto", 0)
    assert probed, "the probe did not run in this process"
    fixed, fixed_state = started("fixed", auto.plan.micro_batch)
    assert auto.plan == fixed.plan
    assert_same_state(auto_state, fixed_state)
    _, other_seed = started("other", auto.plan.micro_batch, seed=1338)
    assert not torch.equal(other_seed["torch"], fixed_state["torch"])
    assert not torch.equal(other_seed["numpy_keys"], fixed_state["numpy_keys"])
    assert not torch.equal(other_seed["python_state"], fixed_state["python_state"])


def test_resume_onto_another_world_size_derives_the_streams_at_the_resumed_step(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "run"
    config = make_config(corpus, out, max_steps=2, save_every=2, eval_every=0)
    Trainer(config).train()
    real_load = ckpt.load_checkpoint

    def saved_by_two_ranks(path: Path, **options: Any) -> dict[str, Any]:
        document = real_load(path, **options)
        return {**document, "world_size": 2, "rng": document["rng"] * 2}

    monkeypatch.setattr("bigbatch.run.checkpoints.state.load_checkpoint", saved_by_two_ranks)
    resumed = Trainer(make_config(corpus, out, max_steps=4, save_every=2, eval_every=0))
    assert resumed.resumed_from is not None and resumed.engine.step_count == 2
    state = capture_rng_state()
    seed_rank_generators(1337, 0, step=2)
    assert_same_state(state, capture_rng_state())


# ---- two processes -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_rank_start(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("ranks")
    torchrun(str(SUPPORT / "rng_worker.py"), str(corpus), str(out))
    return torch.load(out / "result.pt", weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_ranks_draw_different_dropout_masks_from_the_same_model(
    two_rank_start: dict[str, Any], corpus: Path, tmp_path: Path, parallel: str
) -> None:
    got = two_rank_start[parallel]
    assert got["world"] == 2
    rank0, rank1 = got["ranks"]
    assert rank0["mask"].any() and rank0["mask"].shape == rank1["mask"].shape
    assert not torch.equal(rank0["mask"], rank1["mask"])  # each rank drops its own units for its own samples
    assert not torch.equal(rank0["rng"]["torch"], rank1["rng"]["torch"])
    assert not torch.equal(rank0["rng"]["numpy_keys"], rank1["rng"]["numpy_keys"])
    assert not torch.equal(rank0["rng"]["python_state"], rank1["rng"]["python_state"])
    # The same model on every rank at start (FSDP2 does not broadcast: each rank's shards are its own init),
    # equal to a single process's; and rank 0 draws the single process's stream (a documented choice).
    single = Trainer(make_config(corpus, tmp_path / "single", max_steps=1, eval_every=0))
    single_state = capture_rng_state()
    for name, value in single.model.state_dict().items():
        assert torch.equal(got["model"][name], value), name
    assert_same_state(rank0["rng"], single_state)
