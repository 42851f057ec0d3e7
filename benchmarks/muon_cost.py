"""What Newton-Schulz costs per optimizer step at GPT-2 124M's shapes, on CPU, beside a micro-step of the model.

    python benchmarks/muon_cost.py            # 3 repeats each, about 35 CPU-seconds (2 min wall, shared)
    python benchmarks/muon_cost.py --quick    # 1 repeat, T=64: a smoke check (about 25 s)

``--optimizer muon`` orthogonalises each hidden matrix once per optimizer step (not per micro-batch). GPT-2 124M
has 72 of them: per layer q, k and v of c_attn (768x768 each: the fused weight is orthogonalised part by part),
attn c_proj 768x768, mlp c_fc 768x3072, mlp c_proj 3072x768 (85M of its 124M parameters). This times
``bigbatch.engine.muon.orthogonalise`` on one layer's 6 (fp32, random matrices: the cost does not depend on the
values) and counts it 12 times (the layers' shapes are the same), 5 iterations of
the quintic and of polar-express, against one forward and
backward of the whole model (``bigbatch.models.GPT``, preset gpt2, fp32, chunked loss) at B=1, T=256 and the
AdamW step over its parameters. The share of Newton-Schulz in a step of K micro-batches is

    NS / (K x micro-step + optimizer + NS)

printed for K = 1, 8, 32 (an accumulated step pays it once: the share falls as 1/K). Times are this process's
CPU seconds (one thread: about the wall-clock time of an unloaded core; the machine is shared, and other
processes' time is left out), medians over the repeats, each row with its min and max. The FLOPs of Newton-Schulz
(4 m^2 n + 2 m^3 per iteration on the wide orientation m <= n) are printed beside the model's 6 N T.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch

from bigbatch.engine.newton_schulz import orthogonalise
from bigbatch.models import GPT
from bigbatch.models.gpt.config import preset

SHAPES = [(768, 768)] * 3 + [(768, 768), (3072, 768), (768, 3072)]  # q, k, v, c_proj, c_fc, mlp c_proj (out, in)
LAYERS = 12


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    """CPU seconds of this process per call (steadier than the wall clock on a shared machine: other processes'
    time is not counted), after one untimed warm-up call."""
    fn()
    out = []
    for _ in range(repeats):
        started = time.process_time()
        fn()
        out.append(time.process_time() - started)
    return out


def ns_flops(shape: Sequence[int], steps: int) -> float:
    m, n = sorted(shape)
    return steps * (4 * m * m * n + 2 * m**3)


def show(seconds: list[float]) -> str:
    return f"{statistics.median(seconds):7.3f} s (min {min(seconds):.3f}, max {max(seconds):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 repeat, T=64")
    parser.add_argument("--repeats", type=int, help="timed repeats of each (default 3; --quick 1)")
    parser.add_argument("--seq-len", type=int, help="T of the micro-step (default 256; --quick 64)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    torch.set_num_threads(args.threads)
    repeats = args.repeats or (1 if args.quick else 3)
    T = args.seq_len or (64 if args.quick else 256)
    started = time.perf_counter()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), OMP_NUM_THREADS="
        f"{os.environ.get('OMP_NUM_THREADS', 'unset')}; {repeats} timed repeat(s) after one warm-up; shared machine: noisy"
    )
    gen = torch.Generator().manual_seed(0)
    matrices = [torch.randn(shape, generator=gen) * 1e-3 for shape in SHAPES]  # one layer's; x LAYERS below
    muon_params = LAYERS * sum(m.numel() for m in matrices)
    ns_total = {name: LAYERS * sum(ns_flops(m.shape, 5) for m in matrices) for name in ("quintic", "polar-express")}

    torch.manual_seed(0)
    model = GPT(preset("gpt2"))
    n_params = sum(p.numel() for p in model.parameters())
    idx = torch.randint(0, 50257, (1, T + 1), generator=gen)
    x, y = idx[:, :-1], idx[:, 1:]

    def micro_step() -> None:
        loss = model(x, y)
        loss.backward()

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def adamw_step() -> None:
        optimizer.step()

    def one_layer(coefficients: str) -> Callable[[], object]:
        return lambda: [orthogonalise(m, 5, coefficients) for m in matrices]

    ns = {name: [LAYERS * t for t in timed(one_layer(name), repeats)] for name in ("quintic", "polar-express")}
    micro = timed(micro_step, repeats)
    opt = timed(adamw_step, repeats)
    model_flops = 6 * n_params * T  # forward + backward, attention left out
    print(
        f"GPT-2 124M ({n_params / 1e6:.1f}M parameters; {LAYERS * len(matrices)} Muon matrices, {muon_params / 1e6:.1f}M), "
        f"fp32; CPU seconds (Newton-Schulz: one layer's {len(matrices)} matrices timed, x 12)"
    )
    print(f"  {'what':<46} {'time per call':>38} {'GFLOP':>7} {'GFLOP/s':>8}")
    for name, seconds in ns.items():
        gf = ns_total[name] / 1e9
        print(
            f"  {f'Newton-Schulz, {name}, 5 iterations, 72 matrices':<46} {show(seconds):>38} {gf:>7.1f} "
            f"{gf / statistics.median(seconds):>8.1f}"
        )
    gf = model_flops / 1e9
    print(
        f"  {f'forward + backward, B=1 T={T}':<46} {show(micro):>38} {gf:>7.1f} {gf / statistics.median(micro):>8.1f}"
    )
    print(f"  {'AdamW step (fused), all parameters':<46} {show(opt):>38}")
    m_t, o_t = statistics.median(micro), statistics.median(opt)
    print(f"  share of Newton-Schulz in an optimizer step of K micro-steps of B=1 T={T} (NS / (K micro + AdamW + NS)):")
    print(f"  {'K':>4} {'tokens':>7} {'quintic':>8} {'polar-express':>14}")
    shares = {}
    for k in (1, 8, 32):
        cells = []
        for name, seconds in ns.items():
            s = statistics.median(seconds)
            share = s / (k * m_t + o_t + s)
            shares[(k, name)] = share
            cells.append(share)
        print(f"  {k:>4} {k * T:>7,} {cells[0]:>8.1%} {cells[1]:>14.1%}")
    print(
        f"summary: Newton-Schulz for all 72 matrices {statistics.median(ns['quintic']):.3f} s (quintic), "
        f"{statistics.median(ns['polar-express']):.3f} s (polar-express) = "
        f"{statistics.median(ns['quintic']) / m_t:.2f}x and {statistics.median(ns['polar-express']) / m_t:.2f}x one "
        f"micro-step of B=1 T={T}; share of a K=1 step {shares[(1, 'quintic')]:.1%} / {shares[(1, 'polar-express')]:.1%}, "
        f"K=8 {shares[(8, 'quintic')]:.1%} / {shares[(8, 'polar-express')]:.1%}"
    )
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
