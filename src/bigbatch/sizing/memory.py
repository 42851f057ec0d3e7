"""Memory of a training micro-step: estimated from the shapes, and measured.

Measured peaks come from the device's own accounting:

* CUDA: ``torch.cuda.max_memory_allocated`` around each phase, in this process.
* CPU: each micro-batch size runs in a fresh Python process (``python -m
  bigbatch.sizing.memory``). Large allocations are forced onto ``mmap``
  (``MALLOC_MMAP_THRESHOLD_``) so that freed tensors leave the resident set at
  once; the kernel's high-water mark (``VmHWM``) is reset before each phase
  through ``/proc/self/clear_refs`` and read after it, and the peak is reported
  relative to the resident size before the phase. The Python and PyTorch
  runtime itself is measured once (before the model exists) and excluded.
"""

from __future__ import annotations

import gc
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO

import torch

from bigbatch.engine.accumulate import AccumulationEngine
from bigbatch.engine.batch import MicroBatch
from bigbatch.engine.muon import MuonSettings, build_muon
from bigbatch.engine.muon_matrices import muon_matrices
from bigbatch.engine.newton_schulz import newton_schulz_flops
from bigbatch.engine.optim import build_adamw, constant_schedule
from bigbatch.engine.rng import preserved_rng
from bigbatch.errors import BigBatchError, ConfigError
from bigbatch.files.json_text import from_json, to_json
from bigbatch.models.decoder import DecoderLM
from bigbatch.models.family import ModelShape
from bigbatch.models.head_loss import largest_chunk
from bigbatch.models.registry import build_model, family_for_model_name, family_of, model_config_from_dict, model_preset
from bigbatch.progress import ProgressBar

MiB = 2**20


@dataclass(frozen=True)
class MemoryEstimate:
    params: int  # bytes
    grads: int
    optimizer: int  # AdamW: two fp32 moments per parameter; Muon: one momentum per hidden-matrix parameter
    activations: int  # one micro-batch, kept for backward
    orthogonalise_flops: int = 0  # Muon: Newton-Schulz per optimizer step (all matrices, all ranks together)

    @property
    def fixed(self) -> int:
        return self.params + self.grads + self.optimizer


def estimate_memory(
    config: ModelShape,
    micro_batch: int,
    seq_len: int,
    precision: str = "fp32",
    chunked_loss: bool = True,
    optimizer: str = "adamw",
    ns_steps: int = 5,
) -> MemoryEstimate:
    """Shapes-only estimate: fp32 parameters, gradients and the optimizer's state (AdamW: two moments per
    parameter; ``muon``: one momentum per hidden-matrix parameter, AdamW's two for the rest, and Newton-Schulz's
    FLOPs per step); activations of one micro-batch, the layers' (the family's ``layer_bytes_per_token``) plus the
    head and loss (:func:`head_loss_bytes`). Not for a family without a per-layer count (``hf:DIR``: a
    :class:`ConfigError`): its layers are only measured."""
    family = family_of(config)
    if family.layer_bytes_per_token is None:
        raise ConfigError(family.no_estimate_reason)
    with torch.device("meta"):
        model = build_model(config)
        n = model.num_params(non_embedding=False)
        matrices = muon_matrices(model) if optimizer == "muon" else []
    n_muon = sum(p.numel() for _, p, _ in matrices)
    act_bytes = 2 if precision in ("bf16", "fp16") else 4
    per_token = family.layer_bytes_per_token(config, act_bytes)
    tokens = micro_batch * seq_len
    head = head_loss_bytes(config, tokens, chunked_loss)
    return MemoryEstimate(
        params=4 * n,
        grads=4 * n,
        optimizer=8 * (n - n_muon) + 4 * n_muon,
        activations=config.n_layer * per_token * tokens + head,
        orthogonalise_flops=sum(  # a fused weight's parts each on their own
            newton_schulz_flops((*p.shape[:-2], layout.parts, *layout.matrix_shape(p.shape)), ns_steps)
            for _, p, layout in matrices
        ),
    )


