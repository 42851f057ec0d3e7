"""A mixture of experts' load-balancing loss over the step (--router-balance): exactness, cost and quality, on CPU.

    python benchmarks/moe_balance.py              # all three
    python benchmarks/moe_balance.py --only cost  # exactness | cost | quality

* Exactness: ``bigbatch train`` runs of 3 steps of 8 sequences x 32 tokens as micro-batch 8 x K 1, 1 x K 8 and two
  processes of 2 x K 2, for moe-pico and a tiny transformers Mixtral (hf:DIR), with ``exact`` and with ``micro``:
  the relative L2 of each run's update (final - initial parameters) against the 8 x K 1 run's (goal with exact:
  <= 1e-5; micro differs, by the printed amount).
* Cost of ``exact``: moe-nano steps of K 8 micro-batches of 4 x 128 tokens, ``exact`` (routing pass), ``off`` (no
  balancing loss, no pass) and ``micro``, interleaved rounds, medians; with and without activation checkpointing
  (goal: exact at most 1.35 x off).
* Quality: moe-pico at K 8 (micro-batch 2 x 64), 200 steps on the built-in corpus, paired seeds: the validation
  loss and the expert-load coefficient of variation (mean of the last 20 steps' busiest layer) for ``exact``,
  ``micro`` and ``off``; the paired differences with their spread.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from bench_config import interleaved_step_rates

from bigbatch.engine.accumulate import AccumulationEngine
from bigbatch.engine.batch import MicroBatch
from bigbatch.engine.language_model import LanguageModelObjective
from bigbatch.engine.optim import build_adamw, constant_schedule
from bigbatch.models import build_model, model_preset
from bigbatch.observe.metrics import read_records

ROOT = Path(__file__).resolve().parents[1]
SEEDS = (1, 2, 3, 4, 5)
QUALITY_STEPS = 200


def bigbatch(*args: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "bigbatch", *args], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"bigbatch {' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return done.stdout


def checkpoint_parameters(run_dir: Path) -> torch.Tensor:
    """The run's final parameters, flattened in name order (float64)."""
    from bigbatch.run.checkpoints import checkpoint as ckpt

    model = ckpt.load_checkpoint(run_dir)["model"]
    return torch.cat([value.flatten().double() for _, value in sorted(model.items())])


def tiny_mixtral(directory: Path) -> Path:
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
        router_aux_loss_coef=0.5,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(config).save_pretrained(directory)
    return directory


def exactness(work: Path) -> None:
    models = {"moe-pico (coef 0.5)": ["--model", "moe-pico", "--router-aux-coef", "0.5"]}
    models["hf Mixtral (coef 0.5)"] = ["--model", f"hf:{tiny_mixtral(work / 'mixtral')}"]
    shapes = {"8 x K1": ["--micro-batch", "8"], "1 x K8": ["--micro-batch", "1"], "2 procs 2 x K2": ["--micro-batch", "2", "--nproc", "2"]}  # fmt: skip
    common = ["--data", "builtin", "--cache-dir", str(work / "cache"), "--seq-len", "32", "--total-batch-tokens",
              "256", "--max-steps", "3", "--eval-every", "0", "--sample-tokens", "0", "--noise-scale-every", "0",
              "--lr", "1e-2", "--warmup-steps", "0", "--seed", "7"]  # fmt: skip
    print("exactness: the update after 3 steps (final - initial parameters) against 8 x K1's, relative L2")
    for label, model in models.items():
        initial_dir = work / f"init-{len(label)}"
        # one step at lr 1e-30 (AdamW moves each parameter by about lr): the initial parameters, to fp32 rounding
        bigbatch("train", *common, *model, "--micro-batch", "8", "--max-steps", "1", "--lr", "1e-30", "--out",
                 str(initial_dir))  # fmt: skip
        initial = checkpoint_parameters(initial_dir)
        for mode in ("exact", "micro"):
            updates = {}
            for shape, flags in shapes.items():
                out = work / f"{len(label)}-{mode}-{shape.replace(' ', '')}"
                bigbatch("train", *common, *model, *flags, "--router-balance", mode, "--out", str(out))
                updates[shape] = checkpoint_parameters(out) - initial
            reference = updates["8 x K1"]
            diffs = ", ".join(
                f"{shape} {float((u - reference).norm() / reference.norm()):.1e}"
                for shape, u in updates.items()
                if shape != "8 x K1"
            )
            print(f"  {label:<22} {mode:<6} {diffs}")


