"""Muon for a model's hidden matrices, AdamW for the rest, in one optimizer stepped once per optimizer step.

Muon (Jordan et al., 2024) keeps a momentum of each matrix's gradient and moves the matrix by an approximately
orthogonal version of it: the polar factor ``U V^T`` of ``U S V^T``, from a few Newton-Schulz iterations of an odd
matrix polynomial. The orthogonalisation is not linear in the gradient, so it must see the step's one gradient:
here it runs inside :meth:`MuonAdamW.step`, which the engine calls once after the last backward, the one gradient
sync and the clip; the momentum is built from that gradient. Nothing runs per micro-batch or in a backward hook.

Across processes each matrix has one *owner* rank (owners balanced by size). Under DDP every rank holds the whole
reduced gradient, so each orthogonalises only the matrices it owns and one all-reduce of the updates (zeros where
a rank is not the owner: adding zero is exact) gives every rank all of them. Under FSDP2 a matrix is sharded by
rows: its owner gathers the rows, orthogonalises the whole matrix and scatters the update's rows back. Either way
the update equals one process's on the same gradient.

The momentum lives in the optimizer state like AdamW's moments, created at construction (zeros), so every rank
has the same keys from step 0 and a distributed checkpoint saves and reshards it like any other state.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.optim.adamw import adamw as adamw_update

from bigbatch.errors import ConfigError
from bigbatch.models.routing import is_router_path

QUINTIC = (3.4445, -4.7750, 2.0315)
"""Jordan's quintic: steep at zero, so five iterations move every singular value above about 1e-2 of the matrix's
Frobenius norm (by which it is first divided) into roughly 0.68-1.2 (never to exactly 1: it trades the limit for
speed)."""

POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
"""Amsel et al., 2025 ("The Polar Express", arXiv 2505.16932): a different minimax-optimal quintic per iteration
for singular values in [1e-3, 1] after the division by the Frobenius norm; five leave those in about 0.86-1.14."""

CONVERGENT = (15 / 8, -10 / 8, 3 / 8)
"""The classical quintic Newton-Schulz step: 1 is a fixed point with zero first and second derivatives, so from
the band above each iteration roughly cubes the distance to 1. ``polar-express`` runs it after its five."""

COEFFICIENTS = ("quintic", "polar-express")
SCALES = ("rms", "spectral")
NORM_EPS = 1e-7  # keeps a zero gradient's update zero


def iteration_coefficients(name: str, steps: int) -> list[tuple[float, float, float]]:
    """The ``(a, b, c)`` of each of ``steps`` iterations ``X <- a X + b (X X^T) X + c (X X^T)^2 X``."""
    if steps < 1:
        raise ValueError(f"Newton-Schulz needs at least one iteration, got {steps}")
    if name == "quintic":
        return [QUINTIC] * steps
    if name == "polar-express":
        return list(POLAR_EXPRESS[:steps]) + [CONVERGENT] * max(0, steps - len(POLAR_EXPRESS))
    raise ValueError(f"unknown Newton-Schulz coefficients {name!r}; choose one of {', '.join(COEFFICIENTS)}")


def orthogonalise(matrix: torch.Tensor, steps: int = 5, coefficients: str = "quintic") -> torch.Tensor:
    """An approximately orthogonal matrix with ``matrix``'s singular vectors: ``matrix`` (..., m, n), each trailing
    (m, n) matrix on its own (an MoE's expert stack (E, m, n) gives E of them). Computed in fp32 (float64 stays
    float64), normalised by the Frobenius norm first (which bounds the spectral norm), on the wide orientation so
    the Gram matrix is the smaller one; the result has ``matrix``'s dtype."""
    x = matrix if matrix.dtype == torch.float64 else matrix.float()
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + NORM_EPS)
    for a, b, c in iteration_coefficients(coefficients, steps):
        gram = x @ x.mT  # (..., min, min)
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    if tall:
        x = x.mT
    return x.to(matrix.dtype)


def update_scale(shape: Sequence[int], scale: str) -> float:
    """The factor on an orthogonalised update of a matrix of ``shape`` (..., m, n). ``rms``: 0.2 sqrt(max(m, n)),
    which gives the update the RMS of a typical AdamW update (Liu et al., 2025, "Muon is scalable"), so AdamW's
    learning rate and weight decay carry over. ``spectral``: sqrt(max(1, m / n)) (Jordan's; its learning rate is
    about 0.02)."""
    m, n = int(shape[-2]), int(shape[-1])
    if scale == "rms":
        return 0.2 * math.sqrt(max(m, n))
    if scale == "spectral":
        return math.sqrt(max(1.0, m / n))
    raise ValueError(f"unknown Muon update scale {scale!r}; choose one of {', '.join(SCALES)}")


