"""The naive reference of the differential fuzzer, written without bigbatch's training code.

For a :class:`~fuzz_settings.Setting` the reference works out on its own, from the raw data and the
rules docs/data.md states, which samples form each global step (documents one per row, padded, prompt
targets masked, a document longer than T + 1 tokens split into windows of T targets or cut to T + 1;
packed windows strided over ranks or, under ``--shuffle on``, in the seeded order spelt out below; fixed K,
the last window of a document epoch partial or dropped; a token budget reached by the micro-batch that
crosses it, which is included whole). It checks that
bigbatch consumed exactly those samples, then trains a float64 copy of the initial model the plain way: **one** forward/backward over every sample of the global step
concatenated, loss = (sum of per-token cross-entropy over valid targets) / (number of valid targets),
global gradient norm clipped, a hand-written AdamW step (decay on tensors of dim >= 2), learning rate
from a hand-written warmup + cosine formula. The forward of each model family is written out here too,
reading the same parameter names: GPT-2 (learned positions, explicit causal softmax attention, tanh GELU,
LayerNorm) and Llama (rotary positions computed here in float64 from the convention models/llama/model.py
states, each query head reading key/value head ``h // group``, SwiGLU, RMSNorm, no biases). The ``hf`` family
is transformers' own ``LlamaForCausalLM`` behind bigbatch's adapter: the same parameter names under
``hf_model.``, read by this Llama forward with the shape taken by hand from its config.json
(:func:`hf_as_llama`), so transformers' implementation is checked against the reference too.

**The key bias, and other exactly-zero gradients.** Each GPT attention's ``c_attn.bias`` holds query, key
and value slices. The key slice adds ``q . b_k`` to every score of a query, the same constant for all
keys, which softmax cancels: the loss does not depend on it and its true gradient is exactly zero. In
float64 the reference's is ~1e-17, so the reference never moves it (AdamW: m = v = 0, no step); in
bigbatch's fp32 it is rounding noise (~1e-9), and AdamW divides by sqrt(v) + eps, turning noise into
moves of up to about lr per step that mean nothing. Data can add more such elements: when every valid
target of a step sits at position 0 of its row (a batch of one-token completions), no query or key
weight receives any gradient either. So rather than a hard-coded exception, the reference finds them:
an element whose float64 gradient is below ``NULL_GRAD`` (1e-12) x the global gradient norm on every
step has an exact gradient of zero (a Llama has no biases; the data can still give it such elements). Those
elements (a GPT's key-bias slices always among them, which is asserted) are masked out of the 1e-5 relative comparison and held instead to the absolute bound that
AdamW's normalisation allows for pure noise: at most sum_t lr_t x max|m_hat|/sqrt(v_hat) (computed
from the betas; ~lr per step). What the masked elements do to the model is then checked directly:
bigbatch's final model, masked elements and all, must give the same logits as the reference's final
model on the last step's batch (relative L2 <= 1e-5). Every other element, the query and value bias
slices included, is compared to 1e-5.

**Conditioning.** A few settings (a handful of tokens per step, a high learning rate, eps 1e-6 against
tiny gradients) amplify rounding so much that the reference itself, run in plain float32, lands near
or beyond 1e-5 from its float64 self after two steps (seed 333532821: 5.4e-6 in the parameters, 7.2e-5
in the logits). No fp32 implementation can meet 1e-5 there, so the reference is replayed in
float32 too, and each bar (parameters, logits, logged loss and norm) is max(1e-5, 10 x how far plain
fp32 lands from float64 on this setting). Settings where that raises a bar (plain fp32 over 1e-6 away)
are counted in the summary; for all others the bar is exactly 1e-5. The planted bugs of test_fuzz
(mean / K, an off-by-one schedule, no clipping, a step short of a micro-batch) are 1e-3 off or more.

**A mixture of experts** (moe-pico) is written out too (:func:`expert_mixture`: softmax router, top-k, each
token through its own k SwiGLU experts) and its balancing loss is the giant batch's by definition
(:func:`balance_loss`: per layer ``E * sum_e f_e P_e`` over every token of the step with a valid target, averaged
over layers), added to the mean token loss with ``--router-aux-coef``; the logged loss is the cross-entropy alone.
``--router-balance exact`` must match; ``running`` and ``micro`` are planted differences the comparison must find
(:func:`planted_outcome`). A token whose k-th and (k+1)-th router probabilities tie to fp32 rounding could be routed
differently by bigbatch and by the float64 reference; on pico's random routers such ties are rare, and a seed that
hit one would show as a difference in that token's output.

**The shuffled order** (``--shuffle on``, bigbatch's default), as docs/data.md states it, replayed here from
the raw data without bigbatch's loader code (only the constant ``ORDER_SEED_TAG`` is imported). ``seed`` is
the run's ``--seed``; a permutation of ``n`` items for epoch ``e`` is
``Generator(PCG64(SeedSequence([seed, e, ORDER_SEED_TAG]))).permutation(n)``.

* Packed: the corpus (L tokens, one shard) is cut into ``n = (L - 1) // T`` windows, window ``w`` being
  tokens ``[w T, w T + T + 1)`` (T inputs, T shifted targets; the tail past the last is never read). The
  windows form one endless stream of rows, epoch after epoch: row ``q`` lies in epoch ``e = q // n`` at
  position ``q % n`` and reads window ``w = perm_e[q % n]`` moved ``shift_e`` tokens later, where ``shift_0 =
  0`` and, for ``e >= 1`` (and ``T >= 2``), ``shift_e = Generator(PCG64(SeedSequence([seed, e,
  ORDER_SEED_TAG, 1]))).integers(1, T)``, in ``[1, T)``. A moved window that would run past the corpus's end
  (only the last window can: ``w T + shift + T + 1 > L``) is read unmoved. Global micro-batch ``j`` is rows
  ``[j G, (j + 1) G)`` with ``G = B x world``, rank ``r`` taking the ``B`` rows from ``j G + r B``, so one
  micro-batch may hold the end of one epoch and the start of the next (rows of each read in their own
  epoch's order and shift). A micro-batch ends an epoch when ``(j + 1) G`` reaches or passes a multiple of
  ``n``; under a token budget that step ends there with ``partial`` (the straddling micro-batch included
  whole), while with ``drop`` the step so far is discarded, the straddling micro-batch included (its
  next-epoch rows are not read again: the row counter only moves on). No epoch is ever cut
  short, so fixed K never drops or shortens a packed step.
* Documents: an epoch's sequences (numbered in document order, see :func:`document_rows`) are read in the
  order ``perm_e`` of ``n = number of sequences``: position ``i`` of epoch ``e`` is sequence ``perm_e[i]``.
  Epochs, their short last window (padding rows) and ``drop``/``partial`` are as without shuffling; the
  epoch counter, and with it the permutation, moves on at every epoch's end, a dropped remainder included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from fuzz_settings import Setting, non_empty

from bigbatch.data.windows import ORDER_SEED_TAG  # a plain constant: the order's functions are not imported

TOL = 1e-5  # fp32: relative L2 over all parameters (zero-gradient elements masked, see above)
CONDITIONING_SLACK = 10.0  # an ill-conditioned setting: bigbatch may be this many times as far as plain fp32
NULL_GRAD = 1e-12  # an element whose float64 gradient is below this x the global norm is zero to rounding
IGNORE = -100
LN_EPS = 1e-5
EMBEDDING = {
    "gpt": "transformer.wte.weight",
    "llama": "model.embed_tokens.weight",
    "moe": "model.embed_tokens.weight",
}  # the table a tied head shares
HF_PREFIX = "hf_model."  # where bigbatch's adapter (--model hf:DIR) holds the transformers model


@dataclass
class Outcome:
    """What the comparison of one setting found; ``problems`` empty means bigbatch matched the reference."""

    seed: int
    problems: list[str] = field(default_factory=list)
    param_rel: float = math.nan  # relative L2 over all parameters, key-bias slices masked
    worst_tensor: tuple[str, float] = ("", math.nan)  # largest per-tensor relative difference
    update_rel: float = math.nan  # relative L2 of (final - initial) against the reference's update
    loss_rel: float = 0.0  # worst per-step relative difference of the logged loss
    norm_rel: float = 0.0  # worst per-step relative difference of the logged (pre-clip) gradient norm
    logits_rel: float = math.nan  # final models' logits on the last step's batch
    masked: int = 0  # parameter elements whose exact gradient is zero on every step (key-bias slices and more)
    masked_diff: float = 0.0  # largest |bigbatch - reference| on them: AdamW-amplified rounding noise
    steps: int = 0
    clipped_steps: int = 0
    skipped_empty: int = 0  # steps whose samples held no valid target (the trainer takes no step)
    micro_batches: list[int] = field(default_factory=list)  # K per rank of each optimizer step
    step_norm_rel: list[float] = field(default_factory=list)  # per step: logged gradient norm vs the reference's
    caught: list[str] = field(default_factory=list)  # a planted difference (see Setting.expect_difference), found
    ref32_rel: float = math.nan  # the same reference in float32 against float64: the setting's conditioning
    widened: bool = False  # plain fp32 itself misses TOL on this setting, so a bar was raised to SLACK x it
    closest: float = 0.0  # the largest difference / tolerance over the checks: how near to failing

    @property
    def ok(self) -> bool:
        return not self.problems


# ---------------------------------------------------------------------------------------------------
# Which samples form each step, from the raw data and docs/data.md's rules.

Row = tuple[torch.Tensor, torch.Tensor, frozenset[str]]  # inputs (T,), targets (T,), what the row exercises


def document_rows(prompt: bytes, tokens: bytes, T: int, policy: str) -> list[Row]:
    """The sequences one document becomes (docs/data.md, "Ragged data"). Its targets are its tokens 1 .. L-1, each
    predicted from the token before it and trained on unless it lies inside the prompt (token j of the
    document is masked when j < len(prompt)). ``truncate``: one row, the first T targets (the document's first
    T + 1 tokens). ``split``: the targets in consecutive runs of T, one row each, so each row starts where
    the previous one's targets stopped and only the last is padded; every target is in exactly one row. A
    document without targets (a single token) is one empty row either way. Padding: input 0, target -100."""
    targets = list(range(1, len(tokens)))  # document positions that are targets
    if policy == "truncate":
        runs = [targets[:T]]
    else:
        assert policy == "split", policy
        runs = [targets[first : first + T] for first in range(0, len(targets), T)] or [[]]
    long = len(tokens) > T + 1
    masks_some = len(prompt) >= 2  # token 0 is never a target: a 1-token prompt masks nothing
    rows: list[Row] = []
    for w, run in enumerate(runs):
        inputs = torch.zeros(T, dtype=torch.int64)  # byte tokenizer: no end-of-text, padding is 0
        targets_row = torch.full((T,), IGNORE, dtype=torch.int64)
        for i, j in enumerate(run):
            inputs[i] = tokens[j - 1]
            if j >= len(prompt):
                targets_row[i] = tokens[j]
        events: set[str] = set()
        if long and (policy == "truncate" or w >= 1):  # a long document's truncated row, or a later window
            events.add(f"{policy}: long document")
            if masks_some:
                events.add(f"{policy}: long document with a masked prompt")
            if policy == "split" and run and run[0] < len(prompt):
                events.add("split: a later window starts inside the prompt")
        rows.append((inputs, targets_row, frozenset(events)))
    return rows


def permutation(n: int, seed: int, epoch: int) -> list[int]:
    """The shuffled order of epoch ``epoch``'s ``n`` items (module docstring)."""
    generator = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, ORDER_SEED_TAG])))
    return [int(i) for i in generator.permutation(n)]


