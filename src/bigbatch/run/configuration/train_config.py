"""Run configuration: dataclasses whose field help becomes the CLI help, their validation and TOML form.

Where a config comes from (defaults < a TOML file < flags) is :mod:`bigbatch.run.configuration.config_sources`.
A TOML file has one table per section::

    [batch]
    total_batch_tokens = 524288
    micro_batch = 16
    seq_len = 1024
"""

from __future__ import annotations

from dataclasses import Field, asdict, dataclass, field, fields, replace
from typing import Any

from bigbatch.errors import ConfigError, install_hint
from bigbatch.models.registry import model_location, model_names_help
from bigbatch.run.configuration.fields import config_field as _opt
from bigbatch.run.configuration.guard_section import GuardSection
from bigbatch.settings.choices import (
    BATCH_CHANGE_BETAS,
    BATCH_CHANGE_RULE,
    BATCH_CHANGE_WEIGHT_DECAY,
    DATA_MODE,
    LAST_WINDOW,
    LONG_DOCUMENTS,
    LOSS_ON,
    NO_ASSISTANT,
    PACK,
    PARALLEL,
    PRECISION,
    RESUME,
    ROUTER_BALANCE,
    SCHEDULE,
    SHUFFLE,
    SWITCH,
    Choices,
)
from bigbatch.settings.ranges import (
    FRACTION,
    NON_NEGATIVE,
    NON_NEGATIVE_INT,
    POSITIVE,
    POSITIVE_INT,
    POSITIVE_INT_OR_AUTO,
    POSITIVE_OR_AUTO,
    PROBABILITY,
    SEED,
    Range,
)
from bigbatch.sizing.ramp import check_ramp_settings

INIT_FROM_AUTO_SEQ_LEN_CAP = 8192
"""seq_len auto with ``--init-from`` is the directory's context length, at most this: Llama 3.2 declares 131,072
positions, and sequences that long rarely fit a training step (``--seq-len`` asks for more)."""


@dataclass
class ModelSection:
    preset: str = _opt(
        "nano",
        f"model preset: {model_names_help()}",
        flag="model",
    )
    block_size: int = _opt(
        0,
        "maximum context length; auto: the preset's",
        range=POSITIVE_INT_OR_AUTO,
        legacy_zero=True,
    )
    dropout: float = _opt(
        0.0,
        "dropout probability of every dropout in the model, an hf: model's config.json ones included (they are "
        "replaced: 0 turns them off); 0 keeps micro-batch and full-batch gradients identical",
        range=PROBABILITY,
    )
    activation_checkpointing: bool = _opt(
        False, "recompute each transformer block in backward (less activation memory, about 1/3 more compute)"
    )
    chunked_loss: bool = _opt(
        True,
        "compute the head and the loss in chunks of rows, never holding the whole (micro_batch, seq_len, vocab) "
        "logits (the same numbers to rounding; an hf: model whose logits are not its head's linear map uses the "
        "whole logits)",
    )
    router_balance: str = _opt(
        "auto",
        "a mixture of experts' load-balancing loss: exact (over the whole step: a routing pass without gradients "
        "counts every micro-batch's tokens per expert first, so the update is the big batch's at any K and world "
        "size), running (counts so far, as Megatron-LM: cheaper, depends on K), micro (each micro-batch's own, as "
        "transformers: depends on K) or off (none; loads still measured); auto: exact (dense models: none)",
        choices=ROUTER_BALANCE,
    )
    router_aux_coef: float = _opt(
        0.0,
        "weight of a mixture of experts' load-balancing loss; auto: the model's (the MoE presets' 0.01, an hf: or "
        "--init-from model's router_aux_loss_coef)",
        range=POSITIVE_OR_AUTO,
    )
    router_z_coef: float = _opt(
        0.0,
        "weight of the router z-loss (mean squared log-sum-exp of the router logits); auto: the model's (0: none)",
        range=POSITIVE_OR_AUTO,
    )
    lora_rank: int = _opt(
        0,
        "train LoRA adapters of this rank (through peft) instead of the model: every base weight frozen, only the "
        "adapters in the optimizer and its state; 0: train the whole model",
        range=NON_NEGATIVE_INT,
    )
    lora_alpha: float = _opt(
        0.0,
        "LoRA scale numerator (the update is alpha / rank x B A); auto: the rank (a scale of 1)",
        range=POSITIVE_OR_AUTO,
    )
    lora_dropout: float = _opt(
        0.0,
        "dropout on the LoRA adapters' inputs; 0 keeps micro-batch and full-batch gradients identical",
        range=PROBABILITY,
    )
    lora_targets: str = _opt(
        "auto",
        "the linear maps that get adapters: auto (every linear map in the model's blocks: attention and MLP "
        "projections, a mixture of experts' router left out) or comma-separated module names, e.g. q_proj,v_proj",
    )
    init_from: str = _opt(
        "",
        "start from a local Hugging Face GPT-2, Llama, Mixtral or Qwen3-MoE directory (config.json + "
        "model.safetensors; its model_type decides); replaces the preset; its tokenizer.json, when present, is what "
        "--tokenizer auto uses",
    )