def newton_schulz_flops(shape: Sequence[int], steps: int = 5) -> int:
    """The multiply-add FLOPs (2 per multiply-add) of ``steps`` iterations on a matrix of ``shape`` (..., m, n),
    with ``s = min(m, n)``, ``l = max(m, n)``: the Gram matrix (s x l x s), its square (s^3) and the product with
    ``X`` (s x s x l), each iteration."""
    *batch, m, n = (int(d) for d in shape)
    small, large = min(m, n), max(m, n)
    return math.prod(batch) * steps * 2 * (2 * small * small * large + small**3)


@dataclass(frozen=True)
class MuonSettings:
    """Muon's own settings (the AdamW group keeps ``--lr``, the betas, epsilon and ``--weight-decay``)."""

    lr: float  # the Muon group's peak learning rate (the schedule scales it as it scales --lr)
    momentum: float = 0.95
    weight_decay: float = 0.1
    ns_steps: int = 5
    coefficients: str = "quintic"
    scale: str = "rms"

    def __post_init__(self) -> None:
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"--muon-momentum must be in [0, 1), got {self.momentum:g}")
        if self.ns_steps < 1:
            raise ConfigError(f"--muon-ns-steps must be at least 1 (Newton-Schulz iterations), got {self.ns_steps}")
        if self.coefficients not in COEFFICIENTS:
            choices = ", ".join(COEFFICIENTS)
            raise ConfigError(f"--muon-coefficients must be one of {choices}, got {self.coefficients!r}")
        if self.scale not in SCALES:
            raise ConfigError(f"--muon-scale must be one of {', '.join(SCALES)}, got {self.scale!r}")

    def describe(self) -> str:
        """E.g. ``Muon lr 2e-3, momentum 0.95 (Nesterov), weight decay 0.1, 5 quintic Newton-Schulz iterations,
        update RMS matched to AdamW's (0.2 sqrt(max(m, n)))``."""
        scale = "update x sqrt(max(1, m/n))"
        if self.scale == "rms":
            scale = "update RMS matched to AdamW's (0.2 sqrt(max(m, n)))"
        return (
            f"Muon lr {self.lr:g}, momentum {self.momentum:g} (Nesterov), weight decay {self.weight_decay:g}, "
            f"{self.ns_steps} {self.coefficients} Newton-Schulz iterations, {scale}"
        )


# ---- which parameters Muon trains ----------------------------------------------------------------------------


