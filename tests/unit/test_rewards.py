"""GRPO's rewards: ``--reward`` values parsed and loaded (by path and by module), their values checked and weighted,
every failure said in one line naming the reward and the completion, the builtins, and the demo task's files."""

from __future__ import annotations

import json
import math
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from bigbatch.data.corpus import read_documents
from bigbatch.errors import BigBatchError, ConfigError
from bigbatch.rewards import BUILTINS, END, RewardError, RewardSet, RewardSpec, parse_rewards
from bigbatch.rewards.builtin import answer_format, exact_answer
from bigbatch.rewards.demo_task import (
    MAX_OPERAND,
    SPLITS,
    is_test_pair,
    split_pairs,
    task_rows,
    write_task,
)

WHERE = "prompt row 12 of prompts.jsonl, completion 3"
ROW = {"prompt": "23+58=", "answer": "81"}

REWARD_MODULE = """
import math

from helper_for_rewards import LENGTH_UNIT


def length(row, completion):
    return len(completion) / LENGTH_UNIT


def value(row, completion):
    return row["value"]


def boom(row, completion):
    raise ValueError("no answer\\nsecond line")


def one_argument(row):
    return 1.0


def takes_anything(*args):
    return 0.5


NOT_A_FUNCTION = 3
"""


def one_line(message: str) -> str:
    assert "\n" not in message, message
    return message


