"""Replay: its digest and checksums, which rank a differing re-run points at, the float64 tie-break between two
ranks, and one process's replays inside the engine (what it catches, what it cannot, what it records)."""

from __future__ import annotations

import pytest
import torch
from tiny import random_batch

from bigbatch.engine import replay as replay_module
from bigbatch.engine.accumulate import AccumulationEngine
from bigbatch.engine.bad_steps import REPLAY_MISMATCH, BadStepSettings
from bigbatch.engine.batch import MicroBatch
from bigbatch.engine.optim import build_adamw, constant_schedule
from bigbatch.engine.replay import (
    DEVICE_SUSPECT,
    DeviceSuspect,
    DrawnMicroBatch,
    Judgement,
    ReplayCheck,
    ReplayRow,
    checksums,
    contribution,
    device_fault,
    digest,
    host_reference,
    judge,
    judge_alone,
    vote,
)
from bigbatch.engine.rng import capture_rng_state
from bigbatch.models import GPT, GPTConfig
from bigbatch.run.loop.faults import Fault, FaultInjection


def _flip(tensor: torch.Tensor, element: int, bit: int) -> torch.Tensor:
    flipped = tensor.clone()
    flipped.view(-1)[element : element + 1].view(torch.int32).bitwise_xor_(1 << bit)
    return flipped


def test_the_digest_sees_one_flipped_bit_and_the_shape() -> None:
    grads = [torch.linspace(-1, 1, 12), torch.ones(3, 4)]
    flipped = [grads[0], _flip(grads[1], 5, 3)]  # a low mantissa bit: a tiny change in value
    assert digest(grads) == digest([g.clone() for g in grads])
    assert digest(grads) != digest(flipped)
    assert digest([torch.ones(12)]) != digest([torch.ones(3, 4)])
    assert digest([None]) != digest([torch.zeros(0)])


def test_the_checksums_change_with_every_single_bit_and_are_exact() -> None:
    """What an accelerator reduces a gradient to before the host hashes it: every bit of every word moves its
    row's checksum; 2,500 words make three rows (the last padded); half-precision words of odd count are bytes."""
    values = torch.randn(2_500)
    base = checksums(values)
    assert base.shape == (3,) and torch.equal(base, checksums(values.clone()))
    for element in (0, 1_023, 1_024, 2_499):
        for bit in range(32):
            assert not torch.equal(checksums(_flip(values, element, bit)), base), (element, bit)
    words = values.view(torch.int32).to(torch.int64)[:1_024]
    assert int(base[0]) == int((words * (torch.arange(1_024) * 2 + 1)).sum())  # exact: no rounding, no overflow
    half = torch.randn(7).bfloat16()
    changed = half.clone()
    changed.view(torch.int16)[3] ^= 1
    assert not torch.equal(checksums(half), checksums(changed))


# ---- judging the digests --------------------------------------------------------------------------------------


def test_one_process_tells_a_one_off_from_a_device_that_differs_every_time() -> None:
    (suspect,) = judge_alone(1, first="bad", again="good", third="good").transient
    assert (suspect.rank, suspect.micro, suspect.cause, suspect.verdict) == (0, 1, REPLAY_MISMATCH, "transient")
    assert judge_alone(1, first="good", again="bad", third="good") == Judgement()  # the re-run was the odd one
    faulty = judge_alone(2, first="a", again="b", third="c")
    assert list(faulty.faulty) == [0] and "three ways" in faulty.faulty[0] and not faulty.transient


def test_a_rank_wrong_once_is_transient() -> None:
    """Rank 1's first run is wrong: its re-run and rank 0's re-run of it agree with each other."""
    rows = [ReplayRow(0, "a", "a", "a"), ReplayRow(2, "bad", "b", "b")]
    judgement = judge(rows, 2)
    (suspect,) = judgement.transient
    assert (suspect.rank, suspect.micro, suspect.verdict) == (1, 2, "transient")
    assert not judgement.faulty and not judgement.disputes


