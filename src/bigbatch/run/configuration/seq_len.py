"""seq_len auto: the model's context length, from the settings alone (no weights are read), capped for a model
read from a directory."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from bigbatch.models.registry import model_location

if TYPE_CHECKING:
    from bigbatch.run.configuration.train_config import TrainConfig

INIT_FROM_AUTO_SEQ_LEN_CAP = 8192
"""seq_len auto with ``--init-from`` is the directory's context length, at most this: Llama 3.2 declares 131,072
positions, and sequences that long rarely fit a training step (``--seq-len`` asks for more)."""


def model_block_size(config: TrainConfig) -> int:
    """The context length of the model ``config`` trains, from the settings alone (no weights are read):
    ``--init-from``'s config.json (GPT-2 ``n_positions``, Llama ``max_position_embeddings``), else
    ``--block-size``, else the preset's."""
    if config.model.init_from:
        from bigbatch.models.pretrained import read_pretrained_config

        return read_pretrained_config(config.model.init_from).block_size
    if config.model.block_size:
        return config.model.block_size
    from bigbatch.models.registry import model_preset

    return model_preset(config.model.preset).block_size


def auto_seq_len(config: TrainConfig) -> int:
    """What seq_len auto resolves to: the model's block size; with ``--init-from`` or ``--model hf:DIR`` at most
    :data:`INIT_FROM_AUTO_SEQ_LEN_CAP` (a preset's or ``--block-size``'s is the user's own choice)."""
    return capped_seq_len(model_block_size(config), bool(model_directory(config)))


def capped_seq_len(block_size: int, from_directory: bool) -> int:
    """seq_len auto of a model of ``block_size``: all of it, or at most :data:`INIT_FROM_AUTO_SEQ_LEN_CAP` when the
    model comes from a directory (whose context may be 131,072)."""
    return min(block_size, INIT_FROM_AUTO_SEQ_LEN_CAP) if from_directory else block_size


def model_auto_seq_len(model_name: str) -> tuple[int, bool]:
    """seq_len auto for ``--model model_name`` alone (``plan``, ``memory``): its block size, at most
    :data:`INIT_FROM_AUTO_SEQ_LEN_CAP` for a model read from a directory as in training; and whether it was capped."""
    from bigbatch.models.registry import model_preset

    block_size = model_preset(model_name).block_size
    seq_len = capped_seq_len(block_size, bool(model_location(model_name)))
    return seq_len, seq_len < block_size


def model_directory(config: TrainConfig) -> str:
    """The directory the model comes from (``--init-from DIR`` or ``--model hf:DIR``), or ``""`` for a preset."""
    return config.model.init_from or model_location(config.model.preset)


def resolve_seq_len(config: TrainConfig) -> TrainConfig:
    """``config`` with ``seq_len`` auto (stored 0) replaced by :func:`auto_seq_len` (a copy), or ``config`` itself
    when ``seq_len`` is set; everything that plans, reads or names a run uses the resolved one."""
    if config.batch.seq_len:
        return config
    return replace(config, batch=replace(config.batch, seq_len=auto_seq_len(config)))
