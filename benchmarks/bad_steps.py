"""Bad steps, measured with faults injected into real ``bigbatch train`` runs (CPU, gloo, 1 thread per process).

    python benchmarks/bad_steps.py                  # every part (the overhead alone about 25 minutes on 2 cores)
    python benchmarks/bad_steps.py --only exact     # exact | skip-step | replay | quiet | overhead | detector | norms

Pico on the generated English-like corpus (tests/support/text_corpus.py), micro-batches of 2 x 32 tokens.

* exact: ``--bad-step skip-micro`` with bad data (``nan-input``) in micro-batch 1 of step 4, on 1 process, DDP and
  FSDP2 with 2 (on rank 1): the final parameters and optimizer state against a run whose data leaves out that
  micro-batch's documents (the exclusions a rewind writes, given from the start). Goal: bitwise.
* skip-step: an Inf in a gradient of step 4 under ``--bad-step skip-step``, against the run whose data leaves out
  every micro-batch of step 4 and the run where every one of them is bad data (skip-micro drops them all). Goal:
  bitwise, and every Adam moment finite.
* replay: a device that flips a bit in every backward from a drawn step on a drawn rank, at another element each
  time or always the same one (the same wrong value), caught by ``--replay-every N`` (goal: within N steps, the
  rank named, the run stopped; one process cannot see the same wrong value); a single flip in one micro-batch
  (caught only when the replay draws it: about 1/K of the time).
* quiet: 2,000 steps without a fault at ``--replay-every 1`` and the default spike thresholds (1 and 2 processes,
  64 and 256 tokens a step). Goal: 0 bad steps; each run's largest robust z-score of the step loss and gradient
  norm against its window (the detector's own formula) shows the margin below the thresholds (12 and 40).
* overhead: the step time at ``--replay-every 1`` against replay off on nano (micro-batches of 8 x 128), K 4 and 8
  on 1 process (``--overhead-rows``), alternating runs (``--rounds``, 10), each round's overhead and their spread;
  then in one process, steps alternating off/on/on/off (``--quads``, 15), which takes the runs' noise out. Goal: at
  most 1/K of a step + 5%.
* detector (in one process, the engine itself; about 4 minutes): pico trained on the corpus, K 8; after a warm-up,
  4,000 quiet steps, and every 10th step a probe (computed, never applied) in which 1, 2, 4 or all 8 micro-batches
  hold random bytes instead (12.5%, 25%, 50%, 100% of the step). The detector is then replayed over those values at
  each threshold: the catch rate per poison share (and whether exactly the poisoned micro-batches are named), the
  false alarms on the quiet steps, and each level's largest robust z (steps, and micro-batches by their own
  values). Goal: the defaults catch every share with no false alarm.
* norms: what each micro-batch's contribution norm (a hook per parameter) costs: process CPU time per step with
  the guard off, on without the norms, and on, interleaved rounds, pico at K 8.

Attribution: every injected point fault's step, rank, micro-batch and documents (the fault's own line, printed as
it fires) against the ``kind: bad_step`` record. Goal: 100%.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import math
import os
import pstats
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from bench_config import generated_corpus

from bigbatch.engine.accumulate import AccumulationEngine
from bigbatch.engine.bad_steps import (
    GRAD_SPREAD_FLOOR,
    LOSS_SPREAD_FLOOR,
    BadStepSettings,
    MicroValues,
    SpikeDetector,
    spike_limit,
)
from bigbatch.engine.batch import MicroBatch
from bigbatch.engine.optim import build_adamw, constant_schedule
from bigbatch.engine.rng import capture_rng_state, restore_rng_state
from bigbatch.models import GPT, preset
from bigbatch.run.checkpoints import checkpoint as ckpt

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
FAULT_LINE = re.compile(r"fault (\S+) fired: step (\d+), rank (\d+), micro-batch (\d+), documents (\S+)")
LAYOUTS = {"1 process": (1, "none"), "DDP, 2 processes": (2, "ddp"), "FSDP2, 2 processes": (2, "fsdp")}
DEFAULTS = BadStepSettings()
SPIKE_WINDOW, SPIKE_MIN_STEPS = DEFAULTS.spike_window, DEFAULTS.spike_min_steps
LOSS_THRESHOLD, GRAD_THRESHOLD = DEFAULTS.loss_spike, DEFAULTS.grad_spike


@dataclass
class Bench:
    corpus: Path
    work: Path
    runs: int = 0
    attributed: list[tuple[str, bool]] = field(default_factory=list)  # (case, the record named the fault)

    def train(
        self,
        name: str,
        *extra: str,
        nproc: int = 1,
        fault: str | None = None,
        steps: int = 6,
        tokens: int = 256,
        ok: bool = True,
    ) -> tuple[Path, subprocess.CompletedProcess]:
        out = self.work / name
        args = [
            sys.executable, "-m", "bigbatch", "train", "--data", str(self.corpus), "--model", "pico",
            "--micro-batch", "2", "--seq-len", "32", "--total-batch-tokens", str(tokens),
            "--max-steps", str(steps), "--eval-every", "0", "--sample-tokens", "0", "--log-every", "1000",
            "--cache-dir", str(self.work / "cache"), "--out", str(out), "--nproc", str(nproc), *extra,
        ]  # fmt: skip
        if nproc > 1:
            args += ["--collective-timeout", "60"]  # a hang fails in a minute
        env = {k: v for k, v in ENV.items() if k != "BIGBATCH_FAULT"}
        if fault:
            env["BIGBATCH_FAULT"] = fault
        done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=900)
        self.runs += 1
        if ok and done.returncode != 0:
            raise SystemExit(f"{name}: bigbatch train failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        return out, done

    def excluded_run(self, name: str, keys: list[str], *extra: str, nproc: int = 1) -> Path:
        """A run whose data leaves out ``keys`` from its first step: a directory bigbatch made (a run killed before
        its first step) given the exclusions, then trained."""
        out, killed = self.train(name, *extra, nproc=nproc, fault="kill:step=1,micro=0", ok=False)
        assert killed.returncode != 0 and ckpt.latest_valid_checkpoint(out) is None, killed.stdout[-1000:]
        (out / "bad-steps.json").write_text(json.dumps({"excluded": keys, "rewinds": 0}) + "\n")
        self.train(name, *extra, nproc=nproc)
        return out

    def attribute(self, case: str, done: subprocess.CompletedProcess, out: Path) -> list[dict]:
        """Whether each fault's line (step, rank, micro-batch, documents) is a suspect of the bad step records."""
        fired = FAULT_LINE.findall(done.stdout)
        suspects = [(r["step"], s) for r in records(out, "bad_step") for s in r["suspects"]]
        for action, step, rank, micro, key in fired:
            named = any(
                (at, s["rank"], s["micro_batch"], s["key"]) == (int(step), int(rank), int(micro), key)
                for at, s in suspects
            )
            self.attributed.append((f"{case}: {action} at step {step}, rank {rank}, micro-batch {micro}", named))
        if not fired:
            self.attributed.append((f"{case}: the fault did not say where it fired", False))
        return [s for _, s in suspects]


