"""Learning from rewards through ``bigbatch train --objective grpo`` (issue 55): a run on a rollouts file and a run
that samples its own completions, each killed inside a step, resume bitwise (a sampled rollout of two steps
included); the records carry the rollout's statistics; a reward function that fails, a malformed rollouts file and
every setting without meaning are refused in one line with nothing written."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import assert_one_line_error, run_main
from reliability_runs import assert_same_final_model, run_cli, step_losses


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("BIGBATCH_CACHE", str(tmp_path / "env-cache"))
    yield


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A text corpus (the tokenizer's data), a rollouts file of 12 groups of 4 uneven completions, a prompts file
    of sums with answers, and a reward module (the answer's first digit right: a reward that varies early)."""
    root = tmp_path_factory.mktemp("rewards")
    gen = random.Random(0)
    text = root / "text.txt"
    text.write_text(" ".join(str(gen.randint(0, 99)) for _ in range(3000)) + "\n")
    rollouts = root / "rollouts.jsonl"
    lines = []
    for g in range(12):
        prompt = f"{gen.randint(0, 9)}+{gen.randint(0, 9)}="
        for _ in range(4):
            completion = str(gen.randint(0, 18)) * gen.randint(1, 4) + "\n"
            lines.append({"group": f"g{g}", "prompt": prompt, "completion": completion, "reward": gen.random()})
    rollouts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    prompts = root / "prompts.jsonl"
    sums = [(gen.randint(0, 9), gen.randint(0, 9)) for _ in range(40)]
    prompts.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n" for a, b in sums))
    module = root / "digit_reward.py"
    module.write_text(
        "def first_digit(row, completion):\n"
        "    return float(completion[:1] == row['answer'][:1])\n"
        "def broken(row, completion):\n"
        "    raise KeyError('score')\n"
        "def exits(row, completion):\n"
        "    raise SystemExit(0)\n"
        "def mutates(row, completion):\n"
        "    row['answer'] = 'changed'\n"
        "    return 0.0\n"
    )
    return {"text": text, "rollouts": rollouts, "prompts": prompts, "module": module, "cache": root / "cache"}


