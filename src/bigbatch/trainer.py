"""The trainer: composes config, plan, data, model, engine, metrics and checkpoints."""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bigbatch import __version__
from bigbatch.accumulate import AccumulationEngine, StepRecord
from bigbatch.checkpoint import checkpoint_path, list_checkpoints, save_checkpoint
from bigbatch.config import TrainConfig
from bigbatch.accumulate import count_valid_targets
from bigbatch.data.loader import DocumentLoader, PackedLoader
from bigbatch.data.steps import budget_micro_batches, step_micro_batches
from bigbatch.data.prepare import ensure_prepared
from bigbatch.data.shards import TokenDataset
from bigbatch.data.tokenizers import get_tokenizer
from bigbatch.errors import ConfigError, DataError, require_creatable_dir
from bigbatch.metrics import JsonlLog, format_step
from bigbatch.hf import load_hf_gpt2
from bigbatch.model import GPT, preset
from bigbatch.optim import CosineSchedule, build_adamw
from bigbatch.plan import BatchPlan, plan_batch
from bigbatch.sampling import generate

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


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ConfigError(f"unknown device {name!r}; use auto, cpu, cuda or cuda:N") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name} was requested but CUDA is not available here; use --device cpu")
    return device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def default_run_dir() -> Path:
    base = Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")
    candidate, n = base, 1
    while candidate.exists():
        candidate = base.with_name(f"{base.name}-{n}")
        n += 1
    return candidate


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