@dataclass
class DataSection:
    data: str = _opt(
        "builtin",
        "a prepared dataset directory; raw text (file, directory, glob, or 'builtin'); or token shards from "
        "build-nanogpt (.npy) / llm.c (.bin): a directory or glob",
    )
    tokenizer: str = _opt(
        "auto",
        "tokenizer for raw text: byte (no download), gpt2 (tiktoken), bpe:VOCAB (byte-level BPE trained on the "
        "data, e.g. bpe:4096) or file:PATH (a Hugging Face tokenizer.json, or the directory holding one); auto: with "
        "--init-from, that directory's tokenizer.json when it has one, else byte for raw text; the dataset's own for "
        "prepared or token-shard data (another name than the dataset's is an error)",
    )
    val_fraction: float = _opt(
        0.1,
        "share of the token stream held out for validation when preparing raw text; 0 holds none out (then set "
        "--eval-every 0)",
        range=PROBABILITY,
    )
    cache_dir: str = _opt("", "where raw text is prepared (default: $BIGBATCH_CACHE or ~/.cache/bigbatch)")
    data_mode: str = _opt(
        "packed",
        "how raw text is prepared: packed (one token stream) or documents (one padded sequence per document; "
        ".jsonl prompt/completion records mask the prompt)",
        choices=DATA_MODE,
    )
    loss_on: str = _opt(
        "assistant",
        "chat data (.jsonl rows of 'messages', rendered with the model's chat template): train on every assistant "
        "turn's tokens (assistant, end-of-turn token included), only the last turn's (last-assistant) or every "
        "token (all)",
        choices=LOSS_ON,
    )
    no_assistant: str = _opt(
        "refuse",
        "chat data: a conversation with no assistant token to train on is refused in one line (refuse) or left out "
        "and counted (drop)",
        choices=NO_ASSISTANT,
    )
    long_documents: str = _opt(
        "split",
        "documents mode, a document longer than seq_len: split (into seq_len windows, each padded only at its end; "
        "every token is trained on) or truncate (keep its first seq_len+1 tokens, drop the rest)",
        choices=LONG_DOCUMENTS,
    )
    pack: str = _opt(
        "auto",
        "documents mode: on (rows of seq_len filled with whole documents back to back, attention and positions "
        "within each; a long document's windows as --long-documents split makes them), off (one padded document "
        "per row); auto: on for a new run, and what the run started with on resume",
        choices=PACK,
    )
    shuffle: str = _opt(
        "on",
        "training order: on (a seeded permutation of the windows each epoch; packed data: the windows of a step "
        "depend only on the seed, seq_len and tokens per step, not on micro_batch or processes; documents: the "
        "epoch's sequences) or off (the order of the data)",
        choices=SHUFFLE,
        switch=True,
    )


