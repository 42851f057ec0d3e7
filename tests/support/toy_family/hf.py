"""The toy family's directory layout: config.json (``model_type`` ``bigbatch-toy``) and model.safetensors."""

from __future__ import annotations

from pathlib import Path

from bigbatch.models.hf_files import read_config, read_weights, write_hf_directory

from .config import ToyConfig
from .model import ToyLM

MODEL_TYPE = "bigbatch-toy"


def read_toy_config(directory: Path) -> ToyConfig:
    values = read_config(Path(directory), kind="toy")
    return ToyConfig(**{key: value for key, value in values.items() if key != "model_type"})


def load_toy(directory: Path) -> ToyLM:
    model = ToyLM(read_toy_config(directory))
    model.load_state_dict(read_weights(Path(directory)))
    return model


def save_toy(model: ToyLM, directory: Path) -> Path:
    tensors = {key: value.detach().cpu().clone() for key, value in model.state_dict().items()}
    return write_hf_directory(Path(directory), tensors, {"model_type": MODEL_TYPE, **model.config.to_dict()})
