"""Bad steps, measured with faults injected into real ``bigbatch train`` runs (CPU, gloo, 1 thread per process).

    python benchmarks/bad_steps.py                  # every part (about 10 minutes on 2 cores)
    python benchmarks/bad_steps.py --only exact     # exact | skip-step | replay | quiet | overhead

Pico on the generated English-like corpus (tests/support/text_corpus.py), micro-batches of 2 x 32 tokens.

* exact: ``--bad-step skip-micro`` with bad data (``nan-input``) in micro-batch 1 of step 4, on 1 process, DDP and
  FSDP2 with 2 (on rank 1): the final parameters and optimizer state against a run whose data leaves out that
  micro-batch's documents (the exclusions a rewind writes, given from the start). Goal: bitwise.
* skip-step: an Inf in a gradient of step 4 under ``--bad-step skip-step``, against the run whose data leaves out
  every micro-batch of step 4 and the run where every one of them is bad data (skip-micro drops them all). Goal:
  bitwise, and every Adam moment finite.
* replay: a device that flips a bit in every backward from a drawn step on a drawn rank, caught by
  ``--replay-every N`` (goal: within N steps, the rank named); a single flip in one micro-batch (caught only when
  the replay draws it: about 1/K of the time).
* quiet: 2,000 steps without a fault at ``--replay-every 1`` and the default spike thresholds (1 and 2 processes,
  64 and 256 tokens a step). Goal: 0 bad steps; each run's largest robust z-score of the step loss and gradient
  norm against its window (the detector's own formula) shows the margin below the thresholds (12 and 40).
* overhead: the median step time at ``--replay-every 1`` against replay off, K 4 and 8, 1 and 2 processes,
  interleaved runs. Goal: at most 1/K of a step + 5%.

Attribution: every injected point fault's step, rank, micro-batch and documents (the fault's own line, printed as
it fires) against the ``kind: bad_step`` record. Goal: 100%.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from bench_config import generated_corpus

from bigbatch.engine.bad_steps import GRAD_SPREAD_FLOOR, LOSS_SPREAD_FLOOR, spike_limit
from bigbatch.run.checkpoints import checkpoint as ckpt

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
FAULT_LINE = re.compile(r"fault (\S+) fired: step (\d+), rank (\d+), micro-batch (\d+), documents (\S+)")
LAYOUTS = {"1 process": (1, "none"), "DDP, 2 processes": (2, "ddp"), "FSDP2, 2 processes": (2, "fsdp")}
SPIKE_WINDOW, SPIKE_MIN_STEPS, LOSS_THRESHOLD, GRAD_THRESHOLD = 100, 20, 12.0, 40.0


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
    print(f"replay: a device flipping a bit in every backward from step S on (S drawn in 3..8), {trials} per row")
    print(
        f"  {'processes':<10} {'--replay-every':<15} {'caught within N':<16} {'steps to catch':<16} {'rank named':<10}"
    )
    for nproc in (1, 2):
        for every in (1, 2, 4):
            within, named, delays = 0, 0, []
            for t in range(trials):
                start, rank = draw.randint(3, 8), draw.randrange(nproc)
                out, done = bench.train(
                    f"replay-{nproc}-{every}-{t}", "--bad-step", "skip-step", "--replay-every", str(every),
                    "--max-consecutive-skips", "100", nproc=nproc, fault=f"bitflip:step={start},rank={rank}",
                    steps=start + 8, ok=False,
                )  # fmt: skip
                caught = [r for r in records(out, "bad_step") if r["cause"] == "replay mismatch"]
                if caught:
                    delay = caught[0]["step"] - start
                    delays.append(delay)
                    within += delay < every
                    named += all(s["rank"] == rank for s in caught[0]["suspects"])
            shown = ", ".join(map(str, delays))
            print(f"  {nproc:<10} {every:<15} {f'{within} of {trials}':<16} {shown:<16} {f'{named} of {trials}':<10}")
    k, caught = 4, 0
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
        caught += bool(found)
    print(
        f"  one flip in micro-batch m of step 5 (m = 0..{k - 1}, K {k}): caught {caught} of {k} (replay draws 1 of K)"
    )


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


def overhead(bench: Bench, rounds: int) -> None:
    print(f"overhead: median step time at --replay-every 1 against off (steps 3..40, {rounds} interleaved rounds)")
    print(f"  {'processes':<10} {'K':<3} {'off (ms)':<9} {'on (ms)':<9} {'overhead':<9} {'goal 1/K + 5%':<13}")
    for nproc, k in ((1, 4), (1, 8), (2, 4)):
        times: dict[str, list[float]] = {"off": [], "on": []}
        for r in range(rounds):
            for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
                every = ["--replay-every", "1"] if mode == "on" else []
                out, _ = bench.train(
                    f"overhead-{nproc}-{k}-{mode}-{r}", *every, nproc=nproc, steps=40, tokens=64 * k * nproc
                )
                times[mode] += [s["dt"] for s in records(out, "step")[2:]]
        off, on = statistics.median(times["off"]), statistics.median(times["on"])
        print(f"  {nproc:<10} {k:<3} {off * 1e3:<9.2f} {on * 1e3:<9.2f} {on / off - 1:<9.1%} {1 / k + 0.05:<13.1%}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("exact", "skip-step", "replay", "quiet", "overhead"))
    parser.add_argument("--quiet-steps", type=int, default=2000)
    parser.add_argument("--replay-trials", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
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
            "overhead": lambda: overhead(bench, args.rounds),
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
