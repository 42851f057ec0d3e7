"""Run configuration: dataclasses whose field help becomes the CLI help, their validation and TOML form.

Where a config comes from (defaults < a TOML file < flags) is :mod:`bigbatch.run.configuration.config_sources`;
each section's fields are its own module's (``model_section``, ...); ``--seq-len auto`` is :mod:`.seq_len`'s.
A TOML file has one table per section::

    [batch]
    total_batch_tokens = 524288
    micro_batch = 16
    seq_len = 1024
"""

from __future__ import annotations

from dataclasses import Field, asdict, dataclass, field, fields
from typing import Any

from bigbatch.errors import ConfigError
from bigbatch.run.configuration.batch_section import BatchSection
from bigbatch.run.configuration.data_section import DataSection
from bigbatch.run.configuration.guard_section import GuardSection
from bigbatch.run.configuration.model_section import ModelSection
from bigbatch.run.configuration.objective_section import ObjectiveSection
from bigbatch.run.configuration.optim_section import OptimSection
from bigbatch.run.configuration.rewards_section import RewardsSection
from bigbatch.run.configuration.run_section import RunSection
from bigbatch.run.configuration.seq_len import model_directory
from bigbatch.settings.choices import Choices
from bigbatch.settings.ranges import Range
from bigbatch.sizing.ramp import check_ramp_settings

__all__ = [
    "SECTIONS",
    "BatchSection",
    "DataSection",
    "GuardSection",
    "ModelSection",
    "ObjectiveSection",
    "OptimSection",
    "RewardsSection",
    "RunSection",
    "TrainConfig",
    "field_of",
    "flag_of",
    "kind_of",
]

SECTIONS: dict[str, type] = {
    "model": ModelSection,
    "data": DataSection,
    "batch": BatchSection,
    "optim": OptimSection,
    "run": RunSection,
    "guard": GuardSection,
    "objective": ObjectiveSection,
    "rewards": RewardsSection,
}


@dataclass
class TrainConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    batch: BatchSection = field(default_factory=BatchSection)
    optim: OptimSection = field(default_factory=OptimSection)
    run: RunSection = field(default_factory=RunSection)
    guard: GuardSection = field(default_factory=GuardSection)
    objective: ObjectiveSection = field(default_factory=ObjectiveSection)
    rewards: RewardsSection = field(default_factory=RewardsSection)

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
