"""The ``[rewards]`` section: learning from rewards (``--objective grpo``): where completions come from (sampled
from ``--prompts`` with ``--reward`` functions, or a ``--rollouts`` file generated elsewhere), how advantages are
taken over each prompt's group, and the loss and its named aggregation (see
:mod:`bigbatch.engine.policy_gradient` and docs/rewards.md)."""

from __future__ import annotations

from dataclasses import dataclass

from bigbatch.run.configuration.fields import config_field
from bigbatch.settings.choices import ADVANTAGE_SCALE, FLAT_GROUPS, LOSS_AGGREGATION, POLICY_LOSS
from bigbatch.settings.ranges import NON_NEGATIVE, NON_NEGATIVE_INT, POSITIVE_INT, POSITIVE_OR_AUTO, Range

CLIP = Range(float, 0, 1, high_open=True)
TOP_P = Range(float, 0, 1, low_open=True)


@dataclass
class RewardsSection:
    prompts: str = config_field(
        "",
        "grpo: a JSONL file of prompts, one per line: 'prompt' (text) or 'messages' (a conversation, rendered with "
        "the chat template and its generation prompt), and any fields the reward functions read (e.g. 'answer')",
    )
    rollouts: str = config_field(
        "",
        "grpo: a JSONL file of completions generated elsewhere, one per line: group, prompt or prompt_ids, "
        "completion or completion_ids, reward or advantage, optionally logps (the generating policy's, per "
        "completion token); trains on them as they are (the offline learner)",
    )
    reward: str = config_field(
        "",
        "grpo with --prompts: the reward functions, comma-separated: MODULE:FUNCTION[=WEIGHT] (a module or a .py "
        "file; called as FUNCTION(row, completion_text) -> float) or builtin:exact-answer / builtin:format",
    )
    group_size: int = config_field(8, "grpo: completions sampled per prompt (G)", range=POSITIVE_INT)
    prompts_per_step: int = config_field(
        8,
        "grpo: prompts (groups of completions) per optimizer step (P); a step trains on P x G completions",
        range=POSITIVE_INT,
    )
    max_completion_tokens: int = config_field(
        64, "grpo: the most tokens a sampled completion has (its stop token included)", range=POSITIVE_INT
    )
    temperature: float = config_field(
        1.0,
        "the sampling temperature, 0 samples greedily (grpo: its completions', and the logits' divisor in every "
        "log-probability, ratio, KL and entropy; with --rollouts, the temperature the file's completions were "
        "sampled at)",
        range=NON_NEGATIVE,
    )
    top_p: float = config_field(1.0, "grpo: nucleus sampling's probability mass (1: off)", range=TOP_P)
    top_k: int = config_field(
        0, "keep the k most likely tokens; 0 disables top-k filtering (grpo: its completions')", range=NON_NEGATIVE_INT
    )
    stop: str = config_field(
        "",
        "grpo: comma-separated texts, each one token, that end a completion (besides the tokenizer's end-of-text "
        "token, which always does)",
    )
    updates_per_rollout: int = config_field(
        1,
        "grpo: optimizer steps per rollout: each rollout samples this many steps' prompts at once, and each step "
        "trains on its own; the old policy of every step is the one that sampled it",
        range=POSITIVE_INT,
    )
    advantage_scale: str = config_field(
        "std",
        "grpo: a completion's advantage is its reward minus its group's mean, divided by the group's standard "
        "deviation (std: GRPO) or not (none: Dr. GRPO)",
        choices=ADVANTAGE_SCALE,
    )
    flat_groups: str = config_field(
        "keep",
        "grpo: groups whose rewards are all equal (advantage 0): keep them in the step (their tokens count in the "
        "denominators), drop them before the step's units are counted, or resample: replace them by groups of "
        "further prompts (DAPO's dynamic sampling; up to 4 rounds, then drop)",
        choices=FLAT_GROUPS,
    )
    loss_aggregation: str = config_field(
        "token-mean",
        "grpo: how per-token losses become the step's loss, each over the whole step: token-mean (all tokens), "
        "group-token-mean (each group's tokens, then groups), seq-mean-token-mean (each completion's tokens, then "
        "completions), seq-mean-token-sum, seq-mean-token-sum-norm (sums over a constant: Dr. GRPO)",
        choices=LOSS_AGGREGATION,
    )
    policy_loss: str = config_field(
        "ppo",
        "grpo: ppo (the clipped ratio times the advantage) or cispo (the clipped importance weight, detached, times "
        "the advantage and the log-probability)",
        choices=POLICY_LOSS,
    )
    clip_low: float = config_field(
        0.2, "grpo ppo: the ratio's lower clip, 1 - clip_low (0: a ratio below 1 is clipped at 1)", range=CLIP
    )
    clip_high: float = config_field(
        0.2,
        "grpo: the ratio's upper clip, 1 + clip_high (DAPO: 0.28; cispo: the weight's; 0: a ratio above 1 is clipped "
        "at 1)",
        range=NON_NEGATIVE,
    )
    kl_coef: float = config_field(
        0.0,
        "grpo: the weight of the per-token KL to the reference (the base with adapters off under --lora-rank, "
        "--reference DIR, or a frozen copy of the starting model); 0: no KL term",
        range=NON_NEGATIVE,
    )
    entropy_coef: float = config_field(
        0.0, "grpo: the weight of the entropy bonus (0: none; the entropy is reported either way)", range=NON_NEGATIVE
    )
    norm_constant: float = config_field(
        0.0,
        "grpo seq-mean-token-sum-norm: the constant C each completion's token sum is divided by; auto: "
        "--max-completion-tokens (--rollouts: the file's longest completion)",
        range=POSITIVE_OR_AUTO,
    )
