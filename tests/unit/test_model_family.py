"""The model family (gpt or llama) wherever a model is named, stored or read back: presets, checkpoints, resume,
Hugging Face directories (--init-from) and seq_len auto."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bigbatch.errors import CheckpointError, ConfigError
from bigbatch.models import (
    GPT,
    GPTConfig,
    Llama,
    RopeScaling,
    build_model,
    family_of,
    llama_preset,
    model_config_from_dict,
    model_preset,
)
from bigbatch.models.pretrained import hf_model_type, read_pretrained_config
from bigbatch.run.checkpoints import checkpoint as ckpt
from bigbatch.run.checkpoints.resume import check_compatible
from bigbatch.run.configuration.config_sources import apply_mapping
from bigbatch.run.configuration.seq_len import resolve_seq_len
from bigbatch.run.configuration.train_config import TrainConfig


def test_presets_build_their_own_family() -> None:
    for name, family, cls in (("pico", "gpt", GPT), ("llama-pico", "llama", Llama), ("llama-nano", "llama", Llama)):
        model = build_model(model_preset(name, vocab_size=64))
        assert isinstance(model, cls) and family_of(model).name == family_of(model.config).name == family
    with pytest.raises(ConfigError, match="unknown model family 'mamba'"):
        model_config_from_dict("mamba", {})


def small_llama3() -> Llama:
    """Llama 3.2 1B's settings (rope base, llama3 rope scaling, tied head) at a test's size."""
    config = llama_preset("llama3.2-1b", n_layer=1, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=64, vocab_size=64)
    assert config.rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192)
    torch.manual_seed(0)
    return Llama(config)


def test_a_llama_checkpoint_round_trips_with_its_rope_scaling(tmp_path: Path) -> None:
    model = small_llama3()
    path = ckpt.save_checkpoint(
        {
            "model_family": family_of(model).name,
            "model_config": model.config.to_dict(),
            "model": model.state_dict(),
            "step": 1,
        },
        tmp_path / "step_0000001.pt",
    )
    document = ckpt.load_checkpoint(path)  # weights_only: the nested rope scaling is a plain dict
    assert document["model_family"] == "llama"
    assert isinstance(document["model_config"]["rope_scaling"], dict)
    loaded = ckpt.model_from_checkpoint(document)
    assert isinstance(loaded, Llama) and loaded.config == model.config
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # tied again
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


def test_a_checkpoint_without_a_family_is_gpt_and_an_unknown_family_is_refused(tmp_path: Path) -> None:
    gpt = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=64))
    document = {"model_config": gpt.config.to_dict(), "model": gpt.state_dict()}  # before model_family existed
    assert isinstance(ckpt.model_from_checkpoint(document), GPT)
    with pytest.raises(CheckpointError, match=r"^the checkpoint holds a model of family 'mamba', which this bigbatch "):
        ckpt.model_from_checkpoint({**document, "model_family": "mamba"})
    llama = small_llama3()
    wrong = {"model_family": "gpt", "model_config": llama.config.to_dict(), "model": llama.state_dict()}
    with pytest.raises(CheckpointError, match="the checkpoint's gpt model does not match its stored shape"):
        ckpt.model_from_checkpoint(wrong)


def test_resume_refuses_another_family_before_comparing_shapes() -> None:
    llama = small_llama3()
    document = {"model_config": {"n_layer": 1}, "tokenizer": "byte", "config": {}}  # no family: a GPT checkpoint
    batch = TrainConfig().batch
    with pytest.raises(CheckpointError) as caught:
        check_compatible(document, "llama", llama.config.to_dict(), "byte", batch)
    assert str(caught.value) == (
        "the checkpoint holds a gpt model but this run builds a llama model; use the run's own --model (or "
        "--init-from), or a new --out"
    )
    same = {**document, "model_family": "llama", "model_config": llama.config.to_dict()}
    check_compatible(same, "llama", llama.config.to_dict(), "byte", batch)  # no error


def write_config(directory: Path, values: dict) -> Path:
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(values))
    return directory


def test_model_type_decides_the_family_of_a_directory(tmp_path: Path) -> None:
    gpt2 = write_config(tmp_path / "gpt2", {"n_layer": 2, "n_head": 2, "n_embd": 32, "n_positions": 40})
    assert hf_model_type(gpt2) == "gpt2"  # GPT-2 directories from before model_type existed
    assert isinstance(read_pretrained_config(gpt2), GPTConfig)
    llama = write_config(
        tmp_path / "llama",
        {
            "model_type": "llama",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 48,
            "vocab_size": 256,
        },
    )
    shape = read_pretrained_config(llama)
    assert family_of(shape).name == "llama" and shape.block_size == 48 and shape.n_kv_head == 2
    other = write_config(tmp_path / "other", {"model_type": "mistral"})
    with pytest.raises(CheckpointError) as caught:
        hf_model_type(other)
    assert str(caught.value) == (
        f"--init-from {other}: its config.json has model_type 'mistral', and --init-from reads only gpt2, llama, "
        f"mixtral or qwen3_moe into bigbatch's own models; to train this model's weights as they are, pass --model hf:{other} "
        "instead of --init-from"
    )
    with pytest.raises(
        CheckpointError, match="is not a directory; give a Hugging Face GPT-2, Llama, Mixtral or Qwen3-MoE directory"
    ):
        hf_model_type(tmp_path / "missing")


def with_settings(**sections: dict) -> TrainConfig:
    config = TrainConfig()
    apply_mapping(config, sections, origin="test")
    return config


@pytest.mark.parametrize(("positions", "expected"), [(48, 48), (8192, 8192), (131_072, 8192)])
def test_seq_len_auto_from_a_llama_directory_is_capped(tmp_path: Path, positions: int, expected: int) -> None:
    directory = write_config(
        tmp_path / "llama",
        {
            "model_type": "llama",
            "hidden_size": 32,
            "num_attention_heads": 4,
            "max_position_embeddings": positions,
        },
    )
    assert resolve_seq_len(with_settings(model={"init_from": str(directory)})).batch.seq_len == expected
    given = with_settings(model={"init_from": str(directory)}, batch={"seq_len": 16})
    assert resolve_seq_len(given).batch.seq_len == 16


def test_seq_len_auto_of_llama_presets_is_their_block_size() -> None:
    for name, block in (("llama-pico", 64), ("llama-nano", 256), ("llama3.2-1b", 8192)):
        assert resolve_seq_len(with_settings(model={"preset": name})).batch.seq_len == block
    # a preset's --block-size is the user's own choice: not capped
    big = with_settings(model={"preset": "llama3.2-1b", "block_size": 16_384})
    assert resolve_seq_len(big).batch.seq_len == 16_384