@pytest.fixture
def reward_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``my_rewards.py`` (and the module it imports beside it) in the current directory."""
    (tmp_path / "my_rewards.py").write_text(REWARD_MODULE)
    (tmp_path / "helper_for_rewards.py").write_text("LENGTH_UNIT = 2\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "helper_for_rewards", raising=False)
    return tmp_path / "my_rewards.py"


# ------------------------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    ("value", "name", "weight"),
    [
        ("builtin:exact-answer", "exact-answer", 1.0),
        ("builtin:format=0.2", "format", 0.2),
        (" builtin:format=-1e-3 ", "format", -0.001),
        ("builtin:format=0", "format", 0.0),
        ("my_rewards:length", "my_rewards:length", 1.0),
        ("pkg.sub.mod:fn=2", "pkg.sub.mod:fn", 2.0),
        ("my_rewards.py:length=0.5", "my_rewards.py:length", 0.5),
        ("rewards/a=b/r.py:fn=3", "rewards/a=b/r.py:fn", 3.0),
    ],
)
def test_every_form_of_the_flag_parses(value: str, name: str, weight: float) -> None:
    spec = RewardSpec.parse(value)
    assert spec == RewardSpec(name, weight)
    assert spec.is_builtin == (":" not in name)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("exact-answer", ["--reward exact-answer names no function (no ':')", "did you mean builtin:exact-answer?"]),
        ("format=0.2", ["no ':'", "did you mean builtin:format?"]),
        ("formt", ["no ':'", "did you mean builtin:format?"]),
        ("rewards.py", ["no ':'", "MODULE:FUNCTION[=WEIGHT]"]),
        (":fn", ["--reward :fn has an empty MODULE"]),
        ("my_rewards:", ["--reward my_rewards: has an empty FUNCTION"]),
        ("builtin:exact-anser", ["no builtin reward 'exact-anser'", "did you mean builtin:exact-answer?"]),
        (
            "builtin:nothing-like",
            ["no builtin reward 'nothing-like'; give one of builtin:exact-answer, builtin:format"],
        ),
        ("builtin:format=abc", ["--reward builtin:format=abc: the weight 'abc' is not a finite number"]),
        ("builtin:format=nan", ["the weight 'nan' is not a finite number"]),
        ("builtin:format=inf", ["the weight 'inf' is not a finite number"]),
        ("builtin:format=", ["the weight '' is not a finite number"]),
        ("my_rewards:not-a-name", ["'not-a-name' is not the name of a Python function"]),
        ("my-rewards:fn", ["'my-rewards' is neither a dotted module name nor the path of a .py file"]),
    ],
)
def test_a_bad_value_is_refused_in_one_line_naming_it_and_the_forms(value: str, expected: list[str]) -> None:
    with pytest.raises(ConfigError) as caught:
        RewardSpec.parse(value)
    message = one_line(str(caught.value))
    assert message.startswith(f"--reward {value}")
    for fragment in expected:
        assert fragment in message
    if "weight" not in message and "no builtin" not in message:
        assert "builtins: builtin:exact-answer, builtin:format" in message


def test_several_rewards_come_as_a_list_or_separated_by_commas() -> None:
    expected = [RewardSpec("exact-answer"), RewardSpec("format", 0.2)]
    assert parse_rewards("builtin:exact-answer,builtin:format=0.2") == expected
    assert parse_rewards(" builtin:exact-answer , builtin:format=0.2,") == expected
    assert parse_rewards(["builtin:exact-answer", "builtin:format=0.2"]) == expected
    assert parse_rewards("") == [] and parse_rewards([]) == []
    assert RewardSet.from_flags("builtin:exact-answer,builtin:format=0.2").specs == tuple(expected)
    with pytest.raises(ConfigError, match="--reward formt names no function"):
        parse_rewards("builtin:exact-answer,formt")


def test_a_spec_made_directly_is_checked_too() -> None:
    with pytest.raises(ConfigError, match="no builtin reward 'exakt-answer'.*did you mean builtin:exact-answer"):
        RewardSpec("exakt-answer")
    with pytest.raises(ConfigError, match="weight inf is not a finite number"):
        RewardSpec("format", math.inf)
    with pytest.raises(ConfigError, match="--reward builtin:format='2': the weight '2' is not a finite number"):
        RewardSpec("format", "2")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="by its NAME alone"):
        RewardSpec("builtin:format")


# ------------------------------------------------------------------------------------------- loading


def test_a_reward_file_loads_by_path_and_imports_its_neighbours(reward_file: Path) -> None:
    before = list(sys.path)
    rewards = RewardSet.from_flags(["my_rewards.py:length=0.5", "builtin:format"])
    assert sys.path == before  # its folder was on sys.path only while it ran
    assert rewards.names == ("my_rewards.py:length", "format")
    total, values = rewards.score(ROW, "81\n", WHERE)
    assert values == {"my_rewards.py:length": 1.5, "format": 1.0}  # 3 characters / LENGTH_UNIT 2
    assert total == 0.5 * 1.5 + 1.0
    absolute = RewardSet([RewardSpec(f"{reward_file}:length")])  # an absolute path too
    assert absolute.score(ROW, "8", WHERE) == (0.5, {f"{reward_file}:length": 0.5})


def test_a_reward_module_loads_by_dotted_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "reward_pkg_for_test"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "checks.py").write_text("def short(row, completion):\n    return len(completion) < 4\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("reward_pkg_for_test", "reward_pkg_for_test.checks"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    rewards = RewardSet.from_flags(["reward_pkg_for_test.checks:short=2", "builtin:exact-answer"])
    assert rewards.score(ROW, "81\n", WHERE) == (3.0, {"reward_pkg_for_test.checks:short": 1.0, "exact-answer": 1.0})
    assert rewards.score(ROW, "1234\n", WHERE) == (0.0, {"reward_pkg_for_test.checks:short": 0.0, "exact-answer": 0.0})


def _load_error(flags: list[str]) -> str:
    with pytest.raises(ConfigError) as caught:
        RewardSet.from_flags(flags)
    return one_line(str(caught.value))


def test_every_loading_failure_is_one_line_naming_the_flag(
    reward_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    message = _load_error(["no_such_module_for_rewards:fn"])
    assert message.startswith("--reward no_such_module_for_rewards:fn: no module named 'no_such_module_for_rewards'")
    assert "PYTHONPATH" in message
    # a module beside the user that is not importable by name: its path is suggested
    message = _load_error(["my_rewards:length"])
    assert "no module named 'my_rewards' can be imported; my_rewards.py is here: give its path" in message
    message = _load_error(["missing.py:fn=2"])
    assert message.startswith("--reward missing.py:fn=2: there is no file missing.py (relative to ")
    message = _load_error(["my_rewards.py:lenght"])
    assert "my_rewards.py has no 'lenght'; did you mean length?" in message
    assert "(it defines: boom, length, one_argument, takes_anything, value)" in message
    message = _load_error(["my_rewards.py:NOT_A_FUNCTION"])
    assert "my_rewards.py:NOT_A_FUNCTION is a int, not a function; give a function fn(row, completion)" in message
    message = _load_error(["my_rewards.py:one_argument"])
    assert "my_rewards.py:one_argument(row) cannot be called as fn(row, completion)" in message
    assert RewardSet.from_flags(["my_rewards.py:takes_anything"]).score(ROW, "", WHERE)[0] == 0.5

    (tmp_path / "broken.py").write_text("def f(row, completion):\n    return 1\nraise RuntimeError('half set up')\n")
    message = _load_error(["broken.py:f"])
    assert message.startswith(
        "--reward broken.py:f: importing broken.py failed: RuntimeError: half set up (at broken.py:3)"
    )
    (tmp_path / "bad_syntax.py").write_text("def f(row, completion)\n    return 1\n")
    assert "importing bad_syntax.py failed: SyntaxError" in _load_error(["bad_syntax.py:f"])
    (tmp_path / "needs_more.py").write_text("import a_dependency_not_installed_here\n")
    message = _load_error(["needs_more.py:f"])
    assert "ModuleNotFoundError: No module named 'a_dependency_not_installed_here'" in message
    assert sys.path.count(str(tmp_path)) == 0

    monkeypatch.syspath_prepend(str(tmp_path))  # a dotted module whose own import fails
    monkeypatch.delitem(sys.modules, "needs_more", raising=False)
    message = _load_error(["needs_more:f"])
    assert message.startswith("--reward needs_more:f: importing needs_more failed: ModuleNotFoundError")


def test_a_reward_given_twice_or_none_is_refused() -> None:
    assert "format is given twice" in _load_error(["builtin:format", "builtin:format=0.5"])
    message = _load_error([])
    assert message.startswith("no --reward given; give MODULE:FUNCTION[=WEIGHT]")
    assert "builtin:exact-answer" in message


# ------------------------------------------------------------------------------------------- scoring


def test_weights_are_summed_and_described() -> None:
    rewards = RewardSet.from_flags(["builtin:exact-answer", "builtin:format=0.2"])
    assert rewards.describe() == "exact-answer x 1 + format x 0.2"
    assert rewards.specs == (RewardSpec("exact-answer"), RewardSpec("format", 0.2))
    total, values = rewards.score(ROW, "81\n", WHERE)
    assert values == {"exact-answer": 1.0, "format": 1.0} and total == pytest.approx(1.2)
    assert rewards.score(ROW, "18\n", WHERE) == (pytest.approx(0.2), {"exact-answer": 0.0, "format": 1.0})
    assert rewards.score(ROW, "81", WHERE) == (1.0, {"exact-answer": 1.0, "format": 0.0})
    penalty = RewardSet.from_flags(["builtin:format=-1"])
    assert penalty.score(ROW, "81\n", WHERE) == (-1.0, {"format": 1.0})


@pytest.mark.parametrize(
    ("returned", "value"),
    [
        (True, 1.0),
        (False, 0.0),
        (3, 3.0),
        (-0.5, -0.5),
        (Fraction(1, 4), 0.25),
        (np.float32(0.5), 0.5),
        (np.int64(2), 2.0),
        (np.bool_(True), 1.0),
        (np.array(0.25), 0.25),
        (torch.tensor(0.75), 0.75),
        (torch.tensor(True), 1.0),
    ],
)
def test_every_kind_of_number_is_a_reward(reward_file: Path, returned: Any, value: float) -> None:
    rewards = RewardSet.from_flags(["my_rewards.py:value"])
    total, values = rewards.score({**ROW, "value": returned}, "81\n", WHERE)
    assert values == {"my_rewards.py:value": value} and type(values["my_rewards.py:value"]) is float
    assert total == value


@pytest.mark.parametrize(
    ("returned", "expected"),
    [
        (None, "returned None (a NoneType) on prompt row 12 of prompts.jsonl, completion 3: a reward must be a number"),
        ("1.0", "returned '1.0' (a str) on"),
        ([1.0], "returned [1.0] (a list) on"),
        ({"score": 1}, "returned {'score': 1} (a dict) on"),
        (1 + 2j, "returned (1+2j) (a complex) on"),
        (torch.tensor([1.0]), "returned tensor([1.]) (a Tensor) on"),
        (torch.zeros(3, 3), "returned tensor([[0., 0., 0.], [0., 0., 0.], [0., 0., 0.]]) (a Tensor) on"),
        (np.array(["x"]), "(a ndarray) on"),
        (math.nan, "returned nan on prompt row 12 of prompts.jsonl, completion 3: a reward must be a finite number"),
        (math.inf, "returned inf on"),
        (-math.inf, "returned -inf on"),
        (np.float64("nan"), "returned np.float64(nan) on"),
        (torch.tensor(float("inf")), "returned tensor(inf) on"),
        (10**400, "returned 1000000000"),
    ],
)
def test_a_value_that_is_not_a_finite_number_stops_the_run_naming_the_completion(
    reward_file: Path, returned: Any, expected: str
) -> None:
    rewards = RewardSet.from_flags(["builtin:exact-answer", "my_rewards.py:value"])
    with pytest.raises(RewardError) as caught:
        rewards.score({**ROW, "value": returned}, "81\n", WHERE)
    message = one_line(str(caught.value))
    assert isinstance(caught.value, BigBatchError)
    assert message.startswith("reward my_rewards.py:value returned ")
    if "np.float64" in expected and not repr(returned).startswith("np."):  # numpy < 2 shows a bare nan
        expected = "returned nan on"
    assert expected in message
    assert WHERE in message


def test_a_reward_that_raises_stops_the_run_naming_the_completion_and_the_line(reward_file: Path) -> None:
    rewards = RewardSet.from_flags(["my_rewards.py:boom"])
    with pytest.raises(RewardError) as caught:
        rewards.score(ROW, "81\n", WHERE)
    assert one_line(str(caught.value)) == (
        f"reward my_rewards.py:boom failed on {WHERE}: ValueError: no answer (at my_rewards.py:16); fix the reward "
        "function, or the row if it lacks what the function reads"
    )
    assert isinstance(caught.value.__cause__, ValueError)  # the traceback is kept for whoever wants it


def test_a_builtin_on_a_row_without_an_answer_names_the_row() -> None:
    rewards = RewardSet.from_flags(["builtin:exact-answer"])
    with pytest.raises(RewardError) as caught:
        rewards.score({"prompt": "23+58="}, "81\n", WHERE)
    message = one_line(str(caught.value))
    assert message.startswith(f"reward exact-answer failed on {WHERE}: ValueError: the row has no 'answer' field")
    assert "(fields: prompt)" in message
    for bad, what in ((None, "a NoneType, not text"), ("  ", "is empty"), ([81], "a list, not text")):
        with pytest.raises(RewardError, match=what):
            rewards.score({"prompt": "23+58=", "answer": bad}, "81\n", WHERE)
    assert rewards.score({"prompt": "23+58=", "answer": 81}, "81\n", WHERE)[0] == 1.0  # JSON's number


def test_a_sum_that_overflows_is_refused(reward_file: Path) -> None:
    rewards = RewardSet.from_flags(["my_rewards.py:value=1e308", "builtin:format=1e308"])
    with pytest.raises(RewardError, match=f"the rewards of {WHERE} add up to inf"):
        rewards.score({**ROW, "value": 10.0}, "81\n", WHERE)


# ------------------------------------------------------------------------------------------- builtins


@pytest.mark.parametrize(
    ("completion", "exact", "formatted"),
    [
        ("81\n", 1.0, 1.0),
        ("81", 1.0, 0.0),  # cut off before END: the answer is right, the format is not
        (" 81 \n", 1.0, 0.0),
        ("81\n\n", 1.0, 0.0),
        ("81\n12+3=15\n", 1.0, 0.0),  # what follows END is not read as the answer, and breaks the format
        ("18\n", 0.0, 1.0),
        ("081\n", 0.0, 0.0),  # a leading zero is neither the answer nor the format
        ("810\n", 0.0, 1.0),
        ("8 1\n", 0.0, 0.0),
        ("+81\n", 0.0, 0.0),
        ("23+58=81\n", 0.0, 0.0),  # restating the problem is no answer
        ("=81\n", 0.0, 0.0),
        ("\u0668\u0661\n", 0.0, 0.0),  # Arabic-Indic digits are not the task's digits
        ("\n81\n", 0.0, 0.0),
        ("\n", 0.0, 0.0),
        ("", 0.0, 0.0),
    ],
)
def test_the_builtins_on_hand_picked_completions(completion: str, exact: float, formatted: float) -> None:
    assert exact_answer(ROW, completion) == exact
    assert answer_format(ROW, completion) == formatted
    assert BUILTINS["exact-answer"] is exact_answer and BUILTINS["format"] is answer_format


def test_zero_is_an_answer_in_the_format() -> None:
    row = {"prompt": "0+0=", "answer": "0"}
    assert (exact_answer(row, "0\n"), answer_format(row, "0\n")) == (1.0, 1.0)
    assert exact_answer({"prompt": "1+1=", "answer": " 2 "}, "2\n") == 1.0  # the row's answer is stripped too


# ------------------------------------------------------------------------------------------- the demo task


def test_task_rows_are_deterministic_distinct_correct_and_short() -> None:
    rows = task_rows(300, seed=7, split="train")
    assert rows == task_rows(300, seed=7, split="train")
    assert rows[:100] == task_rows(100, seed=7, split="train")  # a prefix of a larger draw
    assert rows != task_rows(300, seed=8, split="train")
    assert len({row["prompt"] for row in rows}) == 300
    for row in rows:
        assert set(row) == {"prompt", "answer"}
        a, b = row["prompt"].removesuffix("=").split("+")
        assert row["prompt"] == f"{int(a)}+{int(b)}=" and 0 <= int(a) <= MAX_OPERAND and 0 <= int(b) <= MAX_OPERAND
        assert row["answer"] == str(int(a) + int(b))
        assert len(row["prompt"].encode()) < 16 and row["prompt"].isascii()
    assert task_rows(2, seed=0, split="test") == [
        {"prompt": "42+13=", "answer": "55"},
        {"prompt": "4+0=", "answer": "4"},
    ]


def test_the_splits_are_disjoint_and_keep_both_orders_of_a_sum_together() -> None:
    train, test = set(split_pairs("train")), set(split_pairs("test"))
    assert not train & test and len(train | test) == (MAX_OPERAND + 1) ** 2
    assert 0.05 < len(test) / len(train | test) < 0.15
    assert all(((b, a) in test) == is_test_pair(a, b) for a, b in train | test)
    everything = {row["prompt"] for row in task_rows(len(test), seed=3, split="test")}
    assert not everything & {row["prompt"] for row in task_rows(len(train), seed=4, split="train")}


def test_task_rows_refuse_what_the_task_cannot_give() -> None:
    with pytest.raises(ConfigError, match="split 'val' does not exist; give one of train, test"):
        task_rows(1, split="val")
    with pytest.raises(ConfigError, match=r"test split has \d+ distinct rows; ask for 0 to \d+"):
        task_rows(100_000, split="test")
    assert SPLITS == ("train", "test")


def _jsonl(path: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_task_files_are_deterministic_disjoint_and_read_by_prepare(tmp_path: Path) -> None:
    paths = write_task(tmp_path / "a" / "task", seed=1, n_sft=300, n_prompts=100, n_test=50)
    again = write_task(tmp_path / "b", seed=1, n_sft=300, n_prompts=100, n_test=50)
    assert set(paths) == {"sft", "prompts", "test"}
    assert [p.name for p in paths.values()] == ["sft.jsonl", "prompts.jsonl", "test.jsonl"]
    for name in paths:
        assert paths[name].read_bytes() == again[name].read_bytes()
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["prompts.jsonl", "sft.jsonl", "test.jsonl"]

    sft, prompts, test = (_jsonl(paths[name]) for name in ("sft", "prompts", "test"))
    assert (len(sft), len(prompts), len(test)) == (300, 100, 50)
    assert sft[0] == {"prompt": sft[0]["prompt"], "completion": sft[0]["completion"]}
    assert all(row["completion"].endswith(END) for row in sft)
    sft_prompts, grpo_prompts, test_prompts = ({row["prompt"] for row in rows} for rows in (sft, prompts, test))
    assert len(sft_prompts) == 300 and len(grpo_prompts) == 100 and len(test_prompts) == 50
    assert not sft_prompts & grpo_prompts and not (sft_prompts | grpo_prompts) & test_prompts

    # the SFT rows are what prepare reads as prompt/completion documents, and their completions score full marks
    rewards = RewardSet.from_flags(["builtin:exact-answer", "builtin:format"])
    documents = list(read_documents([paths["sft"]]))
    assert len(documents) == 300
    for document, row in zip(documents, sft, strict=True):
        assert document.conversation is None and document.answers is None
        assert document.prompt == row["prompt"].encode() and document.data == row["completion"].encode()
        a, b = row["prompt"].removesuffix("=").split("+")
        assert (
            rewards.score({"prompt": row["prompt"], "answer": str(int(a) + int(b))}, row["completion"], WHERE)[0] == 2.0
        )
    for index, row in enumerate(prompts + test):
        assert rewards.score(row, row["answer"] + END, f"prompt row {index}") == (
            2.0,
            {"exact-answer": 1.0, "format": 1.0},
        )
