"""Exactness with ragged and padded data: documents, masks, token budgets and the last window of an epoch."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import mean_loss

from bigbatch.data.documents import DocumentLoader
from bigbatch.data.prepare import prepare_dataset
from bigbatch.data.shards import DocumentShard, TokenDataset
from bigbatch.engine.accumulate import AccumulationEngine
from bigbatch.engine.batch import MicroBatch, StepBatch, StepPolicy, count_valid_targets, read_step
from bigbatch.engine.optim import build_adamw, constant_schedule
from bigbatch.errors import ConfigError, DataError
from bigbatch.models import GPT, GPTConfig
from bigbatch.parallel.distributed import DistContext

TOL = 1e-5
VOCAB = 97


def budget_step(loader: DocumentLoader, budget: int, last_window: str = "partial") -> StepBatch:
    return read_step(
        loader, StepPolicy(token_budget=budget, last_window=last_window), DistContext(), torch.device("cpu")
    )


def budget_micro_batches(loader: DocumentLoader, budget: int, last_window: str = "partial") -> list[MicroBatch]:
    return budget_step(loader, budget, last_window).micro_batches


def step_micro_batches(loader: DocumentLoader, k: int, last_window: str = "partial") -> list[MicroBatch]:
    return read_step(loader, StepPolicy(k=k, last_window=last_window), DistContext(), torch.device("cpu")).micro_batches


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=VOCAB))


def full_batch_grads(net: GPT, batches: list[MicroBatch]) -> list[torch.Tensor]:
    """The big batch: every micro-batch concatenated (same T), one mean over all valid targets."""
    net = copy.deepcopy(net)
    x = torch.cat([b.inputs for b in batches])
    y = torch.cat([b.targets for b in batches])
    loss = mean_loss(net, x, y)
    loss.backward()
    return [p.grad for p in net.parameters()]


def engine_grads(net: GPT, batches: list[MicroBatch]) -> list[torch.Tensor]:
    net = copy.deepcopy(net)
    engine = AccumulationEngine(net, build_adamw(net, 1e-3), constant_schedule(1e-3))
    engine.accumulate(batches)
    return [p.grad for p in net.parameters()]


def mean_over_k_grads(net: GPT, batches: list[MicroBatch]) -> list[torch.Tensor]:
    """The classic idiom: each micro-batch's mean loss divided by K."""
    net = copy.deepcopy(net)
    for b in batches:
        loss = mean_loss(net, b.inputs, b.targets)
        (loss / len(batches)).backward()
    return [p.grad for p in net.parameters()]


def documents(lengths: list[int], prompt: list[int] | None = None, seed: int = 0) -> DocumentShard:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, size=sum(lengths)).astype(np.uint16)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    mask = None
    if prompt is not None:
        mask = np.ones(len(tokens), dtype=np.uint8)
        for start, p in zip(offsets[:-1], prompt, strict=True):
            mask[start : start + p] = 0
    return DocumentShard(tokens, offsets, mask)


