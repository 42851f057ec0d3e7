"""Rollouts as training data: groups of sampled completions, their advantages, and the micro-batches of a step.

A *group* is one prompt's completions; a step trains on whole groups (``prompts_per_step`` of them). What a step
knows before its first backward, the same on every rank (every rank holds the whole step's groups):

* each completion's **advantage**, group-relative: ``A_i = r_i - mean_g(r)``, divided by the group's standard
  deviation (``std``: GRPO; unbiased, plus ``eps``) or not (``none``: Dr. GRPO), unless the rollout gave it;
* which groups are **flat** (every reward equal, so every advantage 0): ``keep`` trains on them (their KL and
  entropy terms still count, and their completions count in the denominators) or ``drop`` leaves them out of the
  step, whose denominators are then counted without them (``resample``: the sampler replaces them first, and
  drops those still flat);
* each group's completion tokens ``T_g`` (``group-token-mean`` divides by it).

**Dealing.** The step's completions, group by group, each a document of its prompt and completion (targets on
the completion's tokens alone), go into micro-batches of ``B`` rows x ``T`` positions: packed (first fit, positions
restarting at each document) or one per row. The micro-batches are numbered (*units*) independently of the number
of processes; rank ``r`` trains units ``r, r + W, ...``, so a group's completions land wherever they fall, across
micro-batches and ranks, and ranks hold uneven numbers of completions. Every rank runs ``K = ceil(units / W)``
micro-batches; a rank past the end runs one of padding (its terms hold no unit).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bigbatch.data.answer_groups import _place
from bigbatch.engine.batch import IGNORE_INDEX, ROLE_COMPLETION, Answers, MicroBatch, RolloutScores
from bigbatch.errors import ConfigError, DataError
from bigbatch.progress import plural
from bigbatch.settings.choices import ADVANTAGE_SCALE
from bigbatch.settings.choices import FLAT_GROUPS as FLAT_GROUPS_CHOICE

ADVANTAGE_SCALES = ADVANTAGE_SCALE.values
FLAT_GROUPS = FLAT_GROUPS_CHOICE.values
ADVANTAGE_EPS = 1e-6
"""Added to a group's standard deviation before dividing (a group of nearly equal rewards stays finite)."""


@dataclass
class Completion:
    """One sampled completion of a prompt: its tokens (the prompt's and its own), reward, and what the rollout
    knew of it (``advantage`` when given, ``old_logps`` one per completion token when given)."""

    prompt: list[int]
    tokens: list[int]
    reward: float
    advantage: float | None = None
    old_logps: list[float] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "tokens": self.tokens,
            "reward": self.reward,
            "advantage": self.advantage,
            "old_logps": self.old_logps,
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Completion:
        return Completion(
            list(d["prompt"]), list(d["tokens"]), float(d["reward"]), d.get("advantage"), d.get("old_logps")
        )


@dataclass
class Group:
    """One prompt's completions; ``key`` names it (the prompt row, or the rollout file's group id)."""

    key: str
    completions: list[Completion]

    @property
    def flat(self) -> bool:
        """Every reward equal: no completion is better than another (advantages all 0)."""
        rewards = [c.reward for c in self.completions]
        return len(set(rewards)) <= 1

    @property
    def flat_given(self) -> bool:
        """Flat as :func:`step_completions` judges it: by the advantages when every completion gives one (all 0),
        else by the rewards."""
        given = [c.advantage for c in self.completions]
        if all(a is not None for a in given):
            return all(a == 0 for a in given)
        return self.flat


def group_advantages(rewards: Sequence[float], scale: str) -> list[float]:
    """``r_i - mean`` over the group, divided by its unbiased standard deviation plus :data:`ADVANTAGE_EPS` with
    ``scale == "std"``; a group of one completion has advantage 0. Computed in float64."""
    if scale not in ADVANTAGE_SCALES:
        raise ConfigError(f"--advantage-scale must be one of {', '.join(ADVANTAGE_SCALES)}; got {scale!r}")
    values = np.asarray(rewards, dtype=np.float64)
    if len(values) < 2:
        return [0.0] * len(values)
    centred = values - values.mean()
    if scale == "std":
        centred = centred / (values.std(ddof=1) + ADVANTAGE_EPS)
    return [float(v) for v in centred]


