"""LoRA adapters on any family's model, through peft: ``--lora-rank R``.

The adapters are injected in place (``peft.inject_adapter_in_model``) into the linear maps of the model's repeated
blocks: the module the loss runs through stays the same module, so accumulation, packing, the chunked loss, FSDP2
units and checkpoints need nothing new. Every base parameter is frozen, so only the adapters reach the optimizer
(:func:`bigbatch.engine.optim.param_groups` takes trainable parameters). ``auto`` targets are found by behaviour:
every ``nn.Linear`` inside the blocks (attention and MLP projections), except a mixture of experts' router (a
linear map named ``gate`` or ``router`` whose outputs are one per expert), which decides routing and is left as
trained. ``peft`` is imported only when adapters are used.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from bigbatch.errors import ConfigError, require_package
from bigbatch.models.routing import is_router_path

ADAPTER = "default"  # peft's name for the one adapter


@dataclass(frozen=True)
class LoraSettings:
    """``rank`` 0: no adapters. ``alpha`` 0: the rank (a scale of 1). ``targets``: ``auto`` or comma-separated
    module names or name suffixes (``q_proj,v_proj``)."""

    rank: int = 0
    alpha: float = 0.0
    dropout: float = 0.0
    targets: str = "auto"

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @classmethod
    def from_config(cls, model_section: dict[str, Any]) -> LoraSettings:
        """From a config's ``model`` section as a dict (a checkpoint's stored config; absent keys: no adapters)."""
        return cls(
            rank=int(model_section.get("lora_rank", 0) or 0),
            alpha=float(model_section.get("lora_alpha", 0.0) or 0.0),
            dropout=float(model_section.get("lora_dropout", 0.0) or 0.0),
            targets=str(model_section.get("lora_targets", "auto") or "auto"),
        )

    def peft_config(self, targets: list[str], random_init: bool = False) -> Any:
        """peft's config; ``random_init`` draws B as well as A (peft's default starts B at zero, so the first
        gradient of A is zero: a check of gradients wants both moving)."""
        peft = require_package("peft", "LoRA (--lora-rank)", "hf")
        return peft.LoraConfig(
            init_lora_weights=not random_init,
            r=self.rank,
            lora_alpha=self.alpha or self.rank,
            lora_dropout=self.dropout,
            target_modules=targets,
            bias="none",
        )


def adapted_module(model: nn.Module) -> nn.Module:
    """The module adapters go into: an ``hf:`` model's transformers module (so its adapter keys are peft's for that
    architecture), else the model itself."""
    inner = getattr(model, "hf_model", None)
    return inner if isinstance(inner, nn.Module) else model


def auto_targets(model: nn.Module) -> list[str]:
    """The full names (inside :func:`adapted_module`) of every linear map in the model's blocks, routers left out."""
    inner = adapted_module(model)
    listed = getattr(model, "blocks", None)
    blocks = set(map(id, listed())) if callable(listed) else set()
    names = []
    for block_name, block in inner.named_modules():
        if id(block) not in blocks:
            continue
        for name, module in block.named_modules():
            if isinstance(module, nn.Linear) and not is_router_path(name):
                names.append(f"{block_name}.{name}")
    return names


def chosen_targets(model: nn.Module, targets: str) -> list[str]:
    """The names ``targets`` picks: ``auto``, or listed names each matching at least one linear map (as a whole name
    or as its last parts); one line naming what exists otherwise."""
    if targets == "auto":
        found = auto_targets(model)
        if not found:
            raise ConfigError("--lora-targets auto found no linear map in the model's blocks; name them with a list")
        return found
    linear = [name for name, m in adapted_module(model).named_modules() if isinstance(m, nn.Linear)]
    chosen: list[str] = []
    for wanted in (t.strip() for t in targets.split(",") if t.strip()):
        matches = [name for name in linear if name == wanted or name.endswith(f".{wanted}")]
        if not matches:
            kinds = sorted({name.rsplit(".", 1)[-1] for name in linear})
            raise ConfigError(
                f"--lora-targets {wanted!r} matches no linear map of the model; its linear maps are named "
                f"{', '.join(kinds)} (or give auto)"
            )
        chosen.extend(m for m in matches if m not in chosen)
    if not chosen:
        raise ConfigError("--lora-targets is empty; give auto or a comma-separated list of module names")
    return chosen


@dataclass(frozen=True)
class LoraReport:
    adapter_parameters: int
    total_parameters: int
    targets: list[str]

    def describe(self) -> str:
        kinds = sorted({name.rsplit(".", 1)[-1] for name in self.targets})
        share = self.adapter_parameters / max(self.total_parameters, 1)
        return (
            f"{self.adapter_parameters:,} adapter parameters trained ({share:.2%} of {self.total_parameters:,}; the "
            f"rest frozen) on {len(self.targets)} linear maps ({', '.join(kinds)})"
        )


def add_lora(model: nn.Module, settings: LoraSettings, random_init: bool = False) -> LoraReport:
    """Inject the adapters of ``settings`` into ``model`` (in place) and freeze everything else."""
    if settings.rank < 0:
        raise ConfigError(f"--lora-rank must be 0 (off) or positive, got {settings.rank}")
    targets = chosen_targets(model, settings.targets)
    peft = require_package("peft", "LoRA (--lora-rank)", "hf")
    config = settings.peft_config(targets, random_init)
    peft.inject_adapter_in_model(config, adapted_module(model), adapter_name=ADAPTER)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_("lora_" in name)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return LoraReport(trained, sum(p.numel() for p in model.parameters()), targets)


def has_lora(model: nn.Module) -> bool:
    return any("lora_" in name for name, _ in model.named_parameters())


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[bool]:
    """The model as its base, adapters switched off, for as long as the block runs (a preference objective's
    reference policy: no second copy in memory). Yields whether the model had adapters. peft's own switch
    (``enable_adapters``) also flips the adapters' ``requires_grad``, which an optimizer and DDP's reducer must
    not see change in the middle of a step; the flag its forward reads is set directly instead."""
    peft_lora = require_package("peft.tuners.lora", "LoRA (--lora-rank)", "hf") if has_lora(model) else None
    layers = [] if peft_lora is None else [m for m in model.modules() if isinstance(m, peft_lora.LoraLayer)]
    was = [layer._disable_adapters for layer in layers]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield bool(layers)
    finally:
        for layer, before in zip(layers, was, strict=True):
            layer._disable_adapters = before


def merge_lora(model: nn.Module) -> None:
    """Fold every adapter into its base weight and put the base layer back in its place (in place), so the model is
    its family's plain module again, as an export writes it."""
    peft_lora = require_package("peft.tuners.lora", "LoRA (--lora-rank)", "hf")
    inner = adapted_module(model)
    for name, module in list(inner.named_modules()):
        if isinstance(module, peft_lora.LoraLayer):
            module.merge()
            parent_name, _, child = name.rpartition(".")
            parent = inner.get_submodule(parent_name) if parent_name else inner
            setattr(parent, child, module.get_base_layer())


def adapter_state(model: nn.Module) -> dict[str, Any]:
    """The adapters' tensors keyed as peft saves them (``base_model.model.`` + the module path, no adapter name)."""
    peft = require_package("peft", "LoRA (--lora-rank)", "hf")
    state = peft.get_peft_model_state_dict(adapted_module(model), adapter_name=ADAPTER)
    return {f"base_model.model.{key}": value.detach().contiguous() for key, value in state.items()}
