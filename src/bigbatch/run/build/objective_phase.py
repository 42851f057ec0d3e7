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
import hashlib
import json
import time
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from bigbatch.data.answers import check_answers_for_objective
from bigbatch.data.dataset import Dataset
from bigbatch.data.loader import loader_for
from bigbatch.engine.accumulate import autocast_for, resolve_precision
from bigbatch.engine.language_model import LanguageModelObjective
from bigbatch.engine.objective import Objective
from bigbatch.engine.preference import (
    PreferenceObjective,
    PreferenceSettings,
    ReferencePolicy,
    ReferenceTable,
    compute_reference_table,
)
from bigbatch.errors import ConfigError
from bigbatch.files.atomic import write_atomically
from bigbatch.files.json_text import to_json
from bigbatch.models import LanguageModel
from bigbatch.models.routing import router_recorder
from bigbatch.parallel.distributed import DistContext, Say
from bigbatch.progress import plural
from bigbatch.run.build.data_phase import RunData
from bigbatch.run.build.engine_phase import resolve_router_balance
from bigbatch.run.build.rollout_phase import build_reward_objective, check_rewards
from bigbatch.run.configuration.objective_section import ObjectiveSection
from bigbatch.run.configuration.train_config import BatchSection, TrainConfig, field_of, flag_of
from bigbatch.sizing.plan import BatchPlan


