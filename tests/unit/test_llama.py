"""The native Llama against transformers' LlamaForCausalLM, offline: random models built from configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from bigbatch.errors import CheckpointError, ConfigError  # noqa: E402
from bigbatch.models import (  # noqa: E402
    LLAMA_PRESETS,
    MODEL_PRESETS,
    GPTConfig,
    Llama,
    LlamaConfig,
    RopeScaling,
    fsdp_units,
    llama_preset,
    load_hf_llama,
    model_preset,
    save_hf_llama,
)
from bigbatch.models.llama.hf import llama_config_from_hf  # noqa: E402

VOCAB = 99
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # short, so that every band of the scaling is used at 64 positions
}

# name -> transformers.LlamaConfig fields beyond the common ones
CASES: dict[str, dict[str, object]] = {
    "gqa-untied": {"num_key_value_heads": 2},
    "gqa-tied": {"num_key_value_heads": 2, "tie_word_embeddings": True},
    "mqa": {"num_key_value_heads": 1},
    "mha": {"num_key_value_heads": 4},
    "rope-base": {"num_key_value_heads": 2, "rope_theta": 500_000.0},
    "llama3-scaling": {"num_key_value_heads": 2, "rope_theta": 500_000.0, "rope_scaling": dict(LLAMA3_SCALING)},
}


def hf_model(**extra: object) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    fields: dict[str, object] = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5,
    }
    fields.update(extra)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields)).eval()


def logits_of(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(x)
    return out.logits if hasattr(out, "logits") else out


def tokens(batch: int = 2, length: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def hf_dir(tmp_path: Path) -> Path:
    hf_model(num_key_value_heads=2).save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case: str, tmp_path: Path) -> None:
    reference = hf_model(**CASES[case])
    reference.save_pretrained(tmp_path / "hf")
    ours = load_hf_llama(tmp_path / "hf").eval()
    assert ours.config.tie_embeddings == bool(CASES[case].get("tie_word_embeddings", False))
    assert (ours.config.rope_scaling is not None) == (case == "llama3-scaling")
    x = tokens()
    torch.testing.assert_close(logits_of(ours, x), logits_of(reference, x), rtol=0, atol=1e-5)


def test_llama3_scaling_changes_the_logits(tmp_path: Path) -> None:
    # Guards the test above: the scaled frequencies must differ from the plain ones at this size.
    hf_model(**CASES["llama3-scaling"]).save_pretrained(tmp_path / "scaled")
    scaled = load_hf_llama(tmp_path / "scaled").eval()
    plain = Llama(LlamaConfig(**{**scaled.config.to_dict(), "rope_scaling": None})).eval()
    plain.load_state_dict(scaled.state_dict())
    x = tokens()
    assert (logits_of(scaled, x) - logits_of(plain, x)).abs().max() > 1e-3


@pytest.mark.parametrize("case", ["gqa-untied", "gqa-tied", "llama3-scaling"])
def test_export_loads_in_transformers_with_identical_logits(case: str, tmp_path: Path) -> None:
    torch.manual_seed(1)
    hf_model(**CASES[case]).save_pretrained(tmp_path / "hf")
    config = load_hf_llama(tmp_path / "hf").config
    ours = Llama(config).eval()  # fresh random weights, so the export carries bigbatch's own init
    save_hf_llama(ours, tmp_path / "export")
    written = json.loads((tmp_path / "export" / "config.json").read_text())
    assert written["model_type"] == "llama" and written["architectures"] == ["LlamaForCausalLM"]
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert theirs.dtype == torch.float32
    assert theirs.config.tie_word_embeddings == config.tie_embeddings
    x = tokens(seed=1)
    torch.testing.assert_close(logits_of(theirs, x), logits_of(ours, x), rtol=0, atol=1e-5)
    with pytest.raises(CheckpointError, match="not empty"):
        save_hf_llama(ours, tmp_path / "export")


def test_save_then_load_is_bit_exact_and_keeps_the_tie(tmp_path: Path) -> None:
    torch.manual_seed(2)
    ours = Llama(llama_preset("llama-pico", vocab_size=VOCAB))
    back = load_hf_llama(save_hf_llama(ours, tmp_path / "export"))
    assert back.config == ours.config
    assert back.lm_head.weight is back.model.embed_tokens.weight
    assert all(p.requires_grad and p.device.type == "cpu" for p in back.parameters())
    for (name, a), b in zip(ours.state_dict().items(), back.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    reference = hf_model(num_key_value_heads=2)
    reference.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1
    ours = load_hf_llama(tmp_path / "hf").eval()
    x = tokens()
    torch.testing.assert_close(logits_of(ours, x), logits_of(reference, x), rtol=0, atol=1e-5)
    shard = sorted((tmp_path / "hf").glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"lacks {shard.name}"):
        load_hf_llama(tmp_path / "hf")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"attention_bias": True}, "attention biases"),
        ({"mlp_bias": True}, "MLP biases"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"head_dim": 32}, "head_dim 32"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "rope_type 'linear'"),
        ({"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic'"),
        ({"partial_rotary_factor": 0.5}, "partial rotary"),
        ({"model_type": "mistral"}, "not llama"),
        ({"num_key_value_heads": 3}, "n_head=4 is not divisible by n_kv_head=3"),
    ],
)
def test_unsupported_variants_are_refused_in_one_line(hf_dir: Path, change: dict, message: str) -> None:
    config = json.loads((hf_dir / "config.json").read_text())
    config.update(change)
    (hf_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message) as caught:
        load_hf_llama(hf_dir)
    assert "\n" not in str(caught.value)


def test_missing_unexpected_and_misshapen_weights_are_refused_in_one_line(hf_dir: Path) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(str(hf_dir / "model.safetensors"))
    cases = [
        ({k: v for k, v in weights.items() if k != "model.layers.1.mlp.up_proj.weight"}, "missing model.layers.1.mlp"),
        ({**weights, "model.layers.9.mlp.up_proj.weight": torch.zeros(1)}, "unexpected model.layers.9"),
        ({**weights, "model.norm.weight": torch.ones(65)}, r"model.norm.weight has shape \(65,\), expected \(64,\)"),
    ]
    for tensors, message in cases:
        save_file(tensors, str(hf_dir / "model.safetensors"))
        with pytest.raises(CheckpointError, match=message) as caught:
            load_hf_llama(hf_dir)
        assert "\n" not in str(caught.value)
    (hf_dir / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json; expected a Hugging Face Llama directory"):
        load_hf_llama(hf_dir)


def test_transformers_4_config_fields_are_read() -> None:
    # Meta's Llama 3.2 1B config.json as transformers 4.x wrote it (rope_theta and rope_scaling, no rope_parameters).
    config = llama_config_from_hf(
        {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 128000,
            "eos_token_id": 128001,
            "head_dim": 64,
            "hidden_act": "silu",
            "hidden_size": 2048,
            "initializer_range": 0.02,
            "intermediate_size": 8192,
            "max_position_embeddings": 131072,
            "mlp_bias": False,
            "num_attention_heads": 32,
            "num_hidden_layers": 16,
            "num_key_value_heads": 8,
            "pretraining_tp": 1,
            "rms_norm_eps": 1e-05,
            "rope_theta": 500000.0,
            "tie_word_embeddings": True,
            "torch_dtype": "bfloat16",
            "rope_scaling": {
                "factor": 32.0,
                "high_freq_factor": 4.0,
                "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192,
                "rope_type": "llama3",
            },
            "use_cache": True,
            "vocab_size": 128256,
        }
    )
    assert config == llama_preset("llama3.2-1b", block_size=131072)


def test_presets_build_on_meta_with_the_expected_parameter_counts() -> None:
    def formula(cfg: LlamaConfig) -> int:
        kv = cfg.n_kv_head * cfg.head_dim
        layer = 2 * cfg.n_embd * cfg.n_embd + 2 * cfg.n_embd * kv + 3 * cfg.n_embd * cfg.ffn_hidden + 2 * cfg.n_embd
        heads = 1 if cfg.tie_embeddings else 2
        return cfg.n_layer * layer + cfg.n_embd + heads * cfg.vocab_size * cfg.n_embd

    for name, cfg in LLAMA_PRESETS.items():
        with torch.device("meta"):
            model = Llama(cfg)
            theirs = transformers.LlamaForCausalLM(
                transformers.LlamaConfig(
                    vocab_size=cfg.vocab_size,
                    hidden_size=cfg.n_embd,
                    intermediate_size=cfg.ffn_hidden,
                    num_hidden_layers=cfg.n_layer,
                    num_attention_heads=cfg.n_head,
                    num_key_value_heads=cfg.n_kv_head,
                    tie_word_embeddings=cfg.tie_embeddings,
                )
            )
        n = model.num_params(non_embedding=False)
        assert n == formula(cfg) == sum(p.numel() for p in theirs.parameters()), name
        assert cfg.n_kv_head < cfg.n_head and cfg.ffn_hidden % 32 == 0, name
        assert model.num_params() == n  # tied: the embedding is the head's matmul
    assert LLAMA_PRESETS["llama3.2-1b"].tie_embeddings
    with torch.device("meta"):
        assert Llama(LLAMA_PRESETS["llama3.2-1b"]).num_params(non_embedding=False) == 1_235_814_400
    # The small presets keep the budgets of the GPT presets they are named after.
    for name, gpt in (("llama-pico", "pico"), ("llama-nano", "nano")):
        ours, theirs_gpt = LLAMA_PRESETS[name], MODEL_PRESETS[gpt]
        assert (ours.n_layer, ours.n_embd, ours.n_head, ours.block_size, ours.vocab_size) == (
            theirs_gpt.n_layer,
            theirs_gpt.n_embd,
            theirs_gpt.n_head,
            theirs_gpt.block_size,
            theirs_gpt.vocab_size,
        )


def test_preset_lookup_covers_both_families() -> None:
    assert model_preset("llama-nano", vocab_size=256) == llama_preset("llama-nano", vocab_size=256)
    assert isinstance(model_preset("nano"), GPTConfig)
    assert not set(LLAMA_PRESETS) & set(MODEL_PRESETS)
    with pytest.raises(ConfigError, match="llama-pico"):
        model_preset("llama-huge")
    with pytest.raises(ConfigError, match="unknown Llama preset"):
        llama_preset("nano")


def test_config_validation_and_dict_round_trip() -> None:
    base = llama_preset("llama3.2-1b").to_dict()
    assert base["rope_scaling"]["factor"] == 32.0
    assert json.loads(json.dumps(base)) == base
    assert LlamaConfig.from_dict(base) == llama_preset("llama3.2-1b")
    bad = [
        ({"n_kv_head": 0}, "n_kv_head must be a positive integer"),
        ({"n_embd": 100}, "not divisible by n_head"),
        ({"n_kv_head": 5}, "not divisible by n_kv_head"),
        ({"n_embd": 32 * 3, "n_head": 32, "n_kv_head": 8}, "head_dim=3"),
        ({"dropout": 1.0}, "dropout"),
    ]
    for change, message in bad:
        with pytest.raises(ConfigError, match=message):
            llama_preset("llama3.2-1b", **change)
    with pytest.raises(ConfigError, match="low_freq_factor < high_freq_factor"):
        RopeScaling(low_freq_factor=4.0, high_freq_factor=1.0)
    assert (
        LlamaConfig(n_layer=1, n_head=2, n_kv_head=1, n_embd=8, ffn_hidden=8, block_size=4).padded_vocab_size == 50257
    )


def test_init_ties_the_head_and_scales_residual_projections() -> None:
    torch.manual_seed(0)
    model = Llama(
        LlamaConfig(
            n_layer=8,
            n_head=4,
            n_kv_head=2,
            n_embd=256,
            ffn_hidden=512,
            block_size=16,
            vocab_size=512,
            tie_embeddings=True,
        )
    )
    layer = model.model.layers[0]
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert layer.mlp.gate_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert layer.mlp.down_proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert layer.self_attn.o_proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert torch.all(layer.input_layernorm.weight == 1) and torch.all(model.model.norm.weight == 1)
    untied = Llama(llama_preset("llama-pico", vocab_size=VOCAB, tie_embeddings=False))
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    assert untied.num_params() == untied.num_params(non_embedding=False) - VOCAB * 32


def test_activation_checkpointing_gives_identical_gradients() -> None:
    torch.manual_seed(0)
    model = Llama(llama_preset("llama-pico", vocab_size=VOCAB)).train()
    x, y = tokens(2, 32, seed=3), tokens(2, 32, seed=4)

    def grads() -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    plain = grads()
    model.activation_checkpointing = True
    checkpointed = grads()
    assert len(plain) == len(checkpointed) == len(list(model.parameters()))
    for a, b in zip(plain, checkpointed, strict=True):
        assert torch.equal(a, b)


def test_flops_per_token_formula() -> None:
    model = Llama(llama_preset("llama-pico", vocab_size=VOCAB))
    n = model.num_params(non_embedding=True)
    assert model.flops_per_token(seq_len=32) == 6 * n + 12 * 2 * 2 * 16 * 32
    with torch.device("meta"):
        big = Llama(llama_preset("llama3.2-1b"))
    assert big.flops_per_token(8192) == 6 * 1_235_814_400 + 12 * 16 * 32 * 64 * 8192


def test_forward_refuses_sequences_longer_than_block_size_and_is_causal() -> None:
    model = Llama(llama_preset("llama-pico", vocab_size=VOCAB)).eval()
    with pytest.raises(ValueError, match="block_size"):
        model(tokens(1, 65))
    x = tokens(1, 64)
    changed = x.clone()
    changed[0, 40:] = (changed[0, 40:] + 1) % VOCAB
    a, b = logits_of(model, x), logits_of(model, changed)
    assert a.shape == (1, 64, VOCAB)
    torch.testing.assert_close(a[:, :40], b[:, :40])
    assert not torch.allclose(a[:, 40:], b[:, 40:])


def test_built_on_meta_then_materialised_computes_the_same() -> None:
    # The rotary angles are no buffer, so nothing is left uninitialised by to_empty + load_state_dict.
    reference = Llama(llama_preset("llama-pico", vocab_size=VOCAB)).eval()
    with torch.device("meta"):
        model = Llama(reference.config)
    model.to_empty(device="cpu")
    model.load_state_dict(reference.state_dict())
    model.eval()
    x = tokens(2, 64)
    assert torch.equal(logits_of(model, x), logits_of(reference, x))
    with torch.device("meta"):
        assert model.to("meta")(x.to("meta")).shape == (2, 64, VOCAB)


def test_fsdp_units_are_the_decoder_layers() -> None:
    model = Llama(llama_preset("llama-pico", vocab_size=VOCAB))
    units = fsdp_units(model)
    assert len(units) == 2 and all(a is b for a, b in zip(units, model.model.layers, strict=True))


def test_a_damaged_or_escaping_shard_index_is_refused(hf_dir: Path) -> None:
    (hf_dir / "model.safetensors").unlink()
    index = hf_dir / "model.safetensors.index.json"
    index.write_text("{not json")
    with pytest.raises(CheckpointError, match="damaged or not a shard index"):
        load_hf_llama(hf_dir)
    index.write_text(json.dumps({"weight_map": {"model.norm.weight": "../elsewhere.safetensors"}}))
    with pytest.raises(CheckpointError, match="not a .safetensors file beside it"):
        load_hf_llama(hf_dir)


def test_verifier_passes_on_a_llama_and_disables_its_dropout() -> None:
    from bigbatch.verify import check_equivalence
    from bigbatch.verify.command import token_batch

    torch.manual_seed(0)
    model = Llama(llama_preset("llama-pico", vocab_size=VOCAB, dropout=0.1)).train()
    batch = token_batch(8, 24, VOCAB, ragged=True, generator=torch.Generator().manual_seed(0))
    report = check_equivalence(model, batch, k=4)
    assert report.equivalent, report.format()
    assert any(name.endswith("self_attn") for name in report.dropout_disabled)