@dataclass
class BatchSection:
    total_batch_tokens: int = _opt(
        16384,
        "tokens per optimizer step = micro_batch x seq_len x K x world_size",
        range=POSITIVE_INT,
    )
    micro_batch: int = _opt(
        16,
        "sequences per micro-batch per device (B); 'auto' picks the largest that fits",
        range=POSITIVE_INT_OR_AUTO,
    )
    memory_budget: float = _opt(
        0.0,
        "MiB a training step may use on CPU, for --micro-batch auto; auto: none given (CUDA probes what fits in the "
        "device's memory; on CPU --micro-batch auto then asks for one)",
        range=POSITIVE_OR_AUTO,
        legacy_zero=True,
    )
    seq_len: int = _opt(
        0,
        "tokens per sequence (T); auto: the model's block size (the preset's, --block-size or --init-from's; "
        f"--init-from's and hf:DIR's at most {INIT_FROM_AUTO_SEQ_LEN_CAP:,})",
        range=POSITIVE_INT_OR_AUTO,
    )
    token_budget: int = _opt(
        0,
        "valid target tokens per step; when set, K varies per step (the micro-batch that reaches the budget is "
        "included whole) and total_batch_tokens is not used; 0 disables it (K fixed by total_batch_tokens)",
        range=NON_NEGATIVE_INT,
    )
    last_window: str = _opt(
        "partial",
        "last incomplete window of a document epoch: partial (train on it, exactly normalized) or drop (skip it)",
        choices=LAST_WINDOW,
    )
    batch_ramp: str = _opt(
        "",
        "batch-size ramp-up START_TOKENS:RAMP_TOKENS (e.g. 32K:10M): tokens per step grow linearly in tokens seen "
        "from START to total_batch_tokens over the first RAMP_TOKENS, in whole micro-batches; auto: grow toward "
        "the measured gradient noise scale; from:RUN: follow the critical batch that bigbatch critical-batch --every "
        "measured along RUN; empty: no ramp",
    )
    max_batch_tokens: int = _opt(
        0,
        "--schedule seesaw: the most tokens per step the doublings reach (K grows; micro-batch memory stays); past "
        "it the learning rate decays as the schedule says; auto: 8 x total_batch_tokens (the three doublings a "
        "cosine decay to min_lr_ratio 0.1 asks for)",
        range=POSITIVE_INT_OR_AUTO,
    )


@dataclass
class OptimSection:
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
    batch_change_weight_decay: str = _opt(
        "keep",
        "at a batch change: keep the weight decay, or timescale (scale it by r / lr factor, keeping "
        "B / (lr x weight decay) fixed)",
        choices=BATCH_CHANGE_WEIGHT_DECAY,
    )


@dataclass
class RunSection:
    max_steps: int = _opt(120, "optimizer steps to train", range=POSITIVE_INT)
    out: str = _opt(
        "",
        "run directory (default: runs/<model>-<hash of the run's settings>, so the same command continues the "
        "same run)",
    )
    name: str = _opt(
        "",
        "a name for the run, which bigbatch report labels it by (default: the run directory's name); not one of the "
        "run's settings (it neither moves the default run directory nor stops a resume); a resume without it keeps "
        "the run's name",
    )
    seed: int = _opt(1337, "random seed, any integer from 0 to 2**63 - 1", range=SEED)
    device: str = _opt("auto", "auto, cpu, cuda or cuda:N")
    precision: str = _opt("auto", "auto (bf16 on CUDA, fp32 on CPU), fp32, bf16 or fp16", choices=PRECISION)
    compile: str = _opt(
        "auto", "torch.compile the model: auto (on for CUDA, off for CPU), on or off", choices=SWITCH, switch=True
    )
    nproc: int = _opt(
        1,
        "processes on this machine: >1 launches torchrun's elastic agent (--standalone) for you",
        range=POSITIVE_INT,
    )
    parallel: str = _opt(
        "auto",
        "auto (ddp when world_size > 1), none, ddp or fsdp (FSDP2 fully_shard per block and root)",
        choices=PARALLEL,
    )
    sync_every_micro_step: bool = _opt(
        False, "reduce gradients after every micro-step instead of once per step (for comparison; costs K rounds)"
    )
    collective_timeout: float = _opt(600.0, "seconds before a hung collective becomes an error", range=POSITIVE)
    peak_flops: float = _opt(
        0.0,
        "peak FLOP/s per device for MFU; auto: looked up by the GPU's name (A100, H100, H200; others: no MFU)",
        range=POSITIVE_OR_AUTO,
        legacy_zero=True,
    )
    tensorboard: bool = _opt(
        False, f"also log to TensorBoard in RUN_DIR/tensorboard (needs {install_hint('tensorboard')})"
    )
    wandb: str = _opt(
        "",
        f"also log to this Weights & Biases project; WANDB_MODE=offline works without network (needs "
        f"{install_hint('wandb')})",
    )
    eval_every: int = _opt(40, "validation loss every N steps (and at the end); 0 disables", range=NON_NEGATIVE_INT)
    eval_batches: int = _opt(
        0,
        "validation micro-batches per process per evaluation, as windows spread uniformly over the validation "
        "split (the same windows every time; the whole split when it holds no more); 'auto': 131,072 tokens' worth, "
        "whatever the micro-batch and processes (a split of at most 131,072 tokens is read whole)",
        range=POSITIVE_INT_OR_AUTO,
    )
    save_every: int = _opt(
        0,
        "checkpoint every N steps; the final step is always saved (0: only the final step)",
        range=NON_NEGATIVE_INT,
    )
    keep_checkpoints: int = _opt(3, "keep the newest N checkpoints; 0 keeps all", range=NON_NEGATIVE_INT)
    async_checkpoint: bool = _opt(
        False,
        "write checkpoints in the background while training goes on (the tensors are first copied to host "
        "memory; the next save waits for the previous one)",
    )
    max_restarts: int = _opt(
        0,
        "with --nproc: restart every worker up to N times when one dies or hangs past --collective-timeout; "
        "the new group resumes from the newest checkpoint by itself; 0: a failed worker ends the run",
        range=NON_NEGATIVE_INT,
    )
    resume: str = _opt(
        "auto",
        "auto: continue from the newest valid checkpoint in --out if there is one; "
        "never: refuse a run directory that holds checkpoints",
        choices=RESUME,
    )
    overwrite: bool = _opt(False, "with --resume never: delete the run directory's checkpoints and logs, start over")
    wait_for_lock: bool = _opt(
        False,
        "when another process is training in the run directory: wait until it ends, then continue its run, instead "
        "of refusing",
    )
    max_consecutive_skips: int = _opt(
        5,
        "abort after this many consecutive steps with a non-finite gradient",
        range=POSITIVE_INT,
    )
    log_every: int = _opt(1, "print a step line every N steps", range=POSITIVE_INT)
    noise_scale_every: int = _opt(
        10,
        "measure the gradient noise scale (critical batch, in tokens) at step 1 and every N steps from the "
        "accumulation's own gradients, without changing training; 0 disables",
        range=NON_NEGATIVE_INT,
    )
    noise_scale_window: int = _opt(
        5,
        "measurements the noise scale is smoothed over: the EMA of |G|^2 and tr(Sigma) decays by 1 - 1/N per "
        "measurement, so it follows a change within about 2N measurements",
        range=POSITIVE_INT,
    )
    sample_tokens: int = _opt(200, "tokens to generate at the end of training; 0 disables", range=NON_NEGATIVE_INT)
    sample_prompt: str = _opt("def ", "prompt for the end-of-training sample")
    extend_schedule: bool = _opt(
        False,
        "on resume: stretch the saved learning-rate schedule to this run's max_steps (or decay_steps) instead of "
        "keeping it",
    )
    allow_data_change: bool = _opt(
        False, "on resume: continue on data whose tokens differ from the checkpoint's (same tokenizer only)"
    )
    allow_ramp_change: bool = _opt(False, "on resume: apply a --batch-ramp other than the run's from the next step")
    allow_batch_change: bool = _opt(
        False,
        "on resume: train at a --total-batch-tokens other than the run's from the next step (the data goes on where "
        "it stood; --batch-change-rule scales the optimizer from the run's first tokens per step)",
    )


