"""Replay: one micro-batch's gradient contribution computed again and compared bit for bit.

With exact accumulation a step's gradient is the sum of its micro-batches' contributions, each a deterministic
function of the parameters, the micro-batch, the loss scale and the generators' state. So one drawn micro-batch's
contribution can be captured as it is computed (tensor hooks on the parameters see it before it is added to
``.grad`` and before any cross-rank reduction), computed again from the same inputs, and compared through a digest
of its bits: a wrong value that raised no error (a bit flipped by a device) shows as a different digest. The
comparison is bitwise, so it holds only where kernels are deterministic (CPU; CUDA with deterministic algorithms,
which the run turns on with ``--replay-every``).

What a replay can tell:

* One process re-runs its own micro-batch on its own device. A fault that gives a different wrong value each time
  (or once) shows; a fault that gives the **same** wrong value every time does not: the device reproduces its own
  wrong digest. When the re-run differs, a third run tells a one-off (the third equals the re-run) from a device
  that computes differently every time (all three differ).
* Several processes: rank ``r`` re-runs rank ``r - 1``'s micro-batch (a ring), and only where a digest differs does
  every rank re-run its own as well (:func:`judge`). A rank whose first run differs from its own re-run, which
  equals its peer's, computed wrongly once (a transient fault: a bad step). A rank whose three values all differ
  is faulty. A fault that repeats its value is a disagreement between two ranks each consistent with itself: with
  three or more ranks the faulty one is the rank in two of them (its digest is not reproduced by the next rank and
  it does not reproduce the previous rank's). With two ranks every disagreement involves both, and the digests
  cannot tell which is wrong: a float64 recomputation on the host breaks the tie where it can (:func:`vote`).

A faulty device stops the run (:class:`DeviceSuspect`): every micro-batch it computes is suspect, so dropping the
replayed one and applying its others would train on wrong values.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn as nn

from bigbatch.engine.bad_steps import REPLAY_MISMATCH, BadStep, Suspect, describe_origin
from bigbatch.engine.rng import capture_rng_state, restore_rng_state
from bigbatch.errors import TrainingError
from bigbatch.parallel.distributed import DistContext

log = logging.getLogger(__name__)

DEVICE_SUSPECT = "device suspect"  # the verdict of a rank whose device a replay found computing wrongly
CHECKSUM_WIDTH = 1024  # 32-bit words per int64 checksum: 1/512 of a gradient's bytes are copied to the host
CHECKSUM_ROWS = 1 << 14  # rows checksummed at once: bounds the int64 temporary at 128 MiB
REFERENCE_MAX_PARAMETERS = 1 << 28  # the largest model copied to the host in float64 (2 GiB) to break a tie


def digest(tensors: Sequence[torch.Tensor | None]) -> str:
    """SHA-256 of the tensors' bits, in order (a missing gradient counts as a marker of its own).

    A tensor on the host is hashed in place (no copy). One on an accelerator is first reduced there to exact
    checksums (:func:`checksums`), so only 1/512 of its bytes crosses to the host: SHA-256 runs at about 1 GB/s on
    a host core, half a second for GPT-2's 500 MB of gradient, many micro-batches' worth on a GPU."""
    hasher = hashlib.sha256()
    for tensor in tensors:
        if tensor is None:
            hasher.update(b"none")
            continue
        hasher.update(str(tuple(tensor.shape)).encode())
        flat = tensor.detach().contiguous().view(-1)
        if flat.device.type != "cpu":
            flat = checksums(flat).cpu()
        hasher.update(flat.view(torch.uint8).numpy().data)  # the array's buffer: hashed without a copy
    return hasher.hexdigest()


def checksums(tensor: torch.Tensor) -> torch.Tensor:
    """Exact checksums of a tensor's bits, computed where it lies: its bytes as 32-bit words (bytes where the size
    is not a multiple of 4), in rows of 1,024, each row's ``sum(word_j x (2j + 1))`` in int64.

    Exact: a word is below 2^31 and a weight below 2^11, so a row's sum stays below 2^53 (no overflow, and integer
    sums do not depend on their order). Any single flipped bit ``b`` of word ``j`` moves its row's sum by
    ``2^b x (2j + 1)``, never zero; two flips cancel only at the same bit of the same word."""
    flat = tensor.detach().contiguous().view(-1)
    words = flat.view(torch.int32) if (flat.numel() * flat.element_size()) % 4 == 0 else flat.view(torch.uint8)
    pad = (-words.numel()) % CHECKSUM_WIDTH
    if pad:
        words = torch.cat([words, words.new_zeros(pad)])
    rows = words.view(-1, CHECKSUM_WIDTH)
    weights = torch.arange(CHECKSUM_WIDTH, dtype=torch.int64, device=rows.device) * 2 + 1
    parts = [
        (rows[start : start + CHECKSUM_ROWS].to(torch.int64) * weights).sum(dim=1)
        for start in range(0, rows.shape[0], CHECKSUM_ROWS)
    ]
    return torch.cat(parts) if parts else weights.new_zeros(0)


class ContributionCapture:
    """While armed, each parameter's incoming gradient (one micro-batch's contribution, before ``.grad`` adds it
    and before DDP reduces it) is kept, in parameter order."""

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.grads: list[torch.Tensor | None] = [None] * len(self.params)
        self._handles: list[Any] = []

    def __enter__(self) -> ContributionCapture:
        for index, param in enumerate(self.params):
            self._handles.append(param.register_hook(self._keeper(index)))
        return self

    def _keeper(self, index: int) -> Callable[[torch.Tensor], None]:
        def keep(grad: torch.Tensor) -> None:
            self.grads[index] = grad.detach().clone()

        return keep

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


@dataclass
class DrawnMicroBatch:
    """What the first pass keeps of the drawn micro-batch: itself (on the host), the generators before its
    forward, and its contribution's digest."""

    index: int
    batch: Any
    rng: dict[str, Any]
    first: str = ""