def records(out: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def flat_state(out: Path) -> dict[str, Any]:
    """The newest checkpoint's parameters and optimizer state (moments, step counts) by path."""
    document = ckpt.load_checkpoint(out)
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}", item)
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(f"{prefix}.{index}", item)
        else:
            flat[prefix] = value

    walk("model", document["model"])
    walk("optimizer", document["optimizer"]["state"])
    return flat


def compared(a: Path, b: Path) -> tuple[bool, int, float]:
    """(bitwise equal, tensors compared, relative L2 of the parameters)."""
    ours, theirs = flat_state(a), flat_state(b)
    assert ours.keys() == theirs.keys(), sorted(ours.keys() ^ theirs.keys())[:4]
    equal = all(torch.equal(v, theirs[k]) if isinstance(v, torch.Tensor) else v == theirs[k] for k, v in ours.items())
    params = [k for k in ours if k.startswith("model.")]
    diff = sum(float((ours[k].double() - theirs[k].double()).square().sum()) for k in params)
    norm = sum(float(theirs[k].double().square().sum()) for k in params)
    return equal, sum(isinstance(v, torch.Tensor) for v in ours.values()), (diff / norm) ** 0.5


def moments_finite(out: Path) -> bool:
    return all(bool(torch.isfinite(v).all()) for k, v in flat_state(out).items() if isinstance(v, torch.Tensor))


def layout_args(layout: str) -> tuple[int, list[str]]:
    nproc, parallel = LAYOUTS[layout]
    return nproc, ["--parallel", parallel] if nproc > 1 else []


# ---- skip-micro: the step without the micro-batch ----------------------------------------------------------