def estimate_unavailable(config: ModelShape) -> str:
    """Why ``config``'s family has no analytic estimate, or ``""`` when it has one."""
    family = family_of(config)
    return family.no_estimate_reason if family.layer_bytes_per_token is None else ""


def head_loss_bytes(config: ModelShape, tokens: int, chunked_loss: bool = True) -> int:
    """What the head and the loss hold at the forward's end for ``tokens`` positions. Whole logits: the fp32
    logits and the log-softmax saved for backward. Chunked (:mod:`bigbatch.models.head_loss`): the rows' gradient
    (fp32, ``C`` per token), the head's gradient (``V x C``, once) and a chunk of logits in flight."""
    vocab = config.vocab_size
    if not chunked_loss:
        return 2 * tokens * config.padded_vocab_size * 4
    return tokens * config.n_embd * 4 + vocab * config.n_embd * 4 + largest_chunk(tokens, vocab) * vocab * 4


@dataclass(frozen=True)
class MicroStepMeasurement:
    """Peaks in bytes above the state before each phase; times in seconds."""

    micro_batch: int
    fixed: int  # parameters + optimizer state, counted from the tensors (gradients are part of each phase's peak)
    forward_peak: int  # activations kept for backward, and transients
    backward_peak: int  # forward + backward, gradients included
    optimizer_peak: int
    step_peak_k2: int  # a whole step of K = 2, from zeroed gradients
    step_peak_k: int  # a whole step of K micro-batches
    k: int
    micro_step_seconds: float
    optimizer_seconds: float


def _rss_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


class _CpuPeak:
    """Peak resident memory of a phase, relative to the resident size at its start."""

    def __enter__(self) -> _CpuPeak:
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current VmRSS
        self.start = _rss_bytes("VmRSS")
        return self

    def __exit__(self, *exc: object) -> None:
        self.peak = _rss_bytes("VmHWM") - self.start


class _CudaPeak:
    def __enter__(self) -> _CudaPeak:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.start = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.synchronize()
        self.peak = torch.cuda.max_memory_allocated() - self.start


def _model_and_optimizer(
    config: ModelShape, device: torch.device, activation_checkpointing: bool, chunked_loss: bool, optimizer_name: str
) -> tuple[DecoderLM, torch.optim.Optimizer, int]:
    """The model on ``device`` and its optimizer (AdamW, or Muon with AdamW) with its state already created (so
    the measured phases do not create it), and the bytes both hold before every step (gradients appear during
    backward)."""
    model = build_model(config).to(device)
    model.activation_checkpointing = activation_checkpointing
    model.chunked_loss = chunked_loss
    optimizer: torch.optim.Optimizer
    if optimizer_name == "muon":
        optimizer = build_muon(model, MuonSettings(lr=1e-4), lr=1e-4)
    else:
        optimizer = build_adamw(model, lr=1e-4)
    for p in model.parameters():  # create AdamW's moments now, so the phases below do not
        p.grad = torch.zeros_like(p)
    optimizer.step()
    model.zero_grad(set_to_none=True)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    state_bytes = sum(
        t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)
    )
    return model, optimizer, param_bytes + state_bytes


