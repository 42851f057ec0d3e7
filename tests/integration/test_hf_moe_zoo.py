"""Every mixture of experts the installed transformers ships, built tiny and random offline: trained exactly by
bigbatch or refused in one line, decided by what the model does (its router probe), never by its name.

Supported: at one micro-batch bigbatch's balancing loss is the model's own ``aux_loss``, and 4 micro-batches give
the gradient of one (cross-entropy and balancing loss over the whole step). Refused: one line naming the model
type, what differed and ``--router-balance off``, which trains it exactly with no balancing loss."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_moe_zoo import NOT_BUILT, accumulated_gradient, build_tiny, moe_model_types, wrap_tiny

from bigbatch.engine.accumulate import AccumulationEngine
from bigbatch.engine.batch import MicroBatch
from bigbatch.engine.optim import constant_schedule

pytest.importorskip("transformers")

TYPES = moe_model_types()


def test_the_zoo_holds_every_family_the_issue_names() -> None:
    assert len(TYPES) >= 40
    for model_type in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "deepseek_v3", "gpt_oss", "jamba"):
        assert model_type in TYPES, model_type


@pytest.mark.slow
@pytest.mark.parametrize("model_type", TYPES)
def test_each_transformers_mixture_of_experts_trains_exactly_or_is_refused_in_one_line(
    model_type: str, tmp_path: Path
) -> None:
    if model_type in NOT_BUILT:
        with pytest.raises(Exception):  # noqa: B017 - what fails is transformers' own; the zoo says why
            build_tiny(model_type)
        return
    model = wrap_tiny(model_type, tmp_path)
    if isinstance(model, str):  # config.json alone refuses it
        assert "\n" not in model and str(tmp_path) in model
        return
    probe = model.router_probe
    assert probe is not None, "a mixture of experts probed as dense"
    tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(2))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    if probe.spec is None:
        line = model.router_refusal
        assert "\n" not in line and f"model_type {model_type}" in line and "--router-balance off" in line, line
        assert model.router_recorder is None  # trained with no balancing loss, as --router-balance off asks
    else:
        with torch.no_grad():
            aux = float(model.hf_model.eval()(input_ids=inputs, output_router_logits=True, use_cache=False).aux_loss)
        model.hf_model.train()
        engine = AccumulationEngine(model, torch.optim.SGD(model.parameters(), lr=1e-9), constant_schedule(1e-9))
        record = engine.step([MicroBatch(inputs, targets)])
        assert record.measurements["router"].balance_loss == pytest.approx(aux, rel=1e-5)
    full = accumulated_gradient(model, inputs, targets, 1)
    accumulated = accumulated_gradient(model, inputs, targets, 4)
    assert ((accumulated - full).norm() / full.norm()).item() <= 1e-5
