"""LoRA adapters (``--lora-rank``), end to end: only the adapters train, exactly whatever the micro-batch, K,
activation checkpointing and process count; a run resumes bitwise; the export reloads in transformers (merged) and
in peft (``--adapter``) with the logits it says; bad settings are one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from chat_models import chat_model_dir, conversations
from exactness import rel_diff
from helpers import assert_one_line_error, corpus_bytes, run_main
from reliability_runs import assert_same_final_model, final_model

from bigbatch.engine.optim import build_adamw
from bigbatch.models import build_model
from bigbatch.models.lora import LoraSettings, add_lora, merge_lora
from bigbatch.models.registry import model_preset


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("lora")
    model = chat_model_dir(root / "model", "qwen2.5", with_model=True)
    data = root / "chat.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in conversations() * 4))
    text = root / "text.txt"
    text.write_bytes(corpus_bytes(40_000))
    return model, data, text


def _chat_args(model: Path, data: Path, out: Path, micro_batch: int, *extra: str) -> list[str]:
    return [
        *("train", "--model", f"hf:{model}", "--data", str(data), "--data-mode", "documents", "--seq-len", "64"),
        *("--micro-batch", str(micro_batch), "--total-batch-tokens", "512", "--max-steps", "3", "--eval-every", "0"),
        *("--sample-tokens", "0", "--noise-scale-every", "0", "--lr", "1e-2", "--warmup-steps", "0"),
        *("--cache-dir", str(out.parent / "cache"), "--out", str(out), "--lora-rank", "4", *extra),
    ]


def _train(args: list[str]) -> str:
    code, out, err = run_main(args)
    assert code == 0, out + err
    return out


def _assert_adapters_match(a: Path, b: Path, tolerance: float = 1e-5) -> None:
    ours, theirs = final_model(a), final_model(b)
    assert ours.keys() == theirs.keys()
    adapters = [name for name in ours if "lora_" in name]
    assert adapters
    for name in adapters:
        assert rel_diff(ours[name].float(), theirs[name].float()) <= tolerance, name


def test_only_the_adapters_train_and_reach_the_optimizer() -> None:
    torch.manual_seed(0)
    model = build_model(model_preset("llama-pico", vocab_size=64))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    report = add_lora(model, LoraSettings(rank=2))
    assert {t.rsplit(".", 1)[-1] for t in report.targets} == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    optimizer = build_adamw(model, lr=1e-3)
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    trainable = {name for name, p in model.named_parameters() if id(p) in in_optimizer}
    assert trainable and all("lora_" in name for name in trainable)
    assert report.adapter_parameters == sum(p.numel() for p in model.parameters() if p.requires_grad)
    merge_lora(model)  # B starts at zero: merging a fresh adapter changes nothing
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(torch.equal(after[n], v) for n, v in before.items())


@pytest.mark.parametrize(
    ("targets", "message"),
    [("nope", r"--lora-targets 'nope' matches no linear map of the model; its linear maps are named .*q_proj")],
)
def test_targets_that_match_nothing_are_one_line(targets: str, message: str) -> None:
    from bigbatch.errors import ConfigError

    model = build_model(model_preset("llama-pico", vocab_size=64))
    with pytest.raises(ConfigError, match=message):
        add_lora(model, LoraSettings(rank=2, targets=targets))


def test_lora_on_chat_data_is_exact_whatever_the_micro_batch(tmp_path: Path, setup: tuple[Path, Path, Path]) -> None:
    """8 rows x K 1 and 1 row x K 8 on conversations of very uneven assistant lengths: the same adapters; the base
    weights never move."""
    model, data, _ = setup
    out = _train(_chat_args(model, data, tmp_path / "mb8", 8))
    assert "lora | rank 4, alpha 4 |" in out and "adapter parameters trained" in out
    _train(_chat_args(model, data, tmp_path / "mb1", 1))
    _assert_adapters_match(tmp_path / "mb1", tmp_path / "mb8")
    trained = final_model(tmp_path / "mb8")
    from safetensors.torch import load_file

    base = load_file(str(model / "model.safetensors"))
    frozen = {n.removeprefix("hf_model.").replace(".base_layer", ""): v for n, v in trained.items() if "lora_" not in n}
    assert frozen.keys() == base.keys()
    for name, value in base.items():
        assert torch.equal(frozen[name], value), name  # frozen: bit for bit the directory's


def test_lora_with_activation_checkpointing_gives_the_same_adapters(
    tmp_path: Path, setup: tuple[Path, Path, Path]
) -> None:
    """The reentrant-checkpoint class: with frozen embeddings no input requires a gradient, and reentrant
    checkpointing would drop the adapters' gradients; bigbatch's non-reentrant checkpointing keeps them (hf: and a
    native family)."""
    model, data, text = setup
    _train(_chat_args(model, data, tmp_path / "plain", 4))
    _train(_chat_args(model, data, tmp_path / "ckpt", 4, "--activation-checkpointing"))
    _assert_adapters_match(tmp_path / "ckpt", tmp_path / "plain", 1e-6)
    native = [
        *("train", "--model", "llama-pico", "--data", str(text), "--seq-len", "32", "--micro-batch", "4"),
        *("--total-batch-tokens", "256", "--max-steps", "3", "--eval-every", "0", "--sample-tokens", "0"),
        *("--noise-scale-every", "0", "--lora-rank", "4", "--cache-dir", str(tmp_path / "cache")),
    ]
    _train([*native, "--out", str(tmp_path / "n-plain")])
    _train([*native, "--out", str(tmp_path / "n-ckpt"), "--activation-checkpointing"])
    _assert_adapters_match(tmp_path / "n-ckpt", tmp_path / "n-plain", 1e-6)
    moved = final_model(tmp_path / "n-ckpt")
    assert any(v.abs().sum() > 0 for n, v in moved.items() if "lora_B" in n)  # B left zero: the adapters trained


def test_a_lora_run_resumes_bitwise(tmp_path: Path, setup: tuple[Path, Path, Path]) -> None:
    model, data, _ = setup
    straight = _chat_args(model, data, tmp_path / "straight", 4, "--decay-steps", "4", "--save-every", "2")
    _train([*straight, "--max-steps", "4"])
    stopped = _chat_args(model, data, tmp_path / "stopped", 4, "--decay-steps", "4", "--save-every", "2")
    _train([*stopped, "--max-steps", "2"])
    out = _train([*stopped, "--max-steps", "4"])
    assert "resum" in out.lower()
    assert_same_final_model(tmp_path / "stopped", tmp_path / "straight")


def test_exports_reload_with_the_logits_they_state(tmp_path: Path, setup: tuple[Path, Path, Path]) -> None:
    model, data, _ = setup
    run = tmp_path / "run"
    _train(_chat_args(model, data, run, 4))
    code, out, err = run_main(["export", str(run), str(tmp_path / "merged")])
    assert code == 0, err
    stated = float(re.search(r"logits are within (\S+) of the trained", out).group(1))  # type: ignore[union-attr]
    assert stated <= 1e-4 and "with its LoRA adapters merged" in out
    code, out, err = run_main(["export", str(run), "--adapter", str(tmp_path / "adapter")])
    assert code == 0, err
    assert float(re.search(r"logits are within (\S+) of the trained", out).group(1)) <= 1e-4  # type: ignore[union-attr]
    import peft
    import transformers

    held = torch.arange(16).unsqueeze(0) % 100
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    base = transformers.AutoModelForCausalLM.from_pretrained(str(model)).eval()
    adapted = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(str(model)), str(tmp_path / "adapter")
    ).eval()
    with torch.no_grad():
        a, m, b = (x(input_ids=held).logits for x in (adapted, merged, base))
    assert (a - m).abs().max() <= 1e-4  # merged and adapter exports are the same model
    assert (a - b).abs().max() > 1e-3  # and not the base: the adapters trained and were written
    assert json.loads((tmp_path / "merged" / "tokenizer_config.json").read_text())["chat_template"]


def test_bad_lora_settings_are_one_line(tmp_path: Path, setup: tuple[Path, Path, Path]) -> None:
    model, data, _ = setup
    base = _chat_args(model, data, tmp_path / "bad", 4)
    base = base[: base.index("--lora-rank")]
    cases = [
        (["--lora-rank", "-1"], "lora-rank"),
        (["--lora-alpha", "8"], "give --lora-rank R to train them"),
        (["--lora-rank", "4", "--lora-targets", "nothing_here"], "matches no linear map"),
    ]
    for extra, message in cases:
        line = assert_one_line_error(*run_main([*base, *extra]))
        assert message in line, line
        assert not (tmp_path / "bad" / "checkpoints").exists()
    _train(_chat_args(model, data, tmp_path / "full", 4)[:-2])  # no --lora-rank: the whole model
    line = assert_one_line_error(*run_main(["export", str(tmp_path / "full"), "--adapter", str(tmp_path / "x")]))
    assert "trained the whole model (no --lora-rank)" in line and not (tmp_path / "x").exists()


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_processes_train_the_same_adapters(tmp_path: Path, setup: tuple[Path, Path, Path], parallel: str) -> None:
    model, data, _ = setup
    _train(_chat_args(model, data, tmp_path / "one", 8))
    _train(_chat_args(model, data, tmp_path / "two", 4, "--nproc", "2", "--parallel", parallel))
    _assert_adapters_match(tmp_path / "two", tmp_path / "one")


def test_verify_with_adapters_compares_their_gradients() -> None:
    code, out, err = run_main(["verify", "--model", "llama-pico", "--lora-rank", "2", "--top", "40"])
    assert code == 0, out + err
    assert "verdict: EQUIVALENT" in out
    listed = [line.split()[0] for line in out.splitlines() if ".lora_" in line]
    assert listed and any("lora_A" in n for n in listed) and any("lora_B" in n for n in listed)
    assert not any(line.split()[0].endswith("base_layer.weight") for line in out.splitlines() if line.strip())
