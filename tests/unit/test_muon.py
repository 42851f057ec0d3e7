"""Muon (bigbatch.engine.muon): Newton-Schulz against an SVD reference, the update's scale, which parameters each
family gives Muon, the AdamW half against torch's AdamW, exactness under accumulation (K micro-batches give the
update of one, with one orthogonalisation per matrix per optimizer step and none during accumulation), the
momentum, the batch-change follower, the per-group learning rate and the optimizer state a checkpoint sees."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from tiny import VOCAB, random_batch

import bigbatch.engine.muon as muon_module
from bigbatch.engine.accumulate import AccumulationEngine
from bigbatch.engine.batch import IGNORE_INDEX, MicroBatch
from bigbatch.engine.batch_change import BatchChange, BatchChangeRule, BatchFollower, OptimSettings
from bigbatch.engine.muon import MuonAdamW, MuonSettings, build_muon
from bigbatch.engine.muon_matrices import muon_matrices, muon_parameters
from bigbatch.engine.newton_schulz import (
    CONVERGENT,
    NORM_EPS,
    POLAR_EXPRESS,
    QUINTIC,
    iteration_coefficients,
    orthogonalise,
    update_scale,
)
from bigbatch.engine.optim import CosineSchedule, constant_schedule
from bigbatch.errors import ConfigError
from bigbatch.models import GPT, GPTConfig, build_model, model_preset
from bigbatch.models.hf.fused_weights import hf_matrix_layout
from bigbatch.models.matrix_layout import MatrixLayout
from bigbatch.models.moe.config import moe_preset
from bigbatch.models.moe.model import MoE

F64 = torch.float64


def tiny_gpt(dtype: torch.dtype = torch.float32, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=VOCAB)).to(dtype)


# ---- Newton-Schulz against the SVD ---------------------------------------------------------------------------


def with_spectrum(m: int, n: int, singular: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A float64 (m, n) matrix ``U diag(singular) V^T`` with random orthonormal ``U`` (m, k) and ``V`` (n, k),
    k = min(m, n); returns it, U and V."""
    k = min(m, n)
    gen = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(m, k, generator=gen, dtype=F64)).Q
    v = torch.linalg.qr(torch.randn(n, k, generator=gen, dtype=F64)).Q
    return u @ torch.diag(singular) @ v.T, u, v


def scalar_map(x: torch.Tensor, coefficients: str, steps: int) -> torch.Tensor:
    """What the iteration does to each singular value ``x`` (already normalised) on its own."""
    for a, b, c in iteration_coefficients(coefficients, steps):
        x = a * x + b * x**3 + c * x**5
    return x


SHAPES = [(24, 64), (64, 24), (48, 48), (8, 128)]  # wide, tall, square, very wide


