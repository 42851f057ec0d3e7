"""The noise scale's small gradient read before the cross-rank reduction (DDP hook, FSDP2 reduce-scatter, FSDP2's
unsharded gradients): it is each rank's own first micro-batch gradient in true units, and the trajectory is bitwise
the same with the measurement on (every step) or off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from launch import SUPPORT, torchrun

pytestmark = pytest.mark.slow


def check(results: dict, spec: str, rel: float = 1e-5) -> None:
    """``rel``: how close the first small norm is to the fp32 reference (bf16 parameters compute another one)."""
    got = results[spec]
    on, off, reference = got["on"], got["off"], got["reference"]
    for name, value in off["state"].items():
        assert torch.equal(on["state"][name], value), f"{spec}: {name} differs with the noise scale measured"
    assert on["losses"] == off["losses"] and on["norms"] == off["norms"], spec
    assert all(sample is not None for sample in on["noise"]), spec  # every step measured
    first = on["noise"][0]
    assert first["noise_small_sq"] == pytest.approx(reference["small_sq"], rel=rel), spec
    assert first["noise_b_small"] == pytest.approx(reference["b_small"], rel=1e-12), spec
    assert first["noise_big_sq"] == pytest.approx(on["norms"][0] ** 2, rel=1e-12), spec


WORLD_2 = ["ddp:1", "ddp:2", "ddp:2:every", "fsdp:1", "fsdp:2", "fsdp:2:every", "fsdp-bf16:1", "fsdp-bf16:2"]


def test_two_ranks_ddp_and_fsdp_read_the_local_gradient_and_keep_the_trajectory(tmp_path: Path) -> None:
    out = tmp_path / "probe.pt"
    torchrun(str(SUPPORT / "noise_dist_worker.py"), str(out), *WORLD_2)
    results = torch.load(out, weights_only=True)
    for spec in WORLD_2:
        assert results[spec]["world"] == 2
        check(results, spec, rel=0.02 if "bf16" in spec else 1e-5)


def test_three_ranks_ddp_hook_averages_bitwise_like_ddp_itself(tmp_path: Path) -> None:
    """With 3 ranks ``x / 3`` and ``x * (1 / 3)`` round differently: the hook must scale as DDP's built-in
    reduction does (``default_hooks.allreduce_hook``'s ``div_`` changes the parameters in the 5th digit)."""
    out = tmp_path / "probe.pt"
    torchrun(str(SUPPORT / "noise_dist_worker.py"), str(out), "ddp:1", "ddp:2:every", nproc=3)
    results = torch.load(out, weights_only=True)
    for spec in ("ddp:1", "ddp:2:every"):
        assert results[spec]["world"] == 3
        check(results, spec)
