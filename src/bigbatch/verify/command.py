"""Inputs for ``bigbatch verify``: the model (a preset or a user factory), a batch and a loss."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from bigbatch.engine.batch import IGNORE_INDEX
from bigbatch.errors import BigBatchError, ConfigError
from bigbatch.models import build_model, model_preset
from bigbatch.models.lora import LoraSettings, add_lora
from bigbatch.models.routing import router_recorder
from bigbatch.parallel.distributed import distributed_session, resolve_device
from bigbatch.verify import (
    DistributedReport,
    EquivalenceReport,
    VerifyLossFn,
    check_distributed_equivalence,
    check_equivalence,
)
from bigbatch.verify.packed_batch import MIN_VOCAB, packed_documents, position_mismatch


@dataclass
class VerifyCase:
    """What the verifier needs: a model, a batch of tensors sharing dim 0, and optionally a loss function."""

    model: nn.Module
    batch: tuple[torch.Tensor, ...] | None = None
    loss_fn: VerifyLossFn | None = None
    unpacked: tuple[torch.Tensor, ...] | None = None  # packed batch: the same documents one per row
    packing_problems: list[str] = field(default_factory=list)  # what the loader's packed rows got wrong


def load_factory(spec: str) -> VerifyCase:
    """Call ``package.module:function``; it returns a model, ``(model, batch[, loss_fn])`` or a :class:`VerifyCase`."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise BigBatchError(f"--factory {spec!r} must look like package.module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BigBatchError(f"cannot import {module_name!r} for --factory: {exc}; is it on PYTHONPATH?") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise BigBatchError(f"{module_name} has no function {attr!r} for --factory")
    made = factory()
    if isinstance(made, VerifyCase):
        return made
    if isinstance(made, nn.Module):
        return VerifyCase(made)
    if isinstance(made, tuple) and 2 <= len(made) <= 3 and isinstance(made[0], nn.Module):
        batch = made[1]
        batch = (batch,) if isinstance(batch, torch.Tensor) else tuple(batch)
        return VerifyCase(made[0], batch, made[2] if len(made) == 3 else None)
    raise BigBatchError(
        f"--factory {spec} returned {type(made).__name__}; return an nn.Module, (model, batch[, loss_fn]) "
        "or a bigbatch.verify.command.VerifyCase"
    )


def preset_case(name: str, vocab_size: int, dropout: float) -> VerifyCase:
    overrides: dict[str, float | int] = {"dropout": dropout}
    if vocab_size:
        overrides["vocab_size"] = vocab_size
    return VerifyCase(build_model(model_preset(name, **overrides)))


