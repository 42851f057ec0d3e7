"""A bad step traced to the right micro-batches: a gradient-only spike by each micro-batch's own contribution (not
by its loss), every bad micro-batch of a rank named, and a bad document followed to every micro-batch holding a part
of it; with faults made outside bigbatch's injector (hooks on the model) and with its own (``BIGBATCH_FAULT``)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from bad_step_runs import SEQ, K, NanLossOnce, confident_on, random_steps, same_state, scale_gradient_of, train
from reliability_runs import cli_args, run_cli
from text_corpus import text_corpus

from bigbatch.engine.bad_steps import GRAD_SPIKE, LOSS_NOT_FINITE, LOSS_SPIKE, BadStepSettings, SpikeDetector
from bigbatch.engine.batch import DocumentPart, MicroBatch, document_key

GUARD = BadStepSettings(spike_min_steps=4)  # the detector judges from the fifth step on: short runs
BAD_TOKEN = 63


def _records(out: Path, kind: str) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


# ---- the detector ----------------------------------------------------------------------------------------------


def test_a_micro_batch_is_judged_by_its_own_values_where_the_step_hides_it() -> None:
    """One micro-batch of four at three times the others' loss moves the step's loss 1.5x (under the step's limit):
    its own loss per token is far over the micro-batches' limit. Its windows survive a checkpoint, and a checkpoint
    written before micro-batches were judged loads with none (they judge nothing until they fill again)."""
    detector = SpikeDetector(min_steps=20)
    for i in range(30):
        detector.observe(2.0 + 0.01 * (i % 3), 1.0, [(2.0 + 0.05 * (j - 1.5), 1.0 + 0.1 * j) for j in range(K)])
    micro = [(2.0, 1.0), (6.0, 1.2), (2.0, 1.1), (2.0, 0.9)]
    assert detector.check(3.0, 1.1) is None  # the step alone: 1.5x is not a spike
    spike = detector.check(3.0, 1.1, micro)
    assert spike is not None and spike[0] == LOSS_SPIKE and spike[1].startswith("micro-batch 1: its loss per token 6")
    assert [(i, cause) for i, cause, _ in detector.over_micro(micro)] == [(1, LOSS_SPIKE)]
    restored = SpikeDetector(min_steps=20)
    restored.load_state_dict(json.loads(json.dumps(detector.state_dict())))
    assert [i for i, _, _ in restored.over_micro(micro)] == [1]
    old = {k: v for k, v in detector.state_dict().items() if not k.startswith("micro")}
    restored.load_state_dict(old)
    assert restored.over_micro(micro) == [] and restored.limits() is not None


# ---- gradient-only spikes, several bad micro-batches -------------------------------------------------------------


def test_a_gradient_only_spike_is_named_by_its_contribution_and_left_out() -> None:
    """A hook on the model multiplies one micro-batch's gradient by 1e4, its loss untouched (a fault bigbatch did
    not make): the record names that micro-batch (not the one of the highest loss) by its own gradient norm, the
    verdict is data (a re-run reproduces the norm), and the update applied is bitwise the one without it."""
    steps = tuple(range(8))
    culprit = random_steps(6)[1].inputs
    run = train(GUARD, steps, model_hook=scale_gradient_of(culprit, 1e4))
    (record,) = run.bad
    assert record.bad is not None and record.step == 7 and not record.skipped
    (suspect,) = record.bad.suspects
    assert (suspect.micro, suspect.cause, suspect.verdict) == (1, GRAD_SPIKE, "data")
    assert suspect.detail.startswith("its own gradient norm ") and suspect.key == "0:0@6100"
    assert same_state(run, train(GUARD, steps, drop={6: {1}}))
    norms = [r.grad_norm for r in run.records]
    assert norms[6] < 3 * max(norms[:6])  # what was applied holds nothing of the 1e4


def test_every_bad_micro_batch_of_a_rank_is_named_and_left_out() -> None:
    """Two NaN losses on one rank in one step, and a NaN beside a gradient spike (found on the try without the
    NaN, by the micro-batches' own values): each named in the line and the record, each left out, exactly."""
    nans = train(BadStepSettings(), (0, 1, 2), hooks=[NanLossOnce(2, 0), NanLossOnce(2, 2)])
    (record,) = nans.bad
    assert record.bad is not None
    assert [(s.micro, s.cause) for s in record.bad.suspects] == [(0, LOSS_NOT_FINITE), (2, LOSS_NOT_FINITE)]
    line = record.bad.line()
    assert (
        "rank 0, micro-batch 0 (documents shard 0 @ 1,000)" in line
        and "micro-batch 2 (documents shard 0 @ 1,200)" in line
    )
    assert [s["micro_batch"] for s in record.bad.record()["suspects"]] == [0, 2]
    assert same_state(nans, train(BadStepSettings(), (0, 1, 2), drop={1: {0, 2}}))
    steps = tuple(range(8))
    hook = scale_gradient_of(random_steps(6)[3].inputs, 1e4)
    both = train(GUARD, steps, hooks=[NanLossOnce(7, 0)], model_hook=hook)
    (record,) = both.bad
    assert record.bad is not None and record.bad.cause == LOSS_NOT_FINITE
    assert [(s.micro, s.cause) for s in record.bad.suspects] == [(0, LOSS_NOT_FINITE), (3, GRAD_SPIKE)]
    assert same_state(both, train(GUARD, steps, drop={6: {0, 3}}))


# ---- a bad document over several micro-batches ---------------------------------------------------------------------

DOC = (0, 5000)  # the bad document: shard 0, first token 5000, read as 3 windows of SEQ targets


def _with_a_long_document(step: int) -> list[MicroBatch]:
    """Step 6 of the data holds windows 0 and 1 of a bad document (micro-batch 1, row 1: 16 targets; micro-batch 2,
    row 0: only its first target, the row's rest padding), and step 7 its window 2: the part in micro-batch 2 is
    too small to lift that micro-batch's own loss over the limit, so only following the document finds it."""
    batches = random_steps(step)
    where = {6: [(1, 1, 0, SEQ), (2, 0, 1, 1)], 7: [(0, 0, 2, 5)]}.get(step, [])
    for micro, row, window, length in where:
        batch = batches[micro]
        inputs, targets = batch.inputs.clone(), batch.targets.clone()
        inputs[row, :length] = BAD_TOKEN
        targets[row, length:] = -100
        part = DocumentPart(DOC[0], DOC[1], window, 3, row, 0, length)
        others = tuple(DocumentPart(0, 100 * r, 0, 1, r, 0, SEQ) for r in range(2) if r != row)
        batches[micro] = MicroBatch(inputs, targets, origin=batch.origin, parts=(part, *others))
    return batches


def test_a_bad_document_is_followed_to_every_micro_batch_that_holds_a_part_of_it() -> None:
    """Bad data (the model confidently wrong on its tokens, a hook bigbatch did not make) in a document over two
    micro-batches of step 7 and one of step 8: both of step 7 are left out (bitwise the run without them), the
    record says where every part is, and a rewind's exclusion of the document leaves out step 8's part too."""
    bad_data = {"batches": _with_a_long_document, "model_hook": confident_on(BAD_TOKEN)}
    guard = replace(GUARD, grad_spike=0)  # a confidently wrong token's gradient would show it alone: losses only
    run = train(guard, range(7), **bad_data)
    (record,) = run.bad
    assert record.bad is not None and record.step == 7
    found, followed = record.bad.suspects
    key = document_key(*DOC)
    assert (found.micro, found.cause, found.bad_documents) == (1, LOSS_SPIKE, (key,))
    assert found.elsewhere == (
        "document shard 0 @ 5,000 (3 windows): window 0 in rank 0, micro-batch 1; window 1 in rank 0, "
        "micro-batch 2; window 2 (shard 0 @ 5,032) in other steps"
    )
    assert (followed.micro, followed.bad_documents) == (2, (key,))
    assert followed.detail == "holds part of document shard 0 @ 5,000, bad in rank 0, micro-batch 1"
    assert same_state(run, train(guard, range(7), drop={6: {1, 2}}, **bad_data))
    excluded = train(guard, range(8), excluded={key}, **bad_data)
    assert same_state(excluded, train(guard, range(8), drop={6: {1, 2}, 7: {0}}, **bad_data))
    assert not excluded.bad


# ---- real runs, bigbatch's own faults --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_bytes(text_corpus(60_000))
    return path


def test_a_gradient_scaled_by_the_fault_is_named_and_left_out(corpus: Path, tmp_path: Path) -> None:
    """``grad-scale``: micro-batch 1's gradient times 1e4 at step 8, its loss unchanged (the detector judging from
    5 steps on): the record names that micro-batch (the fault's own line says which) and the step applied holds
    the other three, with an ordinary gradient norm."""
    out = tmp_path / "run"
    args = cli_args(corpus, out, "--spike-window", "5", "--max-steps", "9", "--eval-every", "0")
    done = run_cli(args, fault="grad-scale:step=8,micro=1")
    assert done.returncode == 0, done.stderr[-2000:]
    (bad,) = _records(out, "bad_step")
    (suspect,) = bad["suspects"]
    assert (bad["step"], suspect["micro_batch"], suspect["cause"], suspect["verdict"]) == (8, 1, GRAD_SPIKE, "data")
    assert f"fault grad-scale fired: step 8, rank 0, micro-batch 1, documents {suspect['key']}" in done.stdout
    steps = {s["step"]: s for s in _records(out, "step")}
    assert steps[8]["tokens"] == 192 and steps[8]["grad_norm"] < 3 * max(steps[s]["grad_norm"] for s in range(1, 8))


def _documents(path: Path) -> Path:
    """Documents of 20 bytes (one window of 32 targets each) but two of 50 (two windows): in data order, micro-batches
    of 2 sequences, 4 a step, document 3 is read in micro-batches 1 and 2 of step 1, document 6 in micro-batch 3 of
    step 1 and micro-batch 0 of step 2."""
    text = text_corpus(30_000).decode()
    lengths = [50 if i in (3, 6) else 20 for i in range(300)]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    path.write_text("".join(json.dumps({"text": text[s : s + n]}) + "\n" for s, n in zip(starts, lengths, strict=True)))
    return path


def test_a_document_over_two_micro_batches_and_two_steps_is_followed(tmp_path: Path) -> None:
    """Documents data, in order: bad data (``nan-input``) in micro-batch 1 of step 1 leaves out micro-batch 2 too,
    which holds the other half of document 3. Under rewind, bad data in micro-batch 3 excludes document 6, whose
    second half step 2 reads: the replay leaves it out there as well."""
    data = _documents(tmp_path / "docs.jsonl")
    extra = (
        "--data-mode",
        "documents",
        "--pack",
        "off",
        "--shuffle",
        "off",
        "--val-fraction",
        "0",
        "--eval-every",
        "0",
    )
    runs = {}
    for mode, micro in (("skip-micro", 1), ("rewind", 3)):
        out = tmp_path / mode
        args = [*cli_args(data, out, "--bad-step", mode, "--max-steps", "2", *extra)]
        done = run_cli(args, fault=f"nan-input:step=1,micro={micro}")
        assert done.returncode == 0, done.stderr[-2000:]
        runs[mode] = (out, done)
    out, done = runs["skip-micro"]
    (bad,) = _records(out, "bad_step")
    assert [(s["micro_batch"], s["bad_documents"]) for s in bad["suspects"]] == [(1, ["doc:0@60"]), (2, ["doc:0@60"])]
    assert bad["suspects"][0]["elsewhere"].startswith("document shard 0 @ 60 (2 windows): window 0 in rank 0, micro")
    out, done = runs["rewind"]
    first = _records(out, "bad_step")[0]
    assert first["suspects"][0]["elsewhere"] == (
        "document shard 0 @ 150 (2 windows): window 0 in rank 0, micro-batch 3; window 1 (shard 0 @ 182) in other steps"
    )
    assert "doc:0@150" in json.loads((out / "bad-steps.json").read_text())["excluded"]
    assert "replaying without 1 micro-batch and every part of 1 document" in done.stdout
    assert "2 micro-batches left out" in done.stdout  # step 1's micro-batch 3, and step 2's micro-batch 0
