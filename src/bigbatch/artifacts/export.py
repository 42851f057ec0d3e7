"""``bigbatch export``: a run's newest valid checkpoint as a Hugging Face model directory (GPT-2, Llama or
mixture-of-experts layout, by the run's model family; an ``hf:DIR`` model in its own architecture's)."""

from __future__ import annotations

from pathlib import Path

from bigbatch.data.tokenizer_files import export_tokenizer
from bigbatch.errors import BigBatchError
from bigbatch.files.atomic import apply_umask
from bigbatch.models.pretrained import hf_class_name, hf_layout, save_pretrained
from bigbatch.run.checkpoints.checkpoint import load_checkpoint, model_from_checkpoint, resolve_checkpoint


def give_umask_modes(out: Path, created: bool) -> None:
    """Every file and directory the export wrote gets the umask's mode, whoever wrote it: transformers'
    ``save_pretrained`` (an ``hf:`` run) leaves ``model.safetensors`` 0600, where a native export is 0644."""
    if created:
        apply_umask(out, directory=True)
    for path in out.rglob("*"):
        if not path.is_symlink():
            apply_umask(path, directory=path.is_dir())


def export_hf(run: Path, out: Path) -> str:
    """Write the model (and its tokenizer) of ``run``'s newest valid checkpoint to the new or empty directory
    ``out``; return the line that says what was written and how to load it."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):  # before the (possibly long) load
        raise BigBatchError(f"{out} already exists and is not empty; choose a new output directory")
    path = resolve_checkpoint(run)
    document = load_checkpoint(path)
    model = model_from_checkpoint(document)
    created = not out.exists()
    save_pretrained(model, out)
    tokenizer_note = export_tokenizer(document, path, out, model.config.block_size)
    give_umask_modes(out, created)
    cfg = model.config
    return (
        f"exported step {document.get('step', '?')} of {path} to {out} (Hugging Face {hf_layout(model)} layout: "
        f"config.json + model.safetensors; {cfg.n_layer} layers, {cfg.n_embd} wide, vocab {cfg.vocab_size}, "
        f"{document.get('tokenizer', 'byte')} tokens{tokenizer_note}); load it with "
        f"transformers.{hf_class_name(model)}.from_pretrained and AutoTokenizer.from_pretrained"
    )