def token_batch(
    samples: int, seq_len: int, vocab_size: int, ragged: bool, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (inputs, targets); with ``ragged``, each sequence keeps a random-length prefix of valid targets."""
    tokens = torch.randint(0, vocab_size, (samples, seq_len + 1), generator=generator)
    inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    if ragged:
        lengths = torch.randint(1, seq_len + 1, (samples,), generator=generator)
        positions = torch.arange(seq_len).unsqueeze(0)  # (1, T)
        targets[positions >= lengths.unsqueeze(1)] = IGNORE_INDEX
    return inputs, targets


def model_vocab_size(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    return int(vocab) if isinstance(vocab, int) else None


def build_case(
    factory: str | None,
    preset_name: str,
    vocab_size: int,
    dropout: float,
    seed: int,
    samples: int,
    seq_len: int,
    ragged: bool,
    packed: bool = False,
) -> VerifyCase:
    """The model (a preset or ``factory``) with its batch: the factory's own, or ``samples`` random sequences
    (with ``packed``, rows of random documents packed by the training loader, the same documents one per row,
    and whether the loader's positions restart at each document)."""
    torch.manual_seed(seed)  # the same model on every rank
    case = load_factory(factory) if factory else preset_case(preset_name, vocab_size, dropout)
    if case.batch is None:
        vocab = vocab_size or model_vocab_size(case.model)
        if not vocab:
            raise BigBatchError("the factory's model has no config.vocab_size; give --vocab-size")
        generator = torch.Generator().manual_seed(seed)
        if packed:
            if vocab < MIN_VOCAB:
                raise BigBatchError(f"--packed needs a vocabulary of at least {MIN_VOCAB} tokens; raise --vocab-size")
            case.batch, case.unpacked = packed_documents(samples, seq_len, vocab, generator)
            mismatch = position_mismatch(case.batch[0], case.batch[2])
            if mismatch:
                case.packing_problems.append(
                    f"the training loader's positions do not restart at each document: {mismatch}"
                )
        else:
            case.batch = token_batch(samples, seq_len, vocab, ragged, generator)
    elif packed:
        raise BigBatchError("--packed builds its own batch; the factory returned one (leave --packed off)")
    return case


def check_router_balance(case: VerifyCase, settings: VerifySettings) -> None:
    """``--router-balance`` on a model without a router is refused in one line."""
    if settings.router_balance != "auto" and router_recorder(case.model) is None:
        name = settings.factory or settings.model
        raise ConfigError(
            f"--router-balance {settings.router_balance} applies to a mixture of experts, and {name} is dense (no "
            "router); leave it out or verify an MoE model (e.g. --model moe-pico)"
        )


@dataclass(frozen=True)
class VerifySettings:
    """What ``bigbatch verify`` compares: the model (a preset or ``factory``), its batch and how it is cut."""

    model: str = "nano"
    factory: str | None = None
    k: int = 4
    micro_batch: int = 2
    seq_len: int = 64
    vocab_size: int = 0
    dropout: float = 0.0
    ragged: bool = True
    packed: bool = False  # rows packed with several documents, checked against one document per row too
    precision: str = "fp32"
    splits: tuple[str, ...] = ("equal", "unequal", "permuted")
    tolerance: float | None = None
    seed: int = 0
    device: str = "cpu"
    router_balance: str = "auto"  # a mixture of experts' balancing loss (auto: exact); refused for a dense model
    lora_rank: int = 0  # LoRA adapters (A and B drawn at random) on the model; only they are compared
    optimizer: str = "adamw"  # the update compared after one step: adamw or muon

    @property
    def balance(self) -> str:
        return "exact" if self.router_balance == "auto" else self.router_balance


def verify_here(settings: VerifySettings) -> EquivalenceReport:
    """The single-process check: the full-batch gradient against the one accumulated over K micro-batches."""
    s = settings
    case = build_case(
        s.factory, s.model, s.vocab_size, s.dropout, s.seed, s.k * s.micro_batch, s.seq_len, s.ragged, s.packed
    )
    assert case.batch is not None  # build_case gives every case a batch
    if s.lora_rank:
        add_lora(case.model, LoraSettings(rank=s.lora_rank), random_init=True)
    check_router_balance(case, s)
    try:
        report = check_equivalence(
            case.model,
            case.batch,
            loss_fn=case.loss_fn,
            k=s.k,
            precision=s.precision,
            tolerance=s.tolerance,
            device=resolve_device(s.device),
            seed=s.seed,
            splits=list(s.splits),
            unpacked=case.unpacked,
            router_balance=s.balance,
            optimizer=s.optimizer,
        )
    except ValueError as exc:
        raise BigBatchError(str(exc)) from exc
    report.packing_problems[:0] = case.packing_problems  # the loader's positions, before the gradients
    return report


def verify_across_ranks(settings: VerifySettings) -> tuple[DistributedReport, bool]:
    """Under torchrun: every rank's gradient after the one sync equals the single-process gradient. Returns the
    report and whether this process is the main rank (the one that reports)."""
    s = settings
    with distributed_session(s.device) as (dist, device):
        case = build_case(
            s.factory,
            s.model,
            s.vocab_size,
            s.dropout,
            s.seed,
            s.k * s.micro_batch * dist.world_size,
            s.seq_len,
            s.ragged,
            s.packed,
        )
        assert case.batch is not None  # build_case gives every case a batch
        if s.lora_rank:
            add_lora(case.model, LoraSettings(rank=s.lora_rank), random_init=True)
        check_router_balance(case, s)
        report = check_distributed_equivalence(
            case.model,
            case.batch,
            dist,
            loss_fn=case.loss_fn,
            k=s.k,
            device=device,
            tolerance=s.tolerance or 1e-5,
            router_balance=s.balance,
        )
        report.packing_problems[:0] = case.packing_problems
        return report, dist.is_main
