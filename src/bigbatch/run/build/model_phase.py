"""The model phase of a build: the model (a preset, ``--init-from`` weights, or ``hf:DIR``) checked for
exactness, with its loss mode (``--chunked-loss``) and whether it takes documents packed into rows (``--pack``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from bigbatch.data.dataset import Dataset
from bigbatch.data.tokenizers import check_tokenizer_fits, is_file_tokenizer
from bigbatch.errors import ConfigError
from bigbatch.models.coupling import cross_sample_modules
from bigbatch.models.decoder import LanguageModel
from bigbatch.models.family import ModelShape
from bigbatch.models.lora import LoraSettings, add_lora
from bigbatch.models.pretrained import load_pretrained, pretrained_dropout
from bigbatch.models.registry import family_for_model_name, family_of, model_preset
from bigbatch.parallel.distributed import Say
from bigbatch.run.configuration.train_config import TrainConfig


@dataclass(frozen=True)
class RunModel:
    """The model on its device, and whether the run's documents are packed into rows for it."""

    model: LanguageModel
    pack: bool


def build_run_model(config: TrainConfig, dataset: Dataset, device: torch.device, say: Say) -> RunModel:
    """The model for this data, refused when it cannot be trained exactly; its loss mode and packing decided."""
    model = model_from_config(config, dataset.vocab_size, dataset.meta.tokenizer)
    check_router(config, model, say)
    lora = lora_settings(config)
    if lora.enabled:
        say("lora | rank %d, alpha %g | %s", lora.rank, lora.alpha or lora.rank, add_lora(model, lora).describe())
        if lora.dropout:
            say(
                "--lora-dropout %g: micro-batch and full-batch gradients differ (each micro-batch draws its own "
                "masks); --lora-dropout 0 keeps them identical",
                lora.dropout,
                level=logging.WARNING,
            )
    model = model.to(device)
    model.activation_checkpointing = config.model.activation_checkpointing
    check_exactness(model, config.model.preset, say)
    say_dropout(config, model, say)
    model.chunked_loss = chunked_loss(config, model, say)
    pack = packs_documents(config, dataset, model, say)
    dataset.check_token_ids(model.config.vocab_size)
    return RunModel(model, pack)


def lora_settings(config: TrainConfig) -> LoraSettings:
    section = config.model
    return LoraSettings(section.lora_rank, section.lora_alpha, section.lora_dropout, section.lora_targets)


def model_from_config(config: TrainConfig, vocab_size: int, tokenizer: str = "") -> LanguageModel:
    """The preset (any family's) with the data's vocabulary, or the pretrained model of ``--init-from``."""
    if config.model.init_from:
        model = load_pretrained(config.model.init_from)  # its config.json's model_type decides the family
        if is_file_tokenizer(tokenizer):  # a model's own tokenizer may be smaller than its (padded) vocabulary
            what = f"the tokenizer {tokenizer.removeprefix('file:')}"
            check_tokenizer_fits(vocab_size, model.config.vocab_size, what)
        elif model.config.vocab_size != vocab_size:
            hint = " (e.g. --tokenizer gpt2)" if model.config.vocab_size == 50257 else ""
            raise ConfigError(
                f"--init-from {config.model.init_from} has vocabulary {model.config.vocab_size} but the data's "
                f"tokenizer has {vocab_size}; prepare the data with the matching tokenizer{hint}"
            )
        if config.model.dropout:
            raise ConfigError("dropout with --init-from is not supported; leave --dropout at 0")
        check_seq_len(config, model.config.block_size, f"--init-from {config.model.init_from}", from_directory=True)
        return model
    shape = preset_shape(config, vocab_size)
    # hf:DIR: its weights when the directory has them, else seeded from config.json; --dropout replaces its own
    return family_of(shape).model_for_training(shape, config.model.dropout)


def preset_shape(config: TrainConfig, vocab_size: int) -> ModelShape:
    """The preset's shape with the data's vocabulary, ``--block-size`` and dropout; ``seq_len`` must fit it. A
    shape fixed by its directory (``hf:DIR``): see :func:`fixed_run_shape`."""
    if family_for_model_name(config.model.preset).fixed_shape:
        return fixed_run_shape(config, vocab_size)
    overrides: dict[str, Any] = {"vocab_size": vocab_size, "dropout": config.model.dropout}
    if config.model.block_size:
        overrides["block_size"] = config.model.block_size
    shape = model_preset(config.model.preset, **overrides)
    check_seq_len(config, shape.block_size, f"the {config.model.preset} model")
    return shape


def fixed_run_shape(config: TrainConfig, vocab_size: int) -> ModelShape:
    """The shape of a ``--model`` whose directory decides it (``hf:DIR``'s config.json): the data's tokens must fit
    its vocabulary and seq_len its context; a model bigbatch cannot train exactly is refused here, before any
    weight is read."""
    name = config.model.preset
    shape = model_preset(name)
    check_tokenizer_fits(vocab_size, shape.vocab_size, "the data's tokenizer")
    refusal, _ = family_of(shape).training_notes(shape)
    if refusal:
        raise ConfigError(refusal)
    check_seq_len(config, shape.block_size, name, from_directory=True)
    return shape


