"""The Llama family through every command, as GPT-2 goes: train (exact accumulation, bitwise resume after SIGKILL,
--init-from a Hugging Face Llama directory), sample, eval, export (loaded back by transformers), verify, and the
refusals (an unsupported model_type, a family change on resume)."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from exactness import assert_big_batch_updates, capture_training
from helpers import assert_one_line_error, corpus_bytes, run_main
from reliability_runs import cli_args, final_model, run_cli, step_losses

from bigbatch.models import Llama, llama_preset
from bigbatch.run.checkpoints import checkpoint as ckpt
from bigbatch.run.configuration.train_config import TrainConfig
from bigbatch.run.loop.trainer import Trainer

TRAIN = ["--seq-len", "32", "--micro-batch", "4", "--total-batch-tokens", "256", "--sample-tokens", "0"]


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    (path / "corpus.txt").write_bytes(corpus_bytes(60_000))
    return path


def train_argv(workspace: Path, out: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--data",
        str(workspace / "corpus.txt"),
        "--cache-dir",
        str(workspace / "cache"),
        "--out",
        str(out),
        *TRAIN,
        *extra,
    ]


@pytest.fixture(scope="module")
def run(workspace: Path) -> tuple[Path, str]:
    """A llama-pico run of 3 steps with validation and an MFU peak: its directory and what it printed."""
    out = workspace / "run"
    argv = train_argv(
        workspace,
        out,
        "--model",
        "llama-pico",
        "--max-steps",
        "3",
        "--eval-every",
        "3",
        "--eval-batches",
        "3",
        "--peak-flops",
        "1e12",
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(workspace)
        code, stdout, stderr = run_main(argv)
    assert code == 0, stdout + stderr
    return out, stdout


# --------------------------------------------------------------------------------------------
# train: the header, MFU, the noise scale; the accumulated update is the giant batch's
# --------------------------------------------------------------------------------------------


def test_a_llama_run_says_its_shape_and_logs_mfu_and_the_noise_scale(run: tuple[Path, str]) -> None:
    out, stdout = run
    assert (
        "model llama-pico | 0.03M parameters | llama: 2 layers, 2 heads (1 key/value), 32 wide, ffn 96 | vocab "
        "256 | block 64" in stdout
    )
    assert "| mfu " in stdout and "| noise scale " in stdout
    document = ckpt.load_checkpoint(out)
    assert document["model_family"] == "llama" and document["model_config"]["n_kv_head"] == 1
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("noise_scale") is not None for r in records if r["kind"] == "step")


@pytest.mark.usefixtures("isolated")
def test_accumulated_llama_updates_equal_one_giant_batch(workspace: Path, tmp_path: Path) -> None:
    """llama-pico, K = 4 micro-batches of 2 x 32, 4 steps with warmup, decay and clipping: every step's update is
    that of one forward/backward over all 8 sequences (loss = sum / valid targets), clipped, one AdamW step at the
    logged learning rate. The bar is 1e-5, or 10x how far the same replay in fp32 lands from float64."""
    config = TrainConfig()
    config.model.preset = "llama-pico"
    config.data.data = str(workspace / "corpus.txt")
    config.data.cache_dir = str(workspace / "cache")
    config.batch.micro_batch, config.batch.seq_len, config.batch.total_batch_tokens = 2, 32, 256  # K = 4
    config.optim.warmup_steps = 2
    config.run.max_steps = 4
    config.run.eval_every = 0
    config.run.sample_tokens = 0
    config.run.out = str(tmp_path / "run")
    trainer = Trainer(config)
    assert isinstance(trainer.model, Llama) and trainer.plan.accumulation_steps == 4
    initial, steps, logged = capture_training(trainer)
    assert [len(s) for s in steps] == [r["micro_batches"] for r in logged] == [4, 4, 4, 4]
    assert_big_batch_updates(trainer.model, initial, steps, logged)
    assert trainer.model.lm_head.weight is trainer.model.model.embed_tokens.weight  # still tied


@pytest.mark.slow
def test_sigkill_then_resume_is_bitwise_identical(workspace: Path, tmp_path: Path) -> None:
    """llama-pico with dropout (the generators matter) killed inside step 5 resumes from step 4 and ends with
    the loss sequence and parameters of a run that never stopped."""

    def args(out: Path, *extra: str) -> list[str]:
        argv = cli_args(workspace / "corpus.txt", out, "--dropout", "0.1", *extra)
        argv[argv.index("--model") + 1] = "llama-pico"
        return argv

    golden = tmp_path / "golden"
    done = run_cli(args(golden))
    assert done.returncode == 0, done.stderr[-2000:]
    out = tmp_path / "run"
    killed = run_cli(args(out, "--save-every", "2"), fault="kill:step=5,micro=2")
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed = run_cli(args(out, "--save-every", "2"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout and "at step 4" in resumed.stdout
    assert step_losses(out) == step_losses(golden)  # bitwise: == on floats
    golden_model, model = final_model(golden), final_model(out)
    assert set(model) == set(golden_model) and "model.layers.0.self_attn.k_proj.weight" in model
    for name, value in golden_model.items():
        assert torch.equal(model[name], value), name


# --------------------------------------------------------------------------------------------
# sample, eval, export, verify
# --------------------------------------------------------------------------------------------


def test_sample_and_eval_read_the_llama_checkpoint(run: tuple[Path, str]) -> None:
    out, stdout = run
    code, text, err = run_main(
        [
            "sample",
            "--checkpoint",
            str(out),
            "--prompt",
            "the ",
            "--max-new-tokens",
            "12",
            "--temperature",
            "0",
            "--device",
            "cpu",
        ]
    )
    assert code == 0, err
    assert text.startswith("the ") and len(text) > len("the \n")
    code, text, err = run_main(["eval", str(out), "--device", "cpu"])
    assert code == 0, err
    val_loss = float(stdout.split("eval step 3 | val loss ")[1].split()[0])
    assert float(text.split("| loss ")[1].split()[0]) == pytest.approx(val_loss, abs=1e-4)  # the run's own windows


def test_export_loads_in_transformers_as_llama_with_identical_logits(run: tuple[Path, str], tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    code, stdout, stderr = run_main(["export", str(run[0]), str(out)])
    assert code == 0, stderr
    assert "Hugging Face Llama layout" in stdout and "transformers.LlamaForCausalLM.from_pretrained" in stdout
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    ours = ckpt.model_from_checkpoint(ckpt.load_checkpoint(run[0])).eval()
    assert isinstance(ours, Llama)
    theirs = transformers.LlamaForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    x = torch.randint(0, ours.config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(x).logits, ours(x), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_verify_says_equivalent_for_llama_pico() -> None:
    code, stdout, stderr = run_main(["verify", "--model", "llama-pico", "--top", "0"])
    assert code == 0, stdout + stderr
    assert stdout.strip().endswith("verdict: EQUIVALENT")
    assert "split unequal" in stdout and "classic mistake 'mean / K'" in stdout


# --------------------------------------------------------------------------------------------
# --init-from a Hugging Face Llama directory
# --------------------------------------------------------------------------------------------


def hf_llama(directory: Path, max_positions: int = 64, **extra: Any) -> Any:
    """A random transformers Llama over the byte vocabulary, saved to ``directory`` (offline)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    fields: dict[str, Any] = {
        "vocab_size": 256,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        **extra,
    }
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields)).eval()
    model.save_pretrained(directory)
    return model


