"""Every closed set of choices, declared once: config fields, validation, CLI flags and docs use these.

This module imports nothing heavy (no torch), so the command line can build its parser from it.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from bigbatch.errors import ConfigError, did_you_mean


def listed(names: tuple[str, ...] | list[str]) -> str:
    """``a, b or c``."""
    return ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else names[0]


@dataclass(frozen=True)
class Choices:
    """The allowed values of one setting, in the order the help lists them."""

    setting: str  # the name used in messages, e.g. "precision"
    values: tuple[str, ...]
    others: tuple[tuple[str, str], ...] = ()  # values people try that are not offered, and what to use instead

    def check(self, value: object, name: str = "") -> str:
        """``value`` when allowed; else a one-line error naming the setting (``name``: where it was set, e.g.
        ``t.toml: run.compile``), the choices, and the nearest choice or (a value of ``others`` near it) what to
        use instead."""
        if value not in self.values:
            allowed = self.listed() if len(self.values) <= 2 else f"one of {', '.join(self.values)}"
            hint = did_you_mean(value, self.values) if isinstance(value, str) else ""
            if isinstance(value, str) and value.lower() in self.values:  # MUON: the choices are lower case
                hint = f"; did you mean {value.lower()}?"
            if not hint and isinstance(value, str) and self.others:
                instead = dict(self.others)
                near = difflib.get_close_matches(value.lower(), list(instead), n=1)
                hint = f"; {near[0]} is not offered: {instead[near[0]]}" if near else ""
            raise ConfigError(f"{name or self.setting} must be {allowed}, got {value!r}{hint}")
        return str(value)

    def __iter__(self):  # noqa: ANN204 - lets argparse's ``choices=`` and ``in`` use the values directly
        return iter(self.values)

    def __contains__(self, value: object) -> bool:
        return value in self.values

    def listed(self) -> str:
        """``a, b or c``, for help text."""
        return listed(self.values)


RESOLVED_PRECISIONS = ("fp32", "bf16", "fp16")
PRECISION = Choices("precision", ("auto", *RESOLVED_PRECISIONS))
PARALLEL = Choices("parallel", ("auto", "none", "ddp", "fsdp"))
LAST_WINDOW = Choices("last_window", ("partial", "drop"))
RESOLVED_DATA_MODES = ("packed", "documents")
"""What a dataset is prepared as; ``auto`` is resolved to one of them from the data (bigbatch/data/data_mode.py)."""
DATA_MODE = Choices("data_mode", ("auto", *RESOLVED_DATA_MODES))
LONG_DOCUMENTS = Choices("long_documents", ("split", "truncate"))
LONG_CONVERSATIONS = Choices("long_conversations", ("drop-oldest-turns", "drop", "refuse"))
RESUME = Choices("resume", ("auto", "never"))
SWITCH = Choices("compile", ("auto", "on", "off"))
SHUFFLE = Choices("shuffle", ("on", "off"))
PACK = Choices("pack", ("auto", "on", "off"))
BATCH_CHANGE_RULE = Choices("batch_change_rule", ("auto", "none", "sqrt", "linear"))
BATCH_CHANGE_BETAS = Choices("batch_change_betas", ("auto", "none", "beta2", "both"))
BATCH_CHANGE_WEIGHT_DECAY = Choices("batch_change_weight_decay", ("keep", "timescale"))
BATCH_CHANGE_MOMENTUM = Choices("batch_change_momentum", ("auto", "keep", "tokens"))
OPTIMIZER = Choices(
    "optimizer",
    ("adamw", "muon"),
    others=(
        ("sgd", "muon is momentum SGD with orthogonalised updates; adamw with --beta2 near 0 is close to signed SGD"),
        ("adam", "use adamw (--weight-decay 0 is Adam)"),
        ("lion", "use adamw or muon"),
        ("shampoo", "muon orthogonalises each matrix's update, as Shampoo without its accumulators does"),
        ("soap", "use muon or adamw"),
        ("adafactor", "use adamw or muon (one buffer per matrix weight)"),
    ),
)
MUON_COEFFICIENTS = Choices("muon_coefficients", ("quintic", "polar-express"))
MUON_SCALE = Choices("muon_scale", ("rms", "spectral"))
SCHEDULE = Choices("schedule", ("cosine", "seesaw"))
ROUTER_BALANCE = Choices("router_balance", ("auto", "exact", "running", "micro", "off"))
LOSS_ON = Choices("loss_on", ("assistant", "last-assistant", "all"))
NO_ASSISTANT = Choices("no_assistant", ("refuse", "drop"))
BAD_STEP = Choices("bad_step", ("skip-micro", "skip-step", "rewind", "stop"))
BAD_ROWS = Choices("bad_rows", ("refuse", "drop"))
"""What becomes of a malformed row of preference pairs or KTO rows (a missing field, identical chosen and rejected, an
empty answer, a conversation the template refuses): ``refuse`` (one line naming the row; nothing is written) or
``drop`` (left out and counted). Over-long rows follow ``long_conversations`` instead."""
REFERENCE_LOGPS = Choices("reference_logps", ("step", "once"))
OBJECTIVE = Choices(
    "objective",
    ("lm", "dpo", "ipo", "simpo", "orpo", "kto", "grpo"),
    others=(
        ("ppo", "--objective grpo is the clipped PPO loss over groups of completions, without a value model"),
        ("dapo", "--objective grpo --clip-high 0.28 --loss-aggregation token-mean --flat-groups drop"),
        ("dr-grpo", "--objective grpo --advantage-scale none --loss-aggregation seq-mean-token-sum-norm"),
        ("cispo", "--objective grpo --policy-loss cispo"),
        ("rloo", "--objective grpo --advantage-scale none (a group mean baseline)"),
    ),
)
LOSS_AGGREGATION = Choices(
    "loss_aggregation",
    ("token-mean", "group-token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"),
    others=(
        ("bnpo", "token-mean over the whole step (TRL's bnpo averages each micro-batch's tokens)"),
        ("dapo", "token-mean"),
        ("grpo", "seq-mean-token-mean"),
        ("dr_grpo", "seq-mean-token-sum-norm"),
        ("seq-mean", "seq-mean-token-mean or seq-mean-token-sum"),
    ),
)
POLICY_LOSS = Choices("policy_loss", ("ppo", "cispo"))
ADVANTAGE_SCALE = Choices("advantage_scale", ("std", "none"))
FLAT_GROUPS = Choices(
    "flat_groups",
    ("keep", "drop", "resample"),
    others=(("dynamic-sampling", "resample (DAPO's dynamic sampling)"), ("filter", "drop")),
)

LAST_WINDOW_POLICIES = LAST_WINDOW.values

# Open sets, named here so that the command line's help needs neither torch nor the data package:
# tests/integration/test_cli_structure.py checks that they match the tokenizers they describe.
TOKENIZER_NAMES = ("byte", "gpt2", "bpe:VOCAB", "file:PATH")