ContributionFn = Callable[[nn.Module, Any], torch.Tensor]
"""``objective(module, micro_batch_on_device)``: the scaled loss the first pass back-propagated for it."""


def contribution(
    module: nn.Module,
    params: Sequence[nn.Parameter],
    drawn: DrawnMicroBatch,
    objective: ContributionFn,
    device: torch.device,
) -> list[torch.Tensor | None]:
    """The drawn micro-batch's contribution computed again through ``module`` (the local module: no cross-rank
    reduction), from the generators it first ran with; the generators are left as they were. ``autograd.grad``
    returns each gradient after the parameters' hooks (a fault's too), as the first pass's capture saw it."""
    trained = [p for p in params if p.requires_grad]
    after = capture_rng_state()
    try:
        restore_rng_state(drawn.rng)
        loss = objective(module, drawn.batch.to(device))
        grads = torch.autograd.grad(loss, trained, allow_unused=True)
    finally:
        restore_rng_state(after)
    return list(grads)


# ---- what the re-runs say -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplayCheck:
    """One rank's drawn micro-batch at a replay: the ranks that re-ran it and whether every re-run matched its
    first digest (a ``kind: replay`` record in ``metrics.jsonl``)."""

    rank: int
    micro: int
    rerun_by: tuple[int, ...]
    matched: bool

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "micro_batch": self.micro, "rerun_by": list(self.rerun_by), "matched": self.matched}


@dataclass(frozen=True)
class ReplayRow:
    """A rank's drawn micro-batch at a replay of several processes: its first digest, the next rank's re-run's, and
    its own re-run's (``""`` until it re-runs it)."""

    micro: int
    first: str
    by_next: str
    again: str = ""


@dataclass
class Judgement:
    """What the digests of one replay say: transient faults (bad steps), faulty ranks (rank -> why) and the
    disagreements of two ranks each consistent with itself that no faulty rank explains (``(owner, peer)``: the
    rank whose micro-batch it is, and the next rank, which computes it otherwise)."""

    transient: list[Suspect] = field(default_factory=list)
    faulty: dict[int, str] = field(default_factory=dict)
    disputes: list[tuple[int, int]] = field(default_factory=list)