def preference_settings(config: TrainConfig) -> PreferenceSettings | None:
    """The preference objective's settings, or ``None`` for ``lm`` (whose parameters are refused when given)."""
    section = config.objective
    if section.name == "lm":
        given = [  # every field of the section but the objective's name, set to other than its default
            f"--{flag_of(f)}"
            for f in fields(ObjectiveSection)
            if f.name != "name" and getattr(section, f.name) != f.default
        ]
        if given:
            verb = "sets" if len(given) == 1 else "set"
            raise ConfigError(
                f"{', '.join(given)} {verb} the parameters of a preference objective; give --objective dpo, ipo, "
                "simpo, orpo or kto, or drop them"
            )
        return None
    if section.name == "grpo":
        given = [
            f"--{flag_of(f)}"
            for f in fields(ObjectiveSection)
            if f.name not in ("name", "reference") and getattr(section, f.name) != f.default
        ]
        if given:
            raise ConfigError(
                f"{', '.join(given)} {'sets' if len(given) == 1 else 'set'} the parameters of a preference objective, "
                "not of --objective grpo (its own are --kl-coef, --clip-low, --clip-high, ...); drop them"
            )
        if section.reference and not config.rewards.kl_coef:
            raise ConfigError(
                "--reference: --objective grpo reads a reference only for --kl-coef; give it or drop both"
            )
        return None
    if section.reference and section.name not in ("dpo", "ipo", "kto"):
        raise ConfigError(f"--reference: --objective {section.name} has no reference policy; drop --reference")
    return PreferenceSettings(  # which objective each parameter belongs to is checked there
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
    check_rewards(config)
    if name == "lm":
        return
    sized = "its completions" if name == "grpo" else "K micro-batches of whole pairs"
    refused = [
        (
            config.batch.batch_ramp not in ("", "none"),
            "--batch-ramp: a ramp follows tokens per step of a next-token loss",
        ),
        (bool(config.batch.token_budget), f"--token-budget: a {name} step is {sized}"),
        (
            name == "grpo" and config.batch.total_batch_tokens != field_of(BatchSection, "total_batch_tokens").default,
            "--total-batch-tokens: a grpo step is --prompts-per-step groups of completions (K follows them)",
        ),
        (config.batch.micro_batch == 0, "--micro-batch auto: it measures next-token steps; give --micro-batch N"),
        (
            config.optim.schedule == "seesaw",
            "--schedule seesaw: its batch doubles in tokens per step of a next-token loss",
        ),
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
    if config.objective.name == "grpo":
        return build_reward_objective(config, model, dataset, device, say)
    settings = preference_settings(config)
    if settings is None:
        return LanguageModelObjective(
            router_balance=resolve_router_balance(config, model),
            router_aux_coef=config.model.router_aux_coef or None,
            router_z_coef=config.model.router_z_coef or None,
        )
    if router_recorder(model) is not None:
        raise ConfigError(
            f"--objective {settings.name} on a mixture of experts: its router's balancing terms are not part of the "
            "preference objectives yet, and training without them lets the experts collapse; use a dense model"
        )
    reference = None
    if settings.needs_reference:
        reference = reference_policy(config, model, dataset, device)
        where = f" {config.objective.reference}" if config.objective.reference else ""
        say("reference | %s%s", reference.describe(model), where)
    objective = PreferenceObjective(settings, reference)
    if reference is not None and config.objective.reference_logps == "once":  # before any wrapping shards them
        objective.reference_weights = weights_fingerprint(reference.module if reference.module is not None else model)
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

        check_reference_directory(Path(directory), model.config.vocab_size)
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


def check_reference_directory(directory: Path, vocab_size: int) -> None:
    """``--reference DIR`` is a Hugging Face model directory of the trained model's vocabulary, or a one-line error
    that names the flag."""
    if not directory.is_dir():
        raise ConfigError(f"--reference {directory}: no such directory; give a Hugging Face model directory")
    config_file = directory / "config.json"
    if not config_file.is_file():
        hint = (
            " (a bigbatch run: bigbatch export RUN --format hf OUT makes one)"
            if (directory / "checkpoints").is_dir()
            else ""
        )
        raise ConfigError(f"--reference {directory} has no config.json: give a Hugging Face model directory{hint}")
    try:
        vocab = int(json.loads(config_file.read_text(encoding="utf-8")).get("vocab_size") or 0)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--reference {directory}: its config.json is not readable ({exc})") from exc
    if vocab and vocab != vocab_size:
        raise ConfigError(
            f"--reference {directory} has vocabulary {vocab:,}, the trained model {vocab_size:,}; give a reference "
            "of the same tokenizer"
        )


def check_answers(objective: str, dataset: Dataset) -> None:
    """A preference objective reads its own rows; ``lm`` reads neither pairs nor KTO rows (a KTO row read as a
    prompt and completion would teach the undesirable ones); see
    :func:`~bigbatch.data.answers.check_answers_for_objective`."""
    answers = dataset.meta.answers if dataset.meta.mode == "documents" else ""
    check_answers_for_objective(answers, objective)


REFERENCE_TABLE_FILE = "reference_logps.pt"
"""Where ``--reference-logps once`` keeps the reference's log-probabilities in the run directory."""


def weights_fingerprint(module: nn.Module) -> str:
    """A sha256 of a reference's weights (a LoRA model's base: its adapters left out), read once."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        if "lora_" in name or not isinstance(tensor, torch.Tensor):
            continue
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def reference_table_key(config: TrainConfig, fingerprints: dict[str, str], weights: str = "") -> str:
    """What a table of reference log-probabilities was computed for: the reference (its weights, and the model
    section and seed that make the starting model, or ``--reference``) and the data's tokens (the chat template
    is in them)."""
    payload = {
        "model": asdict(config.model),
        "seed": config.run.seed,
        "reference": config.objective.reference,
        "weights": weights,
        "data": fingerprints.get("data", ""),
    }
    return hashlib.sha256(to_json(payload).encode()).hexdigest()[:16]


def prepare_reference_table(
    config: TrainConfig,
    objective: Objective,
    model: nn.Module,
    data: RunData,
    plan: BatchPlan,
    run_dir: Path,
    pack: bool,
    dist: DistContext,
    device: torch.device,
    say: Say,
) -> None:
    """``--reference-logps once``: the reference's log-probabilities of every answer of the training and validation
    splits, read from the run directory when it holds a table of the same key, else computed (each rank a share,
    one all-reduce) and written there by rank 0; a frozen reference model then leaves memory."""
    if config.objective.reference_logps != "once":
        return
    if not isinstance(objective, PreferenceObjective) or not objective.settings.needs_reference:
        raise ConfigError(
            f"--reference-logps once: --objective {config.objective.name} has no reference policy; drop it"
        )
    dataset, precision = data.dataset, resolve_precision(config.run.precision, device)
    key = reference_table_key(config, data.fingerprints, objective.reference_weights)
    path = run_dir / REFERENCE_TABLE_FILE
    table = _read_table(path, key)
    if table is None:
        train = loader_for(dataset, "train", plan.micro_batch, plan.seq_len, name="training", pack=pack)
        readers: dict[str, Any] = {"training": train}
        if config.run.eval_every and dataset.meta.shards.get("val"):
            readers["validation"] = loader_for(
                dataset, "val", plan.micro_batch, plan.seq_len, name="validation", pack=pack
            )
        started = time.perf_counter()
        assert objective.reference is not None
        table = compute_reference_table(
            objective.reference, model, readers, dist, device, lambda: autocast_for(precision, device), key
        )
        if dist.is_main:
            state = {"key": key, "values": table.values}
            write_atomically(path, lambda handle: torch.save(state, handle))
        answers = sum(int(v.numel()) for v in table.values.values())
        say(
            "reference | computed once: %s in %.1fs, kept in %s",
            plural(answers, "answer"),
            time.perf_counter() - started,
            path,
        )
    else:
        say("reference | read from %s (computed once for this reference and data)", path)
    objective.table = table
    if objective.reference is not None and objective.reference.module is not None:
        objective.reference = None  # every answer is in the table: the frozen model is not needed again
        say("reference | the frozen reference model left memory: every answer's log-probability is in the table")


def _read_table(path: Path, key: str) -> ReferenceTable | None:
    """The table at ``path`` when it was computed for ``key``; ``None`` when there is none or another's."""
    if not path.is_file():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, ValueError, EOFError):  # damaged or cut: computed again
        return None
    if not isinstance(state, dict) or state.get("key") != key:
        return None
    return ReferenceTable({str(k): v for k, v in state["values"].items()}, key)
