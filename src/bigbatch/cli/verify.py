"""``bigbatch verify``: prove that the accumulated gradient equals the full-batch gradient."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bigbatch.cli.common import (
    add_config_flag,
    add_device,
    add_k,
    add_micro_batch,
    add_model,
    add_precision,
    add_seed,
    add_seq_len,
    add_vocab_size,
)
from bigbatch.files.atomic import write_json_atomically
from bigbatch.run.configuration.optim_section import OptimSection
from bigbatch.run.configuration.rewards_section import RewardsSection
from bigbatch.run.configuration.train_config import ModelSection, ObjectiveSection, RunSection
from bigbatch.settings.choices import LOSS_AGGREGATION, POLICY_LOSS, Choices
from bigbatch.settings.ranges import (
    AUTO,
    NON_NEGATIVE_INT,
    POSITIVE,
)

HELP = "prove that the accumulated gradient equals the full-batch gradient"
DESCRIPTION = (
    "Compare the full-batch gradient with the gradient accumulated over K micro-batches, show the "
    "classic mistakes next to it, and name modules that break equivalence. Exit 0 when equivalent, 1 when not."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model(parser)
    parser.add_argument("--factory", help="package.module:function returning your model, or (model, batch[, loss_fn])")
    add_k(parser, default=4)
    add_micro_batch(parser, default=2, note="; verify: the check's (every preset holds 2 x 4 x 64)", allow_auto=False)
    add_seq_len(parser, default=64, note="; verify: at most the model's block size", allow_auto=False)
    add_vocab_size(parser)
    add_config_flag(
        parser,
        ModelSection,
        "dropout",
        note="; verify turns it off for the comparison, as dropout draws differ between micro-batch and full batch",
    )
    add_config_flag(
        parser,
        ModelSection,
        "router_balance",
        note="; verify: exact must be EQUIVALENT, running and micro are named as the coupling with their distance",
    )
    add_config_flag(
        parser,
        ModelSection,
        "lora_rank",
        note="; verify: adapters with both matrices drawn, the only gradients compared",
    )
    parser.add_argument(
        "--ragged",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="mask a random-length tail of each sequence so micro-batches hold different valid counts (default: on)",
    )
    parser.add_argument(
        "--packed",
        action="store_true",
        help="rows of random documents packed by the training loader (--pack on): checks that its positions restart "
        "at each document and that its rows give the gradient of the same documents one per row",
    )
    add_config_flag(
        parser,
        ObjectiveSection,
        "name",
        note="; verify: a preference objective checks each of its terms on random pairs (KTO rows), K x "
        "micro-batch of them, split equal, unequal, permuted and empty, packed against unpacked, with a negative "
        "control; grpo checks policy, kl and entropy on K x micro-batch random groups of completions, cut between "
        "a group's completions",
    )
    add_config_flag(parser, ObjectiveSection, "beta")
    _add_reward_flags(parser)
    add_config_flag(
        parser,
        OptimSection,
        "optimizer",
        note="; verify: the update after one step of it is compared (one process; --nproc compares gradients)",
    )
    add_precision(parser, default="fp32")
    parser.add_argument(
        "--splits",
        default="equal,unequal,permuted",
        help="how the batch is cut into micro-batches, comma-separated: equal (K pieces), unequal (sizes 1, 2, 3, "
        "... and the remainder), permuted (K pieces of the shuffled samples) (default: all three)",
    )
    parser.add_argument("--tolerance", type=POSITIVE.argtype(), help="relative L2 tolerance (default: by precision)")
    parser.add_argument(
        "--top",
        type=NON_NEGATIVE_INT.argtype(),
        default=5,
        help="parameters listed, worst first; 0 lists none (default: 5)",
    )
    parser.add_argument("--json", type=Path, help="also write the report as JSON (a new file)")
    parser.add_argument("--overwrite", action="store_true", help="replace the --json file if it exists")
    add_config_flag(parser, RunSection, "nproc", note="; verify: >1 checks DDP against one process across the ranks")
    add_seed(parser, default=0)
    add_device(parser, default="cpu")


def _choice(choices: Choices) -> Callable[[str], str]:
    """An argparse type that refuses a value outside ``choices`` with the config's one line (and its hint)."""

    def parse(value: str) -> str:
        from bigbatch.errors import ConfigError

        try:
            return choices.check(value)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    parse.__name__ = choices.setting  # what argparse names in its message
    return parse


def _add_reward_flags(parser: argparse.ArgumentParser) -> None:
    """``--loss-aggregation`` and ``--policy-loss``: which of ``--objective grpo``'s the check covers."""
    add_config_flag(
        parser,
        RewardsSection,
        "loss_aggregation",
        default=None,
        note="; verify --objective grpo: the one checked (unset: all five)",
        parse=_choice(LOSS_AGGREGATION),
    )
    add_config_flag(
        parser,
        RewardsSection,
        "policy_loss",
        default=None,
        note="; verify --objective grpo: the one checked (unset: both)",
        parse=_choice(POLICY_LOSS),
    )


