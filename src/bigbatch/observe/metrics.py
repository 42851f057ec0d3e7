"""Step records: the console line, a JSONL file, and optional TensorBoard / Weights & Biases loggers."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

from bigbatch.engine.accumulate import StepRecord
from bigbatch.errors import require_package
from bigbatch.files.atomic import write_text_atomically
from bigbatch.files.json_text import from_json, to_json
from bigbatch.observe.scalars import eval_values, step_values
from bigbatch.observe.tensorboard_log import TensorBoardLog
from bigbatch.observe.wandb_log import WandbLog

METRICS_FILE = "metrics.jsonl"

PEAK_FLOPS = {"A100": 312e12, "H100": 989e12, "H200": 989e12}
"""Dense bf16 peak FLOP/s per device (tensor cores, no sparsity), matched against the CUDA device name."""


def device_peak_flops(device_name: str) -> float | None:
    """The table's peak for a device name such as ``NVIDIA H200``; ``None`` when unknown (CPUs included)."""
    for key, flops in PEAK_FLOPS.items():
        if key in device_name.upper():
            return flops
    return None


def mfu(flops_per_token: float, tokens_per_s: float, peak_flops_per_device: float, world_size: int = 1) -> float:
    """Model FLOPs utilization: achieved training FLOP/s over the peak of all devices."""
    return flops_per_token * tokens_per_s / (peak_flops_per_device * world_size)


@dataclass(frozen=True)
class Throughput:
    """Valid target tokens over the seconds of a range of optimizer steps: a ratio of totals. (A mean of the
    steps' own rates is not tokens over time: it overstates the throughput whenever step times differ.)"""

    tokens: int
    seconds: float  # the steps' own times (``dt``): evaluation, checkpoints and logging between steps excluded
    first_step: int
    last_step: int
    warm_up: bool = False  # the range is one step that includes warm-up (there was no later step to time)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def steps(self) -> str:
        """``steps 2..120``, ``step 2``, or ``step 1 alone, warm-up included``."""
        if self.warm_up:
            return f"step {self.first_step} alone, warm-up included"
        if self.first_step == self.last_step:
            return f"step {self.first_step}"
        return f"steps {self.first_step}..{self.last_step}"

    def basis(self) -> str:
        """What the number is: ``tokens / time of steps 2..120``, or ``step 1 alone, warm-up included``."""
        return self.steps() if self.warm_up else f"tokens / time of {self.steps()}"

    def describe(self) -> str:
        """``tok/s 4,331 (tokens / time of steps 2..120)``."""
        return f"tok/s {self.tokens_per_s:,.0f} ({self.basis()})"


def format_step(
    record: StepRecord, show_k: bool = False, mfu_value: float | None = None, noise_scale: float | None = None
) -> str:
    """``step 12 | loss 2.413 | norm 0.84 | lr 6.0e-04 | dt 812 ms | tok/s 20,171``

    ``tok/s`` counts valid target tokens. With ``show_k`` (K varies from step to
    step) the line also gives K and the step's valid tokens. ``noise_scale`` (the smoothed gradient noise
    scale, in tokens) is shown when given: ``noise scale 9,061 tok``, or :data:`NO_NOISE_SCALE` while it is not
    positive.
    """
    line = (
        f"step {record.step} | loss {record.loss:.4f} | norm {record.grad_norm:.2f} | lr {record.lr:.1e} | "
        f"dt {record.dt * 1000:.0f} ms | tok/s {record.tokens_per_s:,.0f}"
    )
    if record.muon_lr is not None and record.muon_lr != record.lr:  # the Muon group's own rate (lr is AdamW's)
        line += f" | muon lr {record.muon_lr:.1e}"
    if mfu_value is not None:
        line += f" | mfu {mfu_value:.1%}"
    if show_k:
        line += f" | K {record.micro_batches} | tokens {record.tokens:,}"
    router = record.measurements.get("router")
    if router is not None:  # a mixture of experts: what its router adds, and the busiest expert against the mean
        line += f" | router {router.router_loss:.4f} | load max/mean {max(router.load_max_over_mean):.2f}"
    objective = record.measurements.get("objective")
    if objective is not None:  # a preference objective: its reward margin and accuracy over the step
        values = objective.values
        if "reward/mean" in values:  # learning from rewards: the step's rewards, clipped share and KL
            line += f" | reward {values['reward/mean']:.3f} ± {values.get('reward/std', 0.0):.3f}"
            line += f" | clipped {values.get('clipped', 0.0):.1%}"
            if "kl" in values:
                line += f" | kl {values['kl']:.4f}"
        elif "rewards/accuracy" in values:
            line += f" | margin {values['rewards/margin']:.3f} | acc {values['rewards/accuracy']:.2f}"
        elif "kl" in values:
            line += f" | kl {values['kl']:.3f}"
    if noise_scale is not None:
        line += f" | noise scale {format_noise_scale(noise_scale)} tok" if noise_scale > 0 else f" | {NO_NOISE_SCALE}"
    if record.skipped:
        line += " | SKIPPED (bad step)" if record.bad is not None else " | SKIPPED (non-finite gradient)"
    return line


