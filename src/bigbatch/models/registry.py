"""The model families bigbatch knows, and the lookups the rest of bigbatch makes through them: which family a
``--model`` name, a shape, a model, a checkpoint or a Hugging Face directory's ``model_type`` belongs to.

Registering a family is one line in :data:`FAMILY_MODULES` (see ``docs/models.md``, "Adding a family"). No torch here:
the command line's parser lists the presets.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from bigbatch.errors import ConfigError
from bigbatch.models.family import ModelFamily, ModelShape

if TYPE_CHECKING:
    from bigbatch.models.decoder import DecoderLM

FAMILY_MODULES = (
    "bigbatch.models.gpt.family",
    "bigbatch.models.llama.family",
    "bigbatch.models.moe.family",
    "bigbatch.models.hf.family",
)
"""The module of each family's :class:`ModelFamily` (its ``FAMILY``), in the order help and listings name them; a
checkpoint without ``model_family`` is the first's. Registering a family is one line here."""

FAMILIES: tuple[ModelFamily, ...] = tuple(importlib.import_module(name).FAMILY for name in FAMILY_MODULES)


def family_names() -> tuple[str, ...]:
    return tuple(family.name for family in FAMILIES)


def preset_names() -> tuple[str, ...]:
    """Every preset of every family, in registry order (``hf:DIR`` and other locations are not presets)."""
    return tuple(name for family in FAMILIES for name in family.presets)


def location_families() -> tuple[ModelFamily, ...]:
    """The families whose models are named by a location (``hf:DIR``) rather than by preset."""
    return tuple(family for family in FAMILIES if family.name_prefix)


def model_names_help() -> str:
    """The ``--model`` values, for help text: the presets, then each location a family takes."""
    locations = [f"; or {family.name_prefix}DIR, {family.location_help}" for family in location_families()]
    return ", ".join(preset_names()) + "".join(locations)


def model_location(model_name: str) -> str:
    """Where a ``--model`` value's shape is read from (``DIR`` of ``hf:DIR``), or ``""`` for a preset."""
    for family in location_families():
        if model_name.startswith(family.name_prefix):
            return model_name[len(family.name_prefix) :]
    return ""


def family_named(name: str) -> ModelFamily:
    """The family a checkpoint records as ``model_family``."""
    for family in FAMILIES:
        if family.name == name:
            return family
    raise ConfigError(f"unknown model family {name!r}; this bigbatch knows {', '.join(family_names())}")


def family_for_model_name(model_name: str) -> ModelFamily:
    """The family of a ``--model`` value (a preset or a location such as ``hf:DIR``)."""
    for family in FAMILIES:
        if family.claims(model_name):
            return family
    known = ", ".join([*preset_names(), *(f"{family.name_prefix}DIR" for family in location_families())])
    raise ConfigError(f"unknown model preset {model_name!r}; choose one of: {known}")


def family_of(model_or_shape: Any) -> ModelFamily:
    """The family of a model (anything with a ``config``) or of its shape."""
    shape = getattr(model_or_shape, "config", model_or_shape)
    for family in FAMILIES:
        if isinstance(shape, family.config_type):
            return family
    raise ConfigError(f"{type(shape).__name__} is the shape of no registered model family")


def family_for_hf_model_type(model_type: str) -> ModelFamily | None:
    """The family ``--init-from`` reads a Hugging Face directory of ``model_type`` into, if any."""
    for family in FAMILIES:
        if model_type in family.hf_model_types:
            return family
    return None


def hf_model_types() -> tuple[str, ...]:
    return tuple(model_type for family in FAMILIES for model_type in family.hf_model_types)


def model_preset(model_name: str, **overrides: Any) -> ModelShape:
    """The shape ``model_name`` names (``nano``, ``llama-nano``, ..., ``hf:DIR``), optionally with fields replaced."""
    return family_for_model_name(model_name).shape(model_name, **overrides)


def build_model(shape: ModelShape) -> DecoderLM:
    """The model of ``shape``'s family, freshly initialised (an ``hf:`` one from its config.json, without reading
    its weights)."""
    return family_of(shape).build(shape)


def model_config_from_dict(family_name: str, values: dict[str, Any]) -> ModelShape:
    """The shape stored as ``config.to_dict()`` beside ``family_name`` (a checkpoint's ``model_config``)."""
    return family_named(family_name).config_from_dict(values)
