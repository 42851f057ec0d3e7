"""``--optimizer muon`` across processes (gloo on CPU): DDP and FSDP2 give one process's parameters, each matrix is
orthogonalised once in the job (by its owner), FSDP2's owner assembles a matrix from row pieces some ranks hold
none of, and its momentum travels in sharded checkpoints, resuming bitwise on the same world size and within
fp32 rounding on another.

Every test here starts processes (about 90 s in all on 2 busy cores), so the whole file is marked slow: ``make
test`` runs it, ``make test-fast`` does not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import dist_worker
import muon_dist_worker
import pytest
import torch
from exactness import rel_diff
from helpers import corpus_bytes, run_main
from launch import SUPPORT, support_pythonpath, torchrun
from reliability_runs import assert_same_final_model, cli_args, final_model, run_cli, step_losses

from bigbatch.engine.accumulate import AccumulationEngine
from bigbatch.engine.muon_matrices import muon_parameters
from bigbatch.engine.newton_schulz import orthogonalise
from bigbatch.engine.optim import constant_schedule
from bigbatch.parallel.matrix_owners import balanced_owners
from bigbatch.run.checkpoints import checkpoint as ckpt

pytestmark = pytest.mark.slow  # multi-process, as tests/integration/test_distributed.py

WORKER = str(SUPPORT / "muon_dist_worker.py")
TOL = 1e-5


def relative_l2(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """One number over every tensor: ||ours - reference|| / ||reference||, all parameters together."""
    assert set(ours) == set(reference)
    num = sum(float(((ours[k].double() - reference[k].double()) ** 2).sum()) for k in reference)
    den = sum(float((reference[k].double() ** 2).sum()) for k in reference)
    return (num / den) ** 0.5


# ---- DDP and FSDP2 against one process ----------------------------------------------------------------------


def reference(dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, list]:
    """One process, all 2K micro-batches of each step, the same Muon settings (no process group here: every
    matrix is orthogonalised in this process)."""
    model = dist_worker.make_model().to(dtype)
    optimizer = muon_dist_worker.muon_optimizer(model)
    assert optimizer.owners.world_size == 1
    engine = AccumulationEngine(model, optimizer, constant_schedule(muon_dist_worker.ADAMW_LR), grad_clip=1.0)
    records = [engine.step(dist_worker.global_step_batches(s, 2, ragged=False)) for s in range(dist_worker.STEPS)]
    assert optimizer.orthogonalisations == dist_worker.STEPS * len(muon_parameters(model))
    return model, records


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One torchrun of 2 processes: 3 steps under DDP, then 3 under FSDP2."""
    out = tmp_path_factory.mktemp("muon_train") / "result.pt"
    torchrun(WORKER, "train", str(out))
    return torch.load(out, weights_only=True)


@pytest.fixture(scope="module")
def one_process() -> tuple[dict[str, torch.Tensor], list, dict[str, torch.Tensor]]:
    model, records = reference()
    exact, _ = reference(torch.float64)
    whole = {name: p.detach().clone() for name, p in model.named_parameters()}
    return whole, records, {name: p.detach().clone() for name, p in exact.named_parameters()}


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_processes_match_one_process_with_twice_the_micro_batches(
    trained: dict, one_process: tuple, parallel: str
) -> None:
    whole, records, exact = one_process
    got = trained[parallel]
    assert trained["world"] == 2
    if parallel == "fsdp":
        assert set(got["sharded"]) == set(whole)  # every parameter really was a DTensor (sharded by rows)
    initial = {name: p.detach().double() for name, p in dist_worker.make_model().named_parameters()}
    moved = relative_l2(whole, initial)
    assert moved > 1e-3  # three steps changed the model: the comparison below is not of initial weights
    distance = relative_l2(got["state"], whole)
    print(f"\n{parallel}: relative L2 of all parameters to one process {distance:.2e}")
    assert distance <= TOL
    for name, value in whole.items():  # each tensor too; the bar of exactness.assert_parameters_match
        bar = max(TOL, 10 * rel_diff(value.double(), exact[name]))
        if name.endswith("attn.c_attn.bias"):  # the key slice's exact gradient is zero: AdamW moves it by noise
            c = dist_worker.make_model().config.n_embd
            ours, theirs = got["state"][name].split(c), value.split(c)
            assert rel_diff(ours[0], theirs[0]) <= bar and rel_diff(ours[2], theirs[2]) <= bar, name
            assert (ours[1] - theirs[1]).abs().max().item() <= 1e-5, name
            continue
        assert rel_diff(got["state"][name], value) <= bar, name
    assert got["losses"] == pytest.approx([r.loss for r in records], rel=1e-5)
    assert got["norms"] == pytest.approx([r.grad_norm for r in records], rel=1e-5)
    assert got["tokens"] == [r.tokens for r in records]


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_each_matrix_is_orthogonalised_once_per_step_by_its_owner(trained: dict, parallel: str) -> None:
    matrices = [p for _, p in muon_parameters(dist_worker.make_model())]
    owners = balanced_owners([p.numel() for p in matrices], 2)
    each = [owners.count(rank) for rank in range(2)]
    assert all(each)  # both ranks do some of the work
    runs = trained[parallel]["ns_runs"]  # [step][rank]
    assert len(runs) == dist_worker.STEPS
    for per_rank in runs:
        assert sum(per_rank) == len(matrices)  # once in the job, not once on every rank
        assert per_rank == each