def exact(bench: Bench) -> None:
    print("skip-micro: nan-input in micro-batch 1 of step 4 (rank 1 of 2), 6 steps of 256 tokens (K 4 / world)")
    print(f"  {'layout':<20} {'vs data without its documents':<34} {'vs data with them (rel L2)':>27}")
    for layout in LAYOUTS:
        nproc, extra = layout_args(layout)
        rank = nproc - 1
        tag = layout.split(",")[0].replace(" ", "")
        skipped, done = bench.train(
            f"exact-{tag}-skip", *extra, nproc=nproc, fault=f"nan-input:step=4,micro=1,rank={rank}"
        )
        (suspect,) = bench.attribute(f"skip-micro, {layout}", done, skipped)
        reference = bench.excluded_run(f"exact-{tag}-without", [suspect["key"]], *extra, nproc=nproc)
        clean, _ = bench.train(f"exact-{tag}-clean", *extra, nproc=nproc)
        equal, n, _ = compared(skipped, reference)
        _, _, rel = compared(skipped, clean)
        verdict = f"{'bitwise equal' if equal else 'DIFFERENT'} ({n} tensors)"
        print(f"  {layout:<20} {verdict:<34} {rel:>27.2e}")


# ---- skip-step: the run without the step -------------------------------------------------------------------


def skip_step(bench: Bench) -> None:
    print("skip-step: inf-grad in micro-batch 0 of step 4 (rank 1 of 2), 6 applied steps of 256 tokens")
    print(f"  {'layout':<20} {'moments finite':<15} {'vs data without step 4':<26} {'vs step 4 all bad data':<24}")
    for layout in LAYOUTS:
        nproc, extra = layout_args(layout)
        k = 4 // nproc
        tag = layout.split(",")[0].replace(" ", "")
        inf, done = bench.train(
            f"step-{tag}-inf",
            "--bad-step",
            "skip-step",
            *extra,
            nproc=nproc,
            fault=f"inf-grad:step=4,micro=0,rank={nproc - 1}",
        )
        bench.attribute(f"skip-step, {layout}", done, inf)
        every = ";".join(f"nan-input:step=4,micro={m}" for m in range(k))
        all_bad, _ = bench.train(f"step-{tag}-allbad", *extra, nproc=nproc, fault=every)
        keys = sorted({s["key"] for r in records(all_bad, "bad_step") for s in r["suspects"]})
        assert len(keys) == 4, keys
        without = bench.excluded_run(f"step-{tag}-without", keys, *extra, nproc=nproc)
        a, _, _ = compared(inf, without)
        b, _, _ = compared(inf, all_bad)
        finite = moments_finite(inf)
        print(
            f"  {layout:<20} {str(finite):<15} {'bitwise equal' if a else 'DIFFERENT':<26} {'bitwise equal' if b else 'DIFFERENT':<24}"
        )


# ---- replay: bit flips -------------------------------------------------------------------------------------


def replay(bench: Bench, trials: int) -> None:
    draw = random.Random(7)
    print(
        "replay: a device computing wrongly in every backward from step S on (S drawn in 3..8), a bit flipped at "
        f"another element each time (bitflip) or at the same one (bitflip-same: the same wrong value), {trials} per row"
    )
    print(
        f"  {'fault':<13} {'processes':<10} {'--replay-every':<15} {'caught within N':<16} {'steps to catch':<16} "
        f"{'rank named':<11} {'run stopped':<11}"
    )
    for fault in ("bitflip", "bitflip-same"):
        for nproc in (1, 2):
            for every in (1, 2, 4):
                within, named, stopped, delays = 0, 0, 0, []
                for t in range(trials):
                    start, rank = draw.randint(3, 8), draw.randrange(nproc)
                    out, done = bench.train(
                        f"replay-{fault}-{nproc}-{every}-{t}", "--replay-every", str(every), nproc=nproc,
                        fault=f"{fault}:step={start},rank={rank}", steps=start + 8, ok=False,
                    )  # fmt: skip
                    stopped += done.returncode != 0 and "is suspect" in done.stderr
                    caught = [r for r in records(out, "bad_step") if r["cause"] == "replay mismatch"]
                    if caught:
                        delay = caught[0]["step"] - start
                        delays.append(delay)
                        within += delay < every
                        named += all(s["rank"] == rank for s in caught[0]["suspects"])
                shown = ", ".join(map(str, delays)) or "-"
                print(
                    f"  {fault:<13} {nproc:<10} {every:<15} {f'{within} of {trials}':<16} {shown:<16} "
                    f"{f'{named} of {trials}':<11} {f'{stopped} of {trials}':<11}"
                )
    k, once = 4, 0
    for micro in range(k):
        out, done = bench.train(
            f"replay-once-{micro}",
            "--bad-step",
            "skip-step",
            "--replay-every",
            "1",
            fault=f"bitflip:step=5,micro={micro}",
        )
        found = bench.attribute("one bit flip, replayed", done, out) if records(out, "bad_step") else []
        once += bool(found)
    print(f"  one flip in micro-batch m of step 5 (m = 0..{k - 1}, K {k}): caught {once} of {k} (replay draws 1 of K)")