NO_NOISE_SCALE = "no noise-scale estimate yet"
"""What the step line says when the smoothed estimate is not positive (or NaN): its |G|^2 or tr(Sigma) is still
below the measurement's resolution."""


def format_noise_scale(tokens: float) -> str:
    """``12,345`` (tokens) for a positive estimate; callers word a non-positive or NaN one themselves (see
    :data:`NO_NOISE_SCALE`)."""
    return f"{tokens:,.0f}"


class JsonlLog:
    """Appends one JSON object per line; flushed after each so a crash loses at most the current record."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._handle: IO[str] = self.path.open("a", encoding="utf-8")

    def write(self, kind: str, **values: Any) -> None:
        """One record, as standard JSON (a NaN loss is ``null`` and named in ``nonfinite``: see
        :mod:`bigbatch.files.json_text`)."""
        self._handle.write(to_json({"kind": kind, **values}) + "\n")
        self._handle.flush()

    def write_step(self, record: StepRecord, mfu: float | None = None) -> None:
        self.write("step", **step_values(record, mfu))

    def write_eval(
        self, step: int, val_loss: float, val_tokens: int | None = None, values: Mapping[str, float] | None = None
    ) -> None:
        self.write("eval", **eval_values(step, val_loss, val_tokens, values))

    def write_documents(self, step: int, **shares: Any) -> None:
        """A documents run's positions as its epoch lays them out (``kind: documents``), at the step a session
        starts from; the step records hold each step's own shares."""
        self.write("documents", step=step, **shares)

    def write_restart(self, step: int, **details: Any) -> None:
        """A restart by torchrun's elastic agent (``kind: restart``): the step the new group resumed from."""
        self.write("restart", step=step, **details)

    def write_batch_change(self, step: int, **details: Any) -> None:
        """A change of the tokens per step and the optimizer's settings before and after (``kind: batch_change``)."""
        self.write("batch_change", step=step, **details)

    def write_event(self, kind: str, step: int, **details: Any) -> None:
        """A decision of the run (``kind: bad_step``, ``kind: rewind``): kept through any resume's truncation."""
        self.write(kind, step=step, **details)

    def close(self) -> None:
        self._handle.close()


# --------------------------------------------------------------------------------------------
# Optional loggers: TensorBoard and Weights & Biases, behind the same three methods
# --------------------------------------------------------------------------------------------


class MetricsSink(Protocol):
    """Where step and eval records go: ``write_step``, ``write_eval``, ``close``."""

    def write_step(self, record: StepRecord, mfu: float | None = None) -> None: ...

    def write_eval(
        self, step: int, val_loss: float, val_tokens: int | None = None, values: Mapping[str, float] | None = None
    ) -> None: ...

    def close(self) -> None: ...


