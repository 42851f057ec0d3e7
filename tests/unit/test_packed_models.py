"""Packed rows in every model family: several documents back to back in one row (positions restarting at each)
give the loss and the gradient of the same documents each in its own padded row; the chunked loss gives the
whole-logits loss and gradient; sampling's last-position logits are the full forward's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

from bigbatch.engine.accumulate import token_loss_sum
from bigbatch.engine.batch import IGNORE_INDEX, MicroBatch
from bigbatch.models.decoder import document_causal_mask
from bigbatch.models.gpt.model import GPT, preset
from bigbatch.models.hf.model import build_hf_model, read_hf_config
from bigbatch.models.llama.model import Llama, llama_preset

VOCAB = 256


def build(family: str, tmp_path: Path) -> nn.Module:
    torch.manual_seed(0)
    if family == "gpt":
        return GPT(preset("pico", vocab_size=VOCAB))
    if family == "llama":
        return Llama(llama_preset("llama-pico", vocab_size=VOCAB))
    from hf_models import save_hf

    save_hf(family.removeprefix("hf-"), tmp_path)
    return build_hf_model(read_hf_config(tmp_path), weights=True)


FAMILIES = ["gpt", "llama", "hf-llama", "hf-gpt2"]


def documents(lengths: list[int], seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, targets) of each document; about a third of each document's first targets masked (a prompt)."""
    generator = torch.Generator().manual_seed(seed)
    docs = []
    for n in lengths:
        tokens = torch.randint(1, VOCAB, (n + 1,), generator=generator)
        targets = tokens[1:].clone()
        targets[: n // 3] = IGNORE_INDEX
        docs.append((tokens[:-1], targets))
    return docs


def packed_row(docs: list[tuple[torch.Tensor, torch.Tensor]], T: int) -> MicroBatch:
    """The documents back to back in one row of ``T``, then padding (its own segment, targets -100)."""
    inputs = torch.cat([d[0] for d in docs])
    targets = torch.cat([d[1] for d in docs])
    positions = torch.cat([torch.arange(len(d[0])) for d in docs])
    pad = T - len(inputs)
    inputs = torch.cat([inputs, torch.zeros(pad, dtype=torch.int64)])
    targets = torch.cat([targets, torch.full((pad,), IGNORE_INDEX)])
    positions = torch.cat([positions, torch.arange(pad)])
    return MicroBatch(inputs[None], targets[None], positions[None], padding=pad)


def padded_rows(docs: list[tuple[torch.Tensor, torch.Tensor]], T: int) -> MicroBatch:
    """Each document in its own row of ``T``, padded at its end (the unpacked reference)."""
    inputs = torch.zeros(len(docs), T, dtype=torch.int64)
    targets = torch.full((len(docs), T), IGNORE_INDEX)
    for row, (x, y) in enumerate(docs):
        inputs[row, : len(x)] = x
        targets[row, : len(y)] = y
    return MicroBatch(inputs, targets)


def loss_and_grads(model: nn.Module, batch: MicroBatch) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = token_loss_sum(model, batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads


def assert_same_grads(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        scale = max(float(b[name].norm()), 1e-12)
        assert float((a[name] - b[name]).norm()) <= rtol * scale + 1e-7, name


def test_the_mask_keeps_each_document_to_itself_and_causal() -> None:
    positions = torch.tensor([[0, 1, 2, 0, 1, 0]])
    mask = document_causal_mask(positions)[0, 0]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [0, 0, 0, 1, 0, 0],
            [0, 0, 0, 1, 1, 0],
            [0, 0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_packed_row_gives_each_documents_own_loss_and_gradient(family: str, tmp_path: Path) -> None:
    model = build(family, tmp_path).train()
    docs = documents([7, 1, 19, 12, 3], seed=1)  # 42 positions in a row of 48: padding at the end
    packed_loss, packed = loss_and_grads(model, packed_row(docs, 48))
    alone_loss, alone = loss_and_grads(model, padded_rows(docs, 48))
    assert packed_loss == pytest.approx(alone_loss, rel=1e-5)
    assert_same_grads(packed, alone, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_chunked_loss_equals_the_whole_logits_loss(family: str, tmp_path: Path) -> None:
    model = build(family, tmp_path).train()
    batch = padded_rows(documents([30, 17, 40, 5], seed=2), 48)
    assert model.chunked_loss
    chunked_loss, chunked = loss_and_grads(model, batch)
    model.chunked_loss = False
    whole_loss, whole = loss_and_grads(model, batch)
    assert chunked_loss == pytest.approx(whole_loss, rel=1e-5)
    assert_same_grads(chunked, whole, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_sampling_reads_the_last_positions_logits_only(family: str, tmp_path: Path) -> None:
    model = build(family, tmp_path).eval()
    idx = torch.randint(0, VOCAB, (3, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        last = model(idx, last_only=True)
        full = model(idx)
    assert last.shape == (3, 1, VOCAB)
    torch.testing.assert_close(last, full[:, -1:], rtol=1e-5, atol=1e-6)


def test_a_model_without_its_own_loss_refuses_packed_rows() -> None:
    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, VOCAB)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.embed(idx)

    batch = packed_row(documents([4, 5], seed=4), 12)
    with pytest.raises(ValueError, match="--pack off"):
        token_loss_sum(Plain(), batch)
    unpacked = MicroBatch(batch.inputs, batch.targets)
    assert torch.isfinite(token_loss_sum(Plain(), unpacked))


def test_an_hf_head_with_a_soft_cap_keeps_the_whole_logits_and_its_weights(tmp_path: Path) -> None:
    """Gemma 2 caps its logits after the head: the probe sees it (at logits far from zero) and the loss comes from
    the capped logits themselves; the probe leaves every weight bit for bit as it was."""
    import transformers

    config = transformers.AutoConfig.for_model(
        "gemma2",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
        final_logit_softcapping=30.0,
    )
    config.save_pretrained(tmp_path)
    torch.manual_seed(0)
    inner = transformers.AutoModelForCausalLM.from_config(config)
    before = {name: value.clone() for name, value in inner.state_dict().items()}
    from bigbatch.models.hf.model import HFCausalLM

    model = HFCausalLM(read_hf_config(tmp_path), inner)
    assert not model.head_detachable and not model.chunked_loss
    assert all(torch.equal(before[name], value) for name, value in inner.state_dict().items())
    batch = padded_rows(documents([20, 9], seed=5), 24)
    with torch.no_grad():
        logits = model(batch.inputs)  # the capped logits
        whole = torch.nn.functional.cross_entropy(
            logits.reshape(-1, VOCAB).float(), batch.targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        assert float(model(batch.inputs, targets=batch.targets)) == pytest.approx(float(whole), rel=1e-6)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_an_attention_mask_on_the_trunk_path_alone_fails_the_packing_probe(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loss runs the trunk, not the whole model: an attention mask of ones added there only (transformers then
    stops deriving each packed document's mask from ``position_ids``) lets packed documents see each other in
    training. The probe checks that path, so the model is found not to pack documents."""
    import transformers
    from hf_models import hf_config

    from bigbatch.models.hf.model import HFCausalLM, HFConfig

    config = hf_config(kind)
    torch.manual_seed(0)
    inner = transformers.AutoModelForCausalLM.from_config(config)
    shape = HFConfig("dir", config.to_dict())
    assert HFCausalLM(shape, inner).packs_documents

    def masked_trunk(self: HFCausalLM, trunk: nn.Module, idx: torch.Tensor, positions: torch.Tensor | None) -> Any:
        mask = torch.ones_like(idx)
        return trunk(
            input_ids=idx, position_ids=positions, attention_mask=mask, **self._forward_kwargs
        ).last_hidden_state

    monkeypatch.setattr(HFCausalLM, "_hidden", masked_trunk)
    planted = HFCausalLM(shape, inner)
    assert planted.head_detachable and not planted.packs_documents