def test_a_rank_whose_values_vary_is_faulty_and_explains_what_its_peer_saw() -> None:
    """Rank 1 computes wrongly every time, at another element each time: named; rank 0, whose micro-batch rank 1
    computed otherwise, is not, and no dispute is left."""
    rows = [ReplayRow(0, "a", "a-by-1", "a"), ReplayRow(1, "b-1", "b", "b-2")]
    judgement = judge(rows, 2)
    assert list(judgement.faulty) == [1] and "three ways" in judgement.faulty[1]
    assert not judgement.transient and not judgement.disputes


def test_a_repeating_fault_among_three_ranks_is_the_rank_at_odds_with_both_neighbours() -> None:
    """Rank 1 gives the same wrong value every time: rank 2 does not reproduce its micro-batch, and it does not
    reproduce rank 0's; ranks 0 and 2 agree with each other where they meet."""
    rows = [ReplayRow(0, "a", "a'", "a"), ReplayRow(1, "b'", "b", "b'"), ReplayRow(2, "c", "c", "c")]
    judgement = judge(rows, 3)
    assert list(judgement.faulty) == [1] and "repeats its value" in judgement.faulty[1]
    assert not judgement.disputes and not judgement.transient


def test_with_two_ranks_a_repeating_fault_is_one_dispute_and_one_direction_is_one_too() -> None:
    """Two ranks each consistent with itself: every disagreement involves both, so the digests leave one dispute
    (both directions are the same two ranks); a disagreement on rank 1's micro-batch alone is a dispute too."""
    both = judge([ReplayRow(0, "a", "a'", "a"), ReplayRow(1, "b'", "b", "b'")], 2)
    assert both.disputes == [(0, 1)] and not both.faulty
    one_way = judge([ReplayRow(0, "a", "a", "a"), ReplayRow(3, "b", "b''", "b")], 2)
    assert one_way.disputes == [(1, 0)] and not one_way.faulty


# ---- the float64 tie-break --------------------------------------------------------------------------------------


def _tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=32))


def _drawn(index: int = 0) -> DrawnMicroBatch:
    x, y = random_batch(2, 8, vocab=32, seed=index)
    return DrawnMicroBatch(index, MicroBatch(x, y), capture_rng_state())


def test_the_host_reference_is_the_contribution_to_rounding_and_votes_against_a_flipped_bit() -> None:
    model = _tiny_gpt()
    params = list(model.parameters())
    drawn = _drawn()

    def objective(m: torch.nn.Module, batch: MicroBatch) -> torch.Tensor:
        return m(batch.inputs, targets=batch.targets) * 0.25

    def loss_sum(m: torch.nn.Module, batch: MicroBatch) -> torch.Tensor:
        return m(batch.inputs, targets=batch.targets)

    healthy = contribution(model, params, drawn, objective, torch.device("cpu"))
    reference = host_reference(model, params, drawn, loss_sum, 0.25)
    assert reference is not None and all(r is not None and r.dtype == torch.float64 for r in reference)
    for g, r in zip(healthy, reference, strict=True):
        assert g is not None and r is not None
        assert torch.allclose(g.double(), r, rtol=1e-4, atol=1e-7)
    assert all(p.dtype == torch.float32 and p.grad is None for p in params)  # the model itself is untouched
    second = healthy[1]
    assert second is not None
    faulty = [healthy[0], _flip(second, 3, 20), *healthy[2:]]
    assert vote(healthy, faulty, reference) == 1  # the peer's value is the odd one
    assert vote(faulty, healthy, reference) == 0
    assert vote(healthy, faulty, [r * 3 if r is not None else None for r in reference]) is None  # far from both
    assert vote(healthy, healthy, reference) is None  # nothing differs


