"""The rollout phase of a build (``--objective grpo``): its settings checked before anything is made, its objective,
and its training loader of completions (sampled from ``--prompts`` and scored by ``--reward``, or read from a
``--rollouts`` file), connected to the trained model once it is wrapped.

The run's ``--data`` gives the tokenizer (a ``--init-from`` run's data) and nothing is trained on its text; a step is
``--prompts-per-step`` groups of completions, so ``--total-batch-tokens`` does not size it, and K follows from how
many micro-batches of ``--micro-batch`` x ``--seq-len`` the step's completions fill.
"""

from __future__ import annotations

import logging
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch

from bigbatch.data.dataset import Dataset
from bigbatch.data.rollout_loader import FileRollouts, RolloutLoader
from bigbatch.data.rollouts import describe_groups, read_rollout_file
from bigbatch.data.tokenizers import get_tokenizer
from bigbatch.engine.accumulate import autocast_for, resolve_precision
from bigbatch.engine.policy_gradient import ReferenceScorer, RewardLossSettings, RewardObjective, score_rollout
from bigbatch.errors import ConfigError, DataError
from bigbatch.models import LanguageModel
from bigbatch.models.routing import router_recorder
from bigbatch.parallel.distributed import DistContext, Say, unwrap
from bigbatch.run.configuration.rewards_section import RewardsSection
from bigbatch.run.configuration.train_config import TrainConfig, field_of, flag_of
from bigbatch.sizing.plan import BatchPlan

MIN_TEMPERATURE = 0.01
"""The lowest sampling temperature: logits divided by less overflow float32 (0 itself is greedy, refused)."""

SAMPLER_FIELDS = (
    "reward",
    "group_size",
    "max_completion_tokens",
    "top_p",
    "top_k",
    "stop",
    "updates_per_rollout",
)
"""What only a sampled rollout (``--prompts``) reads."""


def _given(section: RewardsSection, names: tuple[str, ...] | None = None) -> list[str]:
    return [
        f"--{flag_of(f)}"
        for f in fields(RewardsSection)
        if (names is None or f.name in names) and getattr(section, f.name) != f.default
    ]


def check_rewards(config: TrainConfig) -> None:
    """The ``[rewards]`` settings, refused in one line where they mean nothing: without ``--objective grpo``, a
    sampler's flags with ``--rollouts``, neither or both sources, ``--prompts`` without ``--reward``."""
    section, name = config.rewards, config.objective.name
    if name != "grpo":
        given = _given(section)
        if given:
            raise ConfigError(
                f"{', '.join(given)} {'sets' if len(given) == 1 else 'set'} learning from rewards; give --objective "
                "grpo, or drop them"
            )
        return
    if bool(section.prompts) == bool(section.rollouts):
        raise ConfigError(
            "--objective grpo learns from completions: give --prompts FILE (sampled and scored by --reward each "
            "step) or --rollouts FILE (generated elsewhere), one of them"
        )
    if section.rollouts:
        given = _given(section, SAMPLER_FIELDS)
        if given:
            raise ConfigError(
                f"{', '.join(given)} {'shapes' if len(given) == 1 else 'shape'} sampling, and --rollouts trains on "
                "completions generated elsewhere; drop them or give --prompts"
            )
        if section.flat_groups == "resample":
            raise ConfigError(
                "--flat-groups resample samples more prompts, and --rollouts holds completions generated elsewhere; "
                "use keep or drop"
            )
    elif not section.reward:
        raise ConfigError(
            "--prompts needs --reward: the functions that score each completion (MODULE:FUNCTION or "
            "builtin:exact-answer, builtin:format)"
        )
    if section.prompts and section.group_size == 1:
        raise ConfigError(
            "--group-size 1: a completion's advantage is its reward against its group's, so a group of one has none "
            "to learn from; give --group-size 2 or more (8 is usual)"
        )
    if section.prompts and section.top_k == 1:
        raise ConfigError(
            "--top-k 1 samples greedily: every completion of a prompt would be the same, every group flat; give "
            "--top-k 0 (off) or more than 1"
        )
    if 0 < section.temperature < MIN_TEMPERATURE:
        raise ConfigError(
            f"--temperature {section.temperature:g} divides the logits past what float32 holds; give at least "
            f"{MIN_TEMPERATURE:g}"
        )
    if section.prompts and section.temperature == 0:
        raise ConfigError(
            "--temperature 0 samples greedily: every completion of a prompt would be the same, every group flat and "
            "every advantage 0; give a temperature above 0 (1.0 is usual)"
        )
    if section.rollouts and section.temperature == 0:
        raise ConfigError("--temperature 0: the completions' log-probabilities need a temperature above 0")
    if config.model.dropout:
        raise ConfigError(
            "--dropout with --objective grpo: completions are sampled without dropout and scored with it, so the "
            "ratio would measure dropout's noise, not the policy's change; set --dropout 0"
        )
    if section.norm_constant and section.loss_aggregation != "seq-mean-token-sum-norm":
        raise ConfigError("--norm-constant is the constant of --loss-aggregation seq-mean-token-sum-norm; drop it")
    if section.policy_loss == "cispo" and section.clip_low != field_of(RewardsSection, "clip_low").default:
        raise ConfigError("--clip-low: cispo clips its importance weight from above only (--clip-high); drop it")