SECTIONS: dict[str, type] = {
    "model": ModelSection,
    "data": DataSection,
    "batch": BatchSection,
    "optim": OptimSection,
    "run": RunSection,
    "guard": GuardSection,
}


@dataclass
class TrainConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    batch: BatchSection = field(default_factory=BatchSection)
    optim: OptimSection = field(default_factory=OptimSection)
    run: RunSection = field(default_factory=RunSection)
    guard: GuardSection = field(default_factory=GuardSection)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return asdict(self)

    def to_toml(self) -> str:
        lines: list[str] = []
        for section, values in self.to_dict().items():
            lines.append(f"[{section}]")
            for key, value in values.items():
                if value == 0 and field_of(SECTIONS[section], key).metadata.get("auto"):
                    value = "auto"
                lines.append(f"{key} = {_toml_value(value)}")
            lines.append("")
        return "\n".join(lines)

    def validate(self) -> None:
        """Refuse a value out of its choices or range. The word ``auto`` set from Python on a field that takes it
        is stored as the flag stores it (0, resolved where it is used)."""
        for section, section_cls in SECTIONS.items():
            for f in fields(section_cls):
                value = getattr(getattr(self, section), f.name)
                if f.metadata.get("auto") and value == "auto":
                    value = 0
                    setattr(getattr(self, section), f.name, value)
                allowed: Choices | None = f.metadata.get("choices")
                if allowed is not None:
                    allowed.check(value)
                declared: Range | None = f.metadata.get("range")
                if declared is None or (f.metadata.get("auto") and value == 0):  # 0 is how auto is stored
                    continue
                declared.check(f"--{flag_of(f)} ({section}.{f.name})", value)
        directory = model_directory(self)
        if directory and self.model.block_size:
            flag = f"--init-from {directory}" if self.model.init_from else self.model.preset
            raise ConfigError(
                f"--block-size does not apply to {flag}: its context length is its config.json's "
                "(max_position_embeddings or n_positions); leave --block-size auto, and set --seq-len at most that"
            )
        if self.model.init_from and self.model.preset.startswith("hf:"):
            raise ConfigError(
                f"--init-from and --model {self.model.preset} both name a model directory; give one (--model hf:DIR "
                "loads the directory's weights itself)"
            )
        if self.optim.decay_steps and self.optim.decay_steps < self.optim.warmup_steps:
            raise ConfigError(
                f"decay_steps={self.optim.decay_steps} is below warmup_steps={self.optim.warmup_steps}; "
                "raise decay_steps or set it to auto (= max_steps)"
            )
        check_ramp_settings(self.batch.batch_ramp, self.batch.total_batch_tokens, self.batch.token_budget)
        lora_given = self.model.lora_alpha or self.model.lora_dropout or self.model.lora_targets != "auto"
        if lora_given and not self.model.lora_rank:
            raise ConfigError(
                "--lora-alpha, --lora-dropout and --lora-targets shape LoRA adapters; give --lora-rank R to train them"
            )


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    text = str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t")
    return f'"{text}"'


