"""``--model hf:DIR``: any local Hugging Face causal LM through every command, as the native families go. Tiny
random GPT-2, Llama and Qwen2 models saved in the test (offline): train (their own weights, the accumulated update
equal to one giant batch), sample, eval, export (loaded back by AutoModelForCausalLM), verify, plan, memory, auto
micro-batch, compile, bitwise resume after SIGKILL, two processes under DDP and FSDP2; the mixture-of-experts rule
(trained with its load-balancing loss over the whole step) and the one-line refusals of directories
that are not a causal LM."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from exactness import assert_big_batch_updates, capture_training
from helpers import assert_one_line_error, corpus_bytes, run_main
from hf_models import CLASSES, save_hf
from reliability_runs import cli_args, final_model, run_cli, step_losses

from bigbatch.models import HFCausalLM, Llama, llama_preset
from bigbatch.models.hf.model import build_hf_model, read_hf_config
from bigbatch.models.llama.hf import save_hf_llama
from bigbatch.run.checkpoints import checkpoint as ckpt
from bigbatch.run.configuration.train_config import TrainConfig
from bigbatch.run.loop.trainer import Trainer

transformers = pytest.importorskip("transformers")

TRAIN = ["--seq-len", "32", "--micro-batch", "4", "--total-batch-tokens", "256", "--sample-tokens", "0"]
FAMILIES = ("gpt2", "llama", "qwen2")


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hf-model")
    (path / "corpus.txt").write_bytes(corpus_bytes(60_000))
    for kind in (*FAMILIES, "mixtral"):
        save_hf(kind, path / kind)
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
    """A Qwen2 run of 3 steps with validation: its directory and what it printed."""
    out = workspace / "run"
    argv = train_argv(
        workspace,
        out,
        "--model",
        f"hf:{workspace / 'qwen2'}",
        "--max-steps",
        "3",
        "--eval-every",
        "3",
        "--eval-batches",
        "3",
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(workspace)
        code, stdout, stderr = run_main(argv)
    assert code == 0, stdout + stderr
    return out, stdout


def first_batch(workspace: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1's 8 x 32 tokens with --shuffle off: the start of the stream."""
    data = (workspace / "corpus.txt").read_bytes()[: 2 * 4 * 32 + 1]
    return torch.tensor(list(data[:-1])).view(8, 32), torch.tensor(list(data[1:])).view(8, 32)


# --------------------------------------------------------------------------------------------
# train: three architectures from their own weights; the accumulated update is the giant batch's
# --------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("isolated")
@pytest.mark.parametrize("kind", FAMILIES)
def test_each_architecture_trains_from_its_own_weights(workspace: Path, tmp_path: Path, kind: str) -> None:
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(workspace / kind), local_files_only=True)
    out = tmp_path / "run"
    code, stdout, stderr = run_main(
        train_argv(
            workspace,
            out,
            "--model",
            f"hf:{workspace / kind}",
            "--max-steps",
            "2",
            "--eval-every",
            "0",
            "--lr",
            "1e-4",
            "--warmup-steps",
            "0",
            "--shuffle",
            "off",
        )
    )
    assert code == 0, stdout + stderr
    assert f"| hf {CLASSES[kind]}: 2 layers, " in stdout and "| vocab 256 | block 64" in stdout
    x, y = first_batch(workspace)
    with torch.no_grad():  # step 1's loss is the directory's weights' on the first 256 tokens
        expected = torch.nn.functional.cross_entropy(reference.eval()(x).logits.reshape(-1, 256), y.reshape(-1))
    assert float(stdout.split("step 1 | loss ")[1].split()[0]) == pytest.approx(expected.item(), abs=1e-4)
    document = ckpt.load_checkpoint(out)
    assert document["model_family"] == "hf"
    assert document["model_config"]["directory"] == str(workspace / kind)
    assert document["model_config"]["hf_config"]["model_type"] == kind