def spectrum(k: int, smallest: float, kind: str) -> torch.Tensor:
    """Singular values from 3.7 (any scale: the input is normalised) down to ``smallest`` x 3.7: ``spread``
    log-spaced, ``clustered`` (ill-conditioned the hard way) a quarter at the top, the rest log-spaced near the
    bottom."""
    if kind == "spread":
        return 3.7 * torch.logspace(0, math.log10(smallest), k, dtype=F64)
    top = max(1, k // 4)
    return 3.7 * torch.cat([torch.ones(top, dtype=F64), torch.logspace(-1, math.log10(smallest), k - top, dtype=F64)])


@pytest.mark.parametrize(("m", "n"), SHAPES)
@pytest.mark.parametrize("kind", ["spread", "clustered"])
@pytest.mark.parametrize(("coefficients", "smallest"), [("quintic", 1e-2), ("polar-express", 1e-3)])
def test_newton_schulz_keeps_the_singular_vectors_and_maps_each_singular_value(
    m: int, n: int, kind: str, coefficients: str, smallest: float
) -> None:
    """Five iterations act on each singular value alone: ``U^T O V`` is diagonal (the singular vectors are kept,
    nothing leaks outside their span) and its diagonal is the scalar polynomial of ``sigma / ||A||_F`` (the
    iteration's normalisation), which keeps every singular value of the result in the coefficients' band."""
    singular = spectrum(min(m, n), smallest, kind)
    a, u, v = with_spectrum(m, n, singular, seed=m * 1000 + n)
    o = orthogonalise(a, 5, coefficients)
    assert o.dtype == F64 and o.shape == (m, n)
    d = u.T @ o @ v
    diagonal = torch.diagonal(d)
    assert (d - torch.diag(diagonal)).abs().max().item() < 1e-10  # U^T O V diagonal: same singular vectors
    assert (o - u @ torch.diag(diagonal) @ v.T).abs().max().item() < 1e-10  # and no part outside their span
    normalised = singular / (torch.linalg.matrix_norm(a) + NORM_EPS)
    torch.testing.assert_close(diagonal, scalar_map(normalised, coefficients, 5), rtol=1e-9, atol=1e-12)
    # The bands: quintic for sigma >= 1e-2 sigma_max; polar-express for sigma >= 1e-3 ||A||_F (the range its
    # coefficients were fitted to, after the Frobenius normalisation; see the scalar test below).
    if coefficients == "quintic":
        assert 0.6 <= diagonal.min().item() and diagonal.max().item() <= 1.25, diagonal
    else:
        fitted = normalised >= 1e-3
        assert fitted.any()
        assert 0.84 <= diagonal[fitted].min().item() and diagonal[fitted].max().item() <= 1.16, diagonal
        # below the fitted range: smaller, never wrong-signed
        assert 0 < diagonal.min().item() and diagonal.max().item() <= 1.16


def test_the_coefficients_bands_on_every_normalised_singular_value() -> None:
    """The scalar maps on a dense grid: quintic x5 keeps x in [2e-3, 1] within about [0.68, 1.21], polar-express x5
    keeps x in [1e-3, 1] within about [0.86, 1.14]. ``x`` is sigma / ||A||_F, so for a spectrum of many comparable
    values the quintic's guarantee starts near 1e-2 sigma_max (||A||_F <= 5 sigma_max) and polar-express's covers
    sigma >= 1e-3 ||A||_F, not every sigma >= 1e-3 sigma_max (a square 48 x 48 matrix with singular values
    log-spaced over 1..1e-3 of the largest has its smallest at 0.48 after five)."""
    quintic = scalar_map(torch.logspace(math.log10(2e-3), 0, 20001, dtype=F64), "quintic", 5)
    assert 0.6 <= quintic.min().item() and quintic.max().item() <= 1.25
    polar = scalar_map(torch.logspace(-3, 0, 20001, dtype=F64), "polar-express", 5)
    assert 0.84 <= polar.min().item() and polar.max().item() <= 1.16
    a, _, _ = with_spectrum(48, 48, 3.7 * torch.logspace(0, -3, 48, dtype=F64), seed=1)
    low = torch.linalg.svdvals(orthogonalise(a, 5, "polar-express")).min().item()
    assert 0.3 < low < 0.84  # the documented shortfall below the fitted range (what the option's help promises)


@pytest.mark.parametrize(("m", "n"), SHAPES)
@pytest.mark.parametrize("kind", ["spread", "clustered"])
def test_polar_express_with_ten_iterations_is_the_polar_factor(m: int, n: int, kind: str) -> None:
    """After its five, polar-express runs the convergent (15/8, -10/8, 3/8) step: ten iterations give ``U V^T``."""
    a, u, v = with_spectrum(m, n, spectrum(min(m, n), 1e-3, kind), seed=7 * m + n)
    assert (orthogonalise(a, 10, "polar-express") - u @ v.T).abs().max().item() < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize(("m", "n"), [(12, 20), (20, 12)])
def test_a_stack_is_orthogonalised_slice_by_slice(dtype: torch.dtype, m: int, n: int) -> None:
    """An expert stack (E, m, n) is E matrices: each slice's own normalisation and iteration."""
    gen = torch.Generator().manual_seed(3)
    stack = torch.randn(4, m, n, generator=gen, dtype=dtype)
    stack[2] *= 100.0  # slices of very different sizes: each is normalised by its own norm
    together = orthogonalise(stack, 5, "quintic")
    one_by_one = torch.stack([orthogonalise(s, 5, "quintic") for s in stack])
    tolerance = 1e-12 if dtype == F64 else 1e-5
    torch.testing.assert_close(together, one_by_one, rtol=tolerance, atol=tolerance)


def test_a_zero_matrix_gives_zeros_and_a_zero_slice_stays_zero() -> None:
    for coefficients in ("quintic", "polar-express"):
        zero = orthogonalise(torch.zeros(8, 16), 5, coefficients)
        assert torch.equal(zero, torch.zeros(8, 16))
        stack = torch.randn(3, 8, 16, generator=torch.Generator().manual_seed(0))
        stack[1] = 0
        out = orthogonalise(stack, 5, coefficients)
        assert torch.isfinite(out).all() and torch.equal(out[1], torch.zeros(8, 16))


def test_bf16_input_returns_bf16_computed_in_fp32() -> None:
    x = torch.randn(16, 40, generator=torch.Generator().manual_seed(0)).bfloat16()
    out = orthogonalise(x, 5, "quintic")
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    torch.testing.assert_close(out.float(), orthogonalise(x.float(), 5, "quintic"), rtol=0, atol=1e-2)


# ---- coefficients and scale ----------------------------------------------------------------------------------


def test_update_scale_values() -> None:
    assert update_scale((96, 32), "rms") == pytest.approx(0.2 * math.sqrt(96), rel=1e-15)
    assert update_scale((32, 96), "rms") == pytest.approx(0.2 * math.sqrt(96), rel=1e-15)
    assert update_scale((48, 48), "rms") == pytest.approx(0.2 * math.sqrt(48), rel=1e-15)
    assert update_scale((4, 64, 32), "rms") == pytest.approx(0.2 * 8.0, rel=1e-15)  # a stack: each (64, 32) matrix
    assert update_scale((96, 32), "spectral") == pytest.approx(math.sqrt(3.0), rel=1e-15)
    assert update_scale((32, 96), "spectral") == 1.0  # wide: max(1, m/n)
    assert update_scale((4, 64, 32), "spectral") == pytest.approx(math.sqrt(2.0), rel=1e-15)
    with pytest.raises(ValueError, match="unknown Muon update scale 'frobenius'"):
        update_scale((4, 4), "frobenius")


def test_iteration_coefficients() -> None:
    assert iteration_coefficients("quintic", 3) == [QUINTIC] * 3
    assert iteration_coefficients("polar-express", 3) == list(POLAR_EXPRESS[:3])
    assert iteration_coefficients("polar-express", 7) == [*POLAR_EXPRESS, CONVERGENT, CONVERGENT]
    for steps in (0, -1):
        with pytest.raises(ValueError, match="at least one iteration"):
            iteration_coefficients("quintic", steps)
    with pytest.raises(ValueError, match="unknown Newton-Schulz coefficients 'cubic'.*quintic, polar-express"):
        iteration_coefficients("cubic", 5)


@pytest.mark.parametrize(
    ("overrides", "flag"),
    [
        ({"momentum": 1.0}, "--muon-momentum"),
        ({"momentum": -0.1}, "--muon-momentum"),
        ({"ns_steps": 0}, "--muon-ns-steps"),
        ({"coefficients": "cubic"}, "--muon-coefficients"),
        ({"scale": "frobenius"}, "--muon-scale"),
    ],
)
def test_bad_muon_settings_name_the_flag(overrides: dict[str, Any], flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        MuonSettings(lr=0.02, **overrides)


# ---- which parameters Muon trains ----------------------------------------------------------------------------


def hf_model(kind: str) -> nn.Module:
    pytest.importorskip("transformers")
    from hf_models import hf_config

    from bigbatch.models import HFConfig
    from bigbatch.models.hf.model import build_hf_model

    torch.manual_seed(0)
    return build_hf_model(HFConfig("d", hf_config(kind).to_dict()))


PROJECTIONS_LLAMA = {f"self_attn.{p}_proj.weight" for p in "qkvo"} | {
    f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")
}
PROJECTIONS_GPT = {"attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"}
EXPERT_STACKS = {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
SHARED_EXPERT = {f"mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")}
ATTENTION = {f"self_attn.{p}_proj.weight" for p in "qkvo"}

FAMILIES: dict[str, tuple[Callable[[], nn.Module], set[str], set[str]]] = {
    # name: (model, the per-block parameters Muon trains, per-block >= 2-D parameters it must not)
    "gpt": (lambda: tiny_gpt(), PROJECTIONS_GPT, set()),
    "llama": (lambda: build_model(model_preset("llama-pico", vocab_size=64)), PROJECTIONS_LLAMA, set()),
    "moe": (
        lambda: MoE(moe_preset("moe-pico", vocab_size=64, shared_ffn_hidden=8)),
        ATTENTION | EXPERT_STACKS | SHARED_EXPERT,
        {"mlp.gate.weight", "mlp.shared_expert_gate.weight"},
    ),
    "hf:gpt2": (lambda: hf_model("gpt2"), PROJECTIONS_GPT, set()),  # transformers' Conv1D: (in, out), still 2-D
    "hf:llama": (lambda: hf_model("llama"), PROJECTIONS_LLAMA, set()),
    "hf:mixtral": (lambda: hf_model("mixtral"), ATTENTION | EXPERT_STACKS, {"mlp.gate.weight"}),
    "hf:qwen2_moe": (
        lambda: hf_model("qwen2_moe"),
        ATTENTION | EXPERT_STACKS | SHARED_EXPERT,
        {"mlp.gate.weight", "mlp.shared_expert_gate.weight"},
    ),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_muon_trains_the_hidden_matrices_of_every_family(family: str) -> None:
    build, expected, excluded = FAMILIES[family]
    model: Any = build()  # every family has blocks()
    blocks = model.blocks()
    n_layer = len(blocks)
    assert n_layer == 2
    names = {id(p): name for name, p in model.named_parameters()}
    in_blocks = {id(p): f"{i}.{name}" for i, block in enumerate(blocks) for name, p in block.named_parameters()}
    chosen = muon_parameters(model)
    assert len({id(p) for _, p in chosen}) == len(chosen)  # each once
    for label, param in chosen:
        assert id(param) in in_blocks and label == in_blocks[id(param)], label  # named by block index and path
        assert param.dim() >= 2 and min(param.shape) > 1 and param.requires_grad, label
    assert {label for label, _ in chosen} == {f"{i}.{name}" for i in range(n_layer) for name in expected}
    if family in ("moe", "hf:mixtral", "hf:qwen2_moe"):
        assert any(param.dim() == 3 for _, param in chosen)  # the expert stacks (E, m, n)
    # Never chosen: embeddings, position tables, the head, every norm's gain, every bias, the routers.
    chosen_ids = {id(p) for _, p in chosen}
    never = set()
    for module in model.modules():
        if isinstance(module, nn.Embedding) or "norm" in type(module).__name__.lower():
            never |= {id(p) for p in module.parameters(recurse=False)}
    never |= {id(p) for name, p in model.named_parameters() if name.endswith("bias") or p.dim() < 2}
    never |= {id(p) for name, p in model.named_parameters() if name.split(".")[-2] in ("lm_head", "wpe", "wte")}
    never |= {id(p) for i, block in enumerate(blocks) for name, p in block.named_parameters() if name in excluded}
    assert never and not never & chosen_ids, sorted(names[i] for i in never & chosen_ids)
    # What is left for AdamW: everything else, exactly once.
    optimizer = build_muon(model, MuonSettings(lr=0.02), lr=1e-3)
    groups = [{id(p) for p in g["params"]} for g in optimizer.param_groups]
    assert groups[0] == chosen_ids and optimizer.param_groups[0]["muon"]
    assert sum(len(g) for g in groups) == len(names) == len(set().union(*groups))


def test_a_projection_as_wide_as_the_expert_count_is_not_a_router() -> None:
    """Routers are found by name (a path part gate/router, or *_gate/*_router), never by width: k_proj and v_proj
    of a 16-expert model are 16 wide, and LoRA's automatic targets keep them too."""
    from bigbatch.models.lora import auto_targets

    torch.manual_seed(0)
    model = MoE(moe_preset("moe-pico", vocab_size=64, n_expert=16))  # k_proj and v_proj: (16, 32)
    chosen = {label.split(".", 1)[1] for label, _ in muon_parameters(model)}
    assert ATTENTION <= chosen
    assert not any(label.endswith("mlp.gate.weight") for label in chosen)
    targets = auto_targets(model)  # full names, e.g. model.layers.0.self_attn.k_proj
    for projection in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert any(name.endswith(f"self_attn.{projection}") for name in targets), (projection, targets)
    assert not any(name.endswith("mlp.gate") for name in targets)


def test_the_spectral_scale_reads_a_conv1d_weight_as_out_by_in() -> None:
    """transformers' Conv1D (GPT-2) stores its weight (in, out): sqrt(max(1, out / in)) is read from the module, so
    mlp.c_fc (in 32, out 128 here) gets 2 and mlp.c_proj (in 128, out 32) gets 1, as nn.Linear's would."""
    model = hf_model("gpt2")
    settings = MuonSettings(lr=0.02, momentum=0.0, weight_decay=0.0, scale="spectral")
    optimizer = build_muon(model, settings, lr=1e-3)
    block = model.blocks()[0]
    for module, expected in ((block.mlp.c_fc, 2.0), (block.mlp.c_proj, 1.0)):
        weight = module.weight
        start = weight.detach().clone()
        grad = torch.randn_like(weight)
        for p in model.parameters():
            p.grad = None
        weight.grad = grad
        optimizer.step()
        expected_move = 0.02 * expected * orthogonalise(grad, 5, "quintic")
        torch.testing.assert_close(start - weight.detach(), expected_move, rtol=1e-4, atol=1e-6)


# ---- the AdamW half ------------------------------------------------------------------------------------------


def test_the_adamw_half_equals_torch_adamw() -> None:
    """The non-Muon tensors of a float64 model over three steps of the same gradients: torch's AdamW (the same
    groups: weight decay 0.1 on matrices, none on gains and biases) lands on the same values and moments."""
    ours = tiny_gpt(F64)
    theirs = copy.deepcopy(ours)
    optimizer = build_muon(ours, MuonSettings(lr=0.02), lr=3e-3, weight_decay=0.1, betas=(0.8, 0.9), eps=1e-7)
    muon_ids = {id(p) for g in optimizer.param_groups if g["muon"] for p in g["params"]}
    pairs = [(a, b) for a, b in zip(ours.parameters(), theirs.parameters(), strict=True) if id(a) not in muon_ids]
    reference = torch.optim.AdamW(
        [
            {"params": [b for a, b in pairs if a.dim() >= 2], "weight_decay": 0.1},
            {"params": [b for a, b in pairs if a.dim() < 2], "weight_decay": 0.0},
        ],
        lr=3e-3,
        betas=(0.8, 0.9),
        eps=1e-7,
        foreach=False,
    )
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
            a.grad = torch.randn(a.shape, generator=gen, dtype=F64)
            b.grad = a.grad.clone()
        optimizer.step()
        reference.step()
    for a, b in pairs:
        torch.testing.assert_close(a, b, rtol=1e-14, atol=1e-16)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(optimizer.state[a][key], reference.state[b][key], rtol=1e-14, atol=1e-18)
        assert float(optimizer.state[a]["step"]) == float(reference.state[b]["step"]) == 3.0


# ---- exact under accumulation, one orthogonalisation per matrix and step -------------------------------------


def float64_loss(model: nn.Module, batch: MicroBatch) -> torch.Tensor:
    """The summed next-token loss in the model's dtype. bigbatch's own loss computes the cross-entropy in float32
    whatever the model's dtype (``logits.float()``), which leaves a float64 model's gradient only float32-exact
    (K = 1 and K = 8 then differ by ~1e-8); this keeps float64 throughout."""
    logits = model(batch.inputs)
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)), batch.targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


class Calls:
    """``orthogonalise`` counted: calls in all, and calls made outside ``optimizer.step``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.total = self.outside_step = 0
        self.inside = False
        original = muon_module.orthogonalise

        def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
            self.total += 1
            self.outside_step += not self.inside
            return original(*args, **kwargs)

        monkeypatch.setattr(muon_module, "orthogonalise", counting)

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        def enter(*_: Any) -> None:
            self.inside = True

        def leave(*_: Any) -> None:
            self.inside = False

        optimizer.register_step_pre_hook(enter)
        optimizer.register_step_post_hook(leave)


def train(
    base: GPT, k: int, calls: Calls, loss_fn: Callable[..., torch.Tensor] | None = None
) -> tuple[GPT, list[int], int]:
    """Three Muon + AdamW steps of the same 8 sequences per step, split into ``k`` micro-batches; the model, the
    orthogonalisations of each step and the optimizer's own count."""
    model = copy.deepcopy(base)
    optimizer = build_muon(model, MuonSettings(lr=1e-2), lr=1e-2)
    calls.watch(optimizer)
    engine = AccumulationEngine(model, optimizer, constant_schedule(1e-2), grad_clip=1.0, loss_fn=loss_fn)
    per_step = []
    for step in range(3):
        inputs, targets = random_batch(8, 16, seed=step)
        before = calls.total
        engine.step([MicroBatch(x, y) for x, y in zip(inputs.chunk(k), targets.chunk(k), strict=True)])
        per_step.append(calls.total - before)
    return model, per_step, optimizer.orthogonalisations


def whole_model_rel(a: nn.Module, b: nn.Module, base: nn.Module, skip: Callable[[str], bool]) -> float:
    """Relative L2 distance of two trainings' parameter moves, over every parameter ``skip`` keeps."""
    num = den = 0.0
    with torch.no_grad():
        for (name, p), q, r in zip(a.named_parameters(), b.parameters(), base.parameters(), strict=True):
            if not skip(name):
                num += float((p - q).double().pow(2).sum())
                den += float((p - r).double().pow(2).sum())
    return math.sqrt(num / den)


def test_muon_is_exact_under_accumulation_and_orthogonalises_once_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """8 sequences as one micro-batch or as 8: three steps land on the same parameters (fp32: within 1e-5). Every
    step runs Newton-Schulz once per Muon matrix, whatever K, and never during the forwards and backwards."""
    calls = Calls(monkeypatch)
    base = tiny_gpt()
    matrices = len(muon_parameters(base))
    one, steps_one, count_one = train(base, 1, calls)
    eight, steps_eight, count_eight = train(base, 8, calls)
    assert steps_one == steps_eight == [matrices] * 3
    assert count_one == count_eight == 3 * matrices
    assert calls.outside_step == 0
    # The key slice of each attention's c_attn.bias has an exact gradient of zero (a constant added to every score
    # of a query leaves the softmax unchanged): its fp32 gradient is rounding noise that AdamW divides by its own
    # size (up to eps), a move of ~lr either way. It is held to an absolute bound, everything else to 1e-5.
    c = base.config.n_embd
    biases = [
        (name, p, q)
        for (name, p), q in zip(one.named_parameters(), eight.parameters(), strict=True)
        if name.endswith("attn.c_attn.bias")
    ]
    assert len(biases) == 2
    for name, p, q in biases:
        # each can move ~lr (1e-2) either way per step on noise alone: bounded, not exact (observed ~3e-5)
        assert (p[c : 2 * c] - q[c : 2 * c]).abs().max().item() <= 0.1, name
        with torch.no_grad():
            p[c : 2 * c] = q[c : 2 * c]  # leave it out of the relative distance below
    assert whole_model_rel(one, eight, base, lambda name: False) <= 1e-5
    muon_names = {f"transformer.h.{label}" for label, _ in muon_parameters(base)}
    assert whole_model_rel(one, eight, base, lambda name: name not in muon_names) <= 1e-5


def test_muon_is_exact_to_float64_rounding_under_accumulation(monkeypatch: pytest.MonkeyPatch) -> None:
    """In float64 with a float64 loss the two splits agree to rounding: the Muon matrices to 1e-11 each (observed
    ~1e-14), the whole model to 1e-10 (observed ~4e-15). The whole model's bar is looser because the key slices of
    c_attn.bias have an exact gradient of zero: AdamW moves them by ~lr x noise / (|noise| + eps), which in float64
    (noise ~1e-17, far below eps) stays ~1e-11 but is not rounding-sized. (With bigbatch's own loss, whose
    cross-entropy is float32 whatever the model's dtype, the splits differ by ~1e-8 everywhere: that is the loss's
    float32, not Muon.)"""
    calls = Calls(monkeypatch)
    base = tiny_gpt(F64)
    one, _, _ = train(base, 1, calls, float64_loss)
    eight, _, _ = train(base, 8, calls, float64_loss)
    muon_names = {f"transformer.h.{label}" for label, _ in muon_parameters(base)}
    assert len(muon_names) == 8
    for (name, p), q, r in zip(one.named_parameters(), eight.parameters(), base.parameters(), strict=True):
        if name in muon_names:
            assert ((p - q).norm() / (p - r).norm()).item() <= 1e-11, name
    assert whole_model_rel(one, eight, base, lambda name: False) <= 1e-10
    assert calls.outside_step == 0


# ---- momentum ------------------------------------------------------------------------------------------------


def one_matrix_optimizer(
    weight: nn.Parameter, lr: float, momentum: float, weight_decay: float, scale: str = "rms"
) -> MuonAdamW:
    settings = MuonSettings(lr=lr, momentum=momentum, weight_decay=weight_decay, scale=scale)
    group = {"params": [weight], "muon": True, "lr": lr, "weight_decay": weight_decay, "momentum": momentum}
    return MuonAdamW([group], muon=settings, lr=lr)


def test_the_momentum_is_an_average_and_the_update_is_nesterov(monkeypatch: pytest.MonkeyPatch) -> None:
    """buffer <- m buffer + (1 - m) grad (weights summing to one), and Newton-Schulz sees grad + m (buffer - grad),
    the gradient pulled toward where the momentum goes."""
    m = 0.9
    gen = torch.Generator().manual_seed(0)
    weight = nn.Parameter(torch.randn(12, 20, generator=gen, dtype=F64))
    optimizer = one_matrix_optimizer(weight, lr=1e-2, momentum=m, weight_decay=0.0)
    seen: list[torch.Tensor] = []
    original = muon_module.orthogonalise

    def recording(matrix: torch.Tensor, *args: Any) -> torch.Tensor:
        seen.append(matrix.clone())
        return original(matrix, *args)

    monkeypatch.setattr(muon_module, "orthogonalise", recording)
    g1, g2 = torch.randn(2, 12, 20, generator=gen, dtype=F64)
    weight.grad = g1.clone()
    optimizer.step()
    buffer = optimizer.state[weight]["momentum_buffer"]
    torch.testing.assert_close(buffer, (1 - m) * g1, rtol=1e-14, atol=1e-16)
    torch.testing.assert_close(seen[0], (1 - m) * g1 + m * (1 - m) * g1, rtol=1e-14, atol=1e-16)
    weight.grad = g2.clone()
    optimizer.step()
    expected = m * (1 - m) * g1 + (1 - m) * g2
    torch.testing.assert_close(buffer, expected, rtol=1e-14, atol=1e-16)
    torch.testing.assert_close(seen[1], (1 - m) * g2 + m * expected, rtol=1e-14, atol=1e-16)


@pytest.mark.parametrize("scale", ["rms", "spectral"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_without_momentum_the_move_is_the_scaled_orthogonalised_gradient(scale: str, weight_decay: float) -> None:
    """Momentum 0: w <- w (1 - lr wd) - lr x scale x orthogonalise(grad) (the decay decoupled from the gradient)."""
    gen = torch.Generator().manual_seed(1)
    lr = 0.02
    for shape in ((12, 20), (20, 12)):
        start = torch.randn(shape, generator=gen, dtype=F64)
        weight = nn.Parameter(start.clone())
        optimizer = one_matrix_optimizer(weight, lr=lr, momentum=0.0, weight_decay=weight_decay, scale=scale)
        grad = torch.randn(shape, generator=gen, dtype=F64)
        weight.grad = grad.clone()
        optimizer.step()
        expected = start * (1 - lr * weight_decay) - lr * update_scale(shape, scale) * orthogonalise(grad, 5, "quintic")
        torch.testing.assert_close(weight.detach(), expected, rtol=1e-14, atol=1e-15)
        assert optimizer.orthogonalisations == 1


# ---- the batch-change follower -------------------------------------------------------------------------------


def test_the_momentum_follows_a_batch_change_in_tokens() -> None:
    base = OptimSettings(lr=1e-3, beta1=0.9, beta2=0.95, weight_decay=0.1, momentum=0.95)
    assert BatchChangeRule("sqrt", "beta2", "keep", "tokens").follow(base, 4.0).momentum == pytest.approx(0.95**4)
    assert BatchChangeRule("sqrt", "beta2", "keep", "tokens").follow(base, 0.25).momentum == pytest.approx(0.95**0.25)
    assert BatchChangeRule("sqrt", "beta2", "keep", "keep").follow(base, 4.0).momentum == 0.95
    assert BatchChangeRule.resolve("none").momentum == "keep"
    assert BatchChangeRule.resolve("auto").momentum == "tokens"
    assert not BatchChangeRule.resolve("none").changes_anything
    with pytest.raises(ConfigError, match="--batch-change-momentum"):
        BatchChangeRule("sqrt", "beta2", "keep", "halve")
    adamw = OptimSettings(lr=1e-3, beta1=0.9, beta2=0.95, weight_decay=0.1)
    assert BatchChangeRule("sqrt", "beta2", "keep", "tokens").follow(adamw, 4.0).momentum is None

    def change(before: OptimSettings) -> BatchChange:
        after = BatchChangeRule("sqrt", "beta2", "keep", "tokens").follow(before, 4.0)
        return BatchChange(3, 1024, 256, 1024, before, after, "batch ramp")

    record = change(adamw).record()
    assert not [key for key in record if "momentum" in key]
    assert "Muon momentum" not in change(adamw).line()
    muon = change(base).record()
    assert muon["momentum_before"] == 0.95 and muon["momentum_after"] == pytest.approx(0.95**4)
    assert "Muon momentum 0.95 -> 0.81451" in change(base).line()


def test_the_engine_sets_each_groups_momentum_betas_and_lr_from_the_follower() -> None:
    model = tiny_gpt()
    optimizer = build_muon(model, MuonSettings(lr=0.02, momentum=0.95), lr=1e-3)
    base = OptimSettings(lr=1e-3, beta1=0.9, beta2=0.95, weight_decay=0.1, momentum=0.95)
    follower = BatchFollower(BatchChangeRule.resolve("auto"), base, reference_tokens=256)
    follower.last_tokens = 1024  # the next step is 4x the reference
    AccumulationEngine(model, optimizer, constant_schedule(1e-3), follower=follower)
    muon, *adamw = optimizer.param_groups
    assert muon["muon"] and muon["momentum"] == pytest.approx(0.95**4)
    assert muon["lr"] == pytest.approx(0.02 * 2.0, rel=1e-12)  # sqrt(4) x the Muon rate
    for group in adamw:
        assert group["lr"] == pytest.approx(1e-3 * 2.0, rel=1e-12)
        assert group["betas"] == (0.9, pytest.approx(0.95**4))


# ---- learning rates ------------------------------------------------------------------------------------------


def test_the_muon_groups_rate_is_the_schedules_times_its_scale() -> None:
    model = tiny_gpt()
    schedule = CosineSchedule(max_lr=1e-3, min_lr=1e-4, warmup_steps=4, decay_steps=10)
    optimizer = build_muon(model, MuonSettings(lr=0.02), lr=1e-3)
    engine = AccumulationEngine(model, optimizer, schedule)
    muon, *adamw = optimizer.param_groups
    assert muon["lr_scale"] == pytest.approx(20.0)
    assert muon["lr"] == pytest.approx(0.02 * schedule(0) / 1e-3, rel=1e-12)
    assert all(group["lr"] == schedule(0) for group in adamw)
    inputs, targets = random_batch(2, 16)
    engine.step([MicroBatch(inputs, targets)])
    assert muon["lr"] == pytest.approx(0.02 * schedule(1) / 1e-3, rel=1e-12)
    assert all(group["lr"] == schedule(1) for group in adamw)


# ---- state ---------------------------------------------------------------------------------------------------


def test_the_state_exists_from_construction_and_checkpoints_the_same_keys() -> None:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = tiny_gpt()
    optimizer = build_muon(model, MuonSettings(lr=0.02), lr=1e-3)
    muon_ids = {id(p) for _, p in muon_parameters(model)}
    for param in model.parameters():
        state = optimizer.state[param]
        if id(param) in muon_ids:
            assert set(state) == {"momentum_buffer"}
            assert state["momentum_buffer"].shape == param.shape and not state["momentum_buffer"].any()
        else:
            assert set(state) == {"step", "exp_avg", "exp_avg_sq"} and float(state["step"]) == 0.0
    before = [p.detach().clone() for p in model.parameters()]
    fresh = get_optimizer_state_dict(model, optimizer)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))  # no initialising step

    def keys(saved: dict[str, Any]) -> tuple[Any, ...]:
        return (
            sorted((name, tuple(sorted(value))) for name, value in saved["state"].items()),
            [sorted(group) for group in saved["param_groups"]],
        )

    inputs, targets = random_batch(2, 16)
    AccumulationEngine(model, optimizer, constant_schedule(1e-3)).step([MicroBatch(inputs, targets)])
    stepped = get_optimizer_state_dict(model, optimizer)
    assert keys(fresh) == keys(stepped)
    assert len(fresh["state"]) == len(list(model.parameters()))
    saved = copy.deepcopy(optimizer.state_dict())
    optimizer.load_state_dict(saved)
    for param in model.parameters():
        for key, value in optimizer.state[param].items():
            if key != "step":
                assert value.dtype == torch.float32, key
    buffers = [optimizer.state[p]["momentum_buffer"] for p in model.parameters() if id(p) in muon_ids]
    assert buffers and all(b.any() for b in buffers)  # the round trip kept the values, not fresh zeros
    for index, state in saved["state"].items():
        for key, value in state.items():
            assert torch.equal(optimizer.state_dict()["state"][index][key], value), (index, key)


# ---- fused weights, embeddings in blocks, loaded checkpoints, weight decay at a batch change -----------------


def test_a_fused_weight_is_orthogonalised_part_by_part() -> None:
    """GPT's c_attn holds q, k and v (three equal parts of its rows), an MoE's gate_up_proj gate and up (two halves
    of its rows per expert), transformers' Conv1D c_attn q, k and v side by side (stored (in, out)): each part is
    orthogonalised on its own, as separate q, k and v weights would be (nanochat's), scaled by its own shape."""
    gen = torch.Generator().manual_seed(3)
    layouts = {
        "gpt c_attn": (MatrixLayout(3, -2), (96, 32), [slice(0, 32), slice(32, 64), slice(64, 96)], -2),
        "conv1d c_attn": (
            MatrixLayout(3, -1, transposed=True),
            (32, 96),
            [slice(0, 32), slice(32, 64), slice(64, 96)],
            -1,
        ),
        "gate_up": (MatrixLayout(2, -2), (4, 24, 16), [slice(0, 12), slice(12, 24)], -2),
    }
    for name, (layout, shape, parts, dim) in layouts.items():
        x = torch.randn(shape, generator=gen, dtype=F64)
        whole = layout.join(orthogonalise(layout.split(x), 5, "quintic"))
        for part in parts:
            index = (..., part, slice(None)) if dim == -2 else (..., part)
            torch.testing.assert_close(whole[index], orthogonalise(x[index], 5, "quintic"), msg=name)
    assert MatrixLayout(3, -2).matrix_shape((96, 32)) == (32, 32)
    assert MatrixLayout(3, -1, transposed=True).matrix_shape((32, 96)) == (32, 32)
    assert MatrixLayout(2, -2).matrix_shape((4, 24, 16)) == (12, 16)
    assert MatrixLayout(transposed=True).matrix_shape((32, 128)) == (128, 32)


def test_the_families_fused_weights_are_found_by_role() -> None:
    gpt = {name.split(".", 1)[1]: layout for name, _, layout in muon_matrices(tiny_gpt())}
    assert gpt["attn.c_attn.weight"] == MatrixLayout(3, -2) and gpt["mlp.c_fc.weight"] == MatrixLayout()
    moe = {
        name.split(".", 1)[1]: layout for name, _, layout in muon_matrices(MoE(moe_preset("moe-pico", vocab_size=64)))
    }
    assert moe["mlp.experts.gate_up_proj"] == MatrixLayout(2, -2) and moe["mlp.experts.down_proj"] == MatrixLayout()
    hf_gpt2 = {name.split(".", 1)[1]: layout for name, _, layout in muon_matrices(hf_model("gpt2"))}
    assert hf_gpt2["attn.c_attn.weight"] == MatrixLayout(3, -1, transposed=True)
    assert hf_gpt2["mlp.c_fc.weight"] == MatrixLayout(transposed=True)
    mixtral = {name.split(".", 1)[1]: layout for name, _, layout in muon_matrices(hf_model("mixtral"))}
    assert mixtral["mlp.experts.gate_up_proj"] == MatrixLayout(2, -2)
    # gpt-oss stores (E, in, 2F) with gate and up interleaved: not two halves of its rows, so kept whole
    odd = nn.Linear(8, 8)
    assert hf_matrix_layout(odd, "mlp.experts", "gate_up_proj", torch.empty(4, 16, 20), {10}) == MatrixLayout()


def test_the_update_of_gpt_c_attn_is_the_three_parts_own() -> None:
    """One Muon step with momentum 0: c_attn moves by each of q, k, v's own orthogonalised gradient, x 0.2 sqrt(32)."""
    model = tiny_gpt(F64)
    optimizer = build_muon(model, MuonSettings(lr=0.02, momentum=0.0, weight_decay=0.0), lr=1e-3, weight_decay=0.0)
    weight = model.transformer.h[0].attn.c_attn.weight  # (96, 32)
    start = weight.detach().clone()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    grad = torch.randn_like(weight)
    weight.grad = grad
    optimizer.step()
    expected = torch.cat([orthogonalise(g, 5, "quintic") for g in grad.split(32)]) * 0.2 * math.sqrt(32) * 0.02
    torch.testing.assert_close(start - weight.detach(), expected, rtol=1e-10, atol=1e-12)


def test_an_embedding_inside_a_block_is_left_to_adamw() -> None:
    model = tiny_gpt()
    model.transformer.h[0].extra = nn.Embedding(10, 8)  # a per-layer table (some hf: models have one)
    chosen = {id(p) for _, p in muon_parameters(model)}
    assert id(model.transformer.h[0].extra.weight) not in chosen


def test_a_loaded_checkpoint_keeps_the_optimizer_s_configured_settings() -> None:
    """The state (momentum, moments) comes back; lr_scale, ns_steps, coefficients and scale stay as built: a run
    or branch with other Muon settings is not silently given the saved ones."""
    saved_model = tiny_gpt()
    saved = build_muon(saved_model, MuonSettings(lr=0.02, ns_steps=5), lr=1e-3)
    for p in saved_model.parameters():
        p.grad = torch.randn_like(p)
    saved.step()
    model = copy.deepcopy(saved_model)
    fresh = build_muon(
        model, MuonSettings(lr=0.05, ns_steps=7, coefficients="polar-express", scale="spectral"), lr=1e-3
    )
    state = saved.state_dict()
    fresh.load_state_dict(state)
    group = fresh.param_groups[0]
    assert (group["lr_scale"], group["ns_steps"], group["coefficients"], group["scale"]) == (
        pytest.approx(50.0),
        7,
        "polar-express",
        "spectral",
    )
    key = next(iter(fresh.state))
    assert torch.equal(fresh.state[key]["momentum_buffer"], saved.state[next(iter(saved.state))]["momentum_buffer"])


def test_muon_s_weight_decay_follows_the_timescale_rule_when_adamw_has_none() -> None:
    """nanochat's setting: AdamW's weight decay 0, Muon's 0.1. At 4x the reference tokens with sqrt and timescale,
    every group's decay is multiplied by r / sqrt(r) = 2, Muon's included."""
    model = tiny_gpt()
    optimizer = build_muon(model, MuonSettings(lr=1e-3, weight_decay=0.1), lr=1e-3, weight_decay=0.0)
    rule = BatchChangeRule("sqrt", "beta2", "timescale")
    follower = BatchFollower(rule, OptimSettings(1e-3, 0.9, 0.95, 0.0, 0.95), reference_tokens=1024)
    follower.last_tokens = 4096
    engine = AccumulationEngine(model, optimizer, constant_schedule(1e-3), follower=follower)
    assert engine.optimizer.param_groups[0]["weight_decay"] == pytest.approx(0.2)
    assert engine.optimizer.param_groups[0]["momentum"] == pytest.approx(0.95**4)
    assert all(group["weight_decay"] == 0.0 for group in engine.optimizer.param_groups[1:])


def test_the_critical_batch_label_names_a_momentum_rule_that_is_not_auto_s() -> None:
    assert BatchChangeRule("sqrt", "beta2").label() == "sqrt-beta2"
    assert BatchChangeRule("sqrt", "beta2", "keep", "keep").label() == "sqrt-beta2-momentum-keep"
    assert BatchChangeRule("none", "none").label() == "none"
    assert BatchChangeRule.resolve("auto") == BatchChangeRule("sqrt", "beta2")


def test_a_batch_change_says_and_records_muon_s_own_rate_decay_and_momentum() -> None:
    base = OptimSettings(1e-3, 0.9, 0.95, 0.0, momentum=0.95, muon_lr=0.02, muon_weight_decay=0.1)
    follower = BatchFollower(BatchChangeRule("sqrt", "beta2", "timescale"), base, reference_tokens=1024)
    change = follower.change(step=5, tokens_seen=4096, lr=1e-3, tokens_per_step=4096, cause="batch ramp")
    assert change is not None
    record = change.record()
    assert record["muon_lr_before"] == pytest.approx(0.02) and record["muon_lr_after"] == pytest.approx(0.04)
    assert record["muon_weight_decay_after"] == pytest.approx(0.2) and record["momentum_after"] == pytest.approx(
        0.95**4
    )
    line = change.line()
    assert "Muon lr 2.000e-02 -> 4.000e-02" in line and "Muon weight decay 0.1 -> 0.2" in line
    # at half the schedule's peak, Muon's rate is half its own peak
    assert follower.settings(5e-4, 1024).muon_lr == pytest.approx(0.01)


def test_a_step_record_carries_the_muon_rate_beside_adamw_s() -> None:
    model = tiny_gpt()
    optimizer = build_muon(model, MuonSettings(lr=0.02), lr=1e-3)
    engine = AccumulationEngine(model, optimizer, constant_schedule(1e-3))
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (2, 17), generator=gen)
    record = engine.step([MicroBatch(tokens[:, :-1], tokens[:, 1:])])
    assert record.lr == pytest.approx(1e-3) and record.muon_lr == pytest.approx(0.02)
    from bigbatch.observe.metrics import format_step
    from bigbatch.observe.scalars import step_values

    assert step_values(record)["muon_lr"] == pytest.approx(0.02)
    assert "| muon lr 2.0e-02" in format_step(record)


def test_a_resume_refusal_names_auto_as_auto() -> None:
    from bigbatch.run.configuration.identity import settings_diff
    from bigbatch.run.configuration.train_config import TrainConfig

    saved, now = TrainConfig(), TrainConfig()
    saved.optim.optimizer = now.optim.optimizer = "muon"
    now.optim.muon_lr = 0.002
    assert settings_diff(saved.to_dict(), now) == ["optim.muon_lr 'auto' -> 0.002"]


def test_the_header_names_the_kinds_of_fused_weights_it_splits() -> None:
    gpt = build_muon(tiny_gpt(), MuonSettings(lr=0.02), lr=1e-3).describe()
    assert "2 of them fused weights orthogonalised per part (q, k, v)" in gpt
    moe = build_muon(MoE(moe_preset("moe-pico", vocab_size=64)), MuonSettings(lr=0.02), lr=1e-3).describe()
    assert "fused weights orthogonalised per part (gate, up)" in moe
