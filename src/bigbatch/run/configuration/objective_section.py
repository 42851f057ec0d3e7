"""The ``[objective]`` section: what a run optimises, the next-token loss (``lm``) or a preference objective over
answers (see :mod:`bigbatch.engine.preference`), and its parameters."""

from __future__ import annotations

from dataclasses import dataclass

from bigbatch.run.configuration.fields import config_field
from bigbatch.settings.choices import OBJECTIVE, REFERENCE_LOGPS
from bigbatch.settings.ranges import NON_NEGATIVE, POSITIVE, POSITIVE_OR_AUTO, Range

LABEL_SMOOTHING = Range(float, 0, 0.5, high_open=True)


@dataclass
class ObjectiveSection:
    name: str = config_field(
        "lm",
        "what the run optimises: lm, the next-token loss per trained token (text, or chat SFT on assistant replies); "
        "dpo, ipo, simpo, orpo on preference pairs (prompt/chosen/rejected rows); kto on rows with a label "
        "(prompt/completion/label); grpo on completions sampled and scored by rewards (or a rollouts file). Every term "
        "is normalised by its own units over the whole step",
        flag="objective",
        choices=OBJECTIVE,
    )
    beta: float = config_field(
        0.0,
        "the preference objective's beta (auto: dpo/ipo/kto 0.1, simpo 2.0; orpo: lambda, the odds-ratio term's "
        "weight, 0.1)",
        range=POSITIVE_OR_AUTO,
    )
    label_smoothing: float = config_field(
        0.0, "dpo: the share of pairs taken to be mislabelled (conservative DPO); 0: plain DPO", range=LABEL_SMOOTHING
    )
    robust: bool = config_field(
        False, "dpo with --label-smoothing: the unbiased robust DPO loss instead of the conservative one"
    )
    simpo_gamma: float = config_field(
        1.0,
        "simpo: the target reward margin gamma; 0: no margin (the chosen answer need only outscore)",
        range=NON_NEGATIVE,
    )
    desirable_weight: float = config_field(1.0, "kto: the weight of desirable completions", range=POSITIVE)
    undesirable_weight: float = config_field(1.0, "kto: the weight of undesirable completions", range=POSITIVE)
    reference_logps: str = config_field(
        "step",
        "dpo, ipo, kto: the reference's log-probabilities computed in each step's statistics pass (step), or once for "
        "every answer of the data before the first step and kept in the run directory (once: no reference forward "
        "per step, and a frozen reference model leaves memory after it)",
        choices=REFERENCE_LOGPS,
    )
    reference: str = config_field(
        "",
        "dpo, ipo, kto: a model directory whose log-probabilities are the reference (a frozen second copy in "
        "memory); empty: the base model with the LoRA adapters off under --lora-rank (no second copy), else a "
        "frozen copy of the starting model",
    )
