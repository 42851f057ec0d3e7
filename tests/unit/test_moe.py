"""The mixture-of-experts family and the step-wide load-balancing loss (engine/router_balance.py): the accumulated
update equals the giant batch's, balancing loss included, at any K, with activation checkpointing and with
packed rows; running and micro differ; hf: MoE routers give transformers' own aux_loss; HF layouts in and out."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from bigbatch.engine.accumulate import AccumulationEngine
from bigbatch.engine.batch import IGNORE_INDEX, MicroBatch
from bigbatch.engine.language_model import LanguageModelObjective
from bigbatch.engine.optim import constant_schedule
from bigbatch.engine.router_balance import RouterBalance, expert_load
from bigbatch.errors import CheckpointError, ConfigError
from bigbatch.models.moe.config import MOE_PRESETS, MoEConfig, moe_preset
from bigbatch.models.moe.model import MoE
from bigbatch.models.routing import RouterSpec, router_recorder
from bigbatch.parallel.distributed import DistContext

VOCAB = 64


def pico(**overrides: object) -> MoE:
    torch.manual_seed(0)
    return MoE(moe_preset("moe-pico", vocab_size=VOCAB, **overrides))


def batch(samples: int = 8, seq_len: int = 16, ragged: bool = True, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (samples, seq_len + 1), generator=g)
    inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    if ragged:  # micro-batches hold different numbers of counted tokens
        lengths = torch.randint(1, seq_len + 1, (samples,), generator=g)
        targets[torch.arange(seq_len)[None, :] >= lengths[:, None]] = IGNORE_INDEX
    return inputs, targets


def reference_gradient(model: MoE, inputs: torch.Tensor, targets: torch.Tensor, coef: float) -> torch.Tensor:
    """The giant batch's gradient, written out: the mean token loss plus ``coef`` x the balancing loss of every
    counted token of the batch (per layer ``E * sum_e f_e P_e``, ``f`` the share of the k x N assignments,
    averaged over the layers), from one forward."""
    model = copy.deepcopy(model)
    recorder = router_recorder(model)
    assert recorder is not None
    with recorder.recording() as layers:
        loss_sum = model(inputs, targets=targets)
    counted = (targets != IGNORE_INDEX).reshape(-1)
    n_expert, top_k = model.config.n_expert, model.config.top_k
    losses = []
    for routed in layers:
        probs, experts = routed.probs[counted], routed.experts[counted]
        share = torch.bincount(experts.reshape(-1), minlength=n_expert).float() / experts.numel()
        losses.append(n_expert * (share * probs.mean(0)).sum())
    objective = loss_sum / counted.sum() + coef * torch.stack(losses).mean()
    objective.backward()
    assert top_k == experts.shape[1]
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def accumulated_gradient(
    model: MoE, inputs: torch.Tensor, targets: torch.Tensor, k: int, mode: str = "exact", **kwargs: object
) -> tuple[torch.Tensor, AccumulationEngine]:
    model = copy.deepcopy(model)
    engine = AccumulationEngine(
        model,
        torch.optim.SGD(model.parameters(), lr=1.0),
        constant_schedule(1.0),
        grad_clip=0.0,
        objective=LanguageModelObjective(router_balance=mode),
    )
    parts = [MicroBatch(x, y) for x, y in zip(inputs.tensor_split(k), targets.tensor_split(k), strict=True)]
    for param in model.parameters():
        param.grad = None
    engine.accumulate(parts, **kwargs)  # type: ignore[arg-type]
    return torch.cat([p.grad.flatten() for p in model.parameters()]), engine


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_exact_accumulation_is_the_giant_batch_with_its_balancing_loss(k: int) -> None:
    model = pico(router_aux_coef=0.5)
    inputs, targets = batch()
    want = reference_gradient(model, inputs, targets, coef=0.5)
    got, _ = accumulated_gradient(model, inputs, targets, k)
    assert rel(got, want) < 1e-5


def test_exact_holds_with_activation_checkpointing_shared_expert_and_qk_norm() -> None:
    model = pico(router_aux_coef=0.5, shared_ffn_hidden=16, qk_norm=True, norm_topk_prob=False)
    model.activation_checkpointing = True
    inputs, targets = batch()
    want = reference_gradient(model, inputs, targets, coef=0.5)
    got, _ = accumulated_gradient(model, inputs, targets, 4)
    assert rel(got, want) < 1e-5


@pytest.mark.parametrize("mode", ["running", "micro"])
def test_running_and_micro_match_at_one_micro_batch_and_differ_over_several(mode: str) -> None:
    model = pico(router_aux_coef=0.5)
    inputs, targets = batch()
    want = reference_gradient(model, inputs, targets, coef=0.5)
    one, _ = accumulated_gradient(model, inputs, targets, 1, mode)
    four, _ = accumulated_gradient(model, inputs, targets, 4, mode)
    assert rel(one, want) < 1e-5
    assert rel(four, want) > 1e-3  # the coupling the exact mode removes, well above fp32 rounding


def test_off_trains_the_cross_entropy_alone_and_the_z_loss_is_exact() -> None:
    model = pico(router_aux_coef=0.5)
    inputs, targets = batch()
    without, _ = accumulated_gradient(model, inputs, targets, 4, "off")
    assert rel(without, reference_gradient(model, inputs, targets, coef=0.0)) < 1e-5
    z_model = pico(router_aux_coef=0.0, router_z_coef=0.1)
    full, _ = accumulated_gradient(z_model, inputs, targets, 1)
    split, _ = accumulated_gradient(z_model, inputs, targets, 4, "micro")  # the z-loss is a per-token mean
    assert rel(split, full) < 1e-5 and rel(full, reference_gradient(z_model, inputs, targets, coef=0.0)) > 1e-4


def test_the_routing_pass_replays_dropout_so_its_counts_are_the_training_pass_counts() -> None:
    model = pico(dropout=0.2)
    inputs, targets = batch()
    parts = [MicroBatch(x, y) for x, y in zip(inputs.tensor_split(4), targets.tensor_split(4), strict=True)]
    losses = {}
    for mode in ("exact", "off"):  # off: no routing pass at all
        replica = copy.deepcopy(model)
        engine = AccumulationEngine(
            replica,
            torch.optim.SGD(replica.parameters(), lr=0.1),
            constant_schedule(0.1),
            objective=LanguageModelObjective(router_balance=mode),
        )
        torch.manual_seed(5)
        record = engine.step(parts)
        losses[mode] = record.loss
        if mode == "exact":
            assert record.measurements["router"].replay_mismatch == 0.0
    # the training pass drew the masks it draws without a routing pass before it: the same loss, to the bit
    assert losses["exact"] == losses["off"]


def test_packed_rows_give_the_gradient_of_the_same_documents_one_per_row() -> None:
    """Only tokens with a valid target are balanced: padding is routed but not counted, so the packed row and the
    padded rows give the same balancing loss."""
    model = pico(router_aux_coef=0.5)
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(0, VOCAB, (7,), generator=g), torch.randint(0, VOCAB, (9,), generator=g)
    packed_inputs = torch.cat([a[:-1], b[:-1]]).unsqueeze(0)  # (1, 14)
    packed_targets = torch.cat([a[1:], b[1:]]).unsqueeze(0)
    positions = torch.cat([torch.arange(6), torch.arange(8)]).unsqueeze(0)
    rows_inputs = torch.zeros(2, 8, dtype=torch.long)
    rows_targets = torch.full((2, 8), IGNORE_INDEX)
    rows_inputs[0, :6], rows_targets[0, :6] = a[:-1], a[1:]
    rows_inputs[1, :8], rows_targets[1, :8] = b[:-1], b[1:]

    def gradient(micro_batch: MicroBatch) -> torch.Tensor:
        replica = copy.deepcopy(model)
        engine = AccumulationEngine(replica, torch.optim.SGD(replica.parameters(), lr=1.0), constant_schedule(1.0))
        engine.accumulate([micro_batch])
        return torch.cat([p.grad.flatten() for p in replica.parameters()])

    packed = gradient(MicroBatch(packed_inputs, packed_targets, positions))
    assert rel(packed, gradient(MicroBatch(rows_inputs, rows_targets))) < 1e-5


def test_the_balance_weights_reproduce_both_definitions() -> None:
    counts = torch.tensor([[3.0, 1.0, 0.0, 4.0], [2.0, 2.0, 2.0, 2.0]])  # (layers, E): 4 tokens, k = 2
    sums = torch.tensor([[1.5, 0.5, 0.2, 1.8], [1.0, 1.0, 1.0, 1.0]])
    layer = RouterSpec(n_expert=4, top_k=2, n_moe_layer=2, pooling="layer", per_assignment=True, aux_coef=0.01)
    per_layer = [4 * ((c / 8) * (s / 4)).sum() for c, s in zip(counts, sums, strict=True)]
    assert float((layer.balance_weights(counts, 4) * sums).sum()) == pytest.approx(float(sum(per_layer) / 2))
    pooled = RouterSpec(n_expert=4, top_k=2, n_moe_layer=2, pooling="pooled", per_assignment=False, aux_coef=0.01)
    f, p = counts.sum(0) / 8, sums.sum(0) / 8  # transformers: every layer's rows together, f summing to k
    assert float((pooled.balance_weights(counts, 4) * sums).sum()) == pytest.approx(float(4 * (f * p).sum()))


def test_expert_load_is_max_over_mean_and_coefficient_of_variation() -> None:
    peak, cv = expert_load(torch.tensor([[2.0, 2.0, 2.0, 2.0], [4.0, 0.0, 2.0, 2.0]]))
    assert peak == (1.0, 2.0)
    assert cv[0] == 0.0 and cv[1] == pytest.approx((2.0**0.5) / 2)


def test_a_step_records_the_router_loss_and_load_beside_the_cross_entropy() -> None:
    model = pico()
    inputs, targets = batch(ragged=False)
    with torch.no_grad():
        cross_entropy = float(model(inputs, targets=targets)) / targets.numel()
    engine = AccumulationEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), constant_schedule(0.1))
    record = engine.step(
        [MicroBatch(x, y) for x, y in zip(inputs.tensor_split(2), targets.tensor_split(2), strict=True)]
    )
    router = record.measurements["router"]
    values = router.as_dict()
    assert values["router_loss"] == pytest.approx(0.01 * router.balance_loss)
    assert 0.9 < router.balance_loss < 2.0  # about 1 for a fresh router (1 is perfect balance)
    assert set(values) >= {"expert_load_cv", "expert_load_max_over_mean", "expert_load_cv/0", "expert_load_cv/1"}
    assert record.loss == pytest.approx(cross_entropy, rel=1e-6)  # the logged loss is the cross-entropy alone


def test_router_balance_refuses_an_unknown_mode() -> None:
    recorder = router_recorder(pico())
    assert recorder is not None
    with pytest.raises(ValueError, match="exact, running, micro, off"):
        RouterBalance(recorder, "global", DistContext(), torch.device("cpu"))


def test_flops_count_the_active_parameters_only() -> None:
    config = MOE_PRESETS["mixtral-8x7b"]
    with torch.device("meta"):  # the count needs no memory: no 46.7B-parameter model is materialised
        mixtral = MoE(config)
    total = mixtral.num_params(non_embedding=True)
    active = total - mixtral.inactive_parameters()
    assert 46.0e9 < mixtral.num_params(non_embedding=False) < 47.5e9  # Mixtral 8x7B: 46.7B
    assert 12.5e9 < active + mixtral.model.embed_tokens.weight.numel() < 13.2e9  # 12.9B active per token
    assert mixtral.flops_per_token(1) == 6 * active + 12 * config.n_layer * config.n_head * config.head_dim


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"n_expert": 1}, "n_expert must be at least 2"),
        ({"top_k": 5}, "top_k must be between 1 and n_expert=4"),
        ({"shared_ffn_hidden": -1}, "shared_ffn_hidden"),
        ({"n_kv_head": 3}, "not divisible by n_kv_head"),
    ],
)
def test_a_bad_shape_is_one_line(overrides: dict[str, int], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        replace(MOE_PRESETS["moe-pico"], **overrides)


# ---- Hugging Face layouts ------------------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize(
    ("overrides", "layout"),
    [
        ({}, "MixtralForCausalLM"),
        ({"qk_norm": True, "norm_topk_prob": False}, "Qwen3MoeForCausalLM"),
        ({"shared_ffn_hidden": 24, "tie_embeddings": False}, "Qwen2MoeForCausalLM"),
    ],
)
def test_export_loads_in_transformers_with_equal_logits_and_reads_back(
    overrides: dict[str, object], layout: str, tmp_path: Path
) -> None:
    from bigbatch.models.moe.hf import load_hf_moe, save_hf_moe

    model = pico(**overrides).eval()
    save_hf_moe(model, tmp_path / "out")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), local_files_only=True).eval()
    assert type(theirs).__name__ == layout
    inputs, _ = batch(2, 20, ragged=False)
    with torch.no_grad():
        ours = model(inputs)
        torch.testing.assert_close(theirs(input_ids=inputs).logits, ours, rtol=1e-5, atol=1e-5)
        if layout != "Qwen2MoeForCausalLM":  # read back: bigbatch's own file and transformers' re-save
            theirs.save_pretrained(str(tmp_path / "resaved"))
            for directory in (tmp_path / "out", tmp_path / "resaved"):
                torch.testing.assert_close(load_hf_moe(directory).eval()(inputs), ours, rtol=1e-5, atol=1e-5)


def test_a_shape_without_a_transformers_layout_is_refused_in_one_line() -> None:
    from bigbatch.models.moe.hf import hf_layout

    with pytest.raises(ConfigError, match="both a shared expert and query/key norms"):
        hf_layout(replace(MOE_PRESETS["moe-pico"], shared_ffn_hidden=8, qk_norm=True))
    with pytest.raises(ConfigError, match="neither norm_topk_prob nor qk_norm"):
        hf_layout(replace(MOE_PRESETS["moe-pico"], norm_topk_prob=False))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"capacity_factor": 1.25}, "sets capacity_factor = 1.25: a capacity drops the tokens"),
        ({"router_jitter_noise": 0.1}, "router jitter noise"),
        ({"sliding_window": 16}, "sliding-window attention"),
    ],
)
def test_a_mixtral_variant_bigbatch_does_not_compute_is_refused(extra: dict[str, object], message: str) -> None:
    from bigbatch.models.moe.hf import moe_config_from_hf

    config = {
        "model_type": "mixtral",
        "hidden_size": 32,
        "intermediate_size": 16,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "vocab_size": VOCAB,
        "max_position_embeddings": 64,
        **extra,
    }
    with pytest.raises((CheckpointError, ConfigError), match=message):
        moe_config_from_hf(config)
    assert isinstance(moe_config_from_hf({k: v for k, v in config.items() if k not in extra}), MoEConfig)


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_an_hf_mixture_of_experts_balances_the_step_as_transformers_defines_it(kind: str, tmp_path: Path) -> None:
    """One micro-batch: bigbatch's balancing loss is the aux_loss transformers returns for it (every MoE layer
    pooled); K micro-batches, with and without activation checkpointing, reproduce its gradient."""
    from hf_models import save_hf

    from bigbatch.models.hf.model import build_hf_model, read_hf_config

    theirs = save_hf(kind, tmp_path / kind).train()
    model = build_hf_model(read_hf_config(tmp_path / kind), weights=True)
    assert router_recorder(model) is not None and model.head_detachable
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 256, (4, 17), generator=g)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    with torch.no_grad():
        aux = float(theirs(input_ids=inputs, output_router_logits=True).aux_loss)
    engine = AccumulationEngine(model, torch.optim.SGD(model.parameters(), lr=1e-9), constant_schedule(1e-9))
    record = engine.step([MicroBatch(inputs, targets)])
    assert record.measurements["router"].balance_loss == pytest.approx(aux, rel=1e-5)

    def gradient(k: int, checkpointing: bool) -> torch.Tensor:
        replica = copy.deepcopy(model)
        replica.activation_checkpointing = checkpointing
        engine = AccumulationEngine(replica, torch.optim.SGD(replica.parameters(), lr=1.0), constant_schedule(1.0))
        engine.accumulate(
            [MicroBatch(x, y) for x, y in zip(inputs.tensor_split(k), targets.tensor_split(k), strict=True)]
        )
        return torch.cat([p.grad.flatten() for p in replica.parameters() if p.grad is not None])

    full = gradient(1, False)
    assert rel(gradient(4, False), full) < 1e-5
    assert rel(gradient(2, True), full) < 1e-5


@pytest.mark.parametrize("mode", ["exact", "running", "micro"])
def test_a_micro_batch_without_valid_targets_adds_nothing_and_breaks_nothing(mode: str) -> None:
    model = pico(router_aux_coef=0.5)
    inputs, targets = batch(ragged=False)
    targets[:2] = IGNORE_INDEX  # the first micro-batch of four holds no valid target
    got, _ = accumulated_gradient(model, inputs, targets, 4, mode)
    assert torch.isfinite(got).all()
    if mode == "exact":
        assert rel(got, reference_gradient(model, inputs, targets, coef=0.5)) < 1e-5
