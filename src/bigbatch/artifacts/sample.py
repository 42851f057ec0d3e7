"""``bigbatch sample``: text from a saved run's model, streamed piece by piece for one sample."""

from __future__ import annotations

from pathlib import Path
from typing import TextIO

import torch

from bigbatch.data.tokenizer_files import checkpoint_tokenizer
from bigbatch.data.tokenizers import continuation_decoder
from bigbatch.models.sampling import decoded_pieces, generate, generate_stream, prompt_ids
from bigbatch.parallel.distributed import resolve_device
from bigbatch.run.checkpoints.checkpoint import load_checkpoint, model_from_checkpoint


def sample_checkpoint(
    checkpoint: Path,
    prompt: str,
    out: TextIO,
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    num_samples: int,
    seed: int,
    device_name: str = "auto",
) -> None:
    """Write ``num_samples`` continuations of ``prompt`` to ``out``: one is streamed as it is sampled; several are
    written whole, each under a ``--- sample N`` line."""
    device = resolve_device(device_name)
    document = load_checkpoint(checkpoint)
    model = model_from_checkpoint(document).to(device)
    tokenizer = checkpoint_tokenizer(document, checkpoint)  # the run's own copy first: the cache may move
    ids = prompt_ids(tokenizer, prompt, model.config.vocab_size)
    generator = torch.Generator(device=device).manual_seed(seed)
    idx = torch.tensor([ids] * num_samples, dtype=torch.long, device=device)
    decode = continuation_decoder(tokenizer, ids)  # the space a SentencePiece decoder strips at a text's start kept
    if num_samples == 1:  # stream: each piece of text as soon as it is sampled
        out.write(prompt)
        out.flush()
        tokens = generate_stream(model, idx, max_new_tokens, temperature, top_k, generator=generator)
        for piece in decoded_pieces(tokens, decode):
            out.write(piece)
            out.flush()
        out.write("\n")
        out.flush()
        return
    generated = generate(model, idx, max_new_tokens, temperature, top_k, generator=generator)
    for i in range(num_samples):
        out.write(f"--- sample {i + 1}\n")
        out.write(prompt + decode(generated[i, len(ids) :].tolist()) + "\n")
