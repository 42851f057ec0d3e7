"""``bigbatch export``: a run's newest valid checkpoint as a Hugging Face model directory (GPT-2, Llama or
mixture-of-experts layout, by the run's model family; an ``hf:DIR`` model in its own architecture's)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from bigbatch.data.tokenizer_files import checkpoint_tokenizer, export_tokenizer
from bigbatch.errors import BigBatchError, require_package
from bigbatch.files.atomic import apply_umask, write_json_atomically
from bigbatch.models.decoder import DecoderLM
from bigbatch.models.hf_files import has_weights, quiet_progress
from bigbatch.models.lora import LoraSettings, adapter_state, has_lora, merge_lora
from bigbatch.models.pretrained import hf_class_name, hf_layout, save_pretrained
from bigbatch.models.registry import model_location
from bigbatch.run.checkpoints.checkpoint import load_checkpoint, model_from_checkpoint, resolve_checkpoint


def give_umask_modes(out: Path, created: bool) -> None:
    """Every file and directory the export wrote gets the umask's mode, whoever wrote it: transformers'
    ``save_pretrained`` (an ``hf:`` run) leaves ``model.safetensors`` 0600, where a native export is 0644."""
    if created:
        apply_umask(out, directory=True)
    for path in out.rglob("*"):
        if not path.is_symlink():
            apply_umask(path, directory=path.is_dir())


def export_hf(run: Path, out: Path, adapter: bool = False) -> str:
    """Write the model (and its tokenizer) of ``run``'s newest valid checkpoint to the new or empty directory
    ``out`` (a LoRA run's adapters merged into it), or with ``adapter`` only a LoRA run's adapters as peft saves
    them; return the line that says what was written, how to load it, and how far the reloaded export's logits are
    from the training-time model's on a held batch.

    What the export needs (transformers for the reload check, peft for adapters) is checked before anything is
    written, and everything is written into a hidden folder beside ``out`` renamed into place at the end: an export
    completes or leaves nothing."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):  # before the (possibly long) load
        raise BigBatchError(f"{out} already exists and is not empty; choose a new output directory")
    require_package("transformers", "export (it reloads what it wrote to check it)", "hf")
    if adapter:
        require_package("peft", "export --adapter", "hf")
    path = resolve_checkpoint(run)
    document = load_checkpoint(path)
    model = model_from_checkpoint(document).eval()
    lora = has_lora(model)
    if adapter:
        base = _adapter_base(run, model, document, lora)
    held = _held_tokens(model.config.vocab_size)
    with torch.no_grad():
        reference = model(held).float()  # (2, 16, V): the model as trained, adapters unmerged
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    try:
        if adapter:
            line = _export_adapter(model, base, staging, document, path, held, reference)
        else:
            line = _export_model(model, lora, staging, document, path, held, reference)
        give_umask_modes(staging, created=True)
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return line.replace(str(staging), str(out))


def _export_model(
    model: DecoderLM,
    lora: bool,
    out: Path,
    document: dict[str, Any],
    path: Path,
    held: torch.Tensor,
    reference: torch.Tensor,
) -> str:
    """The model (its adapters merged) and its tokenizer in ``out``, reloaded by transformers and compared."""
    if lora:
        merge_lora(model)
    save_pretrained(model, out)
    tokenizer_note = export_tokenizer(document, path, out, model.config.block_size)
    if getattr(model, "hf_model", None) is None:  # an hf:DIR model keeps its own config's ids
        _set_end_of_text(out, document, path)
    try:
        reloaded = _reloaded_logits(out, held, None)
        check = f"within {_max_difference(reloaded, reference):.2e} of the trained model's on a held batch"
    except (ValueError, KeyError, OSError) as exc:  # a family whose layout this transformers does not read
        check = f"not checked ({type(exc).__name__}: transformers does not read this layout)"
    cfg = model.config
    merged = " with its LoRA adapters merged" if lora else ""
    return (
        f"exported step {document.get('step', '?')} of {path} to {out}{merged} (Hugging Face {hf_layout(model)} "
        f"layout: config.json + model.safetensors; {cfg.n_layer} layers, {cfg.n_embd} wide, vocab {cfg.vocab_size}, "
        f"{document.get('tokenizer', 'byte')} tokens{tokenizer_note}); load it with "
        f"transformers.{hf_class_name(model)}.from_pretrained"
        + (" and AutoTokenizer.from_pretrained" if (out / "tokenizer.json").is_file() else "")
        + f"; reloaded, its logits are {check}"
    )


def _set_end_of_text(out: Path, document: dict[str, Any], path: Path) -> None:
    """``bos_token_id`` / ``eos_token_id`` of the exported ``config.json`` (and ``generation_config.json`` where
    written): the run's tokenizer's end-of-text token (GPT-2's convention: one token begins and ends a text), so
    ``generate()`` stops where the tokenizer ends a text; left out for a tokenizer without one (``byte``), rather
    than naming a byte."""
    eot = checkpoint_tokenizer(document, path).eot_token
    for name in ("config.json", "generation_config.json"):
        file = out / name
        if not file.is_file():
            continue
        config = json.loads(file.read_text(encoding="utf-8"))
        for key in ("bos_token_id", "eos_token_id"):
            if eot is None:
                config.pop(key, None)
            else:
                config[key] = int(eot)
        write_json_atomically(file, config)


def _held_tokens(vocab_size: int) -> torch.Tensor:
    """A fixed batch of token ids (2, 16) every vocabulary holds: what the reload check compares on."""
    return ((torch.arange(32) * 7919 + 11) % vocab_size).reshape(2, 16)


def _max_difference(reloaded: torch.Tensor, reference: torch.Tensor) -> float:
    vocab = min(reloaded.shape[-1], reference.shape[-1])  # a padded head's extra columns are never a token
    return float((reloaded[..., :vocab] - reference[..., :vocab]).abs().max())


def _reloaded_logits(directory: Path, held: torch.Tensor, adapter: Path | None) -> torch.Tensor:
    """The logits of the export read back as a user would: transformers (and peft for an adapter over
    ``directory``, the base model)."""
    transformers = require_package("transformers", "checking the export", "hf")
    with quiet_progress():
        model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True)
    if adapter is not None:
        peft = require_package("peft", "checking the adapter export", "hf")
        model = peft.PeftModel.from_pretrained(model, str(adapter))
    with torch.no_grad():
        return model.eval()(input_ids=held).logits.float()