def judge_alone(micro: int, first: str, again: str, third: str) -> Judgement:
    """One process whose re-run differed from its first run, and a third run: which of the three is the odd one.
    (A fault that repeats its value never gets here: the re-run equals the first run.)"""
    if third == again:
        detail = "its first run differs from its re-run, which a third run reproduces"
        return Judgement(transient=[Suspect(0, micro, REPLAY_MISMATCH, verdict="transient", detail=detail)])
    if third == first:  # the re-run was the odd one: the contribution the step holds is reproduced
        return Judgement()
    return Judgement(faulty={0: f"micro-batch {micro}'s gradient came out three ways in three runs"})


def judge(rows: Sequence[ReplayRow], world_size: int) -> Judgement:
    """Each rank's :class:`ReplayRow` (the own re-runs done, as some digest differed) into a :class:`Judgement`."""
    judgement, pairs = Judgement(), []
    for rank, row in enumerate(rows):
        peer = (rank + 1) % world_size
        if row.first == row.by_next:
            continue
        if row.again == row.by_next:  # this rank's device agrees with its peer's now: it was wrong once
            detail = f"its first run differs from its re-run, which equals rank {peer}'s"
            judgement.transient.append(Suspect(rank, row.micro, REPLAY_MISMATCH, verdict="transient", detail=detail))
        elif row.again != row.first:
            judgement.faulty[rank] = (
                f"its micro-batch {row.micro} came out three ways: its first run, its own re-run and rank {peer}'s "
                "re-run all differ"
            )
        else:
            pairs.append((rank, peer))
    for rank in range(world_size):  # a repeating fault: a rank at odds with both of its neighbours
        partners = {owner if peer == rank else peer for owner, peer in pairs if rank in (owner, peer)}
        if len(partners) >= 2 and rank not in judgement.faulty:
            before, after = (rank - 1) % world_size, (rank + 1) % world_size
            judgement.faulty[rank] = (
                f"rank {after} does not reproduce its micro-batch {rows[rank].micro} and it does not reproduce rank "
                f"{before}'s micro-batch {rows[before].micro}, each rank the same way every time (a fault that "
                "repeats its value)"
            )
    seen: set[frozenset[int]] = set()
    for owner, peer in pairs:
        ranks = frozenset((owner, peer))
        if ranks & judgement.faulty.keys() or ranks in seen:
            continue  # explained by a faulty rank, or the same two ranks' other disagreement
        seen.add(ranks)
        judgement.disputes.append((owner, peer))
    return judgement


# ---- a tie between two ranks -----------------------------------------------------------------------------------


