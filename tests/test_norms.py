"""Each norm against torch.nn's reference module, and against hand computations."""

import math

import pytest
import torch
from torch import nn

from normlab.config import NormConfig
from normlab.nn.norms import BatchNorm, CausalBatchNorm, DyT, L2Norm, LayerNorm, RMSNorm, ScaleNorm, build_norm, is_norm


def _randomize(module: nn.Module, gen: torch.Generator) -> None:
    """Non-trivial gains and shifts, so a wrong use of them would show."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))


@pytest.mark.parametrize("weight,bias", [(True, True), (True, False), (False, False)])
def test_layer_norm_matches_torch(weight, bias):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 7, 16, generator=gen) * 3 + 1
    ours = LayerNorm(16, eps=1e-5, weight=weight, bias=bias)
    ref = nn.LayerNorm(16, eps=1e-5, elementwise_affine=weight, bias=bias)
    _randomize(ours, torch.Generator().manual_seed(1))
    _randomize(ref, torch.Generator().manual_seed(1))
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-5)


def test_layer_norm_of_1234():
    y = LayerNorm(4)(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
    torch.testing.assert_close(y, torch.tensor([[-1.3416, -0.4472, 0.4472, 1.3416]]), rtol=0, atol=1e-4)


@pytest.mark.parametrize("weight", [True, False])
def test_rms_norm_matches_torch(weight):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 7, 16, generator=gen) * 3 + 1
    ours = RMSNorm(16, eps=1e-6, weight=weight)
    ref = nn.RMSNorm(16, eps=1e-6, elementwise_affine=weight)
    _randomize(ours, torch.Generator().manual_seed(1))
    _randomize(ref, torch.Generator().manual_seed(1))
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-5)
    by_hand = x / torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-6)
    if weight:
        by_hand = by_hand * ours.weight
    torch.testing.assert_close(ours(x), by_hand, rtol=1e-5, atol=1e-5)


def test_rms_norm_computes_in_float32_under_bf16():
    x = (torch.randn(2, 3, 64) * 50).to(torch.bfloat16)
    y = RMSNorm(64)(x)
    assert y.dtype == torch.bfloat16
    expected = nn.RMSNorm(64, eps=1e-5)(x.float()).to(torch.bfloat16)
    assert torch.equal(y, expected)


def test_batch_norm_matches_torch_in_train_and_eval():
    gen = torch.Generator().manual_seed(0)
    ours = BatchNorm(16, eps=1e-5, momentum=0.1)
    ref = nn.BatchNorm1d(16, eps=1e-5, momentum=0.1)
    _randomize(ours, torch.Generator().manual_seed(1))
    _randomize(ref, torch.Generator().manual_seed(1))
    for _ in range(3):
        x = torch.randn(4, 7, 16, generator=gen) * 2 + 0.5
        # statistics per feature over batch × time = BatchNorm1d over the (B·T, C) matrix
        torch.testing.assert_close(ours(x), ref(x.reshape(-1, 16)).reshape(x.shape), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.running_mean, ref.running_mean)
    torch.testing.assert_close(ours.running_var, ref.running_var)
    ours.eval(), ref.eval()
    x = torch.randn(2, 5, 16, generator=gen)
    torch.testing.assert_close(ours(x), ref(x.reshape(-1, 16)).reshape(x.shape), rtol=1e-5, atol=1e-5)


def test_batch_norm_statistics_span_batch_and_time():
    bn = BatchNorm(3, weight=False, bias=False)
    x = torch.randn(4, 6, 3) * 5 + 2
    y = bn(x)
    flat = y.reshape(-1, 3)
    torch.testing.assert_close(flat.mean(0), torch.zeros(3), atol=1e-5, rtol=0)
    torch.testing.assert_close(flat.var(0, unbiased=False), torch.ones(3), atol=1e-3, rtol=0)


def test_build_norm_none_is_identity_and_knobs_apply():
    assert isinstance(build_norm(NormConfig(name="none"), 8), nn.Identity)
    ln = build_norm(NormConfig(name="layer", eps=1e-3, weight=True, bias=False), 8)
    assert isinstance(ln, LayerNorm) and ln.bias is None and ln.eps == 1e-3
    rms = build_norm(NormConfig(name="rms", weight=False), 8)
    assert isinstance(rms, RMSNorm) and list(rms.parameters()) == []
    bn = build_norm(NormConfig(name="batch", momentum=0.3), 8)
    assert isinstance(bn, BatchNorm) and bn.momentum == 0.3


# ---------------------------------------------------------------- DyT, ScaleNorm, L2


@pytest.mark.parametrize("weight,bias", [(True, True), (True, False), (False, True), (False, False)])
def test_dyt_is_gamma_tanh_alpha_x_plus_beta(weight, bias):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 8, generator=gen) * 4
    dyt = DyT(8, alpha=0.5, weight=weight, bias=bias)
    _randomize(dyt, torch.Generator().manual_seed(1))
    a = dyt.alpha.item()
    assert a != 0.5  # randomized, so a formula ignoring α would fail
    by_hand = torch.tanh(a * x)
    if weight:
        by_hand = by_hand * dyt.weight
    if bias:
        by_hand = by_hand + dyt.bias
    torch.testing.assert_close(dyt(x), by_hand, rtol=1e-6, atol=1e-6)


def test_dyt_parameters_and_defaults():
    dyt = DyT(6, alpha=0.8)
    params = dict(dyt.named_parameters())
    assert set(params) == {"alpha", "weight", "bias"}
    assert params["alpha"].dim() == 0 and params["alpha"].item() == pytest.approx(0.8)
    assert torch.equal(params["weight"], torch.ones(6)) and torch.equal(params["bias"], torch.zeros(6))
    x = torch.tensor([[0.0, 1.0, -1.0, 2.0, 10.0, -10.0]])
    expected = torch.tanh(0.8 * x)  # γ = 1, β = 0 at init
    torch.testing.assert_close(dyt(x), expected)
    dyt(x).sum().backward()
    assert dyt.alpha.grad is not None and dyt.alpha.grad.item() != 0  # α is learnable


def test_scale_norm_is_g_x_over_its_length():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 7, 16, generator=gen) * 3 + 1
    sn = ScaleNorm(16)
    params = dict(sn.named_parameters())
    assert set(params) == {"g"} and params["g"].dim() == 0
    assert params["g"].item() == pytest.approx(4.0)  # g₀ = sqrt(d) = sqrt(16)
    with torch.no_grad():
        sn.g.fill_(2.5)
    by_hand = 2.5 * x / torch.sqrt((x**2).sum(-1, keepdim=True))
    torch.testing.assert_close(sn(x), by_hand, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sn(x).norm(dim=-1), torch.full((4, 7), 2.5), rtol=1e-5, atol=1e-5)


def test_scale_and_l2_floor_the_length_at_eps():
    tiny = torch.tensor([[3e-7, 4e-7]])  # length 5e-7 < eps
    torch.testing.assert_close(L2Norm(2, eps=1e-5)(tiny), tiny / 1e-5)
    torch.testing.assert_close(ScaleNorm(2, eps=1e-5)(tiny), math.sqrt(2) * tiny / 1e-5)
    assert torch.equal(L2Norm(2)(torch.zeros(1, 2)), torch.zeros(1, 2))


def test_l2_norm_gives_unit_length_and_has_no_parameters():
    x = torch.tensor([[3.0, 4.0], [-6.0, 8.0]])
    l2 = L2Norm(2)
    assert list(l2.parameters()) == []
    torch.testing.assert_close(l2(x), torch.tensor([[0.6, 0.8], [-0.6, 0.8]]))


@pytest.mark.parametrize("module", [DyT(64), ScaleNorm(64), L2Norm(64)], ids=["dyt", "scale", "l2"])
def test_new_norms_compute_in_float32_under_bf16(module):
    x = (torch.randn(2, 3, 64) * 50).to(torch.bfloat16)
    y = module(x)
    assert y.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.equal(y, module(x.float()).to(torch.bfloat16))


# ---------------------------------------------------------------- causal BatchNorm


def test_causal_batch_norm_uses_per_position_statistics_over_the_batch():
    gen = torch.Generator().manual_seed(0)
    bn = CausalBatchNorm(4, positions=8, eps=1e-5, momentum=0.1)
    _randomize(bn, torch.Generator().manual_seed(1))
    x = torch.randn(5, 6, 4, generator=gen) * 3 + 1
    mean = x.mean(0, keepdim=True)  # (1, T, d): over the batch at each position
    var = x.var(0, unbiased=False, keepdim=True)
    by_hand = (x - mean) / torch.sqrt(var + 1e-5) * bn.weight + bn.bias
    torch.testing.assert_close(bn(x), by_hand, rtol=1e-5, atol=1e-5)
    # running statistics: torch's update rule, per position; rows beyond T untouched
    torch.testing.assert_close(bn.running_mean[:6], 0.1 * mean[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bn.running_var[:6], 0.9 + 0.1 * x.var(0, unbiased=True), rtol=1e-5, atol=1e-6)
    assert torch.equal(bn.running_mean[6:], torch.zeros(2, 4)) and torch.equal(bn.running_var[6:], torch.ones(2, 4))
    assert bn.num_batches_tracked.item() == 1


def test_causal_batch_norm_matches_torch_batch_norm_at_each_position():
    gen = torch.Generator().manual_seed(0)
    ours = CausalBatchNorm(4, positions=3, momentum=0.2)
    refs = [nn.BatchNorm1d(4, momentum=0.2) for _ in range(3)]
    _randomize(ours, torch.Generator().manual_seed(1))
    for ref in refs:
        _randomize(ref, torch.Generator().manual_seed(1))
    for _ in range(3):
        x = torch.randn(6, 3, 4, generator=gen) * 2 + 0.5
        expected = torch.stack([refs[t](x[:, t]) for t in range(3)], dim=1)
        torch.testing.assert_close(ours(x), expected, rtol=1e-5, atol=1e-5)
    ours.eval()
    for ref in refs:
        ref.eval()
    x = torch.randn(2, 3, 4, generator=gen)
    expected = torch.stack([refs[t](x[:, t]) for t in range(3)], dim=1)
    torch.testing.assert_close(ours(x), expected, rtol=1e-5, atol=1e-5)


def test_causal_batch_norm_position_t_ignores_later_positions_in_training():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 10, 8, generator=gen)
    changed = x.clone()
    changed[:, 6:] = torch.randn(4, 4, 8, generator=gen) * 5
    causal, plain = CausalBatchNorm(8, positions=10), BatchNorm(8)
    assert torch.equal(causal(x)[:, :6], causal(changed)[:, :6])
    assert not torch.allclose(plain(x)[:, :6], plain(changed)[:, :6])  # batch × time statistics leak


def test_causal_batch_norm_rejects_sequences_longer_than_its_positions():
    with pytest.raises(ValueError, match="exceeds the 4 positions"):
        CausalBatchNorm(2, positions=4)(torch.randn(2, 5, 2))


# ---------------------------------------------------------------- build_norm


def test_build_norm_new_norms_and_knobs():
    dyt = build_norm(NormConfig(name="dyt", weight=False, bias=False), 8)
    assert isinstance(dyt, DyT) and dyt.weight is None and dyt.bias is None
    assert isinstance(build_norm(NormConfig(name="scale"), 8), ScaleNorm)
    assert isinstance(build_norm(NormConfig(name="l2"), 8), L2Norm)
    causal = build_norm(NormConfig(name="batch", causal=True, momentum=0.3), 8, positions=16)
    assert isinstance(causal, CausalBatchNorm) and causal.running_mean.shape == (16, 8) and causal.momentum == 0.3
    with pytest.raises(ValueError, match="positions"):
        build_norm(NormConfig(name="batch", causal=True), 8)
    with pytest.raises(ValueError, match="unknown norm role"):
        build_norm(NormConfig(name="dyt"), 8, role="head")
    assert all(is_norm(m) for m in (dyt, causal, ScaleNorm(2), L2Norm(2)))


def test_build_norm_gives_dyt_its_alpha_by_role():
    cfg = NormConfig(name="dyt", alpha_attn=0.8, alpha_mlp=0.2, alpha_final=0.1)
    alphas = {role: build_norm(cfg, 8, role).alpha.item() for role in ("attn", "mlp", "final")}
    assert alphas == pytest.approx({"attn": 0.8, "mlp": 0.2, "final": 0.1})


def test_rms_norm_of_1234():
    # mean(x²) = 7.5, so y = x / sqrt(7.5 + ε)
    y = RMSNorm(4)(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
    torch.testing.assert_close(y, torch.tensor([[0.3651, 0.7303, 1.0954, 1.4606]]), rtol=0, atol=1e-4)


def test_seeded_torch_example_through_layer_and_rms_norm():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8)
    mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    torch.testing.assert_close(LayerNorm(8)(x), (x - mean) / torch.sqrt(var + 1e-5), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(LayerNorm(8)(x), nn.LayerNorm(8)(x), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(RMSNorm(8)(x), x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(RMSNorm(8)(x), nn.RMSNorm(8, eps=1e-5)(x), rtol=1e-5, atol=1e-6)
