"""Sharded checkpoints (torch.distributed.checkpoint) in real processes: a save killed at any point, damaged
checkpoints, asynchronous saves, resuming on another world size, restarts by torchrun's elastic agent (which
``bigbatch train --nproc N --max-restarts M`` runs, as ``torchrun --max-restarts M`` would), and two nodes on the
loopback."""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import corpus_bytes
from reliability_runs import STEPS, assert_same_final_model, cli_args, final_model, make_config, run_cli, step_losses

from bigbatch.errors import CheckpointError
from bigbatch.run.checkpoints import checkpoint as ckpt
from bigbatch.run.loop.trainer import Trainer

SUPPORT = Path(__file__).resolve().parents[1] / "support"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_bytes(corpus_bytes(60_000))
    return path


@pytest.fixture(scope="module")
def golden(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One process, a checkpoint every step, none pruned (the kill tests' reference)."""
    out = tmp_path_factory.mktemp("golden") / "run"
    Trainer(make_config(corpus, out, save_every=1, keep_checkpoints=0)).train()
    return out


@pytest.fixture(scope="module")
def golden_fsdp(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two FSDP2 processes through ``bigbatch train --nproc 2``, a checkpoint every 2 steps."""
    out = tmp_path_factory.mktemp("golden_fsdp") / "run"
    done = run_cli(cli_args(corpus, out, "--nproc", "2", "--parallel", "fsdp", "--save-every", "2"))
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def relative_l2(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    assert set(ours) == set(reference)
    num = sum(float(((ours[k].double() - reference[k].double()) ** 2).sum()) for k in reference)
    den = sum(float((reference[k].double() ** 2).sum()) for k in reference)
    return (num / den) ** 0.5


def rewound(run: Path, to: Path, step: int) -> Path:
    """A copy of ``run`` whose checkpoints after ``step`` are gone (as if it had stopped there)."""
    shutil.copytree(run, to)
    for path in ckpt.list_checkpoints(to):
        if ckpt.checkpoint_step(path) > step:
            ckpt.remove_checkpoint(path)
    return to


def snapshot(folder: Path) -> dict[Path, tuple[int, int]]:
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()}


# ---- a save killed at any point --------------------------------------------------------------------------


def kill_points() -> list[tuple[str, int, bool]]:
    draws = random.Random(32)
    shard, in_background = draws.randrange(0, 400_000), draws.randrange(0, 400_000)
    return [("state", 0, False), ("shard", shard, False), ("marker", 0, False), ("shard", in_background, True)]


@pytest.mark.slow
@pytest.mark.parametrize(("point", "offset", "asynchronous"), kill_points())
def test_a_save_killed_at_any_point_leaves_the_previous_checkpoint_newest_and_resumes_bitwise(
    corpus: Path, golden: Path, tmp_path: Path, point: str, offset: int, asynchronous: bool
) -> None:
    out = tmp_path / "run"
    # Steps 1-2 run in the child, the rest here after the resume, the golden run all here: bitwise only with the
    # same number of threads as this process (the suite runs with 2 and with 1).
    threads = str(torch.get_num_threads())
    env = {**os.environ, "OMP_NUM_THREADS": threads, "PYTHONPATH": os.pathsep.join([str(SUPPORT), *sys.path])}
    command = [sys.executable, str(SUPPORT / "kill_mid_save.py"), str(corpus), str(out), point, str(offset)]
    killed = subprocess.run([*command, *(["async"] if asynchronous else [])], env=env, capture_output=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert ckpt.latest_valid_checkpoint(out) == ckpt.checkpoint_path(out, 2)
    assert ckpt.verify_checkpoint(ckpt.checkpoint_path(out, 3)) is not None  # there, or partly, but never trusted
    Trainer(make_config(corpus, out, save_every=1, keep_checkpoints=0)).train()  # re-saves step 3 from scratch
    assert_same_final_model(out, golden)
    assert ckpt.verify_checkpoint(ckpt.checkpoint_path(out, 3)) is None


# ---- damaged checkpoints ---------------------------------------------------------------------------------


def damage(folder: Path, how: str) -> str:
    """Damage a sharded checkpoint; returns what the refusal must name."""
    shard = folder / "__0_0.distcp"
    if how == "missing shard":
        shard.unlink()
        return "__0_0.distcp is missing"
    if how == "corrupted shard":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
        return "does not match the commit marker's checksum"
    for path in folder.iterdir():  # a marker without its shards
        if path.name != "state.pt":
            path.unlink()
    return "is missing"


@pytest.mark.slow
@pytest.mark.parametrize("how", ["missing shard", "corrupted shard", "marker without shards"])
def test_a_damaged_sharded_checkpoint_is_one_line_and_nothing_is_overwritten(
    golden: Path, corpus: Path, tmp_path: Path, how: str
) -> None:
    run = rewound(golden, tmp_path / "run", step=1)
    says = damage(ckpt.checkpoint_path(run, 1), how)
    before = snapshot(run)
    sample = run_cli(["sample", "--checkpoint", str(ckpt.checkpoint_path(run, 1)), "--max-new-tokens", "4"])
    assert sample.returncode == 2, sample.stderr[-2000:]
    (line,) = sample.stderr.strip().splitlines()
    assert line.startswith("bigbatch: error: ") and says in line and "step_0000001" in line
    with pytest.raises(CheckpointError, match="none is complete and valid") as refused:
        Trainer(make_config(corpus, run, save_every=1, keep_checkpoints=0))
    assert "\n" not in str(refused.value)
    assert snapshot(run) == before


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(golden: Path, corpus: Path, tmp_path: Path) -> None:
    run = rewound(golden, tmp_path / "run", step=3)
    damage(ckpt.checkpoint_path(run, 3), "corrupted shard")
    trainer = Trainer(make_config(corpus, run, save_every=1, keep_checkpoints=0))
    assert trainer.resumed_from == ckpt.checkpoint_path(run, 2)
    trainer.train()
    assert_same_final_model(run, golden)


@pytest.mark.slow
def test_an_index_that_would_run_code_is_refused(golden: Path, tmp_path: Path) -> None:
    import pickle

    run = rewound(golden, tmp_path / "run", step=1)
    folder = ckpt.checkpoint_path(run, 1)
    (folder / ".metadata").write_bytes(pickle.dumps(os.system))  # a global the index has no use for
    from bigbatch.run.checkpoints.sharded import read_index

    with pytest.raises(pickle.UnpicklingError, match="no place in a checkpoint index"):
        read_index(folder)


@pytest.mark.slow
def test_a_single_file_checkpoint_of_earlier_bigbatch_still_resumes_bitwise_and_samples(
    golden: Path, corpus: Path, tmp_path: Path
) -> None:
    """Step 3 rewritten in the format earlier bigbatch wrote (one ``step_0000003.pt``: the whole model and
    optimizer, gathered): sample reads it, and training resumes from it to the golden run's parameters."""
    run = rewound(golden, tmp_path / "run", step=3)
    document = ckpt.load_checkpoint(ckpt.checkpoint_path(run, 3))
    old = {k: v for k, v in document.items() if k not in ("format", "version", "shards", "optimizer_param_groups")}
    ckpt.remove_checkpoint(ckpt.checkpoint_path(run, 3))
    single = ckpt.save_checkpoint(old, ckpt.single_file_path(run, 3))
    assert ckpt.latest_valid_checkpoint(run) == single
    sample = run_cli(["sample", "--checkpoint", str(run), "--max-new-tokens", "4", "--seed", "1"])
    assert sample.returncode == 0, sample.stderr[-2000:]
    trainer = Trainer(make_config(corpus, run, save_every=1, keep_checkpoints=0))
    assert trainer.resumed_from == single
    trainer.train()
    assert ckpt.is_sharded(ckpt.latest_valid_checkpoint(run))  # what it writes from then on
    assert_same_final_model(run, golden)


# ---- asynchronous saves ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_asynchronous_saves_commit_every_checkpoint_and_change_nothing(
    golden: Path, corpus: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    Trainer(make_config(corpus, out, save_every=1, keep_checkpoints=3, async_checkpoint=True)).train()
    assert [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(out)] == [STEPS - 2, STEPS - 1, STEPS]
    assert all(ckpt.verify_checkpoint(p) is None for p in ckpt.list_checkpoints(out))
    for step in range(STEPS - 2, STEPS + 1):  # every one holds its own step's state, not a later one's
        ours = ckpt.load_checkpoint(ckpt.checkpoint_path(out, step))
        theirs = ckpt.load_checkpoint(ckpt.checkpoint_path(golden, step))
        assert ours["engine"] == theirs["engine"] and ours["loader"] == theirs["loader"]
        for name, value in theirs["model"].items():
            assert torch.equal(ours["model"][name], value), (step, name)


# ---- another world size on resume -----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 4])
def test_a_two_process_fsdp_run_resumes_on_another_world_size(
    golden_fsdp: Path, corpus: Path, tmp_path: Path, world: int
) -> None:
    run = rewound(golden_fsdp, tmp_path / "run", step=4)
    done = run_cli(cli_args(corpus, run, "--nproc", str(world), "--parallel", "fsdp", "--save-every", "2"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"at step 4 (1,024 tokens) | world size 2 -> {world}" in done.stdout
    assert relative_l2(final_model(run), final_model(golden_fsdp)) <= 1e-5


@pytest.mark.slow
def test_a_one_process_run_resumes_on_two_ddp_processes(corpus: Path, tmp_path: Path) -> None:
    whole = tmp_path / "whole"
    assert run_cli(cli_args(corpus, whole, "--save-every", "2")).returncode == 0
    run = rewound(whole, tmp_path / "run", step=2)
    done = run_cli(cli_args(corpus, run, "--nproc", "2", "--parallel", "ddp", "--save-every", "2"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "world size 1 -> 2" in done.stdout
    assert relative_l2(final_model(run), final_model(whole)) <= 1e-5


@pytest.mark.slow
def test_a_world_size_that_cannot_keep_the_tokens_per_step_names_the_ones_that_can(
    golden_fsdp: Path, corpus: Path, tmp_path: Path
) -> None:
    run = rewound(golden_fsdp, tmp_path / "run", step=4)
    before = snapshot(run)
    done = run_cli(cli_args(corpus, run, "--nproc", "3", "--parallel", "fsdp"))
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert "total_batch_tokens=256" in line and "keep both with 1, 2, 4 processes" in line
    assert snapshot(run) == before


# ---- restarts without a person ---------------------------------------------------------------------------


def restarts(run: Path) -> list[dict[str, object]]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "restart"]


DDP_DROPOUT = ("--nproc", "2", "--parallel", "ddp", "--dropout", "0.1")
FSDP = ("--nproc", "2", "--parallel", "fsdp")


@pytest.fixture(scope="module")
def golden_ddp_dropout(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two DDP processes with dropout 0.1 (each rank draws its masks from its own generators), a checkpoint
    every 2 steps."""
    out = tmp_path_factory.mktemp("golden_ddp") / "run"
    done = run_cli(cli_args(corpus, out, *DDP_DROPOUT, "--save-every", "2"))
    assert done.returncode == 0, done.stderr[-3000:]
    document = ckpt.load_checkpoint(out)
    assert not torch.equal(document["rng"][0]["torch"], document["rng"][1]["torch"])  # each rank its own stream
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "timeout", "settings", "golden_run"),
    [
        ("kill:step=5,micro=1,rank=1", "60", DDP_DROPOUT, "golden_ddp_dropout"),
        ("hang:step=5,rank=0", "10", FSDP, "golden_fsdp"),
    ],
    ids=["kill-ddp-dropout", "hang-fsdp"],
)
def test_a_failed_worker_restarts_the_group_which_resumes_by_itself_bitwise(
    corpus: Path,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    fault: str,
    timeout: str,
    settings: tuple[str, ...],
    golden_run: str,
) -> None:
    """A worker SIGKILLed inside step 5, or one hung there past --collective-timeout, brings the group down;
    torchrun's agent starts it again, it resumes from step 4 by itself (every rank's generators too: with
    dropout the masks depend on them) and ends with the losses and parameters of a run that never stopped."""
    golden = request.getfixturevalue(golden_run)
    out = tmp_path / "run"
    args = cli_args(corpus, out, *settings, "--save-every", "2", "--max-restarts", "2")
    done = run_cli([*args, "--collective-timeout", timeout], fault=fault)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "restart 1 of at most 2 by torchrun's elastic agent after a worker failed: resumed at step 4" in done.stdout
    assert [(r["step"], r["attempt"]) for r in restarts(out)] == [(4, 1)]
    assert "Traceback" not in done.stderr
    assert step_losses(out) == step_losses(golden)  # bitwise
    assert_same_final_model(out, golden)


# ---- two nodes on the loopback ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.slow
def test_two_simulated_nodes_train_as_one_process(corpus: Path, tmp_path: Path) -> None:
    one = tmp_path / "one"
    assert run_cli(cli_args(corpus, one)).returncode == 0
    two = tmp_path / "two"
    endpoint = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("BIGBATCH_FAULT", None)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
    rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "bigbatch-test"]
    nodes = [
        subprocess.Popen(
            [*torchrun, *rendezvous, "-m", "bigbatch", *cli_args(corpus, two), "--collective-timeout", "60"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [node.communicate(timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], [err[-2000:] for _, err in outputs]
    assert any("world 2" in out for out, _ in outputs)
    assert relative_l2(final_model(two), final_model(one)) <= 1e-5