_SCALAR_TYPES: dict[str, type] = {"int": int, "float": float, "bool": bool, "str": str}


def field_of(section_cls: type, name: str) -> Field[Any]:
    """The field ``name`` of a config section (declared by :func:`_opt`); :func:`flag_of` and :func:`kind_of`
    read it."""
    return next(f for f in fields(section_cls) if f.name == name)


def flag_of(f: Field[Any]) -> str:
    """The field's command-line flag, without the dashes: ``micro-batch``, ``model`` (``preset``'s)."""
    return f.metadata.get("flag", f.name).replace("_", "-")


def kind_of(f: Field[Any]) -> type:
    """The field's scalar type (annotations are strings under ``from __future__ import annotations``)."""
    return _SCALAR_TYPES[f.type if isinstance(f.type, str) else f.type.__name__]


def model_block_size(config: TrainConfig) -> int:
    """The context length of the model ``config`` trains, from the settings alone (no weights are read):
    ``--init-from``'s config.json (GPT-2 ``n_positions``, Llama ``max_position_embeddings``), else
    ``--block-size``, else the preset's."""
    if config.model.init_from:
        from bigbatch.models.pretrained import read_pretrained_config

        return read_pretrained_config(config.model.init_from).block_size
    if config.model.block_size:
        return config.model.block_size
    from bigbatch.models.registry import model_preset

    return model_preset(config.model.preset).block_size


def auto_seq_len(config: TrainConfig) -> int:
    """What seq_len auto resolves to: the model's block size; with ``--init-from`` or ``--model hf:DIR`` at most
    :data:`INIT_FROM_AUTO_SEQ_LEN_CAP` (a preset's or ``--block-size``'s is the user's own choice)."""
    return capped_seq_len(model_block_size(config), bool(model_directory(config)))


def capped_seq_len(block_size: int, from_directory: bool) -> int:
    """seq_len auto of a model of ``block_size``: all of it, or at most :data:`INIT_FROM_AUTO_SEQ_LEN_CAP` when the
    model comes from a directory (whose context may be 131,072)."""
    return min(block_size, INIT_FROM_AUTO_SEQ_LEN_CAP) if from_directory else block_size


def model_auto_seq_len(model_name: str) -> tuple[int, bool]:
    """seq_len auto for ``--model model_name`` alone (``plan``, ``memory``): its block size, at most
    :data:`INIT_FROM_AUTO_SEQ_LEN_CAP` for a model read from a directory as in training; and whether it was capped."""
    from bigbatch.models.registry import model_preset

    block_size = model_preset(model_name).block_size
    seq_len = capped_seq_len(block_size, bool(model_location(model_name)))
    return seq_len, seq_len < block_size


def model_directory(config: TrainConfig) -> str:
    """The directory the model comes from (``--init-from DIR`` or ``--model hf:DIR``), or ``""`` for a preset."""
    return config.model.init_from or model_location(config.model.preset)


def resolve_seq_len(config: TrainConfig) -> TrainConfig:
    """``config`` with ``seq_len`` auto (stored 0) replaced by :func:`auto_seq_len` (a copy), or ``config`` itself
    when ``seq_len`` is set; everything that plans, reads or names a run uses the resolved one."""
    if config.batch.seq_len:
        return config
    return replace(config, batch=replace(config.batch, seq_len=auto_seq_len(config)))
