"""The probes that read the noise scale's small gradient (one process here; DDP and FSDP2 in
tests/integration/test_noise_scale_probe.py)."""

from __future__ import annotations

import noise_problem as problem
import pytest
import torch

from bigbatch.engine.accumulate import AccumulationEngine
from bigbatch.noise.meter import noise_meter_hooks
from bigbatch.noise.probe import GradReadProbe, PreReduceMeter, small_grad_probe
from bigbatch.noise.scale import NoiseScale


def test_the_meter_adds_only_while_armed_and_disarms_on_take() -> None:
    meter = PreReduceMeter()
    meter.add(torch.tensor([3.0, 4.0]))  # not armed: an unmeasured step costs nothing
    assert float(meter.take()) == 0.0
    meter.arm()
    meter.add(torch.tensor([3.0, 4.0]))
    meter.add(torch.tensor([1.0]), scale=2.0)  # a pre-divided input, scaled back
    got = meter.take()
    assert got.dtype == torch.float64 and float(got) == pytest.approx(25.0 + 4.0)
    meter.add(torch.tensor([5.0]))
    assert not meter.armed and float(meter.take()) == 0.0


def test_one_process_reads_grad_and_needs_two_micro_batches() -> None:
    model = problem.make_model()
    probe = small_grad_probe(model, "none", sync_every_micro_step=False, first_reduced_possible=True)
    assert isinstance(probe, GradReadProbe)
    assert not probe.can_measure(1) and probe.can_measure(2)


class CountingProbe(GradReadProbe):
    """Records what the engine asks of it."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.calls: list[tuple[str, int]] = []

    def arm(self, k: int) -> None:
        self.calls.append(("arm", k))

    def take(self) -> torch.Tensor:
        self.calls.append(("take", 0))
        return super().take()


def test_the_engine_arms_the_probe_only_on_measured_steps_and_takes_after_the_first_backward() -> None:
    model = problem.make_model()
    probe = CountingProbe(model)
    noise = NoiseScale(every=2)
    engine = AccumulationEngine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        lambda step: 0.0,
        grad_clip=0.0,
        loss_fn=problem.loss_sum,
        count_fn=problem.count,
        hooks=noise_meter_hooks(noise, model, probe),
    )
    generator = torch.Generator().manual_seed(0)
    records = [engine.step([problem.draw(8, generator) for _ in range(3)]) for _ in range(4)]
    assert [r.noise is not None for r in records] == [True, True, False, True]  # steps 1, 2 and 4
    assert probe.calls == [("arm", 3), ("take", 0)] * 3
    k_1 = [engine.step([problem.draw(8, generator)]) for _ in range(2)]  # step 6 is due, but K = 1 in one process
    assert noise.due(k_1[-1].step)
    assert all(r.noise is None for r in k_1)
    assert len(probe.calls) == 6
