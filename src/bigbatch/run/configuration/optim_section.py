"""The ``[optim]`` section: the optimizer, its schedule and what follows a change of the tokens per step."""

from __future__ import annotations

from dataclasses import dataclass

from bigbatch.run.configuration.fields import config_field as _opt
from bigbatch.settings.choices import (
    BATCH_CHANGE_BETAS,
    BATCH_CHANGE_MOMENTUM,
    BATCH_CHANGE_RULE,
    BATCH_CHANGE_WEIGHT_DECAY,
    MUON_COEFFICIENTS,
    MUON_SCALE,
    OPTIMIZER,
    SCHEDULE,
)
from bigbatch.settings.ranges import (
    FRACTION,
    NON_NEGATIVE,
    NON_NEGATIVE_INT,
    NS_STEPS,
    POSITIVE,
    POSITIVE_INT_OR_AUTO,
    POSITIVE_OR_AUTO,
    PROBABILITY,
)


@dataclass
class OptimSection:
    optimizer: str = _opt(
        "adamw",
        "adamw, or muon: Muon (momentum, then Newton-Schulz orthogonalisation, once per step on the accumulated "
        "gradient) for the 2-D hidden matrices in the blocks (an MoE's expert stacks per expert), AdamW with the "
        "flags below for embeddings, head, routers, gains and biases",
        choices=OPTIMIZER,
    )
    lr: float = _opt(2e-3, "peak learning rate (after warmup)", range=POSITIVE)
    min_lr_ratio: float = _opt(0.1, "final learning rate as a fraction of lr; 0 decays to zero", range=FRACTION)
    warmup_steps: int = _opt(20, "linear warmup steps; 0: none", range=NON_NEGATIVE_INT)
    decay_steps: int = _opt(
        0,
        "step at which cosine decay reaches the minimum; auto: max_steps",
        range=POSITIVE_INT_OR_AUTO,
        legacy_zero=True,
    )
    weight_decay: float = _opt(
        0.1,
        "AdamW weight decay on matrices and embeddings; 0 disables",
        range=NON_NEGATIVE,
    )
    beta1: float = _opt(0.9, "AdamW beta1; 0: no moving average of the gradient", range=PROBABILITY)
    beta2: float = _opt(0.95, "AdamW beta2; 0: no moving average of its square", range=PROBABILITY)
    eps: float = _opt(1e-8, "AdamW epsilon", range=POSITIVE)
    muon_lr: float = _opt(
        0.0,
        "Muon's peak learning rate (the schedule moves it as it moves --lr); auto: --lr with --muon-scale rms "
        "(the update's RMS is AdamW's), 0.02 with spectral",
        range=POSITIVE_OR_AUTO,
    )
    muon_momentum: float = _opt(0.95, "Muon's (Nesterov) momentum; 0: none", range=PROBABILITY)
    muon_weight_decay: float = _opt(
        0.1, "Muon's decoupled weight decay on the hidden matrices; 0 disables", range=NON_NEGATIVE
    )
    muon_ns_steps: int = _opt(
        5, "Newton-Schulz iterations per matrix and step (at most 50: 10 reach the polar factor)", range=NS_STEPS
    )
    muon_coefficients: str = _opt(
        "quintic",
        "Newton-Schulz polynomial: quintic (Jordan's, 5 iterations leave singular values above 1e-2 of the "
        "Frobenius norm in about 0.7-1.2) or polar-express (Amsel et al.'s per-iteration coefficients: above 1e-3, "
        "about 0.86-1.14 after 5; more iterations "
        "converge to the polar factor)",
        choices=MUON_COEFFICIENTS,
    )
    muon_scale: str = _opt(
        "rms",
        "rms: update x 0.2 sqrt(max(m, n)), the RMS of an AdamW update, so AdamW's lr carries over (Moonlight); "
        "spectral: x sqrt(max(1, m/n)) (modded-nanogpt's; lr about 0.02)",
        choices=MUON_SCALE,
    )
    grad_clip: float = _opt(
        1.0,
        "clip the global gradient norm to this after accumulation; 0 disables",
        range=NON_NEGATIVE,
    )
    schedule: str = _opt(
        "cosine",
        "cosine (warmup, then cosine decay to min_lr_ratio x lr) or seesaw (the same schedule in tokens, but wherever "
        "it would halve the learning rate the batch doubles instead and --batch-change-rule moves the learning rate: "
        "sqrt gives 1/sqrt(2) per halving; the tokens of max_steps steps in fewer steps)",
        choices=SCHEDULE,
    )
    batch_change_rule: str = _opt(
        "auto",
        "when the tokens per step change (--batch-ramp, --schedule seesaw, a critical-batch branch, a resume with "
        "another --total-batch-tokens), scale the learning rate by r = new/reference tokens per step: none, sqrt "
        "(x sqrt(r)) or linear (x r); the reference is the run's first total_batch_tokens; auto: sqrt",
        choices=BATCH_CHANGE_RULE,
    )
    batch_change_betas: str = _opt(
        "auto",
        "at a batch change, keep the half-life in tokens of AdamW's moving averages: beta2 (beta2 ** r), both "
        "(beta1 and beta2) or none; auto: beta2, or none with --batch-change-rule none",
        choices=BATCH_CHANGE_BETAS,
    )
    batch_change_momentum: str = _opt(
        "auto",
        "at a batch change with --optimizer muon: tokens (Muon's momentum ** r, keeping its half-life in tokens) or "
        "keep; auto: tokens, or keep with --batch-change-rule none",
        choices=BATCH_CHANGE_MOMENTUM,
    )
    batch_change_weight_decay: str = _opt(
        "keep",
        "at a batch change: keep the weight decay, or timescale (scale it by r / lr factor, keeping "
        "B / (lr x weight decay) fixed)",
        choices=BATCH_CHANGE_WEIGHT_DECAY,
    )