@pytest.mark.usefixtures("isolated")
@pytest.mark.parametrize("kind", FAMILIES)
def test_accumulated_hf_updates_equal_one_giant_batch(workspace: Path, tmp_path: Path, kind: str) -> None:
    """K = 4 micro-batches of 2 x 32, 3 steps with warmup, decay and clipping: every step's update is that of one
    forward/backward over all 8 sequences (loss = sum / valid targets) of the same Hugging Face module, clipped,
    one AdamW step at the logged learning rate (bar: 1e-5, or 10x how far the fp32 replay lands from float64)."""
    config = TrainConfig()
    config.model.preset = f"hf:{workspace / kind}"
    config.data.data, config.data.cache_dir = str(workspace / "corpus.txt"), str(workspace / "cache")
    config.batch.micro_batch, config.batch.seq_len, config.batch.total_batch_tokens = 2, 32, 256  # K = 4
    config.optim.warmup_steps = 2
    config.run.max_steps, config.run.eval_every, config.run.sample_tokens = 3, 0, 0
    config.run.out = str(tmp_path / "run")
    trainer = Trainer(config)
    assert isinstance(trainer.model, HFCausalLM) and trainer.plan.accumulation_steps == 4
    initial, steps, logged = capture_training(trainer)
    assert [len(s) for s in steps] == [r["micro_batches"] for r in logged] == [4, 4, 4]
    assert_big_batch_updates(trainer.model, initial, steps, logged)