def _adapter_base(run: Path, model: torch.nn.Module, document: dict[str, Any], lora: bool) -> Path:
    """The base model directory a run's adapters apply to (its ``hf:DIR``), refused in one line where there is
    none."""
    if not lora:
        raise BigBatchError(f"--adapter: {run} trained the whole model (no --lora-rank); export it without --adapter")
    name = str(document.get("config", {}).get("model", {}).get("preset", ""))
    directory = model_location(name)
    if not directory or getattr(model, "hf_model", None) is None:
        raise BigBatchError(
            f"--adapter writes peft adapters over a Hugging Face model directory, and {run} trained {name}'s own "
            "layout; export the merged model (without --adapter), or fine-tune with --model hf:DIR"
        )
    if not has_weights(directory):
        raise BigBatchError(
            f"--adapter: {directory} holds no weights (the run started from a seeded initialisation), so there is no "
            "base for adapters; export the merged model without --adapter"
        )
    return Path(directory)


def _export_adapter(
    model: torch.nn.Module,
    base: Path,
    out: Path,
    document: dict[str, Any],
    path: Path,
    held: torch.Tensor,
    reference: torch.Tensor,
) -> str:
    """``adapter_config.json`` + ``adapter_model.safetensors`` over ``base``, written by peft itself: the base model
    with the same adapters injected, their weights set to the run's."""
    transformers = require_package("transformers", "--adapter", "hf")
    peft = require_package("peft", "--adapter", "hf")
    settings = LoraSettings.from_config(document.get("config", {}).get("model", {}))
    state = adapter_state(model)
    targets = sorted({key.removeprefix("base_model.model.").split(".lora_")[0] for key in state})
    with quiet_progress():
        host = transformers.AutoModelForCausalLM.from_pretrained(str(base), local_files_only=True)
    wrapped = peft.get_peft_model(host, settings.peft_config(targets))
    result = peft.set_peft_model_state_dict(wrapped, state)
    if getattr(result, "unexpected_keys", None):
        raise BigBatchError(f"--adapter: the adapters do not fit {base} ({result.unexpected_keys[0]}, ...)")
    wrapped.peft_config["default"].base_model_name_or_path = str(base.resolve())
    wrapped.save_pretrained(str(out))
    reloaded = _reloaded_logits(base, held, out)
    return (
        f"exported the LoRA adapters (rank {settings.rank}, {len(targets)} linear maps) of step "
        f"{document.get('step', '?')} of {path} to {out} (adapter_config.json + adapter_model.safetensors over "
        f"{base}); load them with peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({str(base)!r}), "
        f"{str(out)!r}); reloaded, the logits are within {_max_difference(reloaded, reference):.2e} of the trained "
        "model's on a held batch"
    )
