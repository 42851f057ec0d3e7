"""Any local Hugging Face causal language model as a bigbatch model (``--model hf:DIR``).

:class:`HFCausalLM` wraps the ``AutoModelForCausalLM`` built from an :class:`~bigbatch.models.hf.config.HFConfig`:
``forward(idx)`` returns the logits only (no labels, no cache), so the loss, and with it the exactness of
accumulation, stays bigbatch's own. ``transformers`` is imported only when a model is read or built: the rest of
bigbatch starts without it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from bigbatch.errors import CheckpointError, ConfigError
from bigbatch.models.coupling import set_dropout
from bigbatch.models.decoder import DecoderLM
from bigbatch.models.hf.config import HFConfig, require_transformers
from bigbatch.models.hf.fused_weights import hf_matrix_layout, mlp_widths
from bigbatch.models.hf.router_probe import RouterProbe, probe_router, router_refusal
from bigbatch.models.hf_files import has_weights, quiet_progress, read_config
from bigbatch.models.lm_output import logits_loss, logits_or_loss, segment_logits_losses, token_losses_from_logits
from bigbatch.models.matrix_layout import MatrixLayout
from bigbatch.models.routing import RouterRecorder, route_tokens

log = logging.getLogger(__name__)

HEAD_PROBE_SCALE = 1024.0
"""A power of two: the probe's scaling of the head's weight is undone exactly."""


def read_hf_config(directory: Path | str) -> HFConfig:
    """The shape of ``hf:DIR`` from its config.json alone; one line when it is not a causal LM transformers knows."""
    path = Path(directory).expanduser()  # hf:~/models/x: no shell expands a ~ after "hf:"
    if not path.exists():
        raise ConfigError(f"hf:{path} does not exist; give a local Hugging Face model directory (with config.json)")
    if not path.is_dir():
        raise ConfigError(f"hf:{path} is not a directory; give a local Hugging Face model directory")
    try:
        values = read_config(path, kind="model")
    except CheckpointError as exc:
        raise ConfigError(str(exc)) from exc
    require_transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = values.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ConfigError(f"{path}/config.json has no model_type; bigbatch cannot tell which architecture it is")
    if model_type not in CONFIG_MAPPING_NAMES:
        raise ConfigError(
            f"{path}/config.json has model_type {model_type!r}, an architecture this transformers does not know "
            "(custom code is not run); upgrade transformers or choose another model"
        )
    causal = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    declared = values.get("architectures") or []
    if causal is None or (declared and causal not in declared):
        what = declared[0] if declared else f"a {model_type} model"
        raise ConfigError(
            f"hf:{path} holds {what}, not a causal language model (AutoModelForCausalLM has no class for it); "
            "bigbatch trains next-token prediction"
        )
    return HFConfig(directory=str(path), hf_config=values)


def build_hf_model(config: HFConfig, weights: bool = False, dropout: float | None = None) -> HFCausalLM:
    """The model of ``config``: with ``weights``, those of its directory (fp32, on the CPU) when it has any; else
    freshly initialised from the config (from torch's generator: the caller's seed decides). ``dropout`` (a run's
    ``--dropout``) replaces every dropout probability, those of config.json (the model is built with them) and any
    other a module holds; None keeps config.json's. ``config`` itself stays config.json as read."""
    transformers = require_transformers()
    hf_config = config.transformers_config(dropout)
    auto = transformers.AutoModelForCausalLM
    if weights and has_weights(config.directory):
        with quiet_progress():
            model = auto.from_pretrained(config.directory, config=hf_config, local_files_only=True, dtype=torch.float32)
    else:
        model = auto.from_config(hf_config, dtype=torch.float32)
    if dropout is not None:
        set_dropout(model, dropout)  # a probability no config.json key names (the module holds it)
    return HFCausalLM(config, model)


def save_hf_model(model: HFCausalLM, directory: Path | str) -> Path:
    """The wrapped model's own ``save_pretrained`` (config.json + safetensors)."""
    with quiet_progress():
        model.hf_model.save_pretrained(str(directory))  # type: ignore[operator]
    return Path(directory)