def test_native_llama_and_the_hf_adapter_of_its_weights_give_equal_logits(tmp_path: Path) -> None:
    torch.manual_seed(0)
    native = Llama(llama_preset("llama-pico", vocab_size=256)).eval()
    save_hf_llama(native, tmp_path / "llama")
    adapter = build_hf_model(read_hf_config(tmp_path / "llama"), weights=True).eval()
    x = torch.randint(0, 256, (3, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(adapter(x), native(x), rtol=0, atol=1e-5)


# --------------------------------------------------------------------------------------------
# sample, eval, export, verify, plan on the Qwen2 run
# --------------------------------------------------------------------------------------------


def test_the_run_names_the_architecture_and_sample_and_eval_read_it(run: tuple[Path, str]) -> None:
    out, stdout = run
    assert "hf Qwen2ForCausalLM: 2 layers, 4 heads (2 key/value), 32 wide | vocab 256 | block 64" in stdout
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
    assert float(text.split("| loss ")[1].split()[0]) == pytest.approx(val_loss, abs=1e-4)


def test_export_loads_with_automodel_and_gives_equal_logits(run: tuple[Path, str], tmp_path: Path) -> None:
    out = tmp_path / "export"
    code, stdout, stderr = run_main(["export", str(run[0]), str(out)])
    assert code == 0, stderr
    assert "Hugging Face Qwen2ForCausalLM layout" in stdout
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    ours = ckpt.model_from_checkpoint(ckpt.load_checkpoint(run[0])).eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    assert type(theirs).__name__ == "Qwen2ForCausalLM"
    x = torch.randint(0, 256, (3, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(x).logits, ours(x), rtol=0, atol=1e-5)


def test_the_checkpoint_rebuilds_the_model_when_the_directory_has_gone(
    workspace: Path, tmp_path: Path, run: tuple[Path, str]
) -> None:
    document = ckpt.load_checkpoint(run[0])
    moved = {**document, "model_config": {**document["model_config"], "directory": str(tmp_path / "gone")}}
    model = ckpt.model_from_checkpoint(moved)
    assert isinstance(model, HFCausalLM)
    for name, value in document["model"].items():
        assert torch.equal(model.state_dict()[name], value), name


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_verify_says_equivalent(workspace: Path, kind: str) -> None:
    code, stdout, stderr = run_main(["verify", "--model", f"hf:{workspace / kind}", "--top", "0"])
    assert code == 0, stdout + stderr
    assert stdout.strip().endswith("verdict: EQUIVALENT")


def test_plan_names_the_model_and_says_the_estimate_is_unavailable(workspace: Path) -> None:
    code, stdout, stderr = run_main(
        ["plan", "--model", f"hf:{workspace / 'qwen2'}", "--tokens-per-step", "1024", "--micro-batch", "4"]
    )
    assert code == 0, stdout + stderr
    assert "seq_len 64 (the hf:" in stdout and "hf Qwen2ForCausalLM" in stdout
    assert "the analytic memory estimate is unavailable for hf: models" in stdout


# --------------------------------------------------------------------------------------------
# a mixture of experts trains with its balancing loss over the step; directories that are not a causal LM are one
# line
# --------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("isolated")
def test_a_mixture_of_experts_trains_with_the_steps_balancing_loss(workspace: Path, tmp_path: Path) -> None:
    """Mixtral: no warning, the header names the router's balance, the logged loss is the cross-entropy of the
    logits alone and the router loss is transformers' own aux_loss of the step's batch times its coefficient."""
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(workspace / "mixtral"), local_files_only=True)
    code, stdout, stderr = run_main(
        train_argv(
            workspace,
            tmp_path / "run",
            "--model",
            f"hf:{workspace / 'mixtral'}",
            "--max-steps",
            "1",
            "--eval-every",
            "0",
            "--shuffle",
            "off",
        )
    )
    assert code == 0, stdout + stderr
    assert "left out" not in stdout
    assert "router | top-2 of 4 experts | balance exact (over the whole step, from a routing pass) x 0.02" in stdout
    assert "hf MixtralForCausalLM: 2 layers, 4 heads (2 key/value), 32 wide, 4 experts" in stdout
    x, y = first_batch(workspace)
    with torch.no_grad():
        out = reference.eval()(x, output_router_logits=True)
        expected = torch.nn.functional.cross_entropy(out.logits.reshape(-1, 256), y.reshape(-1))
    assert float(stdout.split("step 1 | loss ")[1].split()[0]) == pytest.approx(expected.item(), abs=1e-4)
    step = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert step["kind"] == "step" and step["router_replay_mismatch"] == 0.0
    assert step["router_balance_loss"] == pytest.approx(float(out.aux_loss), rel=1e-5)


def test_a_mixture_of_experts_is_supported_by_what_its_router_does_not_by_its_name(
    workspace: Path, tmp_path: Path
) -> None:
    """GraniteMoE, never named in bigbatch: its aux_loss is bigbatch's balancing loss of its router logits, so it
    trains with the step's balance, its K = 1 router loss transformers' own."""
    from hf_moe_zoo import build_tiny

    build_tiny("granitemoe").save_pretrained(tmp_path / "granite")
    argv = train_argv(workspace, tmp_path / "run", "--model", f"hf:{tmp_path / 'granite'}", "--max-steps", "1")
    code, stdout, stderr = run_main([*argv, "--eval-every", "0", "--shuffle", "off", "--micro-batch", "8"])
    assert code == 0, stdout + stderr
    assert "router | top-2 of 4 experts | balance exact (over the whole step, from a routing pass) x 0.02" in stdout
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "granite"), local_files_only=True)
    x, _ = first_batch(workspace)
    with torch.no_grad():
        aux = float(reference.eval()(x, output_router_logits=True, use_cache=False).aux_loss)
    step = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert step["router_balance_loss"] == pytest.approx(aux, rel=1e-5)