def reward_loss_settings(config: TrainConfig) -> RewardLossSettings:
    section = config.rewards
    # auto: --max-completion-tokens; a rollouts file's longest completion (0 here: set once the file is read)
    constant = section.norm_constant or (0.0 if section.rollouts else float(section.max_completion_tokens))
    return RewardLossSettings(
        aggregation=section.loss_aggregation,
        policy_loss=section.policy_loss,
        clip_low=section.clip_low,
        clip_high=section.clip_high,
        kl_coef=section.kl_coef,
        entropy_coef=section.entropy_coef,
        norm_constant=constant,
        temperature=section.temperature,
    )


def build_reward_objective(
    config: TrainConfig, model: LanguageModel, dataset: Dataset, device: torch.device, say: Say
) -> RewardObjective:
    """The policy-gradient objective, with its reference when ``--kl-coef`` asks for one (before the model is
    wrapped: a frozen copy is the model as it starts)."""
    from bigbatch.run.build.objective_phase import reference_policy

    if router_recorder(model) is not None:
        raise ConfigError(
            "--objective grpo on a mixture of experts: its router's balancing terms are not part of learning from "
            "rewards yet, and training without them lets the experts collapse; use a dense model"
        )
    reference = None
    if config.rewards.kl_coef > 0:
        policy = reference_policy(config, model, dataset, device)
        reference = ReferenceScorer(policy.module)
        where = f" {config.objective.reference}" if config.objective.reference else ""
        say("reference | %s%s", reference.describe(), where)
    objective = RewardObjective(reward_loss_settings(config), reference)
    for line in objective.describe():
        say("%s", line)
    return objective


def build_rollout_loader(
    config: TrainConfig,
    dataset: Dataset,
    plan: BatchPlan,
    dist: DistContext,
    device: torch.device,
    pack: bool,
    say: Say,
) -> RolloutLoader:
    """This rank's loader of completions: a rollout file's, or a sampler's (its model is set by
    :func:`connect_rollouts`)."""
    section = config.rewards
    tokenizer = get_tokenizer(dataset.meta.tokenizer, dataset.directory)

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text.encode("utf-8")))

    vocab = dataset.vocab_size
    if section.rollouts:
        groups = read_rollout_file(Path(section.rollouts), encode, tokenizer.decode, vocab, plan.seq_len)
        if section.flat_groups == "drop" and all(group.flat_given for group in groups):
            raise DataError(
                f"--rollouts {section.rollouts}: every group is flat (its completions' rewards, or advantages, all "
                "equal), and --flat-groups drop leaves every one out; nothing would train: use --flat-groups keep or "
                "give rewards that differ"
            )
        say("rollouts | %s from %s, %d per step", describe_groups(groups), section.rollouts, section.prompts_per_step)
        source: Any = FileRollouts(groups)
    else:
        source = sampled_rollouts(config, dataset, tokenizer, encode, plan, dist, device, say)
    return RolloutLoader(
        source,
        section.prompts_per_step,
        plan.micro_batch,
        plan.seq_len,
        dist.rank,
        dist.world_size,
        pad_token=int(getattr(tokenizer, "eot_token", None) or 0),
        pack=pack,
        advantage_scale=section.advantage_scale,
        flat_groups=section.flat_groups,
        updates_per_rollout=section.updates_per_rollout,
    )


def stop_tokens(config: TrainConfig, tokenizer: Any, encode: Any) -> tuple[int, ...]:
    """The end-of-text token (when the tokenizer has one) and each ``--stop`` text's one token."""
    stops = [] if getattr(tokenizer, "eot_token", None) is None else [int(tokenizer.eot_token)]
    for text in [t for t in config.rewards.stop.split(",") if t]:
        text = _unescaped(text)  # --stop '\n' is a newline
        ids = encode(text)
        if len(ids) != 1:
            raise ConfigError(f"--stop {text!r} is {len(ids)} tokens under this tokenizer; give texts of one token")
        stops.append(ids[0])
    if not stops:
        raise ConfigError(
            "this tokenizer has no end-of-text token, so a completion would never stop before "
            "--max-completion-tokens; give --stop TEXT (e.g. --stop '\\n')"
        )
    return tuple(dict.fromkeys(stops))


ESCAPES = {"\\n": "\n", "\\t": "\t", "\\r": "\r", "\\\\": "\\"}
"""What ``--stop`` reads as an escape (a shell passes backslash-n as two characters); anything else is itself."""