# ---- quiet runs --------------------------------------------------------------------------------------------


def largest_scores(out: Path) -> tuple[float, float]:
    """The largest robust z-score of the step loss and of the gradient norm against the window before each step,
    as the detector computes it (every step applied, so its window is the steps logged)."""
    steps = [r for r in records(out, "step") if not r["skipped"]]
    best = [float("-inf"), float("-inf")]
    for i in range(SPIKE_MIN_STEPS, len(steps)):
        window = steps[max(0, i - SPIKE_WINDOW) : i]
        for slot, (name, floor) in enumerate((("loss", LOSS_SPREAD_FLOOR), ("grad_norm", GRAD_SPREAD_FLOOR))):
            history = [s[name] for s in window]
            median = spike_limit(history, 0.0, floor)
            spread = spike_limit(history, 1.0, floor) - median
            best[slot] = max(best[slot], (steps[i][name] - median) / spread)
    return best[0], best[1]


def quiet(bench: Bench, steps: int) -> None:
    print(f"quiet: {steps:,} steps without a fault, --replay-every 1, spike thresholds loss {LOSS_THRESHOLD:g} / "
          f"gradient norm {GRAD_THRESHOLD:g}")  # fmt: skip
    print(f"  {'run':<34} {'bad steps':<10} {'replays':<9} {'max loss z':<11} {'max grad-norm z':<15}")
    for nproc, tokens in ((1, 64), (1, 256), (2, 128)):
        out, done = bench.train(
            f"quiet-{nproc}-{tokens}", "--replay-every", "1", nproc=nproc, steps=steps, tokens=tokens
        )
        bad = len(records(out, "bad_step"))
        replays = re.search(r"(\d[\d,]*) micro-batch(?:es)? replayed", done.stdout)
        loss_z, grad_z = largest_scores(out)
        name = f"{nproc} process{'es' if nproc > 1 else ''}, {tokens} tokens/step (K {tokens // 64 // nproc})"
        print(f"  {name:<34} {bad:<10} {replays.group(1) if replays else '?':<9} {loss_z:<11.2f} {grad_z:<15.2f}")


# ---- overhead ----------------------------------------------------------------------------------------------


OVERHEAD_MODEL = ("--model", "nano", "--micro-batch", "8", "--seq-len", "128")  # later flags win over train's pico
OVERHEAD_STEPS = 30


def overhead(bench: Bench, rounds: int, rows: list[tuple[int, int]], quads: int) -> None:
    """The step time at ``--replay-every 1`` against off: nano, micro-batches of 8 x 128, rounds of two runs (off
    then on, on then off in the next round), each run's median step (steps 3..30). A round's overhead is its on-run
    over its off-run (minutes apart, not the hours the pooled medians span); the spread is that of the rounds."""
    print(
        f"overhead: --replay-every 1 against off, nano, micro-batch 8 x 128, {OVERHEAD_STEPS} steps a run (steps 3.. "
        f"timed), {rounds} alternating rounds; load {_load()} at the start"
    )
    print(
        f"  {'processes':<10} {'K':<3} {'off (ms)':<9} {'on (ms)':<9} {'overhead':<9} {'rounds: median [min, max]':<27}"
        f" {'goal 1/K + 5%':<14} {'load'}"
    )
    for nproc, k in rows:
        medians: dict[str, list[float]] = {"off": [], "on": []}
        for r in range(rounds):
            for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
                every = ["--replay-every", "1"] if mode == "on" else []
                out, _ = bench.train(
                    f"overhead-{nproc}-{k}-{mode}-{r}",
                    *OVERHEAD_MODEL,
                    *every,
                    nproc=nproc,
                    steps=OVERHEAD_STEPS,
                    tokens=1024 * k * nproc,
                )
                medians[mode].append(statistics.median(s["dt"] for s in records(out, "step")[2:]))
        off, on = statistics.median(medians["off"]), statistics.median(medians["on"])
        per_round = [b / a - 1 for a, b in zip(medians["off"], medians["on"], strict=True)]
        spread = f"{statistics.median(per_round):.1%} [{min(per_round):.1%}, {max(per_round):.1%}]"
        print(
            f"  {nproc:<10} {k:<3} {off * 1e3:<9.1f} {on * 1e3:<9.1f} {on / off - 1:<9.1%} {spread:<27} "
            f"{1 / k + 0.05:<14.1%} {_load()}"
        )
    if quads:
        overhead_in_process(sorted({k for nproc, k in rows if nproc == 1}), quads)