@pytest.mark.usefixtures("isolated")
def test_init_from_a_llama_directory_trains_and_exports_back(workspace: Path, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    reference = hf_llama(tmp_path / "hf")
    out = tmp_path / "run"
    code, stdout, stderr = run_main(
        train_argv(
            workspace,
            out,
            "--init-from",
            str(tmp_path / "hf"),
            "--max-steps",
            "2",
            "--eval-every",
            "0",
            "--lr",
            "1e-4",
            "--warmup-steps",
            "0",
            "--shuffle",
            "off",  # step 1 reads the start of the stream
        )
    )
    assert code == 0, stdout + stderr
    assert (
        f"model {tmp_path / 'hf'} |" in stdout and "llama: 2 layers, 4 heads (2 key/value), 32 wide, ffn 64" in stdout
    )
    # The pretrained weights were used: step 1's loss is the reference's on the first 256 tokens of the stream.
    data = (workspace / "corpus.txt").read_bytes()[: 2 * 4 * 32 + 1]
    x, y = torch.tensor(list(data[:-1])).view(8, 32), torch.tensor(list(data[1:])).view(8, 32)
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(reference(x).logits.reshape(-1, 256), y.reshape(-1))
    assert float(stdout.split("step 1 | loss ")[1].split()[0]) == pytest.approx(expected.item(), abs=1e-4)

    exported = tmp_path / "export"
    code, text, err = run_main(["export", str(out), str(exported)])
    assert code == 0, err
    config = json.loads((exported / "config.json").read_text())
    assert config["num_key_value_heads"] == 2 and config["tie_word_embeddings"] is False
    ours = ckpt.model_from_checkpoint(ckpt.load_checkpoint(out)).eval()
    theirs = transformers.LlamaForCausalLM.from_pretrained(str(exported), local_files_only=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(x).logits, ours(x), rtol=0, atol=1e-5)
        assert not torch.allclose(theirs(x).logits, reference(x).logits, atol=1e-4)  # it trained: weights moved


@pytest.mark.slow
@pytest.mark.usefixtures("isolated")
def test_init_from_caps_seq_len_auto_and_says_so(workspace: Path, tmp_path: Path) -> None:
    """A directory that declares Llama 3.2's 131,072 positions: seq_len auto is 8,192, said in the plan line."""
    hf_llama(tmp_path / "hf", max_positions=131_072)
    argv = train_argv(
        workspace,
        tmp_path / "run",
        "--init-from",
        str(tmp_path / "hf"),
        "--max-steps",
        "1",
        "--eval-every",
        "0",
        "--noise-scale-every",
        "0",
    )
    seq_len = argv.index("--seq-len")
    del argv[seq_len : seq_len + 2]
    argv[argv.index("--micro-batch") + 1] = "1"
    argv[argv.index("--total-batch-tokens") + 1] = "8192"
    code, stdout, stderr = run_main(argv)
    assert code == 0, stdout + stderr
    assert "| seq_len 8192 (the model's block size 131,072, capped at 8,192; --seq-len sets it)" in stdout
    assert "block 131072" in stdout


@pytest.mark.usefixtures("isolated")
@pytest.mark.parametrize("seq_len", [["--seq-len", "32"], []])
def test_init_from_an_unsupported_model_type_is_one_line(workspace: Path, tmp_path: Path, seq_len: list[str]) -> None:
    directory = tmp_path / "mistral"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "mistral", "hidden_size": 32}))
    argv = train_argv(workspace, tmp_path / "run", "--init-from", str(directory), "--max-steps", "1")
    if not seq_len:  # seq_len auto reads the directory's context length first
        at = argv.index("--seq-len")
        del argv[at : at + 2]
    line = assert_one_line_error(*run_main(argv))
    assert "model_type 'mistral'" in line
    assert "--init-from reads only gpt2, llama, mixtral or qwen3_moe" in line
    assert f"pass --model hf:{directory} instead of --init-from" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.usefixtures("isolated")