def test_a_router_without_a_balancing_loss_is_one_line_unless_balance_is_off(workspace: Path, tmp_path: Path) -> None:
    """DeepSeek-V3 balances by a per-expert bias outside the gradient and transformers computes no aux_loss: refused
    in one line that names the bias and the way out, nothing written; --router-balance off trains it."""
    from hf_moe_zoo import build_tiny

    build_tiny("deepseek_v3").save_pretrained(tmp_path / "ds")
    argv = train_argv(workspace, tmp_path / "run", "--model", f"hf:{tmp_path / 'ds'}", "--max-steps", "1")
    line = assert_one_line_error(*run_main(argv))
    assert "is a mixture of experts (model_type deepseek_v3) whose balancing loss bigbatch cannot accumulate" in line
    assert "no aux_loss" in line and "e_score_correction_bias" in line and "--router-balance off" in line
    assert not (tmp_path / "run").exists()
    code, stdout, stderr = run_main([*argv, "--router-balance", "off", "--eval-every", "0"])
    assert code == 0, stdout + stderr
    assert "trained with no load-balancing loss (--router-balance off)" in stdout


def test_router_settings_on_a_dense_model_are_one_line(workspace: Path, tmp_path: Path) -> None:
    for flag in (["--router-balance", "micro"], ["--router-aux-coef", "0.1"]):
        code, out, err = run_main(train_argv(workspace, tmp_path / "run", "--model", "pico", *flag))
        line = assert_one_line_error(code, out, err)
        assert f"{' '.join(flag)} applies to a mixture of experts, and pico is dense" in line


@pytest.mark.parametrize("key", ["capacity_factor", "expert_capacity"])
def test_an_expert_capacity_is_refused(workspace: Path, tmp_path: Path, key: str) -> None:
    save_hf("mixtral", tmp_path / "capped", weights=False, **{key: 2})
    code, out, err = run_main(train_argv(workspace, tmp_path / "run", "--model", f"hf:{tmp_path / 'capped'}"))
    assert "routes tokens to experts with a capacity" in assert_one_line_error(code, out, err)
    code, out, err = run_main(train_argv(workspace, tmp_path / "run2", "--init-from", str(tmp_path / "capped")))
    assert "a capacity drops the tokens routed to a full expert" in assert_one_line_error(code, out, err)


def not_causal(directory: Path) -> str:
    directory.mkdir()
    (directory / "config.json").write_text(
        json.dumps(
            {
                "model_type": "bert",
                "architectures": ["BertForMaskedLM"],
                "hidden_size": 32,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "max_position_embeddings": 64,
                "vocab_size": 256,
            }
        )
    )
    return "holds BertForMaskedLM, not a causal language model"


def unknown(directory: Path) -> str:
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "my-own-lm", "hidden_size": 32}))
    return "has model_type 'my-own-lm', an architecture this transformers does not know"


def no_config(directory: Path) -> str:
    directory.mkdir()
    return "has no config.json"


def missing(directory: Path) -> str:
    return "does not exist; give a local Hugging Face model directory"


@pytest.mark.usefixtures("isolated")
@pytest.mark.parametrize("make", [not_causal, unknown, no_config, missing])
@pytest.mark.parametrize("seq_len", [["--seq-len", "32"], []])
def test_a_directory_that_is_not_a_causal_lm_is_one_line(
    workspace: Path, tmp_path: Path, make: Any, seq_len: list[str]
) -> None:
    directory = tmp_path / "model"
    expected = make(directory)
    argv = train_argv(workspace, tmp_path / "run", "--model", f"hf:{directory}", "--max-steps", "1")
    if not seq_len:  # seq_len auto reads the directory's context length first
        at = argv.index("--seq-len")
        del argv[at : at + 2]
    line = assert_one_line_error(*run_main(argv))
    assert expected in line
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.usefixtures("isolated")
def test_block_size_is_the_directorys_own(workspace: Path, tmp_path: Path) -> None:
    for flags, expected in ((["--block-size", "32"], "--block-size does not apply to hf:"),):
        argv = train_argv(workspace, tmp_path / "run", "--model", f"hf:{workspace / 'llama'}", *flags)
        assert expected in assert_one_line_error(*run_main(argv))


