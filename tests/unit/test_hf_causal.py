"""The ``hf`` family's pieces, without training: the shape read from config.json, the exactness rules (a mixture of
experts warned about, routing with a capacity or a batch-coupled module refused), activation checkpointing, FSDP2
units, parameter counts, the compile fallback and the run directory's name."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from hf_models import hf_config, save_hf

from bigbatch.errors import ConfigError
from bigbatch.models import (
    HFCausalLM,
    HFConfig,
    build_model,
    family_of,
    fsdp_units,
    model_config_from_dict,
    model_preset,
)
from bigbatch.models.hf.config import training_notes
from bigbatch.models.hf.model import CompiledOrEager
from bigbatch.run.build.model_phase import check_exactness
from bigbatch.run.configuration.identity import default_run_dir
from bigbatch.run.configuration.train_config import TrainConfig

pytest.importorskip("transformers")

LLAMA_JSON: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "vocab_size": 256,
    "intermediate_size": 64,
}


def test_the_shape_comes_from_either_naming_of_config_json() -> None:
    llama = HFConfig("dir", LLAMA_JSON)
    assert (llama.block_size, llama.vocab_size, llama.n_layer, llama.n_head, llama.n_kv_head, llama.n_embd) == (
        64,
        256,
        2,
        4,
        2,
        32,
    )
    assert llama.head_dim == 8 and llama.architecture == "LlamaForCausalLM" and llama.experts == 0
    gpt2 = HFConfig(
        "dir", {"model_type": "gpt2", "n_layer": 3, "n_head": 2, "n_embd": 16, "n_positions": 40, "vocab_size": 300}
    )
    assert (gpt2.block_size, gpt2.n_layer, gpt2.n_kv_head, gpt2.architecture) == (40, 3, 2, "GPT2LMHeadModel")
    assert HFConfig.from_dict(llama.to_dict()) == llama and family_of(llama).name == "hf"
    assert model_config_from_dict("hf", llama.to_dict()) == llama
    with pytest.raises(ConfigError, match=r"^dir/config.json gives no context length \(looked for "):
        HFConfig("dir", {**LLAMA_JSON, "max_position_embeddings": None})


def test_an_override_that_would_change_the_shape_is_refused(tmp_path: Path) -> None:
    save_hf("llama", tmp_path / "m", weights=False)
    name = f"hf:{tmp_path / 'm'}"
    assert model_preset(name, dropout=0.0, vocab_size=256).vocab_size == 256  # the model's own: fine
    with pytest.raises(ConfigError, match=r"the vocabulary of hf:.* is its config.json's, not bigbatch's to change"):
        model_preset(name, vocab_size=512)
    # dropout is no part of the shape: the builder sets it in the model's config (what train does with --dropout)
    assert model_preset(name, dropout=0.1) == model_preset(name)


def test_config_json_alone_refuses_a_capacity_and_no_router_by_name() -> None:
    """From config.json alone only an expert capacity is refused; whether a router can be balanced is the router
    probe's, by what the model does (tests/integration/test_hf_moe_zoo.py)."""
    assert training_notes(HFConfig("d", LLAMA_JSON)) == (None, None)
    moe = {**LLAMA_JSON, "model_type": "qwen2_moe", "num_experts": 8, "router_aux_loss_coef": 0.001}
    assert training_notes(HFConfig("d", moe)) == (None, None)
    assert training_notes(HFConfig("d", {**moe, "model_type": "granitemoe"})) == (None, None)
    refusal, _ = training_notes(HFConfig("d", {**moe, "capacity_factor": 1.25}))
    assert refusal is not None and "with a capacity (capacity_factor 1.25)" in refusal
    assert "depends on the rest of the batch" in refusal


def test_a_batch_coupled_module_anywhere_is_refused_in_one_line() -> None:
    torch.manual_seed(0)
    model = build_model(HFConfig("d", LLAMA_JSON))
    assert isinstance(model, HFCausalLM)
    check_exactness(model, "hf:d", lambda *a, **k: None)  # dense, no batch statistics: nothing to say
    model.hf_model.model.layers[1].extra_norm = nn.BatchNorm1d(32)  # type: ignore[union-attr,index]
    with pytest.raises(ConfigError) as caught:
        check_exactness(model, "hf:d", lambda *a, **k: None)
    assert str(caught.value).startswith(
        "hf:d cannot be trained exactly: its module hf_model.model.layers.1.extra_norm (BatchNorm1d) normalizes "
        "with statistics of the whole batch in training mode"
    )
    assert "bigbatch verify --model hf:d" in str(caught.value)