class Trainer:
    """Builds every part from a :class:`TrainConfig`; :meth:`train` runs it to ``max_steps``."""

    def __init__(self, config: TrainConfig) -> None:
        config.validate()
        self.config = config
        self.device = resolve_device(config.run.device)
        seed_everything(config.run.seed)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True

        self.run_dir = Path(config.run.out) if config.run.out else default_run_dir()
        require_creatable_dir(self.run_dir, "run directory")
        if list_checkpoints(self.run_dir):
            raise ConfigError(
                f"run directory {self.run_dir} already holds checkpoints; choose another --out or remove it"
            )
        if config.data.cache_dir:
            require_creatable_dir(Path(config.data.cache_dir), "cache directory")

        data_dir = ensure_prepared(
            config.data.data,
            config.data.tokenizer,
            config.data.val_fraction,
            config.data.cache_dir or None,
            mode=config.data.data_mode,
        )
        self.dataset = TokenDataset(data_dir)
        batch = config.batch
        self.token_budget = batch.token_budget
        if self.token_budget:
            self.plan = BatchPlan(batch.micro_batch, batch.seq_len, accumulation_steps=1, world_size=1)
        else:
            self.plan = plan_batch(batch.total_batch_tokens, batch.micro_batch, batch.seq_len, world_size=1)
        self.documents = self.dataset.meta.mode == "documents"
        self.k_varies = bool(self.token_budget) or self.documents
        self.tokens_seen = 0  # valid target tokens trained on
        self.model = build_model(config, self.dataset.vocab_size).to(self.device)
        self.model_config = self.model.config
        self.train_loader = self._build_loader("train", "training")
        self.val_loader = self._build_val_loader()

        self.train_model: torch.nn.Module = torch.compile(self.model) if config.run.compile else self.model
        opt = config.optim
        self.optimizer = build_adamw(
            self.model, lr=opt.lr, weight_decay=opt.weight_decay, betas=(opt.beta1, opt.beta2), eps=opt.eps
        )
        decay_steps = opt.decay_steps or config.run.max_steps
        self.schedule = CosineSchedule(
            max_lr=opt.lr,
            min_lr=opt.lr * opt.min_lr_ratio,
            warmup_steps=min(opt.warmup_steps, decay_steps),
            decay_steps=decay_steps,
        )
        self.engine = AccumulationEngine(
            self.train_model,
            self.optimizer,
            self.schedule,
            grad_clip=opt.grad_clip,
            precision=config.run.precision,
            device=self.device,
        )

    def _build_loader(self, split: str, name: str) -> PackedLoader | DocumentLoader:
        B, T = self.plan.micro_batch, self.plan.seq_len
        if self.documents:
            pad = self.dataset.meta.eot_token or 0
            return DocumentLoader(self.dataset.document_shards(split), B, T, pad_token=pad, name=name)
        return PackedLoader(self.dataset.shard_arrays(split), B, T, name=name)

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
        log.info(
            "bigbatch %s | device %s | precision %s | run %s",
            __version__, self.device, self.engine.precision, self.run_dir,
        )
        log.info(
            "data %s | %s tokenizer | train %s tokens | val %s tokens",
            self.dataset.directory, meta.tokenizer, f"{meta.tokens.get('train', 0):,}", f"{meta.tokens.get('val', 0):,}",
        )
        log.info(
            "model %s | %.2fM parameters | %d layers, %d heads, %d wide | vocab %d | block %d",
            self.config.model.init_from or self.config.model.preset, self.model.num_params() / 1e6, cfg.n_layer, cfg.n_head, cfg.n_embd,
            cfg.vocab_size, cfg.block_size,
        )
        log.info("plan | %s", self.describe_plan())

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
                f"{p.describe()} (positions; one document per sequence, normalized by the valid targets of each step) "
                f"| last window: {self.config.batch.last_window}"
            )
        return p.describe()

    def next_step_batches(self) -> list:
        if self.token_budget:
            return budget_micro_batches(self.train_loader, self.token_budget, self.config.batch.last_window)
        return step_micro_batches(self.train_loader, self.plan.accumulation_steps, self.config.batch.last_window)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over ``eval_batches`` micro-batches from the start of the split."""
        assert self.val_loader is not None
        self.val_loader.reset()
        self.train_model.eval()
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        count = 0
        for _ in range(self.config.run.eval_batches):
            batch = self.val_loader.next_micro_batch()
            count += count_valid_targets(batch)
            with self.engine.autocast():
                total += self.engine.loss_fn(self.train_model, batch.to(self.device)).float()
            if self.val_loader.epoch:  # the whole validation split was read
                break
        self.train_model.train()
        return float(total.item()) / max(count, 1)

    def checkpoint_payload(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "model_config": self.model_config.to_dict(),
            "optimizer": self.optimizer.state_dict(),
            "engine": self.engine.state_dict(),
            "loader": self.train_loader.state_dict(),
            "config": self.config.to_dict(),
            "tokenizer": self.dataset.meta.tokenizer,
            "dataset": str(self.dataset.directory),
            "step": self.engine.step_count,
            "tokens_seen": self.tokens_seen,
            "torch_rng_state": torch.get_rng_state(),
        }

    def save(self) -> Path:
        path = save_checkpoint(self.checkpoint_payload(), checkpoint_path(self.run_dir, self.engine.step_count))
        log.info("saved checkpoint %s", path)
        return path

    def sample(self, max_new_tokens: int, prompt: str) -> str:
        tokenizer = get_tokenizer(self.dataset.meta.tokenizer)
        ids = tokenizer.encode(prompt.encode("utf-8")) or [0]
        idx = torch.tensor([ids], dtype=torch.long, device=self.device)
        generator = torch.Generator(device=self.device).manual_seed(self.config.run.seed)
        out = generate(self.model, idx, max_new_tokens, temperature=0.8, top_k=50, generator=generator)
        return tokenizer.decode(out[0, len(ids) :].tolist())

    def train(self) -> TrainResult:
        run = self.config.run
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.toml").write_text(self.config.to_toml())
        self._log_header()
        metrics = JsonlLog(self.run_dir / "metrics.jsonl")
        record: StepRecord | None = None
        val_loss: float | None = None
        rates: list[float] = []
        try:
            while self.engine.step_count < run.max_steps:
                micro_batches = self.next_step_batches()
                if sum(count_valid_targets(mb) for mb in micro_batches) == 0:
                    log.warning("skipping a step whose micro-batches hold no valid targets (all masked or padding)")
                    continue
                if self.device.type == "cuda":
                    micro_batches = [mb.pin_memory() for mb in micro_batches]  # lets the copy overlap compute
                record = self.engine.step(micro_batches)
                metrics.write_step(record)
                if record.skipped:
                    log.warning(format_step(record, show_k=True))
                    continue
                self.tokens_seen += record.tokens
                if record.step > 1:
                    rates.append(record.tokens_per_s)
                if record.step % run.log_every == 0 or record.step == run.max_steps:
                    log.info(format_step(record, show_k=self.k_varies))
                last = record.step == run.max_steps
                if self.val_loader is not None and (record.step % run.eval_every == 0 or last):
                    started = time.perf_counter()
                    val_loss = self.evaluate()
                    metrics.write("eval", step=record.step, val_loss=val_loss)
                    log.info("eval step %d | val loss %.4f | %.1fs", record.step, val_loss, time.perf_counter() - started)
                if last or (run.save_every and record.step % run.save_every == 0):
                    self.save()
        finally:
            metrics.close()
        sample = None
        if run.sample_tokens:
            sample = self.sample(run.sample_tokens, run.sample_prompt)
            log.info("sample:\n%s", sample)
        assert record is not None
        mean_rate = sum(rates) / len(rates) if rates else record.tokens_per_s
        log.info(
            "done | %d steps | %s tokens | mean tok/s %s | final loss %.4f%s",
            self.engine.step_count, f"{self.tokens_seen:,}", f"{mean_rate:,.0f}",
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