def cost() -> None:
    torch.manual_seed(0)
    B, T, K = 4, 128, 8
    tokens = torch.randint(0, 256, (K, B, T + 1), generator=torch.Generator().manual_seed(1))
    batches = [MicroBatch(t[:, :-1], t[:, 1:]) for t in tokens]
    for checkpointing in (False, True):
        engines = {}
        for mode in ("off", "exact", "micro"):
            torch.manual_seed(0)
            model = build_model(model_preset("moe-nano", vocab_size=256))
            model.activation_checkpointing = checkpointing
            engines[mode] = AccumulationEngine(
                model,
                build_adamw(model, 1e-3),
                constant_schedule(1e-3),
                grad_clip=1.0,
                objective=LanguageModelObjective(router_balance=mode),
            )
        median, rounds = interleaved_step_rates(engines, batches, 10, 3, 90.0)
        print(
            f"cost: moe-nano, {B} x {T} x K {K}, activation checkpointing {'on' if checkpointing else 'off'}, "
            f"{rounds} interleaved rounds, median tokens/s: "
            + ", ".join(f"{mode} {rate:,.0f}" for mode, rate in median.items())
        )
        print(
            f"  step time exact / off: {median['off'] / median['exact']:.3f} (goal <= 1.35); "
            f"micro / off: {median['off'] / median['micro']:.3f}"
        )


def quality(work: Path) -> None:
    results: dict[str, list[tuple[float, float]]] = {"exact": [], "micro": [], "off": []}
    for seed in SEEDS:
        for mode in results:
            out = work / f"q-{mode}-{seed}"
            bigbatch(
                "train", "--model", "moe-pico", "--micro-batch", "2", "--seq-len", "64", "--total-batch-tokens",
                "1024", "--max-steps", str(QUALITY_STEPS), "--eval-every", str(QUALITY_STEPS), "--eval-batches",
                "auto", "--sample-tokens", "0", "--noise-scale-every", "0", "--router-balance", mode, "--seed",
                str(seed), "--cache-dir", str(work / "cache"), "--out", str(out),
            )  # fmt: skip
            records = read_records(out)
            val = [r["val_loss"] for r in records if r["kind"] == "eval"][-1]
            cv = statistics.mean([r["expert_load_cv"] for r in records if r["kind"] == "step"][-20:])
            results[mode].append((val, cv))
    print(f"quality: moe-pico, 2 x 64 x K 8, {QUALITY_STEPS} steps, seeds {', '.join(map(str, SEEDS))}")
    for mode, values in results.items():
        vals, cvs = [v for v, _ in values], [c for _, c in values]
        print(f"  {mode:<6} val loss {statistics.mean(vals):.4f} +- {statistics.stdev(vals):.4f} | expert-load CV "
              f"{statistics.mean(cvs):.3f} +- {statistics.stdev(cvs):.3f}")  # fmt: skip
    for other in ("micro", "off"):
        dv = [a[0] - b[0] for a, b in zip(results["exact"], results[other], strict=True)]
        dc = [a[1] - b[1] for a, b in zip(results["exact"], results[other], strict=True)]
        print(f"  exact - {other:<5} paired: val loss {statistics.mean(dv):+.4f} (sd {statistics.stdev(dv):.4f}), "
              f"CV {statistics.mean(dc):+.3f} (sd {statistics.stdev(dc):.3f})")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("exactness", "cost", "quality"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="moe-balance-") as tmp:
        work = Path(tmp)
        if args.only in (None, "exactness"):
            exactness(work)
        if args.only in (None, "cost"):
            cost()
        if args.only in (None, "quality"):
            quality(work)


if __name__ == "__main__":
    main()