@dataclass(frozen=True)
class StepFacts:
    """What the rollout knew of a step: its groups (sampled, flat, dropped)."""

    groups: int
    flat: int
    dropped: int
    generation_s: float = 0.0
    resampled: int = 0  # flat groups replaced by groups of other prompts (--flat-groups resample)
    # the rewards of every completion of the step's groups, those dropped as flat included (a reward curve of
    # the trained completions alone would leave out every all-right and all-wrong group)
    reward_sum: float = 0.0
    reward_sq: float = 0.0
    rewarded: int = 0  # completions with a reward (a rollouts file may give advantages instead)

    def as_dict(self) -> dict[str, float]:
        out = {"groups/flat_share": self.flat / self.groups if self.groups else 0.0}
        if self.rewarded:
            mean = self.reward_sum / self.rewarded
            out["reward/mean"] = mean
            out["reward/std"] = math.sqrt(max(self.reward_sq / self.rewarded - mean * mean, 0.0))
        if self.dropped:
            out["groups/dropped"] = float(self.dropped)
        if self.resampled:
            out["groups/resampled"] = float(self.resampled)
        if self.generation_s:
            out["time/generation_s"] = self.generation_s
        return out


@dataclass
class StepCompletions:
    """A step's completions as it trains on them: each with its group's index and its place in the group, its
    advantage and its group's completion tokens."""

    completions: list[Completion] = field(default_factory=list)
    group: list[int] = field(default_factory=list)
    member: list[int] = field(default_factory=list)
    advantage: list[float] = field(default_factory=list)
    group_tokens: list[int] = field(default_factory=list)


def step_completions(groups: Sequence[Group], scale: str, flat_groups: str) -> tuple[StepCompletions, StepFacts]:
    """The step's completions from its groups: flat groups kept (advantage 0) or dropped (``resample``: those left
    after resampling), advantages computed where the rollout gave none, each group's completion tokens counted
    (after any drop)."""
    if flat_groups not in FLAT_GROUPS:
        raise ConfigError(f"--flat-groups must be one of {', '.join(FLAT_GROUPS)}; got {flat_groups!r}")
    out = StepCompletions()
    flat = dropped = rewarded = 0
    reward_sum = reward_sq = 0.0
    for g, group in enumerate(groups):
        given = [c.advantage for c in group.completions]
        if any(a is None for a in given):  # rewards, not advantages: the step's reward statistics count them
            rewarded += len(group.completions)
            reward_sum += sum(c.reward for c in group.completions)
            reward_sq += sum(c.reward * c.reward for c in group.completions)
        is_flat = group.flat_given
        flat += int(is_flat)
        if is_flat and flat_groups in ("drop", "resample"):
            dropped += 1
            continue
        if any(a is None for a in given):
            advantages = group_advantages([c.reward for c in group.completions], scale)
        else:
            advantages = [float(a) for a in given]  # type: ignore[arg-type]
        tokens = sum(len(c.tokens) for c in group.completions)
        for m, (completion, advantage) in enumerate(zip(group.completions, advantages, strict=True)):
            out.completions.append(completion)
            out.group.append(g)
            out.member.append(m)
            out.advantage.append(advantage)
            out.group_tokens.append(tokens)
    return out, StepFacts(len(groups), flat, dropped, 0.0, 0, reward_sum, reward_sq, rewarded)


def deal(step: StepCompletions, micro_batch: int, seq_len: int, pack: bool) -> list[list[tuple[int, int, int]]]:
    """The step's units: for each, its completions as ``(completion index, row, column)``, in order (first fit
    when packed, a row each when not). Every completion must fit a row (:func:`check_fits`)."""
    units: list[list[tuple[int, int, int]]] = []
    fill = [0] * micro_batch
    current: list[tuple[int, int, int]] = []
    for i, completion in enumerate(step.completions):
        size = len(completion.prompt) + len(completion.tokens) - 1
        placed = _place(fill, [size], seq_len, pack)
        if placed is None:
            units.append(current)
            fill, current = [0] * micro_batch, []
            placed = _place(fill, [size], seq_len, pack)
            assert placed is not None, "a completion longer than a row"
        current.append((i, placed[0][0], placed[0][1]))
    if current:
        units.append(current)
    return units


