"""The table of ``bigbatch plan``: the batch arithmetic, memory and the step-time model."""

from __future__ import annotations

import torch

from bigbatch.engine.accumulate import resolve_precision
from bigbatch.errors import ConfigError
from bigbatch.models.family import ModelShape
from bigbatch.models.registry import build_model, family_for_model_name, family_of, model_preset
from bigbatch.parallel.distributed import resolve_device
from bigbatch.sizing.memory import (
    MiB,
    MicroStepMeasurement,
    estimate_memory,
    estimate_unavailable,
    measure_sizes,
)
from bigbatch.sizing.plan import SolvedPlan


def _mib(n: float) -> str:
    return f"{n / MiB:,.1f} MiB" if n < 1024 * MiB else f"{n / 1024 / MiB:,.2f} GiB"


def model_size(config: ModelShape) -> str:
    """``0.83M parameters``, counted as ``train``'s header counts them (built on the meta device: no memory)."""
    with torch.device("meta"):
        return build_model(config).describe_size()


def format_plan(
    solved: SolvedPlan,
    model_name: str | None = None,
    model_config: ModelShape | None = None,
    precision: str = "fp32",
    measured: MicroStepMeasurement | None = None,
    optimizer: str = "adamw",
    ns_steps: int = 5,
) -> str:
    plan = solved.plan
    rows: list[tuple[str, str]] = [
        ("tokens per step", f"{plan.tokens_per_step:,}"),
        ("sequences per step", f"{plan.sequences_per_step:,}"),
        ("sequence length (T)", f"{plan.seq_len:,}"),
        ("micro-batch per device (B)", f"{plan.micro_batch}"),
        ("accumulation steps (K)", f"{plan.accumulation_steps}"),
        ("micro-steps per device per step", f"{plan.accumulation_steps}"),
        ("devices (world size)", f"{plan.world_size}"),
        ("tokens per micro-batch", f"{plan.tokens_per_micro_batch:,}"),
    ]
    notes = []
    if solved.solved_for:
        notes.append(f"derived: {solved.solved_for}")
    if solved.rounded:
        notes.append(
            f"{solved.requested_tokens:,} tokens is not a whole number of micro-batches on every device; rounded "
            f"the sequences per step to {plan.sequences_per_step:,} = {plan.tokens_per_step:,} tokens"
            + (f" ({plan.tokens_per_step / 1e6:.1f}M)" if plan.tokens_per_step >= 100_000 else "")
        )
    unavailable = estimate_unavailable(model_config) if model_config is not None else ""
    if model_config is not None and unavailable:
        family = family_of(model_config)
        rows.append((f"model {model_name}", f"{family.name} {family.hf_class_name(model_config)}"))
        notes.append(unavailable + ("; --measure measures it" if measured is None else ""))
    elif model_config is not None:
        estimate = estimate_memory(
            model_config, plan.micro_batch, plan.seq_len, precision, optimizer=optimizer, ns_steps=ns_steps
        )
        state = "AdamW state" if optimizer == "adamw" else "Muon + AdamW state (1 buffer per matrix weight, 2 else)"
        rows += [
            (f"model {model_name}", model_size(model_config)),
            ("parameters (fp32)", _mib(estimate.params)),
            ("gradients (fp32)", _mib(estimate.grads)),
            (state, _mib(estimate.optimizer)),
            (f"activations per micro-batch ({precision}, estimate)", _mib(estimate.activations)),
            ("peak per device (estimate)", _mib(estimate.fixed + estimate.activations)),
        ]
        if estimate.orthogonalise_flops:
            # the step's training FLOPs: 6 N per token (forward + backward) with attention, every device's tokens
            with torch.device("meta"):
                train_flops = build_model(model_config).flops_per_token(plan.seq_len) * plan.tokens_per_step
            flops = estimate.orthogonalise_flops
            devices = f"{plan.world_size} device{'s' if plan.world_size > 1 else ''}"
            rows.append(
                (
                    f"Newton-Schulz per step ({ns_steps} iterations)",
                    f"{flops / 1e9:,.2f} GFLOP, {flops / train_flops:.2%} of the step's training FLOPs (split "
                    f"across {devices})",
                )
            )
    if measured is not None:
        step = plan.accumulation_steps * measured.micro_step_seconds + measured.optimizer_seconds
        rows += [
            ("activations per micro-batch (measured)", _mib(measured.forward_peak)),
            ("peak per device (measured)", _mib(measured.fixed + max(measured.backward_peak, measured.step_peak_k))),
            ("micro-step time (measured)", f"{measured.micro_step_seconds * 1000:,.1f} ms"),
            ("optimizer step time (measured)", f"{measured.optimizer_seconds * 1000:,.1f} ms"),
            ("step time = K x micro-step + optimizer", f"{step * 1000:,.0f} ms"),
            ("tokens/s per device (model)", f"{plan.tokens_per_step / plan.world_size / step:,.0f}"),
        ]
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    return "\n".join(lines + [f"note: {n}" for n in notes])


def report_plan(
    solved: SolvedPlan,
    model_name: str | None = None,
    vocab_size: int = 0,
    precision: str = "auto",
    device_name: str = "auto",
    measure_step: bool = False,
    optimizer: str = "adamw",
    ns_steps: int = 5,
) -> str:
    """The table of ``bigbatch plan``; with a preset ``model_name``, its memory (the context grown to the plan's
    ``seq_len`` when that is longer) and, with ``measure_step``, a micro-step measured on ``device_name``."""
    if not model_name:
        return format_plan(solved, model_name, None, "fp32", None, optimizer, ns_steps)
    device = resolve_device(device_name)
    resolved = resolve_precision(precision, device)
    overrides = {"vocab_size": vocab_size} if vocab_size else {}
    model_config = model_preset(model_name, **overrides)
    if solved.plan.seq_len > model_config.block_size:
        if family_for_model_name(model_name).fixed_shape:  # its context is its config.json's: it cannot grow here
            raise ConfigError(
                f"--seq-len {solved.plan.seq_len} exceeds {model_name}'s context length {model_config.block_size:,} "
                f"(its config.json's); lower --seq-len to at most {model_config.block_size:,}, or leave it out"
            )
        model_config = model_preset(model_name, block_size=solved.plan.seq_len, **overrides)
    measured = None
    if measure_step:  # minutes for GPT-2 on CPU: said as it goes, as bigbatch memory says it
        measured = measure_sizes(
            model_config,
            model_name,
            [solved.plan.micro_batch],
            solved.plan.seq_len,
            k=min(solved.plan.accumulation_steps, 4),
            device=device,
            precision=resolved,
            optimizer=optimizer,
        )[0]
    return format_plan(solved, model_name, model_config, resolved, measured, optimizer, ns_steps)
