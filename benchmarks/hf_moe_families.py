"""Every mixture of experts the installed transformers ships, built tiny and random offline (the zoo of
``tests/support/hf_moe_zoo.py``), as bigbatch's ``hf:DIR`` wraps it: which train exactly with the step's balancing
loss, which are refused and why, and how exact the supported ones are.

    python benchmarks/hf_moe_families.py               # every model type
    python benchmarks/hf_moe_families.py mixtral olmoe # some

For each model type, one row:

* ``exact``: the router probe matched the model's ``aux_loss``. Measured: the relative difference of bigbatch's
  balancing loss at K 1 from transformers' ``aux_loss`` on the same batch, and 3 AdamW steps (lr 1e-3, fp32) of 8
  sequences x 16 tokens as micro-batch 8 x K 1 and as 1 x K 8 with ``--router-balance exact`` (the engine's
  default): the relative L2 of the final parameters and of the updates (final - initial) of K 8 against K 1
  (goal: parameters <= 1e-5), and of the first step's gradient. AdamW turns a gradient that is rounding noise (a
  router whose weights get none, as under hash routing) into whole steps, so the update can differ where the
  gradient agrees.
* ``refused``: the probe did not match (or the model returns no router logits): the one line ``bigbatch train``
  prints; the same 3 steps are measured with no balancing loss, which ``--router-balance off`` trains.
* ``config``: ``config.json`` alone is refused (the line); ``not built``: the zoo cannot build it tiny.

The last line is the share of the model types that train exactly with their balancing loss.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))

from hf_moe_zoo import NOT_BUILT, accumulated_gradient, moe_model_types, wrap_tiny  # noqa: E402

from bigbatch.engine.accumulate import AccumulationEngine  # noqa: E402
from bigbatch.engine.batch import MicroBatch  # noqa: E402
from bigbatch.engine.optim import build_adamw, constant_schedule  # noqa: E402
from bigbatch.models.hf.model import HFCausalLM  # noqa: E402
from bigbatch.models.hf.router_probe import describe  # noqa: E402

STEPS = 3
ROWS, SEQ_LEN = 8, 16


@dataclass
class Outcome:
    model_type: str
    verdict: str  # exact | refused | config | not built
    line: str = ""  # the refusal, or the probe's definition
    aux_rel: float | None = None  # |bigbatch balancing loss - aux_loss| / aux_loss at K 1
    grad_rel: float | None = None  # the first step's gradient, K 8 against K 1
    params_rel: float | None = None  # K 8 against K 1 after STEPS steps
    update_rel: float | None = None

    def row(self) -> str:
        cells = [f"{self.model_type:24s}", f"{self.verdict:9s}"]
        if self.aux_rel is not None:
            cells.append(f"aux_loss rel {self.aux_rel:.1e}")
        if self.grad_rel is not None and self.params_rel is not None and self.update_rel is not None:
            cells.append(
                f"K8 vs K1: gradient {self.grad_rel:.1e}, params {self.params_rel:.1e}, update {self.update_rel:.1e}"
            )
        if self.line:
            cells.append(self.line)
        return " | ".join(cells)


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().double() for p in model.parameters()])


def train(model: HFCausalLM, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """The parameters after STEPS AdamW steps of the whole batch split into ``k`` micro-batches."""
    replica = copy.deepcopy(model)
    engine = AccumulationEngine(replica, build_adamw(replica, lr=1e-3), constant_schedule(1e-3))
    for step in range(STEPS):
        batch = tokens[step]
        inputs, targets = batch[:, :-1], batch[:, 1:]
        engine.step([MicroBatch(x, y) for x, y in zip(inputs.tensor_split(k), targets.tensor_split(k), strict=True)])
    return flat(replica)


def aux_loss_gap(model: HFCausalLM, tokens: torch.Tensor) -> float:
    """bigbatch's balancing loss at K 1 against transformers' ``aux_loss`` on the same batch, relative."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    with torch.no_grad():
        aux = float(model.hf_model.eval()(input_ids=inputs, output_router_logits=True, use_cache=False).aux_loss)
    model.hf_model.train()
    replica = copy.deepcopy(model)
    engine = AccumulationEngine(replica, torch.optim.SGD(replica.parameters(), lr=1e-12), constant_schedule(1e-12))
    record = engine.step([MicroBatch(inputs, targets)])
    return abs(record.measurements["router"].balance_loss - aux) / abs(aux)