def test_no_reference_for_a_model_too_large_to_copy_to_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _tiny_gpt()
    monkeypatch.setattr(replay_module, "REFERENCE_MAX_PARAMETERS", 10)
    assert host_reference(model, list(model.parameters()), _drawn(), lambda m, b: m(b.inputs, b.targets), 1.0) is None


def test_a_device_fault_is_one_line_naming_the_rank_and_a_stopping_record() -> None:
    shared = [_drawn(0), _drawn(1)]
    checks = [ReplayCheck(0, 0, (1, 0), False), ReplayCheck(1, 1, (0, 1), False)]
    named = device_fault(7, Judgement(faulty={1: "why"}), shared, checks, matched=6)
    message = str(named)
    assert "\n" not in message and message.startswith(
        "replay at step 7: the device of rank 1 is suspect: why; the run stops"
    )
    assert "every replay matched up to step 6" in message
    record = named.bad.record()
    assert record["action"] == f"stopped: {DEVICE_SUSPECT}" and [s["rank"] for s in record["suspects"]] == [1]
    tie = device_fault(7, Judgement(disputes=[(0, 1)]), shared, checks, matched=0)
    assert "the device of rank 0 or rank 1 is suspect" in str(tie) and "no replay matched" in str(tie)
    assert [s.rank for s in tie.bad.suspects] == [0, 1]


# ---- one process, in the engine --------------------------------------------------------------------------------


def _train(fault: Fault | None, steps: int = 3, k: int = 2) -> tuple[AccumulationEngine, list]:
    """Steps of K micro-batches at ``--replay-every 1`` (skip-micro); each step's records and replays."""
    model = _tiny_gpt()
    hooks = [FaultInjection(fault, rank=0, model=model)] if fault is not None else []
    guard = BadStepSettings(replay_every=1)
    engine = AccumulationEngine(model, build_adamw(model, 1e-3), constant_schedule(1e-3), hooks=hooks, bad_steps=guard)
    seen = []
    for step in range(steps):
        x, y = random_batch(2 * k, 8, vocab=32, seed=step)
        batches = [MicroBatch(a, b) for a, b in zip(x.chunk(k), y.chunk(k), strict=True)]
        record = engine.step(batches)
        assert engine.guard is not None
        seen.append((record, engine.guard.take_checks()))
    return engine, seen


def test_one_process_records_each_replay_and_changes_nothing() -> None:
    engine, seen = _train(None)
    assert all(record.bad is None and not record.skipped for record, _ in seen)
    assert [[c.as_dict() for c in checks] for _, checks in seen] == [
        [{"rank": 0, "micro_batch": checks[0].micro, "rerun_by": [0], "matched": True}] for _, checks in seen
    ]
    assert engine.guard is not None and engine.guard.replays == 3 and engine.guard.last_matched == 3


def test_one_process_stops_on_a_device_that_differs_every_time() -> None:
    with pytest.raises(DeviceSuspect, match=r"replay at step 2: the device of rank 0 is suspect: .*three ways"):
        _train(Fault("bitflip", step=2, micro=None))


def test_one_process_cannot_see_a_fault_that_repeats_its_value() -> None:
    """The documented limit: the same device reproduces its own wrong value, so every replay matches."""
    _, seen = _train(Fault("bitflip-same", step=2, micro=None))
    assert all(record.bad is None for record, _ in seen) and all(c.matched for _, checks in seen for c in checks)


def test_one_process_drops_a_micro_batch_computed_wrongly_once() -> None:
    """K 1: the one micro-batch is always the drawn one; its first run flipped once, the re-run and a third run
    agree: a transient bad step (nothing left to train on: the step is skipped)."""
    _, seen = _train(Fault("bitflip", step=2, micro=0), k=1)
    bad = seen[1][0].bad
    assert bad is not None and bad.cause == REPLAY_MISMATCH and bad.suspects[0].verdict == "transient"
    assert seen[1][1] == [ReplayCheck(0, 0, (0, 0), False)]
    assert seen[2][0].bad is None