def args(data: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return [
        *("train", "--data", str(data["text"]), "--tokenizer", "byte", "--model", "pico", "--seq-len", "24"),
        *("--micro-batch", "4", "--max-steps", "4", "--sample-tokens", "0", "--cache-dir", str(data["cache"])),
        *("--objective", "grpo", "--prompts-per-step", "3", "--out", str(out), *extra),
    ]


def offline(data: dict[str, Path]) -> list[str]:
    return ["--rollouts", str(data["rollouts"]), "--loss-aggregation", "seq-mean-token-mean"]


def sampled(data: dict[str, Path]) -> list[str]:
    return [
        *("--prompts", str(data["prompts"]), "--reward", f"{data['module']}:first_digit", "--stop", "\\n"),
        *("--group-size", "4", "--max-completion-tokens", "5", "--temperature", "1.0"),
    ]


@pytest.mark.slow
@pytest.mark.parametrize("source", ["offline", "sampled"])
def test_a_grpo_run_killed_inside_a_step_resumes_bitwise(data: dict[str, Path], tmp_path: Path, source: str) -> None:
    """Killed inside a step, resumed, a run ends with the losses and parameters of a run that never stopped: a
    rollouts file's run killed in step 3, and a sampled run killed in
    the second step of a rollout of two, whose completions and old log-probabilities step 1's checkpoint holds."""
    extra = offline(data) if source == "offline" else [*sampled(data), "--updates-per-rollout", "2"]
    golden = tmp_path / "golden"
    done = run_cli(args(data, golden, *extra))
    assert done.returncode == 0, done.stderr[-2000:]
    out = tmp_path / "run"
    kill_at = "kill:step=3,micro=0" if source == "offline" else "kill:step=2,micro=0"
    save = ["--save-every", "2" if source == "offline" else "1"]
    killed = run_cli(args(data, out, *extra, *save), fault=kill_at)
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed = run_cli(args(data, out, *extra, *save))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout
    assert step_losses(out) == step_losses(golden)  # bitwise: == on floats
    assert_same_final_model(out, golden)


def test_a_sampled_run_records_its_rollouts(data: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "run"
    code, stdout, err = run_main(args(data, out, *sampled(data), "--max-steps", "2", "--eval-every", "0"))
    assert code == 0, err
    assert "objective | grpo: policy per token" in stdout and "rollouts | 40 prompts" in stdout
    assert "spikes: gradient norm" in stdout and "spikes: loss" not in stdout  # a policy loss is not judged
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if r["kind"] == "step"]
    assert len(steps) == 2
    for record in steps:
        assert 0.0 <= record["reward/mean"] <= 1.0 and record["time/generation_s"] > 0
        assert 1.0 <= record["completion/tokens"] <= 5.0
        assert record["term/policy"] == pytest.approx(record["loss"])
    assert steps[0]["ratio/abs_log"] == 0.0 and steps[0]["clipped"] == 0.0  # old policy = policy at the 1st update
    report = run_main(["report", str(out)])
    assert report[0] == 0 and (out / "report" / "reward_vs_step.png").is_file()
    assert "rewards" in report[1] and "reward " in report[1]


def test_a_reward_function_that_fails_is_one_line_naming_the_row(data: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "run"
    extra = [*sampled(data)]
    extra[extra.index(f"{data['module']}:first_digit")] = f"{data['module']}:broken"
    code, stdout, err = run_main(args(data, out, *extra))
    line = assert_one_line_error(code, stdout, err)
    assert "broken" in line and f"of {data['prompts']}" in line and "KeyError" in line, line
    assert not (out / "checkpoints").exists()


def write_rollouts(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


ROW = {"group": 0, "prompt": "1+1=", "completion": "2\n", "reward": 1.0}


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{k: v for k, v in ROW.items() if k != "group"}], "has no 'group'"),
        ([{k: v for k, v in ROW.items() if k != "reward"}], "neither 'reward' nor 'advantage'"),
        ([{**ROW, "reward": "high"}], "not a finite number"),
        ([{**ROW, "completion_ids": [50, 300]}], "outside the model's vocabulary"),
        ([{**ROW, "completion_ids": [51, 10]}], "are not the tokens of 'completion'"),
        ([{**ROW, "logps": [-0.5]}], "one log-probability per completion token"),
        ([ROW, {**ROW, "prompt": "2+2="}], "another prompt than its first line"),
        ([{**ROW, "completion": "9" * 40}], "more than seq_len+1"),
    ],
    ids=["no-group", "no-reward", "bad-reward", "bad-id", "ids-not-text", "logps-length", "two-prompts", "too-long"],
)
def test_a_malformed_rollouts_file_is_refused_in_one_line(
    data: dict[str, Path], tmp_path: Path, rows: list[dict[str, object]], message: str
) -> None:
    path = write_rollouts(tmp_path / "bad.jsonl", rows)
    out = tmp_path / "refused"
    code, stdout, err = run_main(args(data, out, "--rollouts", str(path)))
    line = assert_one_line_error(code, stdout, err)
    assert message in line and "line " in line, line
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--objective", "lm", "--group-size", "4"], "--group-size, --prompts-per-step set learning from rewards"),
        ([], "give --prompts FILE"),
        (["--prompts", "p.jsonl"], "--prompts needs --reward"),
        (["--rollouts", "r.jsonl", "--top-p", "0.5"], "--top-p shapes sampling"),
        (["--prompts", "p.jsonl", "--reward", "builtin:format", "--group-size", "1"], "--group-size 1"),
        (["--prompts", "p.jsonl", "--reward", "builtin:format", "--temperature", "0"], "--temperature 0 samples"),
        (["--prompts", "p.jsonl", "--reward", "builtin:format", "--top-k", "1"], "--top-k 1 samples greedily"),
        (["--rollouts", "r.jsonl", "--temperature", "1e-45"], "divides the logits past what float32 holds"),
        (["--rollouts", "r.jsonl", "--dropout", "0.1"], "--dropout with --objective grpo"),
        (["--rollouts", "r.jsonl", "--flat-groups", "resample"], "--flat-groups resample samples more prompts"),
        (["--rollouts", "r.jsonl", "--batch-ramp", "256:2048"], "does not take --batch-ramp"),
        (["--rollouts", "r.jsonl", "--token-budget", "512"], "does not take --token-budget"),
        (["--rollouts", "r.jsonl", "--beta", "0.2"], "not of --objective grpo"),
        (["--rollouts", "r.jsonl", "--norm-constant", "8"], "--norm-constant is the constant"),
        (["--rollouts", "r.jsonl", "--loss-aggregation", "bnpo"], "token-mean over the whole step"),
        (["--rollouts", "missing.jsonl"], "--rollouts missing.jsonl: no such file"),
        (["--prompts", "missing.jsonl", "--reward", "builtin:format", "--stop", "\\n"], "no such file"),
        (["--prompts", "p.jsonl", "--reward", "builtin:nope"], "--reward builtin:nope"),
    ],
    ids=[
        "flag-without-grpo",
        "no-source",
        "no-reward",
        "sampler-flag-offline",
        "group-of-one",
        "greedy",
        "top-k-one",
        "tiny-temperature",
        "dropout",
        "resample-offline",
        "ramp",
        "budget",
        "beta",
        "norm-constant",
        "bnpo",
        "missing-rollouts",
        "missing-prompts",
        "unknown-builtin",
    ],
)
def test_what_a_grpo_run_cannot_mean_is_refused_in_one_line(
    data: dict[str, Path], tmp_path: Path, extra: list[str], message: str
) -> None:
    out = tmp_path / "refused"
    code, stdout, err = run_main(args(data, out, *extra))
    line = assert_one_line_error(code, stdout, err)
    assert message in line, line
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()


