"""Every part of a training run, built from a :class:`~bigbatch.run.config.TrainConfig`, in the order data flows:

config -> run directory -> data -> model -> plan and step policy -> loaders -> parallel wrapping -> optimizer,
schedule and engine. :func:`build_run` returns them as one frozen :class:`RunParts`; the trainer runs them
and :class:`~bigbatch.run.state.TrainState` saves and restores their state.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from bigbatch.data.cache import ensure_prepared
from bigbatch.data.dataset import Dataset, open_dataset
from bigbatch.data.fingerprint import dataset_fingerprints, tokenizer_fingerprint
from bigbatch.data.loader import DocumentLoader, PackedLoader, loader_for
from bigbatch.data.shards import check_requested_tokenizer
from bigbatch.data.tokenizers import (
    carries_tokenizer_json,
    check_tokenizer_fits,
    get_tokenizer,
    is_file_tokenizer,
    model_dir_tokenizer,
)
from bigbatch.data.validation import ValidationWindows, validation_windows
from bigbatch.engine.accumulate import AccumulationEngine, resolve_precision
from bigbatch.engine.batch import StepPolicy
from bigbatch.engine.optim import build_adamw
from bigbatch.engine.rng import seed_rank_generators
from bigbatch.errors import ConfigError, DataError, require_creatable_dir
from bigbatch.files.outputs import RUN_MARKER, is_legacy_run, require_own_dir
from bigbatch.models import HFConfig, LanguageModel, ModelConfig, fsdp_units, hf_shape, is_hf_name, model_preset
from bigbatch.models import build_model as build_from_shape
from bigbatch.models.hf_causal import CompiledOrEager, HFCausalLM, build_hf_model, training_notes
from bigbatch.models.pretrained import load_pretrained
from bigbatch.noise.probe import small_grad_probe
from bigbatch.noise.scale import NoiseScale, decay_for_window, unavailable_reason
from bigbatch.observe.metrics import device_peak_flops
from bigbatch.parallel.distributed import DistContext, resolve_parallel, wrap_model
from bigbatch.run.config import TrainConfig, model_directory, resolve_seq_len
from bigbatch.run.faults import fault_from_env, with_fault
from bigbatch.run.identity import default_run_dir
from bigbatch.run.lock import RunDirLock, lock_run_dir
from bigbatch.run.resume import find_resume_checkpoint, initial_schedule
from bigbatch.sizing.autobatch import candidate_micro_batches, choose_micro_batch
from bigbatch.sizing.plan import BatchPlan, plan_batch
from bigbatch.sizing.ramp import BatchRamp, parse_ramp
from bigbatch.verify.inputs import scan_cross_sample_modules

Loader = PackedLoader | DocumentLoader
Say = Callable[..., None]
"""``say(message, *args, level=logging.INFO)``: a log line from rank 0."""


@dataclass(frozen=True)
class RunParts:
    """The built run. ``model`` is the user's module (FSDP2 shards its parameters in place); ``train_model`` is
    what the engine runs (DDP-wrapped and/or compiled)."""

    config: TrainConfig
    dist: DistContext
    device: torch.device
    run_dir: Path
    resume_from: Path | None  # the checkpoint to continue from; None: a fresh start
    dataset: Dataset  # a prepared or foreign token dataset
    fingerprints: dict[str, str]  # of the dataset's tokenizer and tokens
    bpe_json: str | None  # a bpe:VOCAB tokenizer travels inside each checkpoint (it is small)
    model: LanguageModel  # GPT or Llama
    train_model: nn.Module
    parallel: str
    optimizer: torch.optim.Optimizer
    engine: AccumulationEngine  # holds the learning-rate schedule
    plan: BatchPlan
    policy: StepPolicy
    train_loader: Loader
    val_loader: ValidationWindows | None  # the fixed windows every evaluation scores
    peak_flops: float | None  # per device, for MFU; None when unknown
    ramp: BatchRamp | None = None  # --batch-ramp: K per step grows to the plan's (see bigbatch.sizing.ramp)
    run_lock: RunDirLock | None = None  # rank 0's hold on run_dir (see bigbatch.run.lock); released by the trainer
    seq_len_auto: bool = False  # --seq-len was auto: config.batch.seq_len is the model's block size

    @property
    def documents(self) -> bool:
        return bool(self.dataset.meta.mode == "documents")

    @property
    def k_varies(self) -> bool:
        return bool(self.policy.token_budget) or self.documents or self.ramp is not None


def seed_everything(seed: int) -> None:
    """The same state on every rank: for building the model (identical parameters on every rank). Training
    itself draws from each rank's own streams (:func:`~bigbatch.engine.rng.seed_rank_generators`)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_run(config: TrainConfig, dist: DistContext, device: torch.device, say: Say) -> RunParts:
    """Every part of the run, on every rank alike (rank 0 prepares data; the others wait and find it)."""
    config.validate()
    seq_len_auto = not config.batch.seq_len
    config = resolve_seq_len(config)  # from here on (run directory, plan, loaders, saved config) the number
    seed_everything(config.run.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    run_dir, run_lock = _run_dir(config, dist, say)
    try:
        return replace(_build_parts(config, dist, device, say, run_dir, run_lock), seq_len_auto=seq_len_auto)
    except BaseException:  # a run refused or failed while building leaves its directory free
        if run_lock is not None:
            run_lock.release()
        raise


def _build_parts(
    config: TrainConfig, dist: DistContext, device: torch.device, say: Say, run_dir: Path, run_lock: RunDirLock | None
) -> RunParts:
    """Everything after the run directory is chosen and held (see :func:`build_run`)."""
    resume_from = find_resume_checkpoint(run_dir, config.run.resume, config.run.overwrite, dist.is_main)
    dist.barrier()
    if config.data.cache_dir:
        require_creatable_dir(Path(config.data.cache_dir), "cache directory")
    dataset = open_dataset(_prepared_data(config, dist))
    check_requested_tokenizer(dataset.meta, config.data.tokenizer, dataset.directory)
    fingerprints = dataset_fingerprints(dataset)
    _say_tokenizer(config, dataset.meta.tokenizer, fingerprints["tokenizer"], say)
    bpe_json = None
    if carries_tokenizer_json(dataset.meta.tokenizer):  # bpe:VOCAB and a model's own file:PATH travel in checkpoints
        bpe_json = get_tokenizer(dataset.meta.tokenizer, dataset.directory).to_str()  # type: ignore[attr-defined]

    model = build_model(config, dataset.vocab_size, dataset.meta.tokenizer).to(device)
    model.activation_checkpointing = config.model.activation_checkpointing
    check_exactness(model, config.model.preset, say)
    model.chunked_loss = chunked_loss(config, model, say)
    pack = packs_documents(config, dataset, model, say)
    dataset.check_token_ids(model.config.vocab_size)
    precision = resolve_precision(config.run.precision, device)
    plan = _plan(config, model, dist, device, precision, say)
    policy = StepPolicy(plan.accumulation_steps, config.batch.token_budget, config.batch.last_window)
    train_loader = build_loader(
        config, dataset, plan, dist, "train", "training", shuffle=config.data.shuffle == "on", pack=pack
    )
    check_micro_batch_fits(train_loader, plan.micro_batch, dist.world_size)
    if isinstance(train_loader, DocumentLoader):
        train_loader.pack_auto = config.data.pack == "auto"
    val_loader = _val_loader(config, dataset, plan, dist, pack)

    parallel = resolve_parallel(config.run.parallel, dist.world_size)
    ramp = build_ramp(config, plan)
    if config.run.parallel in ("ddp", "fsdp") and dist.world_size == 1:
        say(
            "--parallel %s has no effect in a single process: this run neither shards nor replicates the model "
            "(start several processes with --nproc N or torchrun)",
            config.run.parallel,
            level=logging.WARNING,
        )
    wrapped, grad_sync = wrap_model(
        model, parallel, dist, device, config.run.sync_every_micro_step, precision, units=fsdp_units(model)
    )
    compile_model = config.run.compile == "on" or (config.run.compile == "auto" and device.type == "cuda")
    train_model: nn.Module = wrapped
    if compile_model:  # an hf: model may be of an architecture that does not compile: it then trains eagerly
        compiled = CompiledOrEager(wrapped) if isinstance(model, HFCausalLM) else torch.compile(wrapped)
        train_model = compiled  # type: ignore[assignment]
    opt = config.optim
    optimizer = build_adamw(  # after wrapping: FSDP2 replaces parameters with sharded ones
        model, lr=opt.lr, weight_decay=opt.weight_decay, betas=(opt.beta1, opt.beta2), eps=opt.eps
    )
    schedule = initial_schedule(opt.lr, opt.min_lr_ratio, opt.warmup_steps, opt.decay_steps, config.run.max_steps)
    if opt.warmup_steps > schedule.warmup_steps and resume_from is None:
        say(
            "warmup_steps %d is longer than the run (%d steps): warming up over all %d",
            opt.warmup_steps,
            schedule.decay_steps,
            schedule.warmup_steps,
            level=logging.WARNING,
        )
    noise_scale = _noise_scale(config, plan, say)
    small_grad = (
        None
        if noise_scale is None
        else small_grad_probe(
            wrapped, parallel, config.run.sync_every_micro_step, first_reduced_possible=plan.accumulation_steps == 1
        )
    )
    engine = AccumulationEngine(
        train_model,
        optimizer,
        schedule,
        grad_clip=opt.grad_clip,
        precision=precision,
        device=device,
        grad_sync=grad_sync,
        dist=dist,
        noise_scale=noise_scale,
        small_grad=small_grad,
    )
    fault = fault_from_env()
    if fault:
        engine.loss_fn = with_fault(engine.loss_fn, fault, dist.rank, lambda: engine.step_count + 1)
    # Every part is built (the model from the shared seed above; probes leave the generators as they found
    # them): from here on each rank draws its own stream, e.g. its own dropout masks for its own samples.
    seed_rank_generators(config.run.seed, dist.rank)
    peak_flops = config.run.peak_flops or (
        device_peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    )
    return RunParts(
        config=config,
        dist=dist,
        device=device,
        run_dir=run_dir,
        resume_from=resume_from,
        dataset=dataset,
        fingerprints=fingerprints,
        bpe_json=bpe_json,
        model=model,
        train_model=train_model,
        parallel=parallel,
        optimizer=optimizer,
        engine=engine,
        plan=plan,
        policy=policy,
        train_loader=train_loader,
        val_loader=val_loader,
        peak_flops=peak_flops,
        ramp=ramp,
        run_lock=run_lock,
    )


def chosen_run_dir(config: TrainConfig) -> Path:
    """``--out``, or the default directory of these settings (the same settings find the same run again)."""
    return Path(config.run.out) if config.run.out else default_run_dir(config)


def _run_dir(config: TrainConfig, dist: DistContext, say: Say) -> tuple[Path, RunDirLock | None]:
    """The run directory (rank 0's choice when defaulted), held by rank 0 (or its launcher) from here to the end
    of the run; every rank raises the same one-line error when another process holds it."""
    run_dir = Path(dist.broadcast_object(str(chosen_run_dir(config))))
    run_lock, refusal = None, None
    if dist.is_main:  # alone: the others would see the directory half-made
        try:
            require_own_dir(run_dir, "run directory", "--out", RUN_MARKER, is_legacy_run)
            run_lock = lock_run_dir(run_dir, config.run.wait_for_lock, say)
        except ConfigError as exc:  # not bigbatch's directory, or in use
            refusal = exc
    message = dist.broadcast_object(None if refusal is None else str(refusal))
    if refusal is not None:
        raise refusal
    if message is not None:
        raise ConfigError(message)
    return run_dir, run_lock


def prepare_data(config: TrainConfig) -> Path:
    """The run's prepared dataset: raw text prepared into the cache once, or a dataset directory as it is."""
    data = config.data
    return ensure_prepared(
        data.data, data_tokenizer(config), data.val_fraction, data.cache_dir or None, mode=data.data_mode
    )


def data_tokenizer(config: TrainConfig) -> str:
    """``--tokenizer``; ``auto`` with a model directory that holds a tokenizer.json is that file."""
    directory = model_directory(config)
    if config.data.tokenizer in ("", "auto") and directory:
        return model_dir_tokenizer(directory) or config.data.tokenizer
    return config.data.tokenizer


def _say_tokenizer(config: TrainConfig, used: str, used_fingerprint: str, say: Say) -> None:
    """One line on what ``--tokenizer auto`` chose for a model directory."""
    directory = model_directory(config)
    if not directory or config.data.tokenizer not in ("", "auto"):
        return
    own = model_dir_tokenizer(directory)
    if own is None:
        say(
            "--tokenizer auto: %s has no tokenizer.json; using the data's %s tokenizer, as for a preset",
            directory,
            used,
            level=logging.WARNING,
        )
    elif tokenizer_fingerprint(own) == used_fingerprint:
        say("--tokenizer auto: the model's own tokenizer, %s", own.removeprefix("file:"))
    else:
        say(
            "--tokenizer auto: %s holds %s tokens, not those of %s's tokenizer.json; training on them",
            config.data.data,
            used,
            directory,
            level=logging.WARNING,
        )


def _prepared_data(config: TrainConfig, dist: DistContext) -> Path:
    """Rank 0 prepares raw text into the cache while the others wait, then every rank finds it there."""
    path = prepare_data(config) if dist.is_main else None
    dist.barrier()
    return path if path is not None else prepare_data(config)


def build_model(config: TrainConfig, vocab_size: int, tokenizer: str = "") -> LanguageModel:
    """The preset (GPT or Llama) with the data's vocabulary, or the pretrained GPT-2 or Llama of ``--init-from``."""
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
        check_seq_len(config, model.config.block_size, f"init from {config.model.init_from}")
        return model
    shape = preset_shape(config, vocab_size)
    if isinstance(shape, HFConfig):  # hf:DIR: its weights when the directory has them, else seeded from config.json
        return build_hf_model(shape, weights=True)
    return build_from_shape(shape)


def preset_shape(config: TrainConfig, vocab_size: int) -> ModelConfig:
    """The preset's shape (either family) with the data's vocabulary, ``--block-size`` and dropout; ``seq_len``
    must fit it. ``hf:DIR``: see :func:`hf_run_shape`."""
    if is_hf_name(config.model.preset):
        return hf_run_shape(config, vocab_size)
    overrides: dict[str, Any] = {"vocab_size": vocab_size, "dropout": config.model.dropout}
    if config.model.block_size:
        overrides["block_size"] = config.model.block_size
    shape = model_preset(config.model.preset, **overrides)
    check_seq_len(config, shape.block_size, f"the {config.model.preset} model")
    return shape


def hf_run_shape(config: TrainConfig, vocab_size: int) -> HFConfig:
    """``--model hf:DIR``'s shape, its config.json's: the data's tokens must fit its vocabulary and seq_len its
    context; a model bigbatch cannot train exactly is refused here, before any weight is read."""
    name = config.model.preset
    shape = hf_shape(name)
    if config.model.block_size:
        raise ConfigError(
            f"--block-size does not apply to {name}: its context length is its config.json's ({shape.block_size:,})"
        )
    if config.model.dropout:
        raise ConfigError(f"--dropout does not apply to {name}: its config.json sets its dropout; leave --dropout at 0")
    check_tokenizer_fits(vocab_size, shape.vocab_size, "the data's tokenizer")
    refusal, _ = training_notes(shape)
    if refusal:
        raise ConfigError(refusal)
    check_seq_len(config, shape.block_size, name)
    return shape


def check_exactness(model: LanguageModel, name: str, say: Say) -> None:
    """Refuse a model with a module that mixes the samples of a batch (BatchNorm and kin in training mode): its
    micro-batches cannot add up to the big batch. Say what an ``hf:`` mixture of experts leaves out."""
    coupled = scan_cross_sample_modules(model)
    if coupled:
        first = coupled[0]
        raise ConfigError(
            f"{name} cannot be trained exactly: its module {first.module} ({first.kind}) {first.detail}, so "
            f"micro-batches cannot add up to the big batch (bigbatch verify --model {name} shows it)"
        )
    if isinstance(model.config, HFConfig):
        _, warning = training_notes(model.config)
        if warning:
            say("%s", warning, level=logging.WARNING)


def chunked_loss(config: TrainConfig, model: LanguageModel, say: Say) -> bool:
    """``--chunked-loss`` where the model's head can be taken apart from its trunk (every native model; an ``hf:``
    model whose logits are its head's linear map of the last hidden state), said once where it cannot."""
    if not config.model.chunked_loss:
        return False
    if isinstance(model, HFCausalLM) and not model.head_detachable:
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
    if isinstance(model, HFCausalLM) and not model.packs_documents:
        reason = (
            f"{config.model.preset}: {model.config.architecture} in transformers does not confine attention to each "
            "document from position_ids, so packed documents would attend to one another"
        )
        if config.data.pack == "on":
            raise ConfigError(f"--pack on: {reason}; use --pack off")
        say("%s: one document per row (--pack off)", reason, level=logging.WARNING)
        return False
    return True


def check_seq_len(config: TrainConfig, block_size: int, name: str) -> None:
    if config.batch.seq_len > block_size:
        raise ConfigError(
            f"seq_len={config.batch.seq_len} exceeds {name}'s block_size={block_size}; "
            "lower --seq-len or raise --block-size"
        )


def _plan(
    config: TrainConfig, model: LanguageModel, dist: DistContext, device: torch.device, precision: str, say: Say
) -> BatchPlan:
    """K and the micro-batch (measured with ``--micro-batch auto``); one micro-batch per step's unit with a budget."""
    batch = config.batch
    micro_batch = batch.micro_batch or _auto_micro_batch(config, model, dist, device, precision, say)
    if batch.token_budget:
        return BatchPlan(micro_batch, batch.seq_len, accumulation_steps=1, world_size=dist.world_size)
    return plan_batch(batch.total_batch_tokens, micro_batch, batch.seq_len, world_size=dist.world_size)


def _auto_micro_batch(
    config: TrainConfig, model: LanguageModel, dist: DistContext, device: torch.device, precision: str, say: Say
) -> int:
    """Rank 0 finds the largest micro-batch that fits and keeps tokens per step exact; every rank uses it."""
    batch = config.batch
    choice = 0
    if dist.is_main:
        if batch.token_budget:
            candidates = [2**i for i in range(11)]
        else:
            candidates = candidate_micro_batches(batch.total_batch_tokens, batch.seq_len, dist.world_size)
        choice = choose_micro_batch(
            model.config,
            candidates,
            batch.seq_len,
            k=2,
            device=device,
            precision=precision,
            memory_budget_mib=batch.memory_budget,
            activation_checkpointing=model.activation_checkpointing,
            chunked_loss=model.chunked_loss,
        )
        say("auto micro-batch: %d (largest that fits among %s)", choice, candidates)
    return int(dist.broadcast_object(choice))


def build_loader(
    config: TrainConfig,
    dataset: Dataset,
    plan: BatchPlan,
    dist: DistContext,
    split: str,
    name: str,
    shuffle: bool = False,
    pack: bool = False,
) -> Loader:
    """This rank's reader of ``split`` (in a seeded order per epoch with ``shuffle``; documents packed into rows
    with ``pack``); a documents split without a single valid target is refused."""
    loader = loader_for(
        dataset,
        split,
        plan.micro_batch,
        plan.seq_len,
        dist.rank,
        dist.world_size,
        name=name,
        long_documents=config.data.long_documents,
        shuffle=shuffle,
        seed=config.run.seed,
        pack=pack,
    )
    if isinstance(loader, DocumentLoader) and loader.valid_targets == 0:
        raise DataError(
            f"the {name} split of {dataset.directory} holds no valid targets: each of its "
            f"{loader.n_docs:,} documents is a single token or wholly masked (e.g. a prompt with an empty "
            "completion), so there is nothing to train on or score; fix the data"
        )
    return loader


def _val_loader(
    config: TrainConfig, dataset: Dataset, plan: BatchPlan, dist: DistContext, pack: bool = False
) -> ValidationWindows | None:
    if config.run.eval_every == 0:
        return None
    if not dataset.meta.shards.get("val"):
        raise DataError("the dataset has no validation split; prepare it with --val-fraction > 0 or set --eval-every 0")
    try:
        windows = validation_windows(
            dataset,
            "val",
            plan.micro_batch,
            plan.seq_len,
            config.run.eval_batches,
            dist.rank,
            dist.world_size,
            long_documents=config.data.long_documents,
            pack=pack,
        )
        if isinstance(windows.source, DocumentLoader) and windows.source.valid_targets == 0:
            raise DataError(
                f"the validation split of {dataset.directory} holds no valid targets (every document is a single "
                "token or wholly masked)"
            )
        return windows
    except DataError as exc:
        raise DataError(f"{exc}, raise --val-fraction, or set --eval-every 0") from exc


def check_micro_batch_fits(loader: Any, micro_batch: int, world_size: int) -> None:
    """Refuse a documents split smaller than one global micro-batch: every micro-batch would hold the whole
    split plus rows of padding, so every step would repeat it K times."""
    n_seq = getattr(loader, "n_sequences", None)  # only a documents loader has a fixed count of sequences (rows)
    if n_seq is not None and micro_batch * world_size > n_seq:
        per_process = f" x {world_size} processes" if world_size > 1 else ""
        unit, what = (
            ("row", "documents packed into rows")
            if loader.pack
            else ("sequence", "documents after the long-document policy")
        )
        raise ConfigError(
            f"--micro-batch {micro_batch}{per_process} needs {micro_batch * world_size} {unit}s per micro-batch, "
            f"but the training split holds only {n_seq} {unit}{'s' if n_seq != 1 else ''} ({what}); use "
            f"--micro-batch {max(1, n_seq // world_size)} or less, or more data"
        )


def _noise_unmeasurable(config: TrainConfig, plan: BatchPlan) -> str | None:
    """Why this run's steps can never measure the noise scale, or ``None``."""
    # A token budget sizes every step on its own (the plan's K = 1 is only its unit): the engine decides per step
    # whether that step has a second micro-batch to measure with.
    planned_k = 2 if config.batch.token_budget else plan.accumulation_steps
    return unavailable_reason(planned_k, plan.world_size)


def _noise_scale(config: TrainConfig, plan: BatchPlan, say: Say) -> NoiseScale | None:
    """The engine's noise-scale meter (``--noise-scale-every``), or ``None``: off, or (said once) not measurable."""
    if not config.run.noise_scale_every:
        return None
    reason = _noise_unmeasurable(config, plan)
    if reason:
        say("the gradient noise scale is not measured in this run: %s", reason)
        return None
    return NoiseScale(config.run.noise_scale_every, decay_for_window(config.run.noise_scale_window))


def build_ramp(config: TrainConfig, plan: BatchPlan) -> BatchRamp | None:
    """The ``--batch-ramp`` of this plan, or ``None``; auto needs the noise scale this run measures."""
    spec = parse_ramp(config.batch.batch_ramp)
    if spec is None:
        return None
    if spec.auto:
        if not config.run.noise_scale_every:
            reason: str | None = "--noise-scale-every is 0; set it to N > 0"
        else:
            reason = _noise_unmeasurable(config, plan)
        if reason:
            raise ConfigError(
                f"--batch-ramp auto grows toward the measured gradient noise scale, which this run cannot measure: "
                f"{reason}"
            )
    return BatchRamp(spec, plan)
