"""Each norm against torch.nn's reference module, and against hand computations."""

import pytest
import torch
from torch import nn

from normlab.config import NormConfig
from normlab.norms import BatchNorm, LayerNorm, RMSNorm, build_norm


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