@pytest.mark.slow
@pytest.mark.usefixtures("isolated")
def test_config_json_dropout_is_off_unless_asked_and_said(workspace: Path, tmp_path: Path) -> None:
    """GPT-2's config.json sets dropout 0.1 in three places. By default it is replaced by --dropout 0, said at the
    start: 8 micro-batches of 1 then end where 1 of 8 does. --dropout 0.1 sets every dropout (said too), and the
    two splits part."""
    model = tmp_path / "gpt2"
    save_hf("gpt2", model, attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1)

    def train(name: str, micro_batch: str, *extra: str) -> tuple[str, dict[str, torch.Tensor]]:
        argv = train_argv(workspace, tmp_path / name, "--model", f"hf:{model}", "--max-steps", "3", *extra)
        argv[argv.index("--micro-batch") + 1] = micro_batch  # 8 sequences per step: K = 8 / micro_batch
        code, stdout, stderr = run_main([*argv, "--eval-every", "0", "--shuffle", "off"])
        assert code == 0, stdout + stderr
        return stdout, final_model(tmp_path / name)

    said = (
        f"hf:{model}: its config.json sets dropout (attn_pdrop 0.1, embd_pdrop 0.1, resid_pdrop 0.1, "
        "summary_first_dropout 0.1); trained without it (--dropout 0, the default), so micro-batch and full-batch "
        "gradients are identical; --dropout 0.1 trains with dropout, and then they differ"
    )
    (out_8x1, params_8x1), (out_1x8, params_1x8) = train("8x1", "1"), train("1x8", "8")
    assert said in out_8x1 and said in out_1x8
    flat_8x1, flat_1x8 = (torch.cat([v.flatten() for v in p.values()]) for p in (params_8x1, params_1x8))
    assert ((flat_8x1 - flat_1x8).norm() / flat_1x8.norm()).item() <= 1e-5
    dropped_out, params_dropped = train("8x1-dropout", "1", "--dropout", "0.1")
    assert f"hf:{model}: every dropout probability set to 0.1 (--dropout): micro-batch and full-batch" in dropped_out
    flat_dropped = torch.cat([v.flatten() for v in params_dropped.values()])
    assert ((flat_dropped - flat_1x8).norm() / flat_1x8.norm()).item() > 1e-4  # the masks differ


# --------------------------------------------------------------------------------------------
# random initialisation from config.json alone, auto micro-batch, memory, compile
# --------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("isolated")
def test_a_directory_without_weights_starts_from_the_seed(workspace: Path, tmp_path: Path) -> None:
    save_hf("llama", tmp_path / "config-only", weights=False)
    runs = []
    for name, seed in (("a", "1"), ("b", "1"), ("c", "2")):
        code, stdout, stderr = run_main(
            train_argv(
                workspace,
                tmp_path / name,
                "--model",
                f"hf:{tmp_path / 'config-only'}",
                "--max-steps",
                "1",
                "--eval-every",
                "0",
                "--seed",
                seed,
            )
        )
        assert code == 0, stdout + stderr
        runs.append(final_model(tmp_path / name))
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
    assert not all(torch.equal(runs[0][k], runs[2][k]) for k in runs[0])


@pytest.mark.slow
@pytest.mark.usefixtures("isolated")
def test_auto_micro_batch_and_memory_measure_an_hf_model(workspace: Path, tmp_path: Path) -> None:
    argv = train_argv(
        workspace,
        tmp_path / "run",
        "--model",
        f"hf:{workspace / 'llama'}",
        "--max-steps",
        "1",
        "--eval-every",
        "0",
        "--memory-budget",
        "4000",
    )
    argv[argv.index("--micro-batch") + 1] = "auto"
    code, stdout, stderr = run_main(argv)
    assert code == 0, stdout + stderr
    assert "auto micro-batch: 8 (largest that fits among [1, 2, 4, 8])" in stdout
    code, stdout, stderr = run_main(
        [
            "memory",
            "--model",
            f"hf:{workspace / 'llama'}",
            "--seq-len",
            "32",
            "--max-micro-batch",
            "2",
            "--k",
            "2",
            "--device",
            "cpu",
        ]
    )
    assert code == 0, stdout + stderr
    assert "n/a" in stdout and "estimate: the analytic memory estimate is unavailable for hf: models" in stdout


