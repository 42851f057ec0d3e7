"""The trainer: composes config, plan, data, model, engine, metrics and checkpoints."""

from __future__ import annotations

import logging
import random
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bigbatch import __version__
from bigbatch.accumulate import (
    AccumulationEngine,
    StepRecord,
    resolve_precision,
    summed_loss,
)
from bigbatch.autobatch import candidate_micro_batches, choose_micro_batch
from bigbatch.checkpoint import (
    checkpoint_path,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)
from bigbatch.config import TrainConfig
from bigbatch.data.fingerprint import dataset_fingerprints
from bigbatch.batch import StepBatch, StepPolicy, next_step
from bigbatch.data.loader import DocumentLoader, PackedLoader, loader_for
from bigbatch.data.cache import ensure_prepared
from bigbatch.data.dataset import open_dataset
from bigbatch.data.shards import check_requested_tokenizer
from bigbatch.data.tokenizers import get_tokenizer, is_bpe
from bigbatch.distributed import (
    DistContext,
    resolve_device,
    resolve_parallel,
    unwrap,
    wrap_model,
)
from bigbatch.errors import (
    BigBatchError,
    CheckpointError,
    ConfigError,
    DataError,
    TrainingError,
    require_creatable_dir,
)
from bigbatch.faults import fault_from_env, with_fault
from bigbatch.hf import load_hf_gpt2
from bigbatch.metrics import (
    check_optional_loggers,
    device_peak_flops,
    format_step,
    mfu,
    open_metrics,
)
from bigbatch.model import GPT, preset
from bigbatch.optim import CosineSchedule, build_adamw
from bigbatch.outputs import RUN_MARKER, is_legacy_run, mark_own_dir, require_own_dir
from bigbatch.plan import BatchPlan, plan_batch
from bigbatch.progress import ProgressBar
from bigbatch.resume import (
    check_compatible,
    check_settings,
    check_tokenizer,
    data_changed,
    find_resume_checkpoint,
    initial_schedule,
    resumed_schedule,
    truncate_metrics,
)
from bigbatch.rng import capture_rng_state, restore_rng_state, seed_rank_generators
from bigbatch.run_identity import default_run_dir
from bigbatch.sampling import generate
from bigbatch.signals import StopRequest
from bigbatch.tokenizer_files import save_run_tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainResult:
    run_dir: Path
    steps: int
    tokens_seen: int
    final_loss: float
    val_loss: float | None
    tokens_per_s: float  # mean over steps after the first (which includes warm-up)
    sample: str | None
    stopped_by: int = 0  # the signal that stopped the run early, or 0


def seed_everything(seed: int) -> None:
    """The same state on every rank: for building the model (identical parameters on every rank). Training
    itself draws from each rank's own streams (:func:`~bigbatch.rng.seed_rank_generators`)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_model(config: TrainConfig, vocab_size: int) -> GPT:
    """The preset with the data's vocabulary, or the pretrained GPT-2 of ``--init-from``."""
    if config.model.init_from:
        model = load_hf_gpt2(config.model.init_from)
        if model.config.vocab_size != vocab_size:
            raise ConfigError(
                f"--init-from {config.model.init_from} has vocabulary {model.config.vocab_size} but the data's "
                f"tokenizer has {vocab_size}; prepare the data with the matching tokenizer (e.g. --tokenizer gpt2)"
            )
        if config.model.dropout:
            raise ConfigError("dropout with --init-from is not supported; leave --dropout at 0")
        name = f"init from {config.model.init_from}"
    else:
        overrides: dict[str, Any] = {"vocab_size": vocab_size, "dropout": config.model.dropout}
        if config.model.block_size:
            overrides["block_size"] = config.model.block_size
        model = GPT(preset(config.model.preset, **overrides))
        name = f"the {config.model.preset} model"
    if config.batch.seq_len > model.config.block_size:
        raise ConfigError(
            f"seq_len={config.batch.seq_len} exceeds {name}'s block_size={model.config.block_size}; "
            "lower --seq-len or raise --block-size"
        )
    return model


