"""Learning from rewards (``--objective grpo``) through ``bigbatch train``: every aggregation the same update however
the step is cut, on CPU.

    python benchmarks/grpo_exactness.py            # 5 aggregations: ppo over 5 cuts, cispo over 3, 40 runs, 13 min
    python benchmarks/grpo_exactness.py --quick    # ppo alone over the 3 unpacked cuts, 15 runs, about 4 minutes
    python benchmarks/grpo_exactness.py --aggregations token-mean --policy-losses cispo --no-processes

The model is a tiny random Llama over the byte vocabulary (tests/support/hf_models: 2 layers, 32 wide), saved to a
temporary directory and trained as ``--model hf:DIR``. The rollouts are fixed: 9 groups of completions of random
bytes built here (3 a step, of 3, 2 and 3 completions, so 8 a step; prompts of 2 to 7 tokens, completions of 1 to 14;
one group flat: every reward equal), written as a ``--rollouts`` JSONL file with each token's old log-probability
(``logps``: the starting model's own, plus noise of 0.2 nats), so the ratio is not 1 and both clips (``ppo``'s
two-sided one, ``cispo``'s weight clip) cut some tokens. Each run trains 3 AdamW steps (fp32, lr 1e-2 constant, no
warm-up, no gradient clipping), and the runs that cut the same steps differently are compared by the relative L2
distance of their final parameters (every parameter, from the run's checkpoint; goal: at most 1e-5):

* ``8 x K 1`` (the reference): micro-batches of 8 rows, one completion a row (``--pack off``): the step's 8
  completions in one micro-batch, the one big batch;
* ``1 x K 8``: one completion a micro-batch, so every group is cut across micro-batches;
* ``2 processes x 3 x K 2``: micro-batches of 3 rows dealt to 2 ranks: rank 0 trains units 0 and 2 (5
  completions), rank 1 unit 1 (3 completions) and one of padding; the third group lies across both ranks;
* ``packed 1 x K 4``: one row of 32 positions a micro-batch, completions packed into it first fit (2, 3, 2 and 1
  completions, then 3, 2, 2, 1 twice);
* ``2 processes packed 1 x K 2``: the same packed units dealt to 2 ranks (4 and 4 completions, then 5 and 3 twice),
  no micro-batch of padding.

The packed cuts are ppo's alone (``--quick`` leaves them out, and cispo). A run that fails is a row that says so,
the line below the table quotes its error, and the script exits 1 at the end.

AdamW's first steps divide each gradient element by its own size, so fp32 rounding in the smallest elements shows
in the parameters at 1e-7 to 1e-5 even where each step's gradients agree to about 2e-7 (as far as either is from
the float64 gradient); ppo's clip, a jump in the gradient where the ratio crosses 1 +- e, adds to it.

Then the bug the exact version avoids, in process (the same model, rollouts and AdamW settings, ``token-mean``,
ppo): each micro-batch normalising by its own tokens and the micro-batches averaged (what a trainer that divides
each micro-batch's token mean by K does), against the same one big batch; and the in-process big batch against the
command's, as a check that the two are the same training.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT), str(ROOT.parent / "tests" / "support")]
from hf_models import save_hf  # noqa: E402
from preference_exactness import bigbatch, trained, worst  # noqa: E402

from bigbatch.data.rollouts import Completion, Group  # noqa: E402
from bigbatch.engine.policy_gradient import LOSS_AGGREGATIONS, POLICY_LOSSES, RewardObjective  # noqa: E402

STEPS, PROMPTS_PER_STEP, SEQ_LEN, PACKED_ROW, LR = 3, 3, 24, 32, 1e-2
GROUP_SIZES = (3, 2, 3)  # each step's groups: 8 completions
OLD_NOISE = 0.2  # nats between the starting model's log-probabilities and the rollout's


def rollouts(model_dir: Path, seed: int = 0) -> list[Group]:
    """``STEPS x PROMPTS_PER_STEP`` groups of random printable bytes, uneven in length, their old log-probabilities
    the model's own (a plain transformers forward) plus noise; the middle group of step 2 flat."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    gen = random.Random(seed)
    groups = []
    for g in range(STEPS * PROMPTS_PER_STEP):
        prompt = [gen.randrange(32, 127) for _ in range(gen.randint(2, 7))]
        flat = g == PROMPTS_PER_STEP + 1
        completions = []
        for _ in range(GROUP_SIZES[g % PROMPTS_PER_STEP]):
            tokens = [gen.randrange(32, 127) for _ in range(gen.randint(1, 14))]
            ids = torch.tensor([prompt + tokens])
            with torch.no_grad():
                logp = torch.log_softmax(model(ids).logits.float(), -1)[0, len(prompt) - 1 : -1]
            own = logp.gather(1, ids[0, len(prompt) :, None])[:, 0].tolist()
            logps = [min(v + gen.gauss(0.0, OLD_NOISE), -1e-3) for v in own]
            completions.append(Completion(prompt, tokens, 0.5 if flat else round(gen.random(), 3), None, logps))
        groups.append(Group(str(g), completions))
    return groups