def shift(T: int, seed: int, epoch: int) -> int:
    """How many tokens later epoch ``epoch`` reads every packed window (module docstring)."""
    if epoch == 0 or T < 2:
        return 0
    generator = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, ORDER_SEED_TAG, 1])))
    return int(generator.integers(1, T))


def shifted_window(tokens: torch.Tensor, T: int, window: int, moved: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Window ``window`` of a packed corpus moved ``moved`` tokens later, unless that runs past the end."""
    start = window * T
    if start + moved + T + 1 <= len(tokens):
        start += moved
    chunk = tokens[start : start + T + 1]
    return chunk[:-1].clone(), chunk[1:].clone()


@dataclass
class _Stream:
    """Global micro-batches of the data in order (or in the shuffled order): ``next()`` is every rank's
    (inputs, targets) and whether this global micro-batch ended a pass over the data. Documents mode reads
    sequences (a document's rows, in document order or permuted); ``events`` collects what the rows read
    exercised."""

    setting: Setting
    position: int = 0
    epoch: int = 0
    events: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        s = self.setting
        self.B, self.T, self.world = s.micro_batch, s.seq_len, s.world
        self.orders: dict[int, list[int]] = {}
        self.plans: dict[int, list[list[int]]] = {}
        self.taken: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # packed: per row read, its documents alone
        if s.mode == "packed":
            self.tokens = torch.tensor(list(s.corpus.encode()), dtype=torch.int64)
            self._size = len(self.tokens)
            self.windows = (self._size - 1) // self.T
        else:
            self.rows = [
                row
                for p, t in non_empty(s.documents)
                for row in document_rows((p or "").encode(), (p or "").encode() + t.encode(), self.T, s.long_documents)
            ]
            self._size = len(self.rows)
            # a sequence's positions: its non-padding inputs (no document holds token 0, the padding)
            self.lengths = [int((inputs != 0).sum()) for inputs, _, _ in self.rows]

    @property
    def packs(self) -> bool:
        return self.setting.mode == "documents" and self.setting.pack

    @property
    def size(self) -> int:
        """Tokens (packed corpus), sequences (documents one per row) or the rows of this epoch (packed documents)."""
        return len(self._plan(self.epoch)) if self.packs else self._size

    def _plan(self, epoch: int) -> list[list[int]]:
        """The sequences of each row of epoch ``epoch``: the epoch's order (shuffled or not) packed by the fill rule
        docs/data.md states, taken from bigbatch as a pure function (``pack_rows``, unit-tested on its own): which
        documents share a row decides nothing about the gradient, which the reference computes one per row."""
        if epoch not in self.plans:
            import numpy as np

            from bigbatch.data.packing import pack_rows

            n = len(self.rows)
            order = self._order(epoch, n) if self.setting.shuffle else list(range(n))
            starts, members = pack_rows(np.asarray(self.lengths, dtype=np.int64), np.asarray(order), self.T)
            self.plans[epoch] = [[int(m) for m in members[a:b]] for a, b in zip(starts[:-1], starts[1:], strict=True)]
        return self.plans[epoch]

    def _packed_row(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ``index`` of this epoch's packing: its sequences' positions back to back, then padding; the
        sequences alone (each in its own padded row) go to ``taken``, for the replay."""
        plan = self._plan(self.epoch)
        members = plan[index] if index < len(plan) else []
        inputs = torch.zeros(self.T, dtype=torch.int64)
        targets = torch.full((self.T,), IGNORE, dtype=torch.int64)
        used, alone = 0, []
        for member in members:
            row_inputs, row_targets, events = self.rows[member]
            n = self.lengths[member]
            inputs[used : used + n], targets[used : used + n] = row_inputs[:n], row_targets[:n]
            used += n
            alone.append((row_inputs.clone(), row_targets.clone()))
            self.events |= events
        if len(members) > 1:
            self.events.add("pack: a row holds several documents")
        if self.setting.shuffle and self.epoch >= 1:
            self.events.add("shuffle: documents of a later epoch")
        self.taken.append(alone)
        return inputs, targets

    def docs_left(self) -> int:
        return self.size - self.position

    def _order(self, epoch: int, n: int) -> list[int]:
        if epoch not in self.orders:
            self.orders[epoch] = permutation(n, self.setting.init_seed, epoch)
        return self.orders[epoch]

    def _row(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.packs:
            return self._packed_row(index)
        if index >= self.size:  # past the epoch's last sequence: a row of padding
            return torch.zeros(self.T, dtype=torch.int64), torch.full((self.T,), IGNORE, dtype=torch.int64)
        if self.setting.shuffle:
            index = self._order(self.epoch, self.size)[index]
            if self.epoch >= 1:
                self.events.add("shuffle: documents of a later epoch")
        inputs, targets, events = self.rows[index]
        self.events |= events
        return inputs.clone(), targets.clone()

    def _shuffled_row(self, q: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ``q`` of the endless stream of shuffled packed windows."""
        epoch, at = divmod(q, self.windows)
        window, moved = self._order(epoch, self.windows)[at], shift(self.T, self.setting.init_seed, epoch)
        if moved:
            self.events.add("shuffle: a shifted epoch")
            if window == self.windows - 1:
                end = window * self.T + moved + self.T + 1  # one past the moved window's last token
                self.events.add(f"shuffle: the last window {'moved' if end <= self.size else 'kept in place'}")
                if end == self.size:
                    self.events.add("shuffle: the last window moved onto the corpus's last token")
        return shifted_window(self.tokens, self.T, window, moved)

    def next(self) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], bool]:
        B, T, world = self.B, self.T, self.world
        if self.setting.mode == "packed" and self.setting.shuffle:
            first = self.position  # the row counter: it runs on over every epoch
            ranks = []
            for r in range(world):
                rows = [self._shuffled_row(first + r * B + i) for i in range(B)]
                ranks.append((torch.stack([x for x, _ in rows]), torch.stack([y for _, y in rows])))
            self.position += B * world
            epoch = self.position // self.windows
            ended = epoch > self.epoch
            if ended and self.position % self.windows:
                self.events.add("shuffle: a micro-batch straddles an epoch end")
            self.epoch = epoch
            return ranks, ended
        if self.setting.mode == "packed":
            window = B * T
            ranks = []
            for r in range(world):
                chunk = self.tokens[self.position + r * window : self.position + (r + 1) * window + 1]
                ranks.append((chunk[:-1].reshape(B, T), chunk[1:].reshape(B, T)))
            self.position += window * world
            ended = self.position + window * world + 1 > self.size  # no whole window left: wrap
        else:
            ranks = []
            for r in range(world):
                rows = [self._row(self.position + r * B + i) for i in range(B)]
                ranks.append((torch.stack([x for x, _ in rows]), torch.stack([y for _, y in rows])))
            self.position += min(B * world, self.docs_left())
            ended = self.position >= self.size
        if ended:
            self.position, self.epoch = 0, self.epoch + 1
        return ranks, ended


def _valid(batch: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    return sum(int((y != IGNORE).sum()) for _, y in batch)


def expected_steps(
    setting: Setting,
    calls: int,
    events: set[str] | None = None,
    alone: list[list[tuple[torch.Tensor, torch.Tensor]]] | None = None,
) -> list[list[list[tuple[torch.Tensor, torch.Tensor]]]]:
    """The first ``calls`` steps: per step, per global micro-batch, every rank's (inputs, targets). ``events``
    collects ``dropped`` when an incomplete last window was skipped, and what the documents read exercised
    (see :func:`document_rows`). Packed documents: ``alone`` receives, per step, each of its documents in its
    own padded row (inputs, targets), which is what the replay trains on."""
    events = set() if events is None else events
    stream = _Stream(setting, events=events)
    steps = []
    for _ in range(calls):
        first_taken = len(stream.taken)
        step: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        if setting.k:  # fixed K; a document epoch's last, incomplete step is partial or dropped
            k = setting.k
            per_micro = setting.micro_batch * setting.world
            if setting.mode == "documents" and stream.docs_left() < k * per_micro:
                if setting.last_window == "drop":
                    if stream.position:
                        stream.position, stream.epoch = 0, stream.epoch + 1
                        events.add("dropped")
                else:
                    k = math.ceil(stream.docs_left() / per_micro)
            step = [stream.next()[0] for _ in range(k)]
        else:  # a token budget: the micro-batch that reaches it is included whole
            total, passes = 0, 0
            while total < setting.token_budget:
                batch, ended = stream.next()
                step.append(batch)
                total += _valid(batch)
                if ended:
                    passes += 1
                    if total >= setting.token_budget or (setting.last_window == "partial" and total > 0):
                        break
                    assert passes < 2, "the draw guarantees that a budget fits in one pass"
                    step, total = [], 0  # the pass's incomplete remainder is skipped
                    first_taken = len(stream.taken)
                    events.add("dropped")
        steps.append(step)
        if alone is not None:
            alone.append([document for row in stream.taken[first_taken:] for document in row])
    return steps


def check_composition(setting: Setting, steps: list[dict[str, Any]]) -> list[str]:
    """docs/data.md's rules on what bigbatch recorded, then sample-for-sample equality with the reference's
    own assembly of every step."""
    problems: list[str] = []
    B, T, world = setting.micro_batch, setting.seq_len, setting.world
    for s, step in enumerate(steps):
        ranks = step["ranks"]  # per rank: list of (inputs, targets)
        ks = [len(r) for r in ranks]
        total = sum(int((y != IGNORE).sum()) for r in ranks for _, y in r)
        if len(set(ks)) != 1:
            problems.append(f"call {s}: ranks hold different numbers of micro-batches {ks}")
            continue
        if any(tuple(x.shape) != (B, T) or tuple(y.shape) != (B, T) for r in ranks for x, y in r):
            problems.append(f"call {s}: a micro-batch is not {B} x {T}")
        if any(n != total for n in step["n_valid"]):
            problems.append(f"call {s}: the trainer's valid-target count {step['n_valid']} != {total} counted")
        ended_pass = step["epoch_after"] > step["epoch_before"]
        partial_end = setting.last_window == "partial" and ended_pass
        if setting.k:
            allowed_short = setting.mode == "documents" and partial_end
            if ks[0] != setting.k and not (allowed_short and ks[0] < setting.k):
                problems.append(f"call {s}: K={ks[0]} per rank, expected {setting.k} (B*K={B * setting.k} sequences)")
        else:
            last = sum(int((r[-1][1] != IGNORE).sum()) for r in ranks)
            if total < setting.token_budget and not (partial_end and total > 0):
                problems.append(f"call {s}: {total} valid targets do not reach the budget {setting.token_budget}")
            if total - last >= setting.token_budget:
                problems.append(
                    f"call {s}: the budget {setting.token_budget} was reached before the last micro-batch "
                    f"({total - last} of {total} valid targets without it)"
                )
        record = step["records"][0]
        if (record is None) != (total == 0):
            problems.append(f"call {s}: {total} valid targets but {'no ' if record is None else ''}optimizer step")
    expected = expected_steps(setting, len(steps))
    for s, (step, want) in enumerate(zip(steps, expected, strict=True)):
        got = step["ranks"]
        if len(got[0]) != len(want):
            problems.append(f"call {s}: {len(got[0])} micro-batches per rank, the reference assembles {len(want)}")
            break
        same = all(
            torch.equal(got[r][m][0], want[m][r][0]) and torch.equal(got[r][m][1], want[m][r][1])
            for m in range(len(want))
            for r in range(world)
        )
        if not same:
            problems.append(f"call {s}: bigbatch's samples differ from the reference's assembly of the step")
            break
    return problems


# ---------------------------------------------------------------------------------------------------
# The model, the loss, the schedule and AdamW, written out.


def learning_rate(setting: Setting, step: int) -> float:
    """Linear warmup to ``lr`` (step ``s`` of the warmup gets ``lr * (s + 1) / warmup``), then cosine decay to
    ``lr * min_lr_ratio`` at ``decay_steps`` (0: the run's last step), constant after it (build-nanogpt's recipe)."""
    peak, low = setting.lr, setting.lr * setting.min_lr_ratio
    end = setting.decay_steps or setting.max_steps
    warmup = setting.warmup_steps
    if step < warmup:
        return peak * (step + 1) / warmup
    if step >= end:
        return low
    progress = (step - warmup) / (end - warmup)
    return low + (peak - low) * (1 + math.cos(math.pi * progress)) / 2


def _layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + LN_EPS) * weight + bias


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def gpt_logits(p: dict[str, torch.Tensor], idx: torch.Tensor, n_head: int, vocab: int) -> torch.Tensor:
    """(B, T) token ids -> (B, T, vocab) logits of GPT-2 with parameters ``p`` (token table tied to the head)."""
    B, T = idx.shape
    x = p["transformer.wte.weight"][idx] + p["transformer.wpe.weight"][:T]  # (B, T, C)
    C = x.shape[-1]
    D = C // n_head
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    layer = 0
    while f"transformer.h.{layer}.ln_1.weight" in p:
        h = f"transformer.h.{layer}."
        a = _layer_norm(x, p[h + "ln_1.weight"], p[h + "ln_1.bias"])
        q, k, v = (a @ p[h + "attn.c_attn.weight"].T + p[h + "attn.c_attn.bias"]).split(C, dim=-1)
        q, k, v = (t.reshape(B, T, n_head, D).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(D)
        weights = torch.softmax(scores.masked_fill(~causal, -math.inf), dim=-1)
        y = (weights @ v).transpose(1, 2).reshape(B, T, C)
        x = x + y @ p[h + "attn.c_proj.weight"].T + p[h + "attn.c_proj.bias"]
        m = _layer_norm(x, p[h + "ln_2.weight"], p[h + "ln_2.bias"])
        m = _gelu_tanh(m @ p[h + "mlp.c_fc.weight"].T + p[h + "mlp.c_fc.bias"])
        x = x + m @ p[h + "mlp.c_proj.weight"].T + p[h + "mlp.c_proj.bias"]
        layer += 1
    x = _layer_norm(x, p["transformer.ln_f.weight"], p["transformer.ln_f.bias"])
    return (x @ p["transformer.wte.weight"].T)[..., :vocab]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def _silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1 + torch.exp(-x))


Routing = list[tuple[torch.Tensor, torch.Tensor]]
"""Per MoE layer: every token's router probabilities (N, E) and top-k experts (N, k)."""


def swiglu(p: dict[str, torch.Tensor], w: str, m: torch.Tensor) -> torch.Tensor:
    gate, up = m @ p[w + "mlp.gate_proj.weight"].T, m @ p[w + "mlp.up_proj.weight"].T
    return (_silu(gate) * up) @ p[w + "mlp.down_proj.weight"].T


def expert_mixture(config: dict[str, Any], routing: Routing) -> Any:
    """The MoE family's MLP, written out: softmax over the experts, top-k, the k weights renormalised when the
    config says so, each token through its own k SwiGLU experts (stacked ``gate_up_proj`` (E, 2F, C), gate rows
    first, and ``down_proj`` (E, C, F)); each layer's routing is appended to ``routing``."""
    k = int(config["top_k"])
    assert not config["qk_norm"] and not config["shared_ffn_hidden"], "the fuzzer's MoE is moe-pico's shape"

    def mlp(p: dict[str, torch.Tensor], w: str, m: torch.Tensor) -> torch.Tensor:
        B, T, C = m.shape
        flat = m.reshape(B * T, C)
        probs = torch.softmax(flat @ p[w + "mlp.gate.weight"].T, dim=-1)  # (N, E)
        top = torch.topk(probs, k, dim=-1).indices  # (N, k)
        weights = probs.gather(1, top)
        if config["norm_topk_prob"]:
            weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(flat)
        for slot in range(k):
            expert = top[:, slot]
            gate, up = torch.einsum("nc,nfc->nf", flat, p[w + "mlp.experts.gate_up_proj"][expert]).chunk(2, dim=-1)
            y = torch.einsum("nf,ncf->nc", _silu(gate) * up, p[w + "mlp.experts.down_proj"][expert])
            out = out + y * weights[:, slot : slot + 1]
        routing.append((probs, top))
        return out.reshape(B, T, C)

    return mlp


def balance_loss(routing: Routing, targets: torch.Tensor, n_expert: int) -> torch.Tensor:
    """The MoE family's load-balancing loss of the whole step, by its definition: per layer ``E * sum_e f_e P_e``
    over the tokens with a valid target (``f_e`` the share of their k x N assignments that go to ``e``, without
    gradient; ``P_e`` their mean probability for ``e``), averaged over the layers."""
    counted = (targets != IGNORE).reshape(-1)
    losses = []
    for probs, top in routing:
        probs, top = probs[counted], top[counted]
        n, k = top.shape
        share = torch.zeros(n_expert, dtype=probs.dtype).scatter_add_(
            0, top.reshape(-1), torch.ones(top.numel(), dtype=probs.dtype)
        ) / (k * n)
        losses.append(n_expert * (share * probs.mean(0)).sum())
    return torch.stack(losses).mean()


def llama_logits(
    p: dict[str, torch.Tensor], idx: torch.Tensor, config: dict[str, Any], mlp: Any = swiglu
) -> torch.Tensor:
    """(B, T) token ids -> (B, T, vocab) logits of a Llama with parameters ``p``: RoPE (dimension i of a head
    turned with dimension i + D/2 by position x base^(-2i/D)), grouped-query attention, SwiGLU (or ``mlp``: the
    MoE family's), RMSNorm; the head is ``lm_head.weight``, or the token table when tied (then ``p`` holds only
    the table)."""
    assert config.get("rope_scaling") is None, "the fuzzer's Llama has no rope scaling"
    B, T = idx.shape
    H, KV, C = int(config["n_head"]), int(config["n_kv_head"]), int(config["n_embd"])
    D, eps = C // H, float(config["norm_eps"])
    x = p["model.embed_tokens.weight"][idx]  # (B, T, C)
    half = D // 2
    speed = float(config["rope_base"]) ** (-torch.arange(half, dtype=torch.float64) * 2 / D)  # (D/2,)
    angle = torch.arange(T, dtype=torch.float64)[:, None] * speed[None, :]  # (T, D/2)
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)

    def turn(t: torch.Tensor) -> torch.Tensor:  # (B, heads, T, D): each pair (i, i + D/2) turned by its angle
        a, b = t[..., :half], t[..., half:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    kv_of_head = [h // (H // KV) for h in range(H)]  # query head h reads key/value head h // group
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    layer = 0
    while f"model.layers.{layer}.input_layernorm.weight" in p:
        w = f"model.layers.{layer}."
        a = _rms_norm(x, p[w + "input_layernorm.weight"], eps)
        q = (a @ p[w + "self_attn.q_proj.weight"].T).reshape(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        k = (a @ p[w + "self_attn.k_proj.weight"].T).reshape(B, T, KV, D).transpose(1, 2)  # (B, KV, T, D)
        v = (a @ p[w + "self_attn.v_proj.weight"].T).reshape(B, T, KV, D).transpose(1, 2)
        q, k = turn(q), turn(k)
        k, v = k[:, kv_of_head], v[:, kv_of_head]  # (B, H, T, D)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(D)
        weights = torch.softmax(scores.masked_fill(~causal, -math.inf), dim=-1)
        y = (weights @ v).transpose(1, 2).reshape(B, T, C)
        x = x + y @ p[w + "self_attn.o_proj.weight"].T
        x = x + mlp(p, w, _rms_norm(x, p[w + "post_attention_layernorm.weight"], eps))
        layer += 1
    x = _rms_norm(x, p["model.norm.weight"], eps)
    return x @ p.get("lm_head.weight", p["model.embed_tokens.weight"]).T


def hf_as_llama(hf: dict[str, Any]) -> dict[str, Any]:
    """The reference Llama's shape of a transformers Llama config.json (fuzz_settings.HF_CONFIG), read by hand."""
    assert hf["model_type"] == "llama" and hf.get("rope_scaling") is None, hf
    return {
        "n_head": hf["num_attention_heads"],
        "n_kv_head": hf["num_key_value_heads"],
        "n_embd": hf["hidden_size"],
        "norm_eps": hf["rms_norm_eps"],
        "rope_base": hf["rope_theta"],
        "rope_scaling": None,
        "tie_embeddings": hf["tie_word_embeddings"],
        "vocab_size": hf["vocab_size"],
    }


def _unprefixed(state: dict[str, torch.Tensor], problems: list[str], what: str) -> dict[str, torch.Tensor]:
    """The transformers model's own parameter names of the adapter's state."""
    outside = sorted(name for name in state if not name.startswith(HF_PREFIX))
    if outside:
        problems.append(f"{what}: parameters outside {HF_PREFIX}: {outside}")
    return {name.removeprefix(HF_PREFIX): value for name, value in state.items()}


def model_logits(family: str, p: dict[str, torch.Tensor], idx: torch.Tensor, config: dict[str, Any]) -> torch.Tensor:
    """The logits of the family's reference forward (the hf family's: the Llama's)."""
    if family in ("llama", "hf"):
        return llama_logits(p, idx, config)
    if family == "moe":
        return llama_logits(p, idx, config, expert_mixture(config, []))
    return gpt_logits(p, idx, int(config["n_head"]), int(config["vocab_size"]))


def mean_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(sum of -log p(target) over targets != -100) / their number."""
    valid = targets != IGNORE
    picked = logits[valid]  # (N, V)
    nll = torch.logsumexp(picked, dim=-1) - picked.gather(1, targets[valid].unsqueeze(1)).squeeze(1)
    n = int(valid.sum())
    return nll.sum() / n, n


def _key_slice(name: str, c: int) -> slice | None:
    return slice(c, 2 * c) if name.endswith("attn.c_attn.bias") else None


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _parameters(
    state: dict[str, torch.Tensor], problems: list[str], what: str, family: str, tied: bool
) -> dict[str, torch.Tensor]:
    """Float64 copies; a tied LM head checked equal to the token table and dropped (an untied one is kept)."""
    table = EMBEDDING[family]
    params = {
        name: value.detach().double().clone()
        for name, value in state.items()
        if not (tied and name == "lm_head.weight")
    }
    if tied and "lm_head.weight" in state and not torch.equal(state["lm_head.weight"], state[table]):
        problems.append(f"{what}: lm_head.weight is no longer tied to {table}")
    return params


@dataclass
class StepLog:
    loss: float
    norm: float  # before clipping
    n_valid: int
    lr: float


def replay(
    setting: Setting,
    initial: dict[str, torch.Tensor],
    steps: list[torch.Tensor | tuple[torch.Tensor, torch.Tensor]],
    config: dict[str, Any],
    dtype: torch.dtype = torch.float64,
) -> tuple[dict[str, torch.Tensor], list[StepLog], dict[str, torch.Tensor]]:
    """Train a copy of ``initial`` on ``steps`` (per optimizer step: every sample of the global step, as
    one (inputs, targets) batch) the plain way; the final parameters, what each step saw, and per
    parameter the elements whose gradient was zero (to rounding) on every step."""
    params = {name: value.detach().to(dtype).clone().requires_grad_(True) for name, value in initial.items()}
    names = list(params)
    m = {name: torch.zeros_like(v) for name, v in params.items()}
    v2 = {name: torch.zeros_like(v) for name, v in params.items()}
    logs = []
    null = {name: torch.ones_like(v, dtype=torch.bool) for name, v in params.items()}
    for t, (x, y) in enumerate(steps, start=1):
        lr = learning_rate(setting, t - 1)
        routing: Routing = []
        if setting.family == "moe":  # ONE forward of the whole step, its balancing loss over the whole step too
            logits = llama_logits(params, x, config, expert_mixture(config, routing))
        else:
            logits = model_logits(setting.family, params, x, config)  # ONE forward, whole step
        loss, n = mean_token_loss(logits, y)
        objective = loss
        if routing:
            objective = loss + setting.router_aux_coef * balance_loss(routing, y, int(config["n_expert"]))
        grads = dict(zip(names, torch.autograd.grad(objective, [params[k] for k in names]), strict=True))
        norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads.values()))
        for name, g in grads.items():
            null[name] &= g.abs() <= NULL_GRAD * norm
        if setting.grad_clip > 0 and norm > setting.grad_clip:
            grads = {name: g * (setting.grad_clip / norm) for name, g in grads.items()}
        with torch.no_grad():  # AdamW (decoupled decay on matrices and embeddings), bias-corrected moments
            for name, p in params.items():
                g = grads[name]
                if p.dim() >= 2:
                    p.mul_(1 - lr * setting.weight_decay)
                m[name] = setting.beta1 * m[name] + (1 - setting.beta1) * g
                v2[name] = setting.beta2 * v2[name] + (1 - setting.beta2) * g * g
                m_hat = m[name] / (1 - setting.beta1**t)
                v_hat = v2[name] / (1 - setting.beta2**t)
                p.sub_(lr * m_hat / (v_hat.sqrt() + setting.eps))
        logs.append(StepLog(loss=loss.item(), norm=norm, n_valid=n, lr=lr))
    return {name: p.detach().double() for name, p in params.items()}, logs, null


def adam_step_bound(beta1: float, beta2: float, t: int) -> float:
    """The largest |m_hat| / sqrt(v_hat) after ``t`` steps of any gradient sequence (Cauchy-Schwarz), i.e. how
    far one AdamW step can move an element, in units of the learning rate (1 at t = 1)."""
    a = [(1 - beta1) * beta1 ** (t - i) / (1 - beta1**t) for i in range(1, t + 1)]
    b = [(1 - beta2) * beta2 ** (t - i) / (1 - beta2**t) for i in range(1, t + 1)]
    return math.sqrt(sum(ai * ai / bi for ai, bi in zip(a, b, strict=True)))


def param_difference(
    got: dict[str, torch.Tensor],
    ref: dict[str, torch.Tensor],
    start: dict[str, torch.Tensor],
    null: dict[str, torch.Tensor],
) -> tuple[float, float, tuple[str, float], float]:
    """(relative L2 over all parameters, of the updates, the worst single tensor, the largest difference
    on the masked elements) with the elements of ``null`` masked (see the module docstring)."""
    diffs, refs, updates, ref_updates = [], [], [], []
    worst, drift = ("", 0.0), 0.0
    for name in ref:
        r, g, s = ref[name].clone(), got[name].clone(), start[name].clone()
        mask = null[name]
        if mask.any():
            drift = max(drift, float((g - r)[mask].abs().max()))
            for tensor in (r, g, s):
                tensor[mask] = 0.0
        diffs.append((g - r).flatten())
        refs.append(r.flatten())
        updates.append((g - s).flatten())
        ref_updates.append((r - s).flatten())
        rel = _rel(g, r) if r.norm() > 0 else float((g - r).norm())
        if rel > worst[1]:
            worst = (name, rel)
    param_rel = float(torch.cat(diffs).norm() / torch.cat(refs).norm())
    return param_rel, _rel(torch.cat(updates), torch.cat(ref_updates)), worst, drift


def compare(setting: Setting, result: dict[str, Any]) -> Outcome:
    """Run the reference over the steps bigbatch took and compare everything it logged and learnt
    (tolerances: ``TOL``, or ``CONDITIONING_SLACK`` x what plain fp32 does on an ill-conditioned setting)."""
    out = Outcome(seed=setting.seed)
    problems = out.problems
    config, family = result["model_config"], setting.family
    if result.get("model_family") != family:
        problems.append(f"bigbatch built a {result.get('model_family')} model, the setting draws {family}")
        return out
    if family == "hf":  # from here on the reference's own Llama, on the transformers model's parameters
        config, family = hf_as_llama(config["hf_config"]), "llama"
        result = {
            **result,
            **{
                key: _unprefixed(result[key], problems, key)
                for key in ("initial", "final", "checkpoint")
                if result.get(key) is not None
            },
        }
    c, tied = int(config["n_embd"]), family == "gpt" or bool(config["tie_embeddings"])
    calls = result["steps"]
    problems += check_composition(setting, calls)
    if result["steps_done"] != setting.max_steps:
        problems.append(f"bigbatch took {result['steps_done']} optimizer steps, not {setting.max_steps}")
    initial = _parameters(result["initial"], problems, "initial state", family, tied)
    final = _parameters(result["final"], problems, "final state", family, tied)
    if result.get("checkpoint") is not None:
        saved = _parameters(result["checkpoint"], problems, "checkpoint", family, tied)
        if set(saved) != set(final) or any(not torch.equal(saved[k], final[k]) for k in final):
            problems.append("the saved checkpoint's model differs from the trained model")
    if set(final) != set(initial):
        problems.append(f"parameter names differ: {sorted(set(final) ^ set(initial))}")
        return out

    batches, records = [], []
    alone: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    for s, (call, want) in enumerate(zip(calls, expected_steps(setting, len(calls), alone=alone), strict=True)):
        x = torch.cat([xr for micro in want for xr, _ in micro])  # every sample of the global step
        y = torch.cat([yr for micro in want for _, yr in micro])
        if setting.mode == "documents" and setting.pack and alone[s]:  # packed rows: each document on its own
            x = torch.stack([xd for xd, _ in alone[s]])
            y = torch.stack([yd for _, yd in alone[s]])
        if int((y != IGNORE).sum()) == 0:
            out.skipped_empty += 1
        elif call["records"][0] is not None:  # else reported by check_composition
            batches.append((x, y))
            records.append(call["records"][0])
    reference, logs, null = replay(setting, initial, batches, config)
    # The same replay in float32: how far plain fp32 arithmetic lands from float64 on this setting.
    reference32, logs32, _ = replay(setting, initial, batches, config, dtype=torch.float32)
    out.steps = len(logs)
    cond_loss = max((abs(a.loss - b.loss) / abs(b.loss) for a, b in zip(logs32, logs, strict=True)), default=0.0)
    cond_norm = max((abs(a.norm - b.norm) / b.norm for a, b in zip(logs32, logs, strict=True)), default=0.0)
    out.ref32_rel = param_difference(reference32, reference, initial, null)[0]
    for t, (log, record) in enumerate(zip(logs, records, strict=True), start=1):
        out.clipped_steps += setting.grad_clip > 0 and log.norm > setting.grad_clip
        out.loss_rel = max(out.loss_rel, abs(record["loss"] - log.loss) / abs(log.loss))
        out.step_norm_rel.append(abs(record["grad_norm"] - log.norm) / log.norm)
        out.norm_rel = max(out.norm_rel, out.step_norm_rel[-1])
        out.micro_batches.append(record["micro_batches"])
        if record["tokens"] != log.n_valid:
            problems.append(f"step {t}: logged {record['tokens']} tokens, the step holds {log.n_valid} valid targets")
        if abs(record["lr"] - log.lr) > 1e-12 * log.lr + 1e-15:
            problems.append(f"step {t}: learning rate {record['lr']:.6g}, the schedule gives {log.lr:.6g}")

    def check(what: str, value: float, conditioning: float) -> None:
        bar = max(TOL, CONDITIONING_SLACK * conditioning)
        out.widened = out.widened or bar > TOL
        out.closest = max(out.closest, value / bar)
        if not value <= bar:
            problems.append(
                f"{what}: {value:.2e} relative difference from the reference (tolerance {bar:.2g}; plain fp32 "
                f"lands {conditioning:.1e} from float64 on this setting)"
            )

    check("logged loss", out.loss_rel, cond_loss)
    check("logged gradient norm", out.norm_rel, cond_norm)
    for name in initial:
        key = _key_slice(name, c)
        if key is not None and not bool(null[name][key].all()):
            problems.append(f"{name}: the key slice has a nonzero gradient in the reference")
    out.masked = sum(int(mask.sum()) for mask in null.values())
    out.param_rel, out.update_rel, out.worst_tensor, out.masked_diff = param_difference(final, reference, initial, null)
    bound = sum(log.lr * adam_step_bound(setting.beta1, setting.beta2, t) for t, log in enumerate(logs, start=1))
    if out.masked_diff > bound * (1 + 1e-6):
        problems.append(
            f"a masked (zero-gradient) element moved {out.masked_diff:.2e}, more than AdamW can ({bound:.2e})"
        )
    check("the parameters", out.param_rel, out.ref32_rel)
    if batches:  # bigbatch's model, masked elements and all, against the reference's
        x = batches[-1][0]
        with torch.no_grad():
            want = model_logits(family, reference, x, config)
            out.logits_rel = _rel(model_logits(family, final, x, config), want)
            cond_logits = _rel(model_logits(family, reference32, x, config), want)
        check("the final logits", out.logits_rel, cond_logits)
    if setting.clip == "tight" and out.clipped_steps != out.steps:
        problems.append(f"clipping was to bite on every step but bit on {out.clipped_steps} of {out.steps}")
    if setting.clip == "loose" and out.clipped_steps:
        problems.append("clipping was never to bite but did")
    return planted_outcome(setting, out)


def planted_outcome(setting: Setting, out: Outcome) -> Outcome:
    """A setting whose balancing loss is accumulated otherwise than exactly: the differences found are the planted
    one caught (``caught``), and none found where one must be is the problem."""
    expected = setting.expect_difference
    if not expected and expected is not None:
        return out
    numeric = [p for p in out.problems if "relative difference from the reference" in p]
    out.caught = numeric
    out.problems = [p for p in out.problems if p not in numeric]
    if expected and not numeric:
        out.problems.append(
            f"--router-balance {setting.router_balance} was planted, and bigbatch matched the reference: the fuzzer "
            "does not see a balancing loss accumulated per micro-batch"
        )
    return out