def test_one_valid_token_versus_a_thousand_is_exact_and_mean_over_k_is_not() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (32, 64), generator=gen)
    y = torch.randint(0, VOCAB, (32, 64), generator=gen)
    y[:16] = -100
    y[0, 5] = 7  # micro-batch 0: exactly one valid target
    y[16:, 1000 // 16 :] = -100  # micro-batch 1: about a thousand
    batches = [MicroBatch(x[:16], y[:16]), MicroBatch(x[16:], y[16:])]
    assert [count_valid_targets(b) for b in batches] == [1, 16 * (1000 // 16)]
    net = model()
    full = full_batch_grads(net, batches)
    exact = engine_grads(net, batches)
    classic = mean_over_k_grads(net, batches)
    flat = lambda gs: torch.cat([g.flatten() for g in gs])  # noqa: E731
    for g_exact, g_full in zip(exact, full, strict=True):
        assert rel_diff(g_exact, g_full) <= TOL
    assert rel_diff(flat(classic), flat(full)) > 0.1  # measurably wrong: the lone token weighs half the step


def test_document_loader_pads_truncates_and_masks() -> None:
    shard = documents([5, 80, 3], prompt=[2, 0, 1])
    loader = DocumentLoader([shard], micro_batch=3, seq_len=8, pad_token=0, long_documents="truncate")
    batch = loader.next_micro_batch()
    tokens = torch.from_numpy(shard.tokens.astype(np.int64))
    # Document 0: 5 tokens -> 4 positions; its first two tokens are prompt, so target 0 (token 1) is masked.
    assert torch.equal(batch.inputs[0, :4], tokens[0:4])
    assert batch.targets[0, 0].item() == -100
    assert torch.equal(batch.targets[0, 1:4], tokens[2:5])
    assert torch.all(batch.targets[0, 4:] == -100) and torch.all(batch.inputs[0, 4:] == 0)
    # Document 1: 80 tokens cut to T + 1 = 9 -> 8 full positions, no mask.
    assert torch.equal(batch.inputs[1], tokens[5:13]) and torch.equal(batch.targets[1], tokens[6:14])
    # Document 2: 3 tokens with a 1-token prompt: both targets are completion tokens.
    assert torch.equal(batch.targets[2, :2], tokens[86:88])
    assert count_valid_targets(batch) == 3 + 8 + 2
    assert loader.epoch == 1 and loader.position == 0


def test_document_loader_strides_ranks_and_pads_the_last_window() -> None:
    shard = documents([4] * 7)
    loaders = [DocumentLoader([shard], micro_batch=2, seq_len=4, rank=r, world_size=2) for r in range(2)]
    first = [loader.next_micro_batch() for loader in loaders]
    second = [loader.next_micro_batch() for loader in loaders]
    tokens = torch.from_numpy(shard.tokens.astype(np.int64))
    doc = lambda i: tokens[4 * i : 4 * i + 3]  # noqa: E731
    assert torch.equal(first[0].inputs[0, :3], doc(0)) and torch.equal(first[1].inputs[0, :3], doc(2))
    assert torch.equal(second[0].inputs[1, :3], doc(5)) and torch.equal(second[1].inputs[0, :3], doc(6))
    assert torch.all(second[1].targets[1] == -100)  # document 7 does not exist: a padding row
    assert all(loader.epoch == 1 for loader in loaders)


def test_document_loader_state_round_trips() -> None:
    shard = documents([6, 9, 4, 12, 7, 5, 8])
    loader = DocumentLoader([shard], micro_batch=2, seq_len=6)
    loader.next_micro_batch()
    state = loader.state_dict()
    expected = [loader.next_micro_batch() for _ in range(5)]
    resumed = DocumentLoader([shard], micro_batch=2, seq_len=6)
    resumed.load_state_dict(state)
    for a, b in zip(expected, [resumed.next_micro_batch() for _ in range(5)], strict=True):
        assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    assert resumed.n_sequences == 10  # documents of 8, 9 and 12 tokens are two windows of seq_len 6 each
    with pytest.raises(DataError, match="outside the 10 sequences"):
        resumed.load_state_dict({"position": 10, "long_documents": "split"})


def test_token_budget_takes_micro_batches_until_reached_and_is_exact() -> None:
    lengths = [3, 40, 9, 65, 2, 17, 33, 5, 60, 11, 24, 8]
    loader = DocumentLoader([documents(lengths)], micro_batch=2, seq_len=32, long_documents="truncate")
    valid = [min(n, 33) - 1 for n in lengths]  # targets per document after truncation to T + 1
    per_micro = [valid[i] + valid[i + 1] for i in range(0, len(valid), 2)]
    assert per_micro == [34, 40, 17, 36, 42, 30]
    step = budget_step(loader, budget=70)
    batches = step.micro_batches
    assert step.n_valid == 74  # counted once, while the step was assembled
    assert len(batches) == 2  # 34 < 70, 34 + 40 = 74 >= 70: the crossing micro-batch is included whole
    total = sum(count_valid_targets(b) for b in batches)
    assert total == 74
    assert total - count_valid_targets(batches[-1]) < 70 <= total  # the remainder rule
    next_step = budget_micro_batches(loader, budget=70)
    assert [count_valid_targets(b) for b in next_step] == [17, 36, 42]  # 53 < 70 <= 95: K = 3
    net = model()
    for g_exact, g_full in zip(engine_grads(net, next_step), full_batch_grads(net, next_step), strict=True):
        assert rel_diff(g_exact, g_full) <= TOL


def test_token_budget_partial_and_drop_at_the_end_of_an_epoch() -> None:
    lengths = [33] * 6  # 32 targets per document, 64 per micro-batch of 2
    partial = DocumentLoader([documents(lengths)], micro_batch=2, seq_len=32)
    budget_micro_batches(partial, budget=128)  # documents 0-3
    last = budget_micro_batches(partial, budget=128, last_window="partial")
    assert [count_valid_targets(b) for b in last] == [64]  # the epoch ends short of the budget: partial step
    assert partial.epoch == 1
    dropped = DocumentLoader([documents(lengths)], micro_batch=2, seq_len=32)
    budget_micro_batches(dropped, budget=128)
    step = budget_micro_batches(dropped, budget=128, last_window="drop")
    assert len(step) == 2 and dropped.epoch == 1 and dropped.position == 4  # remainder skipped, epoch 2 begun
    with pytest.raises(DataError, match="more than the valid targets"):
        budget_micro_batches(DocumentLoader([documents(lengths)], 2, 32), budget=10_000, last_window="drop")
    with pytest.raises(ConfigError, match="last_window"):
        budget_micro_batches(dropped, budget=1, last_window="keep")


def test_fixed_k_last_window_partial_matches_the_remaining_full_batch() -> None:
    lengths = [9, 30, 4, 17, 25, 6, 12]  # 7 documents; a step of K=2 x B=2 takes 4
    loader = DocumentLoader([documents(lengths, seed=3)], micro_batch=2, seq_len=16, long_documents="truncate")
    step_micro_batches(loader, k=2)
    last = step_micro_batches(loader, k=2, last_window="partial")
    assert len(last) == 2 and torch.all(last[1].targets[1] == -100)  # 3 documents: the last row is padding
    net = model()
    # The partial step's accumulated gradient equals the full-batch gradient over just those 3 documents.
    assert loader.epoch == 1
    x, y = torch.cat([b.inputs for b in last])[:3], torch.cat([b.targets for b in last])[:3]
    for g_exact, g_full in zip(engine_grads(net, last), full_batch_grads(net, [MicroBatch(x, y)]), strict=True):
        assert rel_diff(g_exact, g_full) <= TOL


def test_fixed_k_last_window_drop_skips_to_the_next_epoch() -> None:
    shard = documents([5, 6, 7, 8, 9, 10, 11])
    loader = DocumentLoader([shard], micro_batch=2, seq_len=16)
    step_micro_batches(loader, k=2)
    step = step_micro_batches(loader, k=2, last_window="drop")
    fresh = step_micro_batches(DocumentLoader([shard], micro_batch=2, seq_len=16), k=2)
    for a, b in zip(step, fresh, strict=True):
        assert torch.equal(a.inputs, b.inputs)  # documents 4-6 were dropped; epoch 2 starts from document 0
    assert loader.epoch == 1
    with pytest.raises(DataError, match="fewer than one step"):
        step_micro_batches(DocumentLoader([shard], micro_batch=4, seq_len=16), k=2, last_window="drop")


def test_prepare_documents_from_jsonl_masks_prompts(tmp_path: Path) -> None:
    source = tmp_path / "pairs.jsonl"
    records = [{"prompt": f"Q{i}:", "completion": f" answer {i}"} for i in range(9)] + [{"text": "plain doc"}]
    source.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    meta = prepare_dataset(str(source), tmp_path / "ds", mode="documents", val_fraction=0.2)
    assert meta.mode == "documents" and meta.masked and meta.documents == 10
    dataset = TokenDataset(tmp_path / "ds")
    train, val = dataset.document_shards("train"), dataset.document_shards("val")
    assert len(train[0].offsets) - 1 == 8 and len(val[0].offsets) - 1 == 2
    # validation is 2 documents drawn at random; each split keeps the order of the data
    docs = {}
    for shard in (train[0], val[0]):
        for a, b in zip(shard.offsets[:-1], shard.offsets[1:], strict=True):
            docs[bytes(shard.tokens[a:b].tolist())] = shard.mask[a:b].tolist()
    assert len(docs) == 10
    assert docs[b"Q0: answer 0"][:3] == [0, 0, 0] and all(docs[b"Q0: answer 0"][3:])
    assert all(docs[b"plain doc"])  # the plain text document is trained on entirely


def test_prepare_documents_rejects_bad_jsonl(tmp_path: Path) -> None:
    source = tmp_path / "bad.jsonl"
    source.write_text('{"prompt": "a", "completion": "b"}\n{"question": "x"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2 needs a string 'text'"):
        prepare_dataset(str(source), tmp_path / "ds", mode="documents")
    source.write_text("not json\n")
    with pytest.raises(DataError, match=r"bad.jsonl:1 is not valid JSON"):
        prepare_dataset(str(source), tmp_path / "ds2", mode="documents")
    assert not (tmp_path / "ds").exists() and not (tmp_path / "ds2").exists()


def test_train_on_masked_documents_with_a_token_budget(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from bigbatch.cli import main

    source = tmp_path / "qa.jsonl"
    lines = [json.dumps({"prompt": f"Q: {i} + {i}?\nA:", "completion": f" {2 * i}."}) for i in range(40)]
    source.write_text("\n".join(lines) + "\n")
    out = tmp_path / "run"
    code = main(
        [
            "train",
            "--data",
            str(source),
            "--data-mode",
            "documents",
            "--model",
            "pico",
            "--seq-len",
            "32",
            "--micro-batch",
            "4",
            "--token-budget",
            "40",
            "--max-steps",
            "4",
            "--eval-every",
            "2",
            "--pack",
            "off",
            "--sample-tokens",
            "0",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--out",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0
    assert "token budget 40 valid targets/step" in printed
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if r["kind"] == "step"]
    # Completions are " 2i." plus nothing else trained: 3-5 targets per document, 4 documents per micro-batch.
    assert all(r["tokens"] >= 40 or r["micro_batches"] == 1 for r in steps)
    assert all(r["tokens"] - 4 * 5 < 40 for r in steps)  # overshoot below one micro-batch's maximum
    assert f"K {steps[0]['micro_batches']} | tokens {steps[0]['tokens']}" in printed


def test_prepare_cli_documents_mode(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from bigbatch.cli import main

    (tmp_path / "docs").mkdir()
    for i in range(5):
        (tmp_path / "docs" / f"{i}.txt").write_text(f"document number {i}\n" * (i + 1))
    assert main(["prepare", str(tmp_path / "docs"), "--out", str(tmp_path / "ds"), "--mode", "documents"]) == 0
    assert "documents)" in capsys.readouterr().out
    dataset = TokenDataset(tmp_path / "ds")
    assert dataset.meta.mode == "documents" and not dataset.meta.masked
    shards = dataset.document_shards("train") + dataset.document_shards("val")
    assert sum(len(s.offsets) - 1 for s in shards) == 5
