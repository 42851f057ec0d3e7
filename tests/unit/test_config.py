from __future__ import annotations

import argparse
import tomllib
from pathlib import Path

import pytest

from bigbatch.errors import ConfigError
from bigbatch.run.configuration.config_sources import apply_mapping, config_from_dict
from bigbatch.run.configuration.train_config import TrainConfig


def test_toml_round_trip_preserves_every_field() -> None:
    config = TrainConfig()
    config.batch.micro_batch = 4
    config.run.sample_prompt = 'say "hi"\n\tthen\\stop'
    config.run.compile = "on"
    assert config_from_dict(tomllib.loads(config.to_toml())) == config


def test_mapping_overrides_fields_and_accepts_ints_for_floats() -> None:
    config = TrainConfig()
    apply_mapping(config, {"optim": {"lr": 1, "warmup_steps": 5}, "model": {"preset": "pico"}}, origin="t")
    assert config.optim.lr == 1.0 and isinstance(config.optim.lr, float)
    assert config.optim.warmup_steps == 5 and config.model.preset == "pico"


@pytest.mark.parametrize(
    ("mapping", "pattern"),
    [
        ({"batch": {"micro_batchez": 4}}, r"unknown key 'micro_batchez' in \[batch\]; known keys: total_batch_tokens"),
        ({"training": {"lr": 1.0}}, r"unknown section \[training\]"),
        ({"batch": {"micro_batch": "4"}}, r'batch.micro_batch must be int or "auto", got str'),
        ({"batch": {"micro_batch": 4.0}}, r'batch.micro_batch must be int or "auto", got float'),
        ({"run": {"compile": 1}}, r'run.compile must be "auto" or "on" or "off" \(or true/false\), got int'),
        ({"batch": 3}, r"\[batch\] must be a table"),
    ],
)
def test_bad_mappings_name_the_problem(mapping: dict, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        apply_mapping(TrainConfig(), mapping, origin="file.toml")


@pytest.mark.parametrize(
    ("section", "key", "value", "pattern"),
    [
        ("batch", "micro_batch", -1, r"--micro-batch \(batch.micro_batch\) must be an integer >= 1 or auto, got -1"),
        ("run", "max_steps", -1, r"--max-steps \(run.max_steps\) must be an integer >= 1"),
        ("optim", "lr", 0.0, r"--lr \(optim.lr\) must be a number > 0"),
        ("optim", "min_lr_ratio", 1.5, r"min_lr_ratio\) must be a number in \[0, 1\]"),
        ("data", "val_fraction", 1.0, r"val_fraction\) must be a number in \[0, 1\)"),
        ("run", "precision", "fp8", "precision must be"),
        ("run", "eval_every", -5, "eval_every\\) must be an integer >= 0"),
        ("optim", "beta1", 1.5, r"--beta1 \(optim.beta1\) must be a number in \[0, 1\), got 1.5"),
        ("optim", "eps", float("nan"), r"--eps \(optim.eps\) must be a number > 0, got nan"),
    ],
)
def test_validation_rejects_out_of_range_values(section: str, key: str, value: object, pattern: str) -> None:
    config = TrainConfig()
    setattr(getattr(config, section), key, value)
    with pytest.raises(ConfigError, match=pattern):
        config.validate()


def test_demo_config_file_equals_the_defaults() -> None:
    from pathlib import Path

    from bigbatch.run.configuration.config_sources import load_toml

    path = Path(__file__).resolve().parents[2] / "configs" / "demo.toml"
    assert config_from_dict(load_toml(path)) == TrainConfig()


def test_micro_batch_auto_is_accepted_in_toml_and_round_trips() -> None:
    config = TrainConfig()
    apply_mapping(config, {"batch": {"micro_batch": "auto"}}, origin="t")
    assert config.batch.micro_batch == 0
    assert 'micro_batch = "auto"' in config.to_toml()
    assert config_from_dict(tomllib.loads(config.to_toml())) == config
    with pytest.raises(ConfigError, match='micro_batch must be int or "auto", got str'):
        apply_mapping(config, {"batch": {"micro_batch": "big"}}, origin="t")


def test_compile_switch_accepts_booleans_and_rejects_other_words() -> None:
    config = TrainConfig()
    assert config.run.compile == "auto"
    apply_mapping(config, {"run": {"compile": True}}, origin="t")
    assert config.run.compile == "on"
    config.run.compile = "maybe"
    with pytest.raises(ConfigError, match="compile must be one of auto, on, off"):
        config.validate()


def test_every_ready_config_loads_validates_and_divides() -> None:
    from pathlib import Path

    from bigbatch.models import model_preset
    from bigbatch.run.configuration.config_sources import load_toml
    from bigbatch.run.configuration.seq_len import resolve_seq_len
    from bigbatch.sizing.plan import plan_batch

    folder = Path(__file__).resolve().parents[2] / "configs"
    worlds = {"gpt2-124m.toml": 8, "gpt-1b-8gpu.toml": 8, "llama-1b-8gpu.toml": 8}
    names = sorted(p.name for p in folder.glob("*.toml"))
    assert names == ["demo.toml", "finetune-documents.toml", "gpt-1b-8gpu.toml", "gpt2-124m.toml", "llama-1b-8gpu.toml"]
    for name in names:
        config = resolve_seq_len(config_from_dict(load_toml(folder / name)))
        config.validate()
        assert config.batch.seq_len <= model_preset(config.model.preset).block_size, name
        if not config.batch.token_budget:
            plan = plan_batch(
                config.batch.total_batch_tokens, config.batch.micro_batch, config.batch.seq_len, worlds.get(name, 1)
            )
            if name == "gpt-1b-8gpu.toml":
                assert plan.accumulation_steps == 4
            if name == "llama-1b-8gpu.toml":
                assert config.model.preset == "llama3.2-1b" and config.model.activation_checkpointing
                assert config.run.parallel == "fsdp" and config.run.precision == "bf16"
                assert plan.tokens_per_step == 2_097_152 and plan.seq_len == 4096 and plan.accumulation_steps == 8
            if name == "gpt2-124m.toml":
                assert plan.accumulation_steps == 4 and plan.tokens_per_step == 524_288


def test_gpt_1b_preset_is_about_a_billion_parameters() -> None:
    import torch

    from bigbatch.models import GPT, preset

    with torch.device("meta"):
        n = GPT(preset("gpt-1b")).num_params(non_embedding=False)
    assert 1.0e9 < n < 1.2e9


def test_auto_set_from_python_is_stored_as_the_flag_stores_it() -> None:
    """``config.batch.micro_batch = "auto"`` reads as the flag's ``--micro-batch auto`` once validated, for every
    field that takes auto; the word on a field that does not take it is refused."""
    from dataclasses import fields

    from bigbatch.run.configuration.train_config import SECTIONS

    config = TrainConfig()
    auto_fields = [(s, f.name) for s, cls in SECTIONS.items() for f in fields(cls) if f.metadata.get("auto")]
    assert ("batch", "micro_batch") in auto_fields and ("batch", "seq_len") in auto_fields
    for section, name in auto_fields:
        setattr(getattr(config, section), name, "auto")
    config.validate()
    assert all(getattr(getattr(config, section), name) == 0 for section, name in auto_fields)
    assert 'micro_batch = "auto"' in config.to_toml()
    config.run.max_steps = "auto"  # type: ignore[assignment]
    with pytest.raises(ConfigError):
        config.validate()


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ('[batch]\nmicro_batch = "16"\n', "t.toml: batch.micro_batch must be int or \"auto\", got str '16'"),
        ("[batch]\nseq_len = 1.5\n", 't.toml: batch.seq_len must be int or "auto", got float 1.5'),
        ('[batch]\nmemory_budget = "lots"\n', "t.toml: batch.memory_budget must be float or \"auto\", got str 'lots'"),
        ('[batch]\ntotal_batch_tokens = "2M"\n', "t.toml: batch.total_batch_tokens must be int, got str '2M'"),
        ("[run]\ncompile = 3\n", 't.toml: run.compile must be "auto" or "on" or "off" (or true/false), got int 3'),
        ("[data]\npack = 1\n", 't.toml: data.pack must be "auto" or "on" or "off", got int 1'),
        (
            '[run]\nparallel = "dpp"\n',
            "t.toml: run.parallel must be one of auto, none, ddp, fsdp, got 'dpp'; did you mean ddp?",
        ),
    ],
)
def test_a_toml_type_error_names_every_word_the_field_takes(tmp_path: Path, toml: str, message: str) -> None:
    from bigbatch.cli.app import build_parser
    from bigbatch.run.configuration.config_sources import config_from_args

    (tmp_path / "t.toml").write_text(toml)
    args = build_parser().parse_args(["train", "--config", str(tmp_path / "t.toml")])
    with pytest.raises(ConfigError) as caught:
        config_from_args(args)
    assert str(caught.value) == message.replace("t.toml", str(tmp_path / "t.toml"))


