"""A local Hugging Face model directory of either family: which family it is, its shape, its weights; and a
model written back out in its family's layout. ``config.json``'s ``model_type`` decides (GPT-2 directories
from before the field existed have none: they are read as gpt2)."""

from __future__ import annotations

from pathlib import Path

from bigbatch.errors import CheckpointError
from bigbatch.files.outputs import RUN_MARKER, is_legacy_run
from bigbatch.models.gpt.hf import load_hf_gpt2, read_hf_gpt_config, save_hf_gpt2
from bigbatch.models.gpt.model import GPT, GPTConfig
from bigbatch.models.hf_causal import HFCausalLM, save_hf_model
from bigbatch.models.hf_files import read_config
from bigbatch.models.llama.hf import load_hf_llama, read_hf_llama_config, save_hf_llama
from bigbatch.models.llama.model import Llama, LlamaConfig

SUPPORTED_MODEL_TYPES = ("gpt2", "llama")
"""The ``model_type`` values ``--init-from`` reads."""


def hf_model_type(directory: Path | str) -> str:
    """``config.json``'s ``model_type`` (gpt2 when absent); one line when it is not one ``--init-from`` reads,
    naming what does: ``--model hf:DIR`` for another Hugging Face model, resume or export for a bigbatch run."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a directory; give a Hugging Face GPT-2 or Llama directory")
    if not (directory / "config.json").exists() and is_bigbatch_run(directory):
        raise CheckpointError(
            f"--init-from {directory} is a bigbatch run directory, not a Hugging Face one: continue it with "
            f"--out {directory} (and no --init-from), or start a new run from its weights: bigbatch export "
            f"{directory} DIR, then --init-from DIR"
        )
    model_type = read_config(directory, kind="GPT-2 or Llama").get("model_type", "gpt2")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"--init-from {directory}: its config.json has model_type {model_type!r}, and --init-from reads only "
            f"{' and '.join(SUPPORTED_MODEL_TYPES)} into bigbatch's own models; to train this model's weights as "
            f"they are, pass --model hf:{directory} instead of --init-from"
        )
    return str(model_type)


def is_bigbatch_run(directory: Path) -> bool:
    """Whether ``directory`` is a bigbatch run (its marker, or the checkpoints and metrics of one)."""
    return (directory / RUN_MARKER).is_file() or is_legacy_run(directory)


def read_pretrained_config(directory: Path | str) -> GPTConfig | LlamaConfig:
    """The shape of a GPT-2 or Llama directory, from its config.json alone (no weights are read)."""
    if hf_model_type(directory) == "llama":
        return read_hf_llama_config(directory)
    return read_hf_gpt_config(directory)


def load_pretrained(directory: Path | str) -> GPT | Llama:
    """The model of a GPT-2 or Llama directory, with its weights (fp32, on the CPU)."""
    if hf_model_type(directory) == "llama":
        return load_hf_llama(directory)
    return load_hf_gpt2(directory)


def hf_class_name(model: GPT | Llama | HFCausalLM) -> str:
    """The transformers class that loads ``model``'s export."""
    if isinstance(model, HFCausalLM):
        return model.config.architecture
    return "LlamaForCausalLM" if isinstance(model, Llama) else "GPT2LMHeadModel"


def save_pretrained(model: GPT | Llama | HFCausalLM, directory: Path | str) -> Path:
    """Write ``model`` in its family's Hugging Face layout (config.json + model.safetensors); a Hugging Face
    model through its own ``save_pretrained``."""
    if isinstance(model, HFCausalLM):
        return save_hf_model(model, directory)
    if isinstance(model, Llama):
        return save_hf_llama(model, directory)
    return save_hf_gpt2(model, directory)