def run(args: argparse.Namespace) -> int:
    from bigbatch.errors import ConfigError
    from bigbatch.files.outputs import require_new_file
    from bigbatch.parallel.distributed import launched_by_torchrun
    from bigbatch.parallel.launch import relaunch_under_torchrun
    from bigbatch.verify.command import VerifySettings, verify_across_ranks, verify_here

    if args.json:
        require_new_file(args.json, "--json", args.overwrite)
    if not args.factory:
        _check_seq_len(args.model, args.seq_len)  # before torchrun starts, and with the flag that fixes it
    if args.optimizer == "muon" and (args.objective != "lm" or args.nproc > 1):
        raise ConfigError(
            "verify --optimizer muon compares the update of one process on the next-token loss; leave out "
            f"{'--objective' if args.objective != 'lm' else '--nproc'} (the Muon update across ranks is checked by "
            "tests/integration/test_muon_distributed.py and benchmarks/muon_exactness.py)"
        )
    given = [flag for flag in ("loss_aggregation", "policy_loss") if getattr(args, flag) is not None]
    if given and args.objective != "grpo":
        flag = f"--{given[0].replace('_', '-')}"
        raise ConfigError(f"{flag} is a setting of --objective grpo; add --objective grpo or leave {flag} out")
    if args.objective == "grpo":
        return _verify_rollout(args)
    if args.objective != "lm":
        return _verify_objective(args)
    if args.nproc > 1 and not launched_by_torchrun():
        return relaunch_under_torchrun(args.nproc, "verify", args.argv)
    vocab_size = 0 if args.vocab_size == AUTO else args.vocab_size  # 0: the model's
    settings = VerifySettings(
        model=args.model,
        factory=args.factory,
        k=args.k,
        micro_batch=args.micro_batch,
        seq_len=args.seq_len,
        vocab_size=vocab_size,
        dropout=args.dropout,
        ragged=args.ragged,
        packed=args.packed,
        precision=args.precision,
        splits=tuple(name.strip() for name in args.splits.split(",") if name.strip()),
        tolerance=args.tolerance,
        seed=args.seed,
        device=args.device,
        router_balance=args.router_balance,
        lora_rank=args.lora_rank,
        optimizer=args.optimizer,
    )
    if launched_by_torchrun() and int(os.environ["WORLD_SIZE"]) > 1:
        distributed, is_main = verify_across_ranks(settings)
        if is_main:
            print(distributed.format())
            if args.json:
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                write_json_atomically(Path(args.json), distributed.to_dict())
        return 0 if distributed.equivalent else 1
    report = verify_here(settings)
    print(report.format(top=args.top))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)  # checked creatable before verifying
        write_json_atomically(Path(args.json), report.to_dict())
    return 0 if report.equivalent else 1


def _objective_case(args: argparse.Namespace) -> tuple[Any, tuple[str, ...]]:
    """The model an objective's check runs on (dense; LoRA adapters drawn under ``--lora-rank``) and its splits."""
    from bigbatch.errors import ConfigError
    from bigbatch.models.lora import LoraSettings, add_lora
    from bigbatch.models.routing import router_recorder
    from bigbatch.verify.command import build_case
    from bigbatch.verify.objective_terms import SPLITS

    unknown = [name for name in args.splits.split(",") if name.strip() and name.strip() not in (*SPLITS, "")]
    if unknown:
        raise ConfigError(f"--splits {','.join(unknown)}: choose from {', '.join(SPLITS)}")
    splits = tuple(name.strip() for name in args.splits.split(",") if name.strip())
    if args.splits == "equal,unequal,permuted":  # the default: an objective's check also has a micro-batch of none
        splits = SPLITS
    case = build_case(
        args.factory,
        args.model,
        args.vocab_size if args.vocab_size != "auto" else 0,
        0.0,
        args.seed,
        1,
        args.seq_len,
        False,
    )
    if router_recorder(case.model) is not None:
        raise ConfigError(
            f"--objective {args.objective} on a mixture of experts: its router's balancing terms are not part of the "
            f"{'reward objective' if args.objective == 'grpo' else 'preference objectives'} yet (train refuses it "
            "too); verify a dense model"
        )
    if args.lora_rank:
        add_lora(case.model, LoraSettings(rank=args.lora_rank), random_init=True)
    return case.model, splits


def _write_json(args: argparse.Namespace, report: Any) -> None:
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)  # checked creatable before verifying
        write_json_atomically(Path(args.json), report.to_dict())


