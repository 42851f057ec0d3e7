"""The scalar curves of a run, derived from the records of ``metrics.jsonl``: what TensorBoard and W&B plot.

One mapping, used for the live run and to rebuild or check a logger's history on resume, so that the curves
always say what ``metrics.jsonl`` says:

* a step record (``kind: step``) gives ``train/<field>`` at the optimizer step for every numeric field it
  holds (loss, grad_norm, lr, tokens, micro_batches (K), dt, tokens_per_s, mfu, the noise-scale fields, and
  any field added later), ``train/tokens_seen`` (valid target tokens trained on so far) and ``by_tokens/loss``
  with tokens seen as the x-axis;
* a skipped step (non-finite gradient, no update) keeps the step count, so its values would put a second
  point at the same step on every curve: it gives only ``train/skipped_steps`` (skips so far);
* an eval record gives ``val/loss`` at the step and ``by_tokens/val_loss`` at tokens seen.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict
from typing import Any, NamedTuple

from bigbatch.engine.accumulate import StepRecord

BY_TOKENS = "by_tokens/"
"""Tag prefix of the curves whose x-axis is tokens seen rather than the optimizer step."""


class Point(NamedTuple):
    tag: str
    step: int  # the optimizer step, or tokens seen for a ``by_tokens/`` tag
    value: float


def step_values(record: StepRecord, mfu: float | None = None) -> dict[str, Any]:
    """The fields of a step record in ``metrics.jsonl`` (without ``kind``): the record, ``tokens_per_s``, the
    MFU when known and the step hooks' measurements (the noise scale's fields) flattened on the steps that
    made them."""
    values = asdict(record)
    del values["measurements"]  # flattened below
    del values["bad"]  # a bad step has a record of its own (kind: bad_step); the step says what was done
    if record.bad is not None:
        values["bad_step"] = record.bad.action
    for share in ("padding_share", "prompt_share", "muon_lr"):  # documents only; Muon only
        if values[share] is None:
            del values[share]
    values["tokens_per_s"] = record.tokens_per_s
    if mfu is not None:
        values["mfu"] = mfu
    for measurement in record.measurements.values():
        values.update(measurement.as_dict())
    return values


def eval_values(
    step: int, val_loss: float, val_tokens: int | None = None, values: Mapping[str, float] | None = None
) -> dict[str, Any]:
    """The fields of an eval record in ``metrics.jsonl`` (without ``kind``): the tokens scored when known, and an
    objective's own validation values (``val_rewards/accuracy``, ``val_term/dpo``) when it has them."""
    extra = {f"val_{name}": value for name, value in (values or {}).items()}
    return {"step": step, "val_loss": val_loss, **({} if val_tokens is None else {"val_tokens": val_tokens}), **extra}


class ScalarSeries:
    """Turns records (dicts as in ``metrics.jsonl``, with ``kind``) into :class:`Point` s, keeping the running
    totals (tokens seen, skipped steps) that some curves need; ``history`` primes them on resume."""

    def __init__(self, history: Iterable[dict[str, Any]] = ()) -> None:
        self.tokens_seen = 0
        self.skipped = 0
        self.history: list[Point] = [point for record in history for point in self.points(record)]

    def points(self, record: dict[str, Any]) -> list[Point]:
        kind, step = record.get("kind"), int(record.get("step", 0))
        if kind == "eval":
            loss = float(record["val_loss"])
            points = [Point("val/loss", step, loss), Point(BY_TOKENS + "val_loss", self.tokens_seen, loss)]
            if "val_tokens" in record:  # how many tokens that loss is the mean of
                points.append(Point("val/tokens", step, float(record["val_tokens"])))
            return points
        if kind != "step":
            return []
        if record.get("skipped"):
            self.skipped += 1
            return [Point("train/skipped_steps", step, float(self.skipped))]
        points = [
            Point(f"train/{key}", step, float(value))
            for key, value in record.items()
            if key not in ("kind", "step", "skipped") and isinstance(value, int | float) and not isinstance(value, bool)
        ]
        self.tokens_seen += int(record.get("tokens", 0))
        points.append(Point("train/tokens_seen", step, float(self.tokens_seen)))
        if "loss" in record:
            points.append(Point(BY_TOKENS + "loss", self.tokens_seen, float(record["loss"])))
        return points