def test_resume_refuses_a_family_change_in_one_line(workspace: Path, tmp_path: Path) -> None:
    """The same command, but --init-from's directory now holds a Llama where the run trained a GPT-2."""
    transformers = pytest.importorskip("transformers")
    directory = tmp_path / "hf"
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=256)
    transformers.GPT2LMHeadModel(config).save_pretrained(directory)
    argv = train_argv(
        workspace, tmp_path / "run", "--init-from", str(directory), "--max-steps", "1", "--eval-every", "0"
    )
    code, stdout, stderr = run_main(argv)
    assert code == 0, stdout + stderr
    assert ckpt.load_checkpoint(tmp_path / "run")["model_family"] == "gpt"
    shutil.rmtree(directory)
    hf_llama(directory)
    argv[argv.index("--max-steps") + 1] = "2"
    line = assert_one_line_error(*run_main(argv))
    assert "holds a gpt model but this run builds a llama model" in line


# --------------------------------------------------------------------------------------------
# --dropout, torch.compile
# --------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("isolated")
def test_dropout_reaches_every_llama_layer(workspace: Path, tmp_path: Path) -> None:
    config = TrainConfig()
    config.model.preset, config.model.dropout = "llama-pico", 0.25
    config.data.data, config.data.cache_dir = str(workspace / "corpus.txt"), str(workspace / "cache")
    config.batch.micro_batch, config.batch.seq_len, config.batch.total_batch_tokens = 2, 32, 128
    config.run.max_steps, config.run.eval_every, config.run.sample_tokens = 1, 0, 0
    config.run.out = str(tmp_path / "run")
    trainer = Trainer(config)
    dropouts = [m.p for m in trainer.model.modules() if isinstance(m, torch.nn.Dropout)]
    assert dropouts == [0.25] * 4  # attention and MLP outputs of both layers
    assert all(layer.self_attn.dropout == 0.25 for layer in trainer.model.model.layers)
    trainer.close()


@pytest.mark.slow
def test_compiled_llama_pico_matches_eager_on_cpu() -> None:
    """torch.compile of a llama-pico (inductor, CPU): the same logits and gradients as eager, to fp32 rounding."""
    torch.manual_seed(0)
    eager = Llama(llama_preset("llama-pico", vocab_size=256))
    compiled_copy = copy.deepcopy(eager)
    compiled = torch.compile(compiled_copy)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    expected, got = eager(x), compiled(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    expected.float().logsumexp(-1).sum().backward()
    got.float().logsumexp(-1).sum().backward()
    for (name, p), q in zip(eager.named_parameters(), compiled_copy.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        scale = p.grad.norm().item()
        assert (q.grad - p.grad).norm().item() <= 1e-5 * max(scale, 1e-12) + 1e-7, name