def test_every_auto_field_says_auto_in_its_type_errors_from_toml_and_flags() -> None:
    """The class: each field whose range takes auto names it when a wrong type comes in, from both sources."""
    from dataclasses import fields

    from bigbatch.run.configuration.config_sources import accepted_words, check_type
    from bigbatch.run.configuration.train_config import SECTIONS, flag_of, kind_of

    auto_fields = [(s, f) for s, cls in SECTIONS.items() for f in fields(cls) if f.metadata.get("auto")]
    assert len(auto_fields) >= 6
    for section, f in auto_fields:
        with pytest.raises(ConfigError, match=r'or "auto", got list'):
            check_type(f"{section}.{f.name}", [], kind_of(f), accepted_words(f))
        with pytest.raises(argparse.ArgumentTypeError, match="or auto, got 'x'"):
            f.metadata["range"].argtype()("x")
        assert flag_of(f)


def test_install_hints_are_one_phrase_per_extra() -> None:
    from bigbatch.errors import EXTRAS, BigBatchError, install_hint, require_package

    assert install_hint("hf") == "pip install -e '.[hf]' (bigbatch's [hf] extra: datasets, transformers and peft)"
    assert set(EXTRAS) == {"hf", "tensorboard", "wandb"}
    with pytest.raises(BigBatchError) as caught:
        require_package("no_such_module_for_bigbatch", "--model hf:DIR", "hf", package="transformers")
    assert str(caught.value) == (
        "--model hf:DIR needs the transformers package, which is not installed: pip install -e '.[hf]' "
        "(bigbatch's [hf] extra: datasets, transformers and peft)"
    )
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    for extra in EXTRAS:
        assert f"\n{extra} = [" in pyproject  # every extra the hint names exists
