"""Whole-matrix work split across processes: each matrix has one owner rank, which computes a function of the
whole matrix (Muon's Newton-Schulz orthogonalisation) once in the job, and every process gets its part of the result.

* One process: the function of each matrix, here.
* Replicated matrices (DDP: every rank holds the whole reduced gradient): each rank computes the matrices it owns
  and writes them into one flat buffer, zeros elsewhere; one all-reduce gives every rank every result (adding
  zero is exact, so each result is its owner's, bit for bit).
* Row-sharded matrices (FSDP2's ``Shard(0)``, ``torch.chunk`` pieces: a rank may hold no rows): every gather of
  row pieces to their owners is started at once, each owner computes its whole matrices while the others compute
  theirs, and every scatter of the results' rows back is started at once.

Owners are fixed when the matrices are named (largest first, each to the least-loaded rank), the same on every
rank, so the collectives match across ranks step after step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

Compute = Callable[[int, torch.Tensor], torch.Tensor]
"""``compute(index, whole)``: the result for matrix ``index`` of the whole (gathered) matrix ``whole``."""


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


def row_counts(rows: int, world_size: int) -> list[int]:
    """The rows each rank holds of a dimension FSDP2 shards: ``torch.chunk``'s pieces, then empty ones."""
    pieces = [len(c) for c in torch.arange(rows).chunk(world_size)]
    return pieces + [0] * (world_size - len(pieces))


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (FSDP2's sharded parameters, gradients and optimizer state)."""
    return hasattr(tensor, "to_local") and hasattr(tensor, "placements")


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a sharded tensor, the tensor itself otherwise."""
    local: torch.Tensor = tensor.to_local() if is_sharded(tensor) else tensor  # type: ignore[attr-defined]
    return local


class MatrixOwners:
    """The owner of each of a fixed list of matrices (``params``: their global shapes and how they are held), and
    :meth:`compute_once`, which runs a function of each whole matrix on its owner only."""

    def __init__(self, params: Sequence[torch.Tensor], world_size: int = 1, rank: int = 0) -> None:
        self.world_size, self.rank = world_size, rank
        self.owners = balanced_owners([p.numel() for p in params], world_size)
        self._sharded = [is_sharded(p) for p in params]
        self._rows = [int(p.shape[0]) for p in params]
        for param in params:
            placements = getattr(param, "placements", None)
            if placements is not None and (len(placements) != 1 or getattr(placements[0], "dim", None) != 0):
                raise ValueError(
                    f"whole-matrix work takes tensors sharded by rows (FSDP2's Shard(0)), got {placements}"
                )

    def compute_once(
        self, indices: Sequence[int], inputs: Sequence[torch.Tensor], compute: Compute
    ) -> list[torch.Tensor]:
        """``compute`` of each whole matrix ``indices[k]``, whose part on this rank is ``inputs[k]``, run by its
        owner alone; this rank's part of each result, in order. Every rank passes the same ``indices``."""
        if self.world_size == 1:
            return [compute(i, x) for i, x in zip(indices, inputs, strict=True)]
        results: list[torch.Tensor | None] = [None] * len(indices)
        for sharded, run in ((True, self._through_owners), (False, self._shared)):
            chosen = [k for k, i in enumerate(indices) if self._sharded[i] is sharded]
            if chosen:  # every rank has the same: the collectives match
                parts = run([indices[k] for k in chosen], [inputs[k] for k in chosen], compute)
                for k, part in zip(chosen, parts, strict=True):
                    results[k] = part
        done = [r for r in results if r is not None]
        assert len(done) == len(indices), "every matrix is sharded or replicated"
        return done

    def _shared(self, indices: Sequence[int], inputs: Sequence[torch.Tensor], compute: Compute) -> list[torch.Tensor]:
        """Replicated matrices: the owned results written into one zeroed flat buffer, summed over ranks."""
        import torch.distributed as dist

        sizes = [x.numel() for x in inputs]
        flat = inputs[0].new_zeros(sum(sizes))
        views = list(flat.split(sizes))
        for index, x, view in zip(indices, inputs, views, strict=True):
            if self.owners[index] == self.rank:
                view.copy_(compute(index, x).reshape(-1))
        dist.all_reduce(flat)  # one owner each, zeros elsewhere: each sum is its owner's result, exactly
        return [view.view_as(x) for view, x in zip(views, inputs, strict=True)]

    def _through_owners(
        self, indices: Sequence[int], locals_: Sequence[torch.Tensor], compute: Compute
    ) -> list[torch.Tensor]:
        """Row-sharded matrices: every gather to the owners started together, each owner computing its own whole
        matrices, then every scatter of the results' rows started together; this rank's rows of each result."""
        import torch.distributed as dist

        padded, gathered, counts = [], [], []
        handles = []
        for index, local in zip(indices, locals_, strict=True):
            rows = row_counts(self._rows[index], self.world_size)
            if local.shape[0] != rows[self.rank]:
                raise ValueError(
                    f"expected {rows[self.rank]} rows of matrix {index} on this rank, got {local.shape[0]}"
                )
            piece = local.new_zeros((max(rows), *local.shape[1:]))  # every rank sends one size
            piece[: local.shape[0]] = local
            owner = self.owners[index]
            into = [torch.empty_like(piece) for _ in range(self.world_size)] if owner == self.rank else None
            handles.append(dist.gather(piece, into, dst=owner, async_op=True))
            padded.append(piece)
            gathered.append(into)
            counts.append(rows)
        for handle in handles:
            handle.wait()
        handles, received = [], []
        for index, piece, into, rows in zip(indices, padded, gathered, counts, strict=True):
            pieces = None
            if into is not None:  # this rank owns it: the whole matrix, its result, the result's rows padded
                whole = torch.cat([g[:n] for g, n in zip(into, rows, strict=True)])
                result = compute(index, whole)
                pieces = []
                for n, chunk in zip(rows, result.split(rows), strict=True):
                    out = result.new_zeros(piece.shape)
                    out[:n] = chunk
                    pieces.append(out)
            back = torch.empty_like(piece)
            handles.append(dist.scatter(back, pieces, src=self.owners[index], async_op=True))
            received.append(back)
        for handle in handles:
            handle.wait()
        return [back[: rows[self.rank]] for back, rows in zip(received, counts, strict=True)]