def host_reference(
    module: nn.Module, params: Sequence[nn.Parameter], drawn: DrawnMicroBatch, loss_sum: ContributionFn, scale: float
) -> list[torch.Tensor | None] | None:
    """The drawn micro-batch's contribution computed in float64 on the host from a copy of ``module`` (``loss_sum``
    x ``scale``, no autocast): another device and another precision than the ranks', to break a tie between two.
    ``None`` where it cannot be: a model over :data:`REFERENCE_MAX_PARAMETERS`, or a forward that does not run in
    float64 on the host (then the tie stays, and the run still stops). With dropout on, the host draws its own
    masks, so the reference is near neither rank and :func:`vote` decides nothing."""
    if sum(p.numel() for p in module.parameters()) > REFERENCE_MAX_PARAMETERS:
        return None
    memo: dict[int, Any] = {}
    for tensor in (*module.parameters(), *module.buffers()):
        moved = tensor.detach().to("cpu", torch.float64 if tensor.is_floating_point() else tensor.dtype)
        memo[id(tensor)] = nn.Parameter(moved, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else moved
    after = capture_rng_state()
    try:
        host = copy.deepcopy(module, memo)  # the parameters and buffers come from the memo: never copied on the device
        trained = [memo[id(p)] for p in params if p.requires_grad]
        restore_rng_state(drawn.rng)
        loss = loss_sum(host, drawn.batch.to("cpu")).double() * scale
        grads = torch.autograd.grad(loss, trained, allow_unused=True)
    except (RuntimeError, TypeError, ValueError, KeyError):  # best effort: a tie it cannot break stays a tie
        return None
    finally:
        restore_rng_state(after)
    return list(grads)


def vote(
    owner: Sequence[torch.Tensor | None], peer: Sequence[torch.Tensor | None], reference: Sequence[torch.Tensor | None]
) -> int | None:
    """Which of two ranks' values of the same gradient tensors is the odd one against a float64 reference: ``0``
    the owner's, ``1`` the peer's, ``None`` when the reference is not clearly nearer one of them. Measured where the
    two differ: the one whose distance to the reference is at most a quarter of the distance between the two is
    the healthy one (rounding of another device and precision is far below a flipped high bit)."""
    between = to_owner = to_peer = 0.0
    for a, b, ref in zip(owner, peer, reference, strict=True):
        if a is None or b is None or ref is None:
            continue
        a64, b64, ref64 = a.double(), b.double(), ref.double()
        differ = a64 != b64
        between += float(((a64 - b64)[differ] ** 2).sum())
        to_owner += float(((a64 - ref64)[differ] ** 2).sum())
        to_peer += float(((b64 - ref64)[differ] ** 2).sum())
    if not (math.isfinite(between) and math.isfinite(to_owner) and math.isfinite(to_peer)) or between == 0:
        return None
    if math.sqrt(to_peer) <= math.sqrt(between) / 4:
        return 0
    if math.sqrt(to_owner) <= math.sqrt(between) / 4:
        return 1
    return None


class DeviceSuspect(TrainingError):
    """A replay found a rank's device computing wrongly: the run stops rather than apply steps computed on it.
    ``bad`` is its ``kind: bad_step`` record, ``checks`` the step's replays."""

    def __init__(self, message: str, bad: BadStep, checks: Sequence[ReplayCheck]) -> None:
        super().__init__(message)
        self.bad = bad
        self.checks = list(checks)


def replay_alone(
    drawn: DrawnMicroBatch, rerun: Callable[[DrawnMicroBatch], str]
) -> tuple[Judgement, list[ReplayCheck]]:
    """One process: the drawn micro-batch re-run on its own device, a third time when the re-run differs."""
    again = rerun(drawn)
    if again == drawn.first:
        return Judgement(), [ReplayCheck(0, drawn.index, (0,), True)]
    judgement = judge_alone(drawn.index, drawn.first, again, rerun(drawn))
    if not (judgement.transient or judgement.faulty):
        log.warning(
            "micro-batch %d's re-run differed from its first run, and a third run equals the first", drawn.index
        )
    return judgement, [ReplayCheck(0, drawn.index, (0, 0), False)]


# ---- several processes -----------------------------------------------------------------------------------------


def replay_ring(
    dist: DistContext, drawn: DrawnMicroBatch, rerun: Callable[[DrawnMicroBatch], str]
) -> tuple[Judgement, list[ReplayCheck], list[DrawnMicroBatch]]:
    """Each rank re-runs the previous rank's drawn micro-batch (every rank's is sent to every rank, with its
    generators' state); only when a digest differs does every rank re-run its own too. The judgement, each rank's
    :class:`ReplayCheck` and every rank's drawn micro-batch (for :func:`break_ties`). Collective: every rank calls
    it."""
    world, rank = dist.world_size, dist.rank
    shared = [DrawnMicroBatch(*sent) for sent in dist.all_gather_object((drawn.index, drawn.batch, drawn.rng))]
    firsts = dist.all_gather_object((drawn.first, rerun(shared[(rank - 1) % world])))
    rows = [ReplayRow(shared[r].index, firsts[r][0], firsts[(r + 1) % world][1]) for r in range(world)]
    if all(row.first == row.by_next for row in rows):
        return Judgement(), [ReplayCheck(r, row.micro, ((r + 1) % world,), True) for r, row in enumerate(rows)], shared
    agains = dist.all_gather_object(rerun(drawn))
    rows = [replace(row, again=again) for row, again in zip(rows, agains, strict=True)]
    checks = [
        ReplayCheck(r, row.micro, ((r + 1) % world, r), row.first == row.by_next == row.again)
        for r, row in enumerate(rows)
    ]
    return judge(rows, world), checks, shared


Contribution = Callable[[DrawnMicroBatch], list[torch.Tensor | None]]
Reference = Callable[[DrawnMicroBatch], list[torch.Tensor | None] | None]


def break_ties(
    dist: DistContext, judgement: Judgement, shared: Sequence[DrawnMicroBatch], mine: Contribution, host: Reference
) -> None:
    """Each dispute of ``judgement`` (two ranks, each consistent with itself, that compute the owner's micro-batch
    differently) put to a vote: the two ranks send their values of the gradient tensors that differ, and every rank
    compares them with its own float64 recomputation on the host (:func:`vote`). A rank named by some vote and by
    none against becomes faulty; a dispute no vote settles stays. Collective: every rank calls it, in the same
    order (the judgement is the same everywhere)."""
    for owner, peer in list(judgement.disputes):
        micro = shared[owner]
        values = mine(micro) if dist.rank in (owner, peer) else None
        digests = dist.all_gather_object(None if values is None else [digest([g]) for g in values])
        differ = [i for i, (a, b) in enumerate(zip(digests[owner], digests[peer], strict=True)) if a != b]
        sent = None if values is None else [_on_host(values[i]) for i in differ]
        both = dist.all_gather_object(sent)
        reference = host(micro)
        own = None if reference is None else vote(both[owner], both[peer], [reference[i] for i in differ])
        votes = dist.all_gather_object(own)
        odd = {(owner, peer)[v] for v in votes if v is not None}
        if len(odd) != 1:
            continue
        faulty = odd.pop()
        healthy = peer if faulty == owner else owner
        voters = ", ".join(f"rank {r}" for r, v in enumerate(votes) if v is not None)
        judgement.faulty[faulty] = (
            f"rank {peer} computes rank {owner}'s micro-batch {micro.index} otherwise than rank {owner} does, each "
            "the same way every time (the digests of two ranks cannot tell which is wrong), and a float64 "
            f"recomputation on the host (by {voters}) sides with rank {healthy}"
        )
        judgement.disputes.remove((owner, peer))


def _on_host(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach().cpu()


def device_fault(
    step: int, judgement: Judgement, shared: Sequence[DrawnMicroBatch], checks: Sequence[ReplayCheck], matched: int
) -> DeviceSuspect:
    """The one-line error (and its ``kind: bad_step`` record) of a replay that found a faulty device (or two ranks
    of which one is, when nothing could tell which); ``matched``: the last step whose replays all matched (0: none
    this session)."""

    def suspect(rank: int, detail: str) -> Suspect:
        batch = shared[rank].batch
        key, origin = getattr(batch, "origin_key", ""), getattr(batch, "origin", ())
        documents = describe_origin(origin)
        return Suspect(rank, shared[rank].index, REPLAY_MISMATCH, key, documents, DEVICE_SUSPECT, detail)

    if judgement.faulty:
        ranks = sorted(judgement.faulty)
        suspects = [suspect(rank, judgement.faulty[rank]) for rank in ranks]
        who = " and ".join(f"rank {rank}" for rank in ranks)
        why = "; ".join(judgement.faulty[r] if len(ranks) == 1 else f"rank {r}: {judgement.faulty[r]}" for r in ranks)
    else:
        owner, peer = judgement.disputes[0]
        why = (
            f"ranks {owner} and {peer} compute rank {owner}'s micro-batch {shared[owner].index} otherwise, each the "
            "same way every time, and neither a third rank nor a float64 recomputation on the host tells which is "
            "wrong"
        )
        suspects = [suspect(owner, why), suspect(peer, why)]
        who = f"rank {owner} or rank {peer}"
    since = f"every replay matched up to step {matched}" if matched else "no replay matched before it this session"
    message = (
        f"replay at step {step}: the device of {who} is suspect: {why}; the run stops rather than apply steps "
        f"computed on it ({since}; the steps after that may hold its errors): test or replace it before resuming"
    )
    bad = BadStep(step, REPLAY_MISMATCH, tuple(suspects), f"stopped: {DEVICE_SUSPECT}", math.nan, math.nan, why)
    return DeviceSuspect(message, bad, checks)
