"""The GPT: module names, placements, tied head, and causal evaluation for every norm × placement."""

import pytest
import torch
from torch import nn

from conftest import tiny_config
from normlab.config import NORMS, PLACEMENTS
from normlab.model import GPT
from normlab.norms import LayerNorm


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_eval_mode_is_causal(norm, placement):
    torch.manual_seed(0)
    model = GPT(tiny_config(norm, placement))
    if norm == "batch":  # give the running statistics non-trivial values first
        model.train()
        model(torch.randint(0, 256, (8, 16)))
    model.eval()
    idx = torch.randint(0, 256, (3, 16))
    t = 7
    changed = idx.clone()
    changed[:, t + 1 :] = torch.randint(0, 256, (3, 16 - t - 1))
    assert not torch.equal(idx[:, t + 1 :], changed[:, t + 1 :])
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])  # the change did reach later positions


def test_batch_norm_training_mode_sees_the_future():
    """The caveat the README states: in training mode BatchNorm's batch × time statistics leak."""
    torch.manual_seed(0)
    model = GPT(tiny_config("batch", "pre")).train()
    idx = torch.randint(0, 256, (3, 16))
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    with torch.no_grad():
        a, b = model(idx), model(changed)
    assert (a[:, :10] - b[:, :10]).abs().max() > 1e-4


def test_module_names_are_stable_across_arms():
    names = {}
    for norm in NORMS:
        for placement in PLACEMENTS:
            model = GPT(tiny_config(norm, placement))
            names[norm, placement] = {n for n, _ in model.named_modules()}
    first = next(iter(names.values()))
    assert all(n == first for n in names.values())
    for expected in ("blocks.1.attn", "blocks.1.mlp", "blocks.1.norm1", "blocks.1.norm2", "norm_f", "tok_emb"):
        assert expected in first


def test_placements_fill_the_right_slots():
    pre = GPT(tiny_config("layer", "pre"))
    post = GPT(tiny_config("layer", "post"))
    assert isinstance(pre.norm_f, LayerNorm) and isinstance(post.norm_f, nn.Identity)
    assert pre.blocks[0].slots.pre and not pre.blocks[0].slots.post
    assert post.blocks[0].slots.post and not post.blocks[0].slots.pre


def test_post_placement_normalizes_the_residual_stream():
    """Post-LN: each block's output is a LayerNorm output (zero mean, unit variance per token)."""
    model = GPT(tiny_config("layer", "post")).eval()
    for block in model.blocks:
        for norm in (block.norm1, block.norm2):
            nn.init.ones_(norm.weight), nn.init.zeros_(norm.bias)
    x = torch.randn(2, 16, 32)
    y = model.blocks[0](x)
    torch.testing.assert_close(y.mean(-1), torch.zeros(2, 16), atol=1e-5, rtol=0)
    torch.testing.assert_close(y.var(-1, unbiased=False), torch.ones(2, 16), atol=1e-3, rtol=0)


def test_pre_placement_block_by_hand():
    torch.manual_seed(0)
    block = GPT(tiny_config("rms", "pre")).blocks[0]
    x = torch.randn(2, 16, 32)
    h = x + block.attn(block.norm1(x))
    expected = h + block.mlp(block.norm2(h))
    torch.testing.assert_close(block(x), expected)


def test_head_is_tied_and_init_schemes_differ():
    normal = GPT(tiny_config(init="normal"))
    assert normal.head.weight is normal.tok_emb.weight
    proj_std = normal.blocks[0].mlp.proj.weight.std().item()
    fc_std = normal.blocks[0].mlp.fc.weight.std().item()
    assert abs(fc_std - 0.02) < 0.003
    assert abs(proj_std - 0.02 / 2) < 0.002  # 1/sqrt(2·depth) with depth 2
    xavier = GPT(tiny_config(init="xavier"))
    bound = (6 / (32 + 128)) ** 0.5
    w = xavier.blocks[0].mlp.fc.weight
    assert w.abs().max() <= bound and w.abs().max() > 0.9 * bound
    assert torch.count_nonzero(xavier.blocks[0].mlp.fc.bias) == 0
