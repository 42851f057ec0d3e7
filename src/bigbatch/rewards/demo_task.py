"""A toy verifiable task for the GRPO demo on CPU: two-number addition, ``"23+58="`` -> ``"81"``.

Why addition of two numbers from 0 to 99: the prompts are at most 6 bytes and the answers at most 3 digits, so a
byte-level model of about a million parameters sees thousands of examples a minute on two CPU cores; it learns the
format and most sums by supervised training in a few minutes, and the sums with carries stay partly wrong for a
while, which leaves the rewards something to improve. An answer is checked exactly (:mod:`bigbatch.rewards.builtin`).

A completion is the answer then :data:`~bigbatch.rewards.builtin.END` (a newline): the byte vocabulary has no
end-of-text token, so the task writes its own, and a sampler stops after it.

The splits are fixed by the numbers, not by the seed: the pair ``{a, b}`` is a test pair when a CRC-32 of
``"min+max"`` is a multiple of :data:`TEST_ONE_IN` (about a tenth of the pairs). ``a+b`` and ``b+a`` are in the
same split, so that the test measures sums the model has not seen in either order. The seed only picks which rows
of a split are drawn, so rows of the two splits never meet, whatever seeds they are drawn with.
"""

from __future__ import annotations

import logging
import random
import zlib
from pathlib import Path

from bigbatch.errors import ConfigError
from bigbatch.files.atomic import write_text_atomically
from bigbatch.files.json_text import to_json
from bigbatch.rewards.builtin import END

log = logging.getLogger(__name__)

MAX_OPERAND = 99
"""Both numbers of a prompt are 0 to this."""
TEST_ONE_IN = 10
"""About one pair in this many is a test pair."""
SPLITS = ("train", "test")

SFT_FILE, PROMPTS_FILE, TEST_FILE = "sft.jsonl", "prompts.jsonl", "test.jsonl"


def is_test_pair(a: int, b: int) -> bool:
    """Whether ``a+b`` (and so ``b+a``) belongs to the test split."""
    low, high = sorted((a, b))
    return zlib.crc32(f"{low}+{high}".encode()) % TEST_ONE_IN == 0


def split_pairs(split: str) -> list[tuple[int, int]]:
    """Every ``(a, b)`` of ``split``, in order."""
    if split not in SPLITS:
        raise ConfigError(f"the demo task's split {split!r} does not exist; give one of {', '.join(SPLITS)}")
    wanted = split == "test"
    span = range(MAX_OPERAND + 1)
    return [(a, b) for a in span for b in span if is_test_pair(a, b) == wanted]


def task_row(a: int, b: int) -> dict[str, str]:
    """The prompt row of ``a+b``: ``{"prompt": "23+58=", "answer": "81"}``."""
    return {"prompt": f"{a}+{b}=", "answer": str(a + b)}


def sft_row(row: dict[str, str]) -> dict[str, str]:
    """The supervised row of a prompt row, in the ``{"prompt", "completion"}`` shape ``bigbatch prepare`` reads:
    the completion is the answer then :data:`~bigbatch.rewards.builtin.END`, the completion the builtin rewards
    score 1.0 on both counts."""
    return {"prompt": row["prompt"], "completion": row["answer"] + END}


def task_rows(n: int, seed: int = 0, split: str = "train") -> list[dict[str, str]]:
    """``n`` distinct prompt rows of ``split`` (``train`` or ``test``), drawn at random with ``seed``: the same
    rows for the same arguments, and the first ``n`` of a larger draw with the same seed."""
    pairs = split_pairs(split)
    if not 0 <= n <= len(pairs):
        raise ConfigError(f"the demo task's {split} split has {len(pairs)} distinct rows; ask for 0 to {len(pairs)}")
    # sorted by keys of random.random(), the one draw Python keeps the same across versions (random.sample and
    # shuffle may change), so the files are the same on every Python
    rng = random.Random(seed)
    keys = [rng.random() for _ in pairs]
    order = sorted(range(len(pairs)), key=keys.__getitem__)
    return [task_row(*pairs[i]) for i in order[:n]]


def write_task(
    directory: Path, seed: int = 0, n_sft: int = 4000, n_prompts: int = 2000, n_test: int = 500
) -> dict[str, Path]:
    """Write the demo task's files into ``directory`` (made if missing), each atomically, and return their paths
    by name:

    * ``sft``: ``sft.jsonl``, ``n_sft`` supervised rows ``{"prompt": "23+58=", "completion": "81\\n"}``;
    * ``prompts``: ``prompts.jsonl``, ``n_prompts`` GRPO prompt rows ``{"prompt": "23+58=", "answer": "81"}``;
    * ``test``: ``test.jsonl``, ``n_test`` prompt rows of the test split, to measure both.

    The SFT rows and the GRPO prompts are one draw of the train split cut in two, so they share no sum: what GRPO
    gains on its prompts is not recall of the supervised rows."""
    train = task_rows(n_sft + n_prompts, seed, "train")
    test = task_rows(n_test, seed, "test")
    directory.mkdir(parents=True, exist_ok=True)
    paths = {"sft": directory / SFT_FILE, "prompts": directory / PROMPTS_FILE, "test": directory / TEST_FILE}
    _write_jsonl(paths["sft"], [sft_row(row) for row in train[:n_sft]])
    _write_jsonl(paths["prompts"], train[n_sft:])
    _write_jsonl(paths["test"], test)
    log.info("demo task written to %s: %d SFT rows, %d prompts, %d test rows", directory, n_sft, n_prompts, n_test)
    return paths


def _write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    write_text_atomically(path, "".join(to_json(row) + "\n" for row in rows))