def _verify_objective(args: argparse.Namespace) -> int:
    """``--objective`` other than lm: each term of the objective (see :mod:`bigbatch.verify.objective_terms`)."""
    from bigbatch.engine.preference import PreferenceObjective, PreferenceSettings
    from bigbatch.parallel.distributed import launched_by_torchrun, resolve_device
    from bigbatch.parallel.launch import relaunch_under_torchrun
    from bigbatch.verify.command import model_vocab_size
    from bigbatch.verify.objective_terms import check_objective_terms, verify_reference

    if args.nproc > 1 and not launched_by_torchrun():
        return relaunch_under_torchrun(args.nproc, "verify", args.argv)
    model, splits = _objective_case(args)
    beta = None if args.beta in (0, "auto") else float(args.beta)
    settings = PreferenceSettings(args.objective, beta=beta)
    if launched_by_torchrun() and int(os.environ["WORLD_SIZE"]) > 1:
        return _verify_objective_across_ranks(args, model, settings)
    report = check_objective_terms(
        model,
        PreferenceObjective(settings, verify_reference(model, settings, args.seed)),
        groups=args.k * args.micro_batch,
        k=args.k,
        seq_len=args.seq_len,
        vocab_size=model_vocab_size(model) or 256,
        seed=args.seed,
        device=resolve_device(args.device),
        precision=args.precision,
        tolerance=args.tolerance,
        splits=splits,
    )
    print(report.format())
    _write_json(args, report)
    return 0 if report.equivalent else 1


def _verify_rollout(args: argparse.Namespace) -> int:
    """``--objective grpo``: each term of the reward objective under each aggregation (see
    :mod:`bigbatch.verify.rollout_terms`); under torchrun, across the ranks against one process."""
    from bigbatch.engine.policy_gradient import LOSS_AGGREGATIONS, POLICY_LOSSES
    from bigbatch.errors import ConfigError
    from bigbatch.parallel.distributed import distributed_session, launched_by_torchrun, resolve_device
    from bigbatch.parallel.launch import relaunch_under_torchrun
    from bigbatch.verify.command import model_vocab_size
    from bigbatch.verify.rollout_terms import check_rollout_across_ranks, check_rollout_terms

    if args.beta not in (0, "auto"):
        raise ConfigError("--beta is a preference objective's; verify --objective grpo checks its KL term at 0.1")
    if args.nproc > 1 and not launched_by_torchrun():
        return relaunch_under_torchrun(args.nproc, "verify", args.argv)
    model, splits = _objective_case(args)
    modes = (args.loss_aggregation,) if args.loss_aggregation else LOSS_AGGREGATIONS
    losses = (args.policy_loss,) if args.policy_loss else POLICY_LOSSES
    vocab = model_vocab_size(model) or 256
    if launched_by_torchrun() and int(os.environ["WORLD_SIZE"]) > 1:
        with distributed_session(args.device) as (dist, device):
            report = check_rollout_across_ranks(
                model,
                dist,
                groups=args.k * args.micro_batch * dist.world_size,
                k=args.k,
                seq_len=args.seq_len,
                vocab_size=vocab,
                modes=modes,
                policy_losses=losses,
                seed=args.seed,
                device=device,
                tolerance=args.tolerance or 1e-5,
            )
            if dist.is_main:
                print(report.format())
                _write_json(args, report)
        return 0 if report.equivalent else 1
    report = check_rollout_terms(
        model,
        groups=args.k * args.micro_batch,
        k=args.k,
        seq_len=args.seq_len,
        vocab_size=vocab,
        modes=modes,
        policy_losses=losses,
        seed=args.seed,
        device=resolve_device(args.device),
        precision=args.precision,
        tolerance=args.tolerance,
        splits=splits,
    )
    print(report.format())
    _write_json(args, report)
    return 0 if report.equivalent else 1


def _verify_objective_across_ranks(args: argparse.Namespace, model: object, settings: object) -> int:
    """Under torchrun: each term's gradient after DDP's one sync, with uneven groups per rank."""
    from bigbatch.engine.preference import PreferenceObjective, PreferenceSettings
    from bigbatch.parallel.distributed import distributed_session
    from bigbatch.verify.command import model_vocab_size
    from bigbatch.verify.objective_terms import check_objective_across_ranks, verify_reference

    assert isinstance(settings, PreferenceSettings)
    with distributed_session(args.device) as (dist, device):
        report = check_objective_across_ranks(
            model,  # type: ignore[arg-type]
            PreferenceObjective(settings, verify_reference(model, settings, args.seed)),  # type: ignore[arg-type]
            dist,
            groups=args.k * args.micro_batch * dist.world_size,
            k=args.k,
            seq_len=args.seq_len,
            vocab_size=model_vocab_size(model) or 256,  # type: ignore[arg-type]
            seed=args.seed,
            device=device,
            tolerance=args.tolerance or 1e-5,
        )
        if dist.is_main:
            print(report.format())
    return 0 if report.equivalent else 1


def _check_seq_len(model: str, seq_len: int) -> None:
    """A preset's (or hf:DIR's) block size holds ``--seq-len``, or a one-line error that says the flag's limit."""
    from bigbatch.errors import ConfigError
    from bigbatch.models import model_preset

    block_size = model_preset(model).block_size
    if seq_len > block_size:
        raise ConfigError(
            f"--seq-len {seq_len} exceeds the {model} block size {block_size:,}; lower --seq-len to at most "
            f"{block_size:,}"
        )
