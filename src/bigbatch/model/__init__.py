"""The model: the GPT-2 architecture (:mod:`.gpt`), how it is sharded (:mod:`.parallel`), Hugging Face
GPT-2 interop (:mod:`.hf`) and sampling (:mod:`.sampling`). It knows nothing of batches, accumulation or files
beyond its own weights."""

from bigbatch.model.gpt import GPT, MODEL_PRESETS, GPTConfig, pad_vocab, preset
from bigbatch.model.hf import load_hf_gpt2, save_hf_gpt2
from bigbatch.model.parallel import fsdp_units

__all__ = ["GPT", "MODEL_PRESETS", "GPTConfig", "fsdp_units", "load_hf_gpt2", "pad_vocab", "preset", "save_hf_gpt2"]
