"""The objective phase of a build: what the run optimises (``[objective]``), checked against the settings and data
that give it meaning, with its reference policy.

``lm`` is the next-token loss (with an MoE's router terms); a preference objective reads answers (pairs or KTO
rows) and is refused in one line where a setting has no meaning for it: the gradient noise scale and a batch ramp
measure or follow tokens per step of a next-token loss, a token budget sizes steps by tokens where a preference
step is sized by its pairs (K micro-batches), and ``--micro-batch auto`` measures the memory of next-token steps.
The spike detector judges the objective's first term (DPO's loss per pair, ORPO's NLL per token), and validation
is the objective on the validation split with its reward accuracy.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch

from bigbatch.data.answers import check_answers_for_objective
from bigbatch.data.dataset import Dataset
from bigbatch.engine.language_model import LanguageModelObjective
from bigbatch.engine.objective import Objective
from bigbatch.engine.preference import PreferenceObjective, PreferenceSettings, ReferencePolicy
from bigbatch.errors import ConfigError
from bigbatch.models import LanguageModel
from bigbatch.parallel.distributed import Say
from bigbatch.run.build.engine_phase import resolve_router_balance
from bigbatch.run.configuration.train_config import TrainConfig


def preference_settings(config: TrainConfig) -> PreferenceSettings | None:
    """The preference objective's settings, or ``None`` for ``lm`` (whose parameters are refused when given)."""
    section = config.objective
    if section.name == "lm":
        given = [
            flag
            for flag, value, default in (
                ("--beta", section.beta, 0.0),
                ("--label-smoothing", section.label_smoothing, 0.0),
                ("--robust", section.robust, False),
                ("--simpo-gamma", section.simpo_gamma, 1.0),
                ("--desirable-weight", section.desirable_weight, 1.0),
                ("--undesirable-weight", section.undesirable_weight, 1.0),
                ("--reference", section.reference, ""),
            )
            if value != default
        ]
        if given:
            raise ConfigError(
                f"{', '.join(given)} set the parameters of a preference objective; give --objective dpo, ipo, simpo, "
                "orpo or kto, or drop them"
            )
        return None
    if section.reference and section.name not in ("dpo", "ipo", "kto"):
        raise ConfigError(f"--reference: --objective {section.name} has no reference policy; drop --reference")
    if section.robust and not section.label_smoothing:
        raise ConfigError("--robust corrects for --label-smoothing; give --label-smoothing E (0 < E < 0.5)")
    return PreferenceSettings(
        section.name,
        beta=section.beta or None,
        label_smoothing=section.label_smoothing,
        robust=section.robust,
        gamma=section.simpo_gamma,
        desirable_weight=section.desirable_weight,
        undesirable_weight=section.undesirable_weight,
    )


def check_objective(config: TrainConfig) -> None:
    """Settings that mean nothing under a preference objective, refused in one line before anything is made (the
    gradient noise scale, on by default, is not measured, and the run says so: see
    :func:`~bigbatch.run.build.sizing_phase.noise_unmeasurable`)."""
    name = config.objective.name
    preference_settings(config)
    if name == "lm":
        return
    refused = [
        (
            config.batch.batch_ramp not in ("", "none"),
            "--batch-ramp: a ramp follows tokens per step of a next-token loss",
        ),
        (bool(config.batch.token_budget), "--token-budget: a preference step is K micro-batches of whole pairs"),
        (config.batch.micro_batch == 0, "--micro-batch auto: it measures next-token steps; give --micro-batch N"),
    ]
    for refused_here, why in refused:
        if refused_here:
            raise ConfigError(f"--objective {name} does not take {why}")


def build_objective(
    config: TrainConfig, model: LanguageModel, dataset: Dataset, device: torch.device, say: Say
) -> Objective:
    """The run's objective, its data checked (preference rows for a preference objective, and never KTO rows or
    pairs for ``lm``), with its reference policy (before the model is wrapped: a frozen copy is the model as it
    starts)."""
    check_answers(config.objective.name, dataset)
    settings = preference_settings(config)
    if settings is None:
        return LanguageModelObjective(
            router_balance=resolve_router_balance(config, model),
            router_aux_coef=config.model.router_aux_coef or None,
            router_z_coef=config.model.router_z_coef or None,
        )
    reference = None
    if settings.needs_reference:
        reference = reference_policy(config, model, dataset, device)
        say("reference | %s", reference.describe(model))
    objective = PreferenceObjective(settings, reference)
    for line in objective.describe():
        say("%s", line)
    return objective


def reference_policy(
    config: TrainConfig, model: LanguageModel, dataset: Dataset, device: torch.device
) -> ReferencePolicy:
    """``--reference DIR`` (a frozen model of its own), the base with adapters off under ``--lora-rank``, or a frozen
    copy of the model as it starts."""
    directory = config.objective.reference
    if directory:
        from bigbatch.run.build.model_phase import model_from_config

        section = replace(config.model, preset=f"hf:{directory}", init_from="", lora_rank=0)
        reference = model_from_config(replace(config, model=section), dataset.vocab_size, dataset.meta.tokenizer)
        if reference.config.vocab_size != model.config.vocab_size:
            raise ConfigError(
                f"--reference {directory} has vocabulary {reference.config.vocab_size}, the trained model "
                f"{model.config.vocab_size}; give a reference of the same tokenizer"
            )
        return ReferencePolicy(reference.to(device))
    if config.model.lora_rank:
        return ReferencePolicy()
    return ReferencePolicy(copy.deepcopy(model).to(device))


def check_answers(objective: str, dataset: Dataset) -> None:
    """A preference objective reads its own rows; ``lm`` reads neither pairs nor KTO rows (a KTO row read as a
    prompt and completion would teach the undesirable ones); see
    :func:`~bigbatch.data.answers.check_answers_for_objective`."""
    answers = dataset.meta.answers if dataset.meta.mode == "documents" else ""
    check_answers_for_objective(answers, objective)