def describe_long_documents(loader: DocumentLoader) -> str:
    """The long-document policy of a documents-mode training split and what it costs, for the run header."""
    total = loader.valid_targets + loader.dropped_targets
    longer = f"{loader.long_document_count:,} of {loader.n_docs:,} documents longer than seq_len+1={loader.seq_len + 1}"
    if loader.long_documents == "split":
        return (
            f"split into seq_len windows ({loader.n_sequences:,} sequences; {longer}) | "
            f"0 of {total:,} target tokens dropped"
        )
    share = loader.dropped_targets / total if total else 0.0
    return (
        f"truncate to seq_len+1 tokens ({longer}) | {loader.dropped_targets:,} of {total:,} target tokens dropped "
        f"({share:.1%}); --long-documents split trains on every one"
    )


class EmptyStepGuard:
    """Bounds the steps skipped in a row because they hold no valid target: a training split with valid
    targets yields one within an epoch, so two epochs of empty steps mean none will come."""

    def __init__(self) -> None:
        self.first_epoch: int | None = None

    def reset(self) -> None:
        self.first_epoch = None

    def skipped(self, loader: PackedLoader | DocumentLoader) -> None:
        if self.first_epoch is None:
            self.first_epoch = loader.epoch
        elif loader.epoch - self.first_epoch >= 2:
            raise DataError(
                "every step of a whole epoch held no valid targets (documents that are a single token or wholly "
                "masked); fix the training data"
            )
def check_micro_batch_fits(loader: Any, micro_batch: int, world_size: int) -> None:
    """Refuse a documents split smaller than one global micro-batch: every micro-batch would hold the whole
    split plus rows of padding, so every step would repeat it K times."""
    n_seq = getattr(loader, "n_sequences", None)  # only a documents loader has a fixed count of sequences
    if n_seq is not None and micro_batch * world_size > n_seq:
        per_process = f" x {world_size} processes" if world_size > 1 else ""
        raise ConfigError(
            f"--micro-batch {micro_batch}{per_process} needs {micro_batch * world_size} sequences per micro-batch, "
            f"but the training split holds only {n_seq} sequence{'s' if n_seq != 1 else ''} (documents after the "
            f"long-document policy); use --micro-batch {max(1, n_seq // world_size)} or less, or more data"
        )