def _timed(fn: object, device: torch.device, repeats: int = 3) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` (synchronized on CUDA)."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        fn()  # type: ignore[operator]
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


@preserved_rng()
def measure_in_process(
    config: ModelShape,
    micro_batch: int,
    seq_len: int,
    k: int,
    device: torch.device,
    precision: str = "fp32",
    activation_checkpointing: bool = False,
    chunked_loss: bool = True,
    optimizer: str = "adamw",
) -> MicroStepMeasurement:
    """Measure one configuration in this process (on CPU, call it in a fresh process: see :func:`measure`).

    It seeds and draws (model, tokens), so it runs under :func:`~bigbatch.engine.rng.preserved_rng`: the caller's
    generators (e.g. a trainer's, for ``--micro-batch auto`` on CUDA) are left exactly as they were."""
    peak_meter = _CudaPeak if device.type == "cuda" else _CpuPeak
    torch.manual_seed(0)
    model, opt, fixed = _model_and_optimizer(config, device, activation_checkpointing, chunked_loss, optimizer)
    engine = AccumulationEngine(model, opt, constant_schedule(1e-4), device=device, precision=precision)
    tokens = torch.randint(0, config.vocab_size, (max(k, 2), micro_batch, seq_len + 1))
    batches = [MicroBatch(t[:, :-1], t[:, 1:]).to(device) for t in tokens]
    n_valid = micro_batch * seq_len

    def micro_step() -> torch.Tensor:
        with engine.autocast():
            loss = engine.loss_fn(model, batches[0])
        return loss / n_valid

    engine.step(batches[:1])  # warm-up (allocator, kernels)
    model.zero_grad(set_to_none=True)
    with peak_meter() as forward:
        loss = micro_step()
    with peak_meter() as backward:
        loss.backward()
    backward_peak = forward.peak + backward.peak
    del loss
    with peak_meter() as opt_phase:
        opt.step()
    model.zero_grad(set_to_none=True)
    with peak_meter() as step2:
        engine.step(batches[:2])
    model.zero_grad(set_to_none=True)
    with peak_meter() as stepk:
        engine.step(batches[:k])
    model.zero_grad(set_to_none=True)
    micro_seconds = _timed(lambda: micro_step().backward(), device)
    opt_seconds = _timed(opt.step, device)
    return MicroStepMeasurement(
        micro_batch=micro_batch,
        fixed=fixed,
        forward_peak=forward.peak,
        backward_peak=backward_peak,
        optimizer_peak=opt_phase.peak,
        step_peak_k2=step2.peak,
        step_peak_k=stepk.peak,
        k=k,
        micro_step_seconds=micro_seconds,
        optimizer_seconds=opt_seconds,
    )


def measure(
    config: ModelShape,
    micro_batch: int,
    seq_len: int,
    k: int = 4,
    device: torch.device | str = "cpu",
    precision: str = "fp32",
    activation_checkpointing: bool = False,
    chunked_loss: bool = True,
    optimizer: str = "adamw",
) -> MicroStepMeasurement:
    """Measure one micro-batch size: in this process on CUDA, in a fresh process on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return measure_in_process(
            config, micro_batch, seq_len, k, device, precision, activation_checkpointing, chunked_loss, optimizer
        )
    request = {
        "family": family_of(config).name,
        "config": config.to_dict(),
        "micro_batch": micro_batch,
        "seq_len": seq_len,
        "k": k,
        "precision": precision,
        "activation_checkpointing": activation_checkpointing,
        "chunked_loss": chunked_loss,
        "optimizer": optimizer,
    }
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    done = subprocess.run(
        [sys.executable, "-m", "bigbatch.sizing.memory", to_json(request)], env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"memory probe failed for micro_batch {micro_batch}: {done.stderr.strip()[-500:]}")
    return MicroStepMeasurement(**from_json(done.stdout.strip().splitlines()[-1]))


def linear_fit(xs: list[int], ys: list[int]) -> tuple[float, float, float]:
    """Least-squares ``y = a x + b`` and the largest relative deviation of a point from the line."""
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    var = sum((x - mean_x) ** 2 for x in xs)
    a = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=False)) / var if var else 0.0
    b = mean_y - a * mean_x
    worst = max(abs(y - (a * x + b)) / max(abs(y), 1) for x, y in zip(xs, ys, strict=False))
    return a, b, worst


def _probe_main() -> None:
    request = from_json(sys.argv[1])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    result = measure_in_process(
        model_config_from_dict(request["family"], request["config"]),
        request["micro_batch"],
        request["seq_len"],
        request["k"],
        torch.device("cpu"),
        request["precision"],
        request["activation_checkpointing"],
        request["chunked_loss"],
        request.get("optimizer", "adamw"),
    )
    sys.stdout.write(to_json(asdict(result)) + "\n")  # the parent reads this line


if __name__ == "__main__":
    _probe_main()


def memory_report(rows: list[MicroStepMeasurement], estimate_activations: dict[int, int]) -> str:
    """The table of ``bigbatch memory``, with the linearity and K-flatness checks (an estimate left out of
    ``estimate_activations`` reads n/a)."""
    lines = [
        f"{'micro-batch':>11} {'fixed MiB':>10} {'activations':>12} {'estimate':>9} {'fwd+bwd':>9} {'optimizer':>9} "
        f"{'step K=2':>9} {f'step K={rows[0].k}':>9} {'micro-step':>10}",
    ]
    for r in rows:
        lines.append(
            f"{r.micro_batch:>11} {r.fixed / MiB:>10.1f} {r.forward_peak / MiB:>12.1f} "
            f"{_mib_or_na(estimate_activations.get(r.micro_batch)):>9} {r.backward_peak / MiB:>9.1f} "
            f"{r.optimizer_peak / MiB:>9.1f} {r.step_peak_k2 / MiB:>9.1f} {r.step_peak_k / MiB:>9.1f} "
            f"{r.micro_step_seconds * 1000:>8.0f}ms"
        )
    if len(rows) >= 2:
        slope, intercept, worst = linear_fit([r.micro_batch for r in rows], [r.forward_peak for r in rows])
        lines.append(
            f"activations grow linearly with the micro-batch: {slope / MiB:.2f} MiB per sequence "
            f"(+{intercept / MiB:.1f} MiB), largest deviation from the line {worst:.1%}"
        )
    growth = max(abs(r.step_peak_k - r.step_peak_k2) / max(r.step_peak_k2, 1) for r in rows)
    lines.append(
        f"peak of a whole step at K={rows[0].k} vs K=2, same micro-batch: largest difference {growth:.1%} "
        "(gradients are held across micro-steps; activations are freed after each)"
    )
    return "\n".join(lines)


def _mib_or_na(n: int | None) -> str:
    return "n/a" if n is None else f"{n / MiB:.1f}"


def plot_memory(rows: list[MicroStepMeasurement], path: Path, title: str) -> Path:
    """PNG: fixed part, activations and whole-step peak against the micro-batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r.micro_batch for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    ax.plot(xs, [r.fixed / MiB for r in rows], "s--", label="fixed: params + optimizer state")
    ax.plot(xs, [r.forward_peak / MiB for r in rows], "o-", label="activations (forward peak)")
    ax.plot(xs, [(r.fixed + r.step_peak_k) / MiB for r in rows], "^-", label=f"total peak of a step (K={rows[0].k})")
    ax.set_xlabel("micro-batch (sequences)")
    ax.set_ylabel("MiB")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def micro_batch_sizes(largest: int) -> list[int]:
    """``1, 2, 4, ...`` up to ``largest``: the sizes ``bigbatch memory`` measures."""
    return [2**i for i in range(largest.bit_length()) if 2**i <= largest]


@dataclass(frozen=True)
class MemorySweep:
    """Measured micro-steps of one model for micro-batch sizes 1, 2, 4, ..., with the activation estimates."""

    model: str
    vocab_size: int  # the measured model's: its head and logits are part of every row
    seq_len: int
    precision: str
    device: torch.device
    activation_checkpointing: bool
    chunked_loss: bool
    rows: list[MicroStepMeasurement]
    estimates: dict[int, int]

    def format(self) -> str:
        """The header line and the table of ``bigbatch memory``."""
        how = "allocator peaks" if self.device.type == "cuda" else "peak resident memory of a fresh process per size"
        checkpointing = " | activation checkpointing" if self.activation_checkpointing else ""
        loss = "" if self.chunked_loss else " | whole logits (--no-chunked-loss)"
        shape = f"{self.model} | vocab {self.vocab_size:,} | seq_len {self.seq_len}"
        header = f"{shape} | {self.precision} | {self.device} ({how}){checkpointing}{loss}"
        reason = family_for_model_name(self.model).no_estimate_reason
        note = f"\nestimate: {reason}" if reason else ""
        return header + "\n" + memory_report(self.rows, self.estimates) + note


def measure_sizes(
    config: ModelShape,
    name: str,
    sizes: list[int],
    seq_len: int,
    *,
    k: int,
    device: torch.device,
    precision: str,
    activation_checkpointing: bool = False,
    chunked_loss: bool = True,
    stream: TextIO | None = None,
    optimizer: str = "adamw",
) -> list[MicroStepMeasurement]:
    """:func:`measure` at each micro-batch size, with progress on ``stream`` (default: stderr), since a size can
    take minutes (GPT-2 on CPU): first what is measured, then a redrawn bar on a terminal, else a line per size."""
    stream = sys.stderr if stream is None else stream
    stream.write(
        f"measuring a training micro-step of {name} on {device.type} ({precision}, seq_len {seq_len}, K {k}) at "
        f"micro-batch {', '.join(str(size) for size in sizes)}\n"
    )
    stream.flush()
    rows = []
    with ProgressBar(len(sizes), label="measured", stream=stream, min_interval=0) as bar:  # only on a TTY
        for i, size in enumerate(sizes):
            bar.update(i, extra=f"measuring micro-batch {size}")
            rows.append(
                measure(
                    config,
                    size,
                    seq_len,
                    k=k,
                    device=device,
                    precision=precision,
                    activation_checkpointing=activation_checkpointing,
                    chunked_loss=chunked_loss,
                    optimizer=optimizer,
                )
            )
            if bar.enabled:
                bar.update(i + 1, extra=f"measured micro-batch {size}")
            else:
                stream.write(f"measured micro-batch {size}\n")
    return rows


def sweep_memory(
    model: str,
    seq_len: int,
    max_micro_batch: int,
    *,
    k: int,
    vocab_size: int,
    device: torch.device,
    precision: str,
    activation_checkpointing: bool = False,
    chunked_loss: bool = True,
    stream: TextIO | None = None,
    optimizer: str = "adamw",
) -> MemorySweep:
    """Measure a training micro-step of preset ``model`` at micro-batch sizes 1, 2, 4, ... ``max_micro_batch``.

    Progress goes to ``stream`` (default: stderr): see :func:`measure_sizes`."""
    fixed = family_for_model_name(model).fixed_shape  # hf:DIR: its config.json's vocabulary; 0: the preset's
    config = model_preset(model, **({"vocab_size": vocab_size} if vocab_size and not fixed else {}))
    if seq_len > config.block_size:
        raise BigBatchError(
            f"--seq-len {seq_len} exceeds the {model} block size {config.block_size:,}; lower --seq-len to at most "
            f"{config.block_size:,}, or leave it auto (the block size)"
        )
    sizes = micro_batch_sizes(max_micro_batch)
    rows = measure_sizes(
        config,
        model,
        sizes,
        seq_len,
        k=k,
        device=device,
        precision=precision,
        activation_checkpointing=activation_checkpointing,
        chunked_loss=chunked_loss,
        stream=stream,
        optimizer=optimizer,
    )
    estimates = (
        {}
        if estimate_unavailable(config)
        else {s: estimate_memory(config, s, seq_len, precision, chunked_loss).activations for s in sizes}
    )
    return MemorySweep(
        model, config.vocab_size, seq_len, precision, device, activation_checkpointing, chunked_loss, rows, estimates
    )