def measure(model_type: str) -> Outcome:
    if model_type in NOT_BUILT:
        return Outcome(model_type, "not built", NOT_BUILT[model_type])
    with tempfile.TemporaryDirectory() as tmp:
        model = wrap_tiny(model_type, Path(tmp))
    if isinstance(model, str):
        return Outcome(model_type, "config", model.replace(tmp, "DIR"))
    tokens = torch.randint(0, 256, (STEPS, ROWS, SEQ_LEN + 1), generator=torch.Generator().manual_seed(7))
    probe = model.router_probe
    if probe is None or probe.spec is None:
        outcome = Outcome(model_type, "refused", model.router_refusal.replace(tmp, "DIR"))
    else:
        held = f"; routing bias {probe.bias} held as loaded" if probe.bias else ""
        outcome = Outcome(model_type, "exact", describe(probe.spec) + held, aux_rel=aux_loss_gap(model, tokens[0]))
    inputs, targets = tokens[0, :, :-1], tokens[0, :, 1:]
    one_grad = accumulated_gradient(model, inputs, targets, 1).double()
    many_grad = accumulated_gradient(model, inputs, targets, ROWS).double()
    outcome.grad_rel = float((many_grad - one_grad).norm() / one_grad.norm())
    start = flat(model)
    one, many = train(model, tokens, 1), train(model, tokens, ROWS)
    outcome.params_rel = float((many - one).norm() / one.norm())
    outcome.update_rel = float((many - one).norm() / (one - start).norm())
    return outcome


MEMORY_LIMIT = 6 << 30
"""Address space per model type: a family whose shrunk config is not small (a big vocabulary) gets an error row,
not the machine's memory."""


def measure_in_child(model_type: str) -> Outcome:
    """``measure`` in a process of its own under :data:`MEMORY_LIMIT`."""
    done = subprocess.run(
        [sys.executable, __file__, "--one", model_type], capture_output=True, text=True, env=dict(os.environ)
    )
    rows = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not rows:
        last = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return Outcome(model_type, "error", last[:200])
    return Outcome(**json.loads(rows[-1]))


def one(model_type: str) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    try:
        outcome = measure(model_type)
    except Exception as exc:  # noqa: BLE001 - a row per type, whatever transformers raises
        outcome = Outcome(model_type, "error", f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    print(json.dumps(asdict(outcome)), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_types", nargs="*", help="model types (default: every MoE the zoo finds)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child's: measure one type, print it as JSON
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.one:
        one(args.one)
        return
    types = args.model_types or moe_model_types()
    started = time.perf_counter()
    outcomes = []
    for model_type in types:
        outcome = measure_in_child(model_type)
        outcomes.append(outcome)
        print(outcome.row(), flush=True)
    exact = [o for o in outcomes if o.verdict == "exact"]
    worst = max((o.params_rel or 0.0 for o in exact), default=0.0)
    worst_grad = max((o.grad_rel or 0.0 for o in outcomes), default=0.0)
    print(
        f"\n{len(exact)} of {len(outcomes)} MoE model types train exactly with their balancing loss "
        f"({len(exact) / max(len(outcomes), 1):.0%}); worst K8-vs-K1 parameters rel L2 among them {worst:.1e} "
        f"(goal <= 1e-5); worst gradient rel L2 of every model trained {worst_grad:.1e}; "
        f"{sum(o.verdict == 'refused' for o in outcomes)} refused by the probe (they train with "
        f"--router-balance off), {sum(o.verdict == 'config' for o in outcomes)} by their config.json, "
        f"{sum(o.verdict == 'not built' for o in outcomes)} not built, {sum(o.verdict == 'error' for o in outcomes)} "
        f"errors; {time.perf_counter() - started:.0f} s"
    )


if __name__ == "__main__":
    main()