def muon_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The hidden matrices Muon trains, by role and shape, for every family: trainable parameters of two or more
    dimensions (an MoE's expert stacks (E, m, n) are E matrices) inside the model's repeated blocks, each dimension
    above 1, routers left out. Embeddings, position tables, the head and every gain and bias are outside the blocks
    or one-dimensional: AdamW trains them."""
    listed = getattr(model, "blocks", None)
    blocks = listed() if callable(listed) else []
    found: list[tuple[str, nn.Parameter]] = []
    seen: set[int] = set()
    for index, block in enumerate(blocks):
        for module_name, module in block.named_modules():
            if is_router_path(module_name):
                continue
            for name, param in module.named_parameters(recurse=False):
                full = f"{index}.{module_name}.{name}" if module_name else f"{index}.{name}"
                if param.requires_grad and param.dim() >= 2 and min(param.shape) > 1 and id(param) not in seen:
                    seen.add(id(param))
                    found.append((full, param))
    return found


# ---- sharing the work across processes ------------------------------------------------------------------------


def _is_sharded(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "to_local") and hasattr(tensor, "placements")


def balanced_owners(sizes: Sequence[int], world_size: int) -> list[int]:
    """An owner rank per matrix: largest first, each to the rank with the least work so far (ties: the lowest
    rank), the same on every rank."""
    load = [0] * world_size
    owners = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[index] = rank
        load[rank] += sizes[index]
    return owners


def _row_counts(rows: int, world_size: int) -> list[int]:
    """The rows each rank holds of a dimension FSDP2 shards: ``torch.chunk``'s pieces, then empty ones."""
    pieces = [len(c) for c in torch.arange(rows).chunk(world_size)]
    return pieces + [0] * (world_size - len(pieces))


class MatrixSharing:
    """Who orthogonalises which matrix, and how the updates reach every process (see the module's doc)."""

    def __init__(self, world_size: int = 1, rank: int = 0) -> None:
        self.world_size, self.rank = world_size, rank

    @classmethod
    def from_process_group(cls) -> MatrixSharing:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_world_size(), dist.get_rank())
        return cls()

    def owners(self, params: Sequence[torch.Tensor]) -> list[int]:
        return balanced_owners([p.numel() for p in params], self.world_size)

    def orthogonalised(
        self,
        params: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        compute: Callable[[torch.Tensor], torch.Tensor],
    ) -> list[torch.Tensor]:
        """``compute`` of each whole matrix ``inputs[i]`` (this rank's piece of it, shaped like ``params[i]``'s),
        run once in the job by its owner; this rank's piece of each result."""
        if self.world_size == 1:
            return [compute(x) for x in inputs]
        owners = self.owners(params)
        results: list[torch.Tensor | None] = [None] * len(inputs)
        replicated = [i for i, p in enumerate(params) if not _is_sharded(p)]
        for i, param in enumerate(params):
            if _is_sharded(param):
                results[i] = self._through_owner(param, inputs[i], owners[i], compute)
        if replicated:
            pieces = [compute(inputs[i]) if owners[i] == self.rank else torch.zeros_like(inputs[i]) for i in replicated]
            flat = torch.cat([piece.reshape(-1) for piece in pieces])
            import torch.distributed as dist

            dist.all_reduce(flat)  # one owner each, zeros elsewhere: the sum is the owner's update, exactly
            for i, piece in zip(replicated, flat.split([p.numel() for p in pieces]), strict=True):
                results[i] = piece.view_as(inputs[i])
        return [r for r in results if r is not None]  # every index was filled above

    def _through_owner(
        self, param: torch.Tensor, local: torch.Tensor, owner: int, compute: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """A row-sharded matrix: its rows gathered on ``owner`` (padded to one size), ``compute`` there on the whole,
        the result's rows scattered back; this rank's rows of it."""
        import torch.distributed as dist

        placements = param.placements  # type: ignore[attr-defined]
        if len(placements) != 1 or getattr(placements[0], "dim", None) != 0:
            raise ValueError(f"Muon takes parameters sharded by rows (FSDP2's Shard(0)), got {placements}")
        counts = _row_counts(int(param.shape[0]), self.world_size)
        if local.shape[0] != counts[self.rank]:
            shape = tuple(param.shape)
            raise ValueError(f"expected {counts[self.rank]} rows of a {shape} matrix, got {local.shape[0]}")
        width = max(counts)
        padded = local.new_zeros((width, *local.shape[1:]))
        padded[: local.shape[0]] = local
        mine = self.rank == owner
        gathered = [torch.empty_like(padded) for _ in range(self.world_size)] if mine else None
        dist.gather(padded, gathered, dst=owner)
        pieces: list[torch.Tensor] | None = None
        if mine and gathered is not None:
            whole = torch.cat([g[:count] for g, count in zip(gathered, counts, strict=True)])
            result = compute(whole)
            pieces = []
            for count, chunk in zip(counts, _split_rows(result, counts), strict=True):
                piece = result.new_zeros((width, *result.shape[1:]))
                piece[:count] = chunk
                pieces.append(piece)
        received = torch.empty_like(padded)
        dist.scatter(received, pieces, src=owner)
        return received[: local.shape[0]]


def _split_rows(tensor: torch.Tensor, counts: Sequence[int]) -> list[torch.Tensor]:
    return list(tensor.split(list(counts)))


# ---- the optimizer --------------------------------------------------------------------------------------------


class MuonAdamW(torch.optim.Optimizer):
    """Muon for the param groups marked ``muon: True``, AdamW for the others, as one optimizer (one ``step``, one
    state for checkpoints, one GradScaler). A Muon group's keys: ``lr``, ``momentum``, ``weight_decay``,
    ``ns_steps``, ``coefficients``, ``scale``; an AdamW group's: ``lr``, ``betas``, ``eps``, ``weight_decay``.
    Both decay decoupled from the gradient (``p <- p (1 - lr wd)``)."""

    def __init__(
        self,
        groups: Iterable[dict[str, Any]],
        *,
        muon: MuonSettings,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        sharing: MatrixSharing | None = None,
        stored_transposed: Iterable[torch.Tensor] = (),
    ) -> None:
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": 0.0,
            "muon": False,
            "momentum": muon.momentum,
            "ns_steps": muon.ns_steps,
            "coefficients": muon.coefficients,
            "scale": muon.scale,
        }
        super().__init__(list(groups), defaults)
        self.settings, self.peak_lr = muon, lr
        # weights stored (in, out), as transformers' Conv1D (GPT-2) stores them: the spectral scale reads (out, in)
        self._transposed = {id(p) for p in stored_transposed}
        self.sharing = sharing or MatrixSharing.from_process_group()
        self.orthogonalisations = 0  # Newton-Schulz runs on this process (a test counts them per step)
        for group in self.param_groups:  # every state now: the same keys on every rank from step 0
            for param in group["params"]:
                if group["muon"]:
                    buffer = torch.zeros_like(param, memory_format=torch.preserve_format)
                    self.state[param] = {"momentum_buffer": buffer}
                else:
                    self.state[param] = {
                        "step": torch.tensor(0.0, dtype=torch.float32),
                        "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
                    }

    def describe(self) -> str:
        """The header's line: what each half trains and with what."""
        muon = [p for g in self.param_groups if g["muon"] for p in g["params"]]
        adamw = [g for g in self.param_groups if not g["muon"]]
        rest = [p for g in adamw for p in g["params"]]
        decay = max((float(g["weight_decay"]) for g in adamw), default=0.0)
        beta1, beta2 = self.defaults["betas"]
        shared = (
            f", each matrix orthogonalised by one of {self.sharing.world_size} ranks (owners balanced by size)"
            if self.sharing.world_size > 1
            else ""
        )
        return (
            f"{self.settings.describe()}: {len(muon)} hidden matrices ({sum(p.numel() for p in muon) / 1e6:,.2f}M "
            f"parameters){shared} | AdamW lr {self.peak_lr:g}, betas ({beta1:g}, {beta2:g}), eps "
            f"{self.defaults['eps']:g}, weight decay {decay:g} (not on gains and biases): {len(rest)} other tensors "
            f"(embeddings, head, routers, gains, biases; {sum(p.numel() for p in rest) / 1e6:,.2f}M)"
        )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["muon"]:
                self._muon_step(group)
            else:
                self._adamw_step(group)
        return loss

    def _muon_step(self, group: dict[str, Any]) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        momentum, lr, decay = float(group["momentum"]), float(group["lr"]), float(group["weight_decay"])
        inputs = []
        for param in params:
            grad = _local(param.grad)
            buffer = _local(self.state[param]["momentum_buffer"])
            buffer.lerp_(grad, 1 - momentum)  # an average of past gradients, its weights summing to one
            inputs.append(grad.lerp(buffer, momentum))  # Nesterov: the gradient pulled toward where momentum goes

        steps, coefficients = int(group["ns_steps"]), str(group["coefficients"])

        def compute(matrix: torch.Tensor) -> torch.Tensor:
            self.orthogonalisations += 1
            return orthogonalise(matrix, steps, coefficients)

        updates = self.sharing.orthogonalised(params, inputs, compute)
        for param, update in zip(params, updates, strict=True):
            weights = _local(param)
            if decay:
                weights.mul_(1 - lr * decay)
            shape = tuple(param.shape)
            if id(param) in self._transposed:
                shape = (*shape[:-2], shape[-1], shape[-2])
            weights.add_(update.to(weights.dtype), alpha=-lr * update_scale(shape, str(group["scale"])))

    def _adamw_step(self, group: dict[str, Any]) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adamw_update(
            params,
            [p.grad for p in params],
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [],
            [s["step"] for s in states],
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a sharded tensor (FSDP2's DTensor), the tensor itself otherwise."""
    local: torch.Tensor = tensor.to_local() if _is_sharded(tensor) else tensor  # type: ignore[attr-defined]
    return local


def build_muon(
    model: nn.Module,
    settings: MuonSettings,
    lr: float,
    weight_decay: float = 0.1,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    sharing: MatrixSharing | None = None,
) -> MuonAdamW:
    """:class:`MuonAdamW` over ``model``: Muon for :func:`muon_parameters` (its learning rate ``settings.lr``, held as
    a multiple ``lr_scale`` of ``lr`` so the schedule and batch changes move both alike), AdamW for the rest with
    weight decay on the tensors of two or more dimensions (embeddings, the head), none on gains and biases."""
    matrices = [param for _, param in muon_parameters(model)]
    if not matrices:
        raise ConfigError(
            "--optimizer muon found no hidden matrix in the model's blocks to orthogonalise (it trains 2-D "
            "projections inside the repeated blocks); use --optimizer adamw"
        )
    chosen = set(map(id, matrices))
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in chosen]
    groups: list[dict[str, Any]] = [
        {
            "params": matrices,
            "muon": True,
            "lr": settings.lr,
            "lr_scale": settings.lr / lr,
            "weight_decay": settings.weight_decay,
            "momentum": settings.momentum,
            "ns_steps": settings.ns_steps,
            "coefficients": settings.coefficients,
            "scale": settings.scale,
        },
        {"params": [p for p in rest if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0},
    ]
    transposed: list[torch.Tensor] = [
        module.weight  # type: ignore[misc]
        for module in model.modules()
        if type(module).__name__ == "Conv1D" and id(module.weight) in chosen
    ]
    return MuonAdamW(
        [g for g in groups if g["params"]],
        muon=settings,
        lr=lr,
        betas=betas,
        eps=eps,
        sharing=sharing,
        stored_transposed=transposed,
    )