class HFCausalLM(DecoderLM):
    """A Hugging Face causal LM with bigbatch's model interface: ``forward(idx, targets, positions)`` -> the logits
    (B, T, V), or the summed loss with ``targets``; ``config``, ``activation_checkpointing``, ``chunked_loss``,
    ``num_params``, ``flops_per_token`` and :meth:`fsdp_units` (its :meth:`blocks`).

    No labels go in (the engine's token-weighted loss is computed here from the final hidden states, in chunks of
    rows when the head can be taken apart from the trunk: :attr:`head_detachable`) and no key/value cache. A mixture
    of experts whose router bigbatch reads returns its router logits, from which each forward reports every MoE
    layer's routing to :attr:`router_recorder` (the trainer computes the balancing loss over the step).
    ``positions`` go in as ``position_ids``, from which transformers confines attention to each packed document
    (:attr:`packs_documents` says whether this architecture does)."""

    def __init__(self, config: HFConfig, model: nn.Module) -> None:
        super().__init__()
        self.config = config
        self.hf_model = model.train()  # from_pretrained returns it in eval mode
        self._checkpointing = False
        self._forward_kwargs: dict[str, Any] = {"use_cache": False}
        if hasattr(model.config, "output_router_logits"):
            self._forward_kwargs["output_router_logits"] = False
        self.router_probe: RouterProbe | None = probe_router(model, config.vocab_size, config.experts or 0)
        spec = self.router_probe.spec if self.router_probe is not None else None
        self.router_recorder = RouterRecorder(spec) if spec is not None else None
        self.head_detachable, self.packs_documents = self._probe()
        if spec is not None:
            self._forward_kwargs["output_router_logits"] = True
            if self.head_detachable and not self._trunk_routes(spec.n_moe_layer):
                self.head_detachable = False  # the loss's path must report the routing: the whole model's
        self.chunked_loss = self.head_detachable

    @property
    def router_refusal(self) -> str:
        """Why bigbatch cannot balance this mixture of experts over the step (one line), or ``""``."""
        probe = self.router_probe
        return router_refusal(probe, self.config) if probe is not None and probe.spec is None else ""

    @torch.no_grad()
    def _trunk_routes(self, layers: int) -> bool:
        """Whether the trunk (the chunked loss's path) returns the router logits of every MoE layer."""
        parts = self._trunk_and_head()
        if parts is None:
            return False
        was_training = self.hf_model.training
        self.hf_model.eval()
        try:
            output = parts[0](input_ids=self._probe_tokens(), **self._forward_kwargs)
        except (TypeError, ValueError, AttributeError, RuntimeError):
            return False
        finally:
            self.hf_model.train(was_training)
        return len(getattr(output, "router_logits", None) or ()) == layers

    def _report_routing(self, output: Any) -> None:
        """Each MoE layer's routing of this forward, from the router logits (tokens, E) transformers returned."""
        recorder = self.router_recorder
        if recorder is None:
            return
        for logits in getattr(output, "router_logits", None) or ():
            recorder.add(route_tokens(logits, recorder.spec.top_k, recorder.spec.scoring))

    def _trunk_and_head(self) -> tuple[nn.Module, nn.Linear] | None:
        model: Any = self.hf_model
        trunk = getattr(model, str(getattr(model, "base_model_prefix", "")), None)
        head = model.get_output_embeddings()
        if not isinstance(trunk, nn.Module) or not isinstance(head, nn.Linear):
            return None
        return trunk, head

    def _hidden(self, trunk: nn.Module, idx: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        output = trunk(input_ids=idx, position_ids=positions, **self._forward_kwargs)
        self._report_routing(output)
        hidden: torch.Tensor = output.last_hidden_state
        return hidden

    def _probe(self) -> tuple[bool, bool]:
        """(whether the logits are the head's linear map of the trunk's last hidden state, so the loss can be
        computed in chunks from it; whether ``position_ids`` keep packed documents apart along every path
        :meth:`forward` takes, the trunk's that the loss uses included), each decided by running this architecture
        on 8 tokens (no random numbers drawn: dropout is off)."""
        was_training = self.hf_model.training
        self.hf_model.eval()
        try:
            self.head_detachable = self._head_is_detachable()
            return self.head_detachable, self._packs_documents()
        except (TypeError, ValueError, AttributeError, RuntimeError, StopIteration):
            return False, False  # not a model that runs on input_ids alone: the whole logits, no packing
        finally:
            self.hf_model.train(was_training)

    def _probe_tokens(self) -> torch.Tensor:
        device = next(self.hf_model.parameters()).device
        return ((torch.arange(8, device=device) * 7 + 3) % self.config.vocab_size).unsqueeze(0)  # (1, 8)

    @torch.no_grad()
    def _head_is_detachable(self) -> bool:
        parts = self._trunk_and_head()
        if parts is None:
            return False
        tokens = self._probe_tokens()
        # The head scaled by 2**10 (exactly undone after): logits in the hundreds, where a soft cap or a scale
        # applied after the head shows (a freshly initialised model's logits are too small to tell).
        weight = parts[1].weight
        weight.mul_(HEAD_PROBE_SCALE)
        try:
            reference = self.hf_model(input_ids=tokens, **self._forward_kwargs).logits.float()  # (1, 8, V)
            logits = parts[1](self._hidden(parts[0], tokens, None)).float()
            return logits.shape == reference.shape and torch.allclose(logits, reference, rtol=1e-4, atol=1e-3)
        except (TypeError, ValueError, AttributeError, RuntimeError):
            return False
        finally:
            weight.div_(HEAD_PROBE_SCALE)

    @torch.no_grad()
    def _packs_documents(self) -> bool:
        """Two documents in one row (3 + 5 tokens): along each path, the second's logits must be those it has
        alone. The whole model's path serves logits without targets; the trunk's (when the head is detachable)
        is the one the loss, and so training, takes: a mask or argument that only one of them passes shows."""
        tokens = self._probe_tokens()
        positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]], device=tokens.device)
        paths: list[Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]] = [self._whole_logits]
        parts = self._trunk_and_head()
        if self.head_detachable and parts is not None:
            trunk, head = parts
            paths.append(lambda idx, pos: head(self._hidden(trunk, idx, pos)))
        for logits in paths:
            packed, alone = logits(tokens, positions)[:, 3:].float(), logits(tokens[:, 3:], None).float()
            if not torch.allclose(packed, alone, rtol=1e-4, atol=1e-5):
                return False
        return True

    def _whole_logits(self, idx: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        output = self.hf_model(input_ids=idx, position_ids=positions, **self._forward_kwargs)
        self._report_routing(output)
        logits: torch.Tensor = output.logits
        return logits  # (B, T, V)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        last_only: bool = False,
        segments: torch.Tensor | None = None,
        per_token: bool = False,
        temperature: float = 1.0,
    ) -> torch.Tensor:
        parts = self._trunk_and_head()
        if self.head_detachable and parts is not None and (targets is not None or last_only):
            trunk, head = parts
            return logits_or_loss(
                self._hidden(trunk, idx, positions),
                head.weight,
                targets,
                bias=head.bias,
                chunked=self.chunked_loss,
                last_only=last_only,
                segments=segments,
                per_token=per_token,
                temperature=temperature,
            )
        logits = self._whole_logits(idx, positions)
        if targets is None:
            return logits[:, -1:] if last_only else logits
        if per_token:
            if segments is not None:  # as logits_or_loss refuses it on the detachable path
                raise ValueError("per_token and segments exclude each other: per-token values need no segment sums")
            return token_losses_from_logits(logits / temperature, targets)  # (B, T, 2)
        if segments is not None:
            return segment_logits_losses(logits, targets, segments)
        return logits_loss(logits, targets)

    @property
    def activation_checkpointing(self) -> bool:
        return self._checkpointing

    @activation_checkpointing.setter
    def activation_checkpointing(self, on: bool) -> None:
        """transformers' own checkpointing of each decoder layer (non-reentrant, so it composes with DDP/FSDP)."""
        if on == self._checkpointing:
            return
        model: Any = self.hf_model
        if on and not getattr(model, "supports_gradient_checkpointing", False):
            raise ConfigError(
                f"--activation-checkpointing: {self.config.architecture} does not support activation checkpointing "
                "in transformers; leave it off"
            )
        # transformers 5 renamed gradient_checkpointing_* to activation_checkpointing_* (the old names warn)
        prefix = "activation" if hasattr(model, "activation_checkpointing_enable") else "gradient"
        if on:
            getattr(model, f"{prefix}_checkpointing_enable")({"use_reentrant": False})
        else:
            getattr(model, f"{prefix}_checkpointing_disable")()
        self._checkpointing = on

    def blocks(self) -> nn.ModuleList:
        """The repeated decoder blocks: the first ``nn.ModuleList`` whose children are all of one class (e.g.
        ``model.layers``, ``transformer.h``); an empty one when there is no such list. transformers runs them
        (and checkpoints them: :attr:`activation_checkpointing`)."""
        for module in self.hf_model.modules():
            if isinstance(module, nn.ModuleList) and len(module) and len({type(m) for m in module}) == 1:
                return module
        return nn.ModuleList()

    def matrix_layout(self, path: str, module: nn.Module, name: str, param: torch.Tensor) -> MatrixLayout:
        """Read from transformers' layer types and names (:func:`~bigbatch.models.hf.fused_weights.hf_matrix_layout`)
        and the MLP widths of its config."""
        return hf_matrix_layout(module, path, name, param, mlp_widths(self.hf_model.config))

    def lookup_only_parameters(self) -> int:
        """An input embedding that is not also the output head (a lookup, not a matmul). A mixture of experts'
        count holds every expert, so its FLOPs are an upper bound."""
        model: Any = self.hf_model
        embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
        return 0 if head is not None and head.weight is embedding.weight else int(embedding.weight.numel())


class CompiledOrEager(nn.Module):
    """``torch.compile(module)``, or ``module`` itself from the first call on when that call fails to compile (an
    architecture of any kind may not): said in one line, and training goes on eagerly."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.eager = module
        self.compiled: nn.Module | None = torch.compile(module)  # type: ignore[assignment]
        self._proven = False  # a call went through compiled: later failures are real errors, not compile support

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.compiled is None:
            return self.eager(*args, **kwargs)
        if self._proven:
            return self.compiled(*args, **kwargs)
        try:
            output = self.compiled(*args, **kwargs)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # dynamo and inductor fail in many types
            reason = (str(exc).strip().splitlines() or [""])[0][:200]
            log.warning(
                "torch.compile does not work for this model (%s: %s); training without it (--no-compile skips the "
                "attempt)",
                type(exc).__name__,
                reason,
            )
            self.compiled = None
            return self.eager(*args, **kwargs)
        self._proven = True
        return output