class MetricsFanout:
    """Sends every record to each sink; :meth:`close` closes them all, then re-raises the first failure."""

    def __init__(self, sinks: list[MetricsSink]) -> None:
        self.sinks = sinks

    def write_step(self, record: StepRecord, mfu: float | None = None) -> None:
        for sink in self.sinks:
            sink.write_step(record, mfu)

    def write_eval(
        self, step: int, val_loss: float, val_tokens: int | None = None, values: Mapping[str, float] | None = None
    ) -> None:
        for sink in self.sinks:
            sink.write_eval(step, val_loss, val_tokens, values)

    def write_documents(self, step: int, **shares: Any) -> None:
        """To ``metrics.jsonl`` only: the loggers plot the per-step shares of the step records."""
        for sink in self.sinks:
            if isinstance(sink, JsonlLog):
                sink.write_documents(step, **shares)

    def write_restart(self, step: int, **details: Any) -> None:
        """To ``metrics.jsonl`` only, like :meth:`write_documents`."""
        for sink in self.sinks:
            if isinstance(sink, JsonlLog):
                sink.write_restart(step, **details)

    def write_batch_change(self, step: int, **details: Any) -> None:
        """To ``metrics.jsonl`` only, like :meth:`write_documents`."""
        for sink in self.sinks:
            if isinstance(sink, JsonlLog):
                sink.write_batch_change(step, **details)

    def write_event(self, kind: str, step: int, **details: Any) -> None:
        """To ``metrics.jsonl`` only, like :meth:`write_documents`."""
        for sink in self.sinks:
            if isinstance(sink, JsonlLog):
                sink.write_event(kind, step, **details)

    def reopen_jsonl(self) -> None:
        """Append to ``metrics.jsonl`` as it is now on disk (after a resume rewrote it)."""
        for index, sink in enumerate(self.sinks):
            if isinstance(sink, JsonlLog):
                sink.close()
                self.sinks[index] = JsonlLog(sink.path)

    def close(self) -> None:
        error: BaseException | None = None
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:  # close the rest; report the first
                error = error or exc
        if error is not None:
            raise error


def check_optional_loggers(tensorboard: bool, wandb_project: str) -> None:
    """Fail early, before any training, when an enabled logger's package is missing."""
    if tensorboard:
        require_package("torch.utils.tensorboard", "run.tensorboard (--tensorboard)", "tensorboard")
    if wandb_project:
        require_package("wandb", f"run.wandb (--wandb {wandb_project})", "wandb")


def open_metrics(
    run_dir: Path | str, tensorboard: bool = False, wandb_project: str = "", config: dict[str, Any] | None = None
) -> MetricsFanout:
    """``RUN_DIR/metrics.jsonl`` always; TensorBoard and W&B when enabled (off by default: nothing else happens)."""

    run_dir = Path(run_dir)
    history = read_records(run_dir) if tensorboard or wandb_project else []  # the earlier sessions' records
    sinks: list[MetricsSink] = [JsonlLog(run_dir / METRICS_FILE)]
    try:
        if tensorboard:
            sinks.append(TensorBoardLog(run_dir / "tensorboard", history))
        if wandb_project:
            sinks.append(WandbLog(wandb_project, run_dir, config, history))
    except BaseException:
        MetricsFanout(sinks).close()
        raise
    return MetricsFanout(sinks)


def read_records(run_dir: Path | str) -> list[dict[str, Any]]:
    """The records of ``RUN_DIR/metrics.jsonl`` (one JSON object a line), in file order, their non-finite numbers
    back in place (older files' bare ``NaN`` too); a line that is not one (cut by a crash) is left out, and a run
    without the file has none. The one reader of the log: the loggers' history here,
    :func:`bigbatch.observe.runs.read_metrics` (a run's steps and evaluations) for the rest."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = from_json(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


DECISIONS = ("bad_step", "rewind")
"""Record kinds a resume never drops from ``metrics.jsonl``: what the run decided, and when."""


def truncate_metrics(run_dir: Path, step: int) -> None:
    """Drop records after ``step`` (written before a crash, about to be replayed) from the metrics log."""
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return
    kept = []
    lines = path.read_text().splitlines()
    for line in lines:
        try:
            record = from_json(line)
        except json.JSONDecodeError:
            continue  # a line cut by the crash
        recorded = int(record.get("step", 0))
        # A skipped step keeps the step count, so one recorded at ``step`` came after the checkpoint; the run's
        # decisions stay whatever their step.
        if record.get("kind") in DECISIONS or recorded < step or (recorded == step and not record.get("skipped")):
            kept.append(line)
    if len(kept) == len(lines):
        return  # nothing to drop: the file stays untouched
    write_text_atomically(path, "".join(line + "\n" for line in kept))