@pytest.mark.slow
@pytest.mark.usefixtures("isolated")
def test_compile_trains_an_hf_model_like_eager(workspace: Path, tmp_path: Path) -> None:
    losses = []
    for name, flag in (("eager", "--no-compile"), ("compiled", "--compile")):
        code, stdout, stderr = run_main(
            train_argv(
                workspace,
                tmp_path / name,
                "--model",
                f"hf:{workspace / 'llama'}",
                "--max-steps",
                "2",
                "--eval-every",
                "0",
                flag,
            )
        )
        assert code == 0, stdout + stderr
        assert "torch.compile does not work" not in stdout + stderr
        losses.append(step_losses(tmp_path / name))
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)


# --------------------------------------------------------------------------------------------
# bitwise resume after SIGKILL; two processes (DDP, FSDP2) equal one
# --------------------------------------------------------------------------------------------


def hf_args(corpus: Path, out: Path, model: Path, *extra: str) -> list[str]:
    argv = cli_args(corpus, out, *extra)
    argv[argv.index("--model") + 1] = f"hf:{model}"
    return argv


@pytest.mark.slow
def test_sigkill_then_resume_is_bitwise_identical(workspace: Path, tmp_path: Path) -> None:
    """A Llama with attention dropout (--dropout 0.1: the generators matter) killed inside step 5 resumes from
    step 4 and ends with the loss sequence and parameters of a run that never stopped."""
    model = tmp_path / "llama"
    save_hf("llama", model, attention_dropout=0.1)
    golden = tmp_path / "golden"
    done = run_cli(hf_args(workspace / "corpus.txt", golden, model, "--dropout", "0.1"))
    assert done.returncode == 0, done.stderr[-2000:]
    out = tmp_path / "run"
    again = ("--save-every", "2", "--dropout", "0.1")
    killed = run_cli(hf_args(workspace / "corpus.txt", out, model, *again), fault="kill:step=5,micro=2")
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed = run_cli(hf_args(workspace / "corpus.txt", out, model, *again))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout and "at step 4" in resumed.stdout
    assert step_losses(out) == step_losses(golden)  # bitwise: == on floats
    golden_model, trained = final_model(golden), final_model(out)
    assert set(trained) == set(golden_model) and "hf_model.model.layers.0.self_attn.k_proj.weight" in trained
    for name, value in golden_model.items():
        assert torch.equal(trained[name], value), name


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_processes_match_one(workspace: Path, tmp_path: Path, parallel: str) -> None:
    """--nproc 2 with micro-batch 1 against one process with micro-batch 2: the same 4 sequences per K, the same
    final parameters (FSDP2 shards each decoder layer)."""
    model = workspace / "qwen2"
    one = run_cli(hf_args(workspace / "corpus.txt", tmp_path / "one", model, "--eval-every", "0", "--max-steps", "3"))
    assert one.returncode == 0, one.stderr[-2000:]
    args = hf_args(
        workspace / "corpus.txt",
        tmp_path / "two",
        model,
        "--eval-every",
        "0",
        "--max-steps",
        "3",
        "--nproc",
        "2",
        "--parallel",
        parallel,
    )
    args[args.index("--micro-batch") + 1] = "1"
    two = run_cli(args)
    assert two.returncode == 0, two.stderr[-3000:]
    assert f"parallel {parallel}" in two.stdout and "x world 2" in two.stdout
    assert step_losses(tmp_path / "two") == pytest.approx(step_losses(tmp_path / "one"), rel=1e-5)
    reference = final_model(tmp_path / "one")
    trained = final_model(tmp_path / "two")
    assert set(trained) == set(reference)
    for name, value in reference.items():
        torch.testing.assert_close(trained[name], value, rtol=1e-4, atol=1e-6)