# ---- FSDP2's owner assembly with empty shards ---------------------------------------------------------------


def test_owner_assembles_row_shards_where_a_rank_holds_none(tmp_path: Path) -> None:
    """3 ranks, DTensors sharded by rows: 7 rows [3, 3, 1], 2 rows [1, 1, 0] (rank 2 holds none), 4 rows
    [2, 2, 0] (owned by rank 2, which holds none of them), an expert stack of 2 [1, 1, 0], and a plain tensor.
    Each rank receives exactly its rows of the whole matrix's orthogonalisation."""
    out = tmp_path / "shards.pt"
    torchrun(WORKER, "shards", str(out), nproc=3)
    result = torch.load(out, weights_only=True)
    world = result["world"]
    assert world == 3
    wholes = [orthogonalise(x) for x in result["inputs"]]
    owners = result["ranks"][0]["owners"]
    assert any(
        owner == rank and rows[0] == 0
        for rank, data in enumerate(result["ranks"])
        for owner, rows in zip(owners, data["rows"], strict=False)
    )  # an owner holding no rows of its matrix
    for rank, data in enumerate(result["ranks"]):
        assert data["rank"] == rank and data["owners"] == owners
        assert data["runs"] == owners.count(rank)  # each matrix orthogonalised once, by its owner
        for i, (got, same_here, whole) in enumerate(zip(data["got"], data["expected"], wholes, strict=True)):
            if i < len(muon_dist_worker.SHARD_SHAPES):
                mine = (list(whole.chunk(world)) + [whole[:0]] * world)[rank]  # DTensor's Shard(0): torch.chunk
                assert got.shape == mine.shape == data["rows"][i], (rank, i)
            else:
                mine = whole  # the replicated tensor: all of it on every rank
            assert torch.equal(got, same_here), (rank, i)  # bitwise: the same computation in the same process
            torch.testing.assert_close(got, mine, rtol=0, atol=1e-6)  # and orthogonalise here, up to threads


# ---- checkpoints with Muon's state through the command line -------------------------------------------------

MUON_FSDP = ("--parallel", "fsdp", "--optimizer", "muon", "--muon-lr", "0.02", "--max-steps", "4", "--save-every", "2")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_bytes(corpus_bytes(60_000))
    return path