def test_a_rollouts_files_norm_constant_is_its_longest_completion(data: dict[str, Path], tmp_path: Path) -> None:
    """seq-mean-token-sum-norm's C, auto: a rollouts file has no --max-completion-tokens, so its longest completion."""
    rows = [json.loads(line) for line in data["rollouts"].read_text().splitlines()]
    longest = max(len(row["completion"].encode()) for row in rows)  # byte tokens
    out = tmp_path / "run"
    extra = ["--rollouts", str(data["rollouts"]), "--loss-aggregation", "seq-mean-token-sum-norm", "--max-steps", "1"]
    code, stdout, err = run_main(args(data, out, *extra))
    assert code == 0, err
    assert "(C = the longest completion)" in stdout
    assert f"objective | C = {longest}, the rollouts file's longest completion" in stdout


def test_prompts_as_conversations_render_with_a_real_template_and_its_generation_prompt(tmp_path: Path) -> None:
    """``messages`` prompts go through the tokenizer's own chat template (a byte copy of Qwen2.5's, which also
    injects a default system prompt) with its generation prompt, so a completion starts where a reply does."""
    from real_templates import real_chat_dir
    from transformers import AutoTokenizer

    from bigbatch.data.chat import ChatTemplate
    from bigbatch.data.tokenizers import get_tokenizer
    from bigbatch.rewards.rollout_maker import read_prompts
    from bigbatch.run.build.rollout_phase import _template_encoder

    model_dir = real_chat_dir(tmp_path / "qwen", "qwen2.5")
    text = tmp_path / "text.txt"
    text.write_text("The answer is four. " * 400)
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"What is {a} + {a}?"}], "answer": str(2 * a)} for a in range(6)]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    reward = tmp_path / "length_reward.py"
    reward.write_text("def short(row, completion):\n    return -float(len(completion))\n")
    out = tmp_path / "run"
    code, stdout, err = run_main(
        [
            *("train", "--data", str(text), "--tokenizer", f"file:{model_dir}", "--model", "pico", "--seq-len", "160"),
            *("--block-size", "256"),
            *("--micro-batch", "4", "--max-steps", "1", "--sample-tokens", "0", "--eval-every", "0"),
            *("--objective", "grpo", "--prompts", str(prompts), "--reward", f"{reward}:short", "--group-size", "2"),
            *("--prompts-per-step", "2", "--max-completion-tokens", "4", "--out", str(out)),
        ]
    )
    assert code == 0, err
    assert "rollouts | 6 prompts" in stdout
    # the run's own encoders: a prompt text's special-token text stays text, a template's control tokens are tokens
    tokenizer = get_tokenizer(f"file:{model_dir}")
    template = ChatTemplate(model_dir)
    read = read_prompts(
        prompts,
        lambda s: tokenizer.encode(s.encode()),
        lambda m, w: template.render(w, m, None, True),
        _template_encoder(tokenizer),
    )
    hf = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    expected = hf.apply_chat_template(rows[0]["messages"], add_generation_prompt=True, tokenize=False)
    assert expected.endswith("<|im_start|>assistant\n") and "You are Qwen" in expected
    assert read[0].ids == hf.encode(expected, add_special_tokens=False)  # <|im_start|> one token, as Qwen reads it
    assert read[0].ids[0] == hf.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.encode(b"<|im_start|>") != [read[0].ids[0]]  # in a prompt text, the same characters are text
    assert read[0].row == rows[0]  # what the reward functions see: the row as read


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_an_hf_model_samples_its_completions_and_learns_from_them(
    data: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    """``--model hf:DIR``: transformers' own key-value cache samples, the chunked head scores per token; the KL's
    reference is the base with the adapters off under LoRA (no second copy in memory), else a frozen copy."""
    from hf_models import save_hf

    save_hf(kind, tmp_path / kind)
    out = tmp_path / "run"
    lora = ["--lora-rank", "4"] if kind == "llama" else []  # transformers' GPT-2 Conv1D: no auto LoRA targets
    extra = [*sampled(data), "--max-steps", "2", "--eval-every", "0", *lora, "--kl-coef", "0.05"]
    argv = args(data, out, *extra)
    argv[argv.index("pico")] = f"hf:{tmp_path / kind}"
    code, stdout, err = run_main(argv)
    assert code == 0, err
    reference = "the base model, LoRA adapters off" if lora else "a frozen reference model"
    assert f"reference | {reference}" in stdout
    assert "objective | grpo: policy per token + kl per token x 0.05" in stdout
    steps = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "step"]
    assert len(steps) == 2 and steps[0]["kl"] == pytest.approx(0.0, abs=1e-7)  # adapters start at 0: policy = base
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in steps)