@pytest.mark.parametrize(("kind", "units"), [("gpt2", "transformer.h"), ("llama", "model.layers")])
def test_fsdp_units_are_the_decoder_layers(kind: str, units: str) -> None:
    import transformers

    model = HFCausalLM(
        HFConfig("d", hf_config(kind).to_dict()), transformers.AutoModelForCausalLM.from_config(hf_config(kind))
    )
    expected = list(model.hf_model.get_submodule(units))
    assert len(expected) == 2 and fsdp_units(model) == expected


def test_parameter_counts_and_flops() -> None:
    import transformers

    gpt2 = HFCausalLM(
        HFConfig("d", hf_config("gpt2").to_dict()), transformers.AutoModelForCausalLM.from_config(hf_config("gpt2"))
    )
    total = sum(p.numel() for p in gpt2.parameters())
    assert gpt2.num_params(non_embedding=False) == total
    assert gpt2.num_params() == total  # tied: the token table is also the head's matmul
    llama = HFCausalLM(HFConfig("d", LLAMA_JSON), transformers.AutoModelForCausalLM.from_config(hf_config("llama")))
    assert llama.num_params() == llama.num_params(non_embedding=False) - 256 * 32  # untied input table left out
    assert llama.flops_per_token(64) == 6 * llama.num_params() + 12 * 2 * 4 * 8 * 64