def micro_batches_per_rank(units: int, world_size: int) -> int:
    """K: every rank runs as many micro-batches (at least one, of padding when the step has no unit)."""
    return max(1, -(-units // world_size))


def build_micro_batch(
    step: StepCompletions,
    placed: Sequence[tuple[int, int, int]],
    micro_batch: int,
    seq_len: int,
    pack: bool,
    pad_token: int,
    origin: tuple[int, int],
) -> MicroBatch:
    """One unit's micro-batch: each completion a document of its prompt and completion, its targets the
    completion's tokens, marked as an answer with its :class:`RolloutScores` (``origin``: the rollout's number and
    the unit's, what names the micro-batch)."""
    B, T = micro_batch, seq_len
    inputs = np.full((B, T), pad_token, dtype=np.int64)
    targets = np.full((B, T), IGNORE_INDEX, dtype=np.int64)
    segment = np.full((B, T), -1, dtype=np.int64)
    old = np.zeros((B, T), dtype=np.float32)
    # decided by the whole step (the same on every rank): a micro-batch of padding alone gets zeros, so that no
    # rank runs a scoring forward the others do not (DDP's buffer broadcasts and FSDP's gathers must pair up)
    has_old = bool(step.completions) and all(c.old_logps is not None for c in step.completions)
    positions = np.zeros((B, T), dtype=np.int64) if pack else None
    fill = np.zeros(B, dtype=np.int64)
    for answer, (i, r, c) in enumerate(placed):
        completion = step.completions[i]
        tokens = np.asarray(completion.prompt + completion.tokens, dtype=np.int64)
        n = len(tokens) - 1
        following = tokens[1:].copy()
        prompt_targets = len(completion.prompt) - 1  # the prompt's own next tokens are not trained
        following[:prompt_targets] = IGNORE_INDEX
        inputs[r, c : c + n] = tokens[:-1]
        targets[r, c : c + n] = following
        segment[r, c : c + n] = np.where(following != IGNORE_INDEX, answer, -1)
        if has_old:
            assert completion.old_logps is not None
            old[r, c + prompt_targets : c + n] = np.asarray(completion.old_logps, dtype=np.float32)
        if positions is not None:
            positions[r, c : c + n] = np.arange(n)
        fill[r] = c + n
    if positions is not None:
        for r in range(B):
            positions[r, fill[r] :] = np.arange(T - fill[r])
    index = [i for i, _, _ in placed]

    def column(values: list[Any], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([values[i] for i in index], dtype=dtype)

    scores = RolloutScores(
        column(step.advantage, torch.float32),
        torch.tensor([step.completions[i].reward for i in index], dtype=torch.float32),
        column(step.member, torch.int64),
        column(step.group_tokens, torch.float32),
        torch.from_numpy(old) if has_old else None,
    )
    answers = Answers(
        torch.from_numpy(segment),
        column(step.group, torch.int64),
        torch.full((len(index),), ROLE_COMPLETION, dtype=torch.int64),
        None,
        "rollout",
        rollout=scores,
    )
    return MicroBatch(
        torch.from_numpy(inputs),
        torch.from_numpy(targets),
        None if positions is None else torch.from_numpy(positions),
        padding=B * T - int(fill.sum()),
        origin=(origin,),
        epoch=origin[0],
        answers=answers,
    )


def check_fits(completion: Completion, seq_len: int, where: str) -> None:
    """A completion's document must fit a row of ``seq_len + 1`` tokens and hold a completion token."""
    if not completion.tokens:
        raise DataError(f"{where} has no completion token; a completion ends with at least its stop token")
    total = len(completion.prompt) + len(completion.tokens)
    if total > seq_len + 1:
        raise DataError(
            f"{where}: its prompt and completion are {total:,} tokens, more than seq_len+1={seq_len + 1}; train with "
            f"a larger --seq-len or shorten them"
        )
    if not completion.prompt:
        raise DataError(f"{where} has an empty prompt; a completion is scored after at least one prompt token")


# -- the offline learner's file -----------------------------------------------------------------------------------

ROLLOUT_FIELDS = "group, prompt or prompt_ids, completion or completion_ids, reward or advantage"


def read_rollout_file(path: Path, encode: Any, decode: Any, vocab_size: int, seq_len: int) -> list[Group]:
    """The groups of a JSONL file of completions generated elsewhere, one completion per line: ``group`` (any id:
    a group's lines need not be adjacent; groups keep the order of their first line), the prompt (``prompt_ids``
    or ``prompt`` text), the completion (``completion_ids`` or ``completion`` text; given both, the ids must be the
    text's tokens), ``reward`` or ``advantage`` (every line of a group gives the same one), and optionally
    ``logps``: the generating policy's log-probability of each completion token (then every line has them), the
    ratio's denominator instead of the trainer's own forward. Anything else wrong is one line naming the line."""
    if not path.is_file():
        raise DataError(f"--rollouts {path}: no such file; give a JSONL file of completions ({ROLLOUT_FIELDS})")
    groups: dict[str, Group] = {}
    kinds: dict[str, str] = {}
    with_logps: bool | None = None
    for _, where, row in jsonl_rows(path, "completion"):
        if not isinstance(row, dict):
            raise DataError(f"{where} is not a JSON object; each line is one completion ({ROLLOUT_FIELDS})")
        completion, kind = _completion_of(row, where, encode, decode, vocab_size)
        check_fits(completion, seq_len, where)
        if "group" not in row:
            raise DataError(f"{where} has no 'group'; every completion names its prompt's group")
        key = str(row["group"])
        if kinds.setdefault(key, kind) != kind:
            raise DataError(f"{where}: group {key} mixes rewards and advantages; give one kind for a group")
        has = completion.old_logps is not None
        if with_logps is None:
            with_logps = has
        elif with_logps != has:
            raise DataError(f"{where}: 'logps' given on some lines only; give them on every line or none")
        group = groups.setdefault(key, Group(key, []))
        if group.completions and group.completions[0].prompt != completion.prompt:
            raise DataError(f"{where}: group {key} has another prompt than its first line; one group, one prompt")
        group.completions.append(completion)
    if not groups:
        raise DataError(f"--rollouts {path} holds no completion; give one JSON object per line ({ROLLOUT_FIELDS})")
    return list(groups.values())


def _completion_of(
    row: dict[str, Any], where: str, encode: Any, decode: Any, vocab_size: int
) -> tuple[Completion, str]:
    prompt = _token_ids(row, "prompt", where, encode, decode, vocab_size)
    tokens = _token_ids(row, "completion", where, encode, decode, vocab_size)
    if "reward" in row and "advantage" in row:
        raise DataError(f"{where} gives both 'reward' and 'advantage'; give one")
    kind = "reward" if "reward" in row else "advantage"
    if kind not in row:
        raise DataError(f"{where} has neither 'reward' nor 'advantage'")
    value = row[kind]
    if not _finite_number(value):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise DataError(f"{where}: '{kind}' is {shown}, not a finite number")
    logps = row.get("logps")
    if logps is not None:
        if not isinstance(logps, list) or len(logps) != len(tokens):
            got = len(logps) if isinstance(logps, list) else type(logps).__name__
            raise DataError(
                f"{where}: 'logps' must be a list of one log-probability per completion token "
                f"({len(tokens)}), got {got}"
            )
        if not all(_finite_number(v) and float(v) <= 0 for v in logps):
            raise DataError(f"{where}: 'logps' holds a value that is not a finite log-probability (<= 0)")
        logps = [float(v) for v in logps]
    reward = float(value) if kind == "reward" else 0.0
    advantage = float(value) if kind == "advantage" else None
    return Completion(prompt, tokens, reward, advantage, logps), kind


def jsonl_rows(path: Path, what: str) -> Iterator[tuple[int, str, Any]]:
    """Each non-blank line of a JSONL file as ``(number, where, value)``, ``where`` naming its line; a line that is not
    UTF-8 text (a byte order mark is allowed), not JSON, or holds a lone surrogate is one line naming it."""
    for number, raw in enumerate(path.read_bytes().splitlines(), start=1):
        where = f"line {number} of {path}"
        try:
            line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(f"{where} is not UTF-8 text (byte {exc.start + 1}); save the file as UTF-8") from exc
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where} is not JSON ({exc.msg}); each line is one {what}") from exc
        if _holds_surrogate(value):  # a \ud800 escape: half of a character, which no text holds
            raise DataError(f"{where} holds a lone surrogate escape (a broken \\uXXXX); fix the text")
        yield number, where, value


def _holds_surrogate(value: Any) -> bool:
    """Whether a JSON value holds a string that is not encodable as UTF-8 (a lone surrogate)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_holds_surrogate(k) or _holds_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_holds_surrogate(v) for v in value)
    return False


def _finite_number(value: Any) -> bool:
    """A JSON number (not a boolean) that is finite as a float (an integer too large for one is not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _token_ids(row: dict[str, Any], name: str, where: str, encode: Any, decode: Any, vocab_size: int) -> list[int]:
    """``{name}_ids`` (checked against ``{name}`` text when both are given) or ``{name}`` text encoded."""
    ids, text = row.get(f"{name}_ids"), row.get(name)
    if ids is None and text is None:
        raise DataError(f"{where} has neither '{name}_ids' nor '{name}'")
    if text is not None and not isinstance(text, str):
        raise DataError(f"{where}: '{name}' is not text")
    if ids is None:
        assert isinstance(text, str)
        return list(encode(text))
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise DataError(f"{where}: '{name}_ids' is not a list of token ids")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise DataError(f"{where}: '{name}_ids' holds token {bad[0]}, outside the model's vocabulary of {vocab_size:,}")
    if text is not None and decode(ids) != text:
        raise DataError(
            f"{where}: '{name}_ids' are not the tokens of '{name}' under this run's tokenizer; give one of them, or "
            "the ids of this tokenizer"
        )
    return list(ids)


def describe_groups(groups: Sequence[Group]) -> str:
    completions = sum(len(g.completions) for g in groups)
    return f"{plural(len(groups), 'group')}, {plural(completions, 'completion')}"