def check_router(config: TrainConfig, model: LanguageModel, say: Say) -> None:
    """An ``hf:`` mixture of experts whose balancing loss bigbatch cannot accumulate over the step (its router probe
    found no definition equal to the model's own ``aux_loss``) is refused in one line, unless ``--router-balance
    off`` asks to train it with none; a routing bias outside the gradient is said to be held as loaded."""
    name = config.model.preset
    refusal = getattr(model, "router_refusal", "")
    if refusal and config.model.router_balance != "off":
        raise ConfigError(refusal)
    if refusal:
        say("%s: trained with no load-balancing loss (--router-balance off), as transformers trains it", name)
    probe = getattr(model, "router_probe", None)
    if probe is not None and probe.bias:
        say(
            "%s: its per-expert routing bias %s is held as loaded: bigbatch does not update it (nor does transformers)",
            name,
            probe.bias,
            level=logging.WARNING,
        )


def check_exactness(model: LanguageModel, name: str, say: Say) -> None:
    """Refuse a model with a module that mixes the samples of a batch (BatchNorm and kin in training mode): its
    micro-batches cannot add up to the big batch. Say what training leaves out (an ``hf:`` mixture of experts'
    balancing loss)."""
    coupled = cross_sample_modules(model)
    if coupled:
        first = coupled[0]
        raise ConfigError(
            f"{name} cannot be trained exactly: its module {first.module} ({first.kind}) {first.detail}, so "
            f"micro-batches cannot add up to the big batch (bigbatch verify --model {name} shows it)"
        )
    _, warning = family_of(model).training_notes(model.config)
    if warning:
        say("%s", warning, level=logging.WARNING)


def say_dropout(config: TrainConfig, model: LanguageModel, say: Say) -> None:
    """Say, before the first step, that dropout makes micro-batch and full-batch gradients differ, and what
    ``--dropout`` did to an ``hf:`` model's own (its config.json's dropout is replaced: 0 by default)."""
    own_dropout = family_of(model).dropout_note
    if own_dropout is not None:  # a model with dropout of its own (hf:DIR's config.json)
        note = own_dropout(model.config, config.model.dropout)
        if note:
            say("%s", note, level=logging.WARNING)
    elif config.model.init_from:  # bigbatch's own families: no dropout, whatever config.json says
        own = pretrained_dropout(config.model.init_from)
        listed = ", ".join(f"{key} {value:g}" for key, value in sorted(own.items()) if value)
        if listed:
            say(
                "--init-from %s: its config.json sets dropout (%s); trained without it, so micro-batch and "
                "full-batch gradients are identical",
                config.model.init_from,
                listed,
            )
    elif config.model.dropout:
        say(
            "dropout %g (--dropout): micro-batch and full-batch gradients differ (each micro-batch draws its own "
            "masks); --dropout 0 keeps them identical",
            config.model.dropout,
        )


def chunked_loss(config: TrainConfig, model: LanguageModel, say: Say) -> bool:
    """``--chunked-loss`` where the model's head can be taken apart from its trunk (every native model; an ``hf:``
    model whose logits are its head's linear map of the last hidden state), said once where it cannot."""
    if not config.model.chunked_loss:
        return False
    if not model.head_detachable:
        say(
            "%s: its logits are not its output head's linear map of the last hidden state (e.g. a soft cap or a "
            "scale after the head), so the loss is computed from the whole logits (--chunked-loss has no effect)",
            config.model.preset,
            level=logging.WARNING,
        )
        return False
    return True


def packs_documents(config: TrainConfig, dataset: Dataset, model: LanguageModel, say: Say) -> bool:
    """Whether documents are packed into rows (``--pack``; auto: on); never for a packed token stream. An ``hf:``
    model whose attention ignores ``position_ids`` cannot keep packed documents apart: refused with ``on``, said
    and left unpacked with ``auto``."""
    if dataset.meta.mode != "documents" or config.data.pack == "off":
        return False
    if not model.packs_documents:
        architecture = family_of(model).hf_class_name(model.config)
        reason = (
            f"{config.model.preset}: {architecture} in transformers does not confine attention to each "
            "document from position_ids, so packed documents would attend to one another"
        )
        if config.data.pack == "on":
            raise ConfigError(f"--pack on: {reason}; use --pack off")
        say("%s: one document per row (--pack off)", reason, level=logging.WARNING)
        return False
    return True


def check_seq_len(config: TrainConfig, block_size: int, name: str, from_directory: bool = False) -> None:
    """Refuse a seq_len longer than the model's context, with the fix that applies to it: a preset's context is
    ``--block-size``'s to raise; a model directory's is its config.json's, so only ``--seq-len`` can give."""
    if config.batch.seq_len <= block_size:
        return
    if from_directory:
        raise ConfigError(
            f"seq_len={config.batch.seq_len} exceeds {name}'s context length {block_size:,} (its config.json's "
            f"max_position_embeddings or n_positions, which --block-size cannot change); lower --seq-len to at most "
            f"{block_size:,}, or leave it auto"
        )
    raise ConfigError(
        f"seq_len={config.batch.seq_len} exceeds {name}'s block_size={block_size}; "
        f"lower --seq-len or raise --block-size to at least {config.batch.seq_len}"
    )