def test_a_bad_micro_batch_is_left_out_and_its_completions_leave_the_denominators(
    data: dict[str, Path], tmp_path: Path
) -> None:
    """--bad-step skip-micro under grpo: a micro-batch whose gradient is not finite is dropped, and the step is
    computed again over the others, its units counted without the dropped completions (the advantages of their
    groups stay as the rollout computed them)."""
    out = tmp_path / "run"
    extra = [*offline(data), "--micro-batch", "2", "--pack", "off", "--max-steps", "3", "--eval-every", "0"]
    done = run_cli(args(data, out, *extra), fault="inf-grad:step=2,micro=1")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "bad step 2" in done.stdout and "micro-batch 1" in done.stdout
    steps = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "step"]
    assert len(steps) == 3 and not any(r["skipped"] for r in steps)
    golden = tmp_path / "golden"
    assert run_cli(args(data, golden, *extra)).returncode == 0
    full = [r for r in map(json.loads, (golden / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "step"]
    # step 2 trained on 2 fewer completions (one micro-batch of 2 rows): fewer tokens than the golden run's step
    assert steps[1]["tokens"] < full[1]["tokens"] and steps[0]["tokens"] == full[0]["tokens"]
    assert steps[1]["completion/tokens"] > 0


@pytest.mark.parametrize("function", ["exits", "mutates"])
def test_a_reward_function_cannot_end_the_run_or_change_the_row_others_read(
    data: dict[str, Path], tmp_path: Path, function: str
) -> None:
    """A reward that calls exit is a failing reward (one line, exit 2), not the run's end with exit 0; a reward
    that changes its row changes its own copy: the next function, and the next completion, read the row as read."""
    out = tmp_path / "run"
    extra = [*sampled(data), "--max-steps", "1", "--eval-every", "0"]
    extra[extra.index(f"{data['module']}:first_digit")] = f"{data['module']}:{function},{data['module']}:first_digit"
    code, stdout, err = run_main(args(data, out, *extra))
    if function == "exits":
        line = assert_one_line_error(code, stdout, err)
        assert "reward" in line and "exits" in line and "SystemExit" in line, line
        return
    assert code == 0, err
    golden = tmp_path / "golden"
    assert run_main(args(data, golden, *sampled(data), "--max-steps", "1", "--eval-every", "0"))[0] == 0
    ours = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    theirs = json.loads((golden / "metrics.jsonl").read_text().splitlines()[-1])
    assert ours["reward/mean"] == theirs["reward/mean"]  # first_digit read the true answers


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"prompt": "1+2=\xff", "answer": "3"}\n', "line 1 of"),
        (b'{"prompt": "1+1=\\ud800", "answer": "2"}\n', "lone surrogate"),
    ],
    ids=["not-utf8", "surrogate"],
)
def test_a_prompts_file_of_broken_text_is_one_line(
    data: dict[str, Path], tmp_path: Path, content: bytes, message: str
) -> None:
    prompts = tmp_path / "bad.jsonl"
    prompts.write_bytes(content)
    extra = [*sampled(data)]
    extra[extra.index(str(data["prompts"]))] = str(prompts)
    out = tmp_path / "refused"
    line = assert_one_line_error(*run_main(args(data, out, *extra)))
    assert message in line, line
    assert not (out / "checkpoints").exists()