@pytest.fixture(scope="module")
def golden_muon(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``bigbatch train --nproc 2 --parallel fsdp --optimizer muon``: 4 steps, a checkpoint every 2."""
    out = tmp_path_factory.mktemp("golden_muon") / "run"
    done = run_cli(cli_args(corpus, out, "--nproc", "2", *MUON_FSDP))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "each orthogonalised by one of 2 ranks" in done.stdout
    return out


def rewound(run: Path, to: Path, step: int) -> Path:
    """A copy of ``run`` whose checkpoints after ``step`` are gone (as if it had stopped there)."""
    import shutil

    shutil.copytree(run, to)
    for path in ckpt.list_checkpoints(to):
        if ckpt.checkpoint_step(path) > step:
            ckpt.remove_checkpoint(path)
    return to


def saved_momentum(run: Path, step: int) -> dict[str, torch.Tensor]:
    state = ckpt.load_checkpoint(ckpt.checkpoint_path(run, step))["optimizer"]["state"]
    return {name: entry["momentum_buffer"] for name, entry in state.items() if "momentum_buffer" in entry}


def assert_momentum_restored(probe: Path, golden: Path, world: int) -> None:
    """The resumed optimizer's momentum buffers, gathered whole, are the saved ones bit for bit, float32, on
    every rank's piece too."""
    seen = torch.load(probe, weights_only=True)
    assert seen["world"] == world and seen["step"] == 2
    assert seen["resumed_from"] is not None and seen["resumed_from"].endswith("step_0000002")
    saved = saved_momentum(golden, 2)
    assert len(saved) == len(seen["momentum"]) == 8  # pico: 4 matrices in each of 2 blocks
    assert set(seen["momentum"]) == set(saved)
    for name, value in saved.items():
        assert value.dtype == torch.float32, name
        assert value.abs().sum() > 0, name  # two steps of momentum, not zeros
        assert seen["momentum"][name].dtype == torch.float32, name
        assert torch.equal(seen["momentum"][name], value), name
    assert len(seen["pieces"]) == world
    for pieces in seen["pieces"]:
        assert len(pieces) == 8
        for whole_dtype, local_dtype, local_shape, shape in pieces:
            assert whole_dtype == local_dtype == "torch.float32"
            rows = [len(c) for c in torch.arange(shape[0]).chunk(world)] + [0] * world
            assert local_shape[0] in rows and tuple(local_shape[1:]) == tuple(shape[1:])


def probe_command(world: int, probe: Path, corpus: Path, run: Path) -> list[str]:
    args = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"] if world > 1 else []
    return [sys.executable, *args, WORKER, "probe", str(probe), *cli_args(corpus, run, *MUON_FSDP)]


def resume(golden: Path, corpus: Path, tmp_path: Path, world: int) -> tuple[Path, Path, str]:
    """The golden run's checkpoint of step 2 resumed on ``world`` processes (torchrun running the command line's
    code in each, with a look at the optimizer once resumed), trained to step 4."""
    run, probe = rewound(golden, tmp_path / "run", step=2), tmp_path / "probe.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": support_pythonpath()}
    env.pop("BIGBATCH_FAULT", None)
    done = subprocess.run(
        probe_command(world, probe, corpus, run), env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return run, probe, done.stdout


def test_a_stopped_two_process_fsdp_muon_run_resumes_bitwise(golden_muon: Path, corpus: Path, tmp_path: Path) -> None:
    """Stopped after 2 of 4 steps (the golden run's directory without its later checkpoint, as
    test_sharded_checkpoints does), resumed on 2 processes: the momentum as saved, then steps 3-4's losses and the
    final parameters and momentum bit for bit those of the run that never stopped."""
    run, probe, stdout = resume(golden_muon, corpus, tmp_path, world=2)
    assert "world size" not in stdout  # the same world size: nothing to reshard
    assert_momentum_restored(probe, golden_muon, world=2)
    assert step_losses(run) == step_losses(golden_muon)  # bitwise, steps 3 and 4 retrained
    assert len(step_losses(run)) == 4
    assert_same_final_model(run, golden_muon)
    for name, value in saved_momentum(golden_muon, 4).items():  # and the momentum it saved at the end
        assert torch.equal(saved_momentum(run, 4)[name], value), name


def test_the_checkpoint_resumes_on_one_process(golden_muon: Path, corpus: Path, tmp_path: Path) -> None:
    """In this process (the command line's code, without a process group): the momentum as saved, the parameters
    within fp32 rounding of the run that never stopped."""
    run, probe = rewound(golden_muon, tmp_path / "run", step=2), tmp_path / "probe.pt"
    with muon_dist_worker.probing(str(probe)):
        code, stdout, err = run_main(cli_args(corpus, run, *MUON_FSDP))
    assert code == 0, err[-3000:]
    assert "world size 2 -> 1" in stdout
    assert_momentum_restored(probe, golden_muon, world=1)
    distance = relative_l2(final_model(run), final_model(golden_muon))
    print(f"\nresumed on 1 process: relative L2 of all parameters to 2 processes {distance:.2e}")
    assert distance <= TOL
    assert step_losses(run) == pytest.approx(step_losses(golden_muon), rel=1e-5)


def test_the_checkpoint_resumes_on_four_processes(golden_muon: Path, corpus: Path, tmp_path: Path) -> None:
    run, probe, stdout = resume(golden_muon, corpus, tmp_path, world=4)
    assert "world size 2 -> 4" in stdout
    assert_momentum_restored(probe, golden_muon, world=4)
    distance = relative_l2(final_model(run), final_model(golden_muon))
    print(f"\nresumed on 4 processes: relative L2 of all parameters to 2 processes {distance:.2e}")
    assert distance <= TOL
    assert step_losses(run) == pytest.approx(step_losses(golden_muon), rel=1e-5)