def test_activation_checkpointing_is_transformers_own_and_keeps_the_gradient() -> None:
    torch.manual_seed(0)
    model = build_model(HFConfig("d", LLAMA_JSON))
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))

    def gradient() -> list[torch.Tensor]:
        model.zero_grad()
        model(x).logsumexp(-1).sum().backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    plain = gradient()
    model.activation_checkpointing = True
    assert model.hf_model.is_activation_checkpointing  # type: ignore[union-attr]
    for got, want in zip(gradient(), plain, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    model.activation_checkpointing = False
    assert not model.hf_model.is_activation_checkpointing  # type: ignore[union-attr]


def test_activation_checkpointing_is_refused_where_the_model_has_none() -> None:
    inner = nn.Linear(2, 2)
    inner.config = object()  # type: ignore[assignment]  # no output_router_logits
    model = HFCausalLM(HFConfig("d", LLAMA_JSON), inner)
    model.activation_checkpointing = False  # off stays off, silently
    with pytest.raises(ConfigError, match="LlamaForCausalLM does not support activation checkpointing"):
        model.activation_checkpointing = True


def test_a_model_that_does_not_compile_trains_eagerly_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    class Broken(nn.Module):
        def forward(self, *args: Any) -> Any:
            raise RuntimeError("backend exploded\nwith a long trace")

    monkeypatch.setattr(torch, "compile", lambda module: Broken())
    eager = nn.Linear(3, 2)
    wrapped = CompiledOrEager(eager)
    x = torch.ones(1, 3)
    with caplog.at_level(logging.WARNING):
        assert torch.equal(wrapped(x), eager(x))
        assert torch.equal(wrapped(x), eager(x))
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [
        "torch.compile does not work for this model (RuntimeError: backend exploded); training without it "
        "(--no-compile skips the attempt)"
    ]


def test_the_default_run_directory_is_named_after_the_model_directory(tmp_path: Path) -> None:
    save_hf("qwen2", tmp_path / "Qwen2.5-0.5B", weights=False)
    config = TrainConfig()
    config.model.preset = f"hf:{tmp_path / 'Qwen2.5-0.5B'}"
    assert default_run_dir(config).name.startswith("hf-Qwen2.5-0.5B-")


def test_seq_len_auto_of_an_hf_directory_is_its_context_capped(tmp_path: Path) -> None:
    from bigbatch.run.configuration.seq_len import resolve_seq_len

    for positions, expected in ((64, 64), (131_072, 8192)):
        save_hf("llama", tmp_path / str(positions), weights=False, max_position_embeddings=positions)
        config = TrainConfig()
        config.model.preset = f"hf:{tmp_path / str(positions)}"
        assert resolve_seq_len(config).batch.seq_len == expected


def test_init_from_beside_an_hf_model_is_one_line(tmp_path: Path) -> None:
    from helpers import assert_one_line_error, run_main

    code, out, err = run_main(["train", "--model", f"hf:{tmp_path}", "--init-from", str(tmp_path)])
    line = assert_one_line_error(code, out, err)
    assert "--init-from and --model hf:" in line and "give one" in line


GPT2_DROPOUT = {"attn_pdrop": 0.1, "resid_pdrop": 0.1, "embd_pdrop": 0.1}  # GPT-2's own config.json


@pytest.mark.parametrize(("kind", "extra"), [("gpt2", GPT2_DROPOUT), ("llama", {"attention_dropout": 0.1})])
def test_dropout_replaces_every_dropout_probability_of_config_json(kind: str, extra: dict[str, float]) -> None:
    """``--dropout`` reaches every dropout of an ``hf:`` model: those config.json names (GPT-2's modules, Llama's
    float ``attention_dropout`` that its attention reads), set before the model is built; None keeps config.json's.
    The shape stays config.json as read (what checkpoints store and export writes)."""
    from bigbatch.models.coupling import dropout_sites
    from bigbatch.models.hf.config import dropout_settings
    from bigbatch.models.hf.model import build_hf_model

    shape = HFConfig("d", hf_config(kind, **extra).to_dict())
    assert {key: dropout_settings(shape.hf_config)[key] for key in extra} == extra
    torch.manual_seed(0)
    own = {site.p for site in dropout_sites(build_hf_model(shape))}
    assert own == {0.1}
    for p in (0.0, 0.25):
        torch.manual_seed(0)
        model = build_hf_model(shape, dropout=p)
        sites = dropout_sites(model)
        assert sites and {site.p for site in sites} == {p}
        assert all(model.hf_model.config.to_dict()[key] == p for key in extra)  # type: ignore[operator]
    assert all(shape.hf_config[key] == 0.1 for key in extra)


def test_dropout_settings_are_found_in_nested_configs_and_only_numbers() -> None:
    from bigbatch.models.hf.config import dropout_settings

    values = {
        "attention_dropout": 0.1,
        "use_dropout": True,  # a switch, not a probability
        "dropout_type": "normal",
        "id2label": {0: "a"},
        "text_config": {"hidden_dropout_prob": 0.2, "vocab_size": 9},
    }
    assert dropout_settings(values) == {"attention_dropout": 0.1, "text_config.hidden_dropout_prob": 0.2}


def test_the_run_says_what_dropout_does_to_an_hf_model() -> None:
    from bigbatch.models.hf.config import dropout_note
    from bigbatch.run.build.model_phase import say_dropout

    gpt2 = HFConfig("m/gpt2", hf_config("gpt2", **GPT2_DROPOUT).to_dict())
    assert dropout_note(gpt2, 0.0) == (
        "hf:m/gpt2: its config.json sets dropout (attn_pdrop 0.1, embd_pdrop 0.1, resid_pdrop 0.1, "
        "summary_first_dropout 0.1); trained without it (--dropout 0, the default), so micro-batch and full-batch "
        "gradients are identical; --dropout 0.1 trains with dropout, and then they differ"
    )
    assert dropout_note(gpt2, 0.1) == (
        "hf:m/gpt2: every dropout probability set to 0.1 (--dropout): micro-batch and full-batch gradients then "
        "differ (each micro-batch draws its own masks); --dropout 0 keeps them identical"
    )
    assert dropout_note(HFConfig("m/llama", LLAMA_JSON), 0.0) is None  # no dropout anywhere: nothing to say
    said: list[tuple[str, int]] = []
    torch.manual_seed(0)
    model = build_model(gpt2)
    say_dropout(TrainConfig(), model, lambda fmt, *args, level=logging.INFO: said.append((fmt % args, level)))
    assert said == [(dropout_note(gpt2, 0.0), logging.WARNING)]


def test_verify_turns_off_a_float_dropout_that_no_module_holds() -> None:
    """transformers' Llama attention reads the float ``attention_dropout`` under its own training flag: the
    verifier zeroes it (and says so) as it does an ``nn.Dropout``."""
    from bigbatch.models.coupling import dropout_sites
    from bigbatch.verify import disable_dropout

    torch.manual_seed(0)
    model = build_model(HFConfig("d", {**LLAMA_JSON, "attention_dropout": 0.1}))
    assert disable_dropout(model) == ["hf_model.model.layers.0.self_attn", "hf_model.model.layers.1.self_attn"]
    assert {site.p for site in dropout_sites(model)} == {0.0}


def test_the_run_says_init_froms_config_dropout_is_not_trained_with(tmp_path: Path) -> None:
    import json

    from bigbatch.models import GPT, GPTConfig
    from bigbatch.run.build.model_phase import say_dropout

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", **GPT2_DROPOUT, "n_layer": 2}))
    config = TrainConfig()
    config.model.init_from = str(tmp_path)
    said: list[str] = []
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=8, vocab_size=16))
    say_dropout(config, model, lambda fmt, *args, level=logging.INFO: said.append(fmt % args))
    assert said == [
        f"--init-from {tmp_path}: its config.json sets dropout (attn_pdrop 0.1, embd_pdrop 0.1, resid_pdrop 0.1); "
        "trained without it, so micro-batch and full-batch gradients are identical"
    ]
    config.model.init_from, config.model.dropout = "", 0.2  # a preset with --dropout: said too
    said.clear()
    say_dropout(config, model, lambda fmt, *args, level=logging.INFO: said.append(fmt % args))
    assert said == [
        "dropout 0.2 (--dropout): micro-batch and full-batch gradients differ (each micro-batch draws its own masks); "
        "--dropout 0 keeps them identical"
    ]