def overhead_in_process(ks: list[int], quads: int) -> None:
    """The same overhead with the runs' noise taken out: one process, one nano model, steps alternating off, on, on,
    off (a quad: a drift over it cancels), each quad's on-steps over its off-steps, in the process's CPU time (on a
    shared machine wall time also counts the waits for a core); the median and quartiles of the quads. What the
    first pass adds for the drawn micro-batch (its capture and digest) is inside its on-steps."""
    torch.set_num_threads(1)
    print(
        f"  in one process, CPU time of steps alternating off/on/on/off, {quads} quads after 2 warm-up steps "
        f"(load {_load()}):"
    )
    for k in ks:
        torch.manual_seed(0)
        model = GPT(preset("nano", vocab_size=256))
        engine = AccumulationEngine(
            model, build_adamw(model, 1e-3), constant_schedule(1e-3), bad_steps=BadStepSettings()
        )
        assert engine.guard is not None
        tokens = torch.Generator().manual_seed(k)
        times: list[float] = []
        for i in range(2 + 4 * quads):
            on = i >= 2 and (i - 2) % 4 in (1, 2)
            engine.guard.settings = BadStepSettings(replay_every=1 if on else 0)
            rows = torch.randint(0, 256, (8 * k, 129), generator=tokens)
            started = time.process_time()
            engine.step([MicroBatch(c[:, :-1], c[:, 1:]) for c in rows.chunk(k)])
            times.append(time.process_time() - started)
        ratios = [(times[j + 1] + times[j + 2]) / (times[j] + times[j + 3]) - 1 for j in range(2, len(times), 4)]
        q1, median, q3 = statistics.quantiles(ratios, n=4)
        print(
            f"    K {k}: overhead {median:.1%} [quartiles {q1:.1%}, {q3:.1%}; min {min(ratios):.1%}, max "
            f"{max(ratios):.1%}], goal {1 / k + 0.05:.1%}; load {_load()}"
        )


def _load() -> str:
    """The machine's load average over the last minute (timings on a shared machine move with it)."""
    return f"{os.getloadavg()[0]:.2f}"


def _rows(text: str) -> list[tuple[int, int]]:
    """``1x4,1x8`` -> ``[(1, 4), (1, 8)]``: processes and K per process."""
    return [(int(n), int(k)) for n, k in (row.split("x") for row in text.split(","))]


# ---- the detector: catch rate against poison share, false alarms -------------------------------------------

DETECTOR_K, DETECTOR_ROWS, DETECTOR_SEQ = 8, 2, 32
SHARES = (1, 2, 4, 8)  # poisoned micro-batches of the K 8 in a probe
POISONS = {
    "random bytes": "every byte value alike (the model has learnt that most never occur: an easy case)",
    "random characters": "bytes drawn from the corpus's own byte frequencies (garbled text: a hard case)",
}
LOSS_GRID = (4.0, 6.0, 8.0, 12.0, 16.0, 24.0)
GRAD_GRID = (10.0, 20.0, 40.0, 80.0)


@dataclass
class Observed:
    """One step's values as the guard computed them: the step's loss and gradient norm, each micro-batch's own."""

    loss: float
    grad_norm: float
    micro: list[tuple[float, float]]
    poisoned: tuple[int, ...] = ()  # a probe: which micro-batches held poison
    poison: str = ""  # a probe: which (a key of POISONS)
    warmup: bool = False  # a warm-up step: it fills the detector's window, and is not counted


def _micro_batches(
    tokens: torch.Tensor, draw: torch.Generator, poisoned: tuple[int, ...] = (), poison: str = ""
) -> list[MicroBatch]:
    """K micro-batches of random windows of the corpus; those at ``poisoned`` hold ``poison`` instead."""
    span = DETECTOR_SEQ + 1
    batches = []
    frequencies = torch.bincount(tokens, minlength=256).double()
    for index in range(DETECTOR_K):
        if index in poisoned and poison == "random bytes":
            rows = torch.randint(0, 256, (DETECTOR_ROWS, span), generator=draw)
        elif index in poisoned:
            rows = torch.multinomial(frequencies, DETECTOR_ROWS * span, True, generator=draw).view(DETECTOR_ROWS, span)
        else:
            starts = torch.randint(0, len(tokens) - span, (DETECTOR_ROWS,), generator=draw)
            rows = torch.stack([tokens[int(a) : int(a) + span] for a in starts])
        batches.append(MicroBatch(rows[:, :-1], rows[:, 1:], origin=((0, index),)))
    return batches