def write_rollouts(groups: list[Group], path: Path) -> Path:
    with path.open("w") as f:
        for group in groups:
            for c in group.completions:
                row = {"group": group.key, "prompt_ids": c.prompt, "completion_ids": c.tokens, "reward": c.reward}
                f.write(json.dumps({**row, "logps": c.old_logps}) + "\n")
    return path


CUTS: dict[str, list[str]] = {
    "8 x K 1": ["--micro-batch", "8", "--pack", "off"],
    "1 x K 8": ["--micro-batch", "1", "--pack", "off"],
    "2 processes x 3 x K 2": ["--micro-batch", "3", "--pack", "off", "--nproc", "2"],
    "packed 1 x K 4": ["--micro-batch", "1", "--pack", "on", "--seq-len", str(PACKED_ROW)],
    "2 processes packed 1 x K 2": ["--micro-batch", "1", "--pack", "on", "--seq-len", str(PACKED_ROW), "--nproc", "2"],
}


def failure(exc: SystemExit) -> str:
    """The line of a failed run's output that says why."""
    lines = [line.strip() for line in str(exc.code).splitlines() if line.strip()]
    for marker in ("what():", "Error:", "error:"):
        found = [line for line in lines if marker in line]
        if found:
            return found[0][:200]
    return lines[-1][:200] if lines else "no output"


def cli_runs(
    root: Path,
    model_dir: Path,
    rollout_file: Path,
    aggregations: list[str],
    losses: list[str],
    cuts: list[str],
    quick: bool,
) -> tuple[tuple[str, str, dict[str, torch.Tensor]] | None, bool]:
    """Every run of the table; the first reference's aggregation, policy loss and final parameters, and whether a
    run failed."""
    text = root / "text.txt"  # the run's --data names the tokenizer alone: nothing is trained on its text
    text.write_text("the byte tokenizer needs a corpus to name\n" * 40)
    print(
        f"relative L2 of the final parameters after {STEPS} AdamW steps against 8 x K 1, the one big batch "
        "(goal <= 1e-5)"
    )
    print(f"{'aggregation':<24} {'loss':<6} {'run':<27} {'rel L2':>9} {'wall':>6}")
    first = None
    failures: dict[str, str] = {}
    for aggregation in aggregations:
        for loss in losses:
            common = [
                *("train", "--model", f"hf:{model_dir}", "--tokenizer", "byte", "--data", str(text)),
                *("--objective", "grpo", "--rollouts", str(rollout_file), "--prompts-per-step", str(PROMPTS_PER_STEP)),
                *("--loss-aggregation", aggregation, "--policy-loss", loss, "--seq-len", str(SEQ_LEN)),
                *("--max-steps", str(STEPS), "--lr", str(LR), "--min-lr-ratio", "1", "--warmup-steps", "0"),
                *("--grad-clip", "0", "--eval-every", "0", "--sample-tokens", "0", "--cache-dir", str(root / "cache")),
            ]
            reference = None
            for label in ["8 x K 1", *[c for c in cuts if "packed" not in c or (loss == "ppo" and not quick)]]:
                out = root / "runs" / f"{aggregation}-{loss}-{label.replace(' ', '')}"
                started = time.perf_counter()
                try:
                    bigbatch(*common, *CUTS[label], "--out", str(out))
                except SystemExit as exc:  # a failed run is a row of the table, not the end of it
                    if reference is None:
                        raise
                    failures.setdefault(label, failure(exc))
                    shown = "failed"
                else:
                    params = trained(out, lora=False)
                    if reference is None:
                        reference, shown = params, "reference"
                        first = first if first is not None else (aggregation, loss, params)
                    else:
                        shown = f"{worst(params, reference):9.2e}"
                wall = time.perf_counter() - started
                print(f"{aggregation:<24} {loss:<6} {label:<27} {shown:>9} {wall:5.1f}s", flush=True)
    for label, why in failures.items():
        print(f"{label} failed (first time): {why}")
    return first, bool(failures)


