"""The ``[run]`` section: where and how a run runs (device, precision, parallelism, checkpoints, logging)."""

from __future__ import annotations

from dataclasses import dataclass

from bigbatch.errors import install_hint
from bigbatch.run.configuration.fields import config_field as _opt
from bigbatch.settings.choices import PARALLEL, PRECISION, RESUME, SWITCH
from bigbatch.settings.ranges import (
    NON_NEGATIVE_INT,
    POSITIVE,
    POSITIVE_INT,
    POSITIVE_INT_OR_AUTO,
    POSITIVE_OR_AUTO,
    SEED,
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