def test_a_rollouts_file_of_flat_groups_with_drop_is_refused_before_training(
    tmp_path: Path, data: dict[str, Path]
) -> None:
    path = write_rollouts(tmp_path / "flat.jsonl", [ROW, {**ROW, "completion": "3\n"}])  # one group, rewards equal
    out = tmp_path / "refused"
    line = assert_one_line_error(*run_main(args(data, out, "--rollouts", str(path), "--flat-groups", "drop")))
    assert "every group is flat" in line, line
    assert not (out / "metrics.jsonl").exists()


def test_resuming_with_another_micro_batch_changes_no_learning_rate(data: dict[str, Path], tmp_path: Path) -> None:
    """A grpo step is its prompts' completions whatever --micro-batch or the processes: a resume that changes them
    is no batch change (no rescaled learning rate or beta2)."""
    out = tmp_path / "run"
    first = run_main(args(data, out, *offline(data), "--max-steps", "2", "--eval-every", "0"))
    assert first[0] == 0, first[2]
    code, stdout, err = run_main(
        args(data, out, *offline(data), "--max-steps", "3", "--eval-every", "0", "--micro-batch", "2")
    )
    assert code == 0, err
    assert "resumed from" in stdout and "batch change" not in stdout
    lrs = [r["lr"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "step"]
    golden = tmp_path / "golden"  # the same two sessions, the micro-batch unchanged
    assert run_main(args(data, golden, *offline(data), "--max-steps", "2", "--eval-every", "0"))[0] == 0
    assert run_main(args(data, golden, *offline(data), "--max-steps", "3", "--eval-every", "0"))[0] == 0
    expected = [
        r["lr"] for r in map(json.loads, (golden / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "step"
    ]
    assert lrs == expected
