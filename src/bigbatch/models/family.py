"""What the rest of bigbatch asks of a model family, in one record: :class:`ModelFamily`.

Each family folder (``gpt/``, ``llama/``, ``hf/``) has the same files: ``config.py`` (its shape and presets, no
torch), ``model.py`` (the module, a :class:`~bigbatch.models.decoder.DecoderLM`), ``hf.py`` where it reads and
writes a Hugging Face layout of its own, and ``family.py`` (its :class:`ModelFamily`). :mod:`.registry` lists the
families; nothing outside ``models/`` names a family's classes or checks which family a model is.

A family record imports its config at the top and its model and weights code inside the functions that need them:
the registry is read by the command line's parser, which starts without torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from bigbatch.errors import ConfigError

if TYPE_CHECKING:
    import torch.nn as nn

    from bigbatch.models.decoder import DecoderLM


class ModelShape(Protocol):
    """The numbers every family's config gives (as fields or properties) and the rest of bigbatch reads."""

    @property
    def n_layer(self) -> int: ...
    @property
    def n_head(self) -> int: ...
    @property
    def n_embd(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def padded_vocab_size(self) -> int: ...
    def to_dict(self) -> dict[str, Any]: ...


ModelConfig = ModelShape
"""The shape of any family."""


def check_sizes(shape: Any, positive: tuple[str, ...]) -> None:
    """One line for a shape whose ``positive`` fields are not all positive, or whose width does not split into its
    heads: the checks every family's config starts with."""
    for name in positive:
        if getattr(shape, name) < 1:
            raise ConfigError(f"model {name} must be a positive integer, got {getattr(shape, name)}")
    if shape.n_embd % shape.n_head != 0:
        raise ConfigError(
            f"model n_embd={shape.n_embd} is not divisible by n_head={shape.n_head}; "
            "choose n_embd as a multiple of n_head"
        )


def _no_notes(config: Any) -> tuple[str | None, str | None]:
    return None, None


def _torch_compile(module: nn.Module) -> nn.Module:
    import torch

    return torch.compile(module)  # type: ignore[return-value]


@dataclass(frozen=True)
class ModelFamily:
    """One model family: its shapes, how to build, save and read its models, and what sizing needs of it.

    A family is either named by its presets (``nano``, ``llama-pico``, ...) or, with ``name_prefix``, by a
    location (``hf:DIR``) whose config decides the shape (``fixed_shape``: the vocabulary and context are the
    directory's, no flag changes them)."""

    name: str  # as checkpoints record it (``model_family``)
    description: str  # one line, for docs and listings
    config_type: type
    presets: Mapping[str, Any]  # preset name -> shape
    build: Callable[[Any], DecoderLM]  # a shape -> the model, freshly initialised
    config_from_dict: Callable[[dict[str, Any]], Any]  # a checkpoint's ``model_config`` -> the shape
    describe_shape: Callable[[Any], str]  # the header's words for a shape
    save_hf: Callable[[Any, Path], Path]  # the model -> a Hugging Face directory (config.json + weights)
    hf_class_name: Callable[[Any], str]  # a shape -> the transformers class that loads the export
    layer_bytes_per_token: Callable[[Any, int], int] | None = None
    """What one layer keeps for backward per token at ``act_bytes`` per activation; None: measured only."""
    no_estimate_reason: str = ""  # why there is no analytic memory estimate, when ``layer_bytes_per_token`` is None
    hf_layout_name: str = ""  # the Hugging Face layout it reads and writes (``GPT-2``); none: each shape's class
    hf_model_types: tuple[str, ...] = ()  # config.json ``model_type`` values ``--init-from`` reads into this family
    hf_read_name: str = ""  # the layouts ``--init-from`` reads, as messages name them, comma-separated (default:
    # ``hf_layout_name``)
    read_hf_config: Callable[[Path], Any] | None = None  # a Hugging Face directory -> the shape (no weights read)
    load_hf: Callable[[Path], DecoderLM] | None = None  # a Hugging Face directory -> the model with its weights
    name_prefix: str = ""  # models named by location (``hf:``) rather than by preset
    location_help: str = ""  # what such a location holds, for help text
    shape_from_name: Callable[[str], Any] | None = None  # ``hf:DIR`` -> its shape
    fixed_shape: bool = False
    build_for_training: Callable[[Any, float], DecoderLM] | None = None
    """(shape, ``--dropout``) -> the model a run starts from (``hf:DIR``: its directory's weights); None: build."""
    training_notes: Callable[[Any], tuple[str | None, str | None]] = _no_notes
    """A shape -> (why it cannot be trained exactly, or None; a warning about what training leaves out, or None)."""
    dropout_note: Callable[[Any, float], str | None] | None = None
    """(shape, ``--dropout``) -> what ``--dropout`` did to the model's own dropout; None: it has none of its own."""
    compile: Callable[[nn.Module], nn.Module] = _torch_compile  # a wrapped model -> what the engine runs

    def claims(self, model_name: str) -> bool:
        """Whether ``--model model_name`` is one of this family's."""
        if self.name_prefix:
            return model_name.startswith(self.name_prefix)
        return model_name in self.presets

    def shape(self, model_name: str, **overrides: Any) -> Any:
        """The shape ``model_name`` names, with fields replaced. A fixed shape refuses, in one line, an override
        that would change it (dropout is no part of the shape: the builder sets it)."""
        if self.shape_from_name is None:
            return replace(self.presets[model_name], **overrides)
        shape = self.shape_from_name(model_name)
        for key, value in overrides.items():
            if key == "dropout" or (key in ("vocab_size", "block_size") and value == getattr(shape, key)):
                continue
            what = {"vocab_size": "vocabulary", "block_size": "context length"}.get(key, key)
            raise ConfigError(
                f"the {what} of {model_name} is its config.json's, not bigbatch's to change (asked: {key} {value})"
            )
        return shape

    def hf_layout(self, shape: Any) -> str:
        """The name of the layout a model of ``shape`` exports to (``GPT-2``, ``Qwen2ForCausalLM``)."""
        return self.hf_layout_name or self.hf_class_name(shape)

    def model_for_training(self, shape: Any, dropout: float) -> DecoderLM:
        """The model a run starts from: freshly built, or what ``build_for_training`` reads."""
        if self.build_for_training is None:
            return self.build(shape)
        return self.build_for_training(shape, dropout)