def _probe(engine: AccumulationEngine, batches: list[MicroBatch], poisoned: tuple[int, ...], poison: str) -> Observed:
    """A step's values computed as the guard computes them, and thrown away: gradients, generators as they were."""
    guard = engine.guard
    assert guard is not None
    rng = capture_rng_state()
    engine._zero_grad()
    done = guard._compute(engine, batches, None, None, len(batches))
    engine._zero_grad()
    restore_rng_state(rng)
    return Observed(done.loss, done.grad_norm, list(done.own), poisoned, poison)


def detector_values(corpus: Path, warmup: int, steps: int, probe_every: int) -> list[Observed]:
    """Pico trained for ``warmup + steps`` steps, the guard's detector off (nothing dropped): every step's values
    (the warm-up's marked), and after the warm-up, before every ``probe_every``-th step, a probe with a poisoned
    share."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    tokens = corpus_tokens(corpus)
    model = GPT(preset("pico", vocab_size=256))
    engine = AccumulationEngine(
        model, build_adamw(model, 2e-3), constant_schedule(2e-3), bad_steps=BadStepSettings(loss_spike=0, grad_spike=0)
    )
    guard = engine.guard
    assert guard is not None
    observed: list[Observed] = []
    keep = guard.spikes.observe

    def record(loss: float, grad_norm: float, micro: MicroValues = ()) -> None:
        observed.append(Observed(loss, grad_norm, list(micro)))
        keep(loss, grad_norm, micro)

    guard.spikes.observe = record
    draw = torch.Generator().manual_seed(1)
    for step in range(warmup + steps):
        if step >= warmup and (step - warmup) % probe_every == probe_every - 1:
            probe = (step - warmup) // probe_every
            share = SHARES[probe % len(SHARES)]
            poison = list(POISONS)[probe // len(SHARES) % len(POISONS)]
            poisoned = tuple(sorted(torch.randperm(DETECTOR_K, generator=draw)[:share].tolist()))
            observed.append(_probe(engine, _micro_batches(tokens, draw, poisoned, poison), poisoned, poison))
        engine.step(_micro_batches(tokens, draw))
    for value in observed[:warmup]:  # every warm-up step was applied, so observed, and none was probed
        value.warmup = True
    return observed


def replay_detector(values: list[Observed], loss: float, grad: float, step_only: bool = False) -> dict[str, Any]:
    """The detector at these thresholds over the observed run: false alarms on quiet steps (by the step's values,
    by a micro-batch's own), and per poison share the probes caught and those whose flagged micro-batches were
    exactly the poisoned ones. ``step_only``: the step's values alone (the detector before micro-batches were
    judged)."""
    detector = SpikeDetector(SPIKE_WINDOW, loss, grad, SPIKE_MIN_STEPS)
    alarms = {"step": 0, "micro": 0}
    caught = {(poison, share): [0, 0, 0] for poison in POISONS for share in SHARES}  # probes, caught, named exactly
    quiet = 0
    for value in values:
        by_step = detector._over(value.loss, value.grad_norm) is not None
        over = [] if step_only else [i for i, _, _ in detector.over_micro(value.micro)]
        if value.poisoned:
            tally = caught[value.poison, len(value.poisoned)]
            tally[0] += 1
            tally[1] += by_step or bool(over)
            tally[2] += sorted(over) == list(value.poisoned)
            continue
        if not value.warmup:
            quiet += 1
            alarms["step"] += by_step
            alarms["micro"] += bool(over) and not by_step
        detector.observe(value.loss, value.grad_norm, value.micro)
    return {"quiet": quiet, "alarms": alarms, "caught": caught}


def largest_z(values: list[Observed]) -> tuple[float, float, float, float]:
    """The largest robust z of the quiet steps (loss, gradient norm) and of their micro-batches' own values, each
    against the window before it (the detector's own formula, as :func:`largest_scores` computes it)."""
    best = [-math.inf] * 4
    window = SpikeDetector(SPIKE_WINDOW, min_steps=SPIKE_MIN_STEPS)
    for value in (v for v in values if not v.poisoned):
        if len(window.losses) >= SPIKE_MIN_STEPS and not value.warmup:
            micro_losses = [x for xs in window.micro_losses for x in xs]
            micro_norms = [x for xs in window.micro_norms for x in xs]
            for slot, (x, history, floor) in enumerate(
                (
                    (value.loss, list(window.losses), LOSS_SPREAD_FLOOR),
                    (value.grad_norm, list(window.grad_norms), GRAD_SPREAD_FLOOR),
                    (max(m[0] for m in value.micro), micro_losses, LOSS_SPREAD_FLOOR),
                    (max(m[1] for m in value.micro), micro_norms, GRAD_SPREAD_FLOOR),
                )
            ):
                median = spike_limit(history, 0.0, floor)
                best[slot] = max(best[slot], (x - median) / (spike_limit(history, 1.0, floor) - median))
        window.observe(value.loss, value.grad_norm, value.micro)
    return best[0], best[1], best[2], best[3]


def corpus_tokens(corpus: Path) -> torch.Tensor:
    """The corpus's bytes as token ids (the byte tokenizer's)."""
    return torch.from_numpy(np.frombuffer(corpus.read_bytes(), dtype=np.uint8).astype(np.int64))


def detector(bench: Bench, warmup: int, steps: int, probe_every: int) -> None:
    started = time.process_time()
    values = detector_values(bench.corpus, warmup, steps, probe_every)
    quiet = [v for v in values if not v.poisoned and not v.warmup]
    clean = statistics.median(x for v in quiet for x, _ in v.micro)
    print(
        f"detector: pico, K {DETECTOR_K} of {DETECTOR_ROWS} x {DETECTOR_SEQ}, {warmup} warm-up steps, {len(quiet):,} "
        f"quiet steps, a probe every {probe_every} ({time.process_time() - started:.0f} s of CPU); quiet "
        f"micro-batches' loss per token {clean:.2f}"
    )
    z = largest_z(values)
    print(f"  largest robust z of quiet steps: step loss {z[0]:.2f}, step gradient norm {z[1]:.2f}, micro-batch "
          f"loss {z[2]:.2f}, micro-batch own gradient norm {z[3]:.2f}")  # fmt: skip
    rows = [(loss, 0.0, False) for loss in LOSS_GRID] + [(0.0, grad, False) for grad in GRAD_GRID]
    rows += [(LOSS_THRESHOLD, GRAD_THRESHOLD, True), (LOSS_THRESHOLD, GRAD_THRESHOLD, False)]
    results = [replay_detector(values, loss, grad, step_only) for loss, grad, step_only in rows]
    for poison, what in POISONS.items():
        bad = statistics.median(v.micro[i][0] for v in values if v.poison == poison for i in v.poisoned)
        print(f"  {poison}, {what}: loss per token {bad:.2f} ({bad / clean:.1f}x the quiet micro-batches')")
        shares = "  ".join(f"{100 * s / DETECTOR_K:>8.1f}%" for s in SHARES)
        print(f"    {'loss / grad thresholds':<26} {'false alarms (step, micro)':<27} caught per share: {shares}")
        for (loss, grad, step_only), result in zip(rows, results, strict=True):
            name = f"{loss:g} / {grad:g}" + (" (step values only)" if step_only else "")
            alarms = f"{result['alarms']['step']}, {result['alarms']['micro']} of {result['quiet']:,}"
            cells = [result["caught"][poison, share] for share in SHARES]
            shown = "  ".join(f"{f'{c}/{n}' + ('' if step_only else f' ({e})'):>9}" for n, c, e in cells)
            print(f"    {name:<26} {alarms:<27}                   {shown}")
    print("  (caught/probes; in brackets, the probes whose flagged micro-batches were exactly the poisoned ones)")


# ---- the cost of the contribution norms --------------------------------------------------------------------


class _NoNorms:
    """The guard's contribution measurement switched off (what the guard costs without it)."""

    def __init__(self, *args: object) -> None:
        pass

    def measuring(self, into: list[torch.Tensor]) -> AbstractContextManager[None]:
        return nullcontext()

    def close(self) -> None:
        pass


NORM_SIZES = (("pico", 2, 32, 60), ("nano", 8, 128, 8))  # model, rows, seq_len, steps a round


def _random_windows(tokens: torch.Tensor, draw: torch.Generator, rows: int, seq_len: int) -> list[MicroBatch]:
    starts = torch.randint(0, len(tokens) - seq_len - 1, (DETECTOR_K, rows), generator=draw)
    windows = [torch.stack([tokens[int(a) : int(a) + seq_len + 1] for a in row]) for row in starts]
    return [MicroBatch(w[:, :-1], w[:, 1:]) for w in windows]


def _seconds_per_step(name: str, size: tuple[str, int, int, int], tokens: torch.Tensor, seed: int) -> float:
    model_name, rows, seq_len, steps = size
    torch.manual_seed(0)
    model = GPT(preset(model_name, vocab_size=256))
    guard = None if name == "guard off" else BadStepSettings()
    engine = AccumulationEngine(model, build_adamw(model, 1e-3), constant_schedule(1e-3), bad_steps=guard)
    draw = torch.Generator().manual_seed(seed)
    batches = [_random_windows(tokens, draw, rows, seq_len) for _ in range(steps + 2)]
    for batch in batches[:2]:
        engine.step(batch)
    started = time.process_time()
    for batch in batches[2:]:
        engine.step(batch)
    return (time.process_time() - started) / steps


def norms(bench: Bench, rounds: int) -> None:
    """Process CPU time per step, K 8 (pico of 2 x 32 and nano of 8 x 128): the guard off, on without the
    contribution norms, on; interleaved rounds."""
    from bigbatch.engine import step_guard

    measured = step_guard._ContributionNorm
    torch.set_num_threads(1)
    tokens = corpus_tokens(bench.corpus)
    print(f"norms: process CPU time per step, K {DETECTOR_K}, {rounds} interleaved rounds (median, rounds' range)")
    for size in NORM_SIZES:
        times: dict[str, list[float]] = {"guard off": [], "guard, no norms": [], "guard": []}
        for r in range(rounds):
            for name in list(times) if r % 2 == 0 else list(reversed(times)):
                step_guard._ContributionNorm = _NoNorms if name == "guard, no norms" else measured
                times[name].append(_seconds_per_step(name, size, tokens, r))
        step_guard._ContributionNorm = measured
        model_name, rows, seq_len, steps = size
        params = sum(1 for p in GPT(preset(model_name, vocab_size=256)).parameters() if p.requires_grad)
        print(f"  {model_name}, micro-batches of {rows} x {seq_len}, {params} parameter tensors (a norm each per "
              f"micro-batch), {steps} steps a round:")  # fmt: skip
        base = statistics.median(times["guard, no norms"])
        for name, values in times.items():
            median = statistics.median(values)
            spread = f"{min(values) * 1e3:.1f}-{max(values) * 1e3:.1f}"
            print(f"    {name:<16} {median * 1e3:8.2f} ms ({spread}) {median / base - 1:+7.1%} against no norms")
        print(f"    under cProfile, one round of the guard: {_profiled_share(size, tokens):.1%} of its time in the "
              "norms' hooks (each a norm of the incoming gradient) and in putting them on and off")  # fmt: skip


def _profiled_share(size: tuple[str, int, int, int], tokens: torch.Tensor) -> float:
    """The share of a round's time spent measuring contributions, by cProfile (which a loaded machine's noise does
    not blur as it blurs a comparison of two runs' medians)."""
    profile = cProfile.Profile()
    profile.enable()
    _seconds_per_step("guard", size, tokens, 0)
    profile.disable()
    stats = pstats.Stats(profile)
    rows = [(function, row[3]) for (path, _, function), row in stats.stats.items() if path.endswith("step_guard.py")]  # type: ignore[attr-defined]
    closes = [seconds for function, seconds in rows if function == "close"]  # the watch's calls the hooks' own
    spent = sum(seconds for function, seconds in rows if function in ("_measure", "_open")) + min(closes, default=0.0)
    return spent / stats.total_tt  # type: ignore[attr-defined]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("exact", "skip-step", "replay", "quiet", "overhead", "detector", "norms"))
    parser.add_argument("--quiet-steps", type=int, default=2000)
    parser.add_argument("--replay-trials", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=10, help="overhead: alternating rounds of an off and an on run")
    parser.add_argument("--quads", type=int, default=15, help="overhead: off/on/on/off quads of steps in one process")
    parser.add_argument(
        "--overhead-rows", default="1x4,1x8", help="overhead: PROCESSESxK rows, comma-separated (e.g. 1x4,1x8,2x4)"
    )
    parser.add_argument("--detector-steps", type=int, default=4000, help="detector: quiet steps measured")
    parser.add_argument("--detector-warmup", type=int, default=300, help="detector: steps trained before them")
    parser.add_argument("--norm-rounds", type=int, default=6, help="norms: interleaved rounds")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        corpus, line = generated_corpus(work, 400_000)
        print(line)
        bench = Bench(corpus, work)
        parts = {
            "exact": lambda: exact(bench),
            "skip-step": lambda: skip_step(bench),
            "replay": lambda: replay(bench, args.replay_trials),
            "quiet": lambda: quiet(bench, args.quiet_steps),
            "overhead": lambda: overhead(bench, args.rounds, _rows(args.overhead_rows), args.quads),
            "detector": lambda: detector(bench, args.detector_warmup, args.detector_steps, 5),
            "norms": lambda: norms(bench, args.norm_rounds),
        }
        for name, part in parts.items():
            if args.only in (None, name):
                part()
        if bench.attributed:
            named = sum(ok for _, ok in bench.attributed)
            print(
                f"attribution: {named} of {len(bench.attributed)} injected faults named by step, rank, micro-batch and documents"
            )
            for case, ok in bench.attributed:
                if not ok:
                    print(f"  not named: {case}")
        print(f"({bench.runs} runs of bigbatch train)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