def _unescaped(text: str) -> str:
    out, i = [], 0
    while i < len(text):
        pair = text[i : i + 2]
        if pair in ESCAPES:
            out.append(ESCAPES[pair])
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def sampled_rollouts(
    config: TrainConfig,
    dataset: Dataset,
    tokenizer: Any,
    encode: Any,
    plan: BatchPlan,
    dist: DistContext,
    device: torch.device,
    say: Say,
) -> Any:
    from bigbatch.rewards.functions import RewardSet
    from bigbatch.rewards.rollout_maker import SampledRollouts, SamplerSettings, read_prompts

    section = config.rewards
    rewards = RewardSet.from_flags([v.strip() for v in section.reward.split(",") if v.strip()])
    render = _renderer(dataset)
    prompts = read_prompts(Path(section.prompts), encode, render, _template_encoder(tokenizer) if render else None)
    settings = SamplerSettings(
        group_size=section.group_size,
        max_tokens=section.max_completion_tokens,
        temperature=section.temperature,
        top_p=section.top_p,
        top_k=section.top_k,
        stop_tokens=stop_tokens(config, tokenizer, encode),
    )
    say(
        "rollouts | %d prompts from %s; %d x %d completions a step (at most %d tokens, temperature %g), %s "
        "per rollout; rewards %s",
        len(prompts),
        section.prompts,
        section.prompts_per_step,
        section.group_size,
        section.max_completion_tokens,
        section.temperature,
        f"{section.updates_per_rollout} steps" if section.updates_per_rollout > 1 else "1 step",
        rewards.describe(),
    )
    return SampledRollouts(
        prompts, rewards, settings, tokenizer, plan.seq_len, config.run.seed, dist, device, section.prompts
    )


def _template_encoder(tokenizer: Any) -> Any:
    """An encoder of a chat template's rendering: the template's control tokens become the special tokens they are
    (the run's own encoder keeps special-token text in a prompt as text), as chat data is prepared."""
    to_str = getattr(tokenizer, "to_str", None)
    if to_str is None:
        return None
    import tokenizers

    rendered = tokenizers.Tokenizer.from_str(to_str())
    rendered.encode_special_tokens = False
    rendered.no_truncation()
    rendered.no_padding()
    return lambda text: list(rendered.encode(text, add_special_tokens=False).ids)


def _renderer(dataset: Dataset) -> Any:
    """A chat template's rendering of a prompt's conversation with its generation prompt, when the tokenizer is a
    model directory's with a template; else ``None``."""
    from bigbatch.data.chat import ChatTemplate, has_chat_template

    name = str(dataset.meta.tokenizer)
    if not name.startswith("file:"):
        return None
    directory = Path(name.removeprefix("file:"))
    directory = directory if directory.is_dir() else directory.parent
    if not has_chat_template(directory):
        return None
    template = ChatTemplate(directory)
    return lambda messages, where: template.render(where, messages, None, generation_prompt=True)


def rollout_pack(config: TrainConfig, model: LanguageModel) -> bool:
    """Completions are packed into rows (``--pack`` auto or on) when the model keeps packed documents apart."""
    if config.data.pack == "off":
        return False
    if not model.packs_documents:
        if config.data.pack == "on":
            raise ConfigError(f"--pack on: {type(model).__name__} cannot keep packed completions apart; use --pack off")
        return False
    return True


def connect_rollouts(
    config: TrainConfig,
    loader: Any,
    objective: Any,
    train_model: torch.nn.Module,
    parallel: str,
    dist: DistContext,
    device: torch.device,
    say: Say,
) -> None:
    """Once the model is wrapped: the sampler samples from it (DDP's module itself; under FSDP2 the sharded model,
    its cached decoding registered as an FSDP forward, every rank stepping until every rank's completions stop), a
    rollout of several steps is scored by it, and the objective's records carry what the rollout knew of each
    step."""
    if not isinstance(loader, RolloutLoader):
        return
    from bigbatch.rewards.rollout_maker import SampledRollouts

    if isinstance(loader.source, SampledRollouts):
        sharded = parallel == "fsdp"
        loader.source.model = train_model if sharded else unwrap(train_model)
        loader.source.sharded = sharded  # every rank must run as many forwards
    precision = resolve_precision(config.run.precision, device)
    temperature = config.rewards.temperature

    def scorer(batches: Any) -> None:
        # the old policy alone: the reference does not move, and each step's statistics pass scores it
        score_rollout(train_model, batches, device, lambda: autocast_for(precision, device), None, temperature)

    loader.scorer = scorer
    loader.gather = dist.all_gather_object if dist.world_size > 1 else None
    if isinstance(objective, RewardObjective):
        objective.rollout_facts = loader.step_facts
        if isinstance(loader.source, FileRollouts) and not config.rewards.norm_constant:
            # a rollouts file has no --max-completion-tokens: C is its longest completion
            longest = max(len(c.tokens) for g in loader.source.groups for c in g.completions)
            objective.settings = replace(objective.settings, norm_constant=float(longest))
            if objective.settings.aggregation == "seq-mean-token-sum-norm":
                say("objective | C = %d, the rollouts file's longest completion (--norm-constant sets it)", longest)


def say_no_validation(config: TrainConfig, say: Say) -> None:
    if config.run.eval_every:
        say(
            "validation | --objective grpo scores no validation split (the rewards of each step are its measure)",
            level=logging.INFO,
        )
