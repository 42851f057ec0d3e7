"""A local Hugging Face model directory of a bigbatch family (``--init-from``): which family it is, its shape, its
weights; and a model written back out in its family's layout (``export``). ``config.json``'s ``model_type``
decides, through :mod:`.registry` (GPT-2 directories from before the field existed have none: they are read as
gpt2)."""

from __future__ import annotations

from pathlib import Path

from bigbatch.errors import CheckpointError
from bigbatch.files.outputs import is_bigbatch_run
from bigbatch.models.decoder import DecoderLM
from bigbatch.models.family import ModelFamily, ModelShape
from bigbatch.models.hf.config import dropout_settings
from bigbatch.models.hf_files import read_config
from bigbatch.models.registry import FAMILIES, family_for_hf_model_type, family_of, hf_model_types
from bigbatch.settings.choices import listed

LEGACY_MODEL_TYPE = "gpt2"
"""What a config.json without ``model_type`` is (GPT-2 directories from before the field existed)."""


def hf_model_type(directory: Path | str) -> str:
    """``config.json``'s ``model_type`` (gpt2 when absent); one line when it is not one ``--init-from`` reads,
    naming what does: ``--model hf:DIR`` for another Hugging Face model, resume or export for a bigbatch run."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a directory; give a Hugging Face {_kinds()} directory")
    if not (directory / "config.json").exists() and is_bigbatch_run(directory):
        raise CheckpointError(
            f"--init-from {directory} is a bigbatch run directory, not a Hugging Face one: continue it with "
            f"--out {directory} (and no --init-from), or start a new run from its weights: bigbatch export "
            f"{directory} DIR, then --init-from DIR"
        )
    model_type = read_config(directory, kind=_kinds()).get("model_type", LEGACY_MODEL_TYPE)
    if family_for_hf_model_type(str(model_type)) is None:
        raise CheckpointError(
            f"--init-from {directory}: its config.json has model_type {model_type!r}, and --init-from reads only "
            f"{listed(hf_model_types())} into bigbatch's own models; to train this model's weights as "
            f"they are, pass --model hf:{directory} instead of --init-from"
        )
    return str(model_type)


def _kinds() -> str:
    """``GPT-2, Llama, Mixtral or Qwen3-MoE``: the layouts ``--init-from`` reads, as messages name them."""
    names = [family.hf_read_name or family.hf_layout_name for family in FAMILIES if family.hf_model_types]
    return listed([name for family_names in names for name in family_names.split(", ")])


def pretrained_dropout(directory: Path | str) -> dict[str, float]:
    """The dropout probabilities ``directory``'s config.json sets, by key (bigbatch's own families train without)."""
    return dropout_settings(read_config(Path(directory), kind=_kinds()))


def pretrained_family(directory: Path | str) -> ModelFamily:
    """The family whose Hugging Face layout ``directory`` holds."""
    family = family_for_hf_model_type(hf_model_type(directory))
    assert family is not None  # hf_model_type refused any other
    return family


def read_pretrained_config(directory: Path | str) -> ModelShape:
    """The shape of a Hugging Face directory of a bigbatch family, from its config.json alone (no weights read)."""
    reader = pretrained_family(directory).read_hf_config
    assert reader is not None
    return reader(Path(directory))


def load_pretrained(directory: Path | str) -> DecoderLM:
    """The model of a Hugging Face directory of a bigbatch family, with its weights (fp32, on the CPU)."""
    loader = pretrained_family(directory).load_hf
    assert loader is not None
    return loader(Path(directory))


def hf_class_name(model: DecoderLM) -> str:
    """The transformers class that loads ``model``'s export."""
    return family_of(model).hf_class_name(model.config)


def hf_layout(model: DecoderLM) -> str:
    """The name of the Hugging Face layout ``model`` exports to (``GPT-2``, ``Llama``, ``Qwen2ForCausalLM``)."""
    return family_of(model).hf_layout(model.config)


def save_pretrained(model: DecoderLM, directory: Path | str) -> Path:
    """Write ``model`` in its family's Hugging Face layout (config.json + model.safetensors)."""
    return family_of(model).save_hf(model, Path(directory))