class Trainer:
    """Builds every part from a :class:`TrainConfig`; :meth:`train` runs it to ``max_steps``.

    Under torchrun, pass the :class:`DistContext` and device of
    :func:`~bigbatch.distributed.distributed_session`: every rank builds the same
    parts, reads its own stride of the data and makes the same decisions; only
    rank 0 prints and writes files.
    """

    def __init__(self, config: TrainConfig, dist: DistContext | None = None, device: torch.device | None = None) -> None:
        config.validate()
        self.config = config
        self.tensorboard = bool(getattr(config.run, "tensorboard", False))
        self.wandb_project = str(getattr(config.run, "wandb", "") or "")
        check_optional_loggers(self.tensorboard, self.wandb_project)  # before any work: say which pip install
        self.progress: ProgressBar | None = None  # the terminal's progress bar while train() runs (rank 0, TTY)
        self.dist = dist or DistContext()
        self.device = device or resolve_device(config.run.device, self.dist.local_rank)
        seed_everything(config.run.seed)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True

        out = config.run.out or str(default_run_dir(config))  # the same settings find the same run again
        self.run_dir = Path(self.dist.broadcast_object(out))  # rank 0's choice of a default name
        require_own_dir(self.run_dir, "run directory", "--out", RUN_MARKER, is_legacy_run)
        resume_from = find_resume_checkpoint(self.run_dir, config.run.resume, config.run.overwrite, self.dist.is_main)
        self.dist.barrier()
        if config.data.cache_dir:
            require_creatable_dir(Path(config.data.cache_dir), "cache directory")

        self.dataset = open_dataset(self._prepared_data())
        check_requested_tokenizer(self.dataset.meta, config.data.tokenizer, self.dataset.directory)
        self.fingerprints = dataset_fingerprints(self.dataset)
        tokenizer_name = self.dataset.meta.tokenizer
        # A bpe:VOCAB tokenizer travels inside each checkpoint (it is small), so the model never loses it.
        self._bpe_json: str | None = None
        if is_bpe(tokenizer_name):
            self._bpe_json = get_tokenizer(tokenizer_name, self.dataset.directory).to_str()  # type: ignore[attr-defined]
        self.model = build_model(config, self.dataset.vocab_size).to(self.device)
        self.model.activation_checkpointing = config.model.activation_checkpointing
        self.model_config = self.model.config
        self.dataset.check_token_ids(self.model_config.vocab_size)
        precision = resolve_precision(config.run.precision, self.device)
        batch = config.batch
        world = self.dist.world_size
        micro_batch = batch.micro_batch or self._auto_micro_batch(precision)
        self.token_budget = batch.token_budget
        if self.token_budget:
            self.plan = BatchPlan(micro_batch, batch.seq_len, accumulation_steps=1, world_size=world)
        else:
            self.plan = plan_batch(batch.total_batch_tokens, micro_batch, batch.seq_len, world_size=world)
        self.policy = StepPolicy(
            k=self.plan.accumulation_steps, token_budget=self.token_budget, last_window=batch.last_window
        )
        self.documents = self.dataset.meta.mode == "documents"
        self.k_varies = bool(self.token_budget) or self.documents
        self.tokens_seen = 0  # valid target tokens trained on, all ranks
        self.flops_per_token = self.model.flops_per_token(batch.seq_len)
        self.peak_flops = config.run.peak_flops or (
            device_peak_flops(torch.cuda.get_device_name(self.device)) if self.device.type == "cuda" else None
        )
        self.train_loader = self._build_loader("train", "training")
        check_micro_batch_fits(self.train_loader, self.plan.micro_batch, world)
        self.val_loader = self._build_val_loader()

        self.parallel = resolve_parallel(config.run.parallel, world)
        if config.run.parallel in ("ddp", "fsdp") and world == 1:
            self._say(
                "--parallel %s has no effect in a single process: this run neither shards nor replicates the model "
                "(start several processes with --nproc N or torchrun)", config.run.parallel, level=logging.WARNING,
            )  # fmt: skip
        wrapped, grad_sync = wrap_model(
            self.model, self.parallel, self.dist, self.device, config.run.sync_every_micro_step, precision
        )
        compile_model = config.run.compile == "on" or (config.run.compile == "auto" and self.device.type == "cuda")
        self.train_model: torch.nn.Module = torch.compile(wrapped) if compile_model else wrapped
        opt = config.optim
        self.optimizer = build_adamw(  # after wrapping: FSDP2 replaces parameters with sharded ones
            self.model, lr=opt.lr, weight_decay=opt.weight_decay, betas=(opt.beta1, opt.beta2), eps=opt.eps
        )
        self.schedule: CosineSchedule = initial_schedule(
            opt.lr, opt.min_lr_ratio, opt.warmup_steps, opt.decay_steps, config.run.max_steps
        )  # a resumed run replaces it with the run's own (see _resume)
        self.engine = AccumulationEngine(
            self.train_model,
            self.optimizer,
            self.schedule,
            grad_clip=opt.grad_clip,
            precision=precision,
            device=self.device,
            grad_sync=grad_sync,
            dist=self.dist,
        )
        fault = fault_from_env()
        if fault:
            current = lambda: self.engine.step_count + 1  # noqa: E731
            self.engine.loss_fn = with_fault(self.engine.loss_fn, fault, self.dist.rank, current)
        # Every part is built (the model from the shared seed above; probes leave the generators as they found
        # them): from here on each rank draws its own stream, e.g. its own dropout masks for its own samples.
        seed_rank_generators(config.run.seed, self.dist.rank)
        self.resumed_from: Path | None = None
        self.completed = False  # resumed at (or past) max_steps: nothing left to do
        if opt.warmup_steps > self.schedule.warmup_steps and resume_from is None:
            self._say(
                "warmup_steps %d is longer than the run (%d steps): warming up over all %d", opt.warmup_steps,
                self.schedule.decay_steps, self.schedule.warmup_steps, level=logging.WARNING,
            )  # fmt: skip
        if resume_from is not None:
            self._resume(resume_from)

    def _auto_micro_batch(self, precision: str) -> int:
        """Rank 0 finds the largest micro-batch that fits and keeps tokens per step exact; every rank uses it."""
        batch = self.config.batch
        choice = 0
        if self.dist.is_main:
            if batch.token_budget:
                candidates = [2**i for i in range(11)]
            else:
                candidates = candidate_micro_batches(batch.total_batch_tokens, batch.seq_len, self.dist.world_size)
            choice = choose_micro_batch(
                self.model_config, candidates, batch.seq_len, k=2, device=self.device, precision=precision,
                memory_budget_mib=batch.memory_budget, activation_checkpointing=self.model.activation_checkpointing,
            )  # fmt: skip
            self._say("auto micro-batch: %d (largest that fits among %s)", choice, candidates)
        return int(self.dist.broadcast_object(choice))

    def _resume(self, path: Path) -> None:
        """Restore every stateful part from ``path``; the next step is the one after the checkpoint."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_state_dict,
        )

        document = load_checkpoint(path)
        check_settings(document, self.config, self.run_dir)
        check_compatible(document, self.model_config.to_dict(), self.dataset.meta.tokenizer, self.config.batch)
        check_tokenizer(document.get("fingerprints") or {}, self.fingerprints, self.dataset.meta.tokenizer,
                        f"this run's data {self.dataset.directory}")  # fmt: skip
        changed = data_changed(document, self.fingerprints, self.config.data.data)
        if changed and not self.config.run.allow_data_change:
            raise CheckpointError(
                f"the data of the run in {self.run_dir} changed: {changed}; add --allow-data-change to continue "
                "on the new data, or restore the run's data"
            )
        set_state_dict(
            self.model, self.optimizer, model_state_dict=document["model"], optim_state_dict=document["optimizer"],
            options=StateDictOptions(full_state_dict=True),
        )  # fmt: skip
        self.engine.load_state_dict(document["engine"])
        self.schedule, schedule_note = resumed_schedule(document, self.config, self.engine.step_count)
        self.engine.schedule = self.schedule
        self.engine.load_state_dict(document["engine"])  # again: sets the lr of the next step from the schedule
        self.completed = self.engine.step_count >= self.config.run.max_steps
        try:
            self.train_loader.load_state_dict(document["loader"])
        except DataError:
            if not changed:
                raise
            self._say("the new data has no position matching the checkpoint's: reading it from its start",
                      level=logging.WARNING)  # fmt: skip
        self.tokens_seen = int(document.get("tokens_seen", 0))
        saved_world = int(document.get("world_size", 1))
        rng_states = document.get("rng", [])
        if saved_world == self.dist.world_size and len(rng_states) == saved_world:
            restore_rng_state(rng_states[self.dist.rank])
        else:  # another world size: each rank's stream derived as in a fresh run, at this step (masks then differ)
            seed_rank_generators(self.config.run.seed, self.dist.rank, step=self.engine.step_count)
        if self.dist.is_main:
            truncate_metrics(self.run_dir, self.engine.step_count)
        self.resumed_from = path
        self._say(
            "resumed from %s at step %d (%s tokens)%s", path, self.engine.step_count, f"{self.tokens_seen:,}",
            "" if saved_world == self.dist.world_size else f" | world size {saved_world} -> {self.dist.world_size}",
        )
        if changed:
            self._say("--allow-data-change: the run continues on changed data (%s)", changed, level=logging.WARNING)
        if schedule_note:
            self._say("%s", schedule_note, level=logging.WARNING)

    def _say(self, message: str, *args: Any, level: int = logging.INFO) -> None:
        """Log on rank 0 only."""
        if self.dist.is_main:
            if self.progress is not None:
                self.progress.clear()  # the line goes above the bar; the next update redraws it
            log.log(level, message, *args)

    def _prepared_data(self) -> Path:
        """Rank 0 prepares raw text into the cache while the others wait, then every rank finds it there."""
        data = self.config.data

        def prepare() -> Path:
            return ensure_prepared(
                data.data, data.tokenizer, data.val_fraction, data.cache_dir or None, mode=data.data_mode
            )

        path = prepare() if self.dist.is_main else None
        self.dist.barrier()
        return path if path is not None else prepare()

    def _build_loader(self, split: str, name: str) -> PackedLoader | DocumentLoader:
        B, T = self.plan.micro_batch, self.plan.seq_len
        loader = loader_for(
            self.dataset, split, B, T, self.dist.rank, self.dist.world_size, name=name,
            long_documents=self.config.data.long_documents,
        )  # fmt: skip
        if isinstance(loader, DocumentLoader) and loader.valid_targets == 0:
            raise DataError(
                f"the {name} split of {self.dataset.directory} holds no valid targets: each of its "
                f"{loader.n_docs:,} documents is a single token or wholly masked (e.g. a prompt with an empty "
                "completion), so there is nothing to train on or score; fix the data"
            )
        return loader

    def _build_val_loader(self) -> PackedLoader | DocumentLoader | None:
        if self.config.run.eval_every == 0:
            return None
        if not self.dataset.meta.shards.get("val"):
            raise DataError(
                "the dataset has no validation split; prepare it with --val-fraction > 0 or set --eval-every 0"
            )
        try:
            return self._build_loader("val", "validation")
        except DataError as exc:
            raise DataError(f"{exc}, raise --val-fraction, or set --eval-every 0") from exc

    def _log_header(self) -> None:
        meta = self.dataset.meta
        cfg = self.model_config
        self._say(
            "bigbatch %s | device %s | precision %s | parallel %s | run %s",
            __version__, self.device, self.engine.precision, self.parallel, self.run_dir,
        )
        self._say(
            "data %s | %s tokenizer | train %s tokens | val %s tokens",
            self.dataset.directory, meta.tokenizer, f"{meta.tokens.get('train', 0):,}", f"{meta.tokens.get('val', 0):,}",
        )
        self._say(
            "model %s | %.2fM parameters | %d layers, %d heads, %d wide | vocab %d | block %d",
            self.config.model.init_from or self.config.model.preset, self.model.num_params() / 1e6,
            cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.vocab_size, cfg.block_size,
        )
        self._say("plan | %s", self.describe_plan())
        if isinstance(self.train_loader, DocumentLoader):
            self._say("long documents | %s", describe_long_documents(self.train_loader))

    def describe_plan(self) -> str:
        p = self.plan
        if self.token_budget:
            return (
                f"token budget {self.token_budget:,} valid targets/step | micro_batch {p.micro_batch} x seq_len "
                f"{p.seq_len} x world {p.world_size} per micro-batch | K varies (the micro-batch that reaches the "
                f"budget is included whole) | last window: {self.config.batch.last_window}"
            )
        if self.documents:
            return (
                f"{p.describe()} (positions; one document, or one window of a long one, per sequence, normalized by "
                "the valid targets of each step) "
                f"| last window: {self.config.batch.last_window}"
            )
        return p.describe()

    def next_step(self) -> StepBatch:
        """This rank's micro-batches for the next step and the step's global valid-target count."""
        return next_step(self.train_loader, self.policy, self.dist, self.device)

    @torch.no_grad()
    def evaluate(self, stop: StopRequest | None = None) -> float | None:
        """Mean validation loss over ``eval_batches`` micro-batches per rank from the start of the split; ``None``
        when those micro-batches hold no valid target (no number is made up) or a stop signal cut the pass short."""
        assert self.val_loader is not None
        self.val_loader.reset()
        self.train_model.eval()
        stopped = False

        def should_stop() -> bool:
            nonlocal stopped
            stopped = stopped or bool(stop is not None and self._agreed_stop(stop))
            return stopped

        totals, _ = summed_loss(
            self.train_model, self.val_loader, self.config.run.eval_batches, self.device, self.engine.precision,
            self.engine.loss_fn, should_stop=should_stop if stop is not None else None,
        )  # (loss sum, valid targets)
        self.train_model.train()
        self._reshard()
        self.dist.all_reduce_sum(totals)
        if stopped or totals[1] == 0:
            return None
        return float(totals[0] / totals[1])

    def _reshard(self) -> None:
        """FSDP2 keeps the root's parameters gathered after a forward without backward; free them again."""
        if self.parallel == "fsdp":
            for module in self.model.modules():
                if hasattr(module, "reshard"):
                    module.reshard()

    def _full_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Model and optimizer state as whole tensors keyed by parameter name, whatever the parallelism
        (gathered from shards under FSDP), so that any world size and mode can resume from them."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_state_dict(self.model, self.optimizer, options=options)

    def checkpoint_payload(self) -> dict[str, Any]:
        model_state, optimizer_state = self._full_state()
        return {
            "model": model_state,
            "model_config": self.model_config.to_dict(),
            "optimizer": optimizer_state,
            "engine": self.engine.state_dict(),
            "loader": self.train_loader.state_dict(),
            "config": self.config.to_dict(),
            "tokenizer": self.dataset.meta.tokenizer,
            "fingerprints": dict(self.fingerprints),
            "schedule": {
                "max_lr": self.schedule.max_lr, "min_lr": self.schedule.min_lr,
                "warmup_steps": self.schedule.warmup_steps, "decay_steps": self.schedule.decay_steps,
            },
            **({"tokenizer_json": self._bpe_json} if self._bpe_json else {}),
            "dataset": str(Path(self.dataset.directory).resolve()),  # absolute: eval and sample find it from anywhere
            "step": self.engine.step_count,
            "tokens_seen": self.tokens_seen,
            "world_size": self.dist.world_size,
            "parallel": self.parallel,
            "rng": self.dist.all_gather_object(capture_rng_state()),  # every rank's generators
        }

    def save(self) -> Path:
        """Rank 0 writes one checkpoint that any world size can read (every rank takes part in gathering).

        A failed write (disk full, permissions) leaves the existing checkpoints as they were and raises
        :class:`CheckpointError` on every rank.
        """
        payload = self.checkpoint_payload()
        path = checkpoint_path(self.run_dir, self.engine.step_count)
        error = ""
        if self.dist.is_main:
            started = time.perf_counter()
            try:
                save_checkpoint(payload, path)
            except OSError as exc:
                error = f"could not save checkpoint {path}: {exc.strerror or exc}; earlier checkpoints are intact"
            else:
                self._say(
                    "saved checkpoint %s (%.1f MB, %.2fs)", path, path.stat().st_size / 1e6,
                    time.perf_counter() - started,
                )
                prune_checkpoints(self.run_dir, self.config.run.keep_checkpoints)
        error = self.dist.broadcast_object(error)
        if error:
            raise CheckpointError(error)
        return path

    def sample(self, max_new_tokens: int, prompt: str) -> str:
        """Every rank generates the same text (FSDP needs all ranks in each forward); rank 0 reports it."""
        tokenizer = get_tokenizer(self.dataset.meta.tokenizer, self.dataset.directory)
        ids = tokenizer.encode(prompt.encode("utf-8")) or [0]
        idx = torch.tensor([ids], dtype=torch.long, device=self.device)
        generator = torch.Generator(device=self.device).manual_seed(self.config.run.seed)
        model = self.model if self.parallel == "fsdp" else unwrap(self.model)
        out = generate(model, idx, max_new_tokens, temperature=0.8, top_k=50, generator=generator)  # type: ignore[arg-type]
        return tokenizer.decode(out[0, len(ids) :].tolist())

    def mfu(self, tokens_per_s: float) -> float | None:
        """Model FLOPs utilization of all devices, when their peak is known (GPU table or --peak-flops)."""
        if not self.peak_flops:
            return None
        return mfu(self.flops_per_token, tokens_per_s, self.peak_flops, self.dist.world_size)

    def _agreed_stop(self, stop: StopRequest) -> int:
        """The stop signal if any rank received one (all ranks agree at this step boundary), else 0."""
        if self.dist.world_size == 1:
            return stop.signum
        import torch.distributed as torch_dist

        flags = torch.tensor([stop.signum], dtype=torch.int64, device=self.device)
        torch_dist.all_reduce(flags, op=torch_dist.ReduceOp.MAX)
        return int(flags.item())

    def _stop(self, signum: int, saved: bool) -> None:
        if not saved:
            self.save()
        self._say(
            "stopped by %s after step %d; checkpoint saved in %s; run the same command to resume",
            signal.Signals(signum).name, self.engine.step_count, self.run_dir, level=logging.WARNING,
        )

    def _complete(self) -> TrainResult:
        """A finished run asked to run again: say so and succeed (a requeueing scheduler needs exit 0)."""
        self._say(
            "the run in %s is complete: it reached step %d (max_steps %d); nothing to do (raise --max-steps, "
            "with --extend-schedule to stretch the learning-rate decay, to train on)",
            self.run_dir, self.engine.step_count, self.config.run.max_steps,
        )  # fmt: skip
        return TrainResult(
            run_dir=self.run_dir, steps=self.engine.step_count, tokens_seen=self.tokens_seen,
            final_loss=float("nan"), val_loss=None, tokens_per_s=0.0, sample=None,
        )  # fmt: skip

    def _start_run_dir(self) -> None:
        """Rank 0: the run directory with its config and its own copy of the tokenizer; a fresh start (nothing
        to resume: a first run, or a crash before the first checkpoint) begins a clean metrics log."""
        mark_own_dir(self.run_dir, RUN_MARKER, "run")
        (self.run_dir / "config.toml").write_text(self.config.to_toml())
        if self.resumed_from is None:
            truncate_metrics(self.run_dir, 0)
        if self.dataset.meta.tokenizer != "gpt2":  # gpt2 may need a download: copied with the end-of-run sample
            self._copy_tokenizer()

    def _copy_tokenizer(self) -> None:
        """Rank 0: the run's own copy of its tokenizer in RUN_DIR/tokenizer/ (see bigbatch/tokenizer_files.py)."""
        try:
            tokenizer = get_tokenizer(self.dataset.meta.tokenizer, self.dataset.directory)
            save_run_tokenizer(self.run_dir, tokenizer, self.model_config.block_size)
        except BigBatchError as exc:  # e.g. the GPT-2 encoding cannot be downloaded: training does not need it
            self._say("the tokenizer could not be copied into the run directory: %s", exc, level=logging.WARNING)

    def train(self) -> TrainResult:
        run = self.config.run
        if self.completed:
            return self._complete()
        if self.dist.is_main:
            self._start_run_dir()
        self._log_header()
        metrics = (
            open_metrics(self.run_dir, self.tensorboard, self.wandb_project, self.config.to_dict())
            if self.dist.is_main
            else None
        )
        self.progress = ProgressBar(run.max_steps, enabled=None if self.dist.is_main else False, stream=sys.stderr)
        self.progress.update(self.engine.step_count)
        record: StepRecord | None = None
        val_loss: float | None = None
        rates: list[float] = []
        consecutive_skips = 0
        empty_steps = EmptyStepGuard()
        stopped_by = 0
        stop = StopRequest()
        try:
            stop.__enter__()
            while self.engine.step_count < run.max_steps:
                step = self.next_step()
                micro_batches, n_valid = step.micro_batches, step.n_valid
                if n_valid == 0:
                    self._say("skipping a step whose micro-batches hold no valid targets", level=logging.WARNING)
                    empty_steps.skipped(self.train_loader)
                    stopped_by = self._agreed_stop(stop)
                    if stopped_by:
                        self._stop(stopped_by, saved=False)
                        break
                    continue
                empty_steps.reset()
                if self.device.type == "cuda":
                    micro_batches = [mb.pin_memory() for mb in micro_batches]  # lets the copy overlap compute
                record = self.engine.step(micro_batches, n_valid)
                step_mfu = self.mfu(record.tokens_per_s)
                if metrics:
                    metrics.write_step(record, mfu=step_mfu)
                if record.skipped:
                    self._say(format_step(record, show_k=True), level=logging.WARNING)
                    consecutive_skips += 1
                    if consecutive_skips >= run.max_consecutive_skips:
                        raise TrainingError(
                            f"{consecutive_skips} consecutive steps had a non-finite gradient (loss {record.loss}); "
                            "the run is diverging: lower --lr, check the data, or use bf16 rather than fp16"
                        )
                    stopped_by = self._agreed_stop(stop)
                    if stopped_by:
                        self._stop(stopped_by, saved=False)
                        break
                    continue
                consecutive_skips = 0
                self.tokens_seen += record.tokens
                if record.step > 1:
                    rates.append(record.tokens_per_s)
                if record.step % run.log_every == 0 or record.step == run.max_steps:
                    self._say(format_step(record, show_k=self.k_varies, mfu_value=step_mfu))
                last = record.step == run.max_steps
                if self.val_loader is not None and (record.step % run.eval_every == 0 or last):
                    started = time.perf_counter()
                    step_val_loss = self.evaluate(stop)
                    if step_val_loss is not None:
                        val_loss = step_val_loss
                        if metrics:
                            metrics.write_eval(record.step, val_loss)
                        self._say(
                            "eval step %d | val loss %.4f | %.1fs", record.step, val_loss, time.perf_counter() - started
                        )
                    elif not stop.signum:
                        self._say(
                            "eval step %d | no val loss: the first %d validation micro-batches hold no valid targets; "
                            "raise --eval-batches", record.step, run.eval_batches, level=logging.WARNING,
                        )  # fmt: skip
                saved = last or bool(run.save_every and record.step % run.save_every == 0)
                if saved:
                    self.save()
                self.progress.update(record.step, record.tokens_per_s)
                stopped_by = self._agreed_stop(stop)
                if stopped_by:
                    self._stop(stopped_by, saved)
                    break
        finally:
            stop.__exit__()
            self.progress.close()
            self.progress = None
            if metrics:
                metrics.close()
        if stopped_by:
            return TrainResult(
                run_dir=self.run_dir, steps=self.engine.step_count, tokens_seen=self.tokens_seen,
                final_loss=record.loss if record else float("nan"), val_loss=val_loss,
                tokens_per_s=sum(rates) / len(rates) if rates else 0.0, sample=None, stopped_by=stopped_by,
            )  # fmt: skip
        sample = None
        if run.sample_tokens:
            try:
                sample = self.sample(run.sample_tokens, run.sample_prompt)
                self._say("sample:\n%s", sample)
                if self.dist.is_main and self.dataset.meta.tokenizer == "gpt2":
                    self._copy_tokenizer()  # the sample has loaded the GPT-2 encoding
            except BigBatchError as exc:  # e.g. the GPT-2 encoding cannot be downloaded: the run itself is done
                self._say("no sample: %s", exc, level=logging.WARNING)
        assert record is not None
        mean_rate = sum(rates) / len(rates) if rates else record.tokens_per_s
        mean_mfu = self.mfu(mean_rate)
        self._say(
            "done | %d steps | %s tokens | mean tok/s %s%s | final loss %.4f%s",
            self.engine.step_count, f"{self.tokens_seen:,}", f"{mean_rate:,.0f}",
            f" | mean mfu {mean_mfu:.1%}" if mean_mfu is not None else "",
            record.loss, f" | val loss {val_loss:.4f}" if val_loss is not None else "",
        )
        return TrainResult(
            run_dir=self.run_dir,
            steps=self.engine.step_count,
            tokens_seen=self.tokens_seen,
            final_loss=record.loss,
            val_loss=val_loss,
            tokens_per_s=mean_rate,
            sample=sample,
        )