class MicroBatchMean(RewardObjective):
    """The naive aggregation: each micro-batch's token mean over its own tokens, the step the mean of its
    micro-batches (each micro-batch counts as one ``token`` unit, so the engine divides by K)."""

    def units(self, batch: Any) -> dict[str, float]:
        return {"token": 1.0}

    def sums(self, model: torch.nn.Module, batch: Any, index: int) -> dict[str, torch.Tensor]:
        tokens = float((batch.answers.segment >= 0).sum())
        return {name: value / max(tokens, 1.0) for name, value in super().sums(model, batch, index).items()}


def in_process(model_dir: Path, groups: list[Group], micro_batch: int, naive: bool) -> dict[str, torch.Tensor]:
    """``STEPS`` steps over ``groups`` (token-mean, ppo) at micro-batches of ``micro_batch`` rows, one completion a
    row, as the command trains them (its loader, engine and AdamW); the final parameters."""
    from bigbatch.data.rollout_loader import FileRollouts, RolloutLoader
    from bigbatch.engine.accumulate import AccumulationEngine
    from bigbatch.engine.optim import build_adamw, constant_schedule
    from bigbatch.engine.policy_gradient import RewardLossSettings
    from bigbatch.models.hf.model import build_hf_model, read_hf_config

    model = build_hf_model(read_hf_config(model_dir), weights=True, dropout=0.0)
    objective = (MicroBatchMean if naive else RewardObjective)(RewardLossSettings("token-mean", "ppo"))
    engine = AccumulationEngine(
        model, build_adamw(model, lr=LR), constant_schedule(LR), grad_clip=0.0, objective=objective
    )
    loader = RolloutLoader(FileRollouts(groups), PROMPTS_PER_STEP, micro_batch, SEQ_LEN, pack=False)
    for _ in range(STEPS):
        k = loader.micro_batches_next_step()
        engine.step([loader.next_micro_batch() for _ in range(k)])
    return {name: p.detach().float().clone() for name, p in model.state_dict().items() if p.is_floating_point()}


def contrast(model_dir: Path, groups: list[Group], command: dict[str, torch.Tensor] | None) -> None:
    print(f"in process, token-mean, ppo, {STEPS} AdamW steps: rel L2 of the final parameters against 8 x K 1")
    reference = in_process(model_dir, groups, 8, naive=False)
    if command is not None:
        print(f"  8 x K 1 in process against the command's 8 x K 1: {worst(reference, command):9.2e}")
    print(f"  {'run':<10} {'exact: the step counts':>26} {'micro-batch-mean: its own':>27}")
    for label, micro_batch in (("1 x K 8", 1), ("3 x K 3", 3)):
        exact = worst(in_process(model_dir, groups, micro_batch, naive=False), reference)
        naive = worst(in_process(model_dir, groups, micro_batch, naive=True), reference)
        print(f"  {label:<10} {exact:>26.2e} {naive:>27.2e}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--aggregations", default=",".join(LOSS_AGGREGATIONS))
    parser.add_argument("--policy-losses", default=",".join(POLICY_LOSSES))
    parser.add_argument("--no-processes", action="store_true", help="leave out the two-process runs")
    parser.add_argument("--quick", action="store_true", help="ppo alone, and no packed cuts")
    args = parser.parse_args()
    torch.set_num_threads(1)
    losses = ["ppo"] if args.quick else args.policy_losses.split(",")
    cuts = [c for c in CUTS if c != "8 x K 1" and not (args.no_processes and "processes" in c)]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = root / "tiny-llama"
        save_hf("llama", model_dir)
        groups = rollouts(model_dir)
        rollout_file = write_rollouts(groups, root / "rollouts.jsonl")
        first, failed = cli_runs(root, model_dir, rollout_file, args.aggregations.split(","), losses, cuts, args.quick)
        same = first is not None and first[:2] == ("token-mean", "ppo")
        contrast(model_dir, groups, first[2] if first is not None and same else None)
    print(f"total {time.perf_counter() - started:.0f} s")
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
